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

mod compat;
mod layout;
mod load;
mod state;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

pub use crate::tensor::{BufferPool, PoolStats, Tensor};
pub use compat::{check_compatible, OptimizerSignature};
pub use layout::{ScaleShape, StateLayout, Target};
pub use load::LoadOptions;
pub use state::{round_state, state_absbits};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::manifest::{Encoding, GroupEntry, OptimizerSection, ParamEntry, StateEntry};
use crate::format::optimizer::check_section;
use crate::write::{CommitInfo, SaveOptions, TensorRef};

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
    /// This value as borrowed tensors, named `optim/<param>/<state>` (and `.scale`).
    pub fn as_borrowed(&self, param: &str, state: &str) -> StateValueRef<'_> {
        fn t(t: &Tensor, name: String) -> TensorRef<'_> {
            TensorRef::new(name, t.dtype(), t.shape(), t.bytes())
        }
        let name = state_tensor_name(param, state);
        match self {
            StateValue::Plain(x) => StateValueRef::Plain(t(x, name)),
            StateValue::F16Scaled { q, scale } => StateValueRef::F16Scaled {
                scale: t(scale, format!("{name}.scale")),
                q: t(q, name),
            },
        }
    }

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
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if numel != u64::try_from(x.len()).ok() {
            return Err(Error::InvalidArgument(format!(
                "{} values for shape {shape:?}",
                x.len()
            )));
        }
        state::scaled(x, shape, scale_shape, None, None).map_err(|reason| Error::Conversion {
            param: String::new(),
            state: String::new(),
            reason,
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

    /// This state as borrowed tensors, which is what [`OptimizerStateRef::save`] takes.
    pub fn as_borrowed(&self) -> OptimizerStateRef<'_> {
        OptimizerStateRef {
            groups: Cow::Borrowed(&self.groups),
            state: self
                .state
                .iter()
                .map(|(p, states)| {
                    let states = states
                        .iter()
                        .map(|(n, v)| (n.clone(), v.as_borrowed(p, n)))
                        .collect();
                    (p.clone(), states)
                })
                .collect(),
        }
    }

    /// Check the rules of format-spec/optimizer.md §Rules on this in-memory state (see
    /// [`OptimizerStateRef::validate`]).
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] naming the parameter and state.
    pub fn validate(&self) -> Result<()> {
        self.as_borrowed().validate()
    }

    /// Save this state, with `model` tensors beside it, as a committed checkpoint in a
    /// store (a path, an `s3://` URL, a store: [`crate::save`]), atomically replacing one
    /// there. The state is saved exactly: FP16-scaled states as their codes plus scale, so a
    /// load into the same layout is lossless.
    ///
    /// # Errors
    /// As [`OptimizerStateRef::save`].
    pub fn save<'s>(
        &self,
        to: impl crate::store::IntoStore<'s>,
        model: &[TensorRef<'_>],
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        self.as_borrowed().save(to, model, opts)
    }

    /// Replace this state with the checkpoint's, loaded in `layout`, after checking that it
    /// fits this optimizer by the rule of [`check_compatible`] (format-spec/optimizer.md
    /// §Compatibility): the same number of groups, matched by position; in each group the
    /// same parameter names, in any order; the same parameter shapes; and every CRC of the
    /// bytes read. Hyperparameters come from the checkpoint, the parameter order inside each
    /// group stays this optimizer's. The new state replaces the old one whole: parameters
    /// without state in the checkpoint have none afterwards. (An [`OptimizerState`] has no
    /// class, so rule F1 is the bindings' to apply.)
    ///
    /// # Errors
    /// [`Error::IncompatibleState`] when the checkpoint does not fit, and every error of
    /// [`crate::Checkpoint::load_optimizer`]. On error `self` is unchanged, bit for bit.
    pub fn restore_from<B: AsRef<[u8]> + Send + Sync + crate::mmap::ReleasePages>(
        &mut self,
        ckpt: &crate::Checkpoint<B>,
        layout: &StateLayout,
    ) -> Result<()> {
        let new = ckpt.load_optimizer(layout)?;
        self.adopt(new)
    }

    /// [`OptimizerState::restore_from`] with options ([`LoadOptions`]): with a pool, the
    /// replaced state's tensors give their buffers to it if they came from it, so a loop
    /// that restores repeatedly through one pool stops paying for fresh pages after the
    /// first restore.
    ///
    /// # Errors
    /// As [`OptimizerState::restore_from`]; on error `self` is unchanged, bit for bit.
    pub fn restore_from_opts<B: AsRef<[u8]> + Send + Sync + crate::mmap::ReleasePages>(
        &mut self,
        ckpt: &crate::Checkpoint<B>,
        layout: &StateLayout,
        opts: &LoadOptions<'_>,
    ) -> Result<()> {
        let new = ckpt.load_optimizer_opts(layout, opts)?;
        self.adopt(new)
    }
}

