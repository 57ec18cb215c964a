//! Argument types that turn Python values no checkpoint can match into `ckptstore`
//! exceptions instead of interpreter errors from the conversion: a tensor name that is not
//! valid UTF-8 (a `str` with a lone surrogate) names no stored tensor
//! (`TensorNotFoundError`); an index outside `0..2**64` (negative, or too large) is an
//! `InvalidArgumentError`.

use ckptstore::Error;
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::PyString;

use crate::errors::{invalid_arg, CkError};

/// A tensor name.
pub(crate) struct Name(pub String);

impl<'a, 'py> FromPyObject<'a, 'py> for Name {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let obj = obj.to_owned();
        let s = obj.cast::<PyString>()?;
        match s.to_cow() {
            Ok(t) => Ok(Name(t.into_owned())),
            // Stored names are UTF-8 (format-spec/shard.md): this one is in no checkpoint.
            Err(_) => Err(CkError(Error::TensorNotFound {
                name: s.to_string_lossy().into_owned(),
            })
            .into()),
        }
    }
}

/// An index, offset or extent: an `int` in `0..2**64`.
pub(crate) struct Index(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for Index {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<u64>() {
            Ok(v) => Ok(Index(v)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(invalid_arg(format!(
                "{} is not an index, offset or size: those are integers in 0..2**64",
                obj.repr()
                    .map_or_else(|_| "the value".into(), |r| r.to_string())
            ))),
            Err(e) => Err(e),
        }
    }
}

/// The values of `v`.
pub(crate) fn indexes(v: Vec<Index>) -> Vec<u64> {
    v.into_iter().map(|i| i.0).collect()
}
