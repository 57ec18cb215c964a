//! Optimizer state stored as global tensors (chunked like FSDP / ZeRO shards) and loaded by
//! M ranks, each its own partition: the same layouts and TransformerEngine arithmetic as a
//! whole load, applied to each rank's region; full replacement, all or nothing.
//!
//! The chunked checkpoints are built independently of the multi-rank writer: chunk tensors
//! saved as ordinary tensors, then `globals` and the optimizer section written into the
//! manifest by hand (with a correct CRC).

#[path = "common/manifest_edit.rs"]
mod manifest_edit;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use ckptstore::optim::{
    OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout, StateValue, Target, Tensor,
};
use ckptstore::{save, Checkpoint, Error, Region, SaveOptions, TensorRef};

const ROWS: u64 = 9;
const COLS: u64 = 4;

/// Element `i` of state `k`: smooth Adam-like values of a per-state range.
fn value(k: u32, i: u64) -> f32 {
    ((i as f32 * 0.37 + k as f32).sin()) * (1.0 + k as f32) * 1e-3
}

fn global_values(k: u32) -> Vec<f32> {
    (0..ROWS * COLS).map(|i| value(k, i)).collect()
}

/// Rows `[r0, r0 + n)` of a row-major `[ROWS, COLS]` global.
fn rows(g: &[f32], r0: u64, n: u64) -> Vec<f32> {
    g[(r0 * COLS) as usize..((r0 + n) * COLS) as usize].to_vec()
}

/// `w` of shape `[ROWS, COLS]` with Adam state: `exp_avg` chunked in rows at `cuts`,
/// `exp_avg_sq` stored whole, `step` a scalar; saved as if by `saved_by` ranks.
fn save_sharded_state(dir: &Path, cuts: &[u64]) {
    let (m, v) = (global_values(1), global_values(2));
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(ROWS);
    let chunks: Vec<(u64, u64, Vec<f32>)> = bounds
        .windows(2)
        .map(|w| (w[0], w[1] - w[0], rows(&m, w[0], w[1] - w[0])))
        .collect();
    let names: Vec<String> = chunks
        .iter()
        .map(|(r0, _, _)| format!("optim/w/exp_avg@{r0},0"))
        .collect();
    let step = [7.0f32];
    let weight = vec![0.5f32; (ROWS * COLS) as usize];
    let mut refs: Vec<TensorRef<'_>> = chunks
        .iter()
        .zip(&names)
        .map(|((_, n, d), name)| TensorRef::from_slice(name.as_str(), &[*n, COLS], d))
        .collect();
    refs.push(TensorRef::from_slice(
        "optim/w/exp_avg_sq",
        &[ROWS, COLS],
        &v,
    ));
    refs.push(TensorRef::from_slice("optim/w/step", &[], &step));
    refs.push(TensorRef::from_slice("w", &[ROWS, COLS], &weight));
    save(dir, &refs, &SaveOptions::default()).unwrap();
    manifest_edit::rewrite_manifest(dir, |j| {
        let cj: Vec<serde_json::Value> = chunks
            .iter()
            .zip(&names)
            .map(|((r0, n, _), name)| {
                serde_json::json!({"offsets": [r0, 0], "shape": [n, COLS], "tensor": name})
            })
            .collect();
        j["features"] = serde_json::json!(["optimizer", "global"]);
        j["globals"] = serde_json::json!([{
            "name": "optim/w/exp_avg", "dtype": "F32", "global_shape": [ROWS, COLS], "chunks": cj
        }]);
        j["optimizer"] = serde_json::json!({
            "groups": [{"params": ["w"], "hyper": {"lr": 0.001}}],
            "params": [{"name": "w", "shape": [ROWS, COLS], "state": [
                {"name": "exp_avg", "tensor": "optim/w/exp_avg", "encoding": "plain"},
                {"name": "exp_avg_sq", "tensor": "optim/w/exp_avg_sq", "encoding": "plain"},
                {"name": "step", "tensor": "optim/w/step", "encoding": "plain"}
            ]}]
        });
    });
}

