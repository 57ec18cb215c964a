//! The fast load paths (one fused pass per tensor, the absmax recorded at save time, the
//! SIMD scaled kernel, pooled destinations) against the slow ones and the reference
//! formulas, bit for bit; and every way they can be lied to.

#[path = "common/manifest_edit.rs"]
mod manifest_edit;

use std::path::Path;

use ckptstore::convert::reference;
use ckptstore::optim::{
    BufferPool, OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout, StateValue, Target,
    Tensor,
};
use ckptstore::{Checkpoint, Error, SaveOptions};
use manifest_edit::rewrite_manifest;

/// Sizes that cover the SIMD tail (not a multiple of 8), several fused chunks (16,384
/// elements each) with a partial last one, a 0-dim state and an empty one.
const SIZES: &[&[u64]] = &[&[], &[0], &[3], &[8, 9], &[70_001], &[2, 16_384]];

fn values(k: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i as f32) * 0.618 + k as f32).sin() * 10f32.powi((k % 7) as i32 - 3);
            if i % 97 == 5 {
                -x * 3.0 // the absmax is sometimes negative
            } else {
                x
            }
        })
        .collect()
}

fn state() -> OptimizerState {
    let params: Vec<ParamSpec> = SIZES
        .iter()
        .enumerate()
        .map(|(k, s)| ParamSpec::new(format!("p{k}"), s))
        .collect();
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: params.clone(),
        hyper: Default::default(),
    }]);
    for (k, p) in params.iter().enumerate() {
        let n = p.shape.iter().product::<u64>() as usize;
        let mut st = std::collections::BTreeMap::new();
        for (j, name) in ["exp_avg", "exp_avg_sq"].iter().enumerate() {
            let v = values(2 * k + j, n);
            st.insert(
                name.to_string(),
                StateValue::Plain(Tensor::from_slice(&p.shape, &v).unwrap()),
            );
        }
        st.insert("step".into(), StateValue::Plain(Tensor::scalar_f32(3.0)));
        opt.state.insert(p.name.clone(), st);
    }
    opt
}

fn save(dir: &Path, opt: &OptimizerState) {
    let opts = SaveOptions {
        max_shard_size: 256 << 10,
        ..Default::default()
    };
    opt.save(dir, &[], &opts).unwrap();
}

fn layouts() -> Vec<(&'static str, StateLayout)> {
    let l = |t| {
        StateLayout::default()
            .state("exp_avg", t)
            .state("exp_avg_sq", t)
    };
    vec![
        ("as stored", StateLayout::default()),
        ("f16 scaled [1]", l(Target::F16Scaled(ScaleShape::One))),
        ("f16 scaled 0-dim", l(Target::F16Scaled(ScaleShape::Scalar))),
        ("bf16", l(Target::BF16)),
        ("f32", l(Target::F32)),
    ]
}

fn bits_equal(a: &OptimizerState, b: &OptimizerState) -> bool {
    a.groups == b.groups
        && a.state.len() == b.state.len()
        && a.state.iter().all(|(p, sa)| {
            let sb = &b.state[p];
            sa.len() == sb.len()
                && sa.iter().all(|(n, va)| match (va, &sb[n]) {
                    (StateValue::Plain(x), StateValue::Plain(y)) => x.bit_eq(y),
                    (
                        StateValue::F16Scaled { q, scale },
                        StateValue::F16Scaled { q: q2, scale: s2 },
                    ) => q.bit_eq(q2) && scale.bit_eq(s2),
                    _ => false,
                })
        })
}

#[test]
fn absmax_is_recorded_exactly_for_finite_f32_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let x = [1.5f32, -7.25, 0.1, -0.0];
    let zeros = [0f32, -0.0];
    let nan = [1f32, f32::NAN];
    let inf = [f32::NEG_INFINITY, 2.0];
    let h = [half::f16::from_f32(3.0)];
    let tiny = [f32::from_bits(1), -f32::from_bits(3)];
    ckptstore::save(
        dir.path(),
        &[
            ckptstore::TensorRef::from_slice("x", &[4], &x),
            ckptstore::TensorRef::from_slice("zeros", &[2], &zeros),
            ckptstore::TensorRef::from_slice("nan", &[2], &nan),
            ckptstore::TensorRef::from_slice("inf", &[2], &inf),
            ckptstore::TensorRef::from_slice("h", &[1], &h),
            ckptstore::TensorRef::from_slice("tiny", &[2], &tiny),
        ],
        &SaveOptions::default(),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let absmax = |n: &str| ck.info(n).unwrap().absmax.map(f32::to_bits);
    assert_eq!(absmax("x"), Some(7.25f32.to_bits()));
    assert_eq!(absmax("zeros"), Some(0)); // +0, never -0
    assert_eq!(absmax("nan"), None);
    assert_eq!(absmax("inf"), None);
    // F32 only.
    assert_eq!(absmax("h"), None);
    // Subnormals are exact too.
    assert_eq!(absmax("tiny"), Some(3));
    // Written as the exact decimal of the FP32 value: any JSON reader gets it back.
    let m = std::fs::read_to_string(dir.path().join("ckpt-manifest.json")).unwrap();
    assert!(m.contains("\"absmax\":7.25"), "{m}");
    // 3 x 2^-149 widened to f64 and printed shortest: exact, not FP32's shortest "4e-45".
    assert!(m.contains("\"absmax\":4.203895392974451e-45"), "{m}");
    ck.verify().unwrap();
}

