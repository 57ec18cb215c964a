//! Whole directories published, removed and swept in one step, and small files written
//! durably: the engine's `store::publish` and `put_file` for `ckptstore.atomic`, so that
//! every Python module (the manager and each framework integration) puts checkpoint
//! directories in place through the same crash-tested operations (tests/publish_crash.rs).

use std::path::PathBuf;

use ckptstore::store::copy::{self, FileSum};
use ckptstore::store::fs::{Fs, StdFs};
use ckptstore::store::publish;
use pyo3::prelude::*;

use crate::errors::CkError;

/// Make `staging` visible as `target` in one step (`ckptstore.atomic.publish_dir`).
#[pyfunction]
pub(crate) fn publish_dir(py: Python<'_>, staging: PathBuf, target: PathBuf) -> PyResult<()> {
    Ok(py
        .detach(|| publish::publish_dir(&StdFs, &staging, &target))
        .map_err(CkError)?)
}

/// Remove the directory `target` whole or not at all (`ckptstore.atomic.remove_dir`).
#[pyfunction]
pub(crate) fn remove_dir(py: Python<'_>, target: PathBuf) -> PyResult<bool> {
    Ok(py
        .detach(|| publish::remove_dir(&StdFs, &target))
        .map_err(CkError)?)
}

/// Clean what interrupted publishes and removals left in `parent`
/// (`ckptstore.atomic.sweep_leftovers`).
#[pyfunction]
pub(crate) fn sweep_leftovers(py: Python<'_>, parent: PathBuf) -> PyResult<usize> {
    Ok(py
        .detach(|| publish::sweep_leftovers(&StdFs, &parent))
        .map_err(CkError)?)
}

/// Make a directory and its missing parents durably, also beside other hosts making them
/// through a shared file system (`ckptstore.atomic.make_dirs`).
#[pyfunction]
pub(crate) fn make_dirs(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    Ok(py.detach(|| publish::make_dir(&path)).map_err(CkError)?)
}

/// Flush a directory's entries to stable storage (`ckptstore.atomic.fsync_dir`).
#[pyfunction]
pub(crate) fn fsync_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    Ok(py
        .detach(|| {
            StdFs.sync_dir(&path).map_err(|e| ckptstore::Error::Io {
                op: "fsync directory",
                path: path.clone(),
                source: e,
            })
        })
        .map_err(CkError)?)
}

/// Write the small file `name` in the directory or object-store prefix `location` durably
/// (`ckptstore.atomic.write_file`).
#[pyfunction]
pub(crate) fn write_file(
    py: Python<'_>,
    location: PathBuf,
    name: &str,
    data: &[u8],
) -> PyResult<()> {
    Ok(py
        .detach(|| ckptstore::store::connect(&location)?.put_file(name, data))
        .map_err(CkError)?)
}

/// Copy the files `files` (`(name, size, crc32)`) of the directory `src_dir` into the
/// directory or object-store prefix `location`, each checked against its size and CRC32 as
/// it streams and published whole (`ckptstore.atomic.copy_files`).
#[pyfunction]
pub(crate) fn copy_files(
    py: Python<'_>,
    src_dir: PathBuf,
    location: PathBuf,
    files: Vec<(String, u64, u32)>,
) -> PyResult<()> {
    let files: Vec<FileSum> = files
        .into_iter()
        .map(|(name, size, crc32)| FileSum { name, size, crc32 })
        .collect();
    Ok(py
        .detach(|| copy::copy_in(&src_dir, &*ckptstore::store::connect(&location)?, &files))
        .map_err(CkError)?)
}
