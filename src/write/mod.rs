//! Writing checkpoints: shard planning, parallel shard writes and the commit protocol
//! (format-spec/durability.md).

mod cleanup;
pub mod fs;
pub mod parts;
#[doc(hidden)]
pub mod pause;
mod shard;
mod tensor_ref;
mod two_level;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::dtype::{checked_nbytes, checked_numel, DType};
use crate::error::{Error, Result};
use crate::format::header::{self, HeaderEntry};
use crate::format::manifest::{
    self, BlockCrcs, Manifest, OptimizerSection, ShardEntry, TensorInfo, MANIFEST_FILE,
};
use crate::format::optimizer::check_section;
use crate::format::{
    check_tensor_name, MAX_HEADER_SIZE, MAX_MANIFEST_SIZE, MAX_RANK, MAX_SHARDS, MAX_TENSORS,
    MAX_TENSORS_PER_SHARD, META_CHECKPOINT_ID,
};
use crate::store::{Access, Store};
use crate::view::Element;

pub(crate) use crate::format::names::{engine_file_id, is_id};
pub use crate::format::names::{
    is_engine_file, part_file_name, rank_shard_file_name, shard_file_name, LOCK_FILE, TEMP_PREFIX,
};
use shard::*;
pub use tensor_ref::TensorRef;

/// Default maximum shard size: 4 GiB of tensor data.
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 4 << 30;
/// Size of the chunks in which data is checksummed and written.
const CHUNK: usize = 8 << 20;
/// Bytes written between two write-back hints ([`Put::start_writeback`]).
const WRITEBACK_BYTES: u64 = 8 << 20;

/// Options for [`crate::save`] and [`crate::write_part`].
#[derive(Clone)]
pub struct SaveOptions {
    /// Most bytes of tensor data per shard; a larger tensor gets a shard of its own.
    pub max_shard_size: u64,
    /// User metadata stored in the manifest: a JSON object.
    pub metadata: serde_json::Value,
    /// Called with the byte count of each chunk written (for progress bars).
    pub progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    /// Block size of the per-block CRC32s recorded for tensors larger than one block
    /// (format-spec/integrity.md §Block CRCs), which let region reads check only the
    /// blocks they touch; `0` records none. A power of two in `[4096, 2^30]`; default
    /// `DEFAULT_BLOCK_SIZE` (256 KiB).
    pub block_size: u64,
    /// When the files the new checkpoint no longer references (the previous checkpoint's
    /// shards) are removed: before `save` returns (default) or on a background thread
    /// ([`Cleanup`]).
    pub cleanup: Cleanup,
    /// The optimizer section (format-spec/optimizer.md) of a save that holds an optimizer
    /// state, checked against the tensors by every rule of format-spec/optimizer.md
    /// §Rules before anything is written. [`crate::optim::OptimizerStateRef::save`] builds
    /// it; tools that copy checkpoints (`ckpt pack`) pass the one they read. Refused by
    /// [`crate::write_part`] (a multi-rank checkpoint's section comes with the commit:
    /// [`parts::CommitOptions::optimizer`]).
    pub optimizer: Option<OptimizerSection>,
}

/// When a save removes the files its new checkpoint does not reference: step 5 of
/// format-spec/durability.md, the previous checkpoint's shards and the leftovers of
/// interrupted saves. Either way the new checkpoint is committed and durable first, and a
/// crash during the removal leaves garbage that the next save in the directory removes,
/// never damage.
///
/// Removing large files is not free: on ext4 each unlink frees the file's extents under
/// the journal, measured at 0.15-0.25 s per 256 MiB shard on the development VM (about
/// 0.9 s for a 1 GiB checkpoint), time a training loop need not wait for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cleanup {
    /// Remove them before the save returns; [`CommitInfo::removed`] counts them.
    #[default]
    Inline,
    /// Return at the commit point and remove them on a background thread that keeps the
    /// directory's writer lock until it is done. The next save or commit into the same
    /// directory from this process waits for it ([`wait_for_cleanup`] waits for all);
    /// another process meets the lock as if the save were still running.
    /// [`CommitInfo::removed`] then counts only the temporary files removed before
    /// writing. Applies to local directories; object-store saves remove inline.
    Background,
}

