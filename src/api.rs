//! The verbs over a location, a local path or an object-store URL (`s3://bucket/prefix`):
//! [`open`], [`save`], [`write_part`], [`commit`], [`commit_rendezvous`], [`discard`],
//! [`put_file`]. Each parses its location once ([`IntoLocation`]; a `scheme://...` string
//! is never a local path) and runs the one reader or writer over that location's store:
//! memory maps and the local commit protocol for a path, ranged GETs and multipart uploads
//! for `s3://` (cargo feature `s3`, on by default). This module is the top of the library
//! beside the manager; the root re-exports its verbs (`ckptstore::open`, `ckptstore::save`,
//! ...).

#[cfg(feature = "s3")]
use crate::checkpoint::remote;
use crate::checkpoint::{Checkpoint, Storage};
// `Error` is named by the docs.
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::format::manifest::OptimizerSection;
use crate::format::names::TEMP_PREFIX;
use crate::location::{IntoLocation, Location};
#[cfg(feature = "s3")]
use crate::store::s3::{Remote, S3Config};
use crate::store::{LocalStore, Store};
use crate::write::{self, parts::CommitOptions, parts::Part, parts::PartItem};
use crate::write::{CommitInfo, SaveOptions, TensorRef};

/// Open a checkpoint at a path or URL ([`IntoLocation`]): local ones as
/// [`Checkpoint::open`] does (memory maps), remote ones with [`remote::open`].
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`Checkpoint::open`] or [`remote::open`].
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let w = [1.0f32, 2.0];
/// let t = [ckptstore::TensorRef::from_slice("w", &[2], &w)];
/// ckptstore::save(dir.path(), &t, &Default::default())?;
/// assert_eq!(ckptstore::open(dir.path())?.tensor("w")?.as_slice::<f32>()?, &w[..]);
/// // A URL is never taken as a local path.
/// assert!(ckptstore::open("gs://bucket/run").is_err());
/// # Ok(()) }
/// ```
pub fn open(location: impl IntoLocation) -> Result<Checkpoint<Storage>> {
    match location.into_location()? {
        Location::Local(p) => Ok(Checkpoint::open(p)?.map_storage(Storage::Mapped)),
        #[cfg(feature = "s3")]
        Location::Remote(u) => Ok(remote::open(&u)?.map_storage(Storage::Owned)),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(&u)),
    }
}

/// Save tensors as one committed checkpoint at a path or URL ([`IntoLocation`]):
/// [`write::save`] locally, [`write::remote::save`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`write::save`] or [`write::remote::save`].
pub fn save(
    location: impl IntoLocation,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    save_with_section(location, tensors, opts, None)
}

/// [`save`] with an optimizer section (see [`write::save_with_section`]).
///
/// # Errors
/// As [`save`].
pub fn save_with_section(
    location: impl IntoLocation,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<CommitInfo> {
    match location.into_location()? {
        Location::Local(p) => write::save_with_section(p, tensors, opts, optimizer),
        #[cfg(feature = "s3")]
        Location::Remote(u) => write::remote::save_with_section(&u, tensors, opts, optimizer),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(&u)),
    }
}

/// Save an optimizer state with `model` tensors beside it at a location (as
/// [`crate::optim::OptimizerState::save`] does locally).
///
/// # Errors
/// As [`crate::optim::OptimizerState::save`] and [`save`].
pub fn save_optimizer(
    location: impl IntoLocation,
    state: &crate::optim::OptimizerStateRef<'_>,
    model: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    let (tensors, section) = state.to_parts(model)?;
    save_with_section(location, &tensors, opts, Some(section))
}

/// Write rank `rank`'s part of the multi-rank checkpoint `checkpoint_id` at a path or URL:
/// [`write::parts::write_part`] locally, [`write::remote::write_part`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of those functions.
pub fn write_part(
    location: impl IntoLocation,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    match location.into_location()? {
        Location::Local(p) => write::parts::write_part(p, checkpoint_id, rank, items, opts),
        #[cfg(feature = "s3")]
        Location::Remote(u) => write::remote::write_part(&u, checkpoint_id, rank, items, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(&u)),
    }
}

