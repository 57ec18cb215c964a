//! A checkpoint manager for training loops: one committed checkpoint per step under a root
//! (a local directory or an object-store prefix), `latest()`, retention with garbage
//! collection that never pulls a checkpoint from under a reader, and asynchronous saves
//! with a bounded number in flight.
//!
//! One [`CheckpointManager`] serves every store; what depends on the store lives behind a
//! small private seam (`StepStore`), implemented for a local directory (`local.rs`) and an
//! object-store prefix (`remote.rs`). The retention rule, the async machinery, restores and
//! multi-rank commits are written once, here.
//!
//! Layout (format-spec/durability.md §Manager, format-spec/s3.md §Manager):
//! `ROOT/step-<step, 8+ digits>/` is a normal ckptstore checkpoint. A step counts as
//! committed once its own manifest is.
//!
//! * **Local directory.** A step is written into `ROOT/.tmp-step-<step>-<id>/` and renamed
//!   into place once its manifest is committed, then `ROOT` is fsynced: a step directory
//!   exists only when committed, and an interrupted save leaves only a `.tmp-step-`
//!   directory that `steps()` ignores and the next save (before writing) or `gc()` removes;
//!   a save that fails removes its own. Readers opened through [`CheckpointManager::open`]
//!   hold a shared lock on the step's `.ckpt-lock`; garbage collection takes that lock
//!   exclusively before deleting a step and skips steps it cannot lock. So a step a live
//!   reader has open is never deleted; it goes at the first `gc()` after the reader is
//!   dropped.
//! * **Object store.** A step is written under its prefix with the object-store commit
//!   protocol (the manifest object last). Nothing locks a prefix: there are no reader
//!   leases (readers of [`CheckpointManager::open`] download the whole step at open, so
//!   retention cannot pull bytes from under them; a lazy reader of a step deleted meanwhile
//!   gets an error naming the missing object, never other bytes), and `gc` skips the steps
//!   this manager is saving but cannot see saves of other processes: run one writer per
//!   root.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::checkpoint::Checkpoint;
use crate::checkpoint::Storage;
use crate::error::{Error, Result};
use crate::location::{IntoLocation, Location};
use crate::optim::{OptimizerState, OptimizerStateRef, StateLayout};
use crate::write::parts::{CommitOptions, Part};
use crate::write::{CommitInfo, SaveOptions, TensorRef};
use crate::DType;
pub use save::SaveHandle;
use save::*;
pub use steps::StepEntry;
use steps::*;

mod local;
#[cfg(feature = "s3")]
mod remote;
mod save;
mod steps;

const STEP_PREFIX: &str = "step-";

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

/// A checkpoint opened through the manager: holds its step's lease
/// ([`CheckpointManager::lease`]) while it lives. Dereferences to [`Checkpoint`] over
/// [`Storage`]: memory maps of a local step, buffers downloaded from an object store.
#[derive(Debug)]
pub struct LeasedCheckpoint {
    ckpt: Checkpoint<Storage>,
    lease: StepLease,
}

impl LeasedCheckpoint {
    /// The step this checkpoint belongs to.
    pub fn step(&self) -> u64 {
        self.lease.step
    }
}

impl std::ops::Deref for LeasedCheckpoint {
    type Target = Checkpoint<Storage>;
    fn deref(&self) -> &Checkpoint<Storage> {
        &self.ckpt
    }
}

/// A hold on a committed step (see [`CheckpointManager::lease`]). In a local root it is a
/// shared lock on the step's `.ckpt-lock`, and while it lives garbage collection (of any
/// process) does not delete the step; readers that open the step's directory by themselves
/// (another binding, another reader API) hold one around their reads. An object store has
/// no locks: there the lease only says that the step was committed when it was taken.
#[derive(Debug)]
pub struct StepLease {
    step: u64,
    location: Location,
    _lock: Option<std::fs::File>,
}

impl StepLease {
    /// The step held.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The step's directory or prefix URL.
    pub fn location(&self) -> &Location {
        &self.location
    }

    /// The step's directory (`None` on an object store).
    pub fn path(&self) -> Option<&Path> {
        match &self.location {
            Location::Local(p) => Some(p),
            Location::Remote(_) => None,
        }
    }
}

