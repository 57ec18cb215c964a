//! `Cleanup::Background`: the save returns at its commit point and a thread removes the
//! previous checkpoint's files under the writer lock; the next save waits for it.
//!
//! The background threads and the hold seam are process-wide, so the tests of this file
//! run one at a time (`SERIAL`).

use std::path::Path;
use std::sync::Mutex;

use ckptstore::write::wait_for_cleanup;
use ckptstore::write::{hold_background_cleanup, waiting_for_cleanup};
use ckptstore::{save, Checkpoint, Cleanup, SaveOptions, TensorRef};

static SERIAL: Mutex<()> = Mutex::new(());

fn data(seed: f32) -> Vec<Vec<f32>> {
    (0..4)
        .map(|k| {
            (0..300)
                .map(|i| seed + i as f32 + k as f32 * 0.25)
                .collect()
        })
        .collect()
}

fn refs(d: &[Vec<f32>]) -> Vec<TensorRef<'_>> {
    d.iter()
        .enumerate()
        .map(|(k, v)| TensorRef::from_slice(format!("t{k}"), &[v.len() as u64], v))
        .collect()
}

fn opts(cleanup: Cleanup) -> SaveOptions {
    SaveOptions {
        max_shard_size: 2400, // two tensors per shard: two shards
        cleanup,
        ..Default::default()
    }
}

/// The shard files in `dir`, sorted.
fn shards(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("shard-"))
        .collect();
    v.sort();
    v
}

fn assert_holds(dir: &Path, d: &[Vec<f32>]) {
    let ck = Checkpoint::open(dir).unwrap();
    for (k, v) in d.iter().enumerate() {
        let t = ck.read(&format!("t{k}")).view_unchecked().unwrap();
        let got: Vec<u32> = t
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let want: Vec<u32> = v.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "t{k}");
    }
    ck.verify().unwrap();
}

#[test]
fn background_cleanup_runs_after_the_commit() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (data(1.0), data(2.0));
    save(dir.path(), &refs(&a), &opts(Cleanup::Inline)).unwrap();
    let old = shards(dir.path());
    assert_eq!(old.len(), 2);

    let hold = hold_background_cleanup();
    let info = save(dir.path(), &refs(&b), &opts(Cleanup::Background)).unwrap();
    assert_eq!(info.removed, 0, "nothing removed before the save returned");
    // Committed and durable: the new checkpoint is what the directory holds, while the
    // held cleanup has not removed the old shards yet.
    assert_holds(dir.path(), &b);
    let now = shards(dir.path());
    assert_eq!(now.len(), 4, "old and new shards: {now:?}");
    assert!(old.iter().all(|n| now.contains(n)));

    drop(hold);
    assert_eq!(
        wait_for_cleanup(),
        2,
        "the previous checkpoint's two shards"
    );
    let after = shards(dir.path());
    assert_eq!(after.len(), 2);
    assert!(old.iter().all(|n| !after.contains(n)), "{after:?}");
    assert_holds(dir.path(), &b);
    assert_eq!(wait_for_cleanup(), 0, "nothing left to wait for");
}

#[test]
fn the_next_save_waits_for_the_cleanup_instead_of_meeting_the_lock() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (data(1.0), data(2.0), data(3.0));
    save(dir.path(), &refs(&a), &opts(Cleanup::Inline)).unwrap();
    let first = shards(dir.path());

    let hold = hold_background_cleanup();
    save(dir.path(), &refs(&b), &opts(Cleanup::Background)).unwrap();
    let second: Vec<String> = shards(dir.path())
        .into_iter()
        .filter(|n| !first.contains(n))
        .collect();
    let path = dir.path().to_path_buf();
    let c2 = c.clone();
    let next = std::thread::spawn(move || save(&path, &refs(&c2), &opts(Cleanup::Inline)));
    // Deterministic: wait for the state, not for time. The third save is either blocked on
    // the held cleanup or, if it did not wait, already finished (with the lock error).
    while waiting_for_cleanup() == 0 && !next.is_finished() {
        std::thread::yield_now();
    }
    assert!(
        !next.is_finished(),
        "the third save must wait for the cleanup"
    );
    drop(hold);
    let info = next.join().unwrap().unwrap();
    // The waited-for cleanup removed the first checkpoint; the third save, inline, the second.
    assert_eq!(info.removed, 2);
    let left = shards(dir.path());
    assert!(
        first.iter().chain(&second).all(|n| !left.contains(n)),
        "{left:?}"
    );
    assert_eq!(left.len(), 2);
    assert_holds(dir.path(), &c);
    assert_eq!(wait_for_cleanup(), 0);
}

#[test]
fn a_failed_save_after_a_background_cleanup_changes_nothing() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (data(1.0), data(2.0));
    save(dir.path(), &refs(&a), &opts(Cleanup::Background)).unwrap();
    save(dir.path(), &refs(&b), &opts(Cleanup::Background)).unwrap();
    // A duplicate name is refused before anything is written, after waiting for nothing
    // (validation comes first): the committed checkpoint stays.
    let dup = vec![
        TensorRef::from_slice("t0", &[300], &a[0]),
        TensorRef::from_slice("t0", &[300], &a[1]),
    ];
    assert!(save(dir.path(), &dup, &opts(Cleanup::Background)).is_err());
    wait_for_cleanup();
    assert_eq!(shards(dir.path()).len(), 2);
    assert_holds(dir.path(), &b);
}
