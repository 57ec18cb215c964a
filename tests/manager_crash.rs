//! Crash points of the manager's whole step save (src/manager/local.rs): the step
//! directory created under a temporary name, the checkpoint committed in it (shards,
//! manifest, directory fsyncs), the directory published under the step's name
//! (`store::publish::publish_dir`: a rename, or an exchange over a step saved before),
//! and a step re-saved in place. Every file and directory operation goes through the `Fs`
//! seam ([`CheckpointManager::on_fs`]); the save is crashed after its k-th operation for
//! every k: at that moment the root is copied as it stands (the disk a killed process
//! leaves), and every later operation fails with no effect.
//!
//! Both the copy (the killed process, restarted) and the root the failed save left (its
//! error path ran) are then opened by a plain manager, whose `gc` runs first, as a restart
//! does. Each must list the steps saved before, each bit-identical, and the new step
//! either not at all or whole and bit-identical; nothing of the failed save may be left
//! (but the temporary files of a failed re-save inside that step, which the next save into
//! it removes: checked).
//! A save that returned `Ok` must show the new step, in both (a crash after the commit
//! point, in the removal of the replaced files, leaves only garbage). (What the disk keeps of operations
//! that were not yet fsynced when the power fails is enumerated for the same operations by
//! tests/crash_sim.rs for a checkpoint directory and tests/publish_crash.rs for the
//! publish; this test runs the manager's own sequence of them.)

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::store::fs::{Fs, StdFs};
use ckptstore::{SaveOptions, TensorRef};

/// The real file system until `budget` operations have run; then the root is copied to
/// `snapshot` (once) and every operation fails without effect.
#[derive(Debug)]
struct CrashFs {
    budget: AtomicUsize,
    ran: AtomicUsize,
    root: PathBuf,
    snapshot: PathBuf,
    taken: Mutex<bool>,
}

impl CrashFs {
    fn new(budget: usize, root: &Path, snapshot: &Path) -> Self {
        CrashFs {
            budget: AtomicUsize::new(budget),
            ran: AtomicUsize::new(0),
            root: root.to_path_buf(),
            snapshot: snapshot.to_path_buf(),
            taken: Mutex::new(false),
        }
    }

