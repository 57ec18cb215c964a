//! Multi-rank checkpoints (format-spec/global.md): each rank writes its part, one
//! coordinator commits; the arrays are handed to the engine without a copy.

use std::path::PathBuf;
use std::time::Duration;

use ckptstore::write::parts::Layout;
use ckptstore::write::parts::{self, CommitOptions, Part, PartItem};
use ckptstore::SaveOptions;
use numpy::PyUntypedArray;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{invalid_arg, CkError};
use crate::save::{commit_info, tensor_ref};

/// One item as the Python package prepares it: `(name, wire dtype, ndarray, chunk)` where
/// `chunk` is `(global_shape, offsets)` for a chunk of a global tensor, `None` for a
/// whole tensor.
type Item<'py> = (
    String,
    String,
    Bound<'py, PyUntypedArray>,
    Option<(Vec<u64>, Vec<u64>)>,
);

/// `new_checkpoint_id() -> str`: a fresh id for a multi-rank save, drawn once and handed
/// to every rank.
#[pyfunction]
pub(crate) fn new_checkpoint_id() -> PyResult<String> {
    Ok(parts::new_checkpoint_id().map_err(CkError)?)
}

/// Write this rank's part (see `ckptstore.write_part`); returns the part descriptor.
#[pyfunction]
#[pyo3(signature = (path, checkpoint_id, rank, items, max_shard_size = None))]
pub(crate) fn write_part<'py>(
    py: Python<'py>,
    path: PathBuf,
    checkpoint_id: &str,
    rank: u32,
    items: Vec<Item<'py>>,
    max_shard_size: Option<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut opts = SaveOptions::default();
    if let Some(s) = max_shard_size {
        opts.max_shard_size = s;
    }
    let mut list = Vec::with_capacity(items.len());
    for (name, dt, arr, chunk) in &items {
        let t = tensor_ref(name, dt, arr)?;
        list.push(match chunk {
            None => PartItem::Whole(t),
            Some((global_shape, offsets)) => PartItem::Chunk {
                tensor: t,
                global_shape: global_shape.clone(),
                offsets: offsets.clone(),
            },
        });
    }
    let part = py
        .detach(|| ckptstore::write_part(&path, checkpoint_id, rank, &list, &opts))
        .map_err(CkError)?;
    Ok(PyBytes::new(py, &part.to_bytes()))
}

/// The manifest layout named by `ckptstore.commit(layout=...)`: `"auto"`, `"flat"` or
/// `"two_level"`; anything else is an `InvalidArgumentError` (a `ValueError`) naming the
/// allowed values.
fn parse_layout(layout: &str) -> PyResult<Layout> {
    match layout {
        "auto" => Ok(Layout::Auto),
        "flat" => Ok(Layout::Flat),
        "two_level" => Ok(Layout::TwoLevel),
        other => Err(invalid_arg(format!(
            "layout must be \"auto\", \"flat\" or \"two_level\", got {other:?}"
        ))),
    }
}

/// Commit a multi-rank checkpoint (see `ckptstore.commit`).
#[pyfunction]
#[pyo3(signature = (path, checkpoint_id, parts = None, world_size = None, timeout = None, metadata = None, optimizer = None, layout = "auto"))]
// The Python keyword arguments of `ckptstore.commit`, one for one.
#[allow(clippy::too_many_arguments)]
pub(crate) fn commit<'py>(
    py: Python<'py>,
    path: PathBuf,
    checkpoint_id: &str,
    parts: Option<Vec<Vec<u8>>>,
    world_size: Option<u32>,
    timeout: Option<f64>,
    metadata: Option<&str>,
    optimizer: Option<&str>,
    layout: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let mut opts = CommitOptions {
        world_size,
        layout: parse_layout(layout)?,
        ..Default::default()
    };
    if let Some(m) = metadata {
        opts.metadata = serde_json::from_str(m)
            .map_err(|e| invalid_arg(format!("metadata is not valid JSON: {e}")))?;
    }
    if let Some(o) = optimizer {
        opts.optimizer = Some(
            serde_json::from_str(o).map_err(|e| invalid_arg(format!("optimizer section: {e}")))?,
        );
    }
    let info = match parts {
        Some(bytes) => {
            let decoded = bytes
                .iter()
                .map(|b| Part::from_bytes(b))
                .collect::<Result<Vec<_>, _>>()
                .map_err(CkError)?;
            py.detach(|| ckptstore::commit(&path, checkpoint_id, &decoded, &opts))
        }
        None => {
            let ws = world_size.ok_or_else(|| {
                invalid_arg("commit needs parts, or world_size for the file rendezvous")
            })?;
            let t = timeout.unwrap_or(300.0);
            let t = Duration::try_from_secs_f64(t)
                .map_err(|_| invalid_arg(format!("timeout {t} is not a duration in seconds")))?;
            let opts = CommitOptions {
                world_size: Some(ws),
                wait_for_parts: Some(t),
                ..opts
            };
            py.detach(|| ckptstore::commit(&path, checkpoint_id, &[], &opts))
        }
    }
    .map_err(CkError)?;
    commit_info(py, info)
}
