//! A checkpoint manager for training loops: one committed checkpoint per step under a root
//! directory, `latest()`, retention with garbage collection that never pulls a checkpoint
//! from under a reader, and asynchronous saves with a bounded number in flight.
//!
//! Layout (format-spec/durability.md §Manager): `ROOT/step-<step, 8+ digits>/` is a normal
//! ckptstore checkpoint directory. A step is written into `ROOT/.tmp-step-<step>-<id>/` and
//! renamed into place once its own manifest is committed, then `ROOT` is fsynced: a step
//! directory exists only when committed, and an interrupted save leaves only a `.tmp-step-`
//! directory that `steps()` ignores and the next save (before writing) or `gc()` removes; a
//! save that fails removes its own.
//!
//! Readers opened through [`CheckpointManager::open`] hold a shared lock on the step's
//! `.ckpt-lock`; garbage collection takes that lock exclusively before deleting a step and
//! skips steps it cannot lock. So a step a live reader has open is never deleted; it goes at
//! the first `gc()` after the reader is dropped.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::format::manifest::MANIFEST_FILE;
use crate::optim::{OptimizerState, OptimizerStateRef, StateLayout};
use crate::store::local::{self, Lock};
use crate::write::{self, CommitInfo, SaveOptions, TensorRef, LOCK_FILE};
use crate::DType;

const STEP_PREFIX: &str = "step-";
const TMP_STEP_PREFIX: &str = ".tmp-step-";
/// The root's lock: held (briefly) while a save creates and locks its `.tmp-step-`
/// directory, and while interrupted saves are removed, so that a directory just created is
/// never taken for an interrupted one before its writer has locked it.
const ROOT_LOCK: &str = ".ckpt-manager-lock";

/// Which steps garbage collection keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Keep the newest `keep_last` committed steps (at least 1).
    pub keep_last: usize,
    /// Also keep every step that is a multiple of this (e.g. 1000), if set.
    pub keep_every: Option<u64>,
}

impl Retention {
    /// Keep the newest `n` committed steps, and no others.
    pub fn keep_last(n: usize) -> Self {
        Retention {
            keep_last: n,
            keep_every: None,
        }
    }
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            keep_last: 3,
            keep_every: None,
        }
    }
}

/// One step under a manager root, as `ls` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepEntry {
    /// The step number.
    pub step: u64,
    /// The directory.
    pub path: PathBuf,
    /// True if the directory holds a committed manifest.
    pub committed: bool,
    /// Bytes of the files in the directory.
    pub bytes: u64,
}

/// What [`CheckpointManager::gc`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Steps deleted.
    pub deleted: Vec<u64>,
    /// Steps retention would delete but a reader (or writer) holds open; kept for now.
    pub in_use: Vec<u64>,
    /// Leftover `.tmp-step-` directories of interrupted saves removed.
    pub interrupted_removed: usize,
    /// Files removed from kept steps: engine files their manifest does not name (part
    /// descriptors and shards of a multi-rank commit killed after its commit point, before
    /// its own cleanup ran; temporary files of earlier dead attempts).
    pub swept: usize,
}

/// A checkpoint opened through the manager: holds a shared lock on its step so that
/// garbage collection leaves it alone while it lives. Dereferences to [`Checkpoint`].
#[derive(Debug)]
pub struct LeasedCheckpoint {
    ckpt: Checkpoint,
    lease: StepLease,
}

impl LeasedCheckpoint {
    /// The step this checkpoint belongs to.
    pub fn step(&self) -> u64 {
        self.lease.step
    }
}

/// A shared hold on a committed step (see [`CheckpointManager::lease`]): while it lives,
/// garbage collection does not delete the step. Readers that open the step's directory by
/// themselves (another binding, another reader API) hold one around their reads.
#[derive(Debug)]
pub struct StepLease {
    step: u64,
    path: PathBuf,
    _lock: File,
}

impl StepLease {
    /// The step held.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The step's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl std::ops::Deref for LeasedCheckpoint {
    type Target = Checkpoint;
    fn deref(&self) -> &Checkpoint {
        &self.ckpt
    }
}

