//! The checkpoint manager: committed steps only, latest, retention that spares live
//! readers, async saves that snapshot their input, bounded in flight, errors from wait().

use std::time::{Duration, Instant};

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::{SaveOptions, TensorRef};

fn w(step: u64) -> Vec<f32> {
    (0..1000).map(|i| step as f32 + i as f32).collect()
}

/// Save `v` as tensor `w` of step `step` (blocking, with retention).
fn save_w(mgr: &CheckpointManager, step: u64, v: &[f32]) {
    mgr.save(
        step,
        &[TensorRef::from_slice("w", &[1000], v)],
        None,
        &SaveOptions::default(),
    )
    .unwrap();
}

#[test]
fn steps_latest_and_retention_with_every() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(
        root.path(),
        Retention {
            keep_last: 2,
            keep_every: Some(300),
        },
    )
    .unwrap();
    assert_eq!(mgr.latest().unwrap(), None);
    for step in [100, 200, 300, 400, 500, 600, 700] {
        let v = w(step);
        save_w(&mgr, step, &v);
    }
    assert_eq!(mgr.steps().unwrap(), vec![300, 600, 700]);
    assert_eq!(mgr.latest().unwrap(), Some(700));
    let ck = mgr.open(700).unwrap();
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w(700)[..]
    );
    ck.verify().unwrap();
}

#[test]
fn gc_never_deletes_a_step_a_reader_holds() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(1)).unwrap();
    let v = w(1);
    save_w(&mgr, 1, &v);
    let reader = mgr.open(1).unwrap();
    for step in 2..=3 {
        let v = w(step);
        save_w(&mgr, step, &v);
    }
    // Step 1 is past retention but held: still there, still readable, reported in use.
    assert_eq!(mgr.steps().unwrap(), vec![1, 3]);
    let report = mgr.gc().unwrap();
    assert_eq!(report.in_use, vec![1]);
    assert_eq!(
        reader
            .read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w(1)[..]
    );
    reader.verify().unwrap();
    drop(reader);
    let report = mgr.gc().unwrap();
    assert_eq!(report.deleted, vec![1]);
    assert_eq!(mgr.steps().unwrap(), vec![3]);
    assert!(!mgr.step_dir(1).unwrap().exists());
}

#[test]
fn gc_removes_only_engine_files_and_interrupted_saves() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(1)).unwrap();
    let v = w(1);
    save_w(&mgr, 1, &v);
    std::fs::write(mgr.step_dir(1).unwrap().join("notes.txt"), b"mine").unwrap();
    std::fs::write(root.path().join("README"), b"mine too").unwrap();
    // An interrupted save: a temporary step directory with a partial shard.
    let tmp = root.path().join(".tmp-step-2-00ff00ff00ff00ff");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(tmp.join(".ckpt-tmp-shard-x"), b"partial").unwrap();
    assert_eq!(mgr.steps().unwrap(), vec![1]);
    assert_eq!(mgr.latest().unwrap(), Some(1));
    save_w(&mgr, 3, &v);
    assert!(!tmp.exists(), "the interrupted save is cleaned up");
    // Step 1 lost its checkpoint files, but the user's file (and so the directory) stays.
    assert_eq!(
        std::fs::read(mgr.step_dir(1).unwrap().join("notes.txt")).unwrap(),
        b"mine"
    );
    assert!(!mgr.step_dir(1).unwrap().join("ckpt-manifest.json").exists());
    assert_eq!(
        std::fs::read(root.path().join("README")).unwrap(),
        b"mine too"
    );
    assert_eq!(mgr.steps().unwrap(), vec![3]);
}

#[test]
fn async_save_snapshots_the_callers_buffers() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::default()).unwrap();
    let mut v: Vec<f32> = vec![1.0; 1 << 20];
    let t0 = Instant::now();
    let h = mgr
        .save_async(
            10,
            &[TensorRef::from_slice("w", &[1 << 20], &v)],
            None,
            SaveOptions::default(),
        )
        .unwrap();
    let stall = t0.elapsed();
    // Mutate immediately: the checkpoint must hold the values at the call.
    v.iter_mut().for_each(|x| *x = 2.0);
    h.wait().unwrap();
    eprintln!("stall inside save_async for 4 MiB: {stall:?}");
    let ck = mgr.open(10).unwrap();
    assert!(ck
        .read("w")
        .view_unchecked()
        .unwrap()
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .all(|&x| x == 1.0));
}

