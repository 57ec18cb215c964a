//! Multi-rank saves (format-spec/global.md §Parts, §The commit): each rank writes its own
//! shards and a part descriptor ([`crate::write_part`]); one coordinator merges the parts
//! into the manifest and commits it last ([`crate::commit`], which can wait for the parts:
//! [`CommitOptions::wait_for_parts`]).

mod merge;
mod rendezvous;

use std::collections::{HashMap, HashSet};

use rayon::prelude::*;
use std::path::Path;
use std::time::{Duration, Instant};

use super::{
    commit_manifest, encode_checked, is_id, part_file_name, pause, plan_shards, random_id,
    rank_shard_file_name, remove_leftover_temps, validate_inputs, write_shards, CommitInfo,
    Created, SaveOptions, TensorRef, TEMP_PREFIX,
};
use crate::dtype::{checked_nbytes, DType};
use crate::error::{Error, Result};
use crate::format::global::{ChunkEntry, GlobalEntry};
use crate::format::manifest::{self, Manifest, OptimizerSection, TensorInfo};
use crate::format::optimizer::check_section;
pub use crate::format::part::{chunk_tensor_name, Part, PartChunk, PART_FORMAT, PART_VERSION};
pub(crate) use crate::format::part::{decode_part, decode_reason};
use crate::format::{check_tensor_name, MAX_HEADER_SIZE, MAX_MANIFEST_SIZE, MAX_RANK};
use crate::store::{Access, Held, Store};

use merge::*;
pub(crate) use rendezvous::{commit_rendezvous_impl, Rendezvous};

/// How often a commit that waits for the parts looks for them.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// One tensor a rank contributes to a multi-rank checkpoint.
#[derive(Debug, Clone)]
pub enum PartItem<'a> {
    /// A whole (not global) tensor, stored under its own name. Exactly one rank may offer
    /// a given whole tensor.
    Whole(TensorRef<'a>),
    /// A chunk of a global tensor: `tensor` holds the chunk's elements (its shape is the
    /// chunk's shape) and is named with the **global** tensor's name; the chunk starts at
    /// `offsets` of the global index space of shape `global_shape`. It is stored as the
    /// tensor `<global>@<o0>,<o1>,...~r<rank>` ([`chunk_tensor_name`]).
    Chunk {
        /// The chunk's data, named with the global name.
        tensor: TensorRef<'a>,
        /// The global tensor's shape.
        global_shape: Vec<u64>,
        /// Where the chunk starts, one entry per dimension.
        offsets: Vec<u64>,
    },
}

/// A fresh random checkpoint id (32 lowercase hex digits, 128 random bits) for a multi-rank
/// save: drawn once (by rank 0 or the launcher) and handed to every rank.
///
/// # Errors
/// [`Error::Io`] if the system's random source fails.
pub fn new_checkpoint_id() -> Result<String> {
    random_id()
}

/// Write rank `rank`'s part of checkpoint `checkpoint_id` into `store` (the verb is
/// [`crate::write_part`], which documents it). After validation, [`Store::begin`] with
/// [`Access::Part`] (a local directory: created, shared writer lock), the temporary files
/// an earlier attempt of this rank and id left removed (a local directory), then a part
/// already written refused (in a locked directory or an object store).
pub(crate) fn write_part(
    store: &dyn Store,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    if opts.optimizer.is_some() {
        return Err(Error::InvalidArgument(
            "a rank's part takes no optimizer section: give it to the commit \
             (CommitOptions::optimizer)"
                .into(),
        ));
    }
    let lock = || {
        let held = store.begin(Access::Part)?;
        if store.local_dir().is_some() {
            remove_own_leftover_temps(store, checkpoint_id, rank);
        }
        Ok(held)
    };
    write_part_impl(store, checkpoint_id, rank, items, opts, lock)
}