    /// Whether the next operation may run; at the first one that may not, the copy.
    fn step(&self) -> io::Result<()> {
        let left = self.budget.load(Ordering::SeqCst);
        if left > 0 {
            self.budget.store(left - 1, Ordering::SeqCst);
            self.ran.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        let mut taken = self.taken.lock().unwrap();
        if !*taken {
            copy_tree(&self.root, &self.snapshot);
            *taken = true;
        }
        Err(io::Error::other("simulated crash"))
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

impl Fs for CrashFs {
    type File = std::fs::File;
    fn create(&self, path: &Path) -> io::Result<Self::File> {
        self.step()?;
        StdFs.create(path)
    }
    fn sync(&self, file: &mut Self::File, path: &Path) -> io::Result<()> {
        self.step()?;
        StdFs.sync(file, path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.step()?;
        StdFs.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.step()?;
        StdFs.sync_dir(dir)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.step()?;
        StdFs.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        StdFs.list(dir)
    }
    fn read_prefix(&self, path: &Path, max: u64) -> io::Result<(u64, Vec<u8>)> {
        StdFs.read_prefix(path, max)
    }
    fn exchange(&self, a: &Path, b: &Path) -> io::Result<()> {
        self.step()?;
        StdFs.exchange(a, b)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.step()?;
        StdFs.remove_dir_all(dir)
    }
}

/// The tensors of version `v` of a step.
fn tensors(v: u32) -> Vec<(String, Vec<f32>)> {
    (0..3)
        .map(|i| {
            let n = 1000 + 37 * i as usize;
            (
                format!("layer{i}.w"),
                (0..n)
                    .map(|j| (v * 10_000 + i * 100) as f32 + j as f32 * 0.5)
                    .collect(),
            )
        })
        .collect()
}

fn save(mgr: &CheckpointManager, step: u64, v: u32) -> ckptstore::Result<()> {
    let data = tensors(v);
    let refs: Vec<TensorRef<'_>> = data
        .iter()
        .map(|(n, d)| TensorRef::from_slice(n.as_str(), &[d.len() as u64], d))
        .collect();
    // Small shards: a save of several files, so that crashes fall between them too.
    let opts = SaveOptions {
        max_shard_size: 4096,
        ..Default::default()
    };
    mgr.save(step, &refs, None, &opts).map(|_| ())
}

/// The version of `step` in the manager at `root`, checked bit for bit.
fn version_of(mgr: &CheckpointManager, step: u64, candidates: &[u32]) -> u32 {
    let ck = mgr.open(step).unwrap();
    ck.verify().unwrap();
    for &v in candidates {
        let same = tensors(v).iter().all(|(n, d)| {
            ck.read(n)
                .view()
                .is_ok_and(|t| t.as_slice::<f32>().is_ok_and(|s| s == &d[..]))
        });
        if same && ck.tensors().len() == 3 {
            return v;
        }
    }
    panic!("step {step} is none of versions {candidates:?}: a mixed or damaged step");
}

/// Every name under `root` (recursively) that a finished save or gc must not leave.
fn leftovers(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(".tmp-step-")
                || name.contains(".ckpt-old-")
                || name.contains(".ckpt-trash-")
                || name.starts_with(".ckpt-tmp-")
            {
                out.push(e.path().display().to_string());
            }
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

/// After a restart on `root`: the steps before the crash whole, `step` old or new (or
/// absent when it did not exist), nothing left over. Returns the version `step` shows.
fn check_image(root: &Path, before: &[(u64, u32)], step: u64, new: u32, what: &str) -> Option<u32> {
    let mgr = CheckpointManager::new(root, Retention::keep_last(100)).unwrap();
    mgr.gc().unwrap();
    let listed = mgr.steps().unwrap();
    for &(s, v) in before {
        if s != step {
            assert!(listed.contains(&s), "{what}: step {s} lost: {listed:?}");
            assert_eq!(version_of(&mgr, s, &[v]), v, "{what}: step {s}");
        }
    }
    let old = before.iter().find(|(s, _)| *s == step).map(|&(_, v)| v);
    let shown = listed.contains(&step).then(|| {
        let mut candidates = vec![new];
        candidates.extend(old);
        version_of(&mgr, step, &candidates)
    });
    if old.is_some() {
        assert!(shown.is_some(), "{what}: the step saved before is gone");
    }
    // A failed re-save of a committed step leaves its temporary files in the step: gc keeps
    // files newer than the manifest (a later writer's own), and the next save into the step
    // removes them under its lock. Check that it does.
    let left = leftovers(root);
    let in_step = |p: &String| {
        let p = Path::new(p);
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(".ckpt-tmp-"))
            && p.parent()
                .and_then(|d| d.file_name())
                .is_some_and(|d| d.to_string_lossy() == format!("step-{step:08}"))
    };
    assert!(left.iter().all(in_step), "{what}: left after gc: {left:?}");
    if !left.is_empty() {
        let v = shown.expect("temporary files in a step that is not there");
        save(&mgr, step, v).unwrap();
        assert!(
            leftovers(root).is_empty(),
            "{what}: the next save left {left:?}"
        );
    }
    shown
}

/// Crash the save of version `new` of `step` after every operation, with the steps
/// `before` saved first (through the real file system).
fn enumerate(before: &[(u64, u32)], step: u64, new: u32) {
    let mut k = 0;
    loop {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("run");
        let snap = dir.path().join("snapshot");
        {
            let mgr = CheckpointManager::new(&root, Retention::keep_last(100)).unwrap();
            for &(s, v) in before {
                save(&mgr, s, v).unwrap();
            }
        }
        let fs = CrashFs::new(k, &root, &snap);
        let mgr = CheckpointManager::on_fs(&root, fs, Retention::keep_last(100)).unwrap();
        let result = save(&mgr, step, new);
        drop(mgr);
        let what = format!("crash after operation {k} of saving step {step}");
        let crashed = snap.exists();
        if let Err(e) = &result {
            assert!(crashed, "{what}: failed without a crash: {e}");
        }
        let live = check_image(
            &root,
            before,
            step,
            new,
            &format!("{what} (error path ran)"),
        );
        if result.is_ok() {
            // Ok once committed: a crash in the cleanup after the commit point leaves
            // garbage (the gc above removed it), never the old step.
            assert_eq!(live, Some(new), "{what}: Ok but the new step is not there");
        }
        if !crashed {
            assert!(
                k > 5,
                "the save ran only {k} operations: the seam is not reached"
            );
            return;
        }
        let killed = check_image(&snap, before, step, new, &format!("{what} (killed there)"));
        if result.is_ok() {
            assert_eq!(
                killed,
                Some(new),
                "{what}: committed, but not after a restart"
            );
        }
        k += 1;
    }
}

#[test]
fn a_new_step_is_absent_or_whole_at_every_crash_point() {
    enumerate(&[(1, 1)], 2, 2);
}

#[test]
fn a_resaved_step_is_old_or_new_at_every_crash_point() {
    enumerate(&[(1, 1), (2, 2)], 2, 3);
}

#[test]
fn the_first_step_of_a_run_is_absent_or_whole_at_every_crash_point() {
    enumerate(&[], 5, 1);
}
