//! Saving: numpy arrays handed to the engine's writer without a copy, and optimizer state
//! saved through [`OptimizerStateRef`], so the section rules are the library's own.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ckptstore::optim::{OptimizerStateRef, ParamGroup, ParamSpec, StateValueRef};
use ckptstore::{Cleanup, CommitInfo, SaveOptions, TensorRef};
use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dtypes::{array_bytes, parse_dtype};
use crate::errors::{invalid_arg, CkError};

/// One tensor as the Python package prepares it: `(name, wire dtype, ndarray)`.
pub(crate) type Entry<'py> = (String, String, Bound<'py, PyUntypedArray>);

/// One optimizer state: `(param, state, values)` for a plain state, `(param, state, codes,
/// scale)` for an FP16-scaled one.
pub(crate) type StateEntry<'py> = (String, String, Entry<'py>, Option<Entry<'py>>);

/// A borrowed tensor over an array's memory (no copy).
pub(crate) fn entry_ref<'a>(e: &'a Entry<'_>) -> PyResult<TensorRef<'a>> {
    tensor_ref(&e.0, &e.1, &e.2)
}

/// A borrowed tensor `name` of wire dtype `dt` over `arr`'s memory (no copy).
pub(crate) fn tensor_ref<'a>(
    name: &'a str,
    dt: &str,
    arr: &'a Bound<'_, PyUntypedArray>,
) -> PyResult<TensorRef<'a>> {
    let dtype = parse_dtype(dt)?;
    let shape: Vec<u64> = arr.shape().iter().map(|&d| d as u64).collect();
    let (bytes, strides) = array_bytes(name, arr, dtype)?;
    Ok(match strides {
        None => TensorRef::new(name, dtype, &shape, bytes),
        Some(st) => TensorRef::strided(name, dtype, &shape, &st, 0, bytes),
    })
}

/// The parameter groups from their JSON form: `[{"params": [[name, shape], ...], "hyper":
/// {...}}, ...]`.
fn parse_groups(json: &str) -> PyResult<Vec<ParamGroup>> {
    let bad = |what: &str| invalid_arg(format!("optimizer groups: {what}"));
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| bad(&format!("not valid JSON: {e}")))?;
    let groups = v.as_array().ok_or_else(|| bad("not a list"))?;
    groups
        .iter()
        .map(|g| {
            let params = g
                .get("params")
                .and_then(|p| p.as_array())
                .ok_or_else(|| bad("a group has no list 'params'"))?
                .iter()
                .map(|p| {
                    let (name, shape) = p
                        .as_array()
                        .and_then(|a| Some((a.first()?.as_str()?, a.get(1)?.as_array()?)))
                        .ok_or_else(|| bad("a parameter is not [name, shape]"))?;
                    let shape = shape
                        .iter()
                        .map(|d| {
                            d.as_u64()
                                .ok_or_else(|| bad("a dimension is not an integer"))
                        })
                        .collect::<PyResult<Vec<u64>>>()?;
                    Ok(ParamSpec::new(name, &shape))
                })
                .collect::<PyResult<Vec<_>>>()?;
            let hyper = match g.get("hyper") {
                None => Default::default(),
                Some(serde_json::Value::Object(m)) => m.clone(),
                Some(_) => return Err(bad("'hyper' is not a JSON object")),
            };
            Ok(ParamGroup { params, hyper })
        })
        .collect()
}

/// Save tensors (and optimizer state) as a checkpoint (see `ckptstore.save`, which
/// prepares the arguments).
///
/// `tensors` is a list of `(name, wire dtype, ndarray)`; arrays must be in native byte
/// order with non-negative strides that are whole elements. `metadata` is the manifest's
/// `metadata` object as JSON text. `optimizer` is `(groups JSON, states)` (see
/// [`parse_groups`] and [`StateEntry`]); the library builds and checks its section.
/// The writer's options from the bindings' `metadata` (JSON text) and `max_shard_size`.
pub(crate) fn save_options(
    metadata: Option<&str>,
    max_shard_size: Option<u64>,
) -> PyResult<SaveOptions> {
    let mut opts = SaveOptions::default();
    if let Some(m) = metadata {
        opts.metadata = serde_json::from_str(m)
            .map_err(|e| invalid_arg(format!("metadata is not valid JSON: {e}")))?;
    }
    if let Some(s) = max_shard_size {
        opts.max_shard_size = s;
    }
    Ok(opts)
}