/// Remove the temporary files that an earlier `write_part` of this rank and id left in a
/// local directory (`.ckpt-tmp-shard-<id>-r<rank>-<k>.safetensors`,
/// `.ckpt-tmp-part-<id>-r<rank>.json`): it was killed, or it failed and its own removals
/// failed too (a device that fails every operation for a while). `create` refuses an
/// existing name, so without this every retry of the same rank and id would fail on them
/// with "create ...: File exists" (tests/disk_full_parts.rs). A rank holds the lock
/// only shared, so unlike a save's step 0.3b it removes no other writer's temporary files:
/// these names are unique to (id, rank), and only this rank of this id writes them. An
/// object store has no temporary objects (its puts ignore the staging name). Failures are
/// ignored: the retry's `create` then reports the file in its way.
fn remove_own_leftover_temps<S: Store + ?Sized>(store: &S, checkpoint_id: &str, rank: u32) {
    let shard_prefix = format!("{TEMP_PREFIX}shard-{checkpoint_id}-r{rank}-");
    let part_tmp = format!("{TEMP_PREFIX}{}", part_file_name(checkpoint_id, rank));
    let Ok(entries) = store.list() else {
        return;
    };
    for n in entries {
        let own_shard = n
            .strip_prefix(&shard_prefix)
            .and_then(|r| r.strip_suffix(".safetensors"))
            .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()));
        if own_shard || n == part_tmp {
            let _ = store.delete(&n);
        }
    }
}

/// Delete what the uncommitted multi-rank checkpoint `checkpoint_id` left in `store` (the
/// verb is [`crate::discard`]), under the writer lock taken exclusively ([`Access::Commit`]).
pub(crate) fn discard(store: &dyn Store, checkpoint_id: &str) -> Result<usize> {
    let _held = store.begin(Access::Commit)?;
    discard_impl(store, checkpoint_id)
}

/// [`discard`] over `store` (the caller holds whatever lock the store has).
pub(crate) fn discard_impl<S: Store + ?Sized>(store: &S, checkpoint_id: &str) -> Result<usize> {
    if !is_id(checkpoint_id) {
        return Err(Error::InvalidArgument(format!(
            "{checkpoint_id:?} is not a checkpoint id (32 lowercase hex digits)"
        )));
    }
    let names = store.list()?;
    if names.iter().any(|n| n == manifest::MANIFEST_FILE) {
        let (_, bytes) = store.read_prefix(manifest::MANIFEST_FILE, MAX_MANIFEST_SIZE)?;
        if manifest::decode(&bytes).is_ok_and(|m| m.checkpoint_id == checkpoint_id) {
            return Err(Error::InvalidArgument(format!(
                "checkpoint {checkpoint_id} is the one committed in {}: nothing discarded",
                store.location().display()
            )));
        }
    }
    let mut removed = 0;
    for n in names {
        if crate::format::names::engine_file_id(&n) == Some(checkpoint_id) {
            store.delete(&n)?;
            removed += 1;
        }
    }
    if removed > 0 {
        store.barrier("fsync directory (after discarding an uncommitted checkpoint)")?;
    }
    Ok(removed)
}

