//! Library errors on their way to Python: each [`Error`] variant becomes the exception
//! class of `ckptstore/errors.py` that names it, with its context fields as attributes.

use ckptstore::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// A library error on its way to Python.
pub(crate) struct CkError(pub(crate) Error);

impl From<Error> for CkError {
    fn from(e: Error) -> Self {
        CkError(e)
    }
}

/// The Python module holding the exception classes (`ckptstore/errors.py`).
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn errors_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    ERRORS
        .get_or_try_init(py, || py.import("ckptstore.errors").map(Bound::unbind))
        .map(|m| m.bind(py))
}

/// The exception class for `e` and the attributes it carries besides the message.
fn classify(e: &Error) -> (&'static str, Vec<(&'static str, Py<PyAny>)>) {
    Python::attach(|py| {
        let s = |v: &str| v.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
        let n = |v: u64| v.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
        let attrs = |pairs: Vec<(&'static str, Option<Py<PyAny>>)>| {
            pairs
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| (k, v)))
                .collect::<Vec<_>>()
        };
        match e {
            Error::Io { op, path, source } => (
                "CheckpointIOError",
                attrs(vec![
                    ("op", s(op)),
                    ("filename", s(&path.display().to_string())),
                    (
                        "errno",
                        source
                            .raw_os_error()
                            .and_then(|c| c.into_pyobject(py).ok())
                            .map(|o| o.into_any().unbind()),
                    ),
                ]),
            ),
            Error::NotFound { path, .. } => (
                "CheckpointNotFoundError",
                attrs(vec![("filename", s(&path.display().to_string()))]),
            ),
            Error::InvalidHeader { file, .. } | Error::InvalidManifest { file, .. } => {
                ("CorruptCheckpointError", attrs(vec![("file", s(file))]))
            }
            Error::ShardMismatch { shard, file, .. } => (
                "CorruptCheckpointError",
                attrs(vec![("file", s(file)), ("shard", n(*shard as u64))]),
            ),
            Error::ChecksumMismatch {
                what,
                shard,
                file,
                expected,
                got,
            } => (
                "ChecksumError",
                attrs(vec![
                    ("what", s(what)),
                    ("file", s(file)),
                    ("shard", n(*shard as u64)),
                    ("expected", n(u64::from(*expected))),
                    ("got", n(u64::from(*got))),
                ]),
            ),
            Error::UnsupportedVersion { file, .. } | Error::UnsupportedFeature { file, .. } => {
                ("UnsupportedFormatError", attrs(vec![("file", s(file))]))
            }
            Error::TensorNotFound { name } => {
                ("TensorNotFoundError", attrs(vec![("name", s(name))]))
            }
            Error::InvalidTensor { name, .. } | Error::BadView { name, .. } => {
                ("InvalidTensorError", attrs(vec![("name", s(name))]))
            }
            Error::InvalidOptimizerState { param, state, .. } => (
                "OptimizerStateError",
                attrs(vec![("param", s(param)), ("state", s(state))]),
            ),
            Error::Conversion { param, state, .. } => (
                "OptimizerStateError",
                attrs(vec![("param", s(param)), ("state", s(state))]),
            ),
            Error::IncompatibleState { group, param, .. } => (
                "IncompatibleStateError",
                attrs(vec![
                    ("group", group.and_then(|g| n(g as u64))),
                    ("param", s(param)),
                ]),
            ),
            Error::InvalidPart { part, .. } => ("PartError", attrs(vec![("part", s(part))])),
            Error::PartConflict { name, ranks, .. } => (
                "PartError",
                attrs(vec![
                    ("name", s(name)),
                    (
                        "ranks",
                        ranks
                            .to_vec()
                            .into_pyobject(py)
                            .ok()
                            .map(|o| o.into_any().unbind()),
                    ),
                ]),
            ),
            Error::MissingParts {
                checkpoint_id,
                missing,
                ..
            } => (
                "MissingPartsError",
                attrs(vec![
                    ("checkpoint_id", s(checkpoint_id)),
                    (
                        "missing",
                        missing
                            .clone()
                            .into_pyobject(py)
                            .ok()
                            .map(|o| o.into_any().unbind()),
                    ),
                ]),
            ),
            Error::InvalidArgument(_) => ("InvalidArgumentError", vec![]),
            // A URL this build cannot use is a bad argument; a failed object-store request is
            // an I/O error on the object's URL.
            Error::UnsupportedUrl { .. } => ("InvalidArgumentError", vec![]),
            Error::Remote { url, .. } => ("CheckpointIOError", attrs(vec![("filename", s(url))])),
            _ => ("CheckpointError", vec![]),
        }
    })
}

impl From<CkError> for PyErr {
    fn from(e: CkError) -> PyErr {
        let msg = e.0.to_string();
        let (class, attrs) = classify(&e.0);
        Python::attach(|py| {
            let build = || -> PyResult<PyErr> {
                let cls = errors_module(py)?.getattr(class)?;
                let exc = cls.call1((msg.clone(),))?;
                for (k, v) in attrs {
                    exc.setattr(k, v)?;
                }
                Ok(PyErr::from_value(exc))
            };
            // If the exception module cannot be imported, still report the message.
            build().unwrap_or_else(|_| pyo3::exceptions::PyRuntimeError::new_err(msg.clone()))
        })
    }
}

pub(crate) fn invalid_arg(msg: impl Into<String>) -> PyErr {
    CkError(Error::InvalidArgument(msg.into())).into()
}
