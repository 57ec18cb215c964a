//! How loads read cold shard bytes: the read strategy ([`ReadStrategy`]: page faults, a
//! read-ahead thread, or one reader thread streaming the maps in file order ahead of the
//! converters), the gate converters wait at behind a streaming reader, and the page-cache
//! tools the benchmarks use to know a read is cold ([`cached_pages`], [`drop_page_cache`]).

use std::fs::File;
use std::path::Path;

use super::open::open_map;
use super::{Checkpoint, TensorInfo};
use crate::error::{Error, Result};

/// How loads read cold shard bytes; see [`set_read_strategy`].
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReadStrategy {
    /// Page faults only (the kernel's fault read-ahead), tensors in parallel: the default,
    /// the fastest of these when measured (BENCHMARKS.md §Tried and dropped).
    Faults,
    /// A read-ahead thread walks the tensors in file order, ahead of the converters,
    /// asking for windows that are not in memory (`MADV_WILLNEED`); tensors in parallel.
    WillNeed,
    /// The read-ahead thread, and tensors converted one after the other in file order
    /// (each one rayon-parallel inside), so the converters follow the read-ahead.
    WillNeedInOrder,
    /// One reader thread populates the maps in file order, a window at a time and waiting
    /// for each (`MADV_POPULATE_READ`: the device sees one sequential stream of large
    /// reads, as a single `pread` reader), and tensors are converted in file order, each
    /// once the reader has passed it, so that no converter ever faults on a cold page.
    Stream,
}

static READ_STRATEGY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Select how loads read cold bytes (for benchmarks that compare the strategies; the
/// default is the one measured fastest, see BENCHMARKS.md).
#[doc(hidden)]
pub fn set_read_strategy(s: ReadStrategy) {
    let v = match s {
        ReadStrategy::Faults => 0,
        ReadStrategy::WillNeed => 1,
        ReadStrategy::WillNeedInOrder => 2,
        ReadStrategy::Stream => 3,
    };
    READ_STRATEGY.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The strategy loads use now.
#[doc(hidden)]
pub fn read_strategy() -> ReadStrategy {
    match READ_STRATEGY.load(std::sync::atomic::Ordering::Relaxed) {
        0 => ReadStrategy::Faults,
        1 => ReadStrategy::WillNeed,
        2 => ReadStrategy::WillNeedInOrder,
        _ => ReadStrategy::Stream,
    }
}

/// Bytes the read-ahead thread asks for at a time.
const READAHEAD_WINDOW: usize = 16 << 20;

/// Where the reader thread of [`ReadStrategy::Stream`] has got to, for converters that
/// must not touch bytes it has not read yet.
pub(crate) struct Gate<'r> {
    /// The ranges being read, in order; `None` when no reader runs (hot loads, other
    /// strategies): then [`Gate::wait_for`] returns at once.
    ranges: Option<&'r [&'r [u8]]>,
    /// Bytes of `ranges`, counted in order, that the reader has finished.
    done: std::sync::Mutex<u64>,
    cv: std::sync::Condvar,
}

impl Gate<'_> {
    fn open() -> Gate<'static> {
        Gate {
            ranges: None,
            done: std::sync::Mutex::new(u64::MAX),
            cv: std::sync::Condvar::new(),
        }
    }

    /// Block until the reader has read every byte of `bytes` that lies in its ranges
    /// (returns at once for bytes outside them, or when no reader runs).
    pub(crate) fn wait_for(&self, bytes: &[u8]) {
        let Some(ranges) = self.ranges else { return };
        let Some(last) = bytes
            .len()
            .checked_sub(1)
            .map(|n| bytes.as_ptr() as usize + n)
        else {
            return;
        };
        let mut before = 0u64;
        let mut need = None;
        for r in ranges {
            let a = r.as_ptr() as usize;
            if (a..a + r.len()).contains(&last) {
                need = Some(before + (last - a) as u64 + 1);
                break;
            }
            before += r.len() as u64;
        }
        let Some(need) = need else { return };
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while *done < need {
            done = self.cv.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether a streaming reader runs (then converters should follow it in file order).
    pub(crate) fn streaming(&self) -> bool {
        self.ranges.is_some()
    }

    fn advance(&self, to: u64) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = to;
        self.cv.notify_all();
    }
}