/// One named state of a parameter, over borrowed tensors (see [`OptimizerStateRef`]).
#[derive(Debug, Clone)]
pub enum StateValueRef<'a> {
    /// Values held directly in the tensor's dtype.
    Plain(TensorRef<'a>),
    /// FP16 codes and an F32 scale of shape `[]` or `[1]`: value = `f32(q) * scale`.
    F16Scaled {
        /// The FP16 codes, shaped like the state.
        q: TensorRef<'a>,
        /// The F32 scale.
        scale: TensorRef<'a>,
    },
}

impl StateValueRef<'_> {
    /// The shape of the state (of `q` for scaled states).
    pub fn shape(&self) -> &[u64] {
        match self {
            StateValueRef::Plain(t) => t.shape(),
            StateValueRef::F16Scaled { q, .. } => q.shape(),
        }
    }
}

/// The complete state of an optimizer over borrowed tensors: what a caller that keeps its
/// tensors elsewhere (NumPy or PyTorch arrays, a training framework's buffers) hands to
/// [`OptimizerStateRef::save`] without copying them first. [`OptimizerState::as_borrowed`]
/// makes one from an owned state; both save through the same code, and the section rules
/// of format-spec/optimizer.md are checked in one place, `format::optimizer`.
///
/// # Example
/// ```
/// use std::collections::BTreeMap;
/// use ckptstore::optim::{OptimizerStateRef, ParamGroup, ParamSpec, StateValueRef};
/// use ckptstore::{Checkpoint, SaveOptions, TensorRef};
///
/// # fn main() -> ckptstore::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let exp_avg = vec![0.5f32; 4];
/// let groups = vec![ParamGroup { params: vec![ParamSpec::new("w", &[4])], hyper: Default::default() }];
/// let mut state = BTreeMap::new();
/// state.insert("w".to_string(), BTreeMap::from([(
///     "exp_avg".to_string(),
///     StateValueRef::Plain(TensorRef::from_slice("", &[4], &exp_avg)),
/// )]));
/// let opt = OptimizerStateRef { groups: groups.into(), state };
/// opt.save(dir.path(), &[], &SaveOptions::default())?;
/// let back = Checkpoint::open(dir.path())?.load_optimizer(&Default::default())?;
/// assert_eq!(back.state["w"]["exp_avg"].to_f32()?, exp_avg);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct OptimizerStateRef<'a> {
    /// Parameter groups, in order.
    pub groups: Cow<'a, [ParamGroup]>,
    /// Per parameter name: state name -> value. Parameters without state are absent. The
    /// tensors' own names are ignored: state tensors are saved as `optim/<param>/<state>`
    /// and scales as `optim/<param>/<state>.scale`.
    pub state: BTreeMap<String, BTreeMap<String, StateValueRef<'a>>>,
}

