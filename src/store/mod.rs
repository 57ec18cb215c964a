//! Where a checkpoint lives: a local path or an object-store URL (`s3://bucket/prefix`).
//!
//! Every entry point that takes a checkpoint location as text ([`open`], [`save`], the CLI,
//! the Python bindings) parses it with [`Location::parse`] first: a string of the form
//! `scheme://...` is never taken as a local path. `s3://` is served by [`s3`] (cargo
//! feature `s3`, on by default); `file:///abs/path` is a local path; any other scheme, or
//! `s3://` in a build without the feature, is [`Error::UnsupportedUrl`].
//!
//! Local checkpoints open with read-only memory maps exactly as [`Checkpoint::open`] does;
//! remote ones are downloaded into fresh buffers ([`Storage::Owned`]), so every reader of
//! [`Checkpoint`] (views, `verify`, conversions, optimizer loads, region reads) works on
//! both. The object layout is in format-spec/s3.md.

use crate::checkpoint::Checkpoint;
// `Error` is named by the docs in every build, by code only in builds without `s3`.
#[cfg(any(doc, not(feature = "s3")))]
use crate::error::Error;
use crate::error::Result;
use crate::format::manifest::OptimizerSection;
use crate::mmap::Map;
use crate::write::parts::{CommitOptions, Part, PartItem};
use crate::write::{CommitInfo, SaveOptions, TensorRef};

pub use crate::location::{IntoLocation, Location, RemoteUrl};

pub mod fs;
pub(crate) mod local;
mod object;
#[cfg(feature = "s3")]
pub mod s3;

pub use local::{LocalPut, LocalStore};
pub use object::{Put, Store};

/// The shard bytes of a checkpoint opened through [`open`]: a read-only map of a local
/// file, or a buffer downloaded from an object store.
#[derive(Debug)]
pub enum Storage {
    /// A local shard file, mapped read-only.
    Mapped(Map),
    /// A shard downloaded into memory (there is nothing to map).
    Owned(Vec<u8>),
}

impl crate::mmap::ReleasePages for Storage {
    fn release_pages(&self, offset: usize, len: usize) {
        if let Storage::Mapped(m) = self {
            m.release(offset, len);
        }
    }
    fn advise_sequential(&self) {
        if let Storage::Mapped(m) = self {
            m.advise_sequential();
        }
    }
}

impl AsRef<[u8]> for Storage {
    fn as_ref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m.as_ref(),
            Storage::Owned(v) => v,
        }
    }
}

/// Open a checkpoint at a path or URL ([`IntoLocation`]): local ones as
/// [`Checkpoint::open`] does (memory maps), remote ones with [`s3::open`].
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`Checkpoint::open`] or [`s3::open`].
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
        Location::Remote(u) => Ok(s3::open(&u)?.map_storage(Storage::Owned)),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(&u)),
    }
}

/// [`open`] on a parsed location.
///
/// # Errors
/// As [`open`].
#[deprecated(note = "open takes a Location: call ckptstore::open")]
pub fn open_location(location: &Location) -> Result<Checkpoint<Storage>> {
    open(location)
}

/// Save tensors as one committed checkpoint at a path or URL ([`IntoLocation`]):
/// [`crate::write::save`] locally, [`s3::save`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`crate::write::save`] or [`s3::save`].
pub fn save(
    location: impl IntoLocation,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    save_with_section(location, tensors, opts, None)
}

/// [`save`] with an optimizer section (see [`crate::write::save_with_section`]).
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
        Location::Local(p) => crate::write::save_with_section(p, tensors, opts, optimizer),
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::save_with_section(&u, tensors, opts, optimizer),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(&u)),
    }
}

/// [`save_with_section`] on a parsed location.
///
/// # Errors
/// As [`save`].
#[deprecated(note = "save_with_section takes a Location: call it")]
pub fn save_location(
    location: &Location,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<CommitInfo> {
    save_with_section(location, tensors, opts, optimizer)
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
/// [`crate::write::parts::write_part`] locally, [`s3::write_part`] on an object store.
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
        Location::Local(p) => crate::write::parts::write_part(p, checkpoint_id, rank, items, opts),
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::write_part(&u, checkpoint_id, rank, items, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(&u)),
    }
}

/// [`write_part`] on a parsed location.
///
/// # Errors
/// As [`write_part`].
#[deprecated(note = "write_part takes a Location: call it")]
pub fn write_part_location(
    location: &Location,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    write_part(location, checkpoint_id, rank, items, opts)
}

/// Commit the parts of a multi-rank checkpoint at a path or URL (the manifest last):
/// [`crate::write::parts::commit`] locally, [`s3::commit`] on an object store (one
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
        Location::Local(p) => crate::write::parts::commit(p, checkpoint_id, parts, opts),
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::commit(&u, checkpoint_id, parts, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(&u)),
    }
}

/// [`commit`] on a parsed location.
///
/// # Errors
/// As [`commit`].
#[deprecated(note = "commit takes a Location: call it")]
pub fn commit_location(
    location: &Location,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    commit(location, checkpoint_id, parts, opts)
}

/// Delete what the uncommitted multi-rank checkpoint `checkpoint_id` left at a path or URL
/// (its ranks' shards and parts, its temporary files): [`crate::write::parts::discard`]
/// locally; on an object store the same over the prefix (no lock: no rank may still be
/// writing that checkpoint). Returns how many files (objects) were removed.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`crate::write::parts::discard`].
pub fn discard(location: impl IntoLocation, checkpoint_id: &str) -> Result<usize> {
    match location.into_location()? {
        Location::Local(p) => crate::write::parts::discard(p, checkpoint_id),
        #[cfg(feature = "s3")]
        Location::Remote(u) => crate::write::parts::discard_impl(
            &s3::Remote::new(&u, &s3::S3Config::try_from_env()?)?,
            checkpoint_id,
        ),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(&u)),
    }
}

/// Wait (at most `timeout`) for the parts of ranks `0..world_size` at a path or URL, then
/// commit them: [`crate::write::parts::commit_rendezvous`] locally,
/// [`s3::commit_rendezvous`] on an object store.
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
            crate::write::parts::commit_rendezvous(p, checkpoint_id, world_size, timeout, opts)
        }
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::commit_rendezvous(&u, checkpoint_id, world_size, timeout, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(&u)),
    }
}

/// [`commit_rendezvous`] on a parsed location.
///
/// # Errors
/// As [`commit_rendezvous`].
#[deprecated(note = "commit_rendezvous takes a Location: call it")]
pub fn commit_rendezvous_location(
    location: &Location,
    checkpoint_id: &str,
    world_size: u32,
    timeout: std::time::Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    commit_rendezvous(location, checkpoint_id, world_size, timeout, opts)
}

#[cfg(not(feature = "s3"))]
pub(crate) fn no_s3(u: &RemoteUrl) -> Error {
    Error::UnsupportedUrl {
        url: u.to_string(),
        reason: "this build of ckptstore has no object-store support".into(),
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
            store.put(name, &format!("{}{name}", crate::write::TEMP_PREFIX), bytes)?;
            store.barrier("fsync directory")
        }
        #[cfg(feature = "s3")]
        Location::Remote(u) => {
            s3::Remote::new(u, &s3::S3Config::try_from_env()?)?.put_small(name, bytes.to_vec())
        }
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(u)),
    }
}
