//! Conversions between the engine's values and Python's for `ckptstore.Checkpoint`: owned
//! tensors as numpy arrays, JSON metadata, optimizer layouts and targets, destination
//! buffers; and the reads shared by several methods.

use super::*;

/// Owns one buffer loaded by `load_optimizer`: the `base` of the writable array over it.
#[pyclass(module = "ckptstore._ckptstore", frozen)]
pub(crate) struct OwnedBuffer {
    #[allow(dead_code)] // held for its lifetime only
    tensor: Tensor,
}

/// A numpy array that owns a freshly loaded tensor's buffer (no copy).
#[allow(unsafe_code)] // the one call of `array_over` for owned buffers
pub(crate) fn owned_array(py: Python<'_>, mut t: Tensor, raw: bool) -> PyResult<Py<PyAny>> {
    let (d, shape) = if raw {
        (uint8(py)?, vec![t.bytes().len() as u64])
    } else {
        (descr(py, t.dtype())?, t.shape().to_vec())
    };
    let ptr = t.bytes_mut().as_mut_ptr();
    // The Tensor's bytes live in a heap allocation that moving the Tensor does not move.
    let base = Py::new(py, OwnedBuffer { tensor: t })?;
    // SAFETY: `ptr` points to the tensor's `numel * size` bytes, owned by `base` (which the
    // array keeps alive and nothing else reads or writes: it is frozen and exposes nothing).
    unsafe { array_over(py, d, &shape, ptr, true, base.into_any()) }
}

pub(super) fn json_to_py<'py>(
    py: Python<'py>,
    v: &serde_json::Value,
) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(v).map_err(|e| invalid_arg(e.to_string()))?;
    py.import("json")?.call_method1("loads", (text,))
}

pub(super) fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Native => "ckptstore",
        Kind::Safetensors => "safetensors",
        Kind::HfSharded => "hf-sharded",
        _ => "unknown",
    }
}

/// The path of shard file `f` (as `Shard::file` names it): inside the checkpoint directory,
/// except a single `.safetensors` file's own path and an object URL, taken as they are.
pub(super) fn shard_path(ck: &dyn Reader, f: &str) -> PathBuf {
    match ck.kind() {
        Kind::Safetensors => PathBuf::from(f),
        _ if !ck.resident() => PathBuf::from(f), // an object URL
        _ => ck.root().join(f),
    }
}

/// The whole global tensor `name` in a fresh writable array (its `raw` bytes when `raw`),
/// every chunk CRC-checked, the interpreter released while it reads.
pub(super) fn read_global(
    py: Python<'_>,
    ck: &Arc<dyn Reader>,
    name: &str,
    raw: bool,
) -> PyResult<Py<PyAny>> {
    let ck = ck.clone();
    let t = py.detach(move || ck.read_global(name)).map_err(CkError)?;
    owned_array(py, t, raw)
}

/// Check the CRC32 of every named tensor, in parallel; the first failure in `names` order.
pub(super) fn verify_many(ck: &Checkpoint, names: &[String]) -> Result<(), Error> {
    let first_bad = names
        .par_iter()
        .enumerate()
        .filter_map(|(i, n)| ck.read(n).view().err().map(|e| (i, e)))
        .min_by_key(|(i, _)| *i);
    match first_bad {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// The writable bytes of each destination array (named by `names`, for errors), which must
/// be C-contiguous: `InvalidArgumentError` naming `op` and the tensor otherwise.
pub(super) fn writable_bytes<'a>(
    op: &str,
    names: &[String],
    arrays: &'a mut [numpy::PyReadwriteArray1<'_, u8>],
) -> PyResult<Vec<&'a mut [u8]>> {
    names
        .iter()
        .zip(arrays.iter_mut())
        .map(|(n, a)| {
            a.as_slice_mut().map_err(|_| {
                invalid_arg(format!("{op}: the destination of {n:?} is not contiguous"))
            })
        })
        .collect()
}
