//! The verbs, one entry point each, over any store ([`IntoStore`]: a local path, an
//! `s3://bucket/prefix` URL, a [`Location`](crate::store::Location), or a store the caller
//! made): [`open`], [`save`], [`write_part`], [`commit`], [`discard`]. Each connects once
//! ([`crate::store::connect`]; a `scheme://...` string is never a local path) and runs the
//! one reader or writer over that store: memory maps and the local commit protocol for a
//! directory, ranged GETs and multipart uploads for `s3://` (cargo feature `s3`, on by
//! default). What varies within a verb is an option of its options struct
//! ([`SaveOptions`], [`CommitOptions`]), never another function. The crate root re-exports
//! them (`ckptstore::open`, `ckptstore::save`, ...).

use crate::checkpoint::{Checkpoint, Storage};
// `Error` is named by the docs.
#[cfg(doc)]
use crate::error::Error;
use crate::error::{Error as E, Result};
use crate::store::IntoStore;
use crate::write::{self, parts::CommitOptions, parts::Part, parts::PartItem};
use crate::write::{CommitInfo, SaveOptions, TensorRef};

/// Open the checkpoint committed in a store: a local directory's shards are memory-mapped
/// read-only ([`Checkpoint::open`], [`Storage::Mapped`]), an object store's downloaded with
/// parallel ranged GETs into fresh buffers whose CRCs are summed as the bytes land
/// ([`crate::checkpoint::remote::open`], [`Storage::Owned`]). Either way the manifest and
/// every shard header are checked; tensor CRCs are checked by [`Checkpoint::verify`] and
/// the checked reads. (Reading a few tensors of a large remote checkpoint without
/// downloading it: [`crate::checkpoint::remote::open_lazy`].)
///
/// # Errors
/// [`Error::UnsupportedUrl`]; [`Error::NotFound`] if nothing is committed there; the
/// errors of [`Checkpoint::open`] or [`crate::checkpoint::remote::open`].
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let w = [1.0f32, 2.0];
/// let t = [ckptstore::TensorRef::from_slice("w", &[2], &w)];
/// ckptstore::save(dir.path(), &t, &Default::default())?;
/// assert_eq!(ckptstore::open(dir.path())?.read("w").view()?.as_slice::<f32>()?, &w[..]);
/// // A URL is never taken as a local path.
/// assert!(ckptstore::open("gs://bucket/run").is_err());
/// # Ok(()) }
/// ```
pub fn open<'a>(from: impl IntoStore<'a>) -> Result<Checkpoint<Storage>> {
    let store = from.into_store()?;
    if let Some(dir) = store.local_dir() {
        return Ok(Checkpoint::open(dir)?.map_storage(Storage::Mapped));
    }
    #[cfg(feature = "s3")]
    if let Some(r) = store.remote() {
        return Ok(crate::checkpoint::remote::open(r)?.map_storage(Storage::Owned));
    }
    Err(E::InvalidArgument(format!(
        "{}: this store has neither a directory to map nor an object store to fetch from",
        store.location().display()
    )))
}

/// Save tensors as one committed checkpoint in a store, atomically replacing any
/// checkpoint there.
///
/// Follows the commit protocol of format-spec/durability.md: shards are written
/// (rayon-parallel) under temporary names and published under names unique to the new
/// checkpoint id (a local directory: temporary file, fsync, rename, directory fsync; an
/// object store: multipart uploads); the manifest is published last (renamed over
/// `ckpt-manifest.json`, the directory fsynced again; on an object store, one PUT); only
/// then does the save count as committed, and the files of the previous checkpoint are
/// removed ([`SaveOptions::cleanup`]). A crash at any point leaves either the old or the new
/// checkpoint. A reader that has the old checkpoint open keeps reading its old bytes.
///
/// A local directory is created if missing and held with its writer lock (one save at a
/// time; a second fails at once); the temporary files of earlier failed or killed saves are
/// removed first, and after an error so are the files this save created
/// (format-spec/durability.md §Cleanup). On an object store the prefix is listed first, so
/// that a missing bucket or bad credentials fail before anything is uploaded; one writer
/// per prefix (format-spec/s3.md §Writers). An optimizer state goes in
/// [`SaveOptions::optimizer`] ([`crate::optim::OptimizerStateRef::save`] builds it).
///
/// # Errors
/// [`Error::UnsupportedUrl`]; [`Error::InvalidTensor`] or [`Error::InvalidArgument`] for
/// duplicate names, sizes that do not fit, or a checkpoint over the format's limits (found
/// before any checkpoint file is written, except an over-large manifest, found after the
/// shards: the old checkpoint stays committed); [`Error::InvalidOptimizerState`] naming
/// the parameter and state if the optimizer section breaks a rule; [`Error::Io`] naming
/// the file, or [`Error::Remote`] naming the object URL, for I/O failures. After an error
/// the store holds the previous checkpoint, or, if only the final directory fsync failed,
/// possibly the new one: never a mix. Only `Ok` guarantees the new checkpoint is durable.
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// use ckptstore::{save, SaveOptions, TensorRef};
/// let dir = tempfile::tempdir().unwrap();
/// let w = vec![0.5f32; 1024];
/// let step = [1000i64];
/// let info = save(
///     dir.path(),
///     &[TensorRef::from_slice("w", &[32, 32], &w), TensorRef::from_slice("step", &[], &step)],
///     &SaveOptions { metadata: serde_json::json!({"run": "demo"}), ..Default::default() },
/// )?;
/// assert_eq!(info.tensors, 2);
/// # Ok(()) }
/// ```
pub fn save<'a>(
    to: impl IntoStore<'a>,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    write::save(&*to.into_store()?, tensors, opts)
}

