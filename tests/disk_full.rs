//! A failed save must not keep the disk full (format-spec/durability.md §Cleanup): after an
//! error the writer removes every file it created, a save removes the temporary files of
//! earlier saves (under the writer lock) before writing its own, and the manager removes
//! the directories of interrupted saves before writing a step.
//!
//! Through the fault-injection seam (`save_with_fs` over the file-system model of
//! tests/common/simfs.rs) for every operation an error can hit, and on a real 6 MiB tmpfs
//! when running as root (the test mounts it and skips, saying so, when it cannot).

#[path = "common/simfs.rs"]
mod simfs;

use std::path::{Path, PathBuf};
use std::process::Command;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::{save, Checkpoint, CommitInfo, Error, SaveOptions, TensorRef};
use simfs::*;

const DIR: &str = "/sim/ckpt";
const NOTES: &str = "notes.txt";
const MIB: usize = 1 << 20;

/// `n` bytes of a cheap pattern (incompressible enough for any file system).
fn bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Tensors `t0..` of `each` bytes.
fn refs(data: &[Vec<u8>]) -> Vec<TensorRef<'_>> {
    data.iter()
        .enumerate()
        .map(|(i, b)| TensorRef::new(format!("t{i}"), ckptstore::DType::U8, &[b.len() as u64], b))
        .collect()
}

fn opts(max_shard_size: u64) -> SaveOptions {
    SaveOptions {
        max_shard_size,
        ..Default::default()
    }
}

fn one_thread() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
}

fn sim_save(fs: &SimFs, data: &[Vec<u8>]) -> ckptstore::Result<CommitInfo> {
    one_thread().install(|| {
        ckptstore::save(
            &ckptstore::store::LocalStore::new(fs, Path::new(DIR)),
            &refs(data),
            &opts(3000),
        )
    })
}

/// A model directory holding a committed, settled old checkpoint and a user's file.
fn base(old: &[Vec<u8>]) -> SimState {
    let fs = SimFs::new(Path::new(DIR), SimState::default());
    sim_save(&fs, old).unwrap();
    let mut st = fs.snapshot();
    st.settle();
    st.add_durable_file(NOTES, b"mine");
    st
}

fn names(st: &SimState) -> Vec<String> {
    st.cur.keys().cloned().collect()
}

fn is_enospc(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(ENOSPC))
}

#[test]
fn enospc_at_any_operation_leaves_no_file_of_the_failed_save() {
    let old: Vec<Vec<u8>> = (0..2).map(|i| bytes(2000, i)).collect();
    let new: Vec<Vec<u8>> = (0..4).map(|i| bytes(2500, 10 + i)).collect();
    let base = base(&old);
    let before = names(&base);
    // The operations of an undisturbed save, up to the manifest rename (the last one that
    // can fail the save with the old checkpoint committed).
    let fs = SimFs::new(Path::new(DIR), base.clone());
    sim_save(&fs, &new).unwrap();
    let log = fs.snapshot().log;
    let rename = log
        .iter()
        .position(|o| matches!(&o.kind, OpKind::Rename { to, .. } if to == "ckpt-manifest.json"))
        .unwrap();
    let mut failed = 0;
    for (k, op) in log.iter().enumerate().take(rename + 1) {
        let mut st = base.clone();
        st.fault = Fault::ErrnoOnce(k, ENOSPC);
        let fs = SimFs::new(Path::new(DIR), st);
        let ctx = format!("ENOSPC at operation {}", op.describe());
        let err = sim_save(&fs, &new).expect_err(&ctx);
        assert!(is_enospc(&err), "{ctx}: {err}");
        failed += 1;
        // Exactly the old files are left: no temporary file, no shard of the failed save.
        let st = fs.snapshot();
        assert_eq!(names(&st), before, "{ctx}: files after the failed save");
        // The old checkpoint is intact, and the next save (no fault) succeeds and leaves
        // only its own files and the user's.
        let mut st = st;
        st.fault = Fault::None;
        let fs = SimFs::new(Path::new(DIR), st);
        let info = sim_save(&fs, &new).unwrap_or_else(|e| panic!("{ctx}: the next save: {e}"));
        let mut want: Vec<String> = (0..info.shards)
            .map(|i| ckptstore::write::shard_file_name(&info.checkpoint_id, i))
            .collect();
        want.extend(["ckpt-manifest.json".to_string(), NOTES.to_string()]);
        want.sort();
        assert_eq!(
            names(&fs.snapshot()),
            want,
            "{ctx}: files after the next save"
        );
    }
    assert!(failed >= 20, "only {failed} operations tried");
}

