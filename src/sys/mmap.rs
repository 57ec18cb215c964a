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
    /// Crate-private: the contract above is kept by the engine's own files only, so no
    /// caller outside the crate can map a file it might change (memmap2 makes the same
    /// point by marking its constructor `unsafe`). Users get maps through
    /// [`crate::open`].
    ///
    /// # Errors
    /// [`Error::Io`] when the size cannot be read or `mmap` fails.
    pub(crate) fn open(file: &File, path: &Path) -> Result<Map> {
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

    /// Hint that the whole storage will be read sequentially soon (mapped files).
    fn advise_sequential(&self) {}
}

impl ReleasePages for Map {
    fn release_pages(&self, offset: usize, len: usize) {
        self.release(offset, len);
    }
    fn advise_sequential(&self) {
        Map::advise_sequential(self);
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
        let Some((start, len)) = release_span(offset, len, m.len(), page_size()) else {
            return;
        };
        // SAFETY: this is a read-only, shared mapping of a file. MADV_DONTNEED on such a
        // mapping only drops our page-table entries; the next access re-reads the file's
        // bytes, which are unchanged under the contract on this type (committed files are
        // never modified in place). No reference can observe different bytes, and no
        // private or anonymous memory is discarded. The range lies inside the mapping.
        let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
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

/// The size of a memory page on this system, asked of the OS once (4 KiB on x86-64, 4, 16
/// or 64 KiB on arm64 kernels such as those of GH200 servers). Every page rounding of this
/// module uses it: `madvise` and `mincore` refuse (`EINVAL`) or misread ranges rounded to
/// a smaller page than the kernel's.
pub(crate) fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: sysconf only reads a system constant; it has no preconditions.
            let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if let Ok(n) = usize::try_from(n) {
                if n.is_power_of_two() {
                    return n;
                }
            }
        }
        4096
    })
}

/// The whole pages of a map of `map_len` bytes to release for `[offset, offset + len)`:
/// from the page holding `offset` (rounded down: the map starts on a page boundary) to the
/// end of the range, clipped to the map. `None` for an empty range or nothing left. `page` is a power of
/// two.
fn release_span(offset: usize, len: usize, map_len: usize, page: usize) -> Option<(usize, usize)> {
    if len == 0 {
        return None;
    }
    let start = offset.min(map_len) / page * page;
    let end = offset.saturating_add(len).min(map_len);
    (end > start).then(|| (start, end - start))
}

/// The page-aligned range `[start, start + len)` covering every byte of `bytes`, or `None`
/// for an empty slice.
fn page_range(bytes: &[u8]) -> Option<(usize, usize)> {
    page_span(bytes.as_ptr() as usize, bytes.len(), page_size())
}

/// [`page_range`] of the `len` bytes at address `addr`, for pages of `page` bytes (a power
/// of two): `None` for no bytes or a range past the end of the address space.
fn page_span(addr: usize, len: usize, page: usize) -> Option<(usize, usize)> {
    if len == 0 {
        return None;
    }
    let start = addr / page * page;
    let end = addr.checked_add(len)?.checked_next_multiple_of(page)?;
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
        let pages = len / page_size();
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

#[cfg(test)]
mod tests {
    use super::*;

    const K4: usize = 4096;
    const K64: usize = 65536;

    #[test]
    fn the_page_size_comes_from_the_os() {
        let p = page_size();
        assert!(p.is_power_of_two() && p >= 4096, "{p}");
        #[cfg(target_os = "linux")]
        {
            // The kernel reports the same size to a page-aligned map.
            let v = vec![7u8; 3 * p];
            let (_, pages) = resident_pages(&v).expect("mincore");
            assert!((3..=4).contains(&pages), "{pages}");
        }
    }

    #[test]
    fn spans_round_out_to_whole_pages_of_either_size() {
        // 4 KiB pages.
        assert_eq!(page_span(4096 + 10, 100, K4), Some((4096, 4096)));
        assert_eq!(page_span(4095, 2, K4), Some((0, 8192)));
        // 64 KiB pages (arm64): the same bytes cover one 64 KiB page, never a 4 KiB slice
        // of one (madvise and mincore would refuse that start address).
        assert_eq!(page_span(4096 + 10, 100, K64), Some((0, K64)));
        assert_eq!(page_span(K64 - 1, 2, K64), Some((0, 2 * K64)));
        assert_eq!(page_span(3 * K64, K64, K64), Some((3 * K64, K64)));
        for (addr, len) in [(1usize, 1usize), (K64 + 7, 200_000), (5 * K64, 1)] {
            let (s, l) = page_span(addr, len, K64).unwrap();
            assert_eq!(s % K64, 0);
            assert_eq!(l % K64, 0);
            assert!(s <= addr && addr + len <= s + l);
        }
        assert_eq!(page_span(10, 0, K64), None);
        assert_eq!(page_span(usize::MAX - 5, 10, K64), None);
    }

    #[test]
    fn releases_start_on_a_page_of_the_os_size() {
        // A 1 MiB map, release [70000, 70000 + 200000): the start rounds down to the page.
        assert_eq!(
            release_span(70_000, 200_000, 1 << 20, K4),
            Some((69_632, 200_368))
        );
        assert_eq!(
            release_span(70_000, 200_000, 1 << 20, K64),
            Some((K64, 204_464))
        );
        let (s, _) = release_span(70_000, 200_000, 1 << 20, K64).unwrap();
        assert_eq!(s % K64, 0);
        // Clipped to the map; nothing past its end.
        assert_eq!(release_span(1 << 20, 10, 1 << 20, K64), None);
        assert_eq!(release_span(100, usize::MAX, 1000, K64), Some((0, 1000)));
        assert_eq!(release_span(5, 0, 1000, K64), None);
    }
}