#[test]
fn async_errors_surface_from_wait_and_nothing_appears() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::default()).unwrap();
    // Make the step's final name unusable: a regular file where the directory would go.
    std::fs::write(mgr.step_dir(5).unwrap(), b"in the way").unwrap();
    let v = w(5);
    let h = mgr
        .save_async(
            5,
            &[TensorRef::from_slice("w", &[1000], &v)],
            None,
            SaveOptions::default(),
        )
        .unwrap();
    let err = h.wait().unwrap_err();
    assert!(matches!(err, ckptstore::Error::Io { .. }), "{err}");
    assert_eq!(mgr.steps().unwrap(), Vec::<u64>::new());
}

#[test]
fn saves_in_flight_are_bounded() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(10)).unwrap();
    // A progress hook that sleeps makes each save take a while.
    let slow = SaveOptions {
        progress: Some(std::sync::Arc::new(|_| {
            std::thread::sleep(Duration::from_millis(300))
        })),
        ..Default::default()
    };
    let v = w(0);
    let t0 = Instant::now();
    let h1 = mgr
        .save_async(
            1,
            &[TensorRef::from_slice("w", &[1000], &v)],
            None,
            slow.clone(),
        )
        .unwrap();
    let first = t0.elapsed();
    let h2 = mgr
        .save_async(
            2,
            &[TensorRef::from_slice("w", &[1000], &v)],
            None,
            slow.clone(),
        )
        .unwrap();
    let second = t0.elapsed();
    // The second call waited for the first save (max in flight 1).
    assert!(first < Duration::from_millis(250), "{first:?}");
    assert!(second >= Duration::from_millis(250), "{second:?}");
    h1.wait().unwrap();
    h2.wait().unwrap();
    // With two allowed, the second does not wait.
    let mgr2 = mgr.clone().with_max_in_flight(2);
    let t0 = Instant::now();
    let h3 = mgr2
        .save_async(
            3,
            &[TensorRef::from_slice("w", &[1000], &v)],
            None,
            slow.clone(),
        )
        .unwrap();
    let h4 = mgr2
        .save_async(4, &[TensorRef::from_slice("w", &[1000], &v)], None, slow)
        .unwrap();
    assert!(t0.elapsed() < Duration::from_millis(250));
    h3.wait().unwrap();
    h4.wait().unwrap();
    assert_eq!(mgr.steps().unwrap(), vec![1, 2, 3, 4]);
}

#[test]
fn sigkill_during_save_leaves_latest_on_the_previous_step() {
    // A child process (this test binary, re-run with an env var) saves step 2 slowly and is
    // killed part-way; latest() must still be step 1 and step 1 must verify.
    if let Ok(root) = std::env::var("CKPT_MANAGER_CHILD") {
        let mgr = CheckpointManager::new(&root, Retention::default()).unwrap();
        let big = vec![7u8; 64 << 20];
        let marker = std::path::Path::new(&root).join("save-started");
        let slow = SaveOptions {
            max_shard_size: 8 << 20,
            progress: Some(std::sync::Arc::new(move |_| {
                // Tell the parent the save is under way, then go slowly.
                let _ = std::fs::write(&marker, b"");
                std::thread::sleep(Duration::from_millis(50))
            })),
            ..Default::default()
        };
        mgr.save(
            2,
            &[TensorRef::new(
                "big",
                ckptstore::DType::U8,
                &[64 << 20],
                &big,
            )],
            None,
            &slow,
        )
        .unwrap();
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::default()).unwrap();
    let v = w(1);
    save_w(&mgr, 1, &v);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigkill_during_save_leaves_latest_on_the_previous_step",
            "--nocapture",
        ])
        .env("CKPT_MANAGER_CHILD", root.path())
        .spawn()
        .unwrap();
    // Kill only once the save has started writing (bounded wait).
    let marker = root.path().join("save-started");
    let t0 = Instant::now();
    while !marker.exists() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(marker.exists(), "the child never started its save");
    std::thread::sleep(Duration::from_millis(100));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(mgr.latest().unwrap(), Some(1));
    mgr.open(1).unwrap().verify().unwrap();
    // The interrupted save is visible to ls as uncommitted, and gc removes it.
    assert!(mgr
        .list()
        .unwrap()
        .iter()
        .any(|e| e.step == 2 && !e.committed));
    mgr.gc().unwrap();
    assert!(mgr.list().unwrap().iter().all(|e| e.committed));
}

