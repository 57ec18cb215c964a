//! The optimizer compatibility rule (format-spec/optimizer.md §Compatibility, rules F1–F5):
//! whether a checkpoint's optimizer state fits a live optimizer.
//!
//! [`check_compatible`] is its one implementation. [`super::OptimizerState::restore_from`]
//! (and its pooled and partition forms) call it, and so does every binding: the Python
//! module's `check_optimizer_fit`, which `ckptstore.torch.load`,
//! `ckptstore.torch.distributed.load` and the torch `CheckpointManager`'s restores call
//! before they change anything.

use std::collections::{HashMap, HashSet};

use super::{ParamGroup, ParamSpec};
use crate::error::{Error, Result};

/// One side of the compatibility rule: an optimizer's class, when known, and its
/// parameter groups (names and shapes; the hyperparameters play no part).
#[derive(Debug, Clone, Copy)]
pub struct OptimizerSignature<'a> {
    /// The optimizer's class (`"AdamW"`, `"SGD"`, ...), `None` when unknown: ckptstore's
    /// torch helpers record it in the checkpoint's metadata; a state saved through the
    /// Rust or numpy API has none.
    pub class: Option<&'a str>,
    /// The parameter groups, in the optimizer's order.
    pub groups: &'a [ParamGroup],
}

impl<'a> OptimizerSignature<'a> {
    /// A signature over `groups`, of `class` when known.
    pub fn new(class: Option<&'a str>, groups: &'a [ParamGroup]) -> Self {
        OptimizerSignature { class, groups }
    }
}

/// How many names an error lists before it says how many more there are.
const LISTED: usize = 8;

fn list(names: &[&str]) -> String {
    let mut s: Vec<String> = names
        .iter()
        .take(LISTED)
        .map(|n| format!("{n:?}"))
        .collect();
    if names.len() > LISTED {
        s.push(format!("... {} more", names.len() - LISTED));
    }
    format!("[{}]", s.join(", "))
}

fn incompatible(group: Option<usize>, param: &str, reason: String) -> Error {
    Error::IncompatibleState {
        group,
        param: param.to_string(),
        reason,
    }
}

/// Refuse a parameter named twice on one side (F3): where is it named first?
fn check_unique(side: &str, groups: &[ParamGroup]) -> Result<()> {
    let mut first: HashMap<&str, usize> = HashMap::new();
    for (gi, g) in groups.iter().enumerate() {
        for p in &g.params {
            if let Some(&g0) = first.get(p.name.as_str()) {
                let also = if g0 == gi {
                    "twice in this group".to_string()
                } else {
                    format!("in groups {g0} and {gi}")
                };
                return Err(incompatible(
                    Some(gi),
                    &p.name,
                    format!("{side} names this parameter {also}"),
                ));
            }
            first.insert(&p.name, gi);
        }
    }
    Ok(())
}