/// The steps of a training run under a local directory or an object-store prefix, with
/// retention and async saves.
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
/// assert_eq!(ck.read("w").view()?.as_slice::<f32>()?[0], 300.0);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    steps: Arc<dyn StepStore>,
    retention: Retention,
    /// Steps this manager is saving now (garbage collection leaves them alone).
    saving: Arc<Mutex<Vec<u64>>>,
    in_flight: Arc<(Mutex<usize>, Condvar)>,
    pool: BufferPool,
    max_in_flight: usize,
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

fn check_retention(retention: &Retention) -> Result<()> {
    if retention.keep_last == 0 || retention.keep_every == Some(0) {
        return Err(Error::InvalidArgument(
            "retention must keep at least one step (keep_last >= 1, keep_every >= 1)".into(),
        ));
    }
    Ok(())
}

impl CheckpointManager {
    /// A manager over `root`, a local directory (created if missing) or an object-store
    /// prefix (`s3://bucket/run`, configured from the environment as
    /// [`crate::store::s3::S3Config::try_from_env`]; no request is made yet); at most one
    /// save in flight.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `keep_last == 0` or `keep_every == Some(0)`;
    /// [`Error::UnsupportedUrl`] for a URL this build cannot serve; [`Error::Io`] if a
    /// local `root` cannot be created; [`Error::InvalidArgument`] or [`Error::Remote`] for
    /// an invalid object-store configuration.
    pub fn new(root: impl IntoLocation, retention: Retention) -> Result<Self> {
        check_retention(&retention)?;
        let steps: Arc<dyn StepStore> = match root.into_location()? {
            Location::Local(p) => Arc::new(local::LocalSteps::new(&p)?),
            #[cfg(feature = "s3")]
            Location::Remote(u) => Arc::new(remote::RemoteSteps::new(
                crate::store::s3::Remote::new(&u, &crate::store::s3::S3Config::try_from_env()?)?,
            )),
            #[cfg(not(feature = "s3"))]
            Location::Remote(u) => return Err(crate::store::no_s3(&u)),
        };
        Ok(Self::over(steps, retention))
    }

