//! Two-level checkpoints (feature `parts`, format-spec/global.md §The two-level manifest):
//! real writer processes commit a root that names their part descriptors; readers of any
//! split read back bit for bit, loading only the parts their regions touch; damaged and
//! missing indexes fail exactly the tensors they hold.

#[allow(dead_code)]
#[path = "../src/bin/ckpt/part_layout.rs"]
mod part_layout;

use std::path::Path;
use std::process::{Child, Command};

use ckptstore::commit;
use ckptstore::write::part_file_name;
use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::write::parts::Layout;
use ckptstore::write_part;
use ckptstore::{Checkpoint, CommitOptions, Error, Part, PartItem, SaveOptions, TensorRef};
use part_layout::{box_bytes, global_bytes, globals, STEP};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt");

fn run_ranks(dir: &Path, id: &str, world: u32) -> Vec<Part> {
    let children: Vec<Child> = (0..world)
        .map(|r| {
            Command::new(BIN)
                .arg("_write-part")
                .arg(dir)
                .args([
                    "--id",
                    id,
                    "--rank",
                    &r.to_string(),
                    "--world",
                    &world.to_string(),
                ])
                .spawn()
                .expect("spawn ckpt")
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().expect("wait");
        assert!(out.status.success(), "rank {r} failed: {out:?}");
    }
    (0..world)
        .map(|r| {
            Part::from_bytes(&std::fs::read(dir.join(part_file_name(id, r))).unwrap()).unwrap()
        })
        .collect()
}

fn two_level(world: u32) -> CommitOptions {
    CommitOptions {
        world_size: Some(world),
        layout: Layout::TwoLevel,
        ..Default::default()
    }
}

/// `[start, end)` of reader `k` of `n` over `len` rows.
fn split(len: u64, n: u64, k: u64) -> (u64, u64) {
    (len * k / n, len * (k + 1) / n)
}

#[test]
fn real_processes_commit_a_root_that_reads_back_on_any_split() {
    for world in 1..=4u32 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let id = new_checkpoint_id().unwrap();
        let parts = run_ranks(dir, &id, world);
        commit(dir, &id, &parts, &two_level(world)).unwrap();
        // The part descriptors are part of the checkpoint now.
        for r in 0..world {
            assert!(dir.join(part_file_name(&id, r)).exists(), "part {r} kept");
        }
        let m = ckptstore::format::manifest::decode(
            &std::fs::read(dir.join("ckpt-manifest.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(m.features, vec!["global".to_string(), "parts".to_string()]);
        assert_eq!(m.parts.len(), world as usize);
        assert!(m
            .globals
            .iter()
            .all(|g| g.chunks.is_empty() && g.grid.is_some()));
        // Only rank 0's whole tensor `step` is in the root.
        assert_eq!(m.tensors.len(), 1);

        for readers in 1..=4u64 {
            let ck = Checkpoint::open(dir).unwrap();
            assert!(ck.catalog().two_level());
            assert_eq!(
                ck.catalog().parts_read(),
                (0, 0),
                "open reads the root only"
            );
            assert_eq!(
                ck.read("step")
                    .view_unchecked()
                    .unwrap()
                    .as_slice::<i64>()
                    .unwrap(),
                &[STEP]
            );
            for spec in globals(world) {
                let full = global_bytes(&spec);
                let es = spec.dtype.size();
                if spec.shape.is_empty() {
                    let t = ck.read(spec.name).region(&[], &[]).to_tensor().unwrap();
                    assert_eq!(t.bytes(), full.as_slice());
                    continue;
                }
                for k in 0..readers {
                    let (a, b) = split(spec.shape[0], readers, k);
                    if a == b {
                        continue;
                    }
                    let mut o = vec![0; spec.shape.len()];
                    o[0] = a;
                    let mut s = spec.shape.clone();
                    s[0] = b - a;
                    let t = ck.read(spec.name).region(&o, &s).to_tensor().unwrap();
                    let want = box_bytes(&full, es, &spec.shape, &o, &s);
                    assert_eq!(
                        t.bytes(),
                        want.as_slice(),
                        "{} world {world} reader {k}/{readers}",
                        spec.name
                    );
                    // The one-pass read (each block checked as copied), through the parts.
                    let mut filled = vec![0u8; want.len()];
                    ck.read(spec.name)
                        .region(&o, &s)
                        .fused(true)
                        .into(&mut filled)
                        .unwrap();
                    assert_eq!(filled, want, "{} fill, world {world}", spec.name);
                }
            }
            ck.verify().unwrap();
            assert_eq!(
                ck.catalog().parts_read().0,
                world as usize,
                "verify reads every part"
            );
        }

        // A rank reading back its own rows of `w` (row-split [8, 6]) reads its own part only.
        let ck = Checkpoint::open(dir).unwrap();
        let r = world - 1;
        let (a, b) = split(8, u64::from(world), u64::from(r));
        if b > a {
            ck.read("w")
                .region(&[a, 0], &[b - a, 6])
                .to_tensor()
                .unwrap();
            assert_eq!(ck.catalog().parts_read().0, 1);
        }
        let e = ck.catalog().entry("w").unwrap();
        assert!(e.global);
        assert_eq!(ck.catalog().entries().len(), globals(world).len() + 1);
        let chunks = ck.catalog().chunks("w").unwrap();
        let rows: u64 = chunks.iter().map(|c| c.shape[0]).sum();
        assert_eq!(rows, 8);
    }
}

fn rows(n: u64, base: f32) -> Vec<f32> {
    (0..n * 4).map(|i| base + i as f32).collect()
}

/// Three ranks, each holding 2 rows of `w` [6, 4] and a copy of `bias` [4]; rank 0 also a
/// whole tensor `lr`.
fn three_ranks(dir: &Path, layout: Layout) -> (String, Vec<f32>) {
    let id = new_checkpoint_id().unwrap();
    let all = rows(6, 0.5);
    let bias = vec![1.0f32, 2.0, 3.0, 4.0];
    let lr = vec![0.001f32];
    let parts: Vec<Part> = (0..3u32)
        .map(|r| {
            let mine = &all[r as usize * 8..][..8];
            let mut items = vec![
                PartItem::Chunk {
                    tensor: TensorRef::from_slice("w", &[2, 4], mine),
                    global_shape: vec![6, 4],
                    offsets: vec![2 * u64::from(r), 0],
                },
                PartItem::Chunk {
                    tensor: TensorRef::from_slice("bias", &[4], &bias),
                    global_shape: vec![4],
                    offsets: vec![0],
                },
            ];
            if r == 0 {
                items.push(PartItem::Whole(TensorRef::from_slice("lr", &[1], &lr)));
            }
            write_part(dir, &id, r, &items, &SaveOptions::default()).unwrap()
        })
        .collect();
    let opts = CommitOptions {
        world_size: Some(3),
        layout,
        ..Default::default()
    };
    commit(dir, &id, &parts, &opts).unwrap();
    (id, all)
}

#[test]
fn damaged_and_missing_indexes_fail_only_what_they_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (id, all) = three_ranks(dir, Layout::TwoLevel);
    let f32s = |t: ckptstore::Tensor| t.as_slice::<f32>().unwrap().to_vec();
    // Flip one byte of rank 1's index.
    let p1 = dir.join(part_file_name(&id, 1));
    let good = std::fs::read(&p1).unwrap();
    let mut bad = good.clone();
    bad[good.len() / 2] ^= 0x20;
    std::fs::write(&p1, &bad).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(
        f32s(ck.read("w").region(&[0, 0], &[2, 4]).to_tensor().unwrap()),
        all[..8]
    );
    assert_eq!(
        f32s(ck.read("w").region(&[4, 0], &[2, 4]).to_tensor().unwrap()),
        all[16..]
    );
    assert_eq!(
        f32s(ck.read("bias").to_tensor().unwrap()),
        [1.0, 2.0, 3.0, 4.0]
    );
    assert_eq!(f32s(ck.read("lr").to_tensor().unwrap()), [0.001]);
    for e in [
        ck.read("w")
            .region(&[2, 0], &[1, 4])
            .to_tensor()
            .unwrap_err(),
        ck.read("w").to_tensor().unwrap_err(),
        ck.verify().unwrap_err(),
    ] {
        match &e {
            Error::InvalidPart { part, reason } => {
                assert!(part.ends_with(&part_file_name(&id, 1)), "{e}");
                assert!(reason.contains("CRC32"), "{e}");
            }
            other => panic!("expected InvalidPart, got {other:?}"),
        }
    }
    // Missing: the same, named as missing.
    std::fs::remove_file(&p1).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(
        f32s(ck.read("w").region(&[4, 0], &[2, 4]).to_tensor().unwrap()),
        all[16..]
    );
    let e = ck
        .read("w")
        .region(&[3, 0], &[1, 4])
        .to_tensor()
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidPart { reason, .. } if reason.contains("missing")),
        "{e:?}"
    );
    let e = ck
        .read("w")
        .region(&[3, 0], &[1, 4])
        .fused(true)
        .into(&mut [0u8; 16])
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidPart { reason, .. } if reason.contains("missing")),
        "{e:?}"
    );
    // Restored: everything reads and verifies.
    std::fs::write(&p1, &good).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(f32s(ck.read("w").to_tensor().unwrap()), all);
    ck.verify().unwrap();
    // A missing shard of a part fails its regions, naming the shard.
    let shard = dir.join(format!("shard-{id}-r2-0.safetensors"));
    std::fs::remove_file(&shard).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    assert_eq!(
        f32s(ck.read("w").region(&[0, 0], &[4, 4]).to_tensor().unwrap()),
        all[..16]
    );
    let e = ck
        .read("w")
        .region(&[5, 0], &[1, 4])
        .to_tensor()
        .unwrap_err();
    assert!(
        matches!(&e, Error::ShardMismatch { file, .. } if file.contains("-r2-")),
        "{e:?}"
    );
}

