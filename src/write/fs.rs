//! The file-system seam under the local store, under its old path: it lives in
//! [`crate::store::fs`] now (the [`crate::store::LocalStore`] runs the commit protocol's file
//! operations through it).

pub use crate::store::fs::{Fs, StdFs};