#[test]
fn a_save_too_big_for_the_disk_frees_its_space_for_the_next_one() {
    // The model's disk holds 6000 bytes; the old checkpoint about 2000 + its manifest.
    let old: Vec<Vec<u8>> = vec![bytes(2000, 1)];
    let mut st = base(&old);
    st.capacity = Some(st.used() + 4000);
    let before = names(&st);
    let fs = SimFs::new(Path::new(DIR), st);
    let big: Vec<Vec<u8>> = (0..4).map(|i| bytes(2000, 20 + i)).collect();
    let err = sim_save(&fs, &big).unwrap_err();
    assert!(is_enospc(&err), "{err}");
    assert_eq!(names(&fs.snapshot()), before);
    // A save of the old size fits next to the old checkpoint, as it did before.
    let small: Vec<Vec<u8>> = vec![bytes(2000, 30)];
    sim_save(&fs, &small).unwrap();
}

// ---------------------------------------------------------------------------------------
// A real tmpfs.

/// A tmpfs mounted for the test, unmounted when dropped (also when the test fails).
struct Tmpfs {
    dir: PathBuf,
    _parent: tempfile::TempDir,
}

impl Tmpfs {
    /// Mount a tmpfs of `size` (as `mount -o size=`) or say why not.
    fn mount(size: &str) -> Result<Tmpfs, String> {
        let uid = Command::new("id")
            .arg("-u")
            .output()
            .map_err(|e| e.to_string())?;
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            return Err("not running as root".into());
        }
        let parent = tempfile::tempdir().map_err(|e| e.to_string())?;
        let dir = parent.path().join("tmpfs");
        std::fs::create_dir(&dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs {
            dir,
            _parent: parent,
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Still busy (a mapping not yet dropped): detach it.
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

fn temp_files(dir: &Path) -> Vec<String> {
    walk(dir)
        .into_iter()
        .filter(|n| n.contains("/.ckpt-tmp-") || n.contains(".tmp-step-"))
        .collect()
}

/// Every path under `dir`, relative.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            out.push(format!("/{}", p.strip_prefix(dir).unwrap().display()));
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn enospc_on_a_real_tmpfs_leaves_the_old_checkpoint_and_room_for_the_next_save() {
    let fs = match Tmpfs::mount("6m") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("SKIPPED: needs a 6 MiB tmpfs mounted by the test: {why}");
            return;
        }
    };
    let dir = fs.dir.join("ckpt");
    let two = vec![bytes(2 * MIB, 1)];
    let old = save(&dir, &refs(&two), &opts(64 << 20)).unwrap();
    std::fs::write(dir.join(NOTES), b"mine").unwrap();
    // 8 MiB does not fit: a clear ENOSPC naming the file.
    let eight: Vec<Vec<u8>> = (0..2).map(|i| bytes(4 * MIB, 2 + i)).collect();
    let err = save(&dir, &refs(&eight), &opts(64 << 20)).unwrap_err();
    let msg = err.to_string();
    eprintln!("the 8 MiB save: {msg}");
    assert!(is_enospc(&err), "not ENOSPC: {msg}");
    match &err {
        Error::Io { path, .. } => assert!(
            path.starts_with(&dir) && path.to_string_lossy().contains(".ckpt-tmp-shard-"),
            "the error names {path:?}"
        ),
        _ => unreachable!(),
    }
    assert!(msg.contains("No space left on device"), "{msg}");
    // The old checkpoint is intact, and no temporary file is left.
    let ck = Checkpoint::open(&dir).unwrap();
    ck.verify().unwrap();
    assert_eq!(ck.manifest().unwrap().checkpoint_id, old.checkpoint_id);
    drop(ck);
    assert_eq!(temp_files(&dir), Vec::<String>::new());
    // A 2 MiB save fits again.
    let two_b = vec![bytes(2 * MIB, 9)];
    let new = save(&dir, &refs(&two_b), &opts(64 << 20)).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    ck.verify().unwrap();
    assert_eq!(ck.manifest().unwrap().checkpoint_id, new.checkpoint_id);
    assert_eq!(std::fs::read(dir.join(NOTES)).unwrap(), b"mine");
}

#[test]
fn leftovers_of_a_killed_save_on_a_full_tmpfs_are_removed_before_writing() {
    let fs = match Tmpfs::mount("6m") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("SKIPPED: needs a 6 MiB tmpfs mounted by the test: {why}");
            return;
        }
    };
    // A plain checkpoint directory: 2 MiB committed, plus the 3 MiB temporary shard a
    // killed save left (no process removes it: it died).
    let dir = fs.dir.join("ckpt");
    save(&dir, &refs(&[bytes(2 * MIB, 1)]), &opts(64 << 20)).unwrap();
    let left = dir.join(format!(
        ".ckpt-tmp-shard-{}-00000.safetensors",
        "ab".repeat(16)
    ));
    std::fs::write(&left, bytes(3 * MIB, 2)).unwrap();
    let info = save(&dir, &refs(&[bytes(2 * MIB, 3)]), &opts(64 << 20))
        .expect("the leftover must be removed before the new shard is written");
    assert!(info.removed >= 2, "{info:?}");
    assert!(!left.exists());
    Checkpoint::open(&dir).unwrap().verify().unwrap();

    // The same for the manager: a step directory of a killed save holding 3 MiB.
    let root = fs.dir.join("run");
    let mgr = CheckpointManager::new(&root, Retention::keep_last(1)).unwrap();
    mgr.save(1, &refs(&[bytes(MIB, 4)]), None, &opts(64 << 20))
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let killed = root.join(".tmp-step-2-00ff00ff00ff00ff");
    std::fs::create_dir(&killed).unwrap();
    std::fs::write(killed.join(".ckpt-lock"), b"").unwrap();
    std::fs::write(
        killed.join(format!("shard-{}-00000.safetensors", "cd".repeat(16))),
        bytes(3 * MIB, 5),
    )
    .unwrap();
    // 1 MiB (step 1) + 3 MiB (the leftover) + 2 MiB does not fit in 6 MiB: only a save
    // that removes the leftover first succeeds.
    mgr.save(2, &refs(&[bytes(2 * MIB, 6)]), None, &opts(64 << 20))
        .expect("the interrupted step directory must be removed before writing");
    assert!(!killed.exists());
    assert_eq!(mgr.steps().unwrap(), vec![2]);
    mgr.open(2).unwrap().verify().unwrap();
    // A failed step save leaves nothing behind either.
    let err = mgr
        .save(3, &refs(&[bytes(5 * MIB, 7)]), None, &opts(64 << 20))
        .unwrap_err();
    assert!(is_enospc(&err), "{err}");
    assert_eq!(temp_files(&root), Vec::<String>::new());
    assert_eq!(mgr.steps().unwrap(), vec![2]);
    mgr.save(3, &refs(&[bytes(2 * MIB, 8)]), None, &opts(64 << 20))
        .unwrap();
    assert_eq!(mgr.steps().unwrap(), vec![3]);
}