#[test]
fn fast_paths_agree_with_slow_paths_and_the_reference_bit_for_bit() {
    let root = tempfile::tempdir().unwrap();
    let (with, without) = (root.path().join("with"), root.path().join("without"));
    let opt = state();
    save(&with, &opt);
    save(&without, &opt);
    // The same checkpoint without recorded absmax: loads take the two-pass path.
    rewrite_manifest(&without, |v| {
        for t in v["tensors"].as_array_mut().unwrap() {
            t.as_object_mut().unwrap().remove("absmax");
        }
    });
    let ck = Checkpoint::open(&with).unwrap();
    let ck2 = Checkpoint::open(&without).unwrap();
    assert!(ck.tensors().iter().any(|t| t.absmax.is_some()));
    assert!(ck2.tensors().iter().all(|t| t.absmax.is_none()));
    let pool = BufferPool::new(usize::MAX);
    for (what, layout) in layouts() {
        let fresh = ck.load_optimizer(&layout).unwrap();
        let slow = ck2.load_optimizer(&layout).unwrap();
        assert!(bits_equal(&fresh, &slow), "{what}: one pass != two passes");
        // Pooled: the first load fills the pool when dropped, the second reuses it.
        drop(
            ck.load_optimizer_opts(
                &layout,
                &ckptstore::optim::LoadOptions::default().pool(&pool),
            )
            .unwrap(),
        );
        let hits = pool.stats().hits;
        let pooled = ck
            .load_optimizer_opts(
                &layout,
                &ckptstore::optim::LoadOptions::default().pool(&pool),
            )
            .unwrap();
        assert!(bits_equal(&fresh, &pooled), "{what}: pooled != fresh");
        if what != "as stored" {
            assert!(pool.stats().hits > hits, "{what}: the pool was not reused");
        }
    }
    // And the F16-scaled result is the reference formula on the original values.
    let got = ck
        .load_optimizer(
            &StateLayout::default().state("exp_avg", Target::F16Scaled(ScaleShape::One)),
        )
        .unwrap();
    for (p, st) in &opt.state {
        let StateValue::Plain(src) = &st["exp_avg"] else {
            unreachable!()
        };
        let (rq, rs) = reference::f32_to_f16_scaled(src.as_slice::<f32>().unwrap()).unwrap();
        let StateValue::F16Scaled { q, scale } = &got.state[p]["exp_avg"] else {
            panic!("{p}: not scaled")
        };
        assert_eq!(q.as_slice::<half::f16>().unwrap(), &rq[..], "{p}");
        assert_eq!(
            scale.as_slice::<f32>().unwrap()[0].to_bits(),
            rs.to_bits(),
            "{p}"
        );
        assert_eq!(scale.shape(), &[1]);
    }
}

#[test]
fn a_wrong_recorded_absmax_is_refused_by_load_and_verify() {
    let opt = state();
    for factor in [2.0f32, 0.5] {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), &opt);
        let mut victim = String::new();
        rewrite_manifest(dir.path(), |v| {
            for t in v["tensors"].as_array_mut().unwrap() {
                if t["name"].as_str().unwrap().contains("exp_avg_sq")
                    && t["shape"] == serde_json::json!([70001])
                {
                    let a = t["absmax"].as_f64().unwrap() as f32 * factor;
                    t["absmax"] = f64::from(a).into();
                    victim = t["name"].as_str().unwrap().to_string();
                }
            }
        });
        assert!(!victim.is_empty());
        let ck = Checkpoint::open(dir.path()).unwrap();
        let layout = StateLayout::default().state("exp_avg_sq", Target::F16Scaled(ScaleShape::One));
        let pool = BufferPool::new(usize::MAX);
        match ck.load_optimizer_opts(
            &layout,
            &ckptstore::optim::LoadOptions::default().pool(&pool),
        ) {
            Err(Error::AbsmaxMismatch {
                tensor,
                recorded,
                actual,
                file,
                ..
            }) => {
                assert_eq!(tensor, victim);
                assert_eq!(recorded * (1.0 / factor), actual, "factor {factor}");
                assert!(file.ends_with(".safetensors"));
            }
            other => panic!("factor {factor}: {other:?}"),
        }
        // Whatever the failed load took went back to the pool.
        let s = pool.stats();
        assert_eq!(s.retained_bytes > 0, s.misses > 0);
        match ck.verify() {
            Err(Error::AbsmaxMismatch { tensor, .. }) => assert_eq!(tensor, victim),
            other => panic!("verify, factor {factor}: {other:?}"),
        }
        // Targets that do not scale do not use the absmax: they still load, exactly.
        let f32s = ck
            .load_optimizer(&StateLayout::default().state("exp_avg_sq", Target::F32))
            .unwrap();
        assert!(bits_equal(&f32s, &opt));
    }
}

#[test]
fn damaged_bytes_fail_every_fused_path_with_the_tensor_named() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), &state());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let t = ck
        .tensors()
        .iter()
        .find(|t| t.shape == [70_001] && t.name.contains("exp_avg"))
        .unwrap()
        .clone();
    drop(ck);
    let file = dir
        .path()
        .join(&Checkpoint::open(dir.path()).unwrap().shards()[t.shard].file);
    // Flip one bit near the end of the tensor: in the last, partial fused chunk.
    let mut bytes = std::fs::read(&file).unwrap();
    let at = t.offsets[1] as usize - 5;
    bytes[at] ^= 0x10;
    // Replace the file (the mmap contract forbids editing it in place).
    let tmp = dir.path().join("tmp");
    std::fs::write(&tmp, &bytes).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let pool = BufferPool::new(usize::MAX);
    for (what, layout) in layouts() {
        for r in [
            ck.load_optimizer(&layout),
            ck.load_optimizer_opts(
                &layout,
                &ckptstore::optim::LoadOptions::default().pool(&pool),
            ),
        ] {
            match r {
                Err(Error::ChecksumMismatch { what: w, .. }) => {
                    assert!(w.contains(&t.name), "{what}: {w}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
    }
}
