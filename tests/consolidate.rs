//! `ckpt consolidate` (format-spec/global.md §Consolidate): a 2-rank checkpoint with global
//! tensors, built in-process with `write::parts`, is consolidated through the real binary;
//! the destination must hold every global whole (bit for bit), the whole tensors, the
//! metadata and an index that stock safetensors readers follow.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output};

use ckptstore::checkpoint::Kind;
use ckptstore::checkpoint::HF_INDEX_FILE;
use ckptstore::commit;
use ckptstore::optim::{OptimizerStateRef, ParamGroup, ParamSpec, StateValueRef};
use ckptstore::write::is_engine_file;
use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::write_part;
use ckptstore::{Checkpoint, CommitOptions, DType, PartItem, SaveOptions, TensorRef};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt");

fn ckpt(args: &[&str]) -> Output {
    let out = Command::new(BIN).args(args).output().expect("run ckpt");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("panicked"), "ckpt panicked: {all}");
    out
}

fn ok(args: &[&str]) -> String {
    let out = ckpt(args);
    assert!(out.status.success(), "ckpt {args:?} failed: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The global arrays of the source: `w` F32 [6, 4] split by rows (uneven), `e` I64 [4, 6]
/// split by columns, `ln` F32 [8] replicated on both ranks (one chunk covering it, offered
/// twice).
struct Globals {
    w: Vec<f32>,
    e: Vec<i64>,
    ln: Vec<f32>,
}

fn globals() -> Globals {
    Globals {
        w: (0..24).map(|i| (i as f32 * 0.37).sin() * 10.0).collect(),
        e: (0..24).map(|i| i * 1_000_003 - 7).collect(),
        ln: (0..8).map(|i| 1.0 + i as f32 / 8.0).collect(),
    }
}

/// Column `c0..c1` of a row-major [rows, cols] array.
fn cols(a: &[i64], rows: usize, cols: usize, c0: usize, c1: usize) -> Vec<i64> {
    (0..rows)
        .flat_map(|r| a[r * cols + c0..r * cols + c1].iter().copied())
        .collect()
}

/// Whole tensors of the source: `step` (I64 0-dim, rank 0) and `bias` (F32 [4], rank 1).
const STEP: [i64; 1] = [1234];
const BIAS: [f32; 4] = [0.5, -0.25, 3.0, -8.0];

fn chunk<'a>(t: TensorRef<'a>, global_shape: &[u64], offsets: &[u64]) -> PartItem<'a> {
    PartItem::Chunk {
        tensor: t,
        global_shape: global_shape.to_vec(),
        offsets: offsets.to_vec(),
    }
}

/// Write the 2-rank source into `dir` and commit it.
fn two_rank_source(dir: &Path, g: &Globals) {
    let id = new_checkpoint_id().unwrap();
    let e0 = cols(&g.e, 4, 6, 0, 2);
    let e1 = cols(&g.e, 4, 6, 2, 6);
    let r0 = vec![
        chunk(
            TensorRef::from_slice("w", &[4, 4], &g.w[..16]),
            &[6, 4],
            &[0, 0],
        ),
        chunk(TensorRef::from_slice("e", &[4, 2], &e0), &[4, 6], &[0, 0]),
        chunk(TensorRef::from_slice("ln", &[8], &g.ln), &[8], &[0]),
        PartItem::Whole(TensorRef::from_slice("step", &[], &STEP)),
    ];
    let r1 = vec![
        chunk(
            TensorRef::from_slice("w", &[2, 4], &g.w[16..]),
            &[6, 4],
            &[4, 0],
        ),
        chunk(TensorRef::from_slice("e", &[4, 4], &e1), &[4, 6], &[0, 2]),
        chunk(TensorRef::from_slice("ln", &[8], &g.ln), &[8], &[0]),
        PartItem::Whole(TensorRef::from_slice("bias", &[4], &BIAS)),
    ];
    let opts = SaveOptions::default();
    let parts = vec![
        write_part(dir, &id, 0, &r0, &opts).unwrap(),
        write_part(dir, &id, 1, &r1, &opts).unwrap(),
    ];
    let copts = CommitOptions {
        world_size: Some(2),
        metadata: serde_json::json!({"run": "consolidate-test", "step": 1234}),
        ..Default::default()
    };
    commit(dir, &id, &parts, &copts).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(ck.catalog().globals().len(), 3);
}

fn le_bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn read_index(dst: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dst.join(HF_INDEX_FILE)).unwrap()).unwrap()
}

