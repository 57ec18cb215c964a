//! Step 5 of a save on a background thread ([`super::Cleanup::Background`]): the save
//! returns at its commit point, and a thread that owns the directory's writer lock removes
//! the files the new checkpoint does not reference, then drops the lock.
//!
//! The threads of this process are kept in one registry, so that a later save into the
//! same directory waits for its thread instead of meeting the lock (`lock_dir` calls
//! [`wait_in`]), and so that a program can wait for all of them before it exits
//! ([`wait_for_cleanup`]; the Python package does so at exit).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::Sweep;
use crate::store::LocalStore;

/// One background cleanup of this process.
struct Pending {
    /// The directory, canonical where it can be made so (the key of [`wait_in`]).
    dir: PathBuf,
    /// The process that started it: a forked child inherits the registry but not the
    /// thread, and must not wait for it.
    pid: u32,
    handle: JoinHandle<usize>,
}

static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());

/// Callers blocked in [`wait_in`] or [`wait_for_cleanup`] (test seam).
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// While true, background cleanups wait before removing anything (test seam:
/// [`hold_background_cleanup`]).
static HOLD: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

fn key(dir: &Path) -> PathBuf {
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// Start `sweep` on a background thread that owns `lock` (the directory's writer lock).
/// If no thread can be started, the sweep does not run and the lock is released: the
/// files stay as garbage for the next save, which removes them (never damage).
pub(crate) fn spawn(dir: &Path, lock: File, sweep: Sweep) {
    let path = dir.to_path_buf();
    let started = std::thread::Builder::new()
        .name("ckptstore-cleanup".into())
        .spawn(move || {
            let _lock = lock;
            let (held, cv) = &HOLD;
            let mut h = held.lock().unwrap_or_else(PoisonError::into_inner);
            while *h {
                h = cv.wait(h).unwrap_or_else(PoisonError::into_inner);
            }
            drop(h);
            sweep.run(&LocalStore::std(path))
        });
    if let Ok(handle) = started {
        PENDING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Pending {
                dir: key(dir),
                pid: std::process::id(),
                handle,
            });
    }
}

/// Wait for the pending cleanups `pick` selects; returns the files they removed.
fn wait_where(pick: impl Fn(&Pending) -> bool) -> usize {
    let mine: Vec<Pending> = {
        let mut all = PENDING.lock().unwrap_or_else(PoisonError::into_inner);
        let pid = std::process::id();
        // A forked child's entries name threads it does not have: drop them.
        all.retain(|p| p.pid == pid);
        let (mine, rest) = std::mem::take(&mut *all).into_iter().partition(|p| pick(p));
        *all = rest;
        mine
    };
    if mine.is_empty() {
        return 0;
    }
    WAITING.fetch_add(1, Ordering::SeqCst);
    // A panicked sweep removed what it removed before the panic; count it as none.
    let n = mine.into_iter().map(|p| p.handle.join().unwrap_or(0)).sum();
    WAITING.fetch_sub(1, Ordering::SeqCst);
    n
}

/// Wait for this process's background cleanups of `dir` (before taking its writer lock).
pub(crate) fn wait_in(dir: &Path) -> usize {
    let k = key(dir);
    wait_where(|p| p.dir == k)
}

/// Wait until every background cleanup this process started ([`super::Cleanup::Background`])
/// has finished; returns the number of files they removed. Call it before a program exits
/// to leave no previous checkpoint's files behind (they would be removed by the next save
/// into the directory otherwise). Never fails: a cleanup that could not remove a file
/// leaves it and counts it as not removed.
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// use ckptstore::{save, Cleanup, SaveOptions, TensorRef};
/// let dir = tempfile::tempdir().unwrap();
/// let w = vec![1.0f32; 256];
/// let opts = SaveOptions { cleanup: Cleanup::Background, ..Default::default() };
/// save(dir.path(), &[TensorRef::from_slice("w", &[256], &w)], &opts)?;
/// save(dir.path(), &[TensorRef::from_slice("w", &[256], &w)], &opts)?; // waits for the first
/// assert_eq!(ckptstore::write::wait_for_cleanup(), 1); // the first checkpoint's shard
/// # Ok(()) }
/// ```
pub fn wait_for_cleanup() -> usize {
    wait_where(|_| true)
}

/// Test seam: until the returned guard is dropped, background cleanups wait before
/// removing anything. Not part of the API.
#[doc(hidden)]
pub fn hold_background_cleanup() -> HoldGuard {
    *HOLD.0.lock().unwrap_or_else(PoisonError::into_inner) = true;
    HoldGuard(())
}

/// See [`hold_background_cleanup`]; dropping it lets the held cleanups run.
#[doc(hidden)]
pub struct HoldGuard(());

impl Drop for HoldGuard {
    fn drop(&mut self) {
        *HOLD.0.lock().unwrap_or_else(PoisonError::into_inner) = false;
        HOLD.1.notify_all();
    }
}

/// Test seam: callers now blocked waiting for background cleanups. Not part of the API.
#[doc(hidden)]
pub fn waiting_for_cleanup() -> usize {
    WAITING.load(Ordering::SeqCst)
}