/// [`write_part`] over `store`. After validation, `lock` is called and held until the end
/// (a local directory: create it, take the shared writer lock); then a part already
/// written is refused (not through the crash tests' seam: see below).
pub(crate) fn write_part_impl<S: Store + ?Sized>(
    store: &S,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
    lock: impl FnOnce() -> Result<Held>,
) -> Result<Part> {
    if !is_id(checkpoint_id) {
        return Err(Error::InvalidArgument(format!(
            "checkpoint id {checkpoint_id:?} is not 32 lowercase hex digits (use new_checkpoint_id)"
        )));
    }
    let (stored, chunks) = part_tensors(items, rank)?;
    let sizes = validate_inputs(&stored, opts, None)?;
    // Shards are planned over the whole tensors first, then the chunks, never one shard
    // holding both (a two-level root lists the first kind, the part the second:
    // format-spec/global.md); the part lists its tensors in the items' order.
    let is_chunk: HashSet<&str> = chunks.iter().map(|c| c.tensor.as_str()).collect();
    let (whole_ix, chunk_ix): (Vec<usize>, Vec<usize>) =
        (0..stored.len()).partition(|&i| !is_chunk.contains(stored[i].name()));
    let wholes = whole_ix.len();
    let order: Vec<usize> = whole_ix.into_iter().chain(chunk_ix).collect();
    let planned_order: Vec<TensorRef<'_>> = order.iter().map(|&i| stored[i].clone()).collect();
    let planned_sizes: Vec<u64> = order.iter().map(|&i| sizes[i]).collect();
    let part_name = part_file_name(checkpoint_id, rank);
    let held = lock()?;
    // A part already written is refused where writers are real: a locked directory, an
    // object store. A directory over a substitute file system (the crash tests' seam, no
    // lock) lets a rank retry over what a failed attempt published.
    let seam = held.0.is_none() && store.local_dir().is_some();
    if !seam && store.exists(&part_name)? {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} already wrote its part of checkpoint {checkpoint_id} ({})",
            store.location().join(&part_name).display()
        )));
    }
    let planned = plan_shards(checkpoint_id, &planned_order, &planned_sizes, opts, wholes)?;
    // From here, an error removes every file this call created.
    let created = Created::new(store);
    let (shards, tensors) = write_shards(store, &created, &stored, &planned, opts, &|k| {
        rank_shard_file_name(checkpoint_id, rank, k)
    })?;
    pause::point(pause::Point::BeforePart);
    let mut part = Part {
        checkpoint_id: checkpoint_id.to_string(),
        rank,
        shards,
        tensors,
        chunks,
        encoded: None,
    };
    let bytes = part.to_bytes();
    part.encoded = Some((bytes.len() as u64, crc32fast::hash(&bytes)));
    store.put(&part_name, &format!("{TEMP_PREFIX}{part_name}"), &bytes)?;
    created.published(&part_name);
    store.barrier("fsync directory (after the part descriptor)")?;
    created.commit();
    Ok(part)
}

/// The tensors a rank stores (chunks renamed) and its chunk list, with every check on the
/// items that needs no disk.
fn part_tensors<'a>(
    items: &[PartItem<'a>],
    rank: u32,
) -> Result<(Vec<TensorRef<'a>>, Vec<PartChunk>)> {
    let mut stored = Vec::with_capacity(items.len());
    let mut chunks = Vec::new();
    let mut globals: HashMap<&str, (DType, &[u64])> = HashMap::new();
    let mut boxes: HashSet<(&str, &[u64])> = HashSet::new();
    let mut wholes: Vec<&str> = Vec::new();
    for it in items {
        match it {
            PartItem::Whole(t) => {
                wholes.push(t.name());
                stored.push(t.clone());
            }
            PartItem::Chunk {
                tensor,
                global_shape,
                offsets,
            } => {
                let g = tensor.name();
                let bad = |reason: String| Error::InvalidTensor {
                    name: g.to_string(),
                    reason: format!("chunk at offsets {offsets:?} (rank {rank}): {reason}"),
                };
                check_tensor_name(g).map_err(bad)?;
                let shape = tensor.shape();
                let r = global_shape.len();
                if r > MAX_RANK {
                    return Err(bad(format!("global rank {r} exceeds {MAX_RANK}")));
                }
                if offsets.len() != r || shape.len() != r {
                    return Err(bad(format!(
                        "offsets {offsets:?} and chunk shape {shape:?} must both have the global shape's rank {r} (global shape {global_shape:?})"
                    )));
                }
                if checked_nbytes(tensor.dtype(), global_shape).is_none() {
                    return Err(bad(format!("global shape {global_shape:?} overflows")));
                }
                for d in 0..r {
                    if shape[d] == 0 {
                        return Err(bad(format!(
                            "dimension {d} of the chunk is empty (chunks hold elements)"
                        )));
                    }
                    if offsets[d]
                        .checked_add(shape[d])
                        .is_none_or(|end| end > global_shape[d])
                    {
                        return Err(bad(format!(
                            "dimension {d}: [{}, {}+{}) is outside the global extent {}",
                            offsets[d], offsets[d], shape[d], global_shape[d]
                        )));
                    }
                }
                match globals.get(g) {
                    Some(&(dt, gs)) if dt != tensor.dtype() || gs != global_shape.as_slice() => {
                        return Err(bad(format!(
                            "another chunk of this rank says the global is {dt} {gs:?}, this one {} {global_shape:?}",
                            tensor.dtype()
                        )));
                    }
                    Some(_) => {}
                    None => {
                        globals.insert(g, (tensor.dtype(), global_shape));
                    }
                }
                if !boxes.insert((g, offsets.as_slice())) {
                    return Err(bad("the chunk is given twice".into()));
                }
                let name = chunk_tensor_name(g, offsets, rank);
                chunks.push(PartChunk {
                    global: g.to_string(),
                    dtype: tensor.dtype(),
                    global_shape: global_shape.clone(),
                    offsets: offsets.clone(),
                    shape: shape.to_vec(),
                    tensor: name.clone(),
                });
                stored.push(tensor.clone().renamed(name));
            }
        }
    }
    if let Some(w) = wholes.iter().find(|w| globals.contains_key(**w)) {
        return Err(Error::InvalidTensor {
            name: w.to_string(),
            reason: format!(
                "rank {rank} offers it both as a whole tensor and as chunks of a global tensor"
            ),
        });
    }
    Ok((stored, chunks))
}