pub use cleanup::wait_for_cleanup;
#[doc(hidden)]
pub use cleanup::{hold_background_cleanup, waiting_for_cleanup};

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
            metadata: serde_json::Value::Object(Default::default()),
            progress: None,
            block_size: crate::crc::DEFAULT_BLOCK_SIZE,
            cleanup: Cleanup::Inline,
            optimizer: None,
        }
    }
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("max_shard_size", &self.max_shard_size)
            .field("metadata", &self.metadata)
            .field("block_size", &self.block_size)
            .field("cleanup", &self.cleanup)
            .field("optimizer", &self.optimizer.is_some())
            .finish_non_exhaustive()
    }
}

/// What a committed save wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitInfo {
    /// The new checkpoint's id.
    pub checkpoint_id: String,
    /// Number of shard files.
    pub shards: usize,
    /// Number of tensors.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub data_bytes: u64,
    /// Files removed: temporary files of interrupted saves (before the shards were written,
    /// by [`crate::save`]; before the shard checks, by [`crate::commit`]) and, after the
    /// commit, files of earlier checkpoints and
    /// interrupted saves.
    pub removed: usize,
}

/// Save `tensors` as one committed checkpoint in `store`, atomically replacing any
/// checkpoint there (the verb is [`crate::save`], which documents it): validation (the
/// optimizer section too), [`Store::begin`] (a local directory: created, writer lock
/// taken, this process's background cleanup of it waited for; an object store: probed),
/// the leftovers of ended saves removed (under the lock only), the protocol, then the
/// cleanup, inline or (a locked local directory and [`Cleanup::Background`]) on a thread
/// that keeps the lock.
pub(crate) fn save(
    store: &dyn Store,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    let sizes = validate_inputs(tensors, opts, opts.optimizer.as_ref())?;
    if let Some(dir) = store.local_dir() {
        cleanup::wait_in(dir);
    }
    let held = store.begin(Access::Save)?;
    // Under the lock every temporary file belongs to a save that has ended: free its space
    // before writing ours (format-spec/durability.md §Cleanup).
    let leftovers = match held.0 {
        Some(_) => remove_leftover_temps(store),
        None => 0,
    };
    let (mut info, sweep) = commit(store, tensors, &sizes, opts, opts.optimizer.clone())?;
    info.removed += leftovers;
    match (opts.cleanup, held.0, store.local_dir()) {
        (Cleanup::Background, Some(lock), Some(dir)) => cleanup::spawn(dir, lock, sweep),
        _ => info.removed += sweep.run(store),
    }
    Ok(info)
}

/// Remove the temporary objects (`.ckpt-tmp-*`) of earlier saves from `store`; returns how
/// many were removed. Call only while no other writer runs there (a local directory: holding
/// its writer lock; an object store: one writer per prefix), so that every temporary object
/// belongs to one that ended. Failures are ignored: they leave garbage, never damage (no
/// manifest names a temporary object).
pub(crate) fn remove_leftover_temps<S: Store + ?Sized>(store: &S) -> usize {
    let Ok(entries) = store.list() else {
        return 0;
    };
    entries
        .iter()
        .filter(|n| n.starts_with(TEMP_PREFIX))
        .filter(|n| store.delete(n).is_ok())
        .count()
}

/// The objects this save has published and not yet committed, deleted when dropped unless
/// [`Created::commit`]ed: after any error (or panic) before the manifest is published, a
/// save leaves no object of its own behind (format-spec/durability.md §Cleanup). An object
/// still being written is its [`Put`]'s, which aborts it when dropped unfinished. Only
/// names this save published are recorded, so an object it did not write is never deleted.
struct Created<'s, S: Store + ?Sized> {
    store: &'s S,
    names: Mutex<Vec<String>>,
    committed: bool,
}

impl<'s, S: Store + ?Sized> Created<'s, S> {
    fn new(store: &'s S) -> Self {
        Created {
            store,
            names: Mutex::new(Vec::new()),
            committed: false,
        }
    }