#[test]
fn replicas_wholes_and_the_layout_choice() {
    for layout in [Layout::TwoLevel, Layout::Auto, Layout::Flat] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let (id, all) = three_ranks(dir, layout);
        let ck = Checkpoint::open(dir).unwrap();
        // Auto: far below the threshold, flat.
        assert_eq!(
            ck.catalog().two_level(),
            layout == Layout::TwoLevel,
            "{layout:?}"
        );
        assert_eq!(
            ck.read("w").to_tensor().unwrap().as_slice::<f32>().unwrap(),
            all.as_slice()
        );
        assert_eq!(
            ck.read("bias")
                .to_tensor()
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            &[1.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(
            ck.catalog().chunks("bias").unwrap().len(),
            1,
            "replicas are one chunk"
        );
        let r = ck.verify().unwrap();
        // 3 chunks of w, 3 copies of bias, lr.
        assert_eq!(r.tensors, 7, "{layout:?}");
        let part_files = std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("part-")
            })
            .count();
        assert_eq!(part_files, if layout == Layout::TwoLevel { 3 } else { 0 });
        // The next commit into the directory removes this one's parts and shards.
        let (id2, _) = three_ranks(dir, Layout::Flat);
        assert_ne!(id, id2);
        for e in std::fs::read_dir(dir).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().to_string();
            assert!(!n.contains(&id), "{n} of the superseded checkpoint left");
        }
    }
}

