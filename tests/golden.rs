//! Golden vectors: small checkpoints committed in tests/golden/, generated once by this
//! file (`CKPT_REGEN_GOLDEN=1 cargo test --test golden`) and decoded forever after, so
//! that a change to the format or the reader that breaks old checkpoints fails here.
//! tests/golden/README.md says what each holds.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ckptstore::optim::{
    OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout, StateValue, Target, Tensor,
};
use ckptstore::{Checkpoint, DType, SaveOptions, TensorRef};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn weights() -> Vec<f32> {
    (0..24).map(|i| i as f32 * 0.25 - 3.0).collect()
}

fn state() -> OptimizerState {
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("w", &[4, 6]), ParamSpec::new("t", &[])],
        hyper: serde_json::json!({"lr": 0.001, "betas": [0.9, 0.999]})
            .as_object()
            .unwrap()
            .clone(),
    }]);
    let m: Vec<f32> = (0..24).map(|i| (i as f32 - 12.0) * 1e-3).collect();
    let mut w = BTreeMap::new();
    w.insert(
        "step".to_string(),
        StateValue::Plain(Tensor::scalar_f32(5.0)),
    );
    w.insert(
        "exp_avg".to_string(),
        StateValue::f16_scaled_from_f32(&[4, 6], &m, ScaleShape::One).unwrap(),
    );
    w.insert(
        "exp_avg_sq".to_string(),
        StateValue::Plain(Tensor::from_slice(&[4, 6], &m).unwrap()),
    );
    opt.state.insert("w".into(), w);
    opt
}

fn generate() {
    let dir = golden("v1-optimizer");
    let _ = std::fs::remove_dir_all(&dir);
    let w = weights();
    let ids: Vec<i64> = vec![-1, 0, 1 << 40];
    let mask = [1u8, 0, 1];
    state()
        .save(
            &dir,
            &[
                TensorRef::from_slice("w", &[4, 6], &w),
                TensorRef::from_slice("ids", &[3], &ids),
                TensorRef::new("mask", DType::Bool, &[3], &mask),
                TensorRef::from_slice("t", &[], &[0.5f32]),
            ],
            &SaveOptions {
                max_shard_size: 128,
                metadata: serde_json::json!({"golden": "v1"}),
                ..Default::default()
            },
        )
        .unwrap();
    std::fs::remove_file(dir.join(".ckpt-lock")).unwrap();
}

#[test]
fn version_1_checkpoint_still_decodes() {
    if std::env::var_os("CKPT_REGEN_GOLDEN").is_some() {
        generate();
    }
    let dir = golden("v1-optimizer");
    let ck = Checkpoint::open(&dir).unwrap();
    let rep = ck.verify().unwrap();
    assert_eq!(rep.tensors, 4 + 4); // w, ids, mask, t; step, exp_avg + scale, exp_avg_sq
    assert!(ck.shards().len() >= 2);
    assert_eq!(ck.metadata()["golden"], "v1");
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &weights()[..]
    );
    assert_eq!(
        ck.read("ids")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[-1, 0, 1 << 40]
    );
    assert_eq!(
        ck.read("mask").view_unchecked().unwrap().bytes(),
        &[1, 0, 1]
    );
    assert_eq!(
        ck.read("t").view_unchecked().unwrap().shape(),
        &[] as &[u64]
    );
    // The optimizer state loads back exactly as it was saved.
    let loaded = ck.load_optimizer(&StateLayout::default()).unwrap();
    assert_eq!(loaded, state());
    // And converts: FP16-scaled exp_avg to F32 follows the formula.
    let f = ck
        .load_optimizer(&StateLayout::default().state("exp_avg", Target::F32))
        .unwrap();
    assert_eq!(
        f.state["w"]["exp_avg"].to_f32().unwrap(),
        state().state["w"]["exp_avg"].to_f32().unwrap()
    );
}
