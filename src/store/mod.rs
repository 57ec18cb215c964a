//! The store layer: where a checkpoint's bytes live and how they get there, a local
//! directory or an object-store prefix (`s3://bucket/prefix`), behind one object-shaped
//! trait ([`Store`]: list, get, atomic put, streamed put whose `finish` publishes and whose
//! drop aborts, delete, writer lock).
//!
//! [`LocalStore`] runs the local commit protocol's file steps (temporary file, fsync,
//! rename, directory fsync) over the [`fs`] seam the crash tests inject faults through;
//! [`s3`] (cargo feature `s3`, on by default) is the object-store backend on object_store.
//! The store sits below the reader, the writer and the manager and imports none of them: it
//! moves bytes ([`ranged`] reads fill sinks it knows nothing about). Locations are parsed by
//! [`Location::parse`]: a string of the form `scheme://...` is never taken as a local path;
//! `file:///abs/path` is a local path; any other scheme, or `s3://` in a build without the
//! feature, is `Error::UnsupportedUrl`. The verbs over locations (open, save, write_part,
//! commit) are at the crate root ([`crate::save`], ...) and take any store ([`IntoStore`]). The object layout is in
//! format-spec/s3.md.

#[cfg(not(feature = "s3"))]
use crate::error::Error;

pub use crate::location::{IntoLocation, Location, RemoteUrl};

mod connect;
pub mod copy;
pub mod fs;
pub use crate::sys::mmap;
pub(crate) mod local;
mod object;
pub mod publish;
pub mod ranged;
#[cfg(feature = "s3")]
pub mod s3;

pub use connect::{connect, IntoStore, StoreRef};
pub use local::{LocalPut, LocalStore};
pub use object::{Access, Held, Put, Store};

/// The error of an `s3://` location in a build without the feature `s3`.
#[cfg(not(feature = "s3"))]
pub(crate) fn no_s3(u: &RemoteUrl) -> Error {
    Error::UnsupportedUrl {
        url: u.to_string(),
        reason: "this build of ckptstore has no object-store support".into(),
    }
}
