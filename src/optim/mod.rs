//! Optimizer state: an owned model, saving it into a checkpoint, and loading it back into
//! freshly allocated buffers in the layout the live optimizer wants
//! (format-spec/optimizer.md).
//!
//! Two guarantees hold by construction:
//!
//! * **The source is never written.** A load reads the checkpoint through shared borrows
//!   of a read-only map and writes only into buffers it has just allocated.
//! * **Restores replace, never merge.** [`OptimizerState::restore_from`] builds the whole
//!   new state, validates it against the live optimizer, and only then moves it into place.
//!   Parameters without state in the checkpoint end with none; on any error the live state
//!   is untouched.

mod load;
mod tensor;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

pub use load::{ScaleShape, StateLayout, Target};
pub use tensor::{BufferPool, PoolStats, Tensor};

use crate::dtype::{checked_numel, DType};
use crate::error::{Error, Result};
use crate::format::manifest::{Encoding, GroupEntry, OptimizerSection, ParamEntry, StateEntry};
use crate::write::{save_locked, CommitInfo, SaveOptions, TensorRef};

/// One named state of a parameter.
#[derive(Debug, Clone, PartialEq)]
pub enum StateValue {
    /// Values held directly in the tensor's dtype (F32, BF16, I64 step counters, ...).
    Plain(Tensor),
    /// FP16 codes and an F32 scale (0-dim or `[1]`): value = `f32(q) * scale`.
    F16Scaled {
        /// The FP16 codes, shaped like the state.
        q: Tensor,
        /// The F32 scale, shape `[]` or `[1]`.
        scale: Tensor,
    },
}

impl StateValue {
    /// The shape of the state (of `q` for scaled states).
    pub fn shape(&self) -> &[u64] {
        match self {
            StateValue::Plain(t) => t.shape(),
            StateValue::F16Scaled { q, .. } => q.shape(),
        }
    }

    /// True if both are the same encoding with bit-identical tensors.
    pub fn bit_eq(&self, other: &StateValue) -> bool {
        match (self, other) {
            (StateValue::Plain(a), StateValue::Plain(b)) => a.bit_eq(b),
            (
                StateValue::F16Scaled { q: a, scale: s },
                StateValue::F16Scaled { q: b, scale: t },
            ) => a.bit_eq(b) && s.bit_eq(t),
            _ => false,
        }
    }

    /// Encode FP32 values as FP16 with a per-tensor scale of shape `scale_shape`.
    ///
    /// # Errors
    /// [`Error::Conversion`] for non-finite input or an underflowing scale (see
    /// [`crate::convert::ScaleError`]).
    pub fn f16_scaled_from_f32(
        shape: &[u64],
        x: &[f32],
        scale_shape: ScaleShape,
    ) -> Result<StateValue> {
        let mut q = Tensor::zeros(DType::F16, shape)?;
        if q.numel() != x.len() {
            return Err(Error::InvalidArgument(format!(
                "{} values for shape {shape:?}",
                x.len()
            )));
        }
        let s = crate::convert::f32_to_f16_scaled(x, q.as_mut_slice()?).map_err(|e| {
            Error::Conversion {
                param: String::new(),
                state: String::new(),
                reason: e.to_string(),
            }
        })?;
        Ok(StateValue::F16Scaled {
            q,
            scale: Tensor::scalar_f32(s).reshaped(scale_shape.dims()),
        })
    }

    /// The values as FP32 (scaled states unscaled), in a fresh vector.
    ///
    /// # Errors
    /// [`Error::Conversion`] for non-floating-point plain states.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let conv = |reason: &str| Error::Conversion {
            param: String::new(),
            state: String::new(),
            reason: reason.into(),
        };
        match self {
            StateValue::F16Scaled { q, scale } => {
                let s = scale_value(scale).ok_or_else(|| conv("scale is not a single F32"))?;
                let mut out = vec![0f32; q.numel()];
                crate::convert::f16_scaled_to_f32(q.as_slice()?, s, &mut out);
                Ok(out)
            }
            StateValue::Plain(t) => match t.dtype() {
                DType::F32 => Ok(t.as_slice::<f32>()?.to_vec()),
                DType::BF16 => Ok(t
                    .as_slice::<half::bf16>()?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect()),
                DType::F16 => Ok(t
                    .as_slice::<half::f16>()?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect()),
                DType::F64 => Ok(t.as_slice::<f64>()?.iter().map(|&v| v as f32).collect()),
                d => Err(conv(&format!("{d} is not a floating-point dtype"))),
            },
        }
    }
}

pub(crate) fn scale_value(t: &Tensor) -> Option<f32> {
    (t.dtype() == DType::F32 && t.numel() == 1 && t.shape().len() <= 1)
        .then(|| t.as_slice::<f32>().ok().and_then(|s| s.first().copied()))
        .flatten()
}

