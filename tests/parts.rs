//! Multi-rank saves (format-spec/global.md §Parts, §The commit): real writer processes,
//! the commit and the rendezvous, replicas, hostile parts, and a SIGKILLed rank.

#[allow(dead_code)]
#[path = "../src/bin/ckpt/part_layout.rs"]
mod part_layout;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ckptstore::commit;
use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::write::{is_engine_file, part_file_name, pause};
use ckptstore::write_part;
use ckptstore::{
    save, Checkpoint, CommitOptions, DType, Error, Part, PartItem, SaveOptions, TensorRef,
};
use part_layout::{box_bytes, global_bytes, globals, rank_chunks, STEP};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt");
/// Generous: the success paths never wait this long unless something is broken.
const LONG: Duration = Duration::from_secs(120);

/// The options of a commit that waits (at most `timeout`) for the part descriptors of ranks
/// `0..world` in the directory (the rendezvous), from `opts`.
fn rendezvous(world: u32, timeout: Duration, opts: &CommitOptions) -> CommitOptions {
    CommitOptions {
        world_size: Some(world),
        wait_for_parts: Some(timeout),
        ..opts.clone()
    }
}

fn spawn_rank(dir: &Path, id: &str, rank: u32, world: u32) -> Command {
    let mut c = Command::new(BIN);
    c.arg("_write-part").arg(dir).args([
        "--id",
        id,
        "--rank",
        &rank.to_string(),
        "--world",
        &world.to_string(),
    ]);
    c
}

fn run_ranks(dir: &Path, id: &str, world: u32) {
    let children: Vec<Child> = (0..world)
        .map(|r| spawn_rank(dir, id, r, world).spawn().expect("spawn ckpt"))
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().expect("wait");
        assert!(out.status.success(), "rank {r} failed: {out:?}");
    }
}

fn read_parts(dir: &Path, id: &str, world: u32) -> Vec<Part> {
    (0..world)
        .map(|r| {
            let bytes = std::fs::read(dir.join(part_file_name(id, r))).unwrap();
            Part::from_bytes(&bytes).unwrap()
        })
        .collect()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// The committed checkpoint in `dir` is the layout of `world` ranks, checked through the
/// reader: verify, globals, every chunk's and replica's bytes against the global tensor.
fn check_layout(dir: &Path, id: &str, world: u32) {
    let ck = Checkpoint::open(dir).unwrap();
    ck.verify().unwrap();
    let m = ck.manifest().unwrap();
    assert_eq!(m.checkpoint_id, id);
    assert_eq!(m.features, vec!["global".to_string()]);
    let specs = globals(world);
    assert_eq!(m.globals.len(), specs.len());
    for (gi, spec) in specs.iter().enumerate() {
        let g = m.globals.iter().find(|g| g.name == spec.name).unwrap();
        assert_eq!((g.dtype, &g.global_shape), (spec.dtype, &spec.shape));
        let full = global_bytes(spec);
        // Expected chunks: each box once, held by the listed ranks (lowest first).
        let mut want: Vec<(Vec<u64>, Vec<u64>, Vec<u32>)> = Vec::new();
        for r in 0..world {
            for (cg, o, s) in rank_chunks(world, r) {
                if cg != gi {
                    continue;
                }
                match want.iter_mut().find(|w| w.0 == o) {
                    Some(w) => w.2.push(r),
                    None => want.push((o, s, vec![r])),
                }
            }
        }
        assert_eq!(g.chunks.len(), want.len(), "{}: chunks", spec.name);
        for (o, s, ranks) in &want {
            let c = g.chunks.iter().find(|c| &c.offsets == o).unwrap();
            assert_eq!(&c.shape, s);
            let name = |r: u32| {
                let offs: Vec<String> = o.iter().map(u64::to_string).collect();
                format!("{}@{}~r{r}", spec.name, offs.join(","))
            };
            assert_eq!(c.tensor, name(ranks[0]));
            let reps: Vec<String> = ranks[1..].iter().map(|&r| name(r)).collect();
            assert_eq!(c.replicas, reps);
            let expect = box_bytes(&full, spec.dtype.size(), &spec.shape, o, s);
            for t in std::iter::once(&c.tensor).chain(&c.replicas) {
                let v = ck.read(t).view_unchecked().unwrap();
                assert_eq!(v.dtype(), spec.dtype);
                assert_eq!(v.shape(), s.as_slice());
                assert_eq!(v.bytes(), expect.as_slice(), "{t}: bytes");
            }
        }
    }
    assert_eq!(
        ck.read("step")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[STEP]
    );
    // Nothing but this checkpoint's files: no part descriptor, no other id.
    for n in names(dir) {
        assert!(
            n == "ckpt-manifest.json"
                || n == ".ckpt-lock"
                || n.contains(id) && n.starts_with("shard-"),
            "unexpected file {n} after the commit"
        );
    }
}

#[test]
fn real_processes_write_parts_then_commit() {
    for world in 1..=4u32 {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ck");
        // Explicit parts, read back from the part files.
        let id = new_checkpoint_id().unwrap();
        run_ranks(&dir, &id, world);
        let parts = read_parts(&dir, &id, world);
        let opts = CommitOptions {
            world_size: Some(world),
            metadata: serde_json::json!({"world": world}),
            ..Default::default()
        };
        let info = commit(&dir, &id, &parts, &opts).unwrap();
        assert_eq!(info.checkpoint_id, id);
        assert_eq!(info.removed, world as usize, "the part descriptors");
        check_layout(&dir, &id, world);
        assert_eq!(Checkpoint::open(&dir).unwrap().metadata()["world"], world);

        // The rendezvous, with the writers running while it polls; the old checkpoint's
        // files are removed by this commit.
        let id2 = new_checkpoint_id().unwrap();
        let children: Vec<Child> = (0..world)
            .map(|r| spawn_rank(&dir, &id2, r, world).spawn().unwrap())
            .collect();
        let info = commit(
            &dir,
            &id2,
            &[],
            &rendezvous(world, LONG, &CommitOptions::default()),
        )
        .unwrap();
        for c in children {
            assert!(c.wait_with_output().unwrap().status.success());
        }
        assert_eq!(info.checkpoint_id, id2);
        check_layout(&dir, &id2, world);
    }
}

/// A global of `rows` x 2 F32 whose value at flat index i is i.
fn rows(n: u64) -> Vec<f32> {
    (0..n * 2).map(|i| i as f32).collect()
}

fn chunk<'a>(
    name: &'a str,
    data: &'a [f32],
    global: &[u64],
    offsets: &[u64],
    shape: &[u64],
) -> PartItem<'a> {
    PartItem::Chunk {
        tensor: TensorRef::from_slice(name, shape, data),
        global_shape: global.to_vec(),
        offsets: offsets.to_vec(),
    }
}