#[test]
fn consolidates_globals_whole_with_an_index_safetensors_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    let g = globals();
    two_rank_source(&src, &g);

    // 64 bytes per shard: several shards, so the index maps tensors to different files.
    let out = ok(&[
        "consolidate",
        s(&src),
        "--out",
        s(&dst),
        "--max-shard-size",
        "64",
    ]);
    assert!(out.contains("5 tensors"), "{out}");
    ok(&["verify", s(&dst)]);

    let ck = Checkpoint::open(&dst).unwrap();
    assert_eq!(
        ck.kind(),
        Kind::Native,
        "the manifest wins over the HF index"
    );
    let m = ck.manifest().unwrap();
    assert!(
        m.features.is_empty(),
        "no `global` feature: {:?}",
        m.features
    );
    assert!(ck.catalog().globals().is_empty());
    assert_eq!(
        m.metadata,
        serde_json::json!({"run": "consolidate-test", "step": 1234})
    );
    let want: BTreeMap<&str, (DType, Vec<u64>, Vec<u8>)> = BTreeMap::from([
        ("w", (DType::F32, vec![6, 4], le_bytes(&g.w))),
        ("e", (DType::I64, vec![4, 6], le_bytes(&g.e))),
        ("ln", (DType::F32, vec![8], le_bytes(&g.ln))),
        ("step", (DType::I64, vec![], le_bytes(&STEP))),
        ("bias", (DType::F32, vec![4], le_bytes(&BIAS))),
    ]);
    let names: BTreeSet<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        want.keys().copied().collect(),
        "no chunk tensor is copied"
    );
    for (name, (dtype, shape, bytes)) in &want {
        let v = ck.read(name).view().unwrap();
        assert_eq!(v.dtype(), *dtype, "{name}");
        assert_eq!(v.shape(), &shape[..], "{name}");
        assert_eq!(
            v.bytes(),
            &bytes[..],
            "{name} differs from the global array"
        );
    }

    // The index: exactly the model tensors (no optimizer section: all of them), each in the
    // shard the manifest names, and their total byte size.
    let index = read_index(&dst);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(
        map.keys().map(|k| k.as_str()).collect::<BTreeSet<_>>(),
        want.keys().copied().collect()
    );
    let total: usize = want.values().map(|(_, _, b)| b.len()).sum();
    assert_eq!(index["metadata"]["total_size"], serde_json::json!(total));
    let files: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(files.len() > 1, "expected several shards: {files:?}");
    for (name, file) in map {
        let t = ck.info(name).unwrap();
        assert_eq!(file.as_str().unwrap(), m.shards[t.shard].file, "{name}");
        // A stock safetensors reader finds the tensor in that file, with the right bytes.
        let raw = std::fs::read(dst.join(file.as_str().unwrap())).unwrap();
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        let v = st.tensor(name).unwrap();
        let (_, shape, bytes) = &want[name.as_str()];
        let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        assert_eq!(v.shape(), &shape[..], "{name}");
        assert_eq!(v.data(), &bytes[..], "{name}");
    }
    assert!(
        !is_engine_file(HF_INDEX_FILE),
        "cleanup must never remove the index"
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".ckpt-tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn consolidating_again_replaces_the_checkpoint_and_its_index() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    two_rank_source(&src, &globals());
    ok(&["consolidate", s(&src), "--out", s(&dst)]);
    let first = read_index(&dst);
    ok(&[
        "consolidate",
        s(&src),
        "--out",
        s(&dst),
        "--max-shard-size",
        "64",
    ]);
    let second = read_index(&dst);
    assert_ne!(
        first, second,
        "the index follows the new checkpoint's shards"
    );
    let ck = Checkpoint::open(&dst).unwrap();
    for (name, file) in second["weight_map"].as_object().unwrap() {
        let t = ck.info(name).unwrap();
        assert_eq!(
            file.as_str().unwrap(),
            ck.manifest().unwrap().shards[t.shard].file
        );
        assert!(dst.join(file.as_str().unwrap()).is_file(), "{file}");
    }
    ok(&["verify", s(&dst)]);

    // A later plain save into DST commits and cleans up (removing the consolidated shards)
    // but leaves the index, which is no engine file: it now names missing shards only, and
    // `open` still reads the new manifest.
    let x = [7.0f32; 2];
    ckptstore::save(
        &dst,
        &[TensorRef::from_slice("x", &[2], &x)],
        &SaveOptions::default(),
    )
    .unwrap();
    assert_eq!(
        read_index(&dst),
        second,
        "cleanup must not remove the index"
    );
    for file in second["weight_map"].as_object().unwrap().values() {
        assert!(!dst.join(file.as_str().unwrap()).exists(), "{file}");
    }
    let ck = Checkpoint::open(&dst).unwrap();
    assert_eq!(ck.kind(), Kind::Native);
    assert_eq!(
        ck.read("x")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &x
    );
}