#[test]
fn overlaps_and_gaps_are_refused_by_the_two_level_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let w = rows(3, 0.0);
    // Rank r's rows [o, o + n) of a [4, 4] global.
    let part = |id: &str, r: u32, o: u64, n: u64| {
        let item = PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[n, 4], &w[..(n * 4) as usize]),
            global_shape: vec![4, 4],
            offsets: vec![o, 0],
        };
        write_part(dir, id, r, &[item], &SaveOptions::default()).unwrap()
    };
    let id = new_checkpoint_id().unwrap();
    let overlap = vec![part(&id, 0, 0, 3), part(&id, 1, 2, 2)];
    match commit(dir, &id, &overlap, &two_level(2)) {
        Err(Error::PartConflict { name, ranks, .. }) => {
            assert_eq!(name, "w");
            assert_eq!(ranks, [0, 1]);
        }
        other => panic!("expected PartConflict, got {other:?}"),
    }
    assert!(!dir.join("ckpt-manifest.json").exists());
    let id = new_checkpoint_id().unwrap();
    let gap = vec![part(&id, 0, 0, 1), part(&id, 1, 2, 2)];
    match commit(dir, &id, &gap, &two_level(2)) {
        Err(Error::InvalidManifest { reason, .. }) => assert!(reason.contains("gap"), "{reason}"),
        other => panic!("expected InvalidManifest, got {other:?}"),
    }
    assert!(!dir.join("ckpt-manifest.json").exists());
}