/// A directory holding a committed single-process checkpoint, and its manifest bytes.
fn baseline() -> (tempfile::TempDir, PathBuf, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let x = [1.5f32, 2.5];
    save(
        &dir,
        &[TensorRef::from_slice("old", &[2], &x)],
        &SaveOptions::default(),
    )
    .unwrap();
    let m = std::fs::read(dir.join("ckpt-manifest.json")).unwrap();
    (tmp, dir, m)
}

/// Nothing was committed: the previous checkpoint is still the one in `dir`, intact.
fn unchanged(dir: &Path, manifest: &[u8]) {
    assert_eq!(
        std::fs::read(dir.join("ckpt-manifest.json")).unwrap(),
        manifest
    );
    let ck = Checkpoint::open(dir).unwrap();
    ck.verify().unwrap();
    assert_eq!(
        ck.read("old")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &[1.5, 2.5]
    );
}

fn opts(world: u32) -> CommitOptions {
    CommitOptions {
        world_size: Some(world),
        ..Default::default()
    }
}

#[test]
fn replicated_chunk_from_two_ranks_becomes_replicas() {
    let (_t, dir, _) = baseline();
    let id = new_checkpoint_id().unwrap();
    let all = rows(4);
    let so = SaveOptions::default();
    let g = [4u64, 2];
    let p0 = write_part(
        &dir,
        &id,
        0,
        &[chunk("r", &all[..4], &g, &[0, 0], &[2, 2])],
        &so,
    )
    .unwrap();
    let p1 = write_part(
        &dir,
        &id,
        1,
        &[
            chunk("r", &all[..4], &g, &[0, 0], &[2, 2]),
            chunk("r", &all[4..], &g, &[2, 0], &[2, 2]),
        ],
        &so,
    )
    .unwrap();
    // Given out of rank order: the lowest rank's copy is still the chunk's tensor.
    commit(&dir, &id, &[p1, p0], &opts(2)).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    ck.verify().unwrap();
    let g = &ck.manifest().unwrap().globals[0];
    let c0 = g.chunks.iter().find(|c| c.offsets == [0, 0]).unwrap();
    assert_eq!(c0.tensor, "r@0,0~r0");
    assert_eq!(c0.replicas, vec!["r@0,0~r1".to_string()]);
    let c1 = g.chunks.iter().find(|c| c.offsets == [2, 0]).unwrap();
    assert_eq!((c1.tensor.as_str(), c1.replicas.len()), ("r@2,0~r1", 0));
    for (t, want) in [
        ("r@0,0~r0", &all[..4]),
        ("r@0,0~r1", &all[..4]),
        ("r@2,0~r1", &all[4..]),
    ] {
        assert_eq!(
            ck.read(t)
                .view_unchecked()
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            want
        );
    }
    assert!(
        ck.read("old").view_unchecked().is_err(),
        "the new checkpoint replaced the old one"
    );
}