/// Options for [`crate::commit`].
#[derive(Debug, Clone)]
pub struct CommitOptions {
    /// The number of ranks: when given, the parts' ranks must be exactly `0..world_size`.
    pub world_size: Option<u32>,
    /// User metadata stored in the manifest: a JSON object.
    pub metadata: serde_json::Value,
    /// The optimizer section (format-spec/optimizer.md), whose states may name global
    /// tensors (optimizer state chunked like its parameters: FSDP, ZeRO). Checked by rules
    /// O1-O9 against the merged tensors and globals before anything is written.
    pub optimizer: Option<OptimizerSection>,
    /// The manifest's shape: one flat manifest of every chunk, or a two-level root that
    /// names the part descriptors (format-spec/global.md §The two-level manifest).
    pub layout: Layout,
    /// Wait at most this long for the part descriptors of ranks `0..world_size` to appear
    /// in the store (the rendezvous: format-spec/global.md §Rendezvous), then commit
    /// those: the coordinator needs no parts from the ranks (pass none) but needs
    /// [`CommitOptions::world_size`]. A zero duration looks once. `None` (the default):
    /// commit the parts given.
    pub wait_for_parts: Option<Duration>,
}

/// The shape of the manifest a multi-rank commit writes ([`CommitOptions::layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Layout {
    /// Two-level from [`AUTO_TWO_LEVEL_CHUNKS`] chunks over all parts, flat below.
    #[default]
    Auto,
    /// One manifest listing every chunk (feature `global`): every reader decodes all of
    /// it. Right for tens of ranks.
    Flat,
    /// A root naming the part descriptors, which keep the chunk entries (features
    /// `global` and `parts`): a reader decodes the root and the parts its reads touch.
    /// Parts without chunks (only whole tensors) commit flat.
    TwoLevel,
}

pub use super::two_level::AUTO_TWO_LEVEL_CHUNKS;

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            world_size: None,
            metadata: serde_json::Value::Object(Default::default()),
            optimizer: None,
            layout: Layout::Auto,
            wait_for_parts: None,
        }
    }
}

/// Commit the parts of checkpoint `checkpoint_id` in `store` (the verb is
/// [`crate::commit`], which documents it): with [`CommitOptions::wait_for_parts`], the
/// rendezvous first; the exclusive writer lock ([`Access::Commit`]) after check C1.
pub(crate) fn commit(
    store: &dyn Store,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    let lock = || store.begin(Access::Commit);
    match opts.wait_for_parts {
        None => commit_impl(store, checkpoint_id, parts, opts, lock),
        Some(timeout) => {
            if !parts.is_empty() {
                return Err(Error::InvalidArgument(
                    "a commit that waits for the parts (CommitOptions::wait_for_parts) reads \
                     them from the store: pass no parts"
                        .into(),
                ));
            }
            let Some(world_size) = opts.world_size else {
                return Err(Error::InvalidArgument(
                    "a commit that waits for the parts needs CommitOptions::world_size".into(),
                ));
            };
            // An object store is listed less often than a directory.
            let poll = match store.local_dir() {
                Some(_) => POLL,
                None => POLL.max(Duration::from_millis(50)),
            };
            let wait = Rendezvous {
                world_size,
                timeout,
                poll,
            };
            commit_rendezvous_impl(store, checkpoint_id, &wait, opts, lock)
        }
    }
}

