//! Multi-rank saves (format-spec/global.md §Parts, §The commit): each rank writes its own
//! shards and a part descriptor ([`write_part`]); one coordinator merges the parts into the
//! manifest and commits it last ([`commit`], [`commit_rendezvous`]).

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

/// C1 on parts sorted by rank.
fn check_parts(dir: &Path, id: &str, sorted: &[&Part], world_size: Option<u32>) -> Result<()> {
    if sorted.is_empty() {
        return Err(Error::InvalidArgument("no parts to commit".into()));
    }
    // Each part's own rules, part by part in parallel; the first failure in rank order is
    // the one reported.
    let checked: Vec<_> = sorted.par_iter().map(|p| p.check()).collect();
    for ((i, p), checked) in sorted.iter().enumerate().zip(checked) {
        let bad = |reason: String| Error::InvalidPart {
            part: p.file_name(),
            reason,
        };
        checked.map_err(bad)?;
        if p.checkpoint_id != id {
            return Err(bad(format!(
                "rank {} wrote it for checkpoint {}, not {id}: a part of another save is never committed",
                p.rank, p.checkpoint_id
            )));
        }
        if i > 0 && sorted[i - 1].rank == p.rank {
            return Err(bad(format!("two parts are given for rank {}", p.rank)));
        }
        if let Some(ws) = world_size {
            if p.rank >= ws {
                return Err(bad(format!(
                    "rank {} is outside the world size {ws}",
                    p.rank
                )));
            }
        }
    }
    if let Some(ws) = world_size {
        let have: HashSet<u32> = sorted.iter().map(|p| p.rank).collect();
        let missing: Vec<u32> = (0..ws).filter(|r| !have.contains(r)).collect();
        if !missing.is_empty() {
            return Err(Error::MissingParts {
                dir: dir.to_path_buf(),
                checkpoint_id: id.to_string(),
                missing,
            });
        }
    }
    Ok(())
}

/// C2: every shard file the parts list is this id's and rank's, present, of the recorded
/// size, with the recorded header length and header CRC (only the header is read).
fn check_shards<S: Store>(store: &S, sorted: &[&Part]) -> Result<()> {
    let mut index = 0usize;
    for p in sorted {
        for (k, s) in p.shards.iter().enumerate() {
            let mismatch = |reason: String| Error::ShardMismatch {
                shard: index,
                file: store.describe(&s.file),
                reason: format!("rank {}'s shard {k}: {reason}", p.rank),
            };
            let want = rank_shard_file_name(&p.checkpoint_id, p.rank, k);
            if s.file != want {
                return Err(mismatch(format!("the part names it, expected {want:?}")));
            }
            // At most the header a valid entry can have: never more than the format's cap.
            let max = s.header_size.min(MAX_HEADER_SIZE).saturating_add(8);
            let (len, head) = match store.read_prefix(&s.file, max) {
                Ok(r) => r,
                // A shard that is there but cannot be read (EIO, a failing device) is an
                // I/O error with its errno, not a mismatch: the part may be sound and a
                // retried commit succeed. A missing file is a mismatch.
                Err(e @ Error::Io { .. })
                    if !matches!(&e, Error::Io { source, .. }
                        if source.kind() == std::io::ErrorKind::NotFound) =>
                {
                    return Err(e)
                }
                Err(e) => return Err(mismatch(cannot_open(e))),
            };
            if len != s.size {
                return Err(mismatch(format!(
                    "the file is {len} bytes but the part records {}",
                    s.size
                )));
            }
            let end = s
                .header_size
                .checked_add(8)
                .filter(|&e| e <= s.size && s.header_size <= MAX_HEADER_SIZE)
                .ok_or_else(|| {
                    mismatch(format!(
                        "header_size {} does not fit size {}",
                        s.header_size, s.size
                    ))
                })?;
            // `end` <= `max` and <= the file's length: `head` holds `end` bytes, unless the
            // file shrank meanwhile.
            let head = usize::try_from(end)
                .ok()
                .and_then(|e| head.get(..e))
                .ok_or_else(|| {
                    Error::io(
                        "read",
                        store.location().join(&s.file),
                        std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    )
                })?;
            let prefix = head.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok());
            if prefix.map(u64::from_le_bytes) != Some(s.header_size) {
                return Err(mismatch(format!(
                    "the header length prefix differs from the part's {}",
                    s.header_size
                )));
            }
            let got = crc32fast::hash(head.get(8..).unwrap_or(&[]));
            if got != s.header_crc32 {
                return Err(Error::ChecksumMismatch {
                    what: format!("shard header (rank {})", p.rank),
                    shard: index,
                    file: store.describe(&s.file),
                    expected: s.header_crc32,
                    got,
                });
            }
            index += 1;
        }
    }
    Ok(())
}