/// The row ranges of `m` ranks splitting `ROWS` unevenly (the first ranks take one more).
fn row_split(m: u64) -> Vec<(u64, u64)> {
    let (q, r) = (ROWS / m, ROWS % m);
    let mut at = 0;
    (0..m)
        .map(|k| {
            let n = q + u64::from(k < r);
            let out = (at, n);
            at += n;
            out
        })
        .collect()
}

fn f32s(v: &StateValue) -> Vec<f32> {
    match v {
        StateValue::Plain(t) => t.as_slice::<f32>().unwrap().to_vec(),
        _ => panic!("not plain"),
    }
}

#[test]
fn m_ranks_restore_n_rank_state_in_every_layout() {
    let (m_all, v_all) = (global_values(1), global_values(2));
    for cuts in [vec![], vec![4], vec![2, 5, 8]] {
        let dir = tempfile::tempdir().unwrap();
        save_sharded_state(dir.path(), &cuts);
        let ck = Checkpoint::open(dir.path()).unwrap();
        ck.verify().unwrap();
        // A whole load assembles the chunked state.
        let whole = ck.load_optimizer(&StateLayout::default()).unwrap();
        assert_eq!(f32s(&whole.state["w"]["exp_avg"]), m_all);
        assert_eq!(f32s(&whole.state["w"]["exp_avg_sq"]), v_all);
        for m in 1..=4 {
            for (r0, n) in row_split(m) {
                let part: HashMap<String, Region> =
                    [("w".to_string(), Region::new(&[r0, 0], &[n, COLS]))].into();
                let (em, ev) = (rows(&m_all, r0, n), rows(&v_all, r0, n));
                // As stored: exactly the rank's rows; step whole; local shapes.
                let st = ck
                    .load_optimizer_partition(&StateLayout::default(), &part)
                    .unwrap();
                assert_eq!(st.groups[0].params[0].shape, vec![n, COLS]);
                assert_eq!(f32s(&st.state["w"]["exp_avg"]), em, "cuts {cuts:?} m {m}");
                assert_eq!(f32s(&st.state["w"]["exp_avg_sq"]), ev);
                assert_eq!(f32s(&st.state["w"]["step"]), vec![7.0]);
                // F16-scaled: the TE formula on the rank's own region, scale per rank.
                let fused = StateLayout::with_default(Target::F16Scaled(ScaleShape::One));
                let st = ck.load_optimizer_partition(&fused, &part).unwrap();
                for (k, want) in [("exp_avg", &em), ("exp_avg_sq", &ev)] {
                    let reference =
                        StateValue::f16_scaled_from_f32(&[n, COLS], want, ScaleShape::One).unwrap();
                    assert!(
                        st.state["w"][k].bit_eq(&reference),
                        "{k} cuts {cuts:?} m {m}"
                    );
                }
                assert!(matches!(st.state["w"]["step"], StateValue::Plain(_)));
                // BF16: the plain cast of the region.
                let bf = ck
                    .load_optimizer_partition(&StateLayout::with_default(Target::BF16), &part)
                    .unwrap();
                let mut want = vec![half::bf16::ZERO; em.len()];
                ckptstore::convert::f32_to_bf16(&em, &mut want);
                let StateValue::Plain(t) = &bf.state["w"]["exp_avg"] else {
                    panic!()
                };
                assert_eq!(t.as_slice::<half::bf16>().unwrap(), &want[..]);
            }
        }
    }
}