#[test]
fn a_save_removes_interrupted_steps_but_never_a_committed_or_held_one() {
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(10)).unwrap();
    let v = w(1);
    save_w(&mgr, 1, &v);
    let reader = mgr.open(1).unwrap();
    let shard = format!("shard-{}-00000.safetensors", "ab".repeat(16));
    let plant = |name: &str, files: &[&str]| {
        let d = root.path().join(name);
        std::fs::create_dir(&d).unwrap();
        for f in files {
            std::fs::write(d.join(f), b"partial").unwrap();
        }
        d
    };
    // Interrupted saves: a temporary step directory, and a step directory without a manifest
    // (a gc that stopped half-way).
    let tmp2 = plant(".tmp-step-2-00ff00ff00ff00ff", &[".ckpt-lock", &shard]);
    let step3 = plant("step-00000003", &[".ckpt-tmp-x", &shard]);
    // A save in progress elsewhere: its lock is held.
    let tmp4 = plant(".tmp-step-4-1111111111111111", &[".ckpt-lock", &shard]);
    let writer = std::fs::OpenOptions::new()
        .write(true)
        .open(tmp4.join(".ckpt-lock"))
        .unwrap();
    writer.lock().unwrap();
    // An interrupted save holding a user's file: the engine's files go, the directory stays.
    let tmp5 = plant(".tmp-step-5-2222222222222222", &[&shard, "notes.txt"]);

    let v6 = w(6);
    save_w(&mgr, 6, &v6);
    assert!(!tmp2.exists() && !step3.exists());
    assert!(tmp4.join(&shard).exists(), "a held save was touched");
    assert!(!tmp5.join(&shard).exists() && tmp5.join("notes.txt").exists());
    // The committed step a reader holds is intact.
    assert_eq!(mgr.steps().unwrap(), vec![1, 6]);
    reader.verify().unwrap();
    drop(reader);
    mgr.open(1).unwrap().verify().unwrap();
    drop(writer);
    mgr.gc().unwrap();
    assert!(!tmp4.exists());
}

/// Rank `rank` of 2 writes its rows of `w` (global [4, 250]) for `step` into the step's
/// directory.
fn write_rank(
    mgr: &CheckpointManager,
    step: u64,
    id: &str,
    rank: u32,
) -> ckptstore::write::parts::Part {
    use ckptstore::write::parts::PartItem;
    use ckptstore::write_part;
    let v = w(step);
    let rows = &v[rank as usize * 500..rank as usize * 500 + 500];
    let chunk = PartItem::Chunk {
        tensor: TensorRef::from_slice("w", &[2, 250], rows),
        global_shape: vec![4, 250],
        offsets: vec![u64::from(rank) * 2, 0],
    };
    write_part(
        mgr.step_dir(step).unwrap(),
        id,
        rank,
        &[chunk],
        &SaveOptions::default(),
    )
    .unwrap()
}

#[test]
fn multi_rank_steps_commit_once_and_retention_spares_a_save_in_progress() {
    use ckptstore::write::parts::{new_checkpoint_id, CommitOptions};
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(2)).unwrap();
    for step in [10, 20, 30] {
        let id = new_checkpoint_id().unwrap();
        let parts: Vec<_> = (0..2).map(|r| write_rank(&mgr, step, &id, r)).collect();
        // Written but not committed: not a step yet.
        assert_eq!(
            mgr.steps().unwrap().last().copied(),
            (step > 10).then_some(step - 10)
        );
        mgr.commit_parts(step, &id, &parts, &CommitOptions::default())
            .unwrap();
        assert_eq!(mgr.latest().unwrap(), Some(step));
        let ck = mgr.open(step).unwrap();
        assert_eq!(
            ck.read("w").to_tensor().unwrap().as_slice::<f32>().unwrap(),
            &w(step)[..]
        );
    }
    assert_eq!(mgr.steps().unwrap(), vec![20, 30]);
    // Step 40: rank 0 has written, rank 1 not yet. A gc meanwhile keeps it; it is not
    // counted as a step.
    let id40 = new_checkpoint_id().unwrap();
    let p0 = write_rank(&mgr, 40, &id40, 0);
    mgr.gc().unwrap();
    assert!(mgr.step_dir(40).unwrap().join(p0.file_name()).is_file());
    assert_eq!(mgr.latest().unwrap(), Some(30));
    // Rank 1 dies; the job goes on and commits step 50: step 40's leftovers go.
    let id50 = new_checkpoint_id().unwrap();
    let parts: Vec<_> = (0..2).map(|r| write_rank(&mgr, 50, &id50, r)).collect();
    mgr.commit_parts(50, &id50, &parts, &CommitOptions::default())
        .unwrap();
    assert!(!mgr.step_dir(40).unwrap().exists());
    assert_eq!(mgr.steps().unwrap(), vec![30, 50]);
}