/// Write rank `rank`'s part of the multi-rank checkpoint `checkpoint_id` into a store
/// (format-spec/global.md §Parts): its shards `shard-<id>-r<rank>-<k>.safetensors`, then its
/// part descriptor `part-<id>-r<rank>.json`, each published atomically. Ranks run
/// concurrently: in a local directory each holds the writer lock shared while it writes
/// (waiting while a save or commit holds it), so no save or commit runs meanwhile. No
/// manifest is written: one coordinator's [`commit`] does that. `opts.metadata` is not
/// used (the commit's is), and `opts.optimizer` is refused (it goes to the commit).
///
/// Everything is validated before the store is touched; after an error the files this call
/// created are removed. Temporary files that an earlier attempt of this rank and id left
/// in a local directory (killed, or its removals failed) are removed first, so the rank can
/// be retried.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; [`Error::InvalidArgument`] for a malformed id, an optimizer
/// section, or a part already written for this rank; [`Error::InvalidTensor`] naming the
/// tensor for a bad name, size, chunk box outside its global shape, ranks that disagree, a
/// chunk given twice, or a whole tensor named like a global one; [`Error::Io`] naming the
/// file or [`Error::Remote`] naming the object URL.
pub fn write_part<'a>(
    to: impl IntoStore<'a>,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    write::parts::write_part(&*to.into_store()?, checkpoint_id, rank, items, opts)
}

/// Commit the parts of the multi-rank checkpoint `checkpoint_id` in a store, with the
/// manifest last (format-spec/global.md §The commit, C1-C6): check every part, read the
/// header of every shard it lists, merge (or, for many chunks, a two-level root:
/// [`CommitOptions::layout`]), validate the merged manifest with the reader's rules,
/// publish it, then remove the part descriptors of this id and the files of other ids.
/// `parts` are the ranks' [`write_part`] results; with [`CommitOptions::wait_for_parts`]
/// the commit instead waits for every rank's descriptor in the store and reads them (pass
/// no parts). A local directory is held with its writer lock taken exclusively (after the
/// ranks still writing); an object store takes one committer per prefix
/// (format-spec/s3.md §Writers).
///
/// # Errors
/// Nothing is committed after any error (the previous manifest stays):
/// [`Error::UnsupportedUrl`]; [`Error::InvalidArgument`] for a malformed id, parts of
/// another id, or a rendezvous without `world_size`; [`Error::MissingParts`] naming the
/// ranks missing (at the timeout, when waiting); [`Error::InvalidPart`] for a descriptor
/// that does not decode; [`Error::ShardMismatch`] for a missing or wrong shard;
/// [`Error::InvalidTensor`] for chunks that overlap or leave holes;
/// [`Error::InvalidOptimizerState`]; [`Error::Io`] / [`Error::Remote`].
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// use ckptstore::{commit, open, write_part, PartItem, TensorRef};
/// use ckptstore::write::parts::{new_checkpoint_id, CommitOptions};
/// let dir = tempfile::tempdir().unwrap();
/// let w = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0];
/// let id = new_checkpoint_id()?;
/// // Two ranks, each holding two rows of a [4, 2] tensor.
/// let parts = (0..2u32)
///     .map(|r| {
///         let rows = &w[4 * r as usize..4 * r as usize + 4];
///         let item = PartItem::Chunk {
///             tensor: TensorRef::from_slice("w", &[2, 2], rows),
///             global_shape: vec![4, 2],
///             offsets: vec![2 * r as u64, 0],
///         };
///         write_part(dir.path(), &id, r, &[item], &Default::default())
///     })
///     .collect::<ckptstore::Result<Vec<_>>>()?;
/// let opts = CommitOptions { world_size: Some(2), ..Default::default() };
/// commit(dir.path(), &id, &parts, &opts)?;
/// let ck = open(dir.path())?;
/// ck.verify()?;
/// assert_eq!(ck.read("w").to_tensor()?.as_slice::<f32>()?, &w[..]);
/// # Ok(()) }
/// ```
pub fn commit<'a>(
    to: impl IntoStore<'a>,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    write::parts::commit(&*to.into_store()?, checkpoint_id, parts, opts)
}

/// Delete what the uncommitted multi-rank checkpoint `checkpoint_id` left in a store (its
/// ranks' shards and part descriptors, its temporary files): a job that abandons a save, a
/// consolidation that failed half-way. A local directory is held with its writer lock taken
/// exclusively, so this waits for ranks still writing their parts; on an object store no
/// rank may still be writing that checkpoint. Returns how many files (objects) were removed.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; [`Error::InvalidArgument`] for a malformed id, or if
/// `checkpoint_id` is the committed checkpoint (nothing is removed); [`Error::Io`] naming
/// the directory or a file, [`Error::Remote`] naming the object.
pub fn discard<'a>(at: impl IntoStore<'a>, checkpoint_id: &str) -> Result<usize> {
    write::parts::discard(&*at.into_store()?, checkpoint_id)
}
