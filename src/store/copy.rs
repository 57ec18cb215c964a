//! Local files copied into a store, each checked against the size and CRC32 its writer
//! recorded while it streams: how the tiered manager moves a step that is already committed
//! on a host's fast tier into the persistent tier (a directory or an object-store prefix),
//! without a second snapshot of the training state (python/py_src/ckptstore/torch/tiered.py).
//!
//! Each file is published under its name only whole and only when its bytes match the record
//! ([`Store::put_streamed`], [`crate::store::Put::finish`]); a file that differs is aborted and
//! nothing of it appears. The files of one call go in parallel (rayon), so a caller that needs
//! an order (shards before the part descriptor that names them, which a file rendezvous
//! commit waits for) makes one call per group.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

use rayon::prelude::*;

use super::object::{Access, Store};
use crate::error::{Error, Result};
use crate::format::names::TEMP_PREFIX;

/// A file to copy and what its writer recorded of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSum {
    /// The file's name in the source directory and in the store (one path segment).
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// The CRC32 (IEEE, as crc32fast and zlib compute it) of its bytes.
    pub crc32: u32,
}

const CHUNK: usize = 8 << 20;

/// Copy `files` from the directory `src_dir` into `dst`, each streamed, checked against its
/// [`FileSum`] and published whole, then make the new names durable ([`Store::barrier`]).
/// A local destination directory is created if missing, and its writer lock is held shared
/// while the files go in ([`Access::Part`]: beside other ranks' parts, before the commit).
///
/// # Errors
/// [`Error::Io`] naming the source file (a name that is not one plain path segment, a
/// file missing, unreadable, or of another size than the recorded one); [`Error::ChecksumMismatch`] when its bytes do not have the recorded CRC32;
/// the errors of the store's writes. Files already copied stay published (the caller's
/// commit, not this copy, decides what the destination holds); the failed one is absent.
pub fn copy_in(src_dir: &Path, dst: &dyn Store, files: &[FileSum]) -> Result<()> {
    for f in files {
        if f.name.is_empty()
            || f.name.contains(['/', '\\', '\0'])
            || f.name == "."
            || f.name == ".."
        {
            return Err(Error::Io {
                op: "copy",
                path: src_dir.join(&f.name),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a copied file's name must be one path segment",
                ),
            });
        }
    }
    let _held = dst.begin(Access::Part)?;
    files
        .par_iter()
        .try_for_each(|f| copy_one(&src_dir.join(&f.name), dst, f))?;
    dst.barrier("fsync directory (after copying files in)")
}

fn copy_one(src: &Path, dst: &dyn Store, f: &FileSum) -> Result<()> {
    let io_err = |op: &'static str, source: io::Error| Error::Io {
        op,
        path: src.to_path_buf(),
        source,
    };
    let mut file = File::open(src).map_err(|e| io_err("open (to copy)", e))?;
    let len = file
        .metadata()
        .map_err(|e| io_err("stat (to copy)", e))?
        .len();
    if len != f.size {
        return Err(io_err(
            "copy",
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{len} bytes, the writer recorded {}", f.size),
            ),
        ));
    }
    let staging = format!("{TEMP_PREFIX}copy-{}-{}", std::process::id(), f.name);
    let mut put = dst.put_streamed(&f.name, &staging)?;
    let mut buf = vec![0u8; CHUNK.min(usize::try_from(len).unwrap_or(CHUNK)).max(1)];
    let mut crc = crc32fast::Hasher::new();
    let mut done: u64 = 0;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read (to copy)", e)),
        };
        let chunk = &buf[..n];
        crc.update(chunk);
        put.append(chunk)?;
        put.start_writeback(done, n as u64);
        done = done.saturating_add(n as u64);
        if done > f.size {
            break;
        }
    }
    let got = crc.finalize();
    if done != f.size {
        return Err(io_err(
            "copy",
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "read {done} bytes, the writer recorded {} (the file changed)",
                    f.size
                ),
            ),
        ));
    }
    if got != f.crc32 {
        return Err(Error::ChecksumMismatch {
            what: format!("copied file {}", f.name),
            shard: 0,
            file: src.display().to_string(),
            expected: f.crc32,
            got,
        });
    }
    put.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LocalStore;

    fn sum(dir: &Path, name: &str) -> FileSum {
        let b = std::fs::read(dir.join(name)).unwrap();
        FileSum {
            name: name.into(),
            size: b.len() as u64,
            crc32: crc32fast::hash(&b),
        }
    }

    #[test]
    fn copies_bit_for_bit_and_refuses_a_changed_file() {
        let src = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        let dst_dir = out.path().join("step");
        let big: Vec<u8> = (0..(CHUNK + 12345)).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(src.path().join("a.bin"), &big).unwrap();
        std::fs::write(src.path().join("b.json"), b"{}").unwrap();
        std::fs::write(src.path().join("empty"), b"").unwrap();
        let files: Vec<FileSum> = ["a.bin", "b.json", "empty"]
            .iter()
            .map(|n| sum(src.path(), n))
            .collect();
        let store = LocalStore::std(&dst_dir);
        copy_in(src.path(), &store, &files).unwrap();
        for f in &files {
            assert_eq!(
                std::fs::read(dst_dir.join(&f.name)).unwrap(),
                std::fs::read(src.path().join(&f.name)).unwrap()
            );
        }

        // One byte flipped after its CRC was recorded: refused, nothing published.
        let mut bad = big.clone();
        bad[CHUNK + 7] ^= 0x40;
        std::fs::write(src.path().join("c.bin"), &bad).unwrap();
        let rec = FileSum {
            name: "c.bin".into(),
            size: big.len() as u64,
            crc32: crc32fast::hash(&big),
        };
        let e = copy_in(src.path(), &store, std::slice::from_ref(&rec)).unwrap_err();
        assert!(
            matches!(e, Error::ChecksumMismatch { expected, .. } if expected == rec.crc32),
            "{e}"
        );
        // A size other than the record's: refused before a byte is written.
        let short = FileSum {
            size: rec.size + 1,
            ..rec.clone()
        };
        let e = copy_in(src.path(), &store, &[short]).unwrap_err();
        assert!(matches!(e, Error::Io { op: "copy", .. }), "{e}");
        let mut names: Vec<String> = std::fs::read_dir(&dst_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != crate::format::names::LOCK_FILE)
            .collect();
        names.sort();
        assert_eq!(names, ["a.bin", "b.json", "empty"]);

        for name in ["", "..", "x/y"] {
            let f = FileSum {
                name: name.into(),
                size: 0,
                crc32: 0,
            };
            let e = copy_in(src.path(), &store, &[f]).unwrap_err();
            assert!(matches!(e, Error::Io { op: "copy", .. }), "{e}");
        }
    }
}
