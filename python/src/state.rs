//! The engine's optimizer-state conversions from Python, for the paths whose state does not
//! come from `Checkpoint.load_optimizer` (a rank's shard of a sharded state, a tiered
//! restore): the layout rule (`StateLayout::target`), the absmax as FP32 bits to fold
//! across shards (`state_absbits`), the conversion itself (`StateValue::convert`), and FP16
//! codes back to FP32. No conversion arithmetic lives in Python.

use ckptstore::convert::f16_scaled_to_f32 as unscale;
use ckptstore::optim::{
    round_state as round_into, state_absbits as absbits, ScaleShape, StateLayout, StateValue,
    Target, Tensor,
};
use ckptstore::{DType, TensorView};
use numpy::{PyReadonlyArray1, PyReadwriteArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::checkpoint::owned_array;
use crate::dtypes::{array_bytes, parse_dtype};
use crate::errors::{invalid_arg, CkError};

/// Parse one layout target name.
pub(crate) fn parse_target(s: &str) -> PyResult<Target> {
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
pub(crate) fn parse_layout(
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

/// The name `parse_target` reads back for `t`.
fn target_name(t: Target) -> &'static str {
    match t {
        Target::F32 => "f32",
        Target::BF16 => "bf16",
        Target::F16Scaled(ScaleShape::Keep) => "f16_scaled",
        Target::F16Scaled(ScaleShape::Scalar) => "f16_scaled_scalar",
        Target::F16Scaled(ScaleShape::One) => "f16_scaled_one",
        _ => "as_stored",
    }
}

/// The bytes of a C-contiguous array of wire dtype `wire`, with its dtype and shape.
fn contiguous<'a>(
    what: &str,
    wire: &str,
    arr: &'a Bound<'_, PyUntypedArray>,
) -> PyResult<(DType, Vec<u64>, &'a [u8])> {
    let dtype = parse_dtype(wire)?;
    let (bytes, strides) = array_bytes(what, arr, dtype)?;
    if strides.is_some() {
        return Err(invalid_arg(format!(
            "{what}: the array must be C-contiguous"
        )));
    }
    Ok((
        dtype,
        arr.shape().iter().map(|&d| d as u64).collect(),
        bytes,
    ))
}

/// `state_target(param, state, wire, state_shape, param_shape, layout, counters=())`: the
/// target name `layout` (as `Checkpoint.load_optimizer` takes it) gives this state, by the
/// rule every loader applies (`StateLayout::target`; global shapes for a sharded state).
#[pyfunction]
#[pyo3(signature = (param, state, wire, state_shape, param_shape, layout, counters = Vec::new()))]
pub(crate) fn state_target(
    param: &str,
    state: &str,
    wire: &str,
    state_shape: Vec<u64>,
    param_shape: Vec<u64>,
    layout: Option<&Bound<'_, PyAny>>,
    counters: Vec<String>,
) -> PyResult<&'static str> {
    let float = parse_dtype(wire)?.is_float();
    let l = parse_layout(layout, counters)?;
    Ok(target_name(l.target(
        param,
        state,
        float,
        &state_shape,
        &param_shape,
    )))
}

/// `state_absbits(param, state, wire, array)`: the largest `|x|` of a floating-point state
/// (or shard) as FP32 bits, an infinity or NaN at or above `0x7f800000`; shards fold with
/// `max` (an integer all-reduce).
#[pyfunction]
pub(crate) fn state_absbits(
    py: Python<'_>,
    param: &str,
    state: &str,
    wire: &str,
    array: &Bound<'_, PyUntypedArray>,
) -> PyResult<u32> {
    let (dtype, shape, bytes) = contiguous(&format!("state {param}/{state}"), wire, array)?;
    let v = TensorView::new(state, dtype, &shape, bytes);
    py.detach(|| absbits(param, state, &v))
        .map_err(|e| CkError(e).into())
}

