//! The local-directory [`Store`]: temporary file, fsync, rename, directory fsync
//! (format-spec/durability.md §Operations), every file operation through the [`Fs`] seam so
//! that the crash-simulation and fault-injection tests drive the real protocol. Also the
//! directory's preparation (creation with durable entries) and its writer lock
//! (§Writers), which a local save takes outside the seam.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use super::fs::{Fs, StdFs};
use super::object::{Access, Held, Put, Store};
use crate::error::{Error, Result};
use crate::format::names::LOCK_FILE;

/// A checkpoint directory as a [`Store`], through the file system `F` ([`StdFs`]: the real
/// one).
#[derive(Debug, Clone)]
pub struct LocalStore<'f, F: Fs = StdFs> {
    fs: &'f F,
    dir: PathBuf,
    /// Made by [`LocalStore::std`]: [`Store::begin`] creates the directory and takes its
    /// writer lock. A store over a substitute file system does neither (the seam).
    real: bool,
}

impl LocalStore<'static, StdFs> {
    /// The directory `dir` on the real file system (writes need it to exist: the local
    /// entry points, [`crate::save`] among them, create it first).
    pub fn std(dir: impl Into<PathBuf>) -> Self {
        LocalStore {
            fs: &StdFs,
            dir: dir.into(),
            real: true,
        }
    }
}

impl<'f, F: Fs> LocalStore<'f, F> {
    /// The directory `dir` through `fs`: the seam for fault-injection tests. Writers
    /// through it expect `dir` to exist and take no writer lock (the test guarantees that
    /// no other writer runs there); everything else is the protocol of [`LocalStore::std`].
    pub fn new(fs: &'f F, dir: impl Into<PathBuf>) -> Self {
        LocalStore {
            fs,
            dir: dir.into(),
            real: false,
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl<F: Fs> Store for LocalStore<'_, F> {
    /// A missing directory holds no objects, as a prefix without objects does.
    fn list(&self) -> Result<Vec<String>> {
        match self.fs.list(&self.dir) {
            Ok(names) => Ok(names),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Error::io("list", &self.dir, e)),
        }
    }

    fn exists(&self, name: &str) -> Result<bool> {
        let path = self.dir.join(name);
        match self.fs.read_prefix(&path, 0) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("read", &path, e)),
        }
    }

    fn read_prefix(&self, name: &str, max: u64) -> Result<(u64, Vec<u8>)> {
        let path = self.dir.join(name);
        self.fs
            .read_prefix(&path, max)
            .map_err(|e| Error::io("read", &path, e))
    }

    fn put_streamed(&self, name: &str, staging: &str) -> Result<Box<dyn Put + '_>> {
        let tmp = self.dir.join(staging);
        let file = self
            .fs
            .create(&tmp)
            .map_err(|e| Error::io("create", &tmp, e))?;
        Ok(Box::new(LocalPut {
            fs: self.fs,
            file: Some(file),
            tmp,
            target: self.dir.join(name),
            synced: false,
            published: false,
        }))
    }

    fn barrier(&self, context: &'static str) -> Result<()> {
        self.fs
            .sync_dir(&self.dir)
            .map_err(|e| Error::io(context, &self.dir, e))
    }

    fn delete(&self, name: &str) -> Result<()> {
        let path = self.dir.join(name);
        self.fs
            .remove(&path)
            .map_err(|e| Error::io("remove", &path, e))
    }

    fn location(&self) -> PathBuf {
        self.dir.clone()
    }

    fn describe(&self, name: &str) -> String {
        name.to_string()
    }

    fn begin(&self, access: Access) -> Result<Held> {
        if !self.real {
            return Ok(Held::default());
        }
        // Writers create the directory; a commit or discard needs one that exists (it
        // finds the ranks' files there), and must not leave an empty one behind.
        if access != Access::Commit {
            prepare_dir(&self.dir)?;
        }
        let how = match access {
            Access::Save => Lock::TryExclusive,
            Access::Part => Lock::Shared,
            Access::Commit => Lock::Exclusive,
        };
        Ok(Held(Some(lock_dir(&self.dir, how)?)))
    }

    fn local_dir(&self) -> Option<&Path> {
        Some(&self.dir)
    }
}

/// A file being written into a [`LocalStore`] under its temporary name: `finish` fsyncs
/// (unless [`Put::sync`] did), closes and renames it to its name; a drop without `finish`
/// closes and removes it.
pub struct LocalPut<'a, F: Fs> {
    fs: &'a F,
    /// `None` once closed.
    file: Option<F::File>,
    tmp: PathBuf,
    target: PathBuf,
    synced: bool,
    published: bool,
}