#[test]
fn optimizer_section_is_carried_and_its_tensors_left_out_of_the_index() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    let w = [1.0f32, 2.0, 3.0, 4.0];
    let exp_avg = [0.5f32, 0.25, 0.125, 0.0625];
    let groups = vec![ParamGroup {
        params: vec![ParamSpec::new("w", &[4])],
        hyper: Default::default(),
    }];
    let state = BTreeMap::from([(
        "w".to_string(),
        BTreeMap::from([(
            "exp_avg".to_string(),
            StateValueRef::Plain(TensorRef::from_slice("", &[4], &exp_avg)),
        )]),
    )]);
    let opt = OptimizerStateRef {
        groups: groups.into(),
        state,
    };
    opt.save(
        &src,
        &[TensorRef::from_slice("w", &[4], &w)],
        &SaveOptions::default(),
    )
    .unwrap();
    ok(&["consolidate", s(&src), "--out", s(&dst)]);
    ok(&["verify", s(&dst)]);
    let a = Checkpoint::open(&src).unwrap();
    let b = Checkpoint::open(&dst).unwrap();
    assert_eq!(
        a.manifest().unwrap().optimizer,
        b.manifest().unwrap().optimizer
    );
    assert!(b.manifest().unwrap().optimizer.is_some());
    let back = b.load_optimizer(&Default::default()).unwrap();
    assert_eq!(back.state["w"]["exp_avg"].to_f32().unwrap(), exp_avg);
    let index = read_index(&dst);
    let listed: Vec<&String> = index["weight_map"].as_object().unwrap().keys().collect();
    assert_eq!(listed, ["w"], "only model tensors are listed");
    assert_eq!(index["metadata"]["total_size"], serde_json::json!(16));
}

#[test]
fn a_damaged_chunk_fails_naming_it_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    two_rank_source(&src, &globals());
    // Flip one byte of rank 1's chunk of `w` in its shard.
    let chunk = "w@4,0~r1";
    let (file, pos) = {
        let ck = Checkpoint::open(&src).unwrap();
        let t = ck.info(chunk).unwrap();
        // `offsets` are absolute in the shard file.
        let file = ck.manifest().unwrap().shards[t.shard].file.clone();
        (file, t.offsets[0] + 3)
    };
    let path = src.join(file);
    let mut raw = std::fs::read(&path).unwrap();
    raw[pos as usize] ^= 0x40;
    std::fs::write(&path, raw).unwrap();

    let out = ckpt(&["consolidate", s(&src), "--out", s(&dst)]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(chunk), "the error names the chunk: {err}");
    assert!(!dst.exists(), "nothing may be written at DST");
}

/// `n` row-sharded F32 globals `g<i>` of `[rows, 1024]` over 2 ranks, each value derived from
/// its global index (so every byte of the result can be checked).
fn big_source(dir: &Path, n: usize, rows: u64) -> Vec<Vec<f32>> {
    let cols = 1024u64;
    let all: Vec<Vec<f32>> = (0..n)
        .map(|g| {
            (0..rows * cols)
                .map(|i| (i as f32) * 0.5 + g as f32 * 1e6)
                .collect()
        })
        .collect();
    let names: Vec<String> = (0..n).map(|g| format!("g{g}")).collect();
    let id = new_checkpoint_id().unwrap();
    let half = (rows / 2 * cols) as usize;
    let parts: Vec<_> = (0..2u32)
        .map(|r| {
            let items: Vec<PartItem<'_>> = all
                .iter()
                .zip(&names)
                .map(|(v, name)| {
                    let (lo, hi) = if r == 0 { (0, half) } else { (half, v.len()) };
                    chunk(
                        TensorRef::from_slice(
                            name.as_str(),
                            &[(hi - lo) as u64 / cols, cols],
                            &v[lo..hi],
                        ),
                        &[rows, cols],
                        &[u64::from(r) * rows / 2, 0],
                    )
                })
                .collect();
            write_part(dir, &id, r, &items, &SaveOptions::default()).unwrap()
        })
        .collect();
    commit(dir, &id, &parts, &CommitOptions::default()).unwrap();
    all
}

