//! The storage seam under the writer: the few object-shaped operations the commit protocol
//! needs from wherever a checkpoint lives (format-spec/durability.md §Operations,
//! format-spec/s3.md §Save). A local directory ([`super::LocalStore`]) and an object-store
//! prefix (`store::s3::Remote`) implement it; the writer (`write`, `write::parts`) runs
//! single-process saves, ranks' parts and the multi-rank commit over it, unaware of which.
//!
//! Objects are named by their last path segment (`shard-<id>-<i>.safetensors`,
//! `ckpt-manifest.json`, ...) directly under the store's directory or prefix. Publishing is
//! atomic: a reader sees no object under a name, or the whole of one published object, never
//! a part of one.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// What a writer is about to do in a store, for [`Store::begin`]: how it holds the
/// store's writer lock (format-spec/durability.md §Writers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// A whole save: one at a time per directory (a second one fails at once).
    Save,
    /// A rank writing its part, beside the other ranks (shared).
    Part,
    /// A multi-rank commit: after the ranks still writing (exclusive, waiting).
    Commit,
}

/// What [`Store::begin`] holds while a writer runs: a local directory's writer lock
/// (released on drop), or nothing.
#[derive(Debug, Default)]
pub struct Held(pub(crate) Option<std::fs::File>);

/// A place that holds the objects of one checkpoint: a local directory or an object-store
/// prefix.
///
/// The trait is object safe: the verbs ([`crate::save`], [`crate::write_part`],
/// [`crate::commit`], ...) take any store as `&dyn Store` ([`crate::store::IntoStore`]), and
/// [`crate::store::connect`] makes one from a location. The fault-injection tests hand the
/// verbs a [`super::LocalStore`] over a substitute [`super::fs::Fs`].
pub trait Store: Sync {
    /// The names of the objects directly under the directory or prefix.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`] naming the directory or prefix.
    fn list(&self) -> Result<Vec<String>>;

    /// Whether an object `name` exists.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`] naming the object when that cannot be told.
    fn exists(&self, name: &str) -> Result<bool>;

