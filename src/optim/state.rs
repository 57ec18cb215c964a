//! Conversions of one state value into fresh buffers: the arithmetic of every loader
//! (format-spec/optimizer.md §Conversions), and [`StateValue::convert`] /
//! [`state_absbits`], through which values that are not read from a checkpoint by this
//! crate (a rank's shard of a sharded state, say) get exactly the same conversion.

use std::borrow::Cow;

use half::{bf16, f16};

use super::{BufferPool, ScaleShape, StateValue, Target, Tensor};
use crate::convert;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::view::{Element, TensorView};

impl StateValue {
    /// The value state `state` of parameter `param` takes in `target`, converted from the
    /// plain values `src` into fresh buffers with the arithmetic of
    /// [`Checkpoint::load_optimizer`](crate::checkpoint::Checkpoint::load_optimizer):
    /// `AsStored` copies, `F32` widens, `BF16` rounds to nearest even, `F16Scaled` scales
    /// by `absmax / 32752`. `absmax` is the absmax the scale is computed from, for values
    /// that are one shard of a larger state (the maximum of every shard's
    /// [`state_absbits`], as `f32::from_bits`); `None`: the values' own.
    ///
    /// # Errors
    /// [`Error::Conversion`] naming `param` and `state`: a non-floating-point `src` for a
    /// target other than `AsStored`; for `F16Scaled`, values or an `absmax` that are not
    /// finite, an absmax too small to scale by (`1/scale` overflows FP32), or an `absmax`
    /// below the values' own. `src` is never written.
    pub fn convert(
        param: &str,
        state: &str,
        src: &TensorView<'_>,
        target: Target,
        absmax: Option<f32>,
    ) -> Result<StateValue> {
        let conv = |reason: String| Error::Conversion {
            param: param.into(),
            state: state.into(),
            reason,
        };
        let copy = || Tensor::from_bytes(src.dtype(), src.shape(), src.bytes());
        match (target, src.dtype()) {
            (Target::AsStored, _) | (Target::F32, DType::F32) | (Target::BF16, DType::BF16) => {
                return Ok(StateValue::Plain(copy()?));
            }
            (t, d) if !d.is_float() => {
                return Err(conv(format!(
                    "the {d} state is not floating-point and cannot be converted to {t:?}"
                )));
            }
            (Target::F16Scaled(sh), _) => {
                return scaled(&to_f32(src), src.shape(), sh, absmax, None).map_err(conv);
            }
            _ => {}
        }
        convert_plain(src, target, None, conv)
    }
}

/// The FP32 values state `state` of `param` holds in `target`, from the FP32 values `src`,
/// written into the caller's fresh buffer `dst`: what [`StateValue::convert`] gives, read
/// back as FP32 (`F16Scaled`: the codes unscaled; `BF16`: rounded; `F32` and `AsStored`: a
/// copy), in one fused pass (the codes never leave the cache). `absmax` as in `convert`.
/// `dst` is written even when an error is returned: give a buffer nothing else uses yet.
///
/// # Errors
/// As [`StateValue::convert`]; [`Error::InvalidArgument`] if the lengths differ.
pub fn round_state(
    param: &str,
    state: &str,
    src: &[f32],
    target: Target,
    absmax: Option<f32>,
    dst: &mut [f32],
) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::InvalidArgument(format!(
            "parameter {param:?}, state {state:?}: {} values into {} places",
            src.len(),
            dst.len()
        )));
    }
    let conv = |reason: String| Error::Conversion {
        param: param.into(),
        state: state.into(),
        reason,
    };
    match target {
        Target::F16Scaled(_) => {
            let given = match absmax {
                Some(a) if !a.is_finite() => {
                    return Err(conv(convert::ScaleError::NonFinite.to_string()))
                }
                Some(a) => a,
                None => convert::absmax_f32(src)
                    .ok_or_else(|| conv(convert::ScaleError::NonFinite.to_string()))?,
            };
            let (s, r) = convert::scale_for(given).map_err(|e| conv(e.to_string()))?;
            let own = convert::absmax_from_bits(convert::f32_round_f16_scaled(src, r, s, dst))
                .ok_or_else(|| conv(convert::ScaleError::NonFinite.to_string()))?;
            if own.to_bits() > given.to_bits() || given.is_sign_negative() {
                return Err(conv(format!(
                    "the absmax given, {given:e}, is below the values' own, {own:e}: give the maximum over every shard"
                )));
            }
        }
        Target::BF16 => convert::f32_round_bf16(src, dst),
        _ => convert::copy_bytes(bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst)),
    }
    Ok(())
}

/// The maximum of `|x|` over the floating-point values `src` (widened to FP32), as FP32
/// bits: an infinity or NaN anywhere gives at least
/// [`NON_FINITE_BITS`](crate::convert::NON_FINITE_BITS), and for finite values the
/// integer order of the bits is the numeric order. The shards of one state fold with
/// `max`, exactly and in any order (an integer all-reduce across ranks); `f32::from_bits`
/// of the result is the `absmax` of [`StateValue::convert`].
///
/// # Errors
/// [`Error::Conversion`] naming `param` and `state` if `src` is not floating-point.
pub fn state_absbits(param: &str, state: &str, src: &TensorView<'_>) -> Result<u32> {
    if !src.dtype().is_float() {
        return Err(Error::Conversion {
            param: param.into(),
            state: state.into(),
            reason: format!(
                "the {} state is not floating-point: it has no absmax",
                src.dtype()
            ),
        });
    }
    let x = to_f32(src);
    Ok(convert::absmax_f32(&x).map_or(convert::NON_FINITE_BITS, f32::to_bits))
}

