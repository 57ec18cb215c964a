//! Shards read with positioned reads (`pread`) instead of a memory map: a load that must
//! survive a shard file that fails or shrinks under it.
//!
//! A mapped file turns every I/O failure of the pages it faults in (a disk returning EIO,
//! a network file system losing its server, a file truncated by another program against
//! the contract on [`Map`](crate::mmap::Map)) into `SIGBUS`, which kills the process: there
//! is no error to return. A [`FileShard`] reads the bytes each read needs with `pread` into
//! the caller's fresh buffer, CRC-checked as they land, so the same failures are errors
//! naming the file ([`Error::Io`], or [`Error::ShardMismatch`] for a file that came back
//! short) and the process, and everything it holds, survives. The cost is what a fetch
//! costs: a copy into fresh memory instead of zero-copy views (no [`Read::view`](super::Read::view)
//! views and no `load_optimizer`, which read in place); reads, regions, streams and
//! `verify` work as on any source.

use std::fs::File;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::source::{Fetch, ShardSource};
use super::{Checkpoint, Shard};
use crate::error::{Error, Result};
use crate::format::manifest::MANIFEST_FILE;

/// Where a [`FileShard`] reads from: a file, or a test's fault-injecting stand-in.
pub trait ReadAt: Send + Sync {
    /// Read up to `buf.len()` bytes at `offset`; `Ok(0)` at the end of the file.
    ///
    /// # Errors
    /// The I/O error of the read.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize>;
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
}

/// One shard file read with positioned reads (`pread`) instead of a memory map: a load
/// that must survive a shard file that fails or shrinks under it.
///
/// A mapped file turns every I/O failure of the pages it faults in (a disk returning EIO, a
/// network file system losing its server, a file truncated against the contract on
/// [`Map`](crate::mmap::Map)) into `SIGBUS`, which kills the process. A `FileShard` reads
/// the bytes each read needs into the caller's fresh buffer, CRC-checked as they land, so
/// the same failures are errors naming the file ([`Error::Io`], or
/// [`Error::ShardMismatch`] for a file that came back short). Open with
/// [`Checkpoint::open_pread`]; tests inject faults through [`ReadAt`].
pub struct FileShard {
    src: Box<dyn ReadAt>,
    path: PathBuf,
    len: u64,
    /// The 8-byte header length and the header JSON, read at open.
    head: Vec<u8>,
}

impl std::fmt::Debug for FileShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileShard")
            .field("path", &self.path)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// The bytes read at a time: large enough for the device, small enough to stay in cache
/// while the CRC pieces of what landed are summed.
const READ_UNIT: usize = 1 << 20;

impl FileShard {
    /// A shard of `len` bytes read from `src` (named `path` in errors), its first
    /// `8 + header_size` bytes (the header the manifest records, clamped to the file) read
    /// now.
    ///
    /// # Errors
    /// [`Error::Io`] when the header cannot be read.
    pub fn new(src: Box<dyn ReadAt>, path: &Path, len: u64, header_size: u64) -> Result<Self> {
        let n = header_size.saturating_add(8).min(len);
        let n = usize::try_from(n).map_err(|_| Error::io("read", path, too_big()))?;
        let mut head = vec![0u8; n];
        let got = read_full(src.as_ref(), &mut head, 0).map_err(|e| Error::io("read", path, e))?;
        head.truncate(got);
        Ok(FileShard {
            src,
            path: path.to_path_buf(),
            len,
            head,
        })
    }

    fn open(file: File, path: &Path, header_size: u64) -> Result<Self> {
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        FileShard::new(Box::new(file), path, len, header_size)
    }
}

fn too_big() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, "does not fit in memory")
}

/// Read into all of `buf` at `offset`, stopping early only at the end of the file; returns
/// the bytes read. Interrupted reads are retried.
fn read_full(src: &dyn ReadAt, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut at = 0usize;
    while at < buf.len() {
        match src.read_at(&mut buf[at..], offset + at as u64) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(at)
}

impl ShardSource for FileShard {
    fn len(&self) -> u64 {
        self.len
    }
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
    fn head(&self) -> &[u8] {
        &self.head
    }
    fn fetch(shards: &[Shard<Self>], jobs: &mut [Fetch<'_>]) -> Result<()> {
        jobs.par_iter_mut()
            .map(|j| {
                let i = j.shard();
                let shard = shards.get(i).ok_or_else(|| {
                    Error::InvalidArgument(format!("fetch from shard {i}, of {}", shards.len()))
                })?;
                let s = &shard.bytes;
                let r = j.range();
                let mut buf = vec![0u8; READ_UNIT];
                let mut off = r.start;
                while off < r.end {
                    let want = usize::try_from(r.end - off).map_or(READ_UNIT, |n| n.min(READ_UNIT));
                    let got = read_full(s.src.as_ref(), &mut buf[..want], off)
                        .map_err(|e| Error::io("read", &s.path, e))?;
                    j.write(&buf[..got])
                        .map_err(|_| Error::InvalidArgument("a read ran past its range".into()))?;
                    if got < want {
                        return Err(Error::ShardMismatch {
                            shard: i,
                            file: shard.file.clone(),
                            reason: format!(
                                "the file ended at byte {} while reading bytes {r:?}: it was truncated or replaced while open",
                                off + got as u64
                            ),
                        });
                    }
                    off += got as u64;
                }
                Ok(())
            })
            .collect::<Vec<_>>()
            // The first failure in order.
            .into_iter()
            .collect()
    }
}

impl Checkpoint<FileShard> {
    /// Open the ckptstore directory `dir` with its shards read by `pread` instead of
    /// mapped (see [`FileShard`]): every check [`Checkpoint::open`] makes, and reads that
    /// return an error naming the file, never `SIGBUS`, when a shard fails or shrinks
    /// under them. For loads that must survive failing disks and file systems; the
    /// default mapped reader is zero-copy.
    ///
    /// # Errors
    /// As [`Checkpoint::open`]; [`Error::NotFound`] when `dir` holds no ckptstore
    /// manifest (plain safetensors and Hugging Face directories open with
    /// [`Checkpoint::open`]).
    ///
    /// # Example
    /// ```
    /// # fn main() -> ckptstore::Result<()> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let w = [1.0f32, 2.0, 3.0];
    /// ckptstore::save(dir.path(), &[ckptstore::TensorRef::from_slice("w", &[3], &w)], &Default::default())?;
    /// let ck = ckptstore::Checkpoint::open_pread(dir.path())?;
    /// assert_eq!(ck.read("w").to_tensor()?.as_slice::<f32>()?, &w[..]);
    /// # Ok(()) }
    /// ```
    pub fn open_pread(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = crate::location::local_path(dir.as_ref(), "Checkpoint::open_pread")?;
        let manifest = dir.join(MANIFEST_FILE);
        if !manifest.is_file() {
            return Err(Error::NotFound {
                path: dir.clone(),
                reason: format!("no {MANIFEST_FILE} in the directory"),
            });
        }
        super::open_native_retrying(&dir, &manifest, FileShard::open)
    }
}
