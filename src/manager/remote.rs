//! The checkpoint manager's layout on an object store (format-spec/s3.md §Manager): one
//! checkpoint per step under `ROOT/step-<step, 8+ digits>/`, a step committed once its
//! manifest object exists, `latest` the newest committed step, and retention that deletes
//! only objects the engine wrote (manifests, shards, temporary objects, part descriptors).
//!
//! Unlike a local root there are no reader leases: readers of [`RemoteManager::open`]
//! download the whole step at open, so retention cannot pull bytes from under them; a
//! lazy reader ([`super::s3::open_lazy`]) of a step deleted meanwhile gets an error
//! naming the missing object, never other bytes.

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::format::manifest::MANIFEST_FILE;
use crate::manager::{parse_step, step_name, GcReport, Retention};
use crate::optim::OptimizerState;
use crate::write::{self, CommitInfo, SaveOptions, TensorRef};

use super::s3::{self, Remote, S3Config};
use super::RemoteUrl;

/// One step under a remote manager root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteStep {
    /// The step number.
    pub step: u64,
    /// Its prefix URL.
    pub url: RemoteUrl,
    /// True if its manifest object exists.
    pub committed: bool,
    /// Bytes of the objects directly under the step's prefix.
    pub bytes: u64,
}

/// Steps of a training run under `s3://bucket/root/`.
#[derive(Debug, Clone)]
pub struct RemoteManager {
    root: Remote,
    retention: Retention,
}

impl RemoteManager {
    /// A manager over `root` (no request is made yet).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `keep_last == 0` or `keep_every == Some(0)`;
    /// [`Error::Remote`] for an invalid configuration.
    pub fn new(root: &RemoteUrl, cfg: &S3Config, retention: Retention) -> Result<Self> {
        if retention.keep_last == 0 || retention.keep_every == Some(0) {
            return Err(Error::InvalidArgument(
                "retention must keep at least one step (keep_last >= 1, keep_every >= 1)".into(),
            ));
        }
        Ok(RemoteManager {
            root: Remote::new(root, cfg)?,
            retention,
        })
    }

    /// The root URL.
    pub fn root(&self) -> &RemoteUrl {
        self.root.url()
    }

    /// The prefix of `step`.
    pub fn step_url(&self, step: u64) -> RemoteUrl {
        self.root.url().child(&step_name(step))
    }

    /// Every step prefix, committed or not, ascending.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn list(&self) -> Result<Vec<RemoteStep>> {
        let prefixes = self.root.list()?.prefixes;
        let mut out = Vec::new();
        for p in prefixes {
            let Some(step) = parse_step(&p) else {
                continue;
            };
            let r = self.root.child(&p);
            let objects = r.list()?.objects;
            out.push(RemoteStep {
                step,
                committed: objects.iter().any(|(n, _)| n == MANIFEST_FILE),
                bytes: objects.iter().map(|(_, s)| *s).sum(),
                url: r.url().clone(),
            });
        }
        out.sort_by_key(|s| s.step);
        Ok(out)
    }

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn steps(&self) -> Result<Vec<u64>> {
        Ok(self
            .list()?
            .into_iter()
            .filter(|s| s.committed)
            .map(|s| s.step)
            .collect())
    }

    /// The newest committed step.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.steps()?.last().copied())
    }

    /// Save `tensors` as step `step`, then apply retention.
    ///
    /// # Errors
    /// As [`s3::save_with`]; retention failures are not errors (they leave objects for the
    /// next `gc`).
    pub fn save(
        &self,
        step: u64,
        tensors: &[TensorRef<'_>],
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let info = s3::save_remote(&self.root.child(&step_name(step)), tensors, opts, None)?;
        let _ = self.gc();
        Ok(info)
    }

    /// Save an optimizer state with `model` tensors beside it as step `step`, then apply
    /// retention.
    ///
    /// # Errors
    /// As [`RemoteManager::save`] and [`OptimizerState::save`].
    pub fn save_optimizer(
        &self,
        step: u64,
        state: &OptimizerState,
        model: &[TensorRef<'_>],
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let (tensors, section) = state.as_borrowed().to_parts(model)?;
        let info = s3::save_remote(
            &self.root.child(&step_name(step)),
            &tensors,
            opts,
            Some(section),
        )?;
        let _ = self.gc();
        Ok(info)
    }

    /// Open committed step `step` (downloaded whole, [`s3::open_with`]).
    ///
    /// # Errors
    /// As [`s3::open_with`].
    pub fn open(&self, step: u64) -> Result<Checkpoint<Vec<u8>>> {
        s3::open_remote(&self.root.child(&step_name(step)))
    }

    /// Open the newest committed step: `None` if there is none.
    ///
    /// # Errors
    /// As [`RemoteManager::open`].
    pub fn open_latest(&self) -> Result<Option<(u64, Checkpoint<Vec<u8>>)>> {
        match self.latest()? {
            Some(s) => Ok(Some((s, self.open(s)?))),
            None => Ok(None),
        }
    }

    /// Apply retention: delete committed steps beyond `keep_last` newest (except multiples
    /// of `keep_every`) — the manifest first, so the step stops counting as committed, then
    /// its engine objects; delete the engine objects of uncommitted steps (interrupted
    /// saves; do not run this while a save is running under the root); and in the steps
    /// kept, engine objects their manifest does not name. Objects the engine did not write
    /// are never deleted.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn gc(&self) -> Result<GcReport> {
        let steps = self.list()?;
        let committed: Vec<u64> = steps
            .iter()
            .filter(|s| s.committed)
            .map(|s| s.step)
            .collect();
        let keep_from = committed.len().saturating_sub(self.retention.keep_last);
        let mut report = GcReport::default();
        for s in &steps {
            let r = self.root.child(&step_name(s.step));
            if !s.committed {
                report.interrupted_removed += usize::from(!delete_engine_objects(&r)?.is_empty());
                continue;
            }
            let newest = committed[keep_from..].contains(&s.step);
            let every = self.retention.keep_every.is_some_and(|m| s.step % m == 0);
            if newest || every {
                s3::gc_prefix(&r)?;
                continue;
            }
            r.delete(MANIFEST_FILE)?;
            delete_engine_objects(&r)?;
            report.deleted.push(s.step);
        }
        Ok(report)
    }
}

/// Delete every engine object directly under `r` (not the manifest); their names.
fn delete_engine_objects(r: &Remote) -> Result<Vec<String>> {
    let mut deleted = Vec::new();
    for (name, _) in r.list()?.objects {
        if write::is_engine_file(&name) {
            r.delete(&name)?;
            deleted.push(name);
        }
    }
    Ok(deleted)
}