/// FP16 codes and a scale of shape `sh` for the FP32 values `x` (shaped `shape`), the
/// scale from `absmax` (`None`: the values' own), into a fresh tensor; the error is the
/// reason, for the caller to name the state.
pub(super) fn scaled(
    x: &[f32],
    shape: &[u64],
    sh: ScaleShape,
    absmax: Option<f32>,
    pool: Option<&BufferPool>,
) -> std::result::Result<StateValue, String> {
    let own = convert::absmax_f32(x).ok_or_else(|| convert::ScaleError::NonFinite.to_string())?;
    let absmax = match absmax {
        None => own,
        Some(a) if !a.is_finite() => return Err(convert::ScaleError::NonFinite.to_string()),
        // Compared as bits: both are finite and non-negative (a negative `a` is below any own).
        Some(a) if a.to_bits() < own.to_bits() || a.is_sign_negative() => {
            return Err(format!(
                "the absmax given, {a:e}, is below the values' own, {own:e}: give the maximum over every shard"
            ))
        }
        Some(a) => a,
    };
    let (s, r) = convert::scale_for(absmax).map_err(|e| e.to_string())?;
    let mut q = Tensor::for_overwrite(DType::F16, shape, pool).map_err(|e| e.to_string())?;
    if q.numel() != x.len() {
        return Err(format!("{} values for shape {shape:?}", x.len()));
    }
    convert::f32_mul_to_f16(x, r, q.as_mut_slice().map_err(|e| e.to_string())?);
    Ok(StateValue::F16Scaled {
        q,
        scale: Tensor::scalar_f32(s).reshaped(sh.dims()),
    })
}

/// FP16 codes `qv` times scale `s`, in `t` (F32 or BF16), into a fresh tensor.
pub(super) fn unscale(
    qv: &TensorView<'_>,
    s: f32,
    t: Target,
    pool: Option<&BufferPool>,
) -> Result<StateValue> {
    let codes = typed::<f16>(qv);
    let shape = qv.shape();
    match t {
        Target::F32 => {
            let mut out = Tensor::for_overwrite(DType::F32, shape, pool)?;
            convert::f16_scaled_to_f32(&codes, s, out.as_mut_slice()?);
            Ok(StateValue::Plain(out))
        }
        Target::BF16 => {
            let mut out = Tensor::for_overwrite(DType::BF16, shape, pool)?;
            convert::f16_scaled_to_bf16(&codes, s, out.as_mut_slice()?);
            Ok(StateValue::Plain(out))
        }
        Target::AsStored | Target::F16Scaled(_) => unreachable_as_stored(),
    }
}

/// A floating-point plain state `v` (already CRC-checked) in `target` (not `AsStored`),
/// into a fresh tensor: the general path, without the fused CRC-and-convert kernels.
pub(super) fn convert_plain(
    v: &TensorView<'_>,
    target: Target,
    pool: Option<&BufferPool>,
    conv: impl Fn(String) -> Error,
) -> Result<StateValue> {
    let shape = v.shape();
    match target {
        Target::F32 => {
            let mut out = Tensor::for_overwrite(DType::F32, shape, pool)?;
            widen_to_f32(v, out.as_mut_slice()?);
            Ok(StateValue::Plain(out))
        }
        Target::BF16 => {
            let mut out = Tensor::for_overwrite(DType::BF16, shape, pool)?;
            match v.dtype() {
                DType::F64 => {
                    for (o, &x) in out
                        .as_mut_slice::<bf16>()?
                        .iter_mut()
                        .zip(typed::<f64>(v).iter())
                    {
                        *o = convert::f64_to_bf16(x);
                    }
                }
                _ => {
                    let x = to_f32(v);
                    convert::f32_to_bf16(&x, out.as_mut_slice()?);
                }
            }
            Ok(StateValue::Plain(out))
        }
        Target::F16Scaled(sh) => scaled(&to_f32(v), shape, sh, None, pool).map_err(conv),
        Target::AsStored => unreachable_as_stored(),
    }
}

/// Matched earlier in `run_job`; kept as an error rather than a panic.
pub(super) fn unreachable_as_stored<T>() -> Result<T> {
    Err(Error::InvalidArgument(
        "internal: AsStored handled above".into(),
    ))
}

/// The view's elements as `T`: borrowed when aligned (always, for ckptstore shards),
/// copied otherwise.
pub(super) fn typed<'a, T: Element>(v: &TensorView<'a>) -> Cow<'a, [T]> {
    match v.as_slice::<T>() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(v.bytes())),
    }
}

pub(super) fn widen_to_f32(v: &TensorView<'_>, out: &mut [f32]) {
    match v.dtype() {
        DType::BF16 => convert::bf16_to_f32(&typed::<bf16>(v), out),
        DType::F16 => convert::f16_to_f32(&typed::<f16>(v), out),
        DType::F64 => {
            for (o, &x) in out.iter_mut().zip(typed::<f64>(v).iter()) {
                *o = x as f32;
            }
        }
        _ => convert::copy_bytes(v.bytes(), bytemuck::cast_slice_mut(out)),
    }
}

pub(super) fn to_f32<'a>(v: &TensorView<'a>) -> Cow<'a, [f32]> {
    if v.dtype() == DType::F32 {
        return typed::<f32>(v);
    }
    let mut out = vec![0f32; v.numel()];
    widen_to_f32(v, &mut out);
    Cow::Owned(out)
}
