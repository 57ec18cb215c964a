//! The file-system seam under the local store ([`super::LocalStore`]): every file operation
//! of a save into a local directory goes through [`Fs`], so tests can substitute a
//! fault-injecting implementation (format-spec/durability.md §Operations).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::Path;

/// The file operations of a save (format-spec/durability.md §Operations).
///
/// Implementations must not reorder or cache operations in a way the real file system
/// would not; [`StdFs`] maps each call to one system call.
pub trait Fs: Sync {
    /// A file open for writing.
    type File: Write + Send;
    /// Create a new file (failing if it exists) for writing.
    fn create(&self, path: &Path) -> io::Result<Self::File>;
    /// Flush the file's data and metadata to stable storage (`fsync`).
    fn sync(&self, file: &mut Self::File, path: &Path) -> io::Result<()>;
    /// Atomically rename `from` to `to`, replacing `to` if it exists.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Flush the directory's entries to stable storage (`fsync` on the directory).
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Remove a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// List the names of the entries of a directory.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Read an existing file: its length and its first `min(max, length)` bytes (the
    /// commit of a multi-rank save reads the headers of the ranks' shards this way,
    /// format-spec/global.md C2). Not a step of a save.
    fn read_prefix(&self, path: &Path, max: u64) -> io::Result<(u64, Vec<u8>)>;
    /// A hint that `[offset, offset + len)` of `file` is written and can start going to the
    /// device (write-back), ahead of the [`Fs::sync`] that makes it durable. It promises
    /// nothing and must not fail; the default does nothing.
    fn start_writeback(&self, file: &mut Self::File, offset: u64, len: u64) {
        let _ = (file, offset, len);
    }
    /// Swap two existing entries (files or directories) atomically: afterwards `a` holds
    /// what `b` held and `b` what `a` held, and no state in between exists (Linux
    /// `renameat2(RENAME_EXCHANGE)`). Publishing a directory over an existing one
    /// ([`super::publish::publish_dir`]) uses it. The default, and a system or file system
    /// without such a call, answers `ErrorKind::Unsupported`.
    fn exchange(&self, a: &Path, b: &Path) -> io::Result<()> {
        let _ = (a, b);
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
    /// Remove the directory `dir` and everything below it. The default answers
    /// `ErrorKind::Unsupported`.
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        let _ = dir;
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdFs;

impl Fs for StdFs {
    type File = File;

    fn create(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new().write(true).create_new(true).open(path)
    }

    fn sync(&self, file: &mut File, _path: &Path) -> io::Result<()> {
        file.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn read_prefix(&self, path: &Path, max: u64) -> io::Result<(u64, Vec<u8>)> {
        let f = File::open(path)?;
        let len = f.metadata()?.len();
        let mut head = Vec::new();
        f.take(max.min(len)).read_to_end(&mut head)?;
        Ok((len, head))
    }

    fn start_writeback(&self, file: &mut File, offset: u64, len: u64) {
        crate::sys::io::start_writeback(file, offset, len);
    }

    fn exchange(&self, a: &Path, b: &Path) -> io::Result<()> {
        crate::sys::io::rename_exchange(a, b)
    }

    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir)? {
            if let Ok(name) = e?.file_name().into_string() {
                out.push(name);
            }
        }
        Ok(out)
    }
}
