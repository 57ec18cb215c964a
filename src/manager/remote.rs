//! A manager root on an object store (format-spec/s3.md §Manager): one checkpoint per step
//! under `ROOT/step-<step, 8+ digits>/`, a step committed once its manifest object exists.
//!
//! Nothing locks a prefix, so there are no reader leases: readers of the manager's `open`
//! download the whole step at open, so retention cannot pull bytes from under them; a lazy
//! reader ([`crate::checkpoint::remote::open_lazy`]) of a step deleted meanwhile gets an error naming
//! the missing object, never other bytes. Retention deletes only objects the engine writes
//! (manifests, shards, temporary objects and upload journals, part descriptors).

use super::{interrupted, parse_step, step_name, Skip, StepEntry, StepLease, StepStore};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::Storage;
use crate::error::{Error, Result};
use crate::format::manifest::MANIFEST_FILE;
use crate::location::Location;
use crate::store::s3::{self, Remote};
use crate::write::parts::{CommitOptions, Part};
use crate::write::{self, CommitInfo, SaveOptions, TensorRef};

/// Steps under an object-store prefix.
#[derive(Debug)]
pub(super) struct RemoteSteps {
    root: Remote,
}

impl RemoteSteps {
    pub(super) fn new(root: Remote) -> Self {
        RemoteSteps { root }
    }

    fn step(&self, step: u64) -> Remote {
        self.root.child(&step_name(step))
    }

    fn of(&self, entry: &StepEntry) -> Remote {
        self.step(entry.step)
    }
}

impl StepStore for RemoteSteps {
    fn root(&self) -> Location {
        Location::Remote(self.root.url().clone())
    }

    fn location_of(&self, step: u64) -> Location {
        Location::Remote(self.step(step).url().clone())
    }

    fn list(&self) -> Result<Vec<StepEntry>> {
        let mut out = Vec::new();
        for p in self.root.list()?.prefixes {
            let Some(step) = parse_step(&p) else {
                continue;
            };
            let r = self.root.child(&p);
            let objects = r.list()?.objects;
            out.push(StepEntry {
                step,
                committed: objects.iter().any(|(n, _)| n == MANIFEST_FILE),
                bytes: objects.iter().map(|(_, s)| *s).sum(),
                location: Location::Remote(r.url().clone()),
            });
        }
        out.sort_by_key(|s| s.step);
        Ok(out)
    }

    fn lease(&self, step: u64) -> Result<StepLease> {
        let r = self.step(step);
        let committed = r.list()?.objects.iter().any(|(n, _)| n == MANIFEST_FILE);
        if !committed {
            return Err(Error::NotFound {
                path: r.url().to_string().into(),
                reason: format!("step {step} is not committed"),
            });
        }
        Ok(StepLease {
            step,
            location: Location::Remote(r.url().clone()),
            _lock: None,
        })
    }

    fn open(&self, lease: &StepLease) -> Result<Checkpoint<Storage>> {
        Ok(crate::checkpoint::remote::open(&self.step(lease.step))?.map_storage(Storage::Owned))
    }

    fn save(&self, step: u64, tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
        crate::write::save(&self.step(step), tensors, opts)
    }

    fn commit_parts(
        &self,
        step: u64,
        checkpoint_id: &str,
        parts: &[Part],
        opts: &CommitOptions,
    ) -> Result<CommitInfo> {
        crate::write::parts::commit(&self.step(step), checkpoint_id, parts, opts)
    }

    /// The manifest first, so the step stops counting as committed, then its engine
    /// objects. Nothing holds a step on an object store: always deleted.
    fn delete(&self, entry: &StepEntry) -> Result<bool> {
        let r = self.of(entry);
        r.delete(MANIFEST_FILE)?;
        delete_engine_objects(&r)?;
        Ok(true)
    }

    fn sweep(&self, entry: &StepEntry) -> Result<usize> {
        Ok(s3::gc_prefix(&self.of(entry))?.len())
    }

    fn remove_interrupted(&self, entries: &[StepEntry], skip: &Skip) -> Result<usize> {
        let mut removed = 0;
        let mut first_err = None;
        let has_parts = |e: &StepEntry| {
            self.of(e).list().is_ok_and(|l| {
                l.objects
                    .iter()
                    .any(|(n, _)| crate::format::names::is_part_file(n))
            })
        };
        for e in interrupted(entries, skip, has_parts) {
            match delete_engine_objects(&self.of(e)) {
                Ok(names) => removed += usize::from(!names.is_empty()),
                Err(err) => {
                    first_err.get_or_insert(err);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(removed),
        }
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