/// A multi-rank commit killed after its commit point (the manifest rename), before its own
/// cleanup, leaves its ranks' part descriptors and an earlier dead attempt's files in the
/// committed step (found by the chaos runs, tests/python/test_chaos.py). The manager's gc
/// sweeps kept steps of exactly those: engine files their manifest does not name, not newer
/// than the manifest, and never while the step is held.
#[test]
fn gc_sweeps_kept_steps_of_what_a_killed_commit_left() {
    use ckptstore::write::parts::{new_checkpoint_id, CommitOptions};
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(2)).unwrap();
    let dir = mgr.step_dir(10).unwrap();
    // An earlier attempt at step 10 died after writing rank 0's part.
    let dead = new_checkpoint_id().unwrap();
    let dead_part = write_rank(&mgr, 10, &dead, 0);
    let dead_shards: Vec<String> = dead_part.shards.iter().map(|s| s.file.clone()).collect();
    // The attempt that commits; keep copies of its part descriptors to plant them back as
    // a commit killed before its cleanup would have left them.
    let id = new_checkpoint_id().unwrap();
    let parts: Vec<_> = (0..2).map(|r| write_rank(&mgr, 10, &id, r)).collect();
    let descriptors: Vec<(String, Vec<u8>)> = parts
        .iter()
        .map(|p| {
            let n = p.file_name();
            let b = std::fs::read(dir.join(&n)).unwrap();
            (n, b)
        })
        .collect();
    let old = std::time::SystemTime::now() - Duration::from_secs(60);
    ckptstore::commit(&dir, &id, &parts, &CommitOptions::default()).unwrap();
    for (n, b) in &descriptors {
        std::fs::write(dir.join(n), b).unwrap();
        std::fs::File::options()
            .write(true)
            .open(dir.join(n))
            .unwrap()
            .set_modified(old)
            .unwrap();
    }
    // The commit's own sweep removed the dead attempt's files: plant one shard back, old.
    let dead_shard = dir.join(&dead_shards[0]);
    std::fs::write(&dead_shard, b"dead attempt").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&dead_shard)
        .unwrap()
        .set_modified(old)
        .unwrap();
    // A writer's file newer than the manifest, and a user's file: both stay.
    let newer = dir.join(format!(
        ".ckpt-tmp-shard-{}-00000.safetensors",
        new_checkpoint_id().unwrap()
    ));
    std::fs::write(&newer, b"in flight").unwrap();
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();

    // While a reader holds the step, nothing is swept.
    {
        let _held = mgr.open(10).unwrap();
        assert_eq!(mgr.gc().unwrap().swept, 0);
        assert!(dead_shard.is_file());
    }
    let report = mgr.gc().unwrap();
    assert_eq!(report.swept, 3, "{report:?}");
    assert!(report.deleted.is_empty());
    for (n, _) in &descriptors {
        assert!(!dir.join(n).exists(), "{n} survived gc");
    }
    assert!(!dead_shard.exists());
    assert!(newer.is_file() && dir.join("notes.txt").is_file());
    // The step is whole and reads back bit for bit.
    let ck = mgr.open(10).unwrap();
    ck.verify().unwrap();
    assert_eq!(
        ck.read("w").to_tensor().unwrap().as_slice::<f32>().unwrap(),
        &w(10)[..]
    );
    // A second gc has nothing left to sweep.
    drop(ck);
    assert_eq!(mgr.gc().unwrap().swept, 0);
}