#[test]
fn zero_dim_and_one_element_globals_all_dtypes() {
    let (_t, dir, _) = baseline();
    let id = new_checkpoint_id().unwrap();
    let so = SaveOptions::default();
    let f64s = [2.0f64];
    let i64s = [-9i64, 8];
    let bf = [half::bf16::from_f32(1.5)];
    let hf = [half::f16::from_f32(-2.0)];
    let p0 = write_part(
        &dir,
        &id,
        0,
        &[
            PartItem::Chunk {
                tensor: TensorRef::from_slice("s", &[], &f64s),
                global_shape: vec![],
                offsets: vec![],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("one", &[1], &bf),
                global_shape: vec![1],
                offsets: vec![0],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("n", &[1], &i64s[..1]),
                global_shape: vec![2],
                offsets: vec![0],
            },
        ],
        &so,
    )
    .unwrap();
    let p1 = write_part(
        &dir,
        &id,
        1,
        &[
            PartItem::Chunk {
                tensor: TensorRef::from_slice("n", &[1], &i64s[1..]),
                global_shape: vec![2],
                offsets: vec![1],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("hh", &[1, 1], &hf),
                global_shape: vec![1, 1],
                offsets: vec![0, 0],
            },
        ],
        &so,
    )
    .unwrap();
    commit(&dir, &id, &[p0, p1], &opts(2)).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    ck.verify().unwrap();
    assert_eq!(
        ck.read("s@~r0")
            .view_unchecked()
            .unwrap()
            .as_slice::<f64>()
            .unwrap(),
        &[2.0]
    );
    assert_eq!(
        ck.read("one@0~r0").view_unchecked().unwrap().dtype(),
        DType::BF16
    );
    assert_eq!(
        ck.read("n@0~r0")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[-9]
    );
    assert_eq!(
        ck.read("n@1~r1")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[8]
    );
    assert_eq!(
        ck.read("hh@0,0~r1").view_unchecked().unwrap().bytes(),
        bytemuck_bytes(&hf)
    );
    let s = ck
        .manifest()
        .unwrap()
        .globals
        .iter()
        .find(|g| g.name == "s")
        .unwrap();
    assert_eq!((s.global_shape.len(), s.chunks.len()), (0, 1));
}