#[test]
fn manager_steps_keep_their_parts_through_gc() {
    use ckptstore::manager::{CheckpointManager, Retention};
    let tmp = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(
        tmp.path(),
        Retention {
            keep_last: 2,
            keep_every: None,
        },
    )
    .unwrap();
    let mut want = Vec::new();
    for step in [10u64, 20, 30] {
        let dir = mgr.step_dir(step).unwrap();
        let id = new_checkpoint_id().unwrap();
        let w = rows(4, step as f32);
        let parts: Vec<Part> = (0..2u32)
            .map(|r| {
                let item = PartItem::Chunk {
                    tensor: TensorRef::from_slice("w", &[2, 4], &w[r as usize * 8..][..8]),
                    global_shape: vec![4, 4],
                    offsets: vec![2 * u64::from(r), 0],
                };
                write_part(&dir, &id, r, &[item], &SaveOptions::default()).unwrap()
            })
            .collect();
        mgr.commit_parts(step, &id, &parts, &two_level(2)).unwrap();
        want = w;
    }
    let r = mgr.gc().unwrap();
    assert_eq!(r.swept, 0, "{r:?}");
    assert_eq!(mgr.steps().unwrap(), vec![20, 30]);
    let ck = mgr.open_latest().unwrap().unwrap();
    assert!(ck.catalog().two_level());
    assert_eq!(
        ck.read("w").to_tensor().unwrap().as_slice::<f32>().unwrap(),
        want.as_slice()
    );
    ck.verify().unwrap();
}

#[test]
fn cli_inspects_verifies_and_consolidates_a_two_level_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    std::fs::create_dir(&dir).unwrap();
    let (_, all) = three_ranks(&dir, Layout::TwoLevel);
    let run = |args: &[&std::ffi::OsStr]| {
        let o = Command::new(BIN).args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {o:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    let d = dir.as_os_str();
    let j: serde_json::Value =
        serde_json::from_str(&run(&["inspect".as_ref(), d, "--json".as_ref()])).unwrap();
    assert_eq!(j["two_level"], true);
    // w [6, 4] F32, three copies of bias [4] F32, lr [1] F32: every stored byte.
    assert_eq!(j["total_bytes"], 96 + 3 * 16 + 4);
    assert_eq!(j["parts"].as_array().unwrap().len(), 3);
    let w = j["globals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "w")
        .unwrap();
    assert_eq!(w["chunks"].as_array().unwrap().len(), 3);
    let b = j["globals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "bias")
        .unwrap();
    let bc = b["chunks"].as_array().unwrap();
    assert_eq!(bc.len(), 1);
    assert_eq!(bc[0]["replicas"].as_array().unwrap().len(), 2);
    assert!(run(&["inspect".as_ref(), d]).contains("two-level: 3 part index(es)"));
    run(&["verify".as_ref(), d]);
    let out = tmp.path().join("hf");
    run(&["consolidate".as_ref(), d, "--out".as_ref(), out.as_os_str()]);
    let ck = Checkpoint::open(&out).unwrap();
    assert!(!ck.catalog().two_level());
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        all.as_slice()
    );
    assert_eq!(
        ck.read("bias")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &[1.0, 2.0, 3.0, 4.0]
    );
    // A damaged index: verify fails (exit 1) naming it.
    let id = ckptstore::Checkpoint::open(&dir)
        .unwrap()
        .manifest()
        .unwrap()
        .checkpoint_id
        .clone();
    let p2 = dir.join(part_file_name(&id, 2));
    let mut bytes = std::fs::read(&p2).unwrap();
    bytes[20] ^= 4;
    std::fs::write(&p2, &bytes).unwrap();
    let o = Command::new(BIN).arg("verify").arg(&dir).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&part_file_name(&id, 2)), "{err}");
}

#[test]
fn grid_cells_plan_from_the_root_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, all) = three_ranks(tmp.path(), Layout::TwoLevel);
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let cells = ck.catalog().grid_cells("w").unwrap();
    assert_eq!(ck.catalog().parts_read(), (0, 0));
    let boxes: Vec<(Vec<u64>, Vec<u64>)> = cells
        .iter()
        .map(|c| (c.offsets.clone(), c.shape.clone()))
        .collect();
    assert_eq!(
        boxes,
        vec![
            (vec![0, 0], vec![2, 4]),
            (vec![2, 0], vec![2, 4]),
            (vec![4, 0], vec![2, 4])
        ]
    );
    let mut got = Vec::new();
    for c in &cells {
        let t = ck
            .read("w")
            .region(&c.offsets, &c.shape)
            .to_tensor()
            .unwrap();
        got.extend_from_slice(t.as_slice::<f32>().unwrap());
    }
    assert_eq!(got, all);
    assert_eq!(ck.catalog().grid_cells("bias").unwrap().len(), 1);
    assert!(ck.catalog().grid_cells("lr").is_none());
    let flat = tempfile::tempdir().unwrap();
    three_ranks(flat.path(), Layout::Flat);
    assert!(Checkpoint::open(flat.path())
        .unwrap()
        .catalog()
        .grid_cells("w")
        .is_none());
}

