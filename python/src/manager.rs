//! The checkpoint manager of a training run (`ckptstore.CheckpointManager`,
//! `ckptstore.torch.CheckpointManager`): the Rust [`CheckpointManager`] itself, so that the
//! steps a Python job saves are the ones `ckpt ls` and `ckpt gc` see, with the same
//! retention and the same leases.
//!
//! Saves take the items the Python package prepares for [`crate::save::save`] (tensors
//! over the arrays' memory, optimizer state as groups JSON plus state entries) and commit
//! them as one step with the interpreter detached; the asynchronous part (a snapshot, a
//! background thread) lives in Python, which owns the snapshot buffers.

use std::path::PathBuf;
use std::sync::Mutex;

use ckptstore::manager::{CheckpointManager, Retention, StepLease};
use ckptstore::store::Location;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::IntoPyObjectExt;

use crate::errors::{invalid_arg, CkError};
use crate::save::{commit_info, entry_refs, optimizer_ref, save_options, Entry, StateEntry};

/// Steps of a training run under one root, a local directory or an `s3://` prefix
/// (`ROOT/step-<step>/`, each a normal checkpoint), with retention applied after every save
/// and leases that keep garbage collection away from steps being read (local roots).
#[pyclass(module = "ckptstore._ckptstore", name = "CheckpointManager", frozen)]
pub(crate) struct PyCheckpointManager {
    inner: CheckpointManager,
}

#[pymethods]
impl PyCheckpointManager {
    /// A manager over `root`, a directory (created if missing) or an `s3://` URL. `keep_last`: how many of the newest
    /// committed steps retention keeps (`None`: every step); `keep_every`: also keep every
    /// step that is a multiple of it.
    #[new]
    #[pyo3(signature = (root, keep_last = None, keep_every = None))]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
    ) -> PyResult<Self> {
        if keep_last == Some(0) {
            return Err(invalid_arg(
                "keep_last must be at least 1 (None keeps every step)",
            ));
        }
        if keep_every == Some(0) {
            return Err(invalid_arg("keep_every must be at least 1"));
        }
        let retention = Retention {
            keep_last: keep_last.unwrap_or(usize::MAX),
            keep_every,
        };
        let inner = py
            .detach(|| CheckpointManager::new(&root, retention))
            .map_err(CkError)?;
        Ok(PyCheckpointManager { inner })
    }

    /// The root: a `pathlib.Path`, or the URL text of an object-store root.
    #[getter]
    fn root<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        location_py(py, &self.inner.location())
    }

    /// Where `step` lives (whether or not it exists): its directory, or its URL text.
    fn step_dir<'py>(&self, py: Python<'py>, step: u64) -> PyResult<Bound<'py, PyAny>> {
        location_py(py, &self.inner.location_of(step))
    }

    /// The committed steps, ascending.
    fn steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        Ok(py.detach(|| self.inner.steps()).map_err(CkError)?)
    }

    /// The newest committed step, or `None`.
    fn latest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        Ok(py.detach(|| self.inner.latest()).map_err(CkError)?)
    }

    /// Every step directory, committed or not, and leftovers of interrupted saves: a list
    /// of `{"step", "path", "committed", "bytes"}`, sorted by step.
    fn list<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let entries = py.detach(|| self.inner.list()).map_err(CkError)?;
        entries
            .into_iter()
            .map(|e| {
                let d = PyDict::new(py);
                d.set_item("step", e.step)?;
                d.set_item("path", location_py(py, &e.location)?)?;
                d.set_item("committed", e.committed)?;
                d.set_item("bytes", e.bytes)?;
                Ok(d)
            })
            .collect()
    }

    /// Apply retention now: `{"deleted": [...], "in_use": [...], "interrupted_removed": n,
    /// "swept": n}` (`swept`: engine files removed from kept steps whose manifest does not
    /// name them).
    fn gc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.inner.gc()).map_err(CkError)?;
        let d = PyDict::new(py);
        d.set_item("deleted", r.deleted)?;
        d.set_item("in_use", r.in_use)?;
        d.set_item("interrupted_removed", r.interrupted_removed)?;
        d.set_item("swept", r.swept)?;
        Ok(d)
    }

    /// Hold committed step `step` against garbage collection until the lease is released.
    fn lease(&self, py: Python<'_>, step: u64) -> PyResult<PyStepLease> {
        let lease = py.detach(|| self.inner.lease(step)).map_err(CkError)?;
        Ok(PyStepLease {
            step,
            location: lease.location().clone(),
            lease: Mutex::new(Some(lease)),
        })
    }

    /// Save `tensors` (and `optimizer`) as step `step`, blocking until it is committed and
    /// durable, then apply retention. The arguments are those of the low-level `save`;
    /// arrays are read in place with the interpreter detached: keep them unchanged until
    /// this returns. Returns the commit info.
    #[pyo3(signature = (step, tensors, metadata = None, max_shard_size = None, optimizer = None))]
    fn save<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        tensors: Vec<Entry<'py>>,
        metadata: Option<&str>,
        max_shard_size: Option<u64>,
        optimizer: Option<(String, Vec<StateEntry<'py>>)>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let opts = save_options(metadata, max_shard_size)?;
        let refs = entry_refs(&tensors)?;
        let opt = match &optimizer {
            None => None,
            Some((groups, states)) => Some(optimizer_ref(groups, states)?),
        };
        let info = py
            .detach(|| self.inner.save(step, &refs, opt.as_ref(), &opts))
            .map_err(CkError)?;
        commit_info(py, info)
    }
}

/// A shared hold on a committed step: garbage collection keeps the step while the lease
/// is held. A context manager; `release()` (or leaving the `with` block) lets it go.
#[pyclass(module = "ckptstore._ckptstore", name = "StepLease", frozen)]
pub(crate) struct PyStepLease {
    step: u64,
    location: Location,
    lease: Mutex<Option<StepLease>>,
}

#[pymethods]
impl PyStepLease {
    /// The step held.
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// The step's directory, or its URL text on an object store (open it with
    /// `ckptstore.open` while the lease is held).
    #[getter]
    fn path<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        location_py(py, &self.location)
    }

    /// True while the lease is held.
    #[getter]
    fn held(&self) -> bool {
        self.lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Let the step go (idempotent).
    fn release(&self) {
        self.lease.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.release();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "StepLease(step={}, path={:?}, held={})",
            self.step,
            self.location.to_string(),
            self.held()
        )
    }
}

/// A location for Python: a `pathlib.Path`, or the URL text (a `Path` would fold `s3://`
/// into `s3:/`).
fn location_py<'py>(py: Python<'py>, loc: &Location) -> PyResult<Bound<'py, PyAny>> {
    match loc {
        Location::Local(p) => p.into_bound_py_any(py),
        Location::Remote(u) => u.to_string().into_bound_py_any(py),
    }
}
