//! The two motivating bugs, made impossible: in-place scaling of the source on load
//! (TransformerEngine FusedAdam) and merging into stale state (ColossalAI sharded loading).

#[path = "common/refopt.rs"]
mod refopt;

use std::collections::BTreeMap;
use std::path::Path;

use ckptstore::convert::reference;
use ckptstore::optim::{
    OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout, StateValue, Target, Tensor,
};
use ckptstore::{Checkpoint, Error, SaveOptions};
use half::f16;
use refopt::{Hyper, Kind, Model, Storage};

fn file_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn small_opts() -> SaveOptions {
    SaveOptions {
        max_shard_size: 2048,
        ..Default::default()
    }
}

/// An FP32 Adam state over a model with a 0-dim parameter, trained a few steps.
fn fp32_adam() -> (Model, OptimizerState) {
    let mut model = Model::new(&[
        ("w", &[8, 16]),
        ("b", &[16]),
        ("temp", &[]),
        ("big", &[3000]),
    ]);
    let h = Hyper::new(Kind::Adam);
    let mut opt = refopt::optimizer_for(&model, &h, 1);
    for s in 1..=3 {
        refopt::step(&mut model, &mut opt, &h, Storage::F32, s);
    }
    (model, opt)
}

fn f16_layout(shape: ScaleShape) -> StateLayout {
    StateLayout::default()
        .state("exp_avg", Target::F16Scaled(shape))
        .state("exp_avg_sq", Target::F16Scaled(shape))
}

#[test]
fn fused_adam_fp32_checkpoint_loaded_twice_into_f16_scaled_is_identical_and_source_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let (model, opt) = fp32_adam();
    opt.save(dir.path(), &refopt::model_refs(&model), &small_opts())
        .unwrap();
    let before = file_bytes(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(ck.shards().len() >= 2);
    let layout = f16_layout(ScaleShape::Keep);
    let a = ck.load_optimizer(&layout).unwrap();
    let b = ck.load_optimizer(&layout).unwrap();
    refopt::state_bit_eq(&a, &b).unwrap();
    drop(ck);
    assert_eq!(
        before,
        file_bytes(dir.path()),
        "shard files changed by a load"
    );

    // The loaded codes are exactly the formula applied to the ORIGINAL FP32 values: a
    // loader that scaled its source in place would give other codes on the second load.
    for (param, states) in &opt.state {
        for name in ["exp_avg", "exp_avg_sq"] {
            let x = states[name].to_f32().unwrap();
            let (rq, rs) = reference::f32_to_f16_scaled(&x).unwrap();
            for loaded in [&a, &b] {
                let StateValue::F16Scaled { q, scale } = &loaded.state[param][name] else {
                    panic!("not scaled")
                };
                assert_eq!(q.shape(), states[name].shape(), "{param}/{name} shape");
                assert_eq!(
                    scale.shape(),
                    &[1],
                    "converted scales default to [1] as in FusedAdam"
                );
                assert_eq!(scale.as_slice::<f32>().unwrap()[0].to_bits(), rs.to_bits());
                let got: Vec<u16> = q
                    .as_slice::<f16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let want: Vec<u16> = rq.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{param}/{name}");
            }
        }
        // step (0-dim F32) is not touched by the default.
        assert!(a.state[param]["step"].bit_eq(&states["step"]));
    }
    // The 0-dim parameter's state stays 0-dim.
    assert_eq!(a.state["temp"]["exp_avg"].shape(), &[] as &[u64]);
}

#[test]
fn in_memory_source_bytes_are_never_written() {
    // The same scenario over Vec<u8> buffers: the bytes are compared directly.
    let dir = tempfile::tempdir().unwrap();
    let (model, opt) = fp32_adam();
    opt.save(dir.path(), &refopt::model_refs(&model), &small_opts())
        .unwrap();
    let files = file_bytes(dir.path());
    let manifest = &files["ckpt-manifest.json"];
    let m = ckptstore::format::manifest::decode(manifest).unwrap();
    let shards: Vec<Vec<u8>> = m.shards.iter().map(|s| files[&s.file].clone()).collect();
    let copy = shards.clone();
    let ck = Checkpoint::from_parts(manifest, shards).unwrap();
    for _ in 0..2 {
        ck.load_optimizer(&f16_layout(ScaleShape::Scalar)).unwrap();
        ck.load_optimizer(&StateLayout::with_default(Target::BF16))
            .unwrap();
    }
    for (s, c) in ck.shards().iter().zip(&copy) {
        assert_eq!(&s.bytes, c);
    }
}

