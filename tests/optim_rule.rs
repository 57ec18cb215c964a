//! The optimizer compatibility rule (format-spec/optimizer.md §Compatibility, F1–F5):
//! groups by position, parameters inside a group by name in any order, shapes equal, the
//! class equal unless a change of optimizer is allowed. `restore_from` and the bindings
//! apply it through `optim::check_compatible`.

#[path = "common/refopt.rs"]
mod refopt;

use ckptstore::optim::{
    check_compatible, BufferPool, OptimizerSignature, OptimizerState, ParamGroup, ParamSpec,
    StateLayout,
};
use ckptstore::{Checkpoint, Error, SaveOptions};
use refopt::{Hyper, Kind, Model, Storage};

/// A two-group Adam state over `a`, `b`, `c`, `d` (group 0: a, c; group 1: b, d), trained
/// two steps and saved; its checkpoint directory.
fn saved() -> (tempfile::TempDir, Model, OptimizerState) {
    let dir = tempfile::tempdir().unwrap();
    let h = Hyper::new(Kind::Adam);
    let mut model = Model::new(&[("a", &[4]), ("b", &[2, 3]), ("c", &[3]), ("d", &[])]);
    let mut opt = refopt::optimizer_for(&model, &h, 2);
    for s in 1..=2 {
        refopt::step(&mut model, &mut opt, &h, Storage::F32, s);
    }
    opt.save(dir.path(), &[], &SaveOptions::default()).unwrap();
    (dir, model, opt)
}

/// A live optimizer over the same model, one step of its own (so its state differs).
fn live(model: &Model, groups: Vec<Vec<(&str, &[u64])>>) -> OptimizerState {
    let h = Hyper::new(Kind::Adam);
    let mut opt = OptimizerState::new(
        groups
            .into_iter()
            .map(|g| ParamGroup {
                params: g.into_iter().map(|(n, s)| ParamSpec::new(n, s)).collect(),
                hyper: serde_json::Map::new(),
            })
            .collect(),
    );
    let mut m = model.clone();
    refopt::step(&mut m, &mut opt, &h, Storage::BF16, 1);
    opt
}

fn names(o: &OptimizerState) -> Vec<Vec<&str>> {
    o.groups
        .iter()
        .map(|g| g.params.iter().map(|p| p.name.as_str()).collect())
        .collect()
}

#[test]
fn permuted_order_inside_a_group_is_accepted_and_keeps_the_live_order() {
    let (dir, model, saved) = saved();
    assert_eq!(names(&saved), [vec!["a", "c"], vec!["b", "d"]]);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let permuted = || {
        live(
            &model,
            vec![
                vec![("c", &[3]), ("a", &[4])],
                vec![("d", &[]), ("b", &[2, 3])],
            ],
        )
    };

    let mut opt = permuted();
    opt.restore_from(&ck, &StateLayout::default()).unwrap();
    // The live optimizer keeps its own order; hyperparameters and every state come from
    // the checkpoint, by name.
    assert_eq!(names(&opt), [vec!["c", "a"], vec!["d", "b"]]);
    for (g, s) in opt.groups.iter().zip(&saved.groups) {
        assert_eq!(g.hyper, s.hyper);
        assert!(!g.hyper.is_empty());
    }
    assert_eq!(opt.state.len(), saved.state.len());
    for (p, states) in &saved.state {
        for (n, v) in states {
            assert!(opt.state[p][n].bit_eq(v), "{p}/{n}");
        }
    }

    // The pooled form applies the same rule.
    let mut opt = permuted();
    let pool = BufferPool::new(1 << 20);
    opt.restore_from_opts(
        &ck,
        &StateLayout::default(),
        &ckptstore::optim::LoadOptions::default().pool(&pool),
    )
    .unwrap();
    assert_eq!(names(&opt), [vec!["c", "a"], vec!["d", "b"]]);
    assert!(opt.state["a"]["exp_avg"].bit_eq(&saved.state["a"]["exp_avg"]));
}

/// Restore into `opt`, expect `IncompatibleState` at `group` / `param` with a reason
/// containing every one of `reason`, and `opt` unchanged bit for bit.
fn refused(
    ck: &Checkpoint,
    mut opt: OptimizerState,
    group: Option<usize>,
    param: &str,
    reason: &[&str],
) {
    let before = opt.clone();
    let e = opt.restore_from(ck, &StateLayout::default()).unwrap_err();
    match &e {
        Error::IncompatibleState {
            group: g,
            param: p,
            reason: r,
        } => {
            assert_eq!((*g, p.as_str()), (group, param), "{e}");
            for want in reason {
                assert!(r.contains(want), "{want:?} not in {e}");
            }
        }
        other => panic!("expected IncompatibleState, got {other}"),
    }
    refopt::state_bit_eq(&opt, &before).unwrap();
}