/// A directory of per-step checkpoints with retention and async saves.
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// use ckptstore::manager::{CheckpointManager, Retention};
/// use ckptstore::{SaveOptions, TensorRef};
/// let root = tempfile::tempdir().unwrap();
/// let mgr = CheckpointManager::new(root.path(), Retention { keep_last: 2, keep_every: None })?;
/// let mut w = vec![0f32; 256];
/// for step in [100, 200, 300] {
///     w[0] = step as f32;
///     let handle = mgr.save_async(step, &[TensorRef::from_slice("w", &[256], &w)], None, SaveOptions::default())?;
///     w[1] += 1.0; // the buffers may change as soon as save_async returns
///     handle.wait()?;
/// }
/// assert_eq!(mgr.steps()?, vec![200, 300]);
/// let ck = mgr.open(mgr.latest()?.unwrap())?;
/// assert_eq!(ck.tensor("w")?.as_slice::<f32>()?[0], 300.0);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    root: PathBuf,
    retention: Retention,
    in_flight: Arc<(Mutex<usize>, Condvar)>,
    pool: BufferPool,
    max_in_flight: usize,
}

/// A background save started by [`CheckpointManager::save_async`].
#[derive(Debug)]
pub struct SaveHandle {
    step: u64,
    thread: Option<JoinHandle<Result<CommitInfo>>>,
}

impl SaveHandle {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Wait for the save: `Ok` once the checkpoint is committed and durable (and retention
    /// applied), or the save's error.
    ///
    /// # Errors
    /// Any error of the save ([`Error::Io`] and others).
    pub fn wait(mut self) -> Result<CommitInfo> {
        self.join()
    }

    fn join(&mut self) -> Result<CommitInfo> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument(
                    "the background save panicked".into(),
                ))
            }),
            None => Err(Error::InvalidArgument("already waited".into())),
        }
    }
}

impl Drop for SaveHandle {
    /// Dropping a handle waits for the save (a save is never abandoned half-way).
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.join();
        }
    }
}

/// Owned, gathered copies of tensors: the snapshot an async save writes.
struct Snapshot {
    tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)>,
}

/// Snapshot buffers of finished async saves, reused by the next one: after the first save
/// the snapshot copy runs into memory that is already faulted in.
type BufferPool = Arc<Mutex<Vec<Vec<u8>>>>;

impl Snapshot {
    fn take(tensors: &[TensorRef<'_>], pool: &BufferPool) -> Result<Snapshot> {
        use rayon::prelude::*;
        // Hand each tensor a pooled buffer (largest buffers to largest tensors).
        let mut free = std::mem::take(&mut *pool.lock().unwrap_or_else(|p| p.into_inner()));
        free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(tensors[i].nbytes_hint()));
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); tensors.len()];
        let mut free = free.into_iter();
        for i in order {
            match free.next() {
                Some(b) => bufs[i] = b,
                None => break,
            }
        }
        let tensors = tensors
            .par_iter()
            .zip(bufs)
            .map(|(t, buf)| {
                Ok((
                    t.name().to_string(),
                    t.dtype(),
                    t.shape().to_vec(),
                    t.gather_into(buf)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Snapshot { tensors })
    }

    fn recycle(self, pool: &BufferPool) {
        let mut p = pool.lock().unwrap_or_else(|p| p.into_inner());
        p.clear();
        p.extend(self.tensors.into_iter().map(|t| t.3));
    }

    fn refs(&self) -> Vec<TensorRef<'_>> {
        self.tensors
            .iter()
            .map(|(n, d, s, b)| TensorRef::new(n.as_str(), *d, s, b))
            .collect()
    }
}

pub(crate) fn step_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:08}")
}

pub(crate) fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_PREFIX)?;
    if digits.len() < 8 || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

impl CheckpointManager {
    /// A manager over `root` (created if missing), at most one save in flight.
    ///
    /// # Errors
    /// [`Error::Io`] if `root` cannot be created; [`Error::InvalidArgument`] for
    /// `keep_last == 0` or `keep_every == Some(0)`.
    pub fn new(root: impl AsRef<Path>, retention: Retention) -> Result<Self> {
        if retention.keep_last == 0 || retention.keep_every == Some(0) {
            return Err(Error::InvalidArgument(
                "retention must keep at least the last step".into(),
            ));
        }
        let root = crate::location::local_path(root.as_ref(), "CheckpointManager::new")?;
        local::prepare_dir(&root)?;
        Ok(CheckpointManager {
            root,
            retention,
            in_flight: Arc::new((Mutex::new(0), Condvar::new())),
            pool: Arc::default(),
            max_in_flight: 1,
        })
    }

