//! A manager root in a local directory: steps as directories, written under
//! `.tmp-step-<step>-<id>/` and renamed into place, leases as shared locks on a step's
//! `.ckpt-lock` (format-spec/durability.md §Manager).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use super::{interrupted, parse_step, step_name, Skip, StepEntry, StepLease, StepStore};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::Storage;
use crate::error::{Error, Result};
use crate::format::manifest::MANIFEST_FILE;
use crate::location::Location;
use crate::store::fs::{Fs, StdFs};
use crate::store::local::{self, Lock};
use crate::store::publish::publish_dir;
use crate::store::LocalStore;
use crate::write::parts::{CommitOptions, Part};
use crate::write::{self, CommitInfo, SaveOptions, TensorRef, LOCK_FILE};

const TMP_STEP_PREFIX: &str = ".tmp-step-";
/// The root's lock: held (briefly) while a save creates and locks its `.tmp-step-`
/// directory, and while interrupted saves are removed, so that a directory just created is
/// never taken for an interrupted one before its writer has locked it.
const ROOT_LOCK: &str = ".ckpt-manager-lock";

/// Steps under a local directory, written and published through the file system `F`
/// ([`StdFs`], or a fault-injecting one: tests/manager_crash.rs).
#[derive(Debug)]
pub(super) struct LocalSteps<F: Fs = StdFs> {
    root: PathBuf,
    fs: F,
    /// `fs` is a substitute (the seam): a step re-saved in place goes through it too,
    /// without the directory's writer lock.
    seam: bool,
}

impl LocalSteps<StdFs> {
    /// Steps under `root` (created if missing).
    pub(super) fn new(root: &Path) -> Result<Self> {
        Self::on_fs(root, StdFs, false)
    }
}

impl<F: Fs> LocalSteps<F> {
    /// Steps under `root` (created if missing) through `fs`.
    pub(super) fn on_fs(root: &Path, fs: F, seam: bool) -> Result<Self> {
        let root = crate::location::local_path(root, "CheckpointManager::new")?;
        local::prepare_dir(&root)?;
        Ok(LocalSteps { root, fs, seam })
    }

    fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(step_name(step))
    }

    /// Take the root's lock (blocking; held only for short steps, see [`ROOT_LOCK`]).
    fn lock_root(&self) -> Result<File> {
        local::lock_file(&self.root.join(ROOT_LOCK), Lock::Exclusive)
    }

    /// Remove the interrupted saves `interrupted` picks that no writer holds; how many.
    /// A directory whose lock is held (a save in progress) is skipped, and so is one found
    /// committed once its lock is taken. The caller holds the root's lock.
    fn remove_interrupted_locked(&self, entries: &[StepEntry], skip: &Skip) -> usize {
        interrupted(entries, skip, |e| e.path().is_some_and(has_part_files))
            // A `.tmp-step-` directory may hold a committed manifest of its own (a save
            // killed between its commit and the rename into place): once its lock is
            // ours its writer is gone, and it is removed all the same.
            .filter_map(|e| e.path())
            .filter(|p| {
                let tmp = parse_step_dir(p).is_none();
                matches!(remove_step_dir(p, tmp), Ok(true))
            })
            .count()
    }
}