/// The peak resident memory `ckpt consolidate` reports.
fn reported_peak(out: &str) -> f64 {
    let tail = out
        .split("peak resident memory ")
        .nth(1)
        .expect("a peak figure");
    let mut it = tail.split_whitespace();
    let v: f64 = it.next().unwrap().parse().unwrap();
    match it.next().unwrap() {
        "KiB" => v / 1024.0,
        "MiB" => v,
        "GiB" => v * 1024.0,
        u => panic!("unit {u}"),
    }
}

/// Issue 25: consolidation streams. 128 MiB of globals (eight of 16 MiB) consolidated with
/// `--memory 16MiB` peak well under the whole checkpoint: one tensor assembled at a time,
/// its source pages released (all at once: the sum of the globals plus their mapped chunks,
/// over 256 MiB). Every value comes back, in several parts committed once.
#[test]
fn consolidation_streams_one_group_at_a_time_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    let want = big_source(&src, 8, 4096);
    let out = ok(&[
        "consolidate",
        s(&src),
        "--out",
        s(&dst),
        "--memory",
        "16MiB",
        "--max-shard-size",
        "32MiB",
    ]);
    let peak = reported_peak(&out);
    eprintln!("consolidate of 128 MiB with --memory 16MiB: peak {peak:.1} MiB");
    // 16 MiB held + 16 MiB of the tensor being written + the binary and its buffers.
    assert!(peak < 112.0, "peak {peak} MiB: {out}");
    let ck = Checkpoint::open(&dst).unwrap();
    ck.verify().unwrap();
    assert!(ck.catalog().globals().is_empty());
    for (g, v) in want.iter().enumerate() {
        let t = ck.read(&format!("g{g}")).view_unchecked().unwrap();
        assert_eq!(t.shape(), &[4096, 1024]);
        assert_eq!(t.as_slice::<f32>().unwrap(), &v[..], "g{g}");
    }
    // One part per 16 MiB group: shards of 8 ranks.
    let m = ck.manifest().unwrap();
    let ranks: BTreeSet<&str> = m
        .shards
        .iter()
        .filter_map(|s| s.file.split('-').nth(2))
        .collect();
    assert_eq!(ranks.len(), 8, "{:?}", m.shards);
}

/// A damaged chunk found after parts were written: exit 1 naming it; the checkpoint DST
/// held is still the committed one, bit for bit, and nothing of the failed consolidation
/// is left in DST.
#[test]
fn a_damaged_chunk_half_way_leaves_the_old_destination_and_no_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    big_source(&src, 4, 512);
    ok(&["consolidate", s(&src), "--out", s(&dst)]);
    let before = Checkpoint::open(&dst).unwrap();
    let old_id = before.manifest().unwrap().checkpoint_id.clone();
    let old: Vec<Vec<u8>> = (0..4)
        .map(|g| {
            before
                .read(&format!("g{g}"))
                .view_unchecked()
                .unwrap()
                .bytes()
                .to_vec()
        })
        .collect();
    drop(before);
    let names_before: BTreeSet<String> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    // Flip one byte of g3's chunk of rank 1 (the last group: g0..g2 are written first).
    let ck = Checkpoint::open(&src).unwrap();
    let chunk_name = ck.catalog().global("g3").unwrap().chunks[1].tensor.clone();
    let info = ck.info(&chunk_name).unwrap().clone();
    let file = src.join(&ck.manifest().unwrap().shards[info.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[info.offsets[0] as usize + 100] ^= 0x10;
    std::fs::write(&file, bytes).unwrap();

    let r = ckpt(&["consolidate", s(&src), "--out", s(&dst), "--memory", "1MiB"]);
    assert_eq!(r.status.code(), Some(1), "{r:?}");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains(&chunk_name) && err.contains("g3"), "{err}");
    let after = Checkpoint::open(&dst).unwrap();
    after.verify().unwrap();
    assert_eq!(after.manifest().unwrap().checkpoint_id, old_id);
    for (g, b) in old.iter().enumerate() {
        assert_eq!(
            after
                .read(&format!("g{g}"))
                .view_unchecked()
                .unwrap()
                .bytes(),
            &b[..]
        );
    }
    let names_after: BTreeSet<String> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names_after, names_before);
}