    /// Allow up to `n` saves in flight (default 1): `save_async` blocks while `n` are.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of `step`.
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(step_name(step))
    }

    /// Every step directory, committed or not, and leftover interrupted saves, sorted by step.
    ///
    /// # Errors
    /// [`Error::Io`] if the root cannot be listed.
    pub fn list(&self) -> Result<Vec<StepEntry>> {
        let rd = std::fs::read_dir(&self.root).map_err(|e| Error::io("list", &self.root, e))?;
        let mut out = Vec::new();
        for e in rd.flatten() {
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            let path = e.path();
            if !path.is_dir() {
                continue;
            }
            if let Some(step) = parse_step(&name) {
                let committed = path.join(MANIFEST_FILE).is_file();
                out.push(StepEntry {
                    step,
                    bytes: dir_bytes(&path),
                    path,
                    committed,
                });
            } else if let Some(rest) = name.strip_prefix(TMP_STEP_PREFIX) {
                if let Some(step) = rest.split('-').next().and_then(|s| s.parse().ok()) {
                    out.push(StepEntry {
                        step,
                        bytes: dir_bytes(&path),
                        path,
                        committed: false,
                    });
                }
            }
        }
        out.sort_by(|a, b| (a.step, &a.path).cmp(&(b.step, &b.path)));
        Ok(out)
    }

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// [`Error::Io`] if the root cannot be listed.
    pub fn steps(&self) -> Result<Vec<u64>> {
        Ok(self
            .list()?
            .into_iter()
            .filter(|e| e.committed)
            .map(|e| e.step)
            .collect())
    }

    /// The newest committed step.
    ///
    /// # Errors
    /// [`Error::Io`] if the root cannot be listed.
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.steps()?.last().copied())
    }

    /// Open a committed step, holding it against garbage collection while the returned
    /// checkpoint lives.
    ///
    /// # Errors
    /// [`Error::NotFound`] if the step is not committed; the errors of [`Checkpoint::open`].
    pub fn open(&self, step: u64) -> Result<LeasedCheckpoint> {
        let lease = self.lease(step)?;
        let ckpt = Checkpoint::open(&lease.path)?;
        Ok(LeasedCheckpoint { ckpt, lease })
    }

    /// Hold committed step `step` against garbage collection (a shared lock on its
    /// `.ckpt-lock`) without opening it: for readers that open the directory by other
    /// means. The step is checked to be committed once the lock is held, so a step that
    /// `gc` deleted in between is reported as not found.
    ///
    /// # Errors
    /// [`Error::NotFound`] if the step is not committed; [`Error::Io`] if the lock cannot
    /// be taken.
    pub fn lease(&self, step: u64) -> Result<StepLease> {
        let dir = self.step_dir(step);
        let lock_path = dir.join(LOCK_FILE);
        let not_found = || Error::NotFound {
            path: dir.clone(),
            reason: format!("step {step} is not committed"),
        };
        let lock = OpenOptions::new()
            .read(true)
            .open(&lock_path)
            .map_err(|_| not_found())?;
        lock.lock_shared()
            .map_err(|e| Error::io("lock (shared)", &lock_path, e))?;
        // gc deletes the manifest first, under the exclusive lock: a manifest seen now,
        // with the shared lock held, stays until the lease is dropped.
        if !dir.join(MANIFEST_FILE).is_file() {
            return Err(not_found());
        }
        Ok(StepLease {
            step,
            path: dir,
            _lock: lock,
        })
    }

    /// Restore `state` from the newest committed step (see
    /// [`OptimizerState::restore_from`]). Returns the step, or `None` if there is none.
    ///
    /// # Errors
    /// As [`OptimizerState::restore_from`]; on error `state` is unchanged.
    pub fn restore_latest(
        &self,
        state: &mut OptimizerState,
        layout: &StateLayout,
    ) -> Result<Option<u64>> {
        let Some(step) = self.latest()? else {
            return Ok(None);
        };
        let ck = self.open(step)?;
        state.restore_from(&ck, layout)?;
        Ok(Some(step))
    }

    /// Save `tensors` (and optionally an optimizer state) as `step`, blocking until it is
    /// committed and durable, then apply retention.
    ///
    /// # Errors
    /// The errors of [`crate::save`]; on error no step directory appears (an existing
    /// committed `step` is replaced atomically or kept).
    pub fn save(
        &self,
        step: u64,
        tensors: &[TensorRef<'_>],
        optimizer: Option<&OptimizerState>,
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let optimizer = optimizer.map(OptimizerState::as_borrowed);
        self.save_with(step, tensors, optimizer.as_ref(), opts)
    }

    /// [`CheckpointManager::save`] with the optimizer state over borrowed tensors (see
    /// [`OptimizerStateRef`]): what bindings that keep their tensors elsewhere (NumPy,
    /// PyTorch) call, without copying them first.
    ///
    /// # Errors
    /// As [`CheckpointManager::save`].
    pub fn save_with(
        &self,
        step: u64,
        tensors: &[TensorRef<'_>],
        optimizer: Option<&OptimizerStateRef<'_>>,
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let info = self.save_step(step, tensors, optimizer, opts)?;
        self.gc()?;
        Ok(info)
    }

    fn save_step(
        &self,
        step: u64,
        tensors: &[TensorRef<'_>],
        optimizer: Option<&OptimizerStateRef<'_>>,
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let final_dir = self.step_dir(step);
        let (tensors, section) = match optimizer {
            Some(o) => {
                let (t, s) = o.to_parts(tensors)?;
                (t, Some(s))
            }
            None => (tensors.to_vec(), None),
        };
        // Free the space of interrupted saves before writing this one (a save that failed
        // for lack of space must not make the next one fail too).
        let root_lock = self.lock_root()?;
        self.remove_interrupted_locked(&[]);
        if final_dir.join(MANIFEST_FILE).is_file() {
            // Re-saving a committed step: the directory's own atomic replace.
            drop(root_lock);
            return write::save_locked(&final_dir, &tensors, opts, section);
        }
        let mut rnd = [0u8; 8];
        getrandom::fill(&mut rnd)
            .map_err(|e| Error::io("getrandom", "", std::io::Error::other(e.to_string())))?;
        let tmp = self.root.join(format!(
            "{TMP_STEP_PREFIX}{step}-{}",
            rnd.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ));
        if final_dir.exists() {
            // An uncommitted leftover (a gc that stopped half-way): clear it first.
            remove_step_dir(&final_dir, false).map_err(|e| Error::io("remove", &final_dir, e))?;
        }
        local::prepare_dir(&tmp)?;
        // The writer lock is held until the rename: gc never removes a directory whose
        // lock is held, so it cannot take this one for an interrupted save (nor before it is
        // held: the root lock covers the creation).
        let lock = write::lock_dir(&tmp)?;
        drop(root_lock);
        let store = crate::store::LocalStore::std(&tmp);
        let info = match write::save_impl(&store, &tensors, opts, section) {
            Ok(info) => info,
            Err(e) => {
                // Nothing was committed: the directory is ours (we hold its lock) and holds
                // no file of the failed save any more; remove it.
                let _ = remove_locked_step_dir(&tmp, lock);
                return Err(e);
            }
        };
        std::fs::rename(&tmp, &final_dir).map_err(|e| Error::io("rename", &tmp, e))?;
        File::open(&self.root)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io("fsync directory", &self.root, e))?;
        drop(lock);
        Ok(info)
    }

    /// Take the root's lock (blocking; held only for short steps, see [`ROOT_LOCK`]).
    fn lock_root(&self) -> Result<File> {
        local::lock_file(&self.root.join(ROOT_LOCK), Lock::Exclusive)
    }

    /// Remove the directories of interrupted saves (`.tmp-step-` directories, and `step-`
    /// directories without a committed manifest) that no writer holds; returns how many
    /// were removed. A directory whose lock is held (a save in progress) is skipped, and so
    /// is one found committed once its lock is taken, and those in `skip`. The caller holds
    /// the root's lock.
    fn remove_interrupted_locked(&self, skip: &[PathBuf]) -> usize {
        let Ok(entries) = self.list() else {
            return 0;
        };
        // A `step-` directory without a manifest that is newer than every committed step
        // may be a multi-rank save whose ranks have written their parts and whose commit
        // is still to come (format-spec/global.md): it is kept until a newer step commits.
        let newest = entries.iter().filter(|e| e.committed).map(|e| e.step).max();
        entries
            .iter()
            .filter(|e| !e.committed && !skip.contains(&e.path))
            .filter(|e| {
                let multi_rank_in_progress = parse_step_dir(&e.path).is_some()
                    && newest.is_none_or(|n| e.step > n)
                    && has_part_files(&e.path);
                !multi_rank_in_progress
            })
            // A `.tmp-step-` directory may hold a committed manifest of its own (a save
            // killed between its commit and the rename into place): once its lock is
            // ours its writer is gone, and it is removed all the same.
            .filter(|e| {
                let tmp = parse_step_dir(&e.path).is_none();
                matches!(remove_step_dir(&e.path, tmp), Ok(true))
            })
            .count()
    }

    /// Commit step `step` of a multi-rank save (format-spec/global.md): every rank has
    /// written its part into [`CheckpointManager::step_dir`] with
    /// [`crate::write::parts::write_part`]; this commits them (manifest last), then applies
    /// retention as [`CheckpointManager::save`] does. The step is committed only when its
    /// manifest is: until then `steps`, `latest` and `ckpt ls` do not count it.
    ///
    /// # Errors
    /// The errors of [`crate::write::parts::commit`] (nothing is committed); retention
    /// errors as [`CheckpointManager::gc`].
    pub fn commit_parts(
        &self,
        step: u64,
        checkpoint_id: &str,
        parts: &[crate::write::parts::Part],
        opts: &crate::write::parts::CommitOptions,
    ) -> Result<CommitInfo> {
        let info = crate::write::parts::commit(self.step_dir(step), checkpoint_id, parts, opts)?;
        self.gc()?;
        Ok(info)
    }

    /// Start saving `step` in the background and return as soon as the data is snapshot:
    /// the tensors (and the optimizer state) are copied into buffers the save owns, so the
    /// caller may change its own buffers as soon as this returns. Blocks first while the
    /// maximum number of saves is in flight.
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] for an inconsistent tensor (nothing is started). Errors of
    /// the save itself come from [`SaveHandle::wait`].
    pub fn save_async(
        &self,
        step: u64,
        tensors: &[TensorRef<'_>],
        optimizer: Option<&OptimizerState>,
        opts: SaveOptions,
    ) -> Result<SaveHandle> {
        {
            let (lock, cv) = &*self.in_flight;
            let mut n = lock.lock().unwrap_or_else(|p| p.into_inner());
            while *n >= self.max_in_flight {
                n = cv.wait(n).unwrap_or_else(|p| p.into_inner());
            }
            *n += 1;
        }
        let release = Release(self.in_flight.clone());
        let snapshot = Snapshot::take(tensors, &self.pool)?;
        let optimizer = optimizer.cloned();
        let mgr = self.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ckpt-save-{step}"))
            .spawn(move || {
                let _release = release;
                let refs = snapshot.refs();
                let r = mgr.save(step, &refs, optimizer.as_ref(), &opts);
                drop(refs);
                snapshot.recycle(&mgr.pool);
                r
            })
            .map_err(|e| Error::io("spawn save thread", "", e))?;
        Ok(SaveHandle {
            step,
            thread: Some(thread),
        })
    }

    /// Apply retention: delete committed steps that retention does not keep, unless a
    /// reader or writer holds them (those are reported and kept for a later `gc`), and
    /// remove leftover directories of interrupted saves that no writer holds. Deletes only
    /// files the engine creates; a directory holding anything else is left in place.
    ///
    /// # Errors
    /// [`Error::Io`] if the root cannot be listed.
    pub fn gc(&self) -> Result<GcReport> {
        let entries = self.list()?;
        let committed: Vec<u64> = entries
            .iter()
            .filter(|e| e.committed)
            .map(|e| e.step)
            .collect();
        let keep_from = committed.len().saturating_sub(self.retention.keep_last);
        let mut report = GcReport::default();
        let mut deleted = Vec::new();
        for e in &entries {
            if !e.committed {
                continue; // interrupted saves: below, under the root's lock
            }
            let newest = committed[keep_from..].contains(&e.step);
            let every = self.retention.keep_every.is_some_and(|m| e.step % m == 0);
            if newest || every {
                report.swept += sweep_kept_step(&e.path);
                continue;
            }
            match remove_step_dir(&e.path, true) {
                Ok(true) => {
                    report.deleted.push(e.step);
                    deleted.push(e.path.clone());
                }
                Ok(false) => report.in_use.push(e.step),
                Err(_) => {}
            }
        }
        let root_lock = self.lock_root()?;
        // (Steps just deleted are not counted again where a user's file kept the directory.)
        report.interrupted_removed = self.remove_interrupted_locked(&deleted);
        drop(root_lock);
        Ok(report)
    }
}

/// Give back an in-flight slot when the background save ends (or fails to start).
struct Release(Arc<(Mutex<usize>, Condvar)>);

impl Drop for Release {
    fn drop(&mut self) {
        let (lock, cv) = &*self.0;
        let mut n = lock.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        cv.notify_all();
    }
}

/// The step of a `step-` directory (not a `.tmp-step-` one).
fn parse_step_dir(dir: &Path) -> Option<u64> {
    parse_step(dir.file_name()?.to_str()?)
}

/// True if `dir` holds part descriptors of a multi-rank save.
fn has_part_files(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("part-") && n.ends_with(".json"))
        })
    })
}

