//! The source files below a directory, for the tests that read the code itself
//! (tests/layers.rs, tests/surface.rs).

use std::path::{Path, PathBuf};

/// Every file below `dir` (recursively) whose extension is `ext`, appended to `out`.
pub fn files_with(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files_with(&p, ext, out);
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

/// Every `.rs` file below `dir`.
pub fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    files_with(dir, "rs", out)
}