/// A parameter as the optimizer knows it: name and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// The parameter's name (its model name, so checkpoints do not depend on order).
    pub name: String,
    /// Its shape; empty for a 0-dim parameter.
    pub shape: Vec<u64>,
}

impl ParamSpec {
    /// A parameter spec.
    pub fn new(name: impl Into<String>, shape: &[u64]) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }
}

/// A parameter group: parameters plus hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// Parameters, in group order.
    pub params: Vec<ParamSpec>,
    /// Hyperparameters (lr, betas, eps, weight_decay, momentum, ...).
    pub hyper: serde_json::Map<String, serde_json::Value>,
}

/// The complete state of an optimizer: groups and per-parameter named state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OptimizerState {
    /// Parameter groups, in order.
    pub groups: Vec<ParamGroup>,
    /// Per parameter name: state name -> value. Parameters without state are absent.
    pub state: BTreeMap<String, BTreeMap<String, StateValue>>,
}

/// True if a state of `shape` fits a parameter of `param`: the same shape, or at most one
/// element (scalars such as `step`; format-spec/optimizer.md §Rules).
pub(crate) fn shape_fits(shape: &[u64], param: &[u64]) -> bool {
    shape == param || (shape.len() <= 1 && checked_numel(shape).is_some_and(|n| n <= 1))
}

/// Tensor name of a state in the writer's convention.
fn state_tensor_name(param: &str, state: &str) -> String {
    format!("optim/{param}/{state}")
}

impl OptimizerState {
    /// An optimizer with groups and no state (as before the first step).
    pub fn new(groups: Vec<ParamGroup>) -> Self {
        OptimizerState {
            groups,
            state: BTreeMap::new(),
        }
    }

    /// Find a parameter's spec.
    pub fn param(&self, name: &str) -> Option<&ParamSpec> {
        self.groups
            .iter()
            .flat_map(|g| &g.params)
            .find(|p| p.name == name)
    }