#[test]
fn partition_restore_replaces_stale_state_and_refuses_bad_partitions() {
    let dir = tempfile::tempdir().unwrap();
    save_sharded_state(dir.path(), &[3, 6]);
    let ck = Checkpoint::open(dir.path()).unwrap();
    // A rank's live optimizer (rows 3..6) holding stale state for a parameter the
    // checkpoint does not name, and stale momentum for w: after the restore, only the
    // checkpoint's state remains (the ColossalAI scenario, per rank).
    let groups = vec![ParamGroup {
        params: vec![ParamSpec::new("w", &[3, COLS])],
        hyper: Default::default(),
    }];
    let mut live = OptimizerState::new(groups);
    let stale = Tensor::from_slice(&[3, COLS], &[9.0f32; 12]).unwrap();
    live.state.insert(
        "w".into(),
        BTreeMap::from([
            ("exp_avg".to_string(), StateValue::Plain(stale.clone())),
            ("ghost".to_string(), StateValue::Plain(stale)),
        ]),
    );
    let part: HashMap<String, Region> =
        [("w".to_string(), Region::new(&[3, 0], &[3, COLS]))].into();
    live.restore_from_partition(&ck, &StateLayout::default(), &part)
        .unwrap();
    assert!(!live.state["w"].contains_key("ghost"));
    assert_eq!(
        f32s(&live.state["w"]["exp_avg"]),
        rows(&global_values(1), 3, 3)
    );
    // Bad partitions fail and change nothing.
    let snapshot = live.clone();
    for (bad, want) in [
        (("w", Region::new(&[7, 0], &[3, COLS])), "does not fit"),
        (("w", Region::new(&[0], &[3])), "does not fit"),
        (("nope", Region::new(&[0, 0], &[1, 1])), "does not have"),
    ] {
        let p: HashMap<String, Region> = [(bad.0.to_string(), bad.1)].into();
        let e = live
            .restore_from_partition(&ck, &StateLayout::default(), &p)
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(want),
            "{e}"
        );
        assert_eq!(live, snapshot);
    }
    // A region of another shape than the live parameter's: incompatible, unchanged.
    let p: HashMap<String, Region> = [("w".to_string(), Region::new(&[0, 0], &[4, COLS]))].into();
    let e = live
        .restore_from_partition(&ck, &StateLayout::default(), &p)
        .unwrap_err();
    assert!(matches!(e, Error::IncompatibleState { .. }), "{e}");
    assert_eq!(live, snapshot);
    // A damaged chunk: the partition that reads it fails naming it; others still load.
    let t = ck.info("optim/w/exp_avg@6,0").unwrap().clone();
    let path = dir.path().join(&ck.shards()[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[t.offsets[0] as usize] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    live.restore_from_partition(&ck, &StateLayout::default(), &part)
        .unwrap();
    let p: HashMap<String, Region> = [("w".to_string(), Region::new(&[5, 0], &[3, COLS]))].into();
    let mut other = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("w", &[3, COLS])],
        hyper: Default::default(),
    }]);
    let e = other
        .restore_from_partition(&ck, &StateLayout::default(), &p)
        .unwrap_err();
    assert!(e.to_string().contains("exp_avg@6,0"), "{e}");
    assert!(other.state.is_empty());
}

