//! The optimizer compatibility rule from Python: `check_optimizer_fit` hands the live
//! optimizer's groups and the checkpoint's to `ckptstore::optim::check_compatible`, the one
//! implementation of the rule (format-spec/optimizer.md §Compatibility). The torch layers
//! (`ckptstore.torch.load`, `ckptstore.torch.distributed.load`, the manager's restores)
//! call it before they change anything.

use ckptstore::optim::{check_compatible, OptimizerSignature, ParamGroup, ParamSpec};
use ckptstore::Error;
use pyo3::prelude::*;
use pyo3::types::{PyIterator, PyString};

use crate::errors::CkError;

/// Which side of the rule a value came from: a malformed live side is a bad argument, a
/// malformed checkpoint side (its metadata is outside data) a checkpoint that does not fit.
#[derive(Clone, Copy)]
enum Side {
    Live,
    Saved,
}

impl Side {
    fn error(self, what: String) -> PyErr {
        match self {
            Side::Live => CkError(Error::InvalidArgument(format!(
                "live optimizer groups: {what}"
            )))
            .into(),
            Side::Saved => CkError(Error::IncompatibleState {
                group: None,
                param: String::new(),
                reason: format!("the checkpoint's parameter groups are malformed: {what}"),
            })
            .into(),
        }
    }
}

/// An iterator over a sequence that is not a string.
fn seq<'py>(side: Side, o: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyIterator>> {
    if o.is_instance_of::<PyString>() {
        return Err(side.error(format!("{what} must be a sequence, not a string")));
    }
    o.try_iter()
        .map_err(|e| side.error(format!("{what} must be a sequence: {e}")))
}

/// Groups as Python gives them: a sequence of groups, each a sequence of `(name, shape)`
/// pairs. On the checkpoint's side a shape may be `None` (its metadata records none),
/// which does not fit.
fn groups(side: Side, obj: &Bound<'_, PyAny>) -> PyResult<Vec<ParamGroup>> {
    let mut out = Vec::new();
    for (gi, g) in seq(side, obj, "the groups")?.enumerate() {
        let g = g?;
        let mut params = Vec::new();
        for p in seq(side, &g, &format!("group {gi}"))? {
            let p = p?;
            let (name, shape): (String, Option<Vec<u64>>) = p.extract().map_err(|e| {
                side.error(format!(
                    "group {gi}: each parameter must be a (name, shape) pair: {e}"
                ))
            })?;
            let Some(shape) = shape else {
                return Err(match side {
                    Side::Live => side.error(format!("group {gi}, parameter {name:?}: no shape")),
                    Side::Saved => CkError(Error::IncompatibleState {
                        group: Some(gi),
                        param: name,
                        reason: "the checkpoint records no shape for this parameter".into(),
                    })
                    .into(),
                });
            };
            params.push(ParamSpec { name, shape });
        }
        out.push(ParamGroup {
            params,
            hyper: Default::default(),
        });
    }
    Ok(out)
}

/// `check_optimizer_fit(live_groups, saved_groups, *, live_class=None, saved_class=None,
/// allow_optimizer_change=False)`: raise `IncompatibleStateError` (with `group` and `param`
/// attributes) unless the checkpoint's optimizer state fits the live optimizer, by the
/// rule of format-spec/optimizer.md §Compatibility: the same class when both are known
/// (unless `allow_optimizer_change`), the same number of groups, matched by position, each
/// naming the same parameters in any order, with the same shapes. Each `*_groups` is a
/// sequence of groups, each a sequence of `(name, shape)` pairs.
#[pyfunction]
#[pyo3(signature = (live_groups, saved_groups, *, live_class = None, saved_class = None, allow_optimizer_change = false))]
pub(crate) fn check_optimizer_fit(
    live_groups: &Bound<'_, PyAny>,
    saved_groups: &Bound<'_, PyAny>,
    live_class: Option<String>,
    saved_class: Option<&Bound<'_, PyAny>>,
    allow_optimizer_change: bool,
) -> PyResult<()> {
    let live = groups(Side::Live, live_groups)?;
    let saved = groups(Side::Saved, saved_groups)?;
    let saved_class: Option<String> =
        match saved_class {
            Some(c) if !c.is_none() => Some(c.extract().map_err(|_| {
                Side::Saved.error(format!("the optimizer class is {c}, not a string"))
            })?),
            _ => None,
        };
    check_compatible(
        OptimizerSignature::new(live_class.as_deref(), &live),
        OptimizerSignature::new(saved_class.as_deref(), &saved),
        allow_optimizer_change,
    )
    .map_err(CkError)?;
    Ok(())
}
