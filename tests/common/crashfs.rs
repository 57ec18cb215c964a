//! A crash-injecting file system for the writer's `Fs` seam, shared by tests/atomic.rs and
//! the structured fuzz target (fuzz/fuzz_targets/structured.rs).
#![allow(dead_code)]

use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ckptstore::write::fs::{Fs, StdFs};

/// A file system that fails every operation from the `fail_at`-th on (a crash: nothing
/// after it reaches the disk). Counts create, write, fsync, rename, dir fsync, remove.
pub struct CrashFs {
    fail_at: usize,
    ops: Arc<AtomicUsize>,
}

impl CrashFs {
    /// Fail every operation from the `fail_at`-th (counting from 0) on.
    pub fn new(fail_at: usize) -> Self {
        CrashFs {
            fail_at,
            ops: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl CrashFs {
    fn tick(&self) -> io::Result<()> {
        if self.ops.fetch_add(1, Ordering::SeqCst) >= self.fail_at {
            Err(io::Error::other("injected crash"))
        } else {
            Ok(())
        }
    }
}

pub struct CrashFile {
    inner: std::fs::File,
    fail_at: usize,
    ops: Arc<AtomicUsize>,
}

impl Write for CrashFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.ops.fetch_add(1, Ordering::SeqCst) >= self.fail_at {
            return Err(io::Error::other("injected crash"));
        }
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Fs for CrashFs {
    type File = CrashFile;
    fn create(&self, path: &Path) -> io::Result<CrashFile> {
        self.tick()?;
        Ok(CrashFile {
            inner: StdFs.create(path)?,
            fail_at: self.fail_at,
            ops: self.ops.clone(),
        })
    }
    fn sync(&self, f: &mut CrashFile, path: &Path) -> io::Result<()> {
        self.tick()?;
        StdFs.sync(&mut f.inner, path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.tick()?;
        StdFs.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.tick()?;
        StdFs.sync_dir(dir)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.tick()?;
        StdFs.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.tick()?;
        StdFs.list(dir)
    }
    fn read_prefix(&self, path: &Path, max: u64) -> io::Result<(u64, Vec<u8>)> {
        self.tick()?;
        StdFs.read_prefix(path, max)
    }
}