#[test]
fn scale_shapes_are_kept_or_set_by_the_layout() {
    let dir = tempfile::tempdir().unwrap();
    let x: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("p", &[10]), ParamSpec::new("s", &[])],
        hyper: Default::default(),
    }]);
    let mut sp = BTreeMap::new();
    sp.insert(
        "m0".to_string(),
        StateValue::f16_scaled_from_f32(&[10], &x, ScaleShape::Scalar).unwrap(),
    );
    sp.insert(
        "m1".to_string(),
        StateValue::f16_scaled_from_f32(&[10], &x, ScaleShape::One).unwrap(),
    );
    sp.insert(
        "m2".to_string(),
        StateValue::Plain(Tensor::from_slice(&[10], &x).unwrap()),
    );
    opt.state.insert("p".into(), sp);
    let mut ss = BTreeMap::new();
    ss.insert(
        "m0".to_string(),
        StateValue::f16_scaled_from_f32(&[], &[3.0], ScaleShape::Scalar).unwrap(),
    );
    opt.state.insert("s".into(), ss);
    opt.save(dir.path(), &[], &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();

    let scale_shape = |st: &OptimizerState, p: &str, n: &str| match &st.state[p][n] {
        StateValue::F16Scaled { scale, .. } => scale.shape().to_vec(),
        _ => panic!("not scaled"),
    };
    let keep = ck
        .load_optimizer(&StateLayout::with_default(Target::F16Scaled(
            ScaleShape::Keep,
        )))
        .unwrap();
    assert_eq!(scale_shape(&keep, "p", "m0"), Vec::<u64>::new());
    assert_eq!(scale_shape(&keep, "p", "m1"), vec![1]);
    assert_eq!(scale_shape(&keep, "p", "m2"), vec![1]);
    assert_eq!(scale_shape(&keep, "s", "m0"), Vec::<u64>::new());
    assert_eq!(keep.state["s"]["m0"].shape(), &[] as &[u64]);
    // Kept scaled states are exact copies.
    assert!(keep.state["p"]["m0"].bit_eq(&opt.state["p"]["m0"]));
    let scalar = ck
        .load_optimizer(&StateLayout::with_default(Target::F16Scaled(
            ScaleShape::Scalar,
        )))
        .unwrap();
    assert_eq!(scale_shape(&scalar, "p", "m1"), Vec::<u64>::new());
    assert_eq!(scale_shape(&scalar, "p", "m2"), Vec::<u64>::new());
    let one = ck
        .load_optimizer(&StateLayout::with_default(Target::F16Scaled(
            ScaleShape::One,
        )))
        .unwrap();
    assert_eq!(scale_shape(&one, "p", "m0"), vec![1]);
    // As stored: everything bit-identical to what was saved.
    let same = ck.load_optimizer(&StateLayout::default()).unwrap();
    refopt::state_bit_eq(&same, &opt).unwrap();
    // F16-scaled -> F32 and -> BF16 follow the formulas.
    let f = ck
        .load_optimizer(&StateLayout::with_default(Target::F32))
        .unwrap();
    let StateValue::F16Scaled { q, scale } = &opt.state["p"]["m1"] else {
        panic!()
    };
    let want =
        reference::f16_scaled_to_f32(q.as_slice().unwrap(), scale.as_slice::<f32>().unwrap()[0]);
    assert_eq!(f.state["p"]["m1"].to_f32().unwrap(), want);
    let b = ck
        .load_optimizer(&StateLayout::with_default(Target::BF16))
        .unwrap();
    let StateValue::Plain(t) = &b.state["p"]["m1"] else {
        panic!()
    };
    assert_eq!(
        t.as_slice::<half::bf16>().unwrap(),
        &reference::f32_to_bf16(&want)[..]
    );
}