    /// A manager over the local directory `root` (created if missing) whose step
    /// directories are written and published through `fs` instead of the real file system:
    /// the seam the crash enumeration of a whole step save runs through
    /// (tests/manager_crash.rs), as [`crate::store::LocalStore::new`] is for one checkpoint.
    /// Steps re-saved in place take no writer lock; everything else (leases, retention,
    /// gc) runs on the real file system.
    ///
    /// # Errors
    /// As [`CheckpointManager::new`].
    #[doc(hidden)]
    pub fn on_fs<F: crate::store::fs::Fs + Send + std::fmt::Debug + 'static>(
        root: &Path,
        fs: F,
        retention: Retention,
    ) -> Result<Self> {
        check_retention(&retention)?;
        let steps = local::LocalSteps::on_fs(root, fs, true)?;
        Ok(Self::over(Arc::new(steps), retention))
    }

    /// A manager over the prefix of a connected object store (its own configuration).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `keep_last == 0` or `keep_every == Some(0)`.
    #[cfg(feature = "s3")]
    pub fn remote(root: crate::store::s3::Remote, retention: Retention) -> Result<Self> {
        check_retention(&retention)?;
        Ok(Self::over(
            Arc::new(remote::RemoteSteps::new(root)),
            retention,
        ))
    }

    fn over(steps: Arc<dyn StepStore>, retention: Retention) -> Self {
        CheckpointManager {
            steps,
            retention,
            saving: Arc::default(),
            in_flight: Arc::new((Mutex::new(0), Condvar::new())),
            pool: Arc::default(),
            max_in_flight: 1,
        }
    }

    /// Allow up to `n` saves in flight (default 1): `save_async` blocks while `n` are.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }

    /// The root directory or prefix URL.
    pub fn location(&self) -> Location {
        self.steps.root()
    }

    /// The root directory of a local manager.
    ///
    /// # Errors
    /// [`Error::UnsupportedUrl`] for a manager on an object store.
    pub fn root(&self) -> Result<PathBuf> {
        Ok(self
            .location()
            .local("CheckpointManager::root")?
            .to_path_buf())
    }

    /// Where `step` lives once committed: its directory or prefix URL.
    pub fn location_of(&self, step: u64) -> Location {
        self.steps.location_of(step)
    }

    /// The directory of `step` in a local manager (for ranks writing their parts,
    /// [`crate::write_part`]).
    ///
    /// # Errors
    /// [`Error::UnsupportedUrl`] for a manager on an object store (use
    /// [`CheckpointManager::location_of`]).
    pub fn step_dir(&self, step: u64) -> Result<PathBuf> {
        Ok(self
            .location_of(step)
            .local("CheckpointManager::step_dir")?
            .to_path_buf())
    }

    /// Every step, committed or not, and leftovers of interrupted saves, sorted by step.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`] if the root cannot be listed.
    pub fn list(&self) -> Result<Vec<StepEntry>> {
        self.steps.list()
    }

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// As [`CheckpointManager::list`].
    pub fn steps(&self) -> Result<Vec<u64>> {
        let mut v: Vec<u64> = self
            .list()?
            .into_iter()
            .filter(|e| e.committed)
            .map(|e| e.step)
            .collect();
        v.dedup();
        Ok(v)
    }

    /// The newest committed step.
    ///
    /// # Errors
    /// As [`CheckpointManager::list`].
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.steps()?.last().copied())
    }

    /// Open a committed step, holding its lease while the returned checkpoint lives: local
    /// steps are memory-mapped (and kept from garbage collection), steps on an object store
    /// downloaded whole.
    ///
    /// # Errors
    /// [`Error::NotFound`] if the step is not committed; the errors of [`crate::open`].
    pub fn open(&self, step: u64) -> Result<LeasedCheckpoint> {
        let lease = self.lease(step)?;
        let ckpt = self.steps.open(&lease)?;
        Ok(LeasedCheckpoint { ckpt, lease })
    }

    /// Open the newest committed step: `None` if there is none.
    ///
    /// # Errors
    /// As [`CheckpointManager::open`].
    pub fn open_latest(&self) -> Result<Option<LeasedCheckpoint>> {
        match self.latest()? {
            Some(s) => Ok(Some(self.open(s)?)),
            None => Ok(None),
        }
    }

    /// Hold committed step `step` against garbage collection without opening it
    /// ([`StepLease`]): for readers that open it by other means. The step is checked to
    /// be committed once the lease is held, so a step that `gc` deleted in between is
    /// reported as not found.
    ///
    /// # Errors
    /// [`Error::NotFound`] if the step is not committed; [`Error::Io`] if the lock cannot
    /// be taken; [`Error::Remote`].
    pub fn lease(&self, step: u64) -> Result<StepLease> {
        self.steps.lease(step)
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
        let Some(ck) = self.open_latest()? else {
            return Ok(None);
        };
        state.restore_from(&ck, layout)?;
        Ok(Some(ck.step()))
    }

    /// Save `tensors` (and optionally an optimizer state, over borrowed tensors:
    /// [`OptimizerState::as_borrowed`] of an owned one) as `step`, blocking until it is
    /// committed and durable, then apply retention.
    ///
    /// # Errors
    /// The errors of [`crate::save`]; on error no step appears (an existing committed
    /// `step` is replaced atomically or kept). Once the step is committed this returns
    /// `Ok`: a retention that fails leaves what it could not delete for the next `gc`.
    pub fn save(
        &self,
        step: u64,
        tensors: &[TensorRef<'_>],
        optimizer: Option<&OptimizerStateRef<'_>>,
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let (tensors, opts) = match optimizer {
            Some(o) => {
                let (t, s) = o.to_parts(tensors)?;
                let opts = SaveOptions {
                    optimizer: Some(s),
                    ..opts.clone()
                };
                (t, opts)
            }
            None => (tensors.to_vec(), opts.clone()),
        };
        let info = {
            let _saving = Saving::new(&self.saving, step);
            self.steps.save(step, &tensors, &opts)?
        };
        let _ = self.gc();
        Ok(info)
    }

    /// Commit step `step` of a multi-rank save (format-spec/global.md): every rank has
    /// written its part into [`CheckpointManager::location_of`] with
    /// [`crate::write_part`] (or its object-store twin); this commits them
    /// (manifest last), then applies retention as [`CheckpointManager::save`] does. The
    /// step is committed only when its manifest is: until then `steps`, `latest` and
    /// `ckpt ls` do not count it.
    ///
    /// # Errors
    /// The errors of [`crate::commit`] (nothing is committed).
    pub fn commit_parts(
        &self,
        step: u64,
        checkpoint_id: &str,
        parts: &[Part],
        opts: &CommitOptions,
    ) -> Result<CommitInfo> {
        let info = {
            let _saving = Saving::new(&self.saving, step);
            self.steps.commit_parts(step, checkpoint_id, parts, opts)?
        };
        let _ = self.gc();
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
        // Marked as saving from now on, so that a gc started meanwhile leaves the step
        // alone (an object store has no lock that would).
        let saving = Saving::new(&self.saving, step);
        let snapshot = Snapshot::take(tensors, &self.pool)?;
        let optimizer = optimizer.cloned();
        let mgr = self.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ckpt-save-{step}"))
            .spawn(move || {
                let _release = release;
                let refs = snapshot.refs();
                let borrowed = optimizer.as_ref().map(OptimizerState::as_borrowed);
                let r = mgr.save(step, &refs, borrowed.as_ref(), &opts);
                drop(borrowed);
                drop(saving);
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
    /// lease holds them (those are reported and kept for a later `gc`); in the steps kept,
    /// remove engine files their manifest does not name; remove leftovers of interrupted
    /// saves, except steps this manager is saving. Deletes only files (objects) the engine
    /// creates; a directory holding anything else is left in place.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`] if the root cannot be listed or a step cannot be
    /// deleted (the rest of the sweep still runs; the first error is returned). Nothing
    /// committed and kept is damaged by a failure.
    pub fn gc(&self) -> Result<GcReport> {
        let entries = self.list()?;
        let committed: Vec<u64> = entries
            .iter()
            .filter(|e| e.committed)
            .map(|e| e.step)
            .collect();
        let keep_from = committed.len().saturating_sub(self.retention.keep_last);
        let mut report = GcReport::default();
        let mut skip = Skip {
            saving: self
                .saving
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .copied()
                .collect(),
            deleted: Vec::new(),
        };
        let mut first_err = None;
        // A committed step being saved again is left alone: its new files are not named
        // by the manifest yet.
        let settled = entries
            .iter()
            .filter(|e| e.committed && !skip.saving.contains(&e.step));
        for e in settled {
            let newest = committed[keep_from..].contains(&e.step);
            let every = self.retention.keep_every.is_some_and(|m| e.step % m == 0);
            let r = if newest || every {
                self.steps.sweep(e).map(|n| report.swept += n)
            } else {
                self.steps.delete(e).map(|deleted| {
                    if deleted {
                        report.deleted.push(e.step);
                        skip.deleted.push(e.location.clone());
                    } else {
                        report.in_use.push(e.step);
                    }
                })
            };
            if let Err(err) = r {
                first_err.get_or_insert(err);
            }
        }
        match self.steps.remove_interrupted(&entries, &skip) {
            Ok(n) => report.interrupted_removed = n,
            Err(err) => {
                first_err.get_or_insert(err);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(report),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(step: u64, committed: bool) -> StepEntry {
        StepEntry {
            step,
            location: Location::Local(PathBuf::from(format!("/r/{}", step_name(step)))),
            committed,
            bytes: 0,
        }
    }

    fn picked(entries: &[StepEntry], skip: &Skip, parts: &[u64]) -> Vec<u64> {
        interrupted(entries, skip, |e| parts.contains(&e.step))
            .map(|e| e.step)
            .collect()
    }

    /// Uncommitted steps are leftovers, except steps being saved, steps just deleted, and
    /// a multi-rank save newer than every committed step whose parts are written.
    #[test]
    fn interrupted_saves_are_picked_by_the_rule() {
        let entries = [
            entry(1, false),
            entry(2, true),
            entry(3, false),
            entry(4, true),
            entry(5, false),
            entry(6, false),
        ];
        let none = Skip::default();
        assert_eq!(picked(&entries, &none, &[]), [1, 3, 5, 6]);
        // Parts of an older step are leftovers; of a newer one, a commit still to come.
        assert_eq!(picked(&entries, &none, &[3, 6]), [1, 3, 5]);
        let skip = Skip {
            saving: [5].into(),
            deleted: vec![entries[0].location.clone()],
        };
        assert_eq!(picked(&entries, &skip, &[]), [3, 6]);
        // With nothing committed yet, every step with parts may be a commit to come.
        let fresh = [entry(7, false), entry(8, false)];
        assert_eq!(picked(&fresh, &none, &[8]), [7]);
    }

    #[test]
    fn retention_must_keep_a_step() {
        let dir = tempfile::tempdir().unwrap();
        for r in [
            Retention::keep_last(0),
            Retention {
                keep_last: 1,
                keep_every: Some(0),
            },
        ] {
            assert!(matches!(
                CheckpointManager::new(dir.path(), r),
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