fn bytemuck_bytes(h: &[half::f16]) -> Vec<u8> {
    h.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Two ranks writing `a` and `b` into `dir` for a fresh id; returns (id, parts).
fn two_parts(dir: &Path, a: &[PartItem<'_>], b: &[PartItem<'_>]) -> (String, Vec<Part>) {
    let id = new_checkpoint_id().unwrap();
    let so = SaveOptions::default();
    let p0 = write_part(dir, &id, 0, a, &so).unwrap();
    let p1 = write_part(dir, &id, 1, b, &so).unwrap();
    (id, vec![p0, p1])
}

#[test]
fn hostile_commits_are_refused_and_nothing_is_committed() {
    let all = rows(4);
    let g = [4u64, 2];
    let (_t, dir, old) = baseline();

    // Replicas with different bytes.
    let other = [9f32; 4];
    let (id, parts) = two_parts(
        &dir,
        &[chunk("w", &all[..4], &g, &[0, 0], &[2, 2])],
        &[
            chunk("w", &other, &g, &[0, 0], &[2, 2]),
            chunk("w", &all[4..], &g, &[2, 0], &[2, 2]),
        ],
    );
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::PartConflict {
            name,
            ranks,
            reason,
        }) => {
            assert_eq!((name.as_str(), ranks), ("w", [0, 1]));
            assert!(reason.contains("differ"), "{reason}");
        }
        other => panic!("replicas with different bytes: {other:?}"),
    }
    unchanged(&dir, &old);

    // Overlapping chunks across ranks (rows [0,3) and [2,4)).
    let (id, parts) = two_parts(
        &dir,
        &[chunk("w", &all[..6], &g, &[0, 0], &[3, 2])],
        &[chunk("w", &all[4..], &g, &[2, 0], &[2, 2])],
    );
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::PartConflict {
            name,
            ranks,
            reason,
        }) => {
            assert_eq!((name.as_str(), ranks), ("w", [0, 1]));
            assert!(
                reason.contains("overlap") && reason.contains("[2, 0]"),
                "{reason}"
            );
        }
        other => panic!("overlap: {other:?}"),
    }
    unchanged(&dir, &old);

    // A gap (row 1 missing).
    let (id, parts) = two_parts(
        &dir,
        &[chunk("w", &all[..2], &g, &[0, 0], &[1, 2])],
        &[chunk("w", &all[4..], &g, &[2, 0], &[2, 2])],
    );
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::InvalidManifest { reason, .. }) => assert!(reason.contains("gap"), "{reason}"),
        other => panic!("gap: {other:?}"),
    }
    unchanged(&dir, &old);

    // Mismatched dtype between ranks.
    let bf = [half::bf16::ZERO; 4];
    let (id, parts) = two_parts(
        &dir,
        &[chunk("w", &all[..4], &g, &[0, 0], &[2, 2])],
        &[PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[2, 2], &bf),
            global_shape: g.to_vec(),
            offsets: vec![2, 0],
        }],
    );
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::PartConflict {
            name,
            ranks,
            reason,
        }) => {
            assert_eq!((name.as_str(), ranks), ("w", [0, 1]));
            assert!(reason.contains("BF16"), "{reason}");
        }
        other => panic!("dtype: {other:?}"),
    }
    unchanged(&dir, &old);

    // Mismatched global shape between ranks.
    let (id, parts) = two_parts(
        &dir,
        &[chunk("w", &all[..4], &g, &[0, 0], &[2, 2])],
        &[chunk("w", &all[4..], &[5, 2], &[2, 0], &[2, 2])],
    );
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::PartConflict {
            name,
            ranks,
            reason,
        }) => {
            assert_eq!((name.as_str(), ranks), ("w", [0, 1]));
            assert!(reason.contains("[5, 2]"), "{reason}");
        }
        other => panic!("global shape: {other:?}"),
    }
    unchanged(&dir, &old);

    // A whole tensor offered by two ranks.
    let x = [1f32];
    let (id, parts) = two_parts(
        &dir,
        &[PartItem::Whole(TensorRef::from_slice("x", &[1], &x))],
        &[PartItem::Whole(TensorRef::from_slice("x", &[1], &x))],
    );
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::PartConflict { name, ranks, .. }) => {
            assert_eq!((name.as_str(), ranks), ("x", [0, 1]))
        }
        other => panic!("whole twice: {other:?}"),
    }
    unchanged(&dir, &old);

    // A good pair of parts, then broken in each way below.
    let good = |dir: &Path| {
        two_parts(
            dir,
            &[chunk("w", &all[..4], &g, &[0, 0], &[2, 2])],
            &[chunk("w", &all[4..], &g, &[2, 0], &[2, 2])],
        )
    };

    // Two parts for one rank.
    let (id, parts) = good(&dir);
    let twice = [parts[0].clone(), parts[0].clone(), parts[1].clone()];
    match commit(&dir, &id, &twice, &CommitOptions::default()) {
        Err(Error::InvalidPart { reason, .. }) => assert!(reason.contains("two parts"), "{reason}"),
        other => panic!("two parts for one rank: {other:?}"),
    }
    // A rank missing.
    match commit(&dir, &id, &parts[..1], &opts(2)) {
        Err(Error::MissingParts {
            missing,
            checkpoint_id,
            ..
        }) => {
            assert_eq!((missing, checkpoint_id), (vec![1], id.clone()))
        }
        other => panic!("missing rank: {other:?}"),
    }
    unchanged(&dir, &old);

    // A part of another checkpoint id.
    let (id2, parts2) = good(&dir);
    match commit(&dir, &id, &[parts[0].clone(), parts2[1].clone()], &opts(2)) {
        Err(Error::InvalidPart { part, reason }) => {
            assert_eq!(part, part_file_name(&id2, 1));
            assert!(
                reason.contains(&id2) && reason.contains("another save"),
                "{reason}"
            );
        }
        other => panic!("other id: {other:?}"),
    }
    unchanged(&dir, &old);

    // A shard whose header bytes changed (same size).
    let shard0 = dir.join(&parts[0].shards[0].file);
    let good0 = std::fs::read(&shard0).unwrap();
    let mut bad0 = good0.clone();
    let at = bad0.iter().position(|&b| b == b'F').unwrap(); // "F32" in the header
    bad0[at] = b'G';
    std::fs::write(&shard0, &bad0).unwrap();
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::ChecksumMismatch { what, file, .. }) => {
            assert_eq!(file, parts[0].shards[0].file);
            assert!(what.contains("header") && what.contains("rank 0"), "{what}");
        }
        other => panic!("header changed: {other:?}"),
    }
    std::fs::write(&shard0, &good0).unwrap();
    unchanged(&dir, &old);

    // A shard of the wrong size.
    let shard1 = dir.join(&parts[1].shards[0].file);
    let bytes = std::fs::read(&shard1).unwrap();
    std::fs::write(&shard1, [&bytes[..], &[0u8]].concat()).unwrap();
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::ShardMismatch { file, reason, .. }) => {
            assert_eq!(file, parts[1].shards[0].file);
            assert!(
                reason.contains("rank 1") && reason.contains("bytes"),
                "{reason}"
            );
        }
        other => panic!("wrong size: {other:?}"),
    }
    unchanged(&dir, &old);
    // A missing shard file.
    std::fs::remove_file(&shard1).unwrap();
    match commit(&dir, &id, &parts, &opts(2)) {
        Err(Error::ShardMismatch { file, reason, .. }) => {
            assert_eq!(file, parts[1].shards[0].file);
            assert!(reason.contains("cannot open"), "{reason}");
        }
        other => panic!("missing shard: {other:?}"),
    }
    unchanged(&dir, &old);

    // A corrupted part descriptor: refused by from_bytes and by the rendezvous.
    let (id3, _) = good(&dir);
    let pf = dir.join(part_file_name(&id3, 1));
    let mut bytes = std::fs::read(&pf).unwrap();
    let at = bytes.iter().position(|&b| b == b'w').unwrap();
    bytes[at] = b'v';
    assert!(
        matches!(Part::from_bytes(&bytes), Err(Error::InvalidPart { reason, .. }) if reason.contains("CRC32"))
    );
    std::fs::write(&pf, &bytes).unwrap();
    match commit(
        &dir,
        &id3,
        &[],
        &rendezvous(2, LONG, &CommitOptions::default()),
    ) {
        Err(Error::InvalidPart { part, reason }) => {
            assert_eq!(part, part_file_name(&id3, 1));
            assert!(reason.contains("CRC32"), "{reason}");
        }
        other => panic!("corrupted part: {other:?}"),
    }
    unchanged(&dir, &old);

    // Every refused attempt's files go with the next successful commit.
    let (id4, parts4) = good(&dir);
    commit(&dir, &id4, &parts4, &opts(2)).unwrap();
    for n in names(&dir) {
        assert!(
            n == "ckpt-manifest.json"
                || n == ".ckpt-lock"
                || n.contains(&id4) && n.starts_with("shard-"),
            "left behind: {n}"
        );
    }
    Checkpoint::open(&dir).unwrap().verify().unwrap();
}

