//! Atomic replace and crash points of the commit protocol.

#[path = "common/crashfs.rs"]
mod crashfs;

use std::path::Path;

use ckptstore::{save, Checkpoint, SaveOptions, TensorRef};
use crashfs::CrashFs;

fn tensors(seed: f32) -> Vec<Vec<f32>> {
    (0..5)
        .map(|k| {
            (0..(100 * (k + 1)))
                .map(|i| seed + i as f32 + k as f32 * 0.5)
                .collect()
        })
        .collect()
}

fn refs(data: &[Vec<f32>]) -> Vec<TensorRef<'_>> {
    data.iter()
        .enumerate()
        .map(|(k, v)| TensorRef::from_slice(format!("t{k}"), &[v.len() as u64], v))
        .collect()
}

fn opts() -> SaveOptions {
    SaveOptions {
        max_shard_size: 1200,
        ..Default::default()
    }
}

#[test]
fn reader_keeps_old_bytes_across_replacing_saves() {
    let dir = tempfile::tempdir().unwrap();
    let old = tensors(1.0);
    save(dir.path(), &refs(&old), &opts()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let old_id = ck.manifest().unwrap().checkpoint_id.clone();
    // Two more saves replace it and remove its files while it is mapped.
    for seed in [2.0, 3.0] {
        let new = tensors(seed);
        let info = save(dir.path(), &refs(&new), &opts()).unwrap();
        assert!(info.removed > 0, "old shard files are cleaned up");
    }
    for (k, v) in old.iter().enumerate() {
        assert_eq!(
            ck.read(&format!("t{k}"))
                .view_unchecked()
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            &v[..]
        );
    }
    ck.verify().unwrap();
    let now = Checkpoint::open(dir.path()).unwrap();
    assert_ne!(now.manifest().unwrap().checkpoint_id, old_id);
    assert_eq!(
        now.read("t0")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap()[0],
        3.0
    );
    // Only the manifest, the new shards and the lock file remain.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want: Vec<String> = now.shards().iter().map(|s| s.file.clone()).collect();
    want.extend([".ckpt-lock".to_string(), "ckpt-manifest.json".to_string()]);
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn foreign_files_are_never_removed() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), b"mine").unwrap();
    std::fs::write(dir.path().join("shard-not-ours.safetensors"), b"x").unwrap();
    save(dir.path(), &refs(&tensors(1.0)), &opts()).unwrap();
    save(dir.path(), &refs(&tensors(2.0)), &opts()).unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("notes.txt")).unwrap(),
        b"mine"
    );
    assert!(dir.path().join("shard-not-ours.safetensors").exists());
}

#[test]
fn second_writer_is_refused_while_the_lock_is_held() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), &refs(&tensors(1.0)), &opts()).unwrap();
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(".ckpt-lock"))
        .unwrap();
    lock.lock().unwrap();
    let err = save(dir.path(), &refs(&tensors(2.0)), &opts()).unwrap_err();
    assert!(err.to_string().contains("another save"), "{err}");
    drop(lock);
    save(dir.path(), &refs(&tensors(2.0)), &opts()).unwrap();
}

/// The tensors a checkpoint holds, as (name, bytes).
fn contents(dir: &Path) -> Option<Vec<(String, Vec<u8>)>> {
    let ck = match Checkpoint::open(dir) {
        Ok(ck) => ck,
        Err(ckptstore::Error::NotFound { .. }) => return None,
        Err(e) => panic!("a crash left a damaged checkpoint: {e}"),
    };
    ck.verify()
        .expect("a crash left a checkpoint that fails verify");
    Some(
        ck.tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    ck.read(&t.name).view_unchecked().unwrap().bytes().to_vec(),
                )
            })
            .collect(),
    )
}

fn crash_at_every_operation(with_old: bool) -> usize {
    let old = tensors(1.0);
    let new = tensors(2.0);
    let mut k = 0;
    loop {
        let dir = tempfile::tempdir().unwrap();
        if with_old {
            save(dir.path(), &refs(&old), &opts()).unwrap();
        }
        let old_c = contents(dir.path());
        let fs = CrashFs::new(k);
        let r = ckptstore::save(
            &ckptstore::store::LocalStore::new(&fs, dir.path()),
            &refs(&new),
            &opts(),
        );
        let after = contents(dir.path());
        let new_c = {
            let d2 = tempfile::tempdir().unwrap();
            save(d2.path(), &refs(&new), &opts()).unwrap();
            contents(d2.path())
        };
        match &r {
            Ok(_) => assert_eq!(after, new_c, "an acknowledged save must be visible"),
            Err(_) => assert!(
                after == old_c || after == new_c,
                "crash at op {k}: neither old nor new"
            ),
        }
        if r.is_ok() {
            return k;
        }
        k += 1;
    }
}

#[test]
fn crash_at_every_operation_leaves_old_or_new() {
    let n_empty = crash_at_every_operation(false);
    let n_over = crash_at_every_operation(true);
    eprintln!("crash points: {n_empty} (first save), {n_over} (over a committed checkpoint)");
    assert!(n_empty > 10 && n_over > 10);
}