/// [`commit`] over `store`; `lock` is called after C1 and held until the end (a local
/// directory: the exclusive writer lock).
pub(crate) fn commit_impl<S: Store + ?Sized, G>(
    store: &S,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
    lock: impl FnOnce() -> Result<G>,
) -> Result<CommitInfo> {
    if !is_id(checkpoint_id) {
        return Err(Error::InvalidArgument(format!(
            "checkpoint id {checkpoint_id:?} is not 32 lowercase hex digits"
        )));
    }
    if !opts.metadata.is_object() {
        return Err(Error::InvalidArgument(
            "metadata must be a JSON object".into(),
        ));
    }
    crate::format::check_json_depth(&opts.metadata)
        .map_err(|e| Error::InvalidArgument(format!("metadata {e}")))?;
    // C1.
    let mut sorted: Vec<&Part> = parts.iter().collect();
    sorted.sort_by_key(|p| p.rank);
    check_parts(&store.location(), checkpoint_id, &sorted, opts.world_size)?;
    let _lock = lock()?;
    // Under the exclusive lock every temporary file belongs to a writer that has ended: a
    // commit of this id that crashed left its temporary manifest, whose name a retry of
    // the commit would otherwise find taken (format-spec/global.md §The commit).
    let leftovers = remove_leftover_temps(store);
    // C2.
    check_shards(store, &sorted)?;
    // C3, C4 (C3', C4' for a two-level root).
    let chunks: usize = sorted.iter().map(|p| p.chunks.len()).sum();
    let two_level = chunks > 0
        && match opts.layout {
            Layout::Flat => false,
            Layout::TwoLevel => true,
            Layout::Auto => chunks >= AUTO_TWO_LEVEL_CHUNKS,
        };
    let mut m = if two_level {
        super::two_level::root(store, checkpoint_id, &sorted, &opts.metadata)?
    } else {
        merge(checkpoint_id, &sorted, &opts.metadata)?
    };
    if let Some(sec) = &opts.optimizer {
        let mut shapes: HashMap<&str, (DType, &[u64])> = m
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), (t.dtype, t.shape.as_slice())))
            .collect();
        shapes.extend(
            m.globals
                .iter()
                .map(|g| (g.name.as_str(), (g.dtype, g.global_shape.as_slice()))),
        );
        check_section(sec, |n| shapes.get(n).copied())?;
        m.optimizer = Some(sec.clone());
        m.features.insert(0, "optimizer".into());
    }
    // C5: the reader's own rules, on the bytes about to be written.
    let bytes = encode_checked(&m).map_err(|_| {
        Error::InvalidArgument(format!(
            "the manifest merged from {} parts ({} tensors) would exceed the format's {}-byte cap; commit it with Layout::TwoLevel (format-spec/global.md §The two-level manifest)",
            sorted.len(),
            m.tensors.len(),
            MAX_MANIFEST_SIZE
        ))
    })?;
    if let Err(e) = manifest::decode(&bytes) {
        // Overlapping chunks are the ranks' disagreement: name both where it is cheap.
        return Err(
            overlapping_ranks(&m, &sorted).unwrap_or_else(|| Error::InvalidManifest {
                file: format!(
                    "{} (merged from the parts of checkpoint {checkpoint_id}; not written)",
                    store.location().join(manifest::MANIFEST_FILE).display()
                ),
                reason: decode_reason(e),
            }),
        );
    }
    // C6: steps 3-5 of a save.
    let removed = commit_manifest(store, Created::new(store), &bytes, &m)?.run(store);
    let all = || sorted.iter().flat_map(|p| &p.tensors);
    Ok(CommitInfo {
        checkpoint_id: checkpoint_id.to_string(),
        shards: sorted.iter().map(|p| p.shards.len()).sum(),
        tensors: all().count(),
        data_bytes: all().map(TensorInfo::nbytes).sum(),
        removed: removed + leftovers,
    })
}