    /// Check the invariants of format-spec/optimizer.md §Rules on this in-memory state.
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] naming the parameter and state.
    pub fn validate(&self) -> Result<()> {
        let mut shapes: BTreeMap<&str, &[u64]> = BTreeMap::new();
        for (gi, g) in self.groups.iter().enumerate() {
            for p in &g.params {
                if p.name.is_empty() {
                    return Err(Error::optim(
                        "",
                        "",
                        format!("group {gi} has a parameter with an empty name"),
                    ));
                }
                if shapes.insert(&p.name, &p.shape).is_some() {
                    return Err(Error::optim(
                        &p.name,
                        "",
                        "the parameter is named twice in the groups",
                    ));
                }
            }
        }
        for (param, states) in &self.state {
            let pshape = shapes.get(param.as_str()).ok_or_else(|| {
                Error::optim(param, "", "state for a parameter that no group names")
            })?;
            for (name, v) in states {
                if name.is_empty() {
                    return Err(Error::optim(param, "", "empty state name"));
                }
                if !shape_fits(v.shape(), pshape) {
                    return Err(Error::optim(
                        param,
                        name,
                        format!(
                            "shape {:?} fits neither the parameter's {:?} nor a scalar",
                            v.shape(),
                            pshape
                        ),
                    ));
                }
                if let StateValue::F16Scaled { q, scale } = v {
                    if q.dtype() != DType::F16 || scale_value(scale).is_none() {
                        return Err(Error::optim(
                            param,
                            name,
                            "f16_scaled needs F16 codes and an F32 scale of shape [] or [1]",
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Save this state, with `model` tensors beside it, as a committed checkpoint in `dir`
    /// (atomically replacing one there). The state is saved exactly: FP16-scaled states as
    /// their codes plus scale, so a load into the same layout is lossless.
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] for an inconsistent state, [`Error::InvalidTensor`]
    /// for a model tensor whose name collides with a state tensor, and the errors of
    /// [`crate::save`].
    pub fn save(
        &self,
        dir: impl AsRef<Path>,
        model: &[TensorRef<'_>],
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let (tensors, section) = self.to_parts(model)?;
        save_locked(dir.as_ref(), &tensors, opts, Some(section))
    }

    /// The tensors (model ones first, then state tensors) and the manifest section that
    /// save this state.
    pub(crate) fn to_parts<'a>(
        &'a self,
        model: &[TensorRef<'a>],
    ) -> Result<(Vec<TensorRef<'a>>, OptimizerSection)> {
        self.validate()?;
        let mut tensors: Vec<TensorRef<'_>> = model.to_vec();
        let mut params = Vec::new();
        for g in &self.groups {
            for p in &g.params {
                let mut entries = Vec::new();
                for (sname, v) in self.state.get(&p.name).into_iter().flatten() {
                    let tname = state_tensor_name(&p.name, sname);
                    match v {
                        StateValue::Plain(t) => {
                            tensors.push(TensorRef::new(
                                tname.clone(),
                                t.dtype(),
                                t.shape(),
                                t.bytes(),
                            ));
                            entries.push(StateEntry {
                                name: sname.clone(),
                                tensor: tname,
                                encoding: Encoding::Plain,
                                scale: None,
                            });
                        }
                        StateValue::F16Scaled { q, scale } => {
                            let sname_t = format!("{tname}.scale");
                            tensors.push(TensorRef::new(
                                tname.clone(),
                                q.dtype(),
                                q.shape(),
                                q.bytes(),
                            ));
                            tensors.push(TensorRef::new(
                                sname_t.clone(),
                                scale.dtype(),
                                scale.shape(),
                                scale.bytes(),
                            ));
                            entries.push(StateEntry {
                                name: sname.clone(),
                                tensor: tname,
                                encoding: Encoding::F16Scaled,
                                scale: Some(sname_t),
                            });
                        }
                    }
                }
                params.push(ParamEntry {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    state: entries,
                });
            }
        }
        let section = OptimizerSection {
            groups: self
                .groups
                .iter()
                .map(|g| GroupEntry {
                    params: g.params.iter().map(|p| p.name.clone()).collect(),
                    hyper: serde_json::Value::Object(g.hyper.clone()),
                })
                .collect(),
            params,
        };
        Ok((tensors, section))
    }

    /// Replace this state with the checkpoint's, loaded in `layout`, after checking that it
    /// fits this optimizer: the same number of groups, the same parameter names in each
    /// group in the same order, the same parameter shapes; every CRC of the bytes read.
    /// Hyperparameters come from the checkpoint. The new state replaces the old one whole:
    /// parameters without state in the checkpoint have none afterwards.
    ///
    /// # Errors
    /// [`Error::IncompatibleState`] when the checkpoint does not fit, and every error of
    /// [`crate::Checkpoint::load_optimizer`]. On error `self` is unchanged, bit for bit.
    pub fn restore_from<B: AsRef<[u8]> + Sync>(
        &mut self,
        ckpt: &crate::Checkpoint<B>,
        layout: &StateLayout,
    ) -> Result<()> {
        let new = ckpt.load_optimizer(layout)?;
        check_compatible(self, &new)?;
        *self = new;
        Ok(())
    }

    /// [`OptimizerState::restore_from`], with destination buffers from `pool` (see
    /// [`BufferPool`]). The replaced state's tensors give their buffers to `pool` if they
    /// came from it, so a loop that restores repeatedly through one pool stops paying for
    /// fresh pages after the first restore.
    ///
    /// # Errors
    /// As [`OptimizerState::restore_from`]; on error `self` is unchanged, bit for bit.
    pub fn restore_from_with<B: AsRef<[u8]> + Sync>(
        &mut self,
        ckpt: &crate::Checkpoint<B>,
        layout: &StateLayout,
        pool: &BufferPool,
    ) -> Result<()> {
        let new = ckpt.load_optimizer_with(layout, pool)?;
        check_compatible(self, &new)?;
        *self = new;
        Ok(())
    }
}

fn check_compatible(live: &OptimizerState, new: &OptimizerState) -> Result<()> {
    let bad = |reason: String| Error::IncompatibleState { reason };
    if live.groups.len() != new.groups.len() {
        return Err(bad(format!(
            "the checkpoint has {} parameter group(s), the optimizer {}",
            new.groups.len(),
            live.groups.len()
        )));
    }
    for (gi, (a, b)) in live.groups.iter().zip(&new.groups).enumerate() {
        if a.params.len() != b.params.len() {
            return Err(bad(format!(
                "group {gi} has {} parameter(s) in the checkpoint, {} in the optimizer",
                b.params.len(),
                a.params.len()
            )));
        }
        for (pi, (p, q)) in a.params.iter().zip(&b.params).enumerate() {
            if p.name != q.name {
                return Err(bad(format!(
                    "group {gi}, position {pi}: the checkpoint has parameter {:?}, the optimizer {:?}",
                    q.name, p.name
                )));
            }
            if p.shape != q.shape {
                return Err(bad(format!(
                    "parameter {:?}: shape {:?} in the checkpoint, {:?} in the model",
                    p.name, q.shape, p.shape
                )));
            }
        }
    }
    Ok(())
}

/// Check the optimizer section against the checkpoint's tensors (format-spec/optimizer.md
/// §Rules): used by load and by verify.
pub(crate) fn validate_section<B: AsRef<[u8]> + Sync>(
    sec: &OptimizerSection,
    ckpt: &crate::Checkpoint<B>,
) -> Result<()> {
    let mut in_groups: HashSet<&str> = HashSet::new();
    for (gi, g) in sec.groups.iter().enumerate() {
        if !g.hyper.is_object() {
            return Err(Error::optim(
                "",
                "",
                format!("group {gi}: hyper is not a JSON object"),
            ));
        }
        for p in &g.params {
            if !in_groups.insert(p) {
                return Err(Error::optim(
                    p,
                    "",
                    format!("named by more than one group entry (group {gi})"),
                ));
            }
        }
    }
    let mut listed: HashSet<&str> = HashSet::new();
    let mut used_tensors: HashSet<&str> = HashSet::new();
    for p in &sec.params {
        if !in_groups.contains(p.name.as_str()) {
            return Err(Error::optim(
                &p.name,
                "",
                "listed in params but named by no group",
            ));
        }
        if !listed.insert(&p.name) {
            return Err(Error::optim(&p.name, "", "listed twice in params"));
        }
        let mut names: HashSet<&str> = HashSet::new();
        for s in &p.state {
            let err = |r: String| Error::optim(&p.name, &s.name, r);
            if s.name.is_empty() || !names.insert(&s.name) {
                return Err(err("state name empty or repeated".into()));
            }
            let t = ckpt.info(&s.tensor).map_err(|_| {
                err(format!(
                    "names tensor {:?}, which the checkpoint does not hold",
                    s.tensor
                ))
            })?;
            if !used_tensors.insert(&s.tensor) {
                return Err(err(format!("tensor {:?} is referenced twice", s.tensor)));
            }
            if !shape_fits(&t.shape, &p.shape) {
                return Err(err(format!(
                    "tensor {:?} has shape {:?}, which fits neither the parameter's {:?} nor a scalar",
                    s.tensor, t.shape, p.shape
                )));
            }
            match (s.encoding, &s.scale) {
                (Encoding::Plain, None) => {}
                (Encoding::Plain, Some(_)) => return Err(err("a plain state has a scale".into())),
                (Encoding::F16Scaled, None) => {
                    return Err(err("an f16_scaled state has no scale".into()))
                }
                (Encoding::F16Scaled, Some(sc)) => {
                    if t.dtype != DType::F16 {
                        return Err(err(format!(
                            "f16_scaled codes must be F16, tensor {:?} is {}",
                            s.tensor, t.dtype
                        )));
                    }
                    let st = ckpt.info(sc).map_err(|_| {
                        err(format!(
                            "names scale tensor {sc:?}, which the checkpoint does not hold"
                        ))
                    })?;
                    if !used_tensors.insert(sc) {
                        return Err(err(format!("tensor {sc:?} is referenced twice")));
                    }
                    if st.dtype != DType::F32
                        || st.shape.len() > 1
                        || checked_numel(&st.shape) != Some(1)
                    {
                        return Err(err(format!(
                            "scale tensor {sc:?} must be F32 of shape [] or [1], is {} {:?}",
                            st.dtype, st.shape
                        )));
                    }
                }
            }
        }
    }
    let unlisted = sec
        .groups
        .iter()
        .flat_map(|g| &g.params)
        .find(|p| !listed.contains(p.as_str()));
    if let Some(p) = unlisted {
        return Err(Error::optim(
            p,
            "",
            "named by a group but missing from params",
        ));
    }
    Ok(())
}

/// A synthetic optimizer state for benchmarks (`ckpt bench`, `benches/save_load.rs`): one
/// group of `tensors` parameters `p0000`, `p0001`, ... of `per` elements each, each with an
/// FP32 `exp_avg` of smooth Adam-like values with a per-tensor range. Returns the state and
/// the values, tensor by tensor.
///
/// # Errors
/// [`Error::InvalidArgument`] if a tensor of `per` FP32 elements cannot be allocated.
#[doc(hidden)]
pub fn synthetic_state(tensors: usize, per: usize) -> Result<(OptimizerState, Vec<Vec<f32>>)> {
    let name = |k: usize| format!("p{k:04}");
    let data: Vec<Vec<f32>> = (0..tensors)
        .map(|k| {
            (0..per)
                .map(|i| ((i as f32 * 0.001 + k as f32).sin()) * (1.0 + k as f32) * 1e-3)
                .collect()
        })
        .collect();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: (0..tensors)
            .map(|k| ParamSpec::new(name(k), &[per as u64]))
            .collect(),
        hyper: Default::default(),
    }]);
    for (k, d) in data.iter().enumerate() {
        let t = Tensor::from_slice(&[per as u64], d)?;
        opt.state.insert(
            name(k),
            [("exp_avg".to_string(), StateValue::Plain(t))].into(),
        );
    }
    Ok((opt, data))
}
