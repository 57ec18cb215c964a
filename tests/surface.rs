//! The public surface stays small (issue "one way to do each thing"): the crate root names
//! at most 25 items and 8 public modules, no public function or method is a variant named
//! by a `_with`, `_remote` or `_location` suffix (what varies is an option of the verb's
//! options struct), no source file holds more than 800 lines, `Checkpoint` has at most 30
//! public methods and every read that skips CRCs says `unchecked` in its name. Read from the source, so
//! that a new export fails here, not in review.

#[path = "common/files.rs"]
mod files;

use std::path::Path;

use files::{files_with, rs_files};

/// The names a `pub use` line list brings into the root (`a::{B, C}` gives B and C).
fn use_names(stmt: &str) -> Vec<String> {
    let body = stmt.trim_start_matches("pub use ").trim_end_matches(';');
    let list = match (body.find('{'), body.rfind('}')) {
        (Some(a), Some(b)) => &body[a + 1..b],
        _ => body.rsplit("::").next().unwrap_or(body),
    };
    list.split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.rsplit(" as ")
                .next()
                .unwrap()
                .rsplit("::")
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn the_root_is_small() {
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs")).unwrap();
    // `pub use` statements may span lines: join each one up to its `;`.
    let mut names = Vec::new();
    let mut modules = Vec::new();
    let mut stmt = String::new();
    for line in lib.lines().map(str::trim) {
        if line.starts_with("pub mod ") {
            modules.push(
                line.trim_start_matches("pub mod ")
                    .trim_end_matches(';')
                    .to_string(),
            );
        }
        if line.starts_with("pub use ") || !stmt.is_empty() {
            stmt.push_str(line);
            stmt.push(' ');
            if line.ends_with(';') {
                names.extend(use_names(stmt.trim()));
                stmt.clear();
            }
        }
    }
    assert!(
        names.len() <= 25,
        "{} root names (at most 25): {names:?}",
        names.len()
    );
    assert!(
        modules.len() <= 8,
        "{} public modules (at most 8): {modules:?}",
        modules.len()
    );
    // The verbs are there, once each.
    for verb in ["open", "save", "write_part", "commit", "discard"] {
        assert_eq!(names.iter().filter(|n| *n == verb).count(), 1, "{verb}");
    }
}

#[test]
fn no_public_function_is_a_suffixed_variant() {
    let mut files = Vec::new();
    rs_files(
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")),
        &mut files,
    );
    let mut found = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let Some(rest) = line.trim_start().strip_prefix("pub fn ") else {
                continue;
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if ["_with", "_remote", "_location"]
                .iter()
                .any(|s| name.ends_with(s))
            {
                found.push(format!("{}:{}: {name}", f.display(), i + 1));
            }
        }
    }
    assert!(found.is_empty(), "suffixed public functions: {found:#?}");
}

#[test]
fn no_source_file_is_over_800_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rs_files(&root.join("src"), &mut files);
    rs_files(&root.join("python/src"), &mut files);
    files_with(&root.join("python/py_src/ckptstore"), "py", &mut files);
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > 800).then(|| format!("{}: {n} lines", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these by job: {long:#?}");
}

/// The public methods of type `ty`: every `pub fn` at 4-space indent inside an
/// `impl ... ty<...>` block of src/, as `(name, doc, file:line)`.
fn public_methods(ty: &str) -> Vec<(String, String, String)> {
    let mut files = Vec::new();
    rs_files(
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")),
        &mut files,
    );
    let mut out = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let mut inside = false;
        let mut doc = String::new();
        for (i, line) in text.lines().enumerate() {
            if line.starts_with("impl") {
                let head = line.split(" for ").last().unwrap_or(line);
                let head = head.trim_end().trim_end_matches('{').trim_end();
                inside = head.ends_with(ty) || head.contains(&format!(" {ty}<"));
                doc.clear();
                continue;
            }
            if line.starts_with('}') {
                inside = false;
                continue;
            }
            if !inside {
                continue;
            }
            if let Some(d) = line.strip_prefix("    ///") {
                doc.push_str(d);
                doc.push(' ');
                continue;
            }
            if let Some(rest) = line.strip_prefix("    pub fn ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                out.push((name, doc.clone(), format!("{}:{}", f.display(), i + 1)));
            }
            if !line.starts_with("    #") {
                doc.clear();
            }
        }
    }
    out
}

#[test]
fn checkpoint_has_at_most_30_methods() {
    let methods = public_methods("Checkpoint");
    let names: Vec<&str> = methods.iter().map(|(n, _, _)| n.as_str()).collect();
    // The counter sees the methods (a moved file would count none).
    for m in ["open", "read", "read_batch", "verify", "catalog", "tensors"] {
        assert!(names.contains(&m), "{m} not found in {names:?}");
    }
    assert!(
        names.len() <= 30,
        "Checkpoint has {} public methods (at most 30): {names:?}",
        names.len()
    );
}

#[test]
fn every_unchecked_path_says_so() {
    let mut found = Vec::new();
    let mut copies = 0;
    for ty in ["Checkpoint", "Read", "Batch"] {
        for (name, doc, at) in public_methods(ty) {
            let doc = doc.to_lowercase();
            let skips = [
                "not check",
                "without checking",
                "skips the crc",
                "skip the crc",
            ]
            .iter()
            .any(|s| doc.contains(s));
            if name.contains("copy") || name.contains("into") {
                copies += 1;
            }
            if skips && !name.contains("unchecked") {
                found.push(format!(
                    "{at}: {ty}::{name} (its doc says it skips the CRC)"
                ));
            }
        }
    }
    // The scan sees the copies (`Read::into`, `Read::into_unchecked`).
    assert!(copies >= 2, "{copies} copying methods found");
    assert!(
        found.is_empty(),
        "say `unchecked` in these names: {found:#?}"
    );
}