impl<'a> OptimizerStateRef<'a> {
    /// Check the rules of format-spec/optimizer.md §Rules on this state, as a save would.
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] naming the parameter and state.
    pub fn validate(&self) -> Result<()> {
        let (tensors, section) = self.to_parts(&[])?;
        let by_name: HashMap<&str, &TensorRef<'_>> =
            tensors.iter().map(|t| (t.name(), t)).collect();
        check_section(&section, |n| by_name.get(n).map(|t| (t.dtype(), t.shape())))
    }

    /// Save this state, with `model` tensors beside it, as a committed checkpoint in a
    /// store (a path, an `s3://` URL, a store: [`crate::save`]), atomically replacing one
    /// there, exactly as stored: FP16-scaled states as their codes plus scale. (The
    /// section it writes is [`crate::SaveOptions::optimizer`]; `opts.optimizer` is
    /// replaced.)
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] for a state that breaks a rule of
    /// format-spec/optimizer.md, [`Error::InvalidTensor`] for a model tensor whose name
    /// collides with a state tensor, and the errors of [`crate::save`]. Nothing is
    /// written when the state is invalid.
    pub fn save<'s>(
        &self,
        to: impl crate::store::IntoStore<'s>,
        model: &[TensorRef<'a>],
        opts: &SaveOptions,
    ) -> Result<CommitInfo> {
        let (tensors, section) = self.to_parts(model)?;
        let opts = SaveOptions {
            optimizer: Some(section),
            ..opts.clone()
        };
        crate::write::save(&*to.into_store()?, &tensors, &opts)
    }

    /// The tensors (model ones first, then state tensors in group order and state-name
    /// order) and the manifest section that save this state.
    pub(crate) fn to_parts(
        &self,
        model: &[TensorRef<'a>],
    ) -> Result<(Vec<TensorRef<'a>>, OptimizerSection)> {
        let named: HashSet<&str> = self
            .groups
            .iter()
            .flat_map(|g| &g.params)
            .map(|p| p.name.as_str())
            .collect();
        if let Some(p) = self.state.keys().find(|p| !named.contains(p.as_str())) {
            return Err(Error::optim(
                p,
                "",
                "state for a parameter that no group names",
            ));
        }
        let mut tensors: Vec<TensorRef<'a>> = model.to_vec();
        let mut params = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for p in self.groups.iter().flat_map(|g| &g.params) {
            let mut entries = Vec::new();
            // A parameter named twice is listed twice (rule O2 refuses it by name) but its
            // tensors are taken once.
            let first = seen.insert(&p.name);
            for (sname, v) in self
                .state
                .get(&p.name)
                .into_iter()
                .flatten()
                .filter(|_| first)
            {
                let tname = state_tensor_name(&p.name, sname);
                let (encoding, scale) = match v {
                    StateValueRef::Plain(t) => {
                        tensors.push(t.clone().renamed(tname.clone()));
                        (Encoding::Plain, None)
                    }
                    StateValueRef::F16Scaled { q, scale } => {
                        let scale_name = format!("{tname}.scale");
                        tensors.push(q.clone().renamed(tname.clone()));
                        tensors.push(scale.clone().renamed(scale_name.clone()));
                        (Encoding::F16Scaled, Some(scale_name))
                    }
                };
                entries.push(StateEntry {
                    name: sname.clone(),
                    tensor: tname,
                    encoding,
                    scale,
                });
            }
            params.push(ParamEntry {
                name: p.name.clone(),
                shape: p.shape.clone(),
                state: entries,
            });
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
}

impl OptimizerState {
    /// [`OptimizerState::restore_from`] for one rank's partition (see
    /// [`crate::Checkpoint::load_optimizer_partition`]): the state of the regions this rank
    /// holds replaces this state whole, after checking it fits this optimizer, whose
    /// parameter shapes are the local (region) shapes.
    ///
    /// # Errors
    /// As [`OptimizerState::restore_from`] and
    /// [`crate::Checkpoint::load_optimizer_partition`]; on error `self` is unchanged.
    pub fn restore_from_partition<B: AsRef<[u8]> + Send + Sync + crate::mmap::ReleasePages>(
        &mut self,
        ckpt: &crate::Checkpoint<B>,
        layout: &StateLayout,
        partition: &std::collections::HashMap<String, crate::Region>,
    ) -> Result<()> {
        let new = ckpt.load_optimizer_partition(layout, partition)?;
        self.adopt(new)
    }
}

impl OptimizerState {
    /// Replace this state with `new`, loaded from a checkpoint, if it fits (rule
    /// [`check_compatible`], without a class); the parameters keep this optimizer's order.
    fn adopt(&mut self, new: OptimizerState) -> Result<()> {
        check_compatible(
            OptimizerSignature::new(None, &self.groups),
            OptimizerSignature::new(None, &new.groups),
            false,
        )?;
        *self = compat::in_live_order(&self.groups, new);
        Ok(())
    }
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