/// Delete a step directory if nobody holds its lock: returns `Ok(false)` if it is in use,
/// or if it was listed as uncommitted (`committed` false) but holds a committed manifest
/// once its lock is taken (a save committed it meanwhile). Only engine files (manifest,
/// shards, temp files, lock) are removed; the directory itself only if that leaves it empty.
fn remove_step_dir(dir: &Path, committed: bool) -> std::io::Result<bool> {
    let lock_path = dir.join(LOCK_FILE);
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(false),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
    }
    if !committed && dir.join(MANIFEST_FILE).exists() {
        return Ok(false);
    }
    remove_locked_step_dir(dir, lock)?;
    Ok(true)
}

/// Remove from the kept, committed step `dir` the engine files its manifest does not name,
/// under the step's writer lock (skipped, 0, while anyone holds it: a reader's lease, a
/// save). These are left by a commit killed after its commit point and before its own
/// cleanup (format-spec/durability.md §Cleanup): the committed checkpoint's part
/// descriptors, and shards, parts and temporary files of earlier attempts. Only files not
/// newer than the manifest go: a later writer's files are its own. Returns how many were
/// removed; failures leave garbage, never damage (no manifest names what is removed).
fn sweep_kept_step(dir: &Path) -> usize {
    let Ok(lock) = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join(LOCK_FILE))
    else {
        return 0;
    };
    if lock.try_lock().is_err() {
        return 0;
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    let Ok(committed_at) = std::fs::metadata(&manifest_path).and_then(|m| m.modified()) else {
        return 0;
    };
    let Some(m) = crate::checkpoint::read_capped(&manifest_path, crate::format::MAX_MANIFEST_SIZE)
        .ok()
        .and_then(|b| crate::format::manifest::decode(&b).ok())
    else {
        return 0; // a damaged manifest: leave everything for `verify` to report
    };
    let keep: std::collections::HashSet<&str> = m.shards.iter().map(|s| s.file.as_str()).collect();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if !write::is_engine_file(&name) || keep.contains(name.as_str()) {
            continue;
        }
        let old = e
            .metadata()
            .and_then(|md| md.modified())
            .is_ok_and(|t| t <= committed_at);
        if old && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        let _ = File::open(dir).and_then(|d| d.sync_all());
    }
    drop(lock);
    removed
}