/// Check that the optimizer state of a checkpoint (`saved`) fits the live optimizer
/// (`live`), by the rule of format-spec/optimizer.md §Compatibility:
///
/// * **F1** the optimizer class is the same when both sides name one, unless
///   `allow_optimizer_change` (a deliberate change of optimizer);
/// * **F2** the same number of parameter groups, matched by position;
/// * **F3** no side names a parameter twice (in one group or in two);
/// * **F4** group `i` of both sides names the same parameters **by name, as a set**: the
///   order of the parameters inside a group does not matter, since parameters are named
///   by their model names and a checkpoint does not depend on parameter order;
/// * **F5** each parameter has the same shape on both sides.
///
/// The checks run in this order and the first that fails is reported.
///
/// # Errors
/// [`Error::IncompatibleState`] with the group (`None` for F1 and F2) and the parameter
/// ("" for F1, F2 and a group-wide F4 report) involved, and in its reason what the
/// checkpoint and the live optimizer each have.
///
/// # Example
/// ```
/// use ckptstore::optim::{check_compatible, OptimizerSignature, ParamGroup, ParamSpec};
///
/// let group = |names: &[&str]| ParamGroup {
///     params: names.iter().map(|n| ParamSpec::new(*n, &[4])).collect(),
///     hyper: Default::default(),
/// };
/// let live = [group(&["w", "b"])];
/// let saved = [group(&["b", "w"])];
/// // The order inside a group does not matter.
/// check_compatible(
///     OptimizerSignature::new(Some("AdamW"), &live),
///     OptimizerSignature::new(Some("AdamW"), &saved),
///     false,
/// )?;
/// // Another optimizer class is refused unless the change is asked for.
/// let sgd = OptimizerSignature::new(Some("SGD"), &live);
/// let adamw = OptimizerSignature::new(Some("AdamW"), &saved);
/// assert!(check_compatible(sgd, adamw, false).is_err());
/// check_compatible(sgd, adamw, true)?;
/// # Ok::<(), ckptstore::Error>(())
/// ```
pub fn check_compatible(
    live: OptimizerSignature<'_>,
    saved: OptimizerSignature<'_>,
    allow_optimizer_change: bool,
) -> Result<()> {
    // F1: the class.
    if let (Some(l), Some(s)) = (live.class, saved.class) {
        if l != s && !allow_optimizer_change {
            return Err(incompatible(
                None,
                "",
                format!(
                    "the checkpoint's optimizer is {s}, the live optimizer is {l}: {l} cannot \
                     use {s}'s state and hyperparameters (to restore them anyway, as a \
                     deliberate change of optimizer, allow_optimizer_change)"
                ),
            ));
        }
    }
    // F2: the number of groups.
    if live.groups.len() != saved.groups.len() {
        return Err(incompatible(
            None,
            "",
            format!(
                "the checkpoint has {} parameter group(s), the optimizer {}",
                saved.groups.len(),
                live.groups.len()
            ),
        ));
    }
    // F3: each name once per side.
    check_unique("the optimizer", live.groups)?;
    check_unique("the checkpoint", saved.groups)?;
    for (gi, (lg, sg)) in live.groups.iter().zip(saved.groups).enumerate() {
        // F4: the same names, in any order.
        let saved_specs: HashMap<&str, &ParamSpec> =
            sg.params.iter().map(|p| (p.name.as_str(), p)).collect();
        let live_names: HashSet<&str> = lg.params.iter().map(|p| p.name.as_str()).collect();
        let only_live: Vec<&str> = lg
            .params
            .iter()
            .map(|p| p.name.as_str())
            .filter(|n| !saved_specs.contains_key(n))
            .collect();
        let only_saved: Vec<&str> = sg
            .params
            .iter()
            .map(|p| p.name.as_str())
            .filter(|n| !live_names.contains(n))
            .collect();
        if !only_live.is_empty() || !only_saved.is_empty() {
            let param = only_live.first().or(only_saved.first()).copied();
            let mut reason = format!(
                "the optimizer's group has {} parameter(s), the checkpoint's {}",
                lg.params.len(),
                sg.params.len()
            );
            if !only_live.is_empty() {
                reason += &format!(
                    "; the optimizer's has {} that the checkpoint's lacks",
                    list(&only_live)
                );
            }
            if !only_saved.is_empty() {
                reason += &format!(
                    "; the checkpoint's has {} that the optimizer's lacks",
                    list(&only_saved)
                );
            }
            return Err(incompatible(Some(gi), param.unwrap_or_default(), reason));
        }
        // F5: the same shapes.
        for p in &lg.params {
            if let Some(q) = saved_specs.get(p.name.as_str()) {
                if p.shape != q.shape {
                    return Err(incompatible(
                        Some(gi),
                        &p.name,
                        format!(
                            "shape {:?} in the checkpoint, {:?} in the optimizer",
                            q.shape, p.shape
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// `new` (a state loaded from a checkpoint that [`check_compatible`] accepted for `live`)
/// with the live optimizer's parameter order in every group: the checkpoint's names and
/// shapes are the live ones (F4, F5), possibly in another order, and the live optimizer
/// keeps its own.
pub(super) fn in_live_order(
    live: &[ParamGroup],
    mut new: super::OptimizerState,
) -> super::OptimizerState {
    for (lg, ng) in live.iter().zip(&mut new.groups) {
        ng.params.clone_from(&lg.params);
    }
    new
}
