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
pub(super) fn owned_array(py: Python<'_>, mut t: Tensor, raw: bool) -> PyResult<Py<PyAny>> {
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

/// Parse one layout target name.
pub(super) fn parse_target(s: &str) -> PyResult<Target> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "as_stored" | "stored" => Target::AsStored,
        "f32" | "float32" => Target::F32,
        "bf16" | "bfloat16" => Target::BF16,
        "f16_scaled" => Target::F16Scaled(ScaleShape::Keep),
        "f16_scaled_scalar" => Target::F16Scaled(ScaleShape::Scalar),
        "f16_scaled_one" => Target::F16Scaled(ScaleShape::One),
        _ => {
            return Err(invalid_arg(format!(
                "unknown layout target {s:?}: use \"as_stored\", \"f32\", \"bf16\", \
                 \"f16_scaled\", \"f16_scaled_scalar\" or \"f16_scaled_one\""
            )))
        }
    })
}

/// Build a `StateLayout` from the Python description (see `Checkpoint.load_optimizer`).
pub(super) fn parse_layout(
    layout: Option<&Bound<'_, PyAny>>,
    counters: Vec<String>,
) -> PyResult<StateLayout> {
    let mut l = StateLayout::default();
    match layout {
        None => {}
        Some(obj) if obj.is_none() => {}
        Some(obj) => {
            if let Ok(s) = obj.extract::<String>() {
                l = StateLayout::with_default(parse_target(&s)?);
            } else if let Ok(d) = obj.cast::<PyDict>() {
                // The default first, so that the per-state entries survive it.
                if let Some(t) = d.get_item("*")? {
                    l = StateLayout::with_default(parse_target(&t.extract::<String>()?)?);
                }
                for (k, v) in d.iter() {
                    let target = parse_target(&v.extract::<String>().map_err(|_| {
                        invalid_arg(format!("layout value for {k} must be a string"))
                    })?)?;
                    if let Ok(key) = k.extract::<String>() {
                        if key != "*" {
                            l = l.state(key, target);
                        }
                    } else if let Ok((param, state)) = k.extract::<(String, String)>() {
                        l = l.param_state(param, state, target);
                    } else {
                        return Err(invalid_arg(format!(
                            "layout keys are state names, \"*\" or (param, state) tuples, not {k}"
                        )));
                    }
                }
            } else {
                return Err(invalid_arg(
                    "layout must be None, a target name or a dict of state name -> target name",
                ));
            }
        }
    }
    for c in counters {
        l = l.counter(c);
    }
    Ok(l)
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