#[test]
fn missing_extra_reshaped_and_miscounted_are_refused_specifically() {
    let (dir, model, _) = saved();
    let ck = Checkpoint::open(dir.path()).unwrap();

    // The optimizer's group 0 lacks `c`, which the checkpoint's has.
    refused(
        &ck,
        live(
            &model,
            vec![vec![("a", &[4])], vec![("b", &[2, 3]), ("d", &[])]],
        ),
        Some(0),
        "c",
        &[r#"the checkpoint's has ["c"] that the optimizer's lacks"#],
    );
    // The optimizer's group 1 has `e`, which the checkpoint's lacks.
    refused(
        &ck,
        live(
            &model,
            vec![
                vec![("a", &[4]), ("c", &[3])],
                vec![("b", &[2, 3]), ("d", &[]), ("e", &[1])],
            ],
        ),
        Some(1),
        "e",
        &[r#"the optimizer's has ["e"] that the checkpoint's lacks"#],
    );
    // Same count, one name swapped between the groups: group 0 is the first to differ.
    refused(
        &ck,
        live(
            &model,
            vec![
                vec![("a", &[4]), ("b", &[2, 3])],
                vec![("c", &[3]), ("d", &[])],
            ],
        ),
        Some(0),
        "b",
        &[
            r#"has ["b"] that the checkpoint's lacks"#,
            r#"has ["c"] that the optimizer's lacks"#,
        ],
    );
    // A shape mismatch names the parameter and both shapes.
    refused(
        &ck,
        live(
            &model,
            vec![
                vec![("c", &[3]), ("a", &[2, 2])],
                vec![("b", &[2, 3]), ("d", &[])],
            ],
        ),
        Some(0),
        "a",
        &["shape [4] in the checkpoint, [2, 2] in the optimizer"],
    );
    // Another number of groups.
    refused(
        &ck,
        live(
            &model,
            vec![vec![("a", &[4]), ("b", &[2, 3]), ("c", &[3]), ("d", &[])]],
        ),
        None,
        "",
        &["the checkpoint has 2 parameter group(s), the optimizer 1"],
    );
    // A live optimizer that names a parameter twice.
    refused(
        &ck,
        live(
            &model,
            vec![
                vec![("a", &[4]), ("c", &[3])],
                vec![("b", &[2, 3]), ("a", &[4])],
            ],
        ),
        Some(1),
        "a",
        &["the optimizer names this parameter in groups 0 and 1"],
    );
}

fn groups(gs: &[&[(&str, &[u64])]]) -> Vec<ParamGroup> {
    gs.iter()
        .map(|g| ParamGroup {
            params: g.iter().map(|(n, s)| ParamSpec::new(*n, s)).collect(),
            hyper: Default::default(),
        })
        .collect()
}

#[test]
fn the_class_must_match_unless_a_change_is_allowed() {
    let g = groups(&[&[("w", &[2]), ("b", &[])]]);
    let permuted = groups(&[&[("b", &[]), ("w", &[2])]]);
    fn sig<'a>(class: Option<&'a str>, gs: &'a [ParamGroup]) -> OptimizerSignature<'a> {
        OptimizerSignature::new(class, gs)
    }

    let e =
        check_compatible(sig(Some("SGD"), &g), sig(Some("AdamW"), &permuted), false).unwrap_err();
    match &e {
        Error::IncompatibleState {
            group: None,
            param,
            reason,
        } if param.is_empty() => {
            assert!(
                reason.contains("the checkpoint's optimizer is AdamW"),
                "{e}"
            );
            assert!(reason.contains("the live optimizer is SGD"), "{e}");
            assert!(reason.contains("allow_optimizer_change"), "{e}");
        }
        other => panic!("expected IncompatibleState for the class, got {other}"),
    }
    // A deliberate change of optimizer: allowed, and the rest of the rule still applies.
    check_compatible(sig(Some("SGD"), &g), sig(Some("AdamW"), &permuted), true).unwrap();
    let e = check_compatible(
        sig(Some("SGD"), &g),
        sig(Some("AdamW"), &groups(&[&[("w", &[3]), ("b", &[])]])),
        true,
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::IncompatibleState { group: Some(0), param, .. } if param == "w"),
        "{e}"
    );
    // The same class, or a side without one: compared by the groups alone.
    check_compatible(sig(Some("AdamW"), &g), sig(Some("AdamW"), &permuted), false).unwrap();
    check_compatible(sig(Some("SGD"), &g), sig(None, &permuted), false).unwrap();
    check_compatible(sig(None, &g), sig(Some("AdamW"), &permuted), false).unwrap();
    // The message names the place.
    let e = check_compatible(
        sig(None, &g),
        sig(None, &groups(&[&[("w", &[2]), ("w", &[2])]])),
        false,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot restore optimizer state: group 0, parameter \"w\": the checkpoint names this \
         parameter twice in this group"
    );
}
