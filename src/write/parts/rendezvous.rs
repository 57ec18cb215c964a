//! The file rendezvous of a multi-rank commit (format-spec/global.md §Rendezvous): the
//! coordinator waits for every rank's part descriptor in the checkpoint directory (or
//! prefix), then commits.

use super::*;

/// The bytes of part descriptor `name`, refused unread beyond its first MiB when it is over
/// [`MAX_MANIFEST_SIZE`] (a descriptor names less than the manifest merged from it); one
/// read for a descriptor of up to 1 MiB.
pub(super) fn read_descriptor<S: Store + ?Sized>(store: &S, name: &str) -> Result<Vec<u8>> {
    const FIRST: u64 = 1 << 20;
    let (size, bytes) = store.read_prefix(name, FIRST)?;
    if size > MAX_MANIFEST_SIZE {
        return Err(Error::InvalidPart {
            part: store.describe(name),
            reason: format!(
                "the descriptor is {size} bytes, over the {MAX_MANIFEST_SIZE}-byte cap"
            ),
        });
    }
    if size <= bytes.len() as u64 {
        return Ok(bytes);
    }
    Ok(store.read_prefix(name, size)?.1)
}

/// How a rendezvous waits for the part descriptors.
pub(crate) struct Rendezvous {
    /// The ranks `0..world_size` whose parts are waited for.
    pub(crate) world_size: u32,
    /// The longest wait (a zero timeout looks once).
    pub(crate) timeout: Duration,
    /// The pause between two looks.
    pub(crate) poll: Duration,
}

/// The coordinator's rendezvous over `store` (format-spec/global.md §The commit,
/// format-spec/s3.md §Multi-rank): list the store until the part descriptors
/// `part-<id>-r<rank>.json` of every rank `0..world_size` are there (a rank publishes its
/// part only after all its shards), read and decode each, then [`commit_impl`] them with
/// `world_size` (`lock` as there).
///
/// # Errors
/// [`Error::MissingParts`] naming the store's location and the ranks whose part is still
/// missing at the timeout (nothing is committed); [`Error::InvalidPart`] naming a
/// descriptor that does not decode or is over [`MAX_MANIFEST_SIZE`]; otherwise as
/// [`commit_impl`].
pub(crate) fn commit_rendezvous_impl<S: Store + ?Sized, G>(
    store: &S,
    checkpoint_id: &str,
    wait: &Rendezvous,
    opts: &CommitOptions,
    lock: impl FnOnce() -> Result<G>,
) -> Result<CommitInfo> {
    let world_size = wait.world_size;
    if world_size == 0 {
        return Err(Error::InvalidArgument("world_size must be positive".into()));
    }
    if !is_id(checkpoint_id) {
        return Err(Error::InvalidArgument(format!(
            "checkpoint id {checkpoint_id:?} is not 32 lowercase hex digits"
        )));
    }
    let deadline = Instant::now().checked_add(wait.timeout);
    let names: Vec<String> = (0..world_size)
        .map(|r| part_file_name(checkpoint_id, r))
        .collect();
    loop {
        let listed: HashSet<String> = store.list()?.into_iter().collect();
        let missing: Vec<u32> = (0..world_size)
            .filter(|&r| !listed.contains(&names[r as usize]))
            .collect();
        if missing.is_empty() {
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::MissingParts {
                dir: store.location(),
                checkpoint_id: checkpoint_id.to_string(),
                missing,
            });
        }
        std::thread::sleep(wait.poll);
    }
    // Read and decode the descriptors in parallel (at 1,024 ranks x 10,000 tensors they are
    // 3.7 GB of JSON); the first failure in rank order is the one reported.
    let parts = names
        .par_iter()
        .map(|name| decode_part(&read_descriptor(store, name)?, &store.describe(name)))
        .collect::<Vec<Result<Part>>>()
        .into_iter()
        .collect::<Result<Vec<Part>>>()?;
    let opts = CommitOptions {
        world_size: Some(world_size),
        wait_for_parts: None,
        ..opts.clone()
    };
    commit_impl(store, checkpoint_id, &parts, &opts, lock)
}