/// Delete a step directory whose lock `lock` the caller holds (see [`remove_step_dir`]).
fn remove_locked_step_dir(dir: &Path, lock: File) -> std::io::Result<()> {
    let lock_path = dir.join(LOCK_FILE);
    // The manifest goes first: from then on the step is not committed for anyone.
    let _ = std::fs::remove_file(dir.join(MANIFEST_FILE));
    for e in std::fs::read_dir(dir)?.flatten() {
        if let Ok(name) = e.file_name().into_string() {
            if write::is_engine_file(&name) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_file(&lock_path);
    drop(lock);
    let _ = std::fs::remove_dir(dir);
    if let Some(parent) = dir.parent() {
        let _ = File::open(parent).and_then(|d| d.sync_all());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A save killed after committing its manifest inside its `.tmp-step-` directory (before
    /// the rename into place) leaves a directory with a manifest: still an interrupted save,
    /// not a step, and the next `gc` removes it.
    #[test]
    fn gc_removes_a_tmp_step_with_a_committed_manifest() {
        let root = tempfile::tempdir().unwrap();
        let mgr = CheckpointManager::new(root.path(), Retention::keep_last(2)).unwrap();
        let w = vec![1f32; 8];
        mgr.save(
            1,
            &[TensorRef::from_slice("w", &[8], &w)],
            None,
            &SaveOptions::default(),
        )
        .unwrap();
        let tmp = root.path().join(format!("{TMP_STEP_PREFIX}2-00ff"));
        crate::save(
            &tmp,
            &[TensorRef::from_slice("w", &[8], &w)],
            &SaveOptions::default(),
        )
        .unwrap();
        assert!(tmp.join(MANIFEST_FILE).is_file());
        assert_eq!(mgr.steps().unwrap(), vec![1]);
        assert_eq!(mgr.gc().unwrap().interrupted_removed, 1);
        assert!(!tmp.exists());
        assert_eq!(mgr.steps().unwrap(), vec![1]);
    }
}