#[test]
fn grid_cells_within_a_box_are_the_cells_it_touches() {
    let tmp = tempfile::tempdir().unwrap();
    three_ranks(tmp.path(), Layout::TwoLevel);
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let within = |o: &[u64], s: &[u64]| -> Option<Vec<Vec<u64>>> {
        ck.catalog()
            .grid_cells_within("w", o, s)
            .map(|cs| cs.into_iter().map(|c| c.offsets).collect())
    };
    assert_eq!(
        within(&[2, 0], &[2, 4]),
        Some(vec![vec![2, 0]]),
        "one rank's rows"
    );
    assert_eq!(
        within(&[3, 1], &[1, 1]),
        Some(vec![vec![2, 0]]),
        "inside a cell"
    );
    assert_eq!(
        within(&[1, 0], &[4, 4]),
        Some(vec![vec![0, 0], vec![2, 0], vec![4, 0]]),
        "across two splits"
    );
    assert_eq!(within(&[0, 0], &[0, 4]), Some(vec![]), "an empty box");
    assert_eq!(within(&[6, 0], &[1, 4]), Some(vec![]), "outside the tensor");
    assert_eq!(within(&[5, 0], &[2, 4]), Some(vec![]), "past the end");
    assert_eq!(
        within(&[u64::MAX, 0], &[2, 4]),
        Some(vec![]),
        "offsets that overflow"
    );
    assert_eq!(within(&[0], &[1]), Some(vec![]), "another rank of index");
    assert!(ck.catalog().grid_cells_within("lr", &[], &[]).is_none());
    assert_eq!(ck.catalog().parts_read(), (0, 0));
}

#[test]
fn chunks_within_a_box_load_only_the_parts_holding_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (id, _) = three_ranks(tmp.path(), Layout::TwoLevel);
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let within = |o: &[u64], s: &[u64]| -> Vec<Vec<u64>> {
        ck.catalog()
            .chunks_within("w", o, s)
            .unwrap()
            .into_iter()
            .map(|c| c.offsets)
            .collect()
    };
    assert_eq!(within(&[2, 0], &[2, 4]), vec![vec![2, 0]]);
    let size = std::fs::metadata(tmp.path().join(part_file_name(&id, 1)))
        .unwrap()
        .len();
    assert_eq!(ck.catalog().parts_read(), (1, size), "rank 1's part alone");
    assert_eq!(within(&[3, 1], &[1, 1]), vec![vec![2, 0]]);
    assert_eq!(within(&[1, 0], &[2, 4]), vec![vec![0, 0], vec![2, 0]]);
    assert_eq!(ck.catalog().parts_read().0, 2);
    for (o, s) in [
        (vec![0, 0], vec![0, 4]),
        (vec![6, 0], vec![1, 4]),
        (vec![u64::MAX, 0], vec![2, 4]),
        (vec![0], vec![1]),
    ] {
        assert!(within(&o, &s).is_empty(), "{o:?} {s:?}");
    }
    assert!(matches!(
        ck.catalog().chunks_within("nope", &[0], &[1]),
        Err(ckptstore::Error::TensorNotFound { .. })
    ));
}

#[test]
fn a_part_is_loaded_once_however_many_threads_ask() {
    let tmp = tempfile::tempdir().unwrap();
    let (id, all) = three_ranks(tmp.path(), Layout::TwoLevel);
    let size = std::fs::metadata(tmp.path().join(part_file_name(&id, 1)))
        .unwrap()
        .len();
    for _ in 0..20 {
        let ck = Checkpoint::open(tmp.path()).unwrap();
        let barrier = std::sync::Barrier::new(8);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    barrier.wait();
                    let t = ck.read("w").region(&[2, 0], &[2, 4]).to_tensor().unwrap();
                    assert_eq!(t.as_slice::<f32>().unwrap(), &all[8..16]);
                });
            }
        });
        assert_eq!(ck.catalog().parts_read(), (1, size));
    }
}