/// `convert_state(param, state, wire, array, target, *, absmax_bits=None)`: the state in
/// `target` (a name `Checkpoint.load_optimizer` takes) in fresh arrays, by the engine's
/// conversion: an array, or an `F16Scaled` for FP16-scaled targets, whose scale comes from
/// `absmax_bits` when given (the folded `state_absbits` of every shard), else from the
/// values. Refusals are `OptimizerStateError` naming the parameter and the state.
#[pyfunction]
#[pyo3(signature = (param, state, wire, array, target, *, absmax_bits = None))]
pub(crate) fn convert_state(
    py: Python<'_>,
    param: &str,
    state: &str,
    wire: &str,
    array: &Bound<'_, PyUntypedArray>,
    target: &str,
    absmax_bits: Option<u32>,
) -> PyResult<Py<PyAny>> {
    let t = parse_target(target)?;
    let (dtype, shape, bytes) = contiguous(&format!("state {param}/{state}"), wire, array)?;
    let v = TensorView::new(state, dtype, &shape, bytes);
    let out = py
        .detach(|| StateValue::convert(param, state, &v, t, absmax_bits.map(f32::from_bits)))
        .map_err(CkError)?;
    Ok(match out {
        StateValue::Plain(t) => owned_array(py, t, false)?,
        StateValue::F16Scaled { q, scale } => py
            .import("ckptstore._types")?
            .getattr("F16Scaled")?
            .call1((owned_array(py, q, false)?, owned_array(py, scale, false)?))?
            .unbind(),
    })
}

/// `round_state(param, state, src, target, out, *, absmax_bits=None)`: the float32 values
/// the state holds in `target` (what `convert_state` gives, read back as float32), written
/// into `out`, a fresh C-contiguous float32 array as long as the C-contiguous float32 `src`
/// (and not overlapping it: numpy's borrow rules refuse that), in one fused engine pass
/// (`ckptstore::optim::round_state`). `absmax_bits` as in `convert_state`.
#[pyfunction]
#[pyo3(signature = (param, state, src, target, out, *, absmax_bits = None))]
pub(crate) fn round_state(
    py: Python<'_>,
    param: &str,
    state: &str,
    src: PyReadonlyArray1<'_, f32>,
    target: &str,
    mut out: PyReadwriteArray1<'_, f32>,
    absmax_bits: Option<u32>,
) -> PyResult<()> {
    let t = parse_target(target)?;
    let x = src.as_slice().map_err(|_| {
        invalid_arg(format!(
            "state {param}/{state}: the source is not contiguous"
        ))
    })?;
    let y = out.as_slice_mut().map_err(|_| {
        invalid_arg(format!(
            "state {param}/{state}: the destination is not contiguous"
        ))
    })?;
    py.detach(|| round_into(param, state, x, t, absmax_bits.map(f32::from_bits), y))
        .map_err(|e| CkError(e).into())
}

/// `f16_scaled_to_f32(q, scale, out)`: FP16 codes times their one-element FP32 scale, into
/// `out`, a C-contiguous float32 array as long as the C-contiguous float16 `q`
/// (`F16Scaled.to_float32`; rayon-parallel, `q` read in place).
#[pyfunction]
pub(crate) fn f16_scaled_to_f32(
    py: Python<'_>,
    q: &Bound<'_, PyUntypedArray>,
    scale: &Bound<'_, PyUntypedArray>,
    mut out: PyReadwriteArray1<'_, f32>,
) -> PyResult<()> {
    let (_, shape, qb) = contiguous("F16Scaled.q", "F16", q)?;
    let (_, _, sb) = contiguous("F16Scaled.scale", "F32", scale)?;
    let s: [u8; 4] = sb.try_into().map_err(|_| {
        invalid_arg(format!(
            "F16Scaled.scale must hold one float32, not {} bytes",
            sb.len()
        ))
    })?;
    let s = f32::from_le_bytes(s);
    let y = out
        .as_slice_mut()
        .map_err(|_| invalid_arg("F16Scaled.to_float32: the destination is not contiguous"))?;
    let v = TensorView::new("F16Scaled.q", DType::F16, &shape, qb);
    // The codes in place where numpy aligned them (always, for arrays it made), else copied.
    let copied;
    let codes: &[half::f16] = match v.as_slice::<half::f16>() {
        Ok(c) => c,
        Err(_) => {
            copied = Tensor::from_bytes(DType::F16, &shape, qb).map_err(CkError)?;
            copied.as_slice::<half::f16>().map_err(CkError)?
        }
    };
    if codes.len() != y.len() {
        return Err(invalid_arg(format!(
            "F16Scaled.to_float32: {} codes into {} places",
            codes.len(),
            y.len()
        )));
    }
    py.detach(|| unscale(codes, s, y));
    Ok(())
}