#[test]
fn non_finite_values_cannot_be_scaled_and_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("p", &[3])],
        hyper: Default::default(),
    }]);
    let x = [1.0f32, f32::INFINITY, 2.0];
    opt.state.insert(
        "p".into(),
        [(
            "exp_avg".to_string(),
            StateValue::Plain(Tensor::from_slice(&[3], &x).unwrap()),
        )]
        .into(),
    );
    opt.save(dir.path(), &[], &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    match ck.load_optimizer(&f16_layout(ScaleShape::Keep)) {
        Err(Error::Conversion {
            param,
            state,
            reason,
        }) => {
            assert_eq!((param.as_str(), state.as_str()), ("p", "exp_avg"));
            assert!(reason.contains("infinity or NaN"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // BF16 keeps the infinity.
    let b = ck
        .load_optimizer(&StateLayout::with_default(Target::BF16))
        .unwrap();
    assert_eq!(
        b.state["p"]["exp_avg"].to_f32().unwrap(),
        vec![1.0, f32::INFINITY, 2.0]
    );
}

/// A state too small to scale to FP16 (absmax below ~1e-34) cannot be loaded as FP16-scaled,
/// and says so; with one of its bytes damaged it is refused as damaged first (found by the
/// `structured` fuzz target: the recorded absmax was checked before the data's CRC).
#[test]
fn an_unscalable_damaged_state_is_refused_as_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("p", &[64])],
        hyper: Default::default(),
    }]);
    let x: Vec<f32> = (0..64).map(|i| 5e-39 * (1.0 + i as f32 / 64.0)).collect();
    opt.state.insert(
        "p".into(),
        [(
            "exp_avg".to_string(),
            StateValue::Plain(Tensor::from_slice(&[64], &x).unwrap()),
        )]
        .into(),
    );
    opt.save(dir.path(), &[], &SaveOptions::default()).unwrap();
    let layout = f16_layout(ScaleShape::Keep);
    let ck = Checkpoint::open(dir.path()).unwrap();
    match ck.load_optimizer(&layout) {
        Err(Error::Conversion { reason, .. }) => assert!(reason.contains("too small"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let t = ck
        .tensors()
        .iter()
        .find(|t| t.name.contains("exp_avg"))
        .unwrap()
        .clone();
    let file = dir
        .path()
        .join(&ck.manifest().unwrap().shards[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[t.offsets[0] as usize + 17] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(
        matches!(
            ck.load_optimizer(&layout),
            Err(Error::ChecksumMismatch { .. })
        ),
        "a damaged state must be refused as damaged"
    );
}

/// The ColossalAI scenario for one optimizer configuration.
fn stale_state_scenario(kind: Kind, ngroups: usize, storage: Storage) {
    let dir = tempfile::tempdir().unwrap();
    let h = Hyper::new(kind);
    let model0 = Model::new(&[("a", &[4, 4]), ("b", &[7]), ("c", &[]), ("d", &[2, 3])]);
    let fresh = refopt::optimizer_for(&model0, &h, ngroups);
    // Saved before the first step: groups, no state.
    fresh
        .save(dir.path(), &refopt::model_refs(&model0), &small_opts())
        .unwrap();

    // Train, so state accumulates; add stale non-parameter state too.
    let mut model = model0.clone();
    let mut opt = fresh.clone();
    for s in 1..=3 {
        refopt::step(&mut model, &mut opt, &h, storage, s);
    }
    opt.state.insert(
        "ghost".into(),
        [(
            "momentum_buffer".to_string(),
            storage.encode(&[2], &[1.0, 2.0]),
        )]
        .into(),
    );
    assert!(!opt.state.is_empty());

    // Restore model and optimizer from the checkpoint.
    let ck = Checkpoint::open(dir.path()).unwrap();
    let layout = storage.layout();
    opt.restore_from(&ck, &layout).unwrap();
    assert!(
        opt.state.is_empty(),
        "{kind:?}: state survived the restore: {:?}",
        opt.state.keys()
    );
    let mut model = refopt::model_from(&ck, &model0);

    // The next step equals a fresh optimizer's first step.
    let mut model_f = model0.clone();
    let mut opt_f = fresh.clone();
    refopt::step(&mut model, &mut opt, &h, storage, 1);
    refopt::step(&mut model_f, &mut opt_f, &h, storage, 1);
    assert_eq!(
        model, model_f,
        "{kind:?} {ngroups} groups {storage:?}: parameters differ"
    );
    refopt::state_bit_eq(&opt, &opt_f).unwrap();
}

#[test]
fn colossalai_restore_replaces_stale_state() {
    let mut n = 0;
    for kind in [Kind::Sgd, Kind::Adam, Kind::AdamW] {
        for ngroups in [1, 2] {
            for storage in [Storage::F32, Storage::F64] {
                stale_state_scenario(kind, ngroups, storage);
                n += 1;
            }
        }
    }
    assert_eq!(n, 12);
}

#[test]
fn colossalai_the_point_nine_example() {
    // p = 1, grad = 1, SGD lr 0.1 momentum 0.9. Fresh: p -> 0.9. With one step of stale
    // momentum merged in (the bug), the update would give 0.81.
    let dir = tempfile::tempdir().unwrap();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("p", &[])],
        hyper: serde_json::json!({"lr": 0.1, "momentum": 0.9})
            .as_object()
            .unwrap()
            .clone(),
    }]);
    opt.save(dir.path(), &[], &SaveOptions::default()).unwrap();
    let sgd = |p: f32, st: &mut OptimizerState| -> f32 {
        let buf = match st.state.get("p").and_then(|s| s.get("momentum_buffer")) {
            Some(b) => 0.9 * b.to_f32().unwrap()[0] + 1.0,
            None => 1.0,
        };
        st.state.entry("p".into()).or_default().insert(
            "momentum_buffer".into(),
            StateValue::Plain(Tensor::scalar_f32(buf)),
        );
        p - 0.1 * buf
    };
    let p = sgd(1.0, &mut opt); // momentum accumulates
    assert_eq!(p, 0.9);
    opt.restore_from(
        &Checkpoint::open(dir.path()).unwrap(),
        &StateLayout::default(),
    )
    .unwrap();
    let next = sgd(1.0, &mut opt);
    assert_eq!(next, 0.9);
    assert_ne!(next, 1.0 - 0.1 * (0.9 * 1.0 + 1.0)); // 0.81: what merging gives
}