/// Why a shard could not be read, in C2's words: "cannot open PATH: CAUSE".
fn cannot_open(e: Error) -> String {
    match e {
        Error::Io { path, source, .. } => format!("cannot open {}: {source}", path.display()),
        Error::Remote { url, reason, .. } => format!("cannot open {url}: {reason}"),
        other => format!("cannot open: {other}"),
    }
}

/// C3, C4: the merged manifest of parts sorted by rank.
fn merge(id: &str, sorted: &[&Part], metadata: &serde_json::Value) -> Result<Manifest> {
    let mut shards = Vec::new();
    let mut tensors: Vec<TensorInfo> = Vec::new();
    // Every stored tensor name, with the rank that stores it; whole tensors separately.
    let mut owner: HashMap<String, u32> = HashMap::new();
    let mut wholes: HashMap<String, u32> = HashMap::new();
    let mut globals: Vec<GlobalEntry> = Vec::new();
    // Per global: its index in `globals` and the rank that first declared it.
    let mut global_ix: HashMap<String, (usize, u32)> = HashMap::new();
    // Per (global index, offsets): the chunk's index and the rank of its primary copy.
    let mut chunk_ix: HashMap<(usize, Vec<u64>), (usize, u32)> = HashMap::new();
    let mut crc_of: HashMap<String, Option<u32>> = HashMap::new();
    for p in sorted {
        let base = shards.len();
        shards.extend(p.shards.iter().cloned());
        let chunk_names: HashSet<&str> = p.chunks.iter().map(|c| c.tensor.as_str()).collect();
        for t in &p.tensors {
            if let Some(&other) = owner.get(&t.name) {
                let reason = if chunk_names.contains(t.name.as_str()) {
                    "both ranks store a tensor of this name"
                } else {
                    "both ranks offer this whole tensor; to replicate a tensor, offer it from each rank as one chunk covering the whole tensor"
                };
                return Err(Error::PartConflict {
                    name: t.name.clone(),
                    ranks: [other, p.rank],
                    reason: reason.into(),
                });
            }
            owner.insert(t.name.clone(), p.rank);
            if !chunk_names.contains(t.name.as_str()) {
                wholes.insert(t.name.clone(), p.rank);
            }
            crc_of.insert(t.name.clone(), t.crc32);
            let mut t = t.clone();
            t.shard = base
                .checked_add(t.shard)
                .ok_or_else(|| Error::InvalidArgument("shard indexes overflow".into()))?;
            tensors.push(t);
        }
        for c in &p.chunks {
            let gi = match global_ix.get(&c.global) {
                Some(&(gi, first)) => {
                    let g = &globals[gi];
                    if g.dtype != c.dtype || g.global_shape != c.global_shape {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [first, p.rank],
                            reason: format!(
                                "rank {first} declares the global tensor {} {:?}, rank {} {} {:?}",
                                g.dtype, g.global_shape, p.rank, c.dtype, c.global_shape
                            ),
                        });
                    }
                    gi
                }
                None => {
                    globals.push(GlobalEntry {
                        name: c.global.clone(),
                        dtype: c.dtype,
                        global_shape: c.global_shape.clone(),
                        chunks: Vec::new(),
                        grid: None,
                    });
                    global_ix.insert(c.global.clone(), (globals.len() - 1, p.rank));
                    globals.len() - 1
                }
            };
            match chunk_ix.get(&(gi, c.offsets.clone())) {
                Some(&(ci, prank)) => {
                    let ch = &mut globals[gi].chunks[ci];
                    if ch.shape != c.shape {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [prank, p.rank],
                            reason: format!(
                                "chunks at offsets {:?} overlap: rank {prank}'s has shape {:?}, rank {}'s {:?}",
                                c.offsets, ch.shape, p.rank, c.shape
                            ),
                        });
                    }
                    let (a, b) = (crc_of.get(&ch.tensor), crc_of.get(&c.tensor));
                    if a != b || a.is_none_or(Option::is_none) {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [prank, p.rank],
                            reason: format!(
                                "both write the chunk at offsets {:?} (shape {:?}) but the copies differ: CRC32 {} vs {}",
                                c.offsets,
                                c.shape,
                                crc_text(a),
                                crc_text(b)
                            ),
                        });
                    }
                    ch.replicas.push(c.tensor.clone());
                }
                None => {
                    let g = &mut globals[gi];
                    g.chunks.push(ChunkEntry {
                        offsets: c.offsets.clone(),
                        shape: c.shape.clone(),
                        tensor: c.tensor.clone(),
                        replicas: Vec::new(),
                    });
                    chunk_ix.insert((gi, c.offsets.clone()), (g.chunks.len() - 1, p.rank));
                }
            }
        }
    }
    for g in &globals {
        if let Some(&r) = wholes.get(&g.name) {
            let first = global_ix.get(&g.name).map_or(r, |&(_, f)| f);
            return Err(Error::PartConflict {
                name: g.name.clone(),
                ranks: [r.min(first), r.max(first)],
                reason: format!(
                    "rank {r} offers a whole tensor of this name, rank {first} chunks of a global tensor"
                ),
            });
        }
    }
    Ok(Manifest {
        format: manifest::FORMAT_NAME.into(),
        version: manifest::VERSION,
        features: if globals.is_empty() {
            vec![]
        } else {
            vec!["global".into()]
        },
        checkpoint_id: id.to_string(),
        shards,
        tensors,
        metadata: metadata.clone(),
        optimizer: None,
        globals,
        parts: Vec::new(),
        grids: Vec::new(),
    })
}