    /// `name` was published by this save.
    fn published(&self, name: &str) {
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name.to_string());
    }

    /// The manifest is published: the objects belong to the new checkpoint now.
    fn commit(mut self) {
        self.committed = true;
    }
}

impl<S: Store + ?Sized> Drop for Created<'_, S> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let names = std::mem::take(self.names.get_mut().unwrap_or_else(|p| p.into_inner()));
        for n in names {
            let _ = self.store.delete(&n);
        }
    }
}

pub(crate) use crate::format::names::random_id;

/// Step 0 of the protocol: validate everything (the optimizer section too) before touching
/// the disk. Returns each tensor's byte size.
fn validate_inputs(
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<&OptimizerSection>,
) -> Result<Vec<u64>> {
    if !opts.metadata.is_object() {
        return Err(Error::InvalidArgument(
            "metadata must be a JSON object".into(),
        ));
    }
    crate::format::check_json_depth(&opts.metadata)
        .map_err(|e| Error::InvalidArgument(format!("metadata {e}")))?;
    if opts.max_shard_size == 0 {
        return Err(Error::InvalidArgument(
            "max_shard_size must be positive".into(),
        ));
    }
    let b = opts.block_size;
    if b != 0
        && (!b.is_power_of_two()
            || !(crate::crc::MIN_BLOCK_SIZE..=crate::crc::MAX_BLOCK_SIZE).contains(&b))
    {
        return Err(Error::InvalidArgument(format!(
            "block_size {b} must be 0 or a power of two in [{}, {}]",
            crate::crc::MIN_BLOCK_SIZE,
            crate::crc::MAX_BLOCK_SIZE
        )));
    }
    if tensors.len() > MAX_TENSORS {
        return Err(Error::InvalidArgument(format!(
            "{} tensors exceed the format's limit of {MAX_TENSORS} per checkpoint",
            tensors.len()
        )));
    }
    let sizes = tensors
        .iter()
        .map(TensorRef::validate)
        .collect::<Result<Vec<_>>>()?;
    let mut by_name: HashMap<&str, &TensorRef<'_>> = HashMap::with_capacity(tensors.len());
    for t in tensors {
        if by_name.insert(t.name.as_ref(), t).is_some() {
            return Err(Error::InvalidTensor {
                name: t.name.to_string(),
                reason: "the name is given twice".into(),
            });
        }
    }
    if let Some(sec) = optimizer {
        check_section(sec, |n| {
            by_name.get(n).map(|t| (t.dtype, t.shape.as_slice()))
        })?;
    }
    Ok(sizes)
}