impl<F: Fs + Send + std::fmt::Debug + 'static> StepStore for LocalSteps<F> {
    fn root(&self) -> Location {
        Location::Local(self.root.clone())
    }

    fn location_of(&self, step: u64) -> Location {
        Location::Local(self.step_dir(step))
    }

    fn list(&self) -> Result<Vec<StepEntry>> {
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
            let (step, committed) = if let Some(step) = parse_step(&name) {
                (step, path.join(MANIFEST_FILE).is_file())
            } else if let Some(step) = name
                .strip_prefix(TMP_STEP_PREFIX)
                .and_then(|rest| rest.split('-').next())
                .and_then(|s| s.parse().ok())
            {
                (step, false)
            } else {
                continue;
            };
            out.push(StepEntry {
                step,
                bytes: dir_bytes(&path),
                location: Location::Local(path),
                committed,
            });
        }
        out.sort_by_key(|e| (e.step, e.location.to_string()));
        Ok(out)
    }

    fn lease(&self, step: u64) -> Result<StepLease> {
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
            location: Location::Local(dir),
            _lock: Some(lock),
        })
    }

    fn open(&self, lease: &StepLease) -> Result<Checkpoint<Storage>> {
        let dir = lease.location.local("CheckpointManager::open")?;
        Ok(Checkpoint::open(dir)?.map_storage(Storage::Mapped))
    }

    fn save(&self, step: u64, tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
        let final_dir = self.step_dir(step);
        // Free the space of interrupted saves before writing this one (a save that failed
        // for lack of space must not make the next one fail too).
        let root_lock = self.lock_root()?;
        if let Ok(entries) = self.list() {
            self.remove_interrupted_locked(&entries, &Skip::default());
        }
        if final_dir.join(MANIFEST_FILE).is_file() {
            // Re-saving a committed step: the directory's own atomic replace.
            drop(root_lock);
            return match self.seam {
                false => write::save(&LocalStore::std(&final_dir), tensors, opts),
                true => write::save(&LocalStore::new(&self.fs, &final_dir), tensors, opts),
            };
        }
        let tmp = self.root.join(format!(
            "{TMP_STEP_PREFIX}{step}-{}",
            &write::random_id()?[..16]
        ));
        if final_dir.exists() {
            // An uncommitted leftover (a gc that stopped half-way): clear it first.
            remove_step_dir(&final_dir, false).map_err(|e| Error::io("remove", &final_dir, e))?;
        }
        local::prepare_dir(&tmp)?;
        // The writer lock is held until the rename: gc never removes a directory whose
        // lock is held, so it cannot take this one for an interrupted save (nor before it is
        // held: the root lock covers the creation).
        let lock = local::lock_dir(&tmp, local::Lock::TryExclusive)?;
        drop(root_lock);
        // Under our own lock: the store takes none and cleans up inline.
        let store = LocalStore::new(&self.fs, &tmp);
        let info = match write::save(&store, tensors, opts) {
            Ok(info) => info,
            Err(e) => {
                // Nothing was committed: the directory is ours (we hold its lock) and holds
                // no file of the failed save any more; remove it.
                let _ = remove_locked_step_dir(&tmp, lock);
                return Err(e);
            }
        };
        // The step appears whole under its name (the rename through the `Fs` seam that
        // tests/publish_crash.rs enumerates), then the root's entry is made durable.
        publish_dir(&self.fs, &tmp, &final_dir)?;
        drop(lock);
        Ok(info)
    }

    fn commit_parts(
        &self,
        step: u64,
        checkpoint_id: &str,
        parts: &[Part],
        opts: &CommitOptions,
    ) -> Result<CommitInfo> {
        write::parts::commit(
            &LocalStore::std(self.step_dir(step)),
            checkpoint_id,
            parts,
            opts,
        )
    }

    fn delete(&self, entry: &StepEntry) -> Result<bool> {
        let dir = entry.location.local("gc")?;
        remove_step_dir(dir, true).map_err(|e| Error::io("remove step", dir, e))
    }

    fn sweep(&self, entry: &StepEntry) -> Result<usize> {
        Ok(entry.path().map_or(0, sweep_kept_step))
    }

    fn remove_interrupted(&self, entries: &[StepEntry], skip: &Skip) -> Result<usize> {
        let root_lock = self.lock_root()?;
        let n = self.remove_interrupted_locked(entries, skip);
        drop(root_lock);
        Ok(n)
    }
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
                .is_some_and(crate::format::names::is_part_file)
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
/// newer than the manifest go: a later writer's files are its own (the next save into the
/// step removes a failed one's, under its lock). Returns how many were
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
    let keep: std::collections::HashSet<&str> = m.files().collect();
    let keep = |name: &str| keep.contains(name) || m.keeps(name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if !write::is_engine_file(&name) || keep(&name) {
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
    // The manifest goes first: from then on the step is not committed for anyone. Its data
    // goes only once that removal is durable: a removal or directory fsync that fails
    // (EIO, a full disk) keeps the step whole and committed (the error says why) rather
    // than leave a committed manifest naming deleted shards.
    match std::fs::remove_file(dir.join(MANIFEST_FILE)) {
        Ok(()) => File::open(dir).and_then(|d| d.sync_all())?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
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
    use crate::manager::{CheckpointManager, Retention};

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
        write::save(
            &LocalStore::std(&tmp),
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