#[test]
fn planted_leftovers_are_removed_by_the_next_save_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let one = vec![bytes(1000, 1)];
    save(d, &refs(&one), &opts(64 << 20)).unwrap();
    let id = "0123456789abcdef0123456789abcdef";
    let engine = [
        format!(".ckpt-tmp-shard-{id}-00000.safetensors"),
        format!(".ckpt-tmp-{id}-manifest"),
        ".ckpt-tmp-anything".to_string(),
    ];
    let foreign = [
        NOTES,
        ".ckpt-tmp",
        ".ckpt-tmpfile",
        "ckpt-tmp-shard.safetensors",
        "model.safetensors",
    ];
    for n in &engine {
        std::fs::write(d.join(n), b"partial").unwrap();
    }
    for n in foreign {
        std::fs::write(d.join(n), b"mine").unwrap();
    }
    let info = save(d, &refs(&[bytes(1000, 2)]), &opts(64 << 20)).unwrap();
    // The three leftovers and the old checkpoint's shard.
    assert_eq!(info.removed, engine.len() + 1, "{info:?}");
    for n in &engine {
        assert!(!d.join(n).exists(), "{n} is left");
    }
    for n in foreign {
        assert_eq!(std::fs::read(d.join(n)).unwrap(), b"mine", "{n} changed");
    }
    Checkpoint::open(d).unwrap().verify().unwrap();
}