#[test]
fn incompatible_checkpoints_fail_without_changing_anything() {
    let dir = tempfile::tempdir().unwrap();
    let h = Hyper::new(Kind::Adam);
    let model = Model::new(&[("a", &[4]), ("b", &[2, 2]), ("c", &[3])]);
    let mut saved = refopt::optimizer_for(&model, &h, 2);
    let mut m = model.clone();
    refopt::step(&mut m, &mut saved, &h, Storage::F32, 1);
    saved
        .save(dir.path(), &[], &SaveOptions::default())
        .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();

    let mut live_model = model.clone();
    let mut cases: Vec<(&str, OptimizerState)> = Vec::new();
    let one_group = refopt::optimizer_for(&model, &h, 1);
    cases.push(("parameter group(s)", one_group));
    let mut moved = refopt::optimizer_for(&model, &h, 2);
    let p = moved.groups[0].params.pop().unwrap();
    moved.groups[1].params.push(p);
    cases.push(("that the optimizer's lacks", moved));
    let mut renamed = refopt::optimizer_for(&model, &h, 2);
    renamed.groups[0].params[0].name = "zzz".into();
    cases.push(("parameter", renamed));
    let mut reshaped = refopt::optimizer_for(&model, &h, 2);
    reshaped.groups[0].params[0].shape = vec![2, 2];
    cases.push(("shape", reshaped));
    for (what, mut live) in cases {
        for s in 1..=2 {
            refopt::step(&mut live_model, &mut live, &h, Storage::BF16, s);
        }
        let snapshot = live.clone();
        let err = live.restore_from(&ck, &StateLayout::default()).unwrap_err();
        assert!(
            matches!(err, Error::IncompatibleState { .. }),
            "{what}: {err}"
        );
        assert!(err.to_string().contains(what), "{what}: {err}");
        refopt::state_bit_eq(&live, &snapshot).unwrap();
    }
}

