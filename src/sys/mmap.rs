//! Read-only memory maps of shard files.

use std::fs::File;
use std::path::Path;

use crate::error::{Error, Result};

/// A read-only memory map of a whole file.
///
/// # Contract
///
/// Mapping a file is only sound while nobody changes or truncates it: a concurrent write
/// would change bytes we hand out as `&[u8]`, and a truncation would turn a read into
/// `SIGBUS`. ckptstore keeps its side of that contract by construction:
///
/// * it never writes to a committed file: shards and manifests are written to temporary
///   files and renamed into place, and a save over an existing checkpoint writes files
///   with new names; files that leave a checkpoint are unlinked, never truncated, and an
///   unlinked file stays valid for every process that still maps it;
/// * maps are `PROT_READ` (via [`memmap2::Mmap`]): a load cannot write through to its source.
///
/// Other programs must keep the same rule: do not edit, truncate or overwrite shard files
/// of a checkpoint that may be open. Replace checkpoints with `ckpt pack` or the writer.
#[derive(Debug)]
pub struct Map {
    // `None` for an empty file: mapping zero bytes is an error on some platforms.
    map: Option<memmap2::Mmap>,
}

impl Map {
    /// Map `file` (opened read-only at `path`, used in errors) whole.
    ///
    /// # Errors
    /// [`Error::Io`] when the size cannot be read or `mmap` fails.
    pub fn open(file: &File, path: &Path) -> Result<Map> {
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        if len == 0 {
            return Ok(Map { map: None });
        }
        // SAFETY: the map is read-only, and the files we map are never modified in place
        // while a checkpoint is open (see the contract on this type). A file modified by
        // another program in violation of that contract can change the bytes we read, which
        // is caught by CRC verification, but cannot cause undefined behaviour in safe code
        // that only reads `u8`s and Pod values out of the slice.
        let map = unsafe { memmap2::MmapOptions::new().map(file) }
            .map_err(|e| Error::io("mmap", path, e))?;
        Ok(Map { map: Some(map) })
    }

    /// Hint the kernel that the whole map will be read sequentially soon.
    pub fn advise_sequential(&self) {
        if let Some(m) = &self.map {
            // Advice is a hint; failure is harmless.
            let _ = m.advise(memmap2::Advice::Sequential);
        }
    }
}

/// Shard storage whose pages a reader can release from the process once it has used them
/// (restores that keep their resident memory near the size of what they build): mapped
/// files drop their page-table entries, memory the process owns keeps its bytes.
pub trait ReleasePages {
    /// Release what backs `[offset, offset + len)` where that is possible; never changes
    /// the bytes a later read sees.
    fn release_pages(&self, offset: usize, len: usize);
}

impl ReleasePages for Map {
    fn release_pages(&self, offset: usize, len: usize) {
        self.release(offset, len);
    }
}

impl ReleasePages for Vec<u8> {
    /// Owned bytes stay: releasing them would lose data.
    fn release_pages(&self, _offset: usize, _len: usize) {}
}

impl Map {
    /// Release the resident pages of `[offset, offset + len)` (rounded out to whole pages):
    /// they leave this process's resident set, and a later read faults them in again from
    /// the file. Used by streaming loads to bound memory. Out-of-range requests are clipped.
    pub fn release(&self, offset: usize, len: usize) {
        let Some(m) = &self.map else { return };
        let start = offset.min(m.len()) / PAGE * PAGE;
        let end = offset.saturating_add(len).min(m.len());
        if end <= start {
            return;
        }
        // SAFETY: this is a read-only, shared mapping of a file. MADV_DONTNEED on such a
        // mapping only drops our page-table entries; the next access re-reads the file's
        // bytes, which are unchanged under the contract on this type (committed files are
        // never modified in place). No reference can observe different bytes, and no
        // private or anonymous memory is discarded. The range lies inside the mapping.
        let _ = unsafe {
            m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}

impl AsRef<[u8]> for Map {
    fn as_ref(&self) -> &[u8] {
        match &self.map {
            Some(m) => m,
            None => &[],
        }
    }
}

const PAGE: usize = 4096;

/// The page-aligned range `[start, start + len)` covering every byte of `bytes`, or `None`
/// for an empty slice.
fn page_range(bytes: &[u8]) -> Option<(usize, usize)> {
    if bytes.is_empty() {
        return None;
    }
    let addr = bytes.as_ptr() as usize;
    let start = addr / PAGE * PAGE;
    let end = addr
        .checked_add(bytes.len())?
        .checked_next_multiple_of(PAGE)?;
    Some((start, end - start))
}

/// Ask the kernel to start reading the pages behind `bytes` now (`madvise(MADV_WILLNEED)`),
/// without waiting for them: a read-ahead hint for memory-mapped shard bytes that a loader
/// will touch soon. For anonymous memory it is harmless. Failures are ignored (a hint).
pub(crate) fn will_need(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    if let Some((start, len)) = page_range(bytes) {
        // SAFETY: the range covers only pages holding bytes of `bytes`, which are mapped
        // (the slice is live). MADV_WILLNEED changes no memory contents and no mapping: it
        // only schedules reads into the page cache. Errors come back as the result.
        let _ = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_WILLNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// Read the pages behind `bytes` into memory and map them now, waiting for the reads
/// (`madvise(MADV_POPULATE_READ)`, Linux 5.14+): a reader thread that walks a map in order
/// this way gives the device one sequential stream of large reads (the kernel's read-ahead
/// window), and later reads of `bytes` take no page fault. Failures are ignored (older
/// kernels, I/O errors: a later read of the bytes reports those itself).
pub(crate) fn populate_read(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    if let Some((start, len)) = page_range(bytes) {
        // SAFETY: the range covers only pages holding bytes of `bytes`, which are mapped
        // readable (the slice is live). MADV_POPULATE_READ only faults those pages in, as
        // reading them would; it changes no contents and no mapping. Errors come back as
        // the result.
        let _ = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// How many of the pages behind `bytes` are in memory (`mincore`): for a file map, the
/// pages in the page cache, faulted in by this process or not. `None` where it cannot be
/// asked (other systems, or the call failed).
pub(crate) fn resident_pages(bytes: &[u8]) -> Option<(usize, usize)> {
    #[cfg(target_os = "linux")]
    {
        let Some((start, len)) = page_range(bytes) else {
            return Some((0, 0));
        };
        let pages = len / PAGE;
        let mut v = vec![0u8; pages];
        // SAFETY: the range covers only pages holding bytes of the live slice `bytes`, and
        // `v` has one writable byte per page of it, which is what mincore writes.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, v.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        Some((v.iter().filter(|&&b| b & 1 != 0).count(), pages))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = bytes;
        None
    }
}

/// Whether the first and the last page behind `bytes` are in memory: a cheap sample
/// (two one-page `mincore` calls) that tells a hot range from a cold one.
pub(crate) fn looks_resident(bytes: &[u8]) -> bool {
    if bytes.is_empty() {
        return true;
    }
    let first = &bytes[..1];
    let last = &bytes[bytes.len() - 1..];
    matches!(resident_pages(first), Some((1, 1))) && matches!(resident_pages(last), Some((1, 1)))
}
