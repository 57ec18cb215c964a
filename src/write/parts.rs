//! Multi-rank saves (format-spec/global.md §Parts, §The commit): each rank writes its own
//! shards and a part descriptor ([`write_part`]); one coordinator merges the parts into the
//! manifest and commits it last ([`commit`], [`commit_rendezvous`]).

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
use crate::store::fs::Fs;
use crate::store::local::{self, Lock};
use crate::store::{LocalStore, Store};

/// How often [`commit_rendezvous`] looks for the part files.
use merge::*;
pub use rendezvous::commit_rendezvous;
pub(crate) use rendezvous::{commit_rendezvous_impl, Rendezvous};

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

/// Write rank `rank`'s part of checkpoint `checkpoint_id` into `dir` (format-spec/global.md
/// §Parts): its shards `shard-<id>-r<rank>-<k>.safetensors` (temporary file, fsync, rename;
/// directory fsync), then its part descriptor `part-<id>-r<rank>.json` the same way. Ranks
/// run concurrently: each holds a shared lock on the directory's writer lock file while it
/// writes (waiting for it while a save or commit holds it exclusively), so no save or
/// commit runs meanwhile. `opts.metadata` is not used (the commit's metadata is).
///
/// Everything is validated before the disk is touched; after an error the files this call
/// created are removed. Temporary files that an earlier attempt of this rank and id left
/// (killed, or its removals failed) are removed first, so the rank can be retried.
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed id or a part already written for this rank;
/// [`Error::InvalidTensor`] naming the
/// tensor for a bad name, size, chunk box outside its global shape, ranks that disagree,
/// a chunk given twice, or a whole tensor named like a global one; [`Error::Io`] naming the
/// file.
pub fn write_part(
    dir: impl AsRef<Path>,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    let dir = crate::location::local_path(dir.as_ref(), "write::parts::write_part")?;
    let store = LocalStore::std(&dir);
    let lock = || {
        local::prepare_dir(&dir)?;
        let held = local::lock_dir(&dir, Lock::Shared)?;
        remove_own_leftover_temps(&store, checkpoint_id, rank);
        Ok(held)
    };
    write_part_impl(&store, checkpoint_id, rank, items, opts, true, lock)
}