/// Rewrite the optimizer section of a checkpoint's manifest (recomputing the CRC trailer).
fn edit_section(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("ckpt-manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v["optimizer"]);
    let m: ckptstore::format::manifest::Manifest = serde_json::from_value(v).unwrap();
    std::fs::write(&p, ckptstore::format::manifest::encode(&m)).unwrap();
}

#[test]
fn bad_optimizer_sections_name_parameter_and_state_and_change_nothing() {
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "missing tensor",
            |o| o["params"][0]["state"][0]["tensor"] = "nope".into(),
            "a",
            "does not hold",
        ),
        (
            "shape",
            |o| o["params"][0]["state"][1]["tensor"] = "optim/b/exp_avg".into(),
            "a",
            "fits neither",
        ),
        (
            "scale is the codes",
            |o| o["params"][1]["state"][0]["scale"] = "optim/b/exp_avg".into(),
            "b",
            "referenced twice",
        ),
        (
            "scale shape",
            |o| o["params"][1]["state"][0]["scale"] = "optim/b/exp_avg_sq".into(),
            "b",
            "must be F32 of shape",
        ),
        (
            "codes not f16",
            |o| o["params"][0]["state"][0]["encoding"] = "f16_scaled".into(),
            "a",
            "no scale",
        ),
        (
            "overlap",
            |o| o["groups"][1]["params"] = serde_json::json!(["b", "a"]),
            "a",
            "more than one group",
        ),
        (
            "unknown param",
            |o| o["groups"][0]["params"] = serde_json::json!(["a", "q"]),
            "",
            "named by",
        ),
        (
            "plain with scale",
            |o| o["params"][0]["state"][0]["scale"] = "optim/a/step".into(),
            "a",
            "plain state has a scale",
        ),
    ];
    for (what, edit, param, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let h = Hyper::new(Kind::Adam);
        let model = Model::new(&[("a", &[3]), ("b", &[5])]);
        let mut saved = refopt::optimizer_for(&model, &h, 2);
        let mut m = model.clone();
        refopt::step(&mut m, &mut saved, &h, Storage::F32, 1);
        // b's exp_avg as F16-scaled, so its state has a scale.
        let x = saved.state["b"]["exp_avg"].to_f32().unwrap();
        saved.state.get_mut("b").unwrap().insert(
            "exp_avg".into(),
            StateValue::f16_scaled_from_f32(&[5], &x, ScaleShape::One).unwrap(),
        );
        saved
            .save(
                dir.path(),
                &refopt::model_refs(&model),
                &SaveOptions::default(),
            )
            .unwrap();
        edit_section(dir.path(), edit);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let mut live = refopt::optimizer_for(&model, &h, 2);
        refopt::step(&mut m, &mut live, &h, Storage::F32, 1);
        let snapshot = live.clone();
        let err = live.restore_from(&ck, &StateLayout::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(want), "{what}: {want:?} not in {msg}");
        if !param.is_empty() {
            assert!(
                msg.contains(&format!("parameter {param:?}")),
                "{what}: {msg}"
            );
        }
        refopt::state_bit_eq(&live, &snapshot).unwrap();
    }
}

#[test]
fn damaged_state_bytes_fail_the_restore_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (model, opt) = fp32_adam();
    opt.save(dir.path(), &refopt::model_refs(&model), &small_opts())
        .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let t = ck.info("optim/big/exp_avg_sq").unwrap().clone();
    let file = dir.path().join(&ck.shards()[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[t.offsets[0] as usize + 100] ^= 4;
    std::fs::write(&file, &bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut live = opt.clone();
    live.state.insert("extra".into(), BTreeMap::new());
    let snapshot = live.clone();
    let err = live
        .restore_from(&ck, &f16_layout(ScaleShape::Keep))
        .unwrap_err();
    assert!(
        matches!(err, Error::ChecksumMismatch { ref what, .. } if what.contains("optim/big/exp_avg_sq")),
        "{err}"
    );
    assert_eq!(live, snapshot);
}

#[test]
fn checkpoint_without_optimizer_section_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let v = [1f32];
    ckptstore::save(
        dir.path(),
        &[ckptstore::TensorRef::from_slice("w", &[1], &v)],
        &SaveOptions::default(),
    )
    .unwrap();
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .load_optimizer(&StateLayout::default())
        .unwrap_err();
    assert!(err.to_string().contains("no optimizer state"), "{err}");
}

#[test]
fn orphan_state_is_refused_at_save() {
    let dir = tempfile::tempdir().unwrap();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("p", &[2])],
        hyper: Default::default(),
    }]);
    opt.state.insert(
        "q".into(),
        [("m".to_string(), StateValue::Plain(Tensor::scalar_f32(1.0)))].into(),
    );
    let err = opt
        .save(dir.path(), &[], &SaveOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("no group names"), "{err}");
    assert!(!dir.path().join("ckpt-manifest.json").exists());
}
