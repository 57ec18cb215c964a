//! What the live optimizer holds for each state: [`Target`], [`ScaleShape`] and the
//! [`StateLayout`] that maps states to targets, with the one rule (written here, used by
//! every loader and by the Python bindings) for which states a default target applies to.

use std::collections::HashMap;

/// The shape of the scale tensor of an FP16-scaled state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleShape {
    /// Keep the checkpoint's scale shape when the stored state is FP16-scaled; `[1]`
    /// (as TransformerEngine's FusedAdam) when it is converted from plain values.
    #[default]
    Keep,
    /// A 0-dim scale, shape `[]`.
    Scalar,
    /// A one-element scale, shape `[1]`.
    One,
}

impl ScaleShape {
    pub(crate) fn dims(self) -> &'static [u64] {
        match self {
            ScaleShape::Scalar => &[],
            ScaleShape::Keep | ScaleShape::One => &[1],
        }
    }
}

/// What the live optimizer holds for a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Target {
    /// Whatever the checkpoint stores, copied exactly.
    #[default]
    AsStored,
    /// FP32 values.
    F32,
    /// BF16 values (round to nearest even from FP32).
    BF16,
    /// FP16 codes with a per-tensor F32 scale (TransformerEngine FusedAdam arithmetic).
    F16Scaled(ScaleShape),
}

/// Per state name (and optionally per parameter), the target the live optimizer holds.
///
/// Resolution order: a `(parameter, state)` entry, then a state-name entry, then the
/// default. Explicit entries apply as given and fail on a non-floating-point state; the
/// default applies only to floating-point states shaped like their parameter and never to
/// the counters named by [`StateLayout::counter`] (by default `step`), so scalar states
/// stay as stored even for a 0-dim parameter, whose moments are 0-dim too.
///
/// # Example
/// ```
/// use ckptstore::optim::{ScaleShape, StateLayout, Target};
/// let layout = StateLayout::default()
///     .state("exp_avg", Target::F16Scaled(ScaleShape::Keep))
///     .state("exp_avg_sq", Target::F16Scaled(ScaleShape::Keep))
///     .param_state("embed.weight", "exp_avg", Target::F32);
/// ```
#[derive(Debug, Clone)]
pub struct StateLayout {
    default: Target,
    states: HashMap<String, Target>,
    params: HashMap<(String, String), Target>,
    counters: Vec<String>,
}

impl Default for StateLayout {
    /// Everything as stored; `step` is a counter.
    fn default() -> Self {
        StateLayout {
            default: Target::AsStored,
            states: HashMap::new(),
            params: HashMap::new(),
            counters: vec!["step".into()],
        }
    }
}

impl StateLayout {
    /// A layout whose default target is `t`.
    pub fn with_default(t: Target) -> Self {
        StateLayout {
            default: t,
            ..Default::default()
        }
    }

    /// Name a state the default target never applies to (a counter kept as stored, like
    /// the built-in `step`).
    pub fn counter(mut self, state: impl Into<String>) -> Self {
        self.counters.push(state.into());
        self
    }

    /// Set the target of every state named `state`.
    pub fn state(mut self, state: impl Into<String>, t: Target) -> Self {
        self.states.insert(state.into(), t);
        self
    }

    /// Set the target of one parameter's state.
    pub fn param_state(
        mut self,
        param: impl Into<String>,
        state: impl Into<String>,
        t: Target,
    ) -> Self {
        self.params.insert((param.into(), state.into()), t);
        self
    }

    /// The target this layout gives state `state` of parameter `param`, whose values are
    /// floating-point (`float`; FP16-scaled states are) and shaped `state_shape`, for a
    /// parameter shaped `param_shape` (global shapes, for a sharded state): a
    /// `(parameter, state)` entry, else a state-name entry, as given; else the default, for
    /// floating-point states shaped like their parameter that are not counters, and
    /// [`Target::AsStored`] for the rest. Every loader resolves targets with this rule.
    pub fn target(
        &self,
        param: &str,
        state: &str,
        float: bool,
        state_shape: &[u64],
        param_shape: &[u64],
    ) -> Target {
        let (target, explicit) = self.resolve(param, state);
        if explicit || (float && state_shape == param_shape) {
            target
        } else {
            Target::AsStored
        }
    }

    /// The target for a state, and whether it was given explicitly.
    fn resolve(&self, param: &str, state: &str) -> (Target, bool) {
        if let Some(&t) = self.params.get(&(param.to_string(), state.to_string())) {
            return (t, true);
        }
        if let Some(&t) = self.states.get(state) {
            return (t, true);
        }
        if self.counters.iter().any(|c| c == state) {
            return (Target::AsStored, false);
        }
        (self.default, false)
    }
}
