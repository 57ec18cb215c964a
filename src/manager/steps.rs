//! Steps as a store sees them: the entries of a root ([`StepEntry`]), what a manager needs
//! of the store its steps live in ([`StepStore`]: local directory or object-store prefix),
//! and which leftovers count as interrupted saves.

use super::*;

/// One step under a manager root, as `ls` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepEntry {
    /// The step number.
    pub step: u64,
    /// Its directory (a `.tmp-step-` one for an interrupted local save) or prefix URL.
    pub location: Location,
    /// True if it holds a committed manifest.
    pub committed: bool,
    /// Bytes of the files (objects) directly in it.
    pub bytes: u64,
}

impl StepEntry {
    /// The directory of a local step (`None` for a step on an object store).
    pub fn path(&self) -> Option<&Path> {
        match &self.location {
            Location::Local(p) => Some(p),
            Location::Remote(_) => None,
        }
    }
}

/// What a manager needs from the store its steps live in: listing steps, saving one,
/// holding, opening and deleting one. The retention rule, async saves, restores and
/// multi-rank commits are written once on top, in [`CheckpointManager`].
pub(super) trait StepStore: Send + Sync + std::fmt::Debug {
    /// The root directory or prefix URL.
    fn root(&self) -> Location;

    /// Where step `step` lives once committed.
    fn location_of(&self, step: u64) -> Location;

    /// Every step, committed or not, and leftovers of interrupted saves, by step.
    fn list(&self) -> Result<Vec<StepEntry>>;

    /// A lease on committed step `step`; [`Error::NotFound`] if it is not committed.
    fn lease(&self, step: u64) -> Result<StepLease>;

    /// Open the step `lease` holds.
    fn open(&self, lease: &StepLease) -> Result<Checkpoint<Storage>>;

    /// Save one step, committed and durable when this returns `Ok`; an existing committed
    /// `step` is replaced atomically or kept.
    fn save(&self, step: u64, tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo>;

    /// Commit the ranks' parts written under `location_of(step)`.
    fn commit_parts(
        &self,
        step: u64,
        checkpoint_id: &str,
        parts: &[Part],
        opts: &CommitOptions,
    ) -> Result<CommitInfo>;

    /// Delete a committed step retention does not keep: `Ok(false)` if a lease holds it.
    fn delete(&self, entry: &StepEntry) -> Result<bool>;

    /// Remove from a kept, committed step the engine files its manifest does not name;
    /// how many.
    fn sweep(&self, entry: &StepEntry) -> Result<usize>;

    /// Remove the leftovers of interrupted saves among `entries` (those [`interrupted`]
    /// picks), except `skip`; how many were removed.
    fn remove_interrupted(&self, entries: &[StepEntry], skip: &Skip) -> Result<usize>;
}

/// What the removal of interrupted saves leaves alone: steps this manager is saving now,
/// and locations of steps retention has just deleted (a user's file kept the directory).
#[derive(Debug, Default)]
pub(super) struct Skip {
    pub(super) saving: BTreeSet<u64>,
    pub(super) deleted: Vec<Location>,
}

/// The uncommitted entries that are leftovers of interrupted saves and may be removed.
/// An uncommitted step newer than every committed one that holds part descriptors
/// (`has_parts`) may be a multi-rank save whose ranks have written their parts and whose
/// commit is still to come (format-spec/global.md): it is kept until a newer step commits.
pub(super) fn interrupted<'a>(
    entries: &'a [StepEntry],
    skip: &'a Skip,
    has_parts: impl Fn(&StepEntry) -> bool + 'a,
) -> impl Iterator<Item = &'a StepEntry> + 'a {
    let newest = entries.iter().filter(|e| e.committed).map(|e| e.step).max();
    entries
        .iter()
        .filter(|e| !e.committed)
        .filter(|e| !skip.saving.contains(&e.step) && !skip.deleted.contains(&e.location))
        .filter(move |e| !(newest.is_none_or(|n| e.step > n) && has_parts(e)))
}