/// N ranks save the state through the multi-rank writer (each its rows of `exp_avg` and
/// `exp_avg_sq`, `step` replicated), the coordinator commits with the optimizer section;
/// M ranks restore their partitions in every layout.
#[test]
fn n_ranks_save_sharded_adam_state_m_ranks_restore_it() {
    use ckptstore::commit;
    use ckptstore::format::manifest::OptimizerSection;
    use ckptstore::write::parts::{new_checkpoint_id, CommitOptions, PartItem};
    use ckptstore::write_part;
    let (m_all, v_all) = (global_values(1), global_values(2));
    let section: OptimizerSection = serde_json::from_value(serde_json::json!({
        "groups": [{"params": ["w"], "hyper": {"lr": 0.001}}],
        "params": [{"name": "w", "shape": [ROWS, COLS], "state": [
            {"name": "exp_avg", "tensor": "optim/w/exp_avg", "encoding": "plain"},
            {"name": "exp_avg_sq", "tensor": "optim/w/exp_avg_sq", "encoding": "plain"},
            {"name": "step", "tensor": "optim/w/step", "encoding": "plain"}
        ]}]
    }))
    .unwrap();
    let layouts = [
        ckptstore::write::parts::Layout::Flat,
        ckptstore::write::parts::Layout::TwoLevel,
    ];
    for (n, layout) in (1..=4u64).flat_map(|n| layouts.map(|l| (n, l))) {
        let dir = tempfile::tempdir().unwrap();
        let id = new_checkpoint_id().unwrap();
        let step = [7.0f32];
        let parts: Vec<_> = row_split(n)
            .into_iter()
            .enumerate()
            .map(|(rank, (r0, rows_n))| {
                let (m, v) = (rows(&m_all, r0, rows_n), rows(&v_all, r0, rows_n));
                fn chunk<'a>(
                    name: &'static str,
                    d: &'a [f32],
                    r0: u64,
                    rows_n: u64,
                ) -> PartItem<'a> {
                    PartItem::Chunk {
                        tensor: TensorRef::from_slice(name, &[rows_n, COLS], d),
                        global_shape: vec![ROWS, COLS],
                        offsets: vec![r0, 0],
                    }
                }
                let items = [
                    chunk("optim/w/exp_avg", &m, r0, rows_n),
                    chunk("optim/w/exp_avg_sq", &v, r0, rows_n),
                    PartItem::Chunk {
                        tensor: TensorRef::from_slice("optim/w/step", &[], &step),
                        global_shape: vec![],
                        offsets: vec![],
                    },
                ];
                write_part(
                    dir.path(),
                    &id,
                    rank as u32,
                    &items,
                    &SaveOptions::default(),
                )
                .unwrap()
            })
            .collect();
        let opts = CommitOptions {
            optimizer: Some(section.clone()),
            layout,
            ..Default::default()
        };
        commit(dir.path(), &id, &parts, &opts).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(
            ck.catalog().two_level(),
            layout == ckptstore::write::parts::Layout::TwoLevel
        );
        ck.verify().unwrap();
        // A whole load assembles the chunked state (two-level: from every part).
        let whole = ck.load_optimizer(&StateLayout::default()).unwrap();
        assert_eq!(
            f32s(&whole.state["w"]["exp_avg"]),
            m_all,
            "n {n} {layout:?}"
        );
        assert_eq!(f32s(&whole.state["w"]["exp_avg_sq"]), v_all);
        for m in 1..=4 {
            for (r0, rn) in row_split(m) {
                let part: HashMap<String, Region> =
                    [("w".to_string(), Region::new(&[r0, 0], &[rn, COLS]))].into();
                let st = ck
                    .load_optimizer_partition(&StateLayout::default(), &part)
                    .unwrap();
                assert_eq!(
                    f32s(&st.state["w"]["exp_avg"]),
                    rows(&m_all, r0, rn),
                    "n {n} m {m}"
                );
                assert_eq!(f32s(&st.state["w"]["exp_avg_sq"]), rows(&v_all, r0, rn));
                assert_eq!(f32s(&st.state["w"]["step"]), vec![7.0]);
                let fused = StateLayout::with_default(Target::F16Scaled(ScaleShape::One));
                let st = ck.load_optimizer_partition(&fused, &part).unwrap();
                let want = StateValue::f16_scaled_from_f32(
                    &[rn, COLS],
                    &rows(&m_all, r0, rn),
                    ScaleShape::One,
                )
                .unwrap();
                assert!(st.state["w"]["exp_avg"].bit_eq(&want));
            }
        }
    }
    // A section naming a tensor the parts do not hold: refused, nothing committed.
    let dir = tempfile::tempdir().unwrap();
    let id = new_checkpoint_id().unwrap();
    let x = [1.0f32; 4];
    let p = write_part(
        dir.path(),
        &id,
        0,
        &[PartItem::Whole(TensorRef::from_slice("other", &[4], &x))],
        &SaveOptions::default(),
    )
    .unwrap();
    let opts = CommitOptions {
        optimizer: Some(section),
        ..Default::default()
    };
    let e = commit(dir.path(), &id, &[p], &opts).unwrap_err();
    assert!(matches!(e, Error::InvalidOptimizerState { .. }), "{e}");
    assert!(Checkpoint::open(dir.path()).is_err());
}