    /// The size of object `name` and its first `min(max, size)` bytes (the multi-rank commit
    /// reads the headers of the ranks' shards this way, format-spec/global.md C2, and the
    /// rendezvous the part descriptors).
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`] naming the object (a missing one too).
    fn read_prefix(&self, name: &str, max: u64) -> Result<(u64, Vec<u8>)>;

    /// Start writing object `name`, published only by [`Put::finish`]; dropping the
    /// [`Put`] unfinished aborts it and leaves nothing behind (best effort). `staging` is
    /// the temporary name (starting with `TEMP_PREFIX`, unique to the writer) under which a
    /// store that cannot publish in place writes first: a local directory writes the
    /// temporary file `staging`, then renames it to `name`. Object stores ignore it.
    ///
    /// # Errors
    /// [`Error::Io`] (`create`, naming the temporary file) or [`Error::Remote`].
    fn put_streamed(&self, name: &str, staging: &str) -> Result<Box<dyn Put + '_>>;

    /// Publish the small object `name` holding `bytes` atomically ([`Store::put_streamed`],
    /// all of `bytes`, [`Put::finish`]; an object store does it in one request).
    ///
    /// # Errors
    /// As [`Store::put_streamed`] and [`Put::finish`].
    fn put(&self, name: &str, staging: &str, bytes: &[u8]) -> Result<()> {
        let mut p = self.put_streamed(name, staging)?;
        p.append(bytes)?;
        p.finish()
    }

    /// Publish one small file `name` (an index beside a checkpoint, say) durably: a local
    /// temporary file, fsync, rename, directory fsync; on an object store, one PUT
    /// ([`Store::put`], then [`Store::barrier`]).
    ///
    /// # Errors
    /// As [`Store::put`] and [`Store::barrier`].
    fn put_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let staging = format!("{}{name}", crate::format::names::TEMP_PREFIX);
        self.put(name, &staging, bytes)?;
        self.barrier("fsync directory")
    }

    /// Make the names published so far durable: a local directory fsyncs itself; an object
    /// store, whose completed PUTs are durable, does nothing. `context` says in the error
    /// what the barrier guards ("fsync directory (before commit; the old checkpoint stays)").
    ///
    /// # Errors
    /// [`Error::Io`] with `context` as its operation, naming the directory.
    fn barrier(&self, context: &'static str) -> Result<()>;

    /// Delete object `name`. On an object store, deleting an upload journal
    /// (`.ckpt-tmp-upload-*`, format-spec/s3.md §Uploads) aborts its upload first, and a
    /// missing object is no error; in a local directory a missing file is one.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`] naming the object.
    fn delete(&self, name: &str) -> Result<()>;

    /// The directory, or the prefix URL, for messages.
    fn location(&self) -> PathBuf;

    /// Get ready for a writer that is about to `access` the store, and hold what it must
    /// hold until the returned [`Held`] is dropped: a local directory on the real file
    /// system is created if missing (its new entries made durable; not for
    /// [`Access::Commit`], which needs the ranks' directory) and its writer lock taken; an object store is listed once, so that a missing bucket or bad credentials
    /// fail before anything is written; a directory over a substitute file system (the
    /// fault-injection seam) must exist and takes no lock. The default does nothing.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or lock file (`WouldBlock` for a second
    /// [`Access::Save`] into one directory); [`Error::Remote`] naming the bucket.
    fn begin(&self, access: Access) -> Result<Held> {
        let _ = access;
        Ok(Held::default())
    }

    /// The local directory of a store on a file system, `None` for an object store: the
    /// reader maps its files, and a save's background cleanup runs there.
    fn local_dir(&self) -> Option<&Path> {
        None
    }

    /// The object store connection behind an `s3://` store, `None` for a directory: the
    /// reader fetches its shards with ranged GETs.
    #[cfg(feature = "s3")]
    fn remote(&self) -> Option<&super::s3::Remote> {
        None
    }

    /// How errors about the contents of object `name` name it: a local store by the bare
    /// file name (as a manifest names its shards), an object store by the object's URL.
    fn describe(&self, name: &str) -> String;
}

/// An object being written: bytes go in through [`Write`], [`Put::finish`] publishes them,
/// and a drop without `finish` aborts (a local store removes its temporary file; an object
/// store aborts its multipart upload and deletes the upload's journal).
pub trait Put: Write + Send {
    /// A hint that bytes `[offset, offset + len)` are written and can start going to the
    /// device (a local file's write-back) ahead of the sync that makes them durable. It
    /// promises nothing and cannot fail; the default does nothing.
    fn start_writeback(&mut self, offset: u64, len: u64) {
        let _ = (offset, len);
    }

    /// The crate error for `e`, a failure of one of this object's [`Write`] calls, naming
    /// the object.
    fn write_error(&self, e: io::Error) -> Error;

    /// Write all of `bytes`; errors name the object ([`Put::write_error`]).
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Remote`].
    fn append(&mut self, bytes: &[u8]) -> Result<()> {
        self.write_all(bytes).map_err(|e| self.write_error(e))
    }

    /// Make the bytes written so far durable without publishing them (a local store fsyncs
    /// its temporary file; an object store does nothing before [`Put::finish`]). Optional:
    /// `finish` does it when it was not done. After a failure, only dropping is left (a
    /// failed fsync is never retried: format-spec/durability.md).
    ///
    /// # Errors
    /// [`Error::Io`] (`fsync`, naming the temporary file).
    fn sync(&mut self) -> Result<()>;

    /// Publish the object under its name, atomically and durably as far as the object
    /// itself goes (a local store: fsync and rename; the rename's directory entry is made
    /// durable by [`Store::barrier`]). After an error the object is not published and is
    /// aborted as by a drop.
    ///
    /// # Errors
    /// [`Error::Io`] (`fsync`, `rename`, naming the temporary file) or [`Error::Remote`]
    /// naming the object.
    fn finish(self: Box<Self>) -> Result<()>;
}
