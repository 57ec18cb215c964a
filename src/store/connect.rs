//! From a location to a store: [`connect`] (object_store's `parse_url`) and [`IntoStore`],
//! what every verb takes: a location (a path, `s3://bucket/prefix`, a [`Location`]) that it
//! connects to, or a store the caller made (its own [`super::s3::S3Config`], or a
//! [`LocalStore`] over a fault-injecting [`super::fs::Fs`]).

use std::ops::Deref;

use super::object::Store;
use super::LocalStore;
use crate::error::Result;
use crate::location::{IntoLocation, Location};

/// The store at `location`: a local directory on the real file system (not created yet:
/// writers create it), or an object-store prefix configured from the environment
/// ([`super::s3::S3Config::try_from_env`]; no request is made yet).
///
/// # Errors
/// [`crate::Error::UnsupportedUrl`] for a URL this build cannot serve;
/// [`crate::Error::InvalidArgument`] for an invalid object-store configuration.
///
/// # Example
/// ```
/// # fn main() -> ckptstore::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let store = ckptstore::store::connect(dir.path())?;
/// let t = [ckptstore::TensorRef::from_slice("w", &[2], &[1.0f32, 2.0])];
/// ckptstore::save(&*store, &t, &Default::default())?;
/// assert!(store.list()?.contains(&"ckpt-manifest.json".to_string()));
/// # Ok(()) }
/// ```
pub fn connect(location: impl IntoLocation) -> Result<Box<dyn Store>> {
    match location.into_location()? {
        Location::Local(p) => Ok(Box::new(LocalStore::std(p))),
        #[cfg(feature = "s3")]
        Location::Remote(u) => Ok(Box::new(super::s3::Remote::new(
            &u,
            &super::s3::S3Config::try_from_env()?,
        )?)),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(super::no_s3(&u)),
    }
}

/// A store a verb runs over: one it connected to, or one the caller lent it.
pub enum StoreRef<'a> {
    /// Connected by the verb ([`connect`]).
    Owned(Box<dyn Store + 'a>),
    /// The caller's.
    Borrowed(&'a (dyn Store + 'a)),
}

impl<'a> Deref for StoreRef<'a> {
    type Target = dyn Store + 'a;
    fn deref(&self) -> &Self::Target {
        match self {
            StoreRef::Owned(b) => b.as_ref(),
            StoreRef::Borrowed(s) => *s,
        }
    }
}

/// What the verbs take as the place to work in: anything that names a location
/// ([`IntoLocation`]: `&str`, `&Path`, `PathBuf`, [`Location`], ...), connected with
/// [`connect`], or a store: `&dyn Store`, `&LocalStore<F>`, `&Remote`.
pub trait IntoStore<'a> {
    /// The store.
    ///
    /// # Errors
    /// As [`connect`].
    fn into_store(self) -> Result<StoreRef<'a>>;
}

impl<'a, T: IntoLocation> IntoStore<'a> for T {
    fn into_store(self) -> Result<StoreRef<'a>> {
        connect(self).map(StoreRef::Owned)
    }
}

impl<'a> IntoStore<'a> for &'a (dyn Store + 'a) {
    fn into_store(self) -> Result<StoreRef<'a>> {
        Ok(StoreRef::Borrowed(self))
    }
}

impl<'a, F: super::fs::Fs> IntoStore<'a> for &'a LocalStore<'a, F> {
    fn into_store(self) -> Result<StoreRef<'a>> {
        Ok(StoreRef::Borrowed(self))
    }
}

#[cfg(feature = "s3")]
impl<'a> IntoStore<'a> for &'a super::s3::Remote {
    fn into_store(self) -> Result<StoreRef<'a>> {
        Ok(StoreRef::Borrowed(self))
    }
}