/// [`entry_ref`] of every entry.
pub(crate) fn entry_refs<'a>(tensors: &'a [Entry<'_>]) -> PyResult<Vec<TensorRef<'a>>> {
    tensors.iter().map(entry_ref).collect()
}

/// The cleanup mode from its Python name (`"inline"` or `"background"`).
fn parse_cleanup(s: &str) -> PyResult<Cleanup> {
    match s {
        "inline" => Ok(Cleanup::Inline),
        "background" => Ok(Cleanup::Background),
        _ => Err(invalid_arg(format!(
            "cleanup must be \"inline\" or \"background\", not {s:?}"
        ))),
    }
}

#[pyfunction]
#[pyo3(signature = (path, tensors, metadata = None, max_shard_size = None, optimizer = None, cleanup = "inline"))]
pub(crate) fn save<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Vec<Entry<'py>>,
    metadata: Option<&str>,
    max_shard_size: Option<u64>,
    optimizer: Option<(String, Vec<StateEntry<'py>>)>,
    cleanup: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let mut opts = save_options(metadata, max_shard_size)?;
    opts.cleanup = parse_cleanup(cleanup)?;
    let refs = entry_refs(&tensors)?;
    let info = match &optimizer {
        None => py.detach(|| crate::remote::save(&path, &refs, &opts)),
        Some((groups, states)) => {
            let opt = optimizer_ref(groups, states)?;
            py.detach(|| crate::remote::save_optimizer(&path, &opt, &refs, &opts))
        }
    }
    .map_err(CkError)?;
    commit_info(py, info)
}

/// Wait for every background cleanup this process started (`ckptstore.wait_for_cleanup`);
/// returns the number of files removed.
#[pyfunction]
pub(crate) fn wait_for_cleanup(py: Python<'_>) -> usize {
    py.detach(ckptstore::write::wait_for_cleanup)
}

/// The optimizer state of a save over the arrays' memory (no copy): `groups` as JSON (see
/// [`parse_groups`]) and one [`StateEntry`] per state.
pub(crate) fn optimizer_ref<'a>(
    groups: &str,
    states: &'a [StateEntry<'_>],
) -> PyResult<OptimizerStateRef<'a>> {
    let mut state: BTreeMap<String, BTreeMap<String, StateValueRef<'a>>> = BTreeMap::new();
    for (param, sname, values, scale) in states {
        let v = match scale {
            None => StateValueRef::Plain(entry_ref(values)?),
            Some(s) => StateValueRef::F16Scaled {
                q: entry_ref(values)?,
                scale: entry_ref(s)?,
            },
        };
        if state
            .entry(param.clone())
            .or_default()
            .insert(sname.clone(), v)
            .is_some()
        {
            return Err(invalid_arg(format!(
                "optimizer state {sname:?} of parameter {param:?} is given twice"
            )));
        }
    }
    Ok(OptimizerStateRef {
        groups: parse_groups(groups)?.into(),
        state,
    })
}

/// What a save or commit returns to Python: `checkpoint_id`, `shards`, `tensors`,
/// `data_bytes`, `removed`.
pub(crate) fn commit_info(py: Python<'_>, info: CommitInfo) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("checkpoint_id", info.checkpoint_id)?;
    d.set_item("shards", info.shards)?;
    d.set_item("tensors", info.tensors)?;
    d.set_item("data_bytes", info.data_bytes)?;
    d.set_item("removed", info.removed)?;
    Ok(d)
}