#[test]
fn write_part_refuses_bad_chunks_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    let id = new_checkpoint_id().unwrap();
    let so = SaveOptions::default();
    let d = rows(2);
    let cases: Vec<(Vec<PartItem<'_>>, &str)> = vec![
        (vec![chunk("w", &d, &[4, 2], &[3, 0], &[2, 2])], "outside"),
        (
            vec![chunk("w", &d, &[4, 2], &[u64::MAX, 0], &[2, 2])],
            "outside",
        ),
        (vec![chunk("w", &d, &[4, 2, 1], &[0, 0], &[2, 2])], "rank"),
        (vec![chunk("w", &d, &[4], &[0], &[2, 2])], "rank"),
        (
            vec![
                chunk("w", &d, &[4, 2], &[0, 0], &[2, 2]),
                chunk("w", &d, &[4, 2], &[0, 0], &[2, 2]),
            ],
            "twice",
        ),
        (
            vec![
                chunk("w", &d, &[4, 2], &[0, 0], &[2, 2]),
                chunk("w", &d, &[6, 2], &[2, 0], &[2, 2]),
            ],
            "global",
        ),
        (
            vec![
                chunk("w", &d, &[4, 2], &[0, 0], &[2, 2]),
                PartItem::Whole(TensorRef::from_slice("w", &[4], &d)),
            ],
            "whole",
        ),
        (
            vec![chunk("w", &d[..3], &[4, 2], &[0, 0], &[2, 2])],
            "bytes",
        ),
    ];
    for (items, want) in cases {
        match write_part(&dir, &id, 0, &items, &so) {
            Err(Error::InvalidTensor { name, reason }) => {
                assert!(name == "w" || name.starts_with("w@"), "{name}");
                assert!(reason.contains(want), "{want}: {reason}");
            }
            other => panic!("{want}: {other:?}"),
        }
        assert!(!dir.exists() || names(&dir).iter().all(|n| n == ".ckpt-lock"));
    }
    assert!(matches!(
        write_part(&dir, "not-an-id", 0, &[], &so),
        Err(Error::InvalidArgument(_))
    ));
    // A rank writes its part once.
    write_part(
        &dir,
        &id,
        0,
        &[chunk("w", &d, &[2, 2], &[0, 0], &[2, 2])],
        &so,
    )
    .unwrap();
    match write_part(
        &dir,
        &id,
        0,
        &[chunk("w", &d, &[2, 2], &[0, 0], &[2, 2])],
        &so,
    ) {
        Err(Error::InvalidArgument(r)) => assert!(r.contains("already"), "{r}"),
        other => panic!("second write: {other:?}"),
    }
}