/// Run `f` while a read-ahead thread brings the not-yet-cached bytes of `ranges` (slices
/// of mapped shard bytes, in the order `f` will read them) into memory, per the read
/// strategy ([`ReadStrategy`]): asking the kernel for windows that are not in memory
/// (`MADV_WILLNEED`), or, with [`ReadStrategy::Stream`] where `stream` is set, reading
/// them in order and publishing its progress in the [`Gate`] handed to `f`. Windows
/// already in memory (sampled: first and last page) cost two `mincore` calls and nothing
/// else, so hot loads start no thread. The thread stops when `f` returns.
pub(crate) fn with_readahead<R: Send>(
    ranges: &[&[u8]],
    stream: bool,
    f: impl FnOnce(&Gate<'_>) -> R + Send,
) -> R {
    use std::sync::atomic::{AtomicBool, Ordering};
    let strategy = read_strategy();
    if strategy == ReadStrategy::Faults
        || ranges
            .iter()
            .flat_map(|r| r.chunks(READAHEAD_WINDOW))
            .all(crate::sys::mmap::looks_resident)
    {
        return f(&Gate::open());
    }
    let done = AtomicBool::new(false);
    if stream && strategy == ReadStrategy::Stream {
        let gate = Gate {
            ranges: Some(ranges),
            done: std::sync::Mutex::new(0),
            cv: std::sync::Condvar::new(),
        };
        return std::thread::scope(|s| {
            s.spawn(|| {
                let mut pos = 0u64;
                for w in ranges.iter().flat_map(|r| r.chunks(READAHEAD_WINDOW)) {
                    // Stop reading (but still release waiters) once `f` is done.
                    if !done.load(Ordering::Relaxed) {
                        crate::sys::mmap::populate_read(w);
                    }
                    pos += w.len() as u64;
                    gate.advance(pos);
                }
                gate.advance(u64::MAX);
            });
            let r = f(&gate);
            done.store(true, Ordering::Relaxed);
            r
        });
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            for r in ranges {
                for w in r.chunks(READAHEAD_WINDOW) {
                    if done.load(Ordering::Relaxed) {
                        return;
                    }
                    if !crate::sys::mmap::looks_resident(w) {
                        crate::sys::mmap::will_need(w);
                    }
                }
            }
        });
        let r = f(&Gate::open());
        done.store(true, Ordering::Relaxed);
        r
    })
}

/// Whether loads should convert tensors one after the other (see [`ReadStrategy`]).
pub(crate) fn in_order() -> bool {
    read_strategy() == ReadStrategy::WillNeedInOrder
}

impl<S: super::ShardSource> Checkpoint<S> {
    /// The mapped bytes of `tensors`, sorted in file order (shard, offset).
    /// Ranges that touch or overlap in a shard are merged, so that a checkpoint of many
    /// small tensors costs a few `mincore` calls per window, not per tensor.
    pub(crate) fn ranges_in_file_order<'a>(&'a self, tensors: &[&'a TensorInfo]) -> Vec<&'a [u8]> {
        let mut spans: Vec<(usize, u64, u64)> = tensors
            .iter()
            .map(|t| (t.shard, t.offsets[0], t.offsets[1]))
            .collect();
        spans.sort_unstable();
        let mut merged: Vec<(usize, u64, u64)> = Vec::with_capacity(spans.len());
        for (sh, a, b) in spans {
            match merged.last_mut() {
                Some(m) if m.0 == sh && a <= m.2 => m.2 = m.2.max(b),
                _ => merged.push((sh, a, b)),
            }
        }
        merged
            .into_iter()
            .filter_map(|(sh, a, b)| {
                self.shards
                    .get(sh)?
                    .bytes
                    .bytes()?
                    .get(usize::try_from(a).ok()?..usize::try_from(b).ok()?)
            })
            .collect()
    }
}

/// `(cached, total)` pages of the file at `path` in the page cache (`mincore` over a new
/// map that touches no page; `None` where the system cannot say). For benchmarks that must
/// know the cache is cold before they trust a "cold" figure.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or mapped.
pub fn cached_pages(path: &Path) -> Result<Option<(usize, usize)>> {
    let m = open_map(path)?;
    Ok(crate::sys::mmap::resident_pages(m.as_ref()))
}

/// Drop the file at `path` from the page cache: flush its dirty pages (`fdatasync`), then
/// `posix_fadvise(POSIX_FADV_DONTNEED)`, so that the next read comes from the device (a
/// cold read, as after a reboot). No privileges needed. Pages that a live memory map of any
/// process has faulted in stay cached: close checkpoints over the file first. A no-op on
/// systems other than Linux.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened, flushed or advised.
pub fn drop_page_cache(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(|e| Error::io("open", path, e))?;
    f.sync_data().map_err(|e| Error::io("fdatasync", path, e))?;
    crate::sys::io::drop_cached(&f).map_err(|e| Error::io("posix_fadvise", path, e))
}