/// Commit the parts of a multi-rank checkpoint at a path or URL (the manifest last):
/// [`write::parts::commit`] locally, [`write::remote::commit`] on an object store (one
/// committer per prefix: format-spec/s3.md §Writers).
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of those functions (nothing is committed).
pub fn commit(
    location: impl IntoLocation,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    match location.into_location()? {
        Location::Local(p) => write::parts::commit(p, checkpoint_id, parts, opts),
        #[cfg(feature = "s3")]
        Location::Remote(u) => write::remote::commit(&u, checkpoint_id, parts, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(&u)),
    }
}

/// Delete what the uncommitted multi-rank checkpoint `checkpoint_id` left at a path or URL
/// (its ranks' shards and parts, its temporary files): [`write::parts::discard`]
/// locally; on an object store the same over the prefix (no lock: no rank may still be
/// writing that checkpoint). Returns how many files (objects) were removed.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`write::parts::discard`].
pub fn discard(location: impl IntoLocation, checkpoint_id: &str) -> Result<usize> {
    match location.into_location()? {
        Location::Local(p) => write::parts::discard(p, checkpoint_id),
        #[cfg(feature = "s3")]
        Location::Remote(u) => {
            write::parts::discard_impl(&Remote::new(&u, &S3Config::try_from_env()?)?, checkpoint_id)
        }
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(&u)),
    }
}

/// Wait (at most `timeout`) for the parts of ranks `0..world_size` at a path or URL, then
/// commit them: [`write::parts::commit_rendezvous`] locally,
/// [`write::remote::commit_rendezvous`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; [`Error::MissingParts`] naming the ranks still missing at the
/// timeout; the errors of those functions (nothing is committed).
pub fn commit_rendezvous(
    location: impl IntoLocation,
    checkpoint_id: &str,
    world_size: u32,
    timeout: std::time::Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    match location.into_location()? {
        Location::Local(p) => {
            write::parts::commit_rendezvous(p, checkpoint_id, world_size, timeout, opts)
        }
        #[cfg(feature = "s3")]
        Location::Remote(u) => {
            write::remote::commit_rendezvous(&u, checkpoint_id, world_size, timeout, opts)
        }
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(&u)),
    }
}

/// Write one small file `name` beside a checkpoint (an index, say) durably: a local
/// temporary file, fsync, rename, directory fsync; on an object store, one PUT (the
/// [`Store::put`] and [`Store::barrier`] of the location's store).
///
/// # Errors
/// [`Error::Io`] / [`Error::Remote`] naming the file or object.
pub fn put_file(location: &Location, name: &str, bytes: &[u8]) -> Result<()> {
    match location {
        Location::Local(dir) => {
            let store = LocalStore::std(dir);
            store.put(name, &format!("{TEMP_PREFIX}{name}"), bytes)?;
            store.barrier("fsync directory")
        }
        #[cfg(feature = "s3")]
        Location::Remote(u) => {
            Remote::new(u, &S3Config::try_from_env()?)?.put_small(name, bytes.to_vec())
        }
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(crate::store::no_s3(u)),
    }
}

/// The object-store verbs with an explicit configuration ([`S3Config`]) or
/// connection ([`Remote`]), where the verbs above take a URL and the
/// environment's configuration: the reader's (`open_with`, `open_lazy`, ...) and the
/// writer's (`save_with`, `write_part_remote`, `commit_remote`, ...) in one place, with the
/// store's types they take (cargo feature `s3`).
#[cfg(feature = "s3")]
pub mod s3 {
    #[allow(deprecated)]
    pub use crate::checkpoint::remote::RemoteCheckpoint;
    pub use crate::checkpoint::remote::{open, open_lazy, open_remote, open_with};
    pub use crate::store::s3::{gc_prefix, Listing, ObjectPut, Remote, RemoteShard, S3Config};
    pub use crate::write::remote::{
        commit, commit_remote, commit_rendezvous, commit_rendezvous_remote, save, save_remote,
        save_with, save_with_section, write_part, write_part_remote,
    };
}