/// [`write_part`] through a substitute file system, into an existing directory, without the
/// writer lock and without the check for a part already written: the seam for
/// crash-simulation tests (format-spec/durability.md §Operations), like
/// [`super::save_with_fs`].
#[doc(hidden)]
pub fn write_part_with_fs<F: Fs>(
    fs: &F,
    dir: &Path,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    let store = LocalStore::new(fs, dir);
    let lock = || {
        remove_own_leftover_temps(&store, checkpoint_id, rank);
        Ok(())
    };
    write_part_impl(&store, checkpoint_id, rank, items, opts, false, lock)
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
fn remove_own_leftover_temps<S: Store>(store: &S, checkpoint_id: &str, rank: u32) {
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

/// Delete what the uncommitted multi-rank checkpoint `checkpoint_id` left in `dir`: its
/// ranks' shards and part descriptors, and its temporary files (a job that abandons a save,
/// a consolidation that failed half-way). Under the writer lock, taken exclusively, so it
/// waits for ranks still writing their parts. Returns how many files were removed.
///
/// # Errors
/// [`Error::InvalidArgument`] for a malformed id, or if `checkpoint_id` is the committed
/// checkpoint (nothing is removed); [`Error::Io`] naming the directory or a file.
pub fn discard(dir: impl AsRef<Path>, checkpoint_id: &str) -> Result<usize> {
    let dir = crate::location::local_path(dir.as_ref(), "write::parts::discard")?;
    let _lock = local::lock_dir(&dir, Lock::Exclusive)?;
    discard_impl(&LocalStore::std(&dir), checkpoint_id)
}

/// [`discard`] over `store` (the caller holds whatever lock the store has).
pub(crate) fn discard_impl<S: Store>(store: &S, checkpoint_id: &str) -> Result<usize> {
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
/// (a local directory: create it, take the shared writer lock); `refuse_existing`: refuse a
/// part already written.
pub(crate) fn write_part_impl<S: Store, G>(
    store: &S,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
    refuse_existing: bool,
    lock: impl FnOnce() -> Result<G>,
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
    let _lock = lock()?;
    if refuse_existing && store.exists(&part_name)? {
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

/// Options for [`commit`] and [`commit_rendezvous`].
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
        }
    }
}

/// Commit the parts of checkpoint `checkpoint_id` in `dir` (format-spec/global.md §The
/// commit, rules C1-C6): under the writer lock (waiting for ranks still holding it shared,
/// and for a save in progress), remove the temporary files of writers that have ended (a
/// crashed commit's temporary manifest among them), check every part and every shard file it
/// lists, merge them into one manifest (replicated chunks become replicas) or, with
/// [`CommitOptions::layout`] two-level, into a root naming the part descriptors
/// (format-spec/global.md §The two-level manifest, C1'-C6'), validate it with the reader's
/// own rules, and write it last exactly as [`super::save`] does. Then remove the engine
/// files of other ids, and (flat) the part descriptors of this id; a two-level root keeps
/// them, since it names them.
///
/// # Errors
/// Nothing is committed after any error (the previous checkpoint stays):
/// [`Error::InvalidPart`] for a part of another id, two parts of one rank, or ranks outside
/// `0..world_size`; [`Error::MissingParts`] for ranks of `0..world_size` without a part;
/// [`Error::ShardMismatch`] / [`Error::ChecksumMismatch`] for a shard file that is missing,
/// misnamed, of the wrong size or whose header CRC differs; [`Error::PartConflict`] naming
/// both ranks for a whole tensor offered twice, a global declared with different dtypes or
/// shapes, replicas whose bytes differ, or chunks that overlap; [`Error::InvalidManifest`]
/// for a merged manifest the reader would refuse otherwise (chunks that leave a gap, ...);
/// [`Error::InvalidArgument`] for a merged manifest over the size cap; [`Error::Io`].
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// use ckptstore::write::parts::{commit, new_checkpoint_id, write_part};
/// use ckptstore::{Checkpoint, CommitOptions, PartItem, SaveOptions, TensorRef};
/// let dir = tempfile::tempdir().unwrap();
/// let id = new_checkpoint_id()?;
/// let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
/// // Two ranks, each holding half of the rows of the global tensor "w" [4, 2].
/// let parts = (0..2u32)
///     .map(|r| {
///         let rows = &w[r as usize * 4..][..4];
///         let chunk = PartItem::Chunk {
///             tensor: TensorRef::from_slice("w", &[2, 2], rows),
///             global_shape: vec![4, 2],
///             offsets: vec![2 * u64::from(r), 0],
///         };
///         write_part(dir.path(), &id, r, &[chunk], &SaveOptions::default())
///     })
///     .collect::<ckptstore::Result<Vec<_>>>()?;
/// let opts = CommitOptions { world_size: Some(2), ..Default::default() };
/// commit(dir.path(), &id, &parts, &opts)?;
/// let ck = Checkpoint::open(dir.path())?;
/// ck.verify()?;
/// assert_eq!(ck.manifest().unwrap().globals[0].chunks.len(), 2);
/// assert_eq!(ck.tensor("w@2,0~r1")?.as_slice::<f32>()?, &w[4..]);
/// # Ok(()) }
/// ```
pub fn commit(
    dir: impl AsRef<Path>,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    let dir = crate::location::local_path(dir.as_ref(), "write::parts::commit")?;
    commit_impl(&LocalStore::std(&dir), checkpoint_id, parts, opts, || {
        local::lock_dir(&dir, Lock::Exclusive)
    })
}

/// [`commit`] through a substitute file system, without the writer lock (the caller
/// guarantees that no rank, save or other commit runs meanwhile): the seam for
/// crash-simulation tests (format-spec/durability.md §Operations), like
/// [`super::save_with_fs`].
#[doc(hidden)]
pub fn commit_with_fs<F: Fs>(
    fs: &F,
    dir: &Path,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    let store = LocalStore::new(fs, dir);
    commit_impl(&store, checkpoint_id, parts, opts, || Ok(()))
}

/// [`commit`] over `store`; `lock` is called after C1 and held until the end (a local
/// directory: the exclusive writer lock).
pub(crate) fn commit_impl<S: Store, G>(
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