#[test]
fn part_bytes_roundtrip_and_hostile_bytes_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let id = new_checkpoint_id().unwrap();
    let d = rows(2);
    let step = [5i64];
    let p = write_part(
        tmp.path(),
        &id,
        3,
        &[
            chunk("w", &d, &[4, 2], &[2, 0], &[2, 2]),
            PartItem::Whole(TensorRef::from_slice("step", &[], &step)),
        ],
        &SaveOptions::default(),
    )
    .unwrap();
    let bytes = p.to_bytes();
    assert_eq!(
        std::fs::read(tmp.path().join(p.file_name())).unwrap(),
        bytes
    );
    assert_eq!(Part::from_bytes(&bytes).unwrap(), p);
    assert_eq!(p.rank, 3);
    assert_eq!(p.chunks[0].tensor, "w@2,0~r3");
    for n in 0..bytes.len() {
        assert!(Part::from_bytes(&bytes[..n]).is_err());
    }
    // Hostile content behind a valid CRC: refused with a reason, never a panic.
    let text =
        String::from_utf8(bytes[..bytes.len() - ckptstore::format::manifest::TRAILER_LEN].to_vec())
            .unwrap();
    for (from, to, want) in [
        ("\"ckptstore-part\"", "\"ckptstore\"", "format"),
        ("\"version\":1", "\"version\":2", "version"),
        ("\"shard\":0", "\"shard\":7", "shard 7"),
        (
            "\"tensor\":\"w@2,0~r3\"",
            "\"tensor\":\"nope\"",
            "does not list",
        ),
        ("\"offsets\":[2,0]", "\"offsets\":[2]", "rank"),
    ] {
        assert!(text.contains(from), "{from}");
        let b =
            ckptstore::format::manifest::append_trailer(text.replacen(from, to, 1).into_bytes());
        match Part::from_bytes(&b) {
            Err(Error::InvalidPart { reason, .. }) => {
                assert!(reason.contains(want), "{want}: {reason}")
            }
            other => panic!("{want}: {other:?}"),
        }
    }
}

#[test]
fn engine_file_names_of_ranks() {
    let id = "0123456789abcdef0123456789abcdef";
    for n in [
        format!("shard-{id}-r0-0.safetensors"),
        format!("shard-{id}-r12-345.safetensors"),
        format!("part-{id}-r3.json"),
        format!(".ckpt-tmp-part-{id}-r3.json"),
        format!("shard-{id}-00001.safetensors"),
    ] {
        assert!(is_engine_file(&n), "{n}");
    }
    for n in [
        format!("shard-{id}-r-0.safetensors"),
        format!("shard-{id}-rx-0.safetensors"),
        format!("shard-{id}-r1.safetensors"),
        format!("part-{id}-r.json"),
        format!("part-{id}.json"),
        "part-notanid-r0.json".to_string(),
        "ckpt-manifest.json".to_string(),
        ".ckpt-lock".to_string(),
    ] {
        assert!(!is_engine_file(&n), "{n}");
    }
}