impl<F: Fs> LocalPut<'_, F> {
    fn file(&mut self) -> io::Result<&mut F::File> {
        self.file
            .as_mut()
            .ok_or_else(|| io::Error::other("the file is closed"))
    }
}

impl<F: Fs> Write for LocalPut<'_, F> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file()?.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file()?.flush()
    }
}

impl<F: Fs> Put for LocalPut<'_, F> {
    fn start_writeback(&mut self, offset: u64, len: u64) {
        if let Some(f) = self.file.as_mut() {
            self.fs.start_writeback(f, offset, len);
        }
    }

    fn write_error(&self, e: io::Error) -> Error {
        Error::io("write", &self.tmp, e)
    }

    fn sync(&mut self) -> Result<()> {
        if self.synced {
            return Ok(());
        }
        let synced = match self.file.as_mut() {
            Some(f) => self.fs.sync(f, &self.tmp),
            None => Err(io::Error::other("the file is closed")),
        };
        synced.map_err(|e| Error::io("fsync", &self.tmp, e))?;
        self.synced = true;
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        self.sync()?;
        drop(self.file.take());
        self.fs
            .rename(&self.tmp, &self.target)
            .map_err(|e| Error::io("rename", &self.tmp, e))?;
        self.published = true;
        Ok(())
    }
}

impl<F: Fs> Drop for LocalPut<'_, F> {
    fn drop(&mut self) {
        if !self.published {
            drop(self.file.take());
            let _ = self.fs.remove(&self.tmp);
        }
    }
}

/// Create `dir` (and its parents) if missing, making the new entries durable
/// (format-spec/durability.md §Protocol, step 0.2).
///
/// # Errors
/// [`Error::Io`] naming the directory.
pub(crate) fn prepare_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    // The directories about to be created, deepest first.
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
        .collect();
    create_dir_all_shared(dir).map_err(|e| Error::io("create directory", dir, e))?;
    // Each new directory's entry lives in its parent: fsync those parents.
    for d in missing.iter().rev() {
        let parent = match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        StdFs
            .sync_dir(parent)
            .map_err(|e| Error::io("fsync directory", parent, e))?;
    }
    Ok(())
}

/// `std::fs::create_dir_all`, also where other hosts make the same directories at the same
/// moment through a shared file system's client caches (format-spec/durability.md, "On a
/// shared file system"): there `mkdir` can answer "exists" from the server while this
/// client's cache still says the name is missing (and `create_dir_all`'s own check after it
/// fails), or a parent another host made a moment ago is still missing here. After such a
/// failure the nearest ancestor that can be listed is listed (which refreshes an NFS-like
/// client's entries of it) and the creation is tried again, four times at most.
fn create_dir_all_shared(dir: &Path) -> io::Result<()> {
    let mut tries: u64 = 0;
    loop {
        let e = match std::fs::create_dir_all(dir) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if tries == 4
            || !matches!(
                e.kind(),
                io::ErrorKind::AlreadyExists | io::ErrorKind::NotFound
            )
        {
            return Err(e);
        }
        tries += 1;
        for a in dir
            .ancestors()
            .skip(1)
            .filter(|a| !a.as_os_str().is_empty())
        {
            if let Ok(entries) = std::fs::read_dir(a) {
                entries.for_each(drop);
                break;
            }
        }
        if dir.is_dir() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(20 * tries));
    }
}

/// How [`lock_file`] takes a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lock {
    /// Exclusive, failing at once if it is held (a save: one at a time per directory).
    TryExclusive,
    /// Exclusive, waiting for it (a multi-rank commit: after the ranks still writing).
    Exclusive,
    /// Shared, waiting for it (a rank writing its part, beside the other ranks).
    Shared,
}

/// Hold the writer lock file of `dir` (format-spec/durability.md §Writers), released when the
/// returned file is dropped.
///
/// # Errors
/// As [`lock_file`].
pub(crate) fn lock_dir(dir: &Path, how: Lock) -> Result<File> {
    lock_file(&dir.join(LOCK_FILE), how)
}

/// Hold the lock file `path` (created if missing), released when the returned file is
/// dropped.
///
/// # Errors
/// [`Error::Io`] naming the file: `open lock file`, or `lock` (for
/// [`Lock::TryExclusive`], `WouldBlock` while another save holds it).
pub(crate) fn lock_file(path: &Path, how: Lock) -> Result<File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::io("open lock file", path, e))?;
    let locked = match how {
        Lock::Exclusive => f.lock(),
        Lock::Shared => f.lock_shared(),
        Lock::TryExclusive => match f.try_lock() {
            Ok(()) => Ok(()),
            Err(std::fs::TryLockError::WouldBlock) => Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "another save into this directory is in progress; wait for it or choose another directory",
            )),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        },
    };
    locked.map_err(|e| Error::io("lock", path, e))?;
    Ok(f)
}