/// Globals of up to this many chunks are searched pair by pair for an overlap to report.
const MAX_OVERLAP_SEARCH: usize = 4096;

/// Two chunks of one global of `m` that overlap, as the conflict of the ranks that wrote
/// them (the first pair found; globals of more than [`MAX_OVERLAP_SEARCH`] chunks are not
/// searched).
fn overlapping_ranks(m: &Manifest, sorted: &[&Part]) -> Option<Error> {
    let rank_of: HashMap<&str, u32> = sorted
        .iter()
        .flat_map(|p| p.chunks.iter().map(|c| (c.tensor.as_str(), p.rank)))
        .collect();
    let meets = |a: &ChunkEntry, b: &ChunkEntry| {
        (0..a.offsets.len()).all(|d| {
            let (ao, bo) = (a.offsets[d], b.offsets[d]);
            let (ae, be) = (
                ao.saturating_add(a.shape.get(d).copied().unwrap_or(0)),
                bo.saturating_add(b.shape.get(d).copied().unwrap_or(0)),
            );
            ao < be && bo < ae
        })
    };
    for g in m
        .globals
        .iter()
        .filter(|g| g.chunks.len() <= MAX_OVERLAP_SEARCH)
    {
        for (i, a) in g.chunks.iter().enumerate() {
            for b in &g.chunks[i + 1..] {
                if a.offsets.len() == b.offsets.len() && meets(a, b) {
                    let ra = rank_of.get(a.tensor.as_str()).copied()?;
                    let rb = rank_of.get(b.tensor.as_str()).copied()?;
                    return Some(Error::PartConflict {
                        name: g.name.clone(),
                        ranks: [ra.min(rb), ra.max(rb)],
                        reason: format!(
                            "chunks overlap: rank {ra}'s at offsets {:?} shape {:?}, rank {rb}'s at offsets {:?} shape {:?}",
                            a.offsets, a.shape, b.offsets, b.shape
                        ),
                    });
                }
            }
        }
    }
    None
}

fn crc_text(c: Option<&Option<u32>>) -> String {
    match c {
        Some(Some(v)) => format!("{v:08x}"),
        _ => "(none)".into(),
    }
}

/// Wait until the part files of ranks `0..world_size` of `checkpoint_id` are all in `dir`
/// (polling), then [`commit`] them with `world_size`. The timeout bounds the wait for the
/// part files.
///
/// # Errors
/// [`Error::MissingParts`] naming the ranks whose part is still missing at the timeout
/// (nothing is committed); [`Error::InvalidPart`] naming the file of a descriptor that does
/// not decode; otherwise as [`commit`].
pub fn commit_rendezvous(
    dir: impl AsRef<Path>,
    checkpoint_id: &str,
    world_size: u32,
    timeout: Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    let dir = crate::location::local_path(dir.as_ref(), "write::parts::commit_rendezvous")?;
    let store = LocalStore::std(&dir);
    let lock = || local::lock_dir(&dir, Lock::Exclusive);
    let wait = Rendezvous {
        world_size,
        timeout,
        poll: POLL,
    };
    commit_rendezvous_impl(&store, checkpoint_id, &wait, opts, lock)
}

/// The bytes of part descriptor `name`, refused unread beyond its first MiB when it is over
/// [`MAX_MANIFEST_SIZE`] (a descriptor names less than the manifest merged from it); one
/// read for a descriptor of up to 1 MiB.
fn read_descriptor<S: Store>(store: &S, name: &str) -> Result<Vec<u8>> {
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
pub(crate) fn commit_rendezvous_impl<S: Store, G>(
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
        ..opts.clone()
    };
    commit_impl(store, checkpoint_id, &parts, &opts, lock)
}