#[test]
fn rendezvous_times_out_naming_the_missing_rank() {
    let (_t, dir, old) = baseline();
    let id = new_checkpoint_id().unwrap();
    let x = [1f32];
    for r in [0u32, 2] {
        write_part(
            &dir,
            &id,
            r,
            &[PartItem::Whole(TensorRef::from_slice(
                format!("t{r}"),
                &[1],
                &x,
            ))],
            &SaveOptions::default(),
        )
        .unwrap();
    }
    match commit(
        &dir,
        &id,
        &[],
        &rendezvous(3, Duration::from_millis(1), &CommitOptions::default()),
    ) {
        Err(Error::MissingParts {
            missing,
            checkpoint_id,
            dir: d,
        }) => {
            assert_eq!((missing, checkpoint_id, &d), (vec![1], id.clone(), &dir))
        }
        other => panic!("{other:?}"),
    }
    unchanged(&dir, &old);
    // A directory the ranks have not created yet holds no parts: the same error, and the
    // rendezvous creates nothing.
    let later = dir.join("not-yet");
    match commit(
        &later,
        &id,
        &[],
        &rendezvous(2, Duration::ZERO, &CommitOptions::default()),
    ) {
        Err(Error::MissingParts {
            missing, dir: d, ..
        }) => {
            assert_eq!((missing, &d), (vec![0, 1], &later))
        }
        other => panic!("{other:?}"),
    }
    assert!(!later.exists());
    // A descriptor over the format's size cap is refused (a sparse file: it is not read
    // whole).
    std::fs::File::create(dir.join(part_file_name(&id, 1)))
        .unwrap()
        .set_len(ckptstore::format::MAX_MANIFEST_SIZE + 1)
        .unwrap();
    match commit(
        &dir,
        &id,
        &[],
        &rendezvous(3, Duration::ZERO, &CommitOptions::default()),
    ) {
        Err(Error::InvalidPart { part, reason }) => {
            assert_eq!(part, part_file_name(&id, 1));
            assert!(reason.contains("cap"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    unchanged(&dir, &old);
}

#[test]
fn rendezvous_with_a_writer_thread() {
    let (_t, dir, _) = baseline();
    let id = new_checkpoint_id().unwrap();
    let all = rows(4);
    let g = [4u64, 2];
    write_part(
        &dir,
        &id,
        0,
        &[chunk("w", &all[..4], &g, &[0, 0], &[2, 2])],
        &SaveOptions::default(),
    )
    .unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let writer = {
        let (dir, id, b, all) = (dir.clone(), id.clone(), barrier.clone(), all.clone());
        std::thread::spawn(move || {
            b.wait();
            write_part(
                &dir,
                &id,
                1,
                &[chunk("w", &all[4..], &g, &[2, 0], &[2, 2])],
                &SaveOptions::default(),
            )
            .unwrap();
        })
    };
    barrier.wait();
    let info = commit(
        &dir,
        &id,
        &[],
        &rendezvous(2, LONG, &CommitOptions::default()),
    )
    .unwrap();
    writer.join().unwrap();
    assert_eq!(info.checkpoint_id, id);
    let ck = Checkpoint::open(&dir).unwrap();
    ck.verify().unwrap();
    assert_eq!(ck.manifest().unwrap().globals[0].chunks.len(), 2);
}

#[test]
fn sigkilled_rank_leaves_the_previous_checkpoint() {
    let (t, dir, old) = baseline();
    let id = new_checkpoint_id().unwrap();
    let pause_dir = t.path().join("pause");
    std::fs::create_dir(&pause_dir).unwrap();
    // Ranks 0 and 1 finish; rank 2 stops after its shards, before its part, and is killed.
    let mut killed = spawn_rank(&dir, &id, 2, 3)
        .env(pause::PAUSE_ENV, pause::Point::BeforePart.name())
        .env(pause::PAUSE_DIR_ENV, &pause_dir)
        .spawn()
        .unwrap();
    for r in 0..2 {
        assert!(spawn_rank(&dir, &id, r, 3).status().unwrap().success());
    }
    let marker = pause_dir.join(pause::Point::BeforePart.name());
    let start = Instant::now();
    while !marker.exists() {
        assert!(
            start.elapsed() < LONG,
            "rank 2 never reached {}",
            marker.display()
        );
        if let Some(s) = killed.try_wait().unwrap() {
            panic!("rank 2 exited ({s}) before pausing");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // While rank 2 is alive it holds the directory lock shared: a save refuses at once, so
    // its removal of temporary files cannot touch a live rank's files.
    let z = [0f32];
    match save(
        &dir,
        &[TensorRef::from_slice("z", &[1], &z)],
        &SaveOptions::default(),
    ) {
        Err(Error::Io {
            op: "lock", source, ..
        }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::WouldBlock)
        }
        other => panic!("a save while a rank writes: {other:?}"),
    }
    unchanged(&dir, &old);
    killed.kill().unwrap(); // SIGKILL
    killed.wait().unwrap();
    let dead_shards: Vec<String> = names(&dir)
        .into_iter()
        .filter(|n| n.starts_with(&format!("shard-{id}-r2-")))
        .collect();
    assert!(
        !dead_shards.is_empty(),
        "rank 2 wrote its shards before the kill"
    );
    assert!(!dir.join(part_file_name(&id, 2)).exists());

    match commit(
        &dir,
        &id,
        &[],
        &rendezvous(3, Duration::from_millis(50), &CommitOptions::default()),
    ) {
        Err(Error::MissingParts { missing, .. }) => assert_eq!(missing, vec![2]),
        other => panic!("{other:?}"),
    }
    unchanged(&dir, &old);

    // The next save into the directory removes the dead attempt's files.
    let y = [3f32];
    let info = save(
        &dir,
        &[TensorRef::from_slice("y", &[1], &y)],
        &SaveOptions::default(),
    )
    .unwrap();
    for n in names(&dir) {
        assert!(
            n == "ckpt-manifest.json" || n == ".ckpt-lock" || n.contains(&info.checkpoint_id),
            "left behind: {n}"
        );
    }
    Checkpoint::open(&dir).unwrap().verify().unwrap();
}

#[test]
fn a_failed_write_part_removes_what_it_created() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    std::fs::create_dir(&dir).unwrap();
    let id = new_checkpoint_id().unwrap();
    // The part descriptor's temporary name is taken (by a directory): creating it fails
    // after the shards are written.
    let blocker = dir.join(format!(".ckpt-tmp-{}", part_file_name(&id, 0)));
    std::fs::create_dir(&blocker).unwrap();
    let d = rows(2);
    let so = SaveOptions {
        max_shard_size: 8, // one shard per tensor: two shards
        ..Default::default()
    };
    let items = [
        chunk("w", &d, &[4, 2], &[0, 0], &[2, 2]),
        PartItem::Whole(TensorRef::from_slice("x", &[2], &d[..2])),
    ];
    match write_part(&dir, &id, 0, &items, &so) {
        Err(Error::Io {
            op: "create", path, ..
        }) => assert_eq!(path, blocker),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        names(&dir),
        vec![
            ".ckpt-lock".to_string(),
            blocker.file_name().unwrap().to_str().unwrap().to_string()
        ],
        "the shards written before the error are gone"
    );
    std::fs::remove_dir(&blocker).unwrap();
    let p = write_part(&dir, &id, 0, &items, &so).unwrap();
    assert_eq!(p.shards.len(), 2);
    assert_eq!(p.shards[1].file, format!("shard-{id}-r0-1.safetensors"));
}

/// `discard` takes away what an abandoned multi-rank save wrote (its shards, parts and
/// temporary files), leaves the committed checkpoint and other files, and refuses to
/// discard the committed checkpoint itself.
#[test]
fn discard_removes_an_uncommitted_checkpoint_and_only_it() {
    let (_tmp, dir, manifest) = baseline();
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
    let before = names(&dir);
    let w = rows(4);
    let a = [chunk("w", &w[..4], &[4, 2], &[0, 0], &[2, 2])];
    let b = [chunk("w", &w[4..], &[4, 2], &[2, 0], &[2, 2])];
    let (id, parts) = two_parts(&dir, &a, &b);
    std::fs::write(
        dir.join(format!(".ckpt-tmp-shard-{id}-r1-9.safetensors")),
        b"x",
    )
    .unwrap();
    assert!(names(&dir).len() > before.len());
    assert_eq!(ckptstore::discard(&dir, &id).unwrap(), 5);
    assert_eq!(names(&dir), before);
    unchanged(&dir, &manifest);
    assert_eq!(ckptstore::discard(&dir, &id).unwrap(), 0);
    // The committed checkpoint is refused, and nothing goes.
    let (id2, parts2) = two_parts(&dir, &a, &b);
    commit(&dir, &id2, &parts2, &opts(2)).unwrap();
    let committed = names(&dir);
    assert!(matches!(
        ckptstore::discard(&dir, &id2),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(names(&dir), committed);
    assert!(matches!(
        ckptstore::discard(&dir, "not-an-id"),
        Err(Error::InvalidArgument(_))
    ));
    drop(parts);
}
