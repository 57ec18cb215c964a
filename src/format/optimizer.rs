//! The optimizer section's rules (format-spec/optimizer.md §Rules, O1-O9): the one place
//! they are written down in code.
//!
//! The writer checks a section against the tensors it is about to save, the reader against
//! the tensors of the checkpoint it opened; both call [`check_section`] with a function
//! that looks a tensor up by name, so the two cannot drift apart.

use std::collections::HashSet;

use super::schema::{Encoding, OptimizerSection};
use crate::dtype::{checked_numel, DType};
use crate::error::{Error, Result};

/// True if a state of `shape` fits a parameter of `param`: the same shape, or at most one
/// element (scalars such as `step`; rule O6).
pub fn shape_fits(shape: &[u64], param: &[u64]) -> bool {
    shape == param || (shape.len() <= 1 && checked_numel(shape).is_some_and(|n| n <= 1))
}

/// True if `dtype` and `shape` make a valid scale of an `f16_scaled` state: F32 with rank
/// at most 1 and exactly one element (rule O8).
pub fn is_scale(dtype: DType, shape: &[u64]) -> bool {
    dtype == DType::F32 && shape.len() <= 1 && checked_numel(shape) == Some(1)
}

/// Check `sec` against rules O1-O9 of format-spec/optimizer.md. `tensor(name)` returns the
/// dtype and shape of the tensor called `name` among those the section may reference (the
/// checkpoint's, or those being saved), or `None` if there is none.
///
/// Reads no tensor data; runs in time linear in the size of the section.
///
/// # Errors
/// [`Error::InvalidOptimizerState`] naming the parameter and state of the first rule
/// broken.
pub fn check_section<'t>(
    sec: &OptimizerSection,
    tensor: impl Fn(&str) -> Option<(DType, &'t [u64])>,
) -> Result<()> {
    let mut in_groups: HashSet<&str> = HashSet::new();
    for (gi, g) in sec.groups.iter().enumerate() {
        if !g.hyper.is_object() {
            // O1
            return Err(Error::optim(
                "",
                "",
                format!("group {gi}: hyper is not a JSON object"),
            ));
        }
        super::check_json_depth(&g.hyper)
            .map_err(|e| Error::optim("", "", format!("group {gi}: hyper {e}")))?;
        for p in &g.params {
            if p.is_empty() {
                // O9
                return Err(Error::optim(
                    "",
                    "",
                    format!("group {gi} has a parameter with an empty name"),
                ));
            }
            if !in_groups.insert(p) {
                // O2
                return Err(Error::optim(
                    p,
                    "",
                    format!("named twice in the groups, by more than one group entry (again in group {gi})"),
                ));
            }
        }
    }
    let mut listed: HashSet<&str> = HashSet::new();
    let mut used: HashSet<&str> = HashSet::new();
    for p in &sec.params {
        // O3
        if !in_groups.contains(p.name.as_str()) {
            return Err(Error::optim(
                &p.name,
                "",
                "state for a parameter that no group names (listed in params but named by no group)",
            ));
        }
        if !listed.insert(&p.name) {
            return Err(Error::optim(&p.name, "", "listed twice in params"));
        }
        let mut names: HashSet<&str> = HashSet::new();
        for s in &p.state {
            let err = |r: String| Error::optim(&p.name, &s.name, r);
            // O4
            if s.name.is_empty() || !names.insert(&s.name) {
                return Err(err("state name empty or repeated".into()));
            }
            // O5
            let (dtype, shape) = tensor(&s.tensor).ok_or_else(|| {
                err(format!(
                    "names tensor {:?}, which the checkpoint does not hold",
                    s.tensor
                ))
            })?;
            if !used.insert(&s.tensor) {
                return Err(err(format!("tensor {:?} is referenced twice", s.tensor)));
            }
            // O6
            if !shape_fits(shape, &p.shape) {
                return Err(err(format!(
                    "tensor {:?} has shape {shape:?}, which fits neither the parameter's {:?} nor a scalar",
                    s.tensor, p.shape
                )));
            }
            match (s.encoding, &s.scale) {
                (Encoding::Plain, None) => {}
                // O7
                (Encoding::Plain, Some(_)) => return Err(err("a plain state has a scale".into())),
                // O8
                (Encoding::F16Scaled, None) => {
                    return Err(err("an f16_scaled state has no scale".into()))
                }
                (Encoding::F16Scaled, Some(sc)) => {
                    if dtype != DType::F16 {
                        return Err(err(format!(
                            "f16_scaled codes must be F16, tensor {:?} is {dtype}",
                            s.tensor
                        )));
                    }
                    let (sd, ss) = tensor(sc).ok_or_else(|| {
                        err(format!(
                            "names scale tensor {sc:?}, which the checkpoint does not hold"
                        ))
                    })?;
                    if !used.insert(sc) {
                        return Err(err(format!("tensor {sc:?} is referenced twice")));
                    }
                    if !is_scale(sd, ss) {
                        return Err(err(format!(
                            "scale tensor {sc:?} must be F32 of shape [] or [1], is {sd} {ss:?}"
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