/// The protocol (format-spec/durability.md) on validated input: draw the id, plan the
/// shards and check the plan against the format's limits (step 0), then steps 1-4.
/// Returns what was committed (`removed` 0) and step 5's work, for the caller to run.
fn commit<S: Store + ?Sized>(
    store: &S,
    tensors: &[TensorRef<'_>],
    sizes: &[u64],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<(CommitInfo, Sweep)> {
    let id = random_id()?;
    let planned = plan_shards(&id, tensors, sizes, opts, 0)?;
    pause::point(pause::Point::BeforeShards);
    // From here until the manifest rename, an error removes every file this save created.
    let created = Created::new(store);
    // Steps 1-2.
    let (shards, infos) = write_shards(store, &created, tensors, &planned, opts, &|i| {
        shard_file_name(&id, i)
    })?;
    // 3. The manifest.
    let m = Manifest {
        format: manifest::FORMAT_NAME.into(),
        version: manifest::VERSION,
        features: if optimizer.is_some() {
            vec!["optimizer".into()]
        } else {
            vec![]
        },
        checkpoint_id: id.clone(),
        shards,
        tensors: infos,
        metadata: opts.metadata.clone(),
        optimizer,
        globals: Vec::new(),
        parts: Vec::new(),
        grids: Vec::new(),
    };
    let bytes = encode_checked(&m)?;
    // Steps 3-4.
    let sweep = commit_manifest(store, created, &bytes, &m)?;
    let info = CommitInfo {
        checkpoint_id: id,
        shards: m.shards.len(),
        tensors: m.tensors.len(),
        data_bytes: sizes.iter().sum(),
        removed: 0,
    };
    Ok((info, sweep))
}

/// `m` encoded with its trailer, refused if over the format's manifest size cap.
fn encode_checked(m: &Manifest) -> Result<Vec<u8>> {
    let bytes = manifest::encode(m);
    if bytes.len() as u64 > MAX_MANIFEST_SIZE {
        return Err(Error::InvalidArgument(format!(
            "the manifest would be {} bytes, over the format's {MAX_MANIFEST_SIZE}-byte cap",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Steps 3-4 of the protocol, shared by [`save`] and [`crate::commit`]: write `bytes` (the
/// encoding of `m`) as the manifest (locally: temporary file, fsync), publish it (the
/// rename: the commit point), then the store's barrier (the directory fsync). Until the
/// manifest is published, an error drops `created` and so deletes every object it records.
/// Returns step 5, the cleanup, for the caller to run (inline or on a background thread,
/// [`Cleanup`]).
fn commit_manifest<S: Store + ?Sized>(
    store: &S,
    created: Created<'_, S>,
    bytes: &[u8],
    m: &Manifest,
) -> Result<Sweep> {
    let staging = format!("{TEMP_PREFIX}{}-manifest", m.checkpoint_id);
    let mut put = store.put_streamed(MANIFEST_FILE, &staging)?;
    put.append(bytes)?;
    put.sync()?;
    pause::point(pause::Point::BeforeManifestRename);
    if let Err(e) = put.finish() {
        // The publish failed, but it may have happened: an object store applies a PUT
        // whose answer is then lost. Our files must go only if our manifest is not the
        // committed one (they would be the data of the checkpoint now committed), so read
        // back what is there.
        return match store.read_prefix(MANIFEST_FILE, bytes.len() as u64 + 1) {
            Ok((len, got)) if len == bytes.len() as u64 && got == bytes => {
                // It landed: this checkpoint is committed; go on from the commit point.
                created.commit();
                pause::point(pause::Point::AfterManifestRename);
                store.barrier(
                    "fsync directory (at the commit point; old or new checkpoint, undetermined)",
                )?;
                pause::point(pause::Point::BeforeCleanup);
                Ok(Sweep::after(m))
            }
            // Another manifest (the old checkpoint) or none: ours did not land; `created`
            // drops here and removes our files.
            Ok(_) => Err(e),
            Err(Error::Io { ref source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Err(e)
            }
            Err(Error::NotFound { .. }) => Err(e),
            Err(_) => {
                // Cannot tell: keep our files (a later save or `gc` sweeps them once a
                // commit decides); the error says the publish failed.
                created.commit();
                Err(e)
            }
        };
    }
    created.commit();
    pause::point(pause::Point::AfterManifestRename);
    // 4. The commit point: the new manifest's directory entry is durable.
    store.barrier("fsync directory (at the commit point; old or new checkpoint, undetermined)")?;
    pause::point(pause::Point::BeforeCleanup);
    Ok(Sweep::after(m))
}

/// Step 5, decided at the commit point: remove the engine files the just-committed
/// manifest does not reference: files of earlier checkpoints and of interrupted saves,
/// temporary files, and the part descriptors of its own id. Other files of its id are never
/// removed. Run only under the writer lock. Failures leave garbage, never damage: the new
/// checkpoint is committed.
pub(crate) struct Sweep {
    id: String,
    keep: HashSet<String>,
}

impl Sweep {
    fn after(m: &Manifest) -> Sweep {
        Sweep {
            id: m.checkpoint_id.clone(),
            keep: m.files().map(str::to_string).collect(),
        }
    }

    /// Delete the objects; returns how many were deleted.
    pub(crate) fn run<S: Store + ?Sized>(&self, store: &S) -> usize {
        let Ok(entries) = store.list() else {
            return 0;
        };
        entries
            .iter()
            .filter(|name| is_engine_file(name) && !self.keep.contains(name.as_str()))
            .filter(|name| {
                engine_file_id(name) != Some(self.id.as_str()) || name.starts_with("part-")
            })
            .filter(|name| store.delete(name).is_ok())
            .count()
    }
}
