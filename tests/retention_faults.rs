//! Issue 27 §3: a disk that fails under the manager's retention. `ckpt gc` (the manager's
//! `gc`, which every save runs too) is run over a root of committed steps, an interrupted
//! save, a user's file and a stray leftover, with the k-th file-system call of the process
//! (`unlink`, `rmdir`, `fsync`, `rename`) failing with EIO or ENOSPC, once or from then on,
//! for every k until a run sees no fault. The calls are failed by a small `LD_PRELOAD`
//! interposer compiled here (the same technique as the chaos tests' `unlink` interposer:
//! the real file system, the real binary).
//!
//! After every faulted run: the process exits 0 or 1 (an error naming what failed), never
//! dies; every step listed as committed opens and verifies bit for bit (a step is deleted
//! manifest first, and its data only once that removal is durable, so no failure leaves a
//! committed step without its shards); the steps retention keeps are intact; the user's file
//! is there. Then a `gc` without faults converges: exactly the kept steps, no engine file
//! outside them, the user's file kept.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::{Checkpoint, SaveOptions, TensorRef};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt");

const SHIM_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* CKPT_FAULT_AT=k: the k-th call (counting unlink, rmdir, fsync, rename) fails with
   CKPT_FAULT_ERRNO (EIO or ENOSPC); CKPT_FAULT_PERSIST=1: every call from the k-th on.
   CKPT_FAULT_COUNT=path: the number of calls is written there at exit. */
static int calls;
static int fail(void) {
    const char *at = getenv("CKPT_FAULT_AT");
    int n = ++calls;
    if (!at) return 0;
    int k = atoi(at);
    const char *p = getenv("CKPT_FAULT_PERSIST");
    if (n == k || (p && *p == '1' && n > k)) {
        const char *e = getenv("CKPT_FAULT_ERRNO");
        errno = (e && strcmp(e, "ENOSPC") == 0) ? ENOSPC : EIO;
        return 1;
    }
    return 0;
}
typedef int (*path_fn)(const char *);
typedef int (*fd_fn)(int);
typedef int (*two_fn)(const char *, const char *);
int unlink(const char *path) {
    static path_fn real; if (!real) real = (path_fn)dlsym(RTLD_NEXT, "unlink");
    return fail() ? -1 : real(path);
}
int rmdir(const char *path) {
    static path_fn real; if (!real) real = (path_fn)dlsym(RTLD_NEXT, "rmdir");
    return fail() ? -1 : real(path);
}
int fsync(int fd) {
    static fd_fn real; if (!real) real = (fd_fn)dlsym(RTLD_NEXT, "fsync");
    return fail() ? -1 : real(fd);
}
int rename(const char *a, const char *b) {
    static two_fn real; if (!real) real = (two_fn)dlsym(RTLD_NEXT, "rename");
    return fail() ? -1 : real(a, b);
}
__attribute__((destructor)) static void report(void) {
    const char *path = getenv("CKPT_FAULT_COUNT");
    if (!path) return;
    FILE *f = fopen(path, "w");
    if (f) { fprintf(f, "%d\n", calls); fclose(f); }
}
"#;

fn build_shim(dir: &Path) -> PathBuf {
    let src = dir.join("fault_shim.c");
    let so = dir.join("fault_shim.so");
    std::fs::write(&src, SHIM_C).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&so)
        .arg(&src)
        .arg("-ldl")
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run the C compiler {cc:?} (the Rust build needs one): {e}")
        });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

fn data(step: u64) -> Vec<f32> {
    (0..20_000).map(|i| step as f32 * 1e4 + i as f32).collect()
}

const STEPS: [u64; 5] = [1, 2, 3, 4, 5];
const KEEP: [u64; 2] = [4, 5];

/// The root every run starts from: five committed steps (two shards each), a user's file in
/// step 2, an interrupted save, and a stray engine file in kept step 5.
fn template(root: &Path) {
    let mgr = CheckpointManager::new(root, Retention::keep_last(100)).unwrap();
    for s in STEPS {
        let d = data(s);
        let t = [
            TensorRef::from_slice("a", &[10_000], &d[..10_000]),
            TensorRef::from_slice("b", &[10_000], &d[10_000..]),
        ];
        let opts = SaveOptions {
            max_shard_size: 40_000,
            ..Default::default()
        };
        mgr.save(s, &t, None, &opts).unwrap();
    }
    std::fs::write(mgr.step_dir(2).unwrap().join("notes.txt"), b"mine").unwrap();
    let tmp = root.join(".tmp-step-6-00ff00ff00ff00ff");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::write(
        tmp.join("shard-0123456789abcdef0123456789abcdef-00000.safetensors"),
        b"half",
    )
    .unwrap();
    // Older than the manifest: a dead attempt's file, which the sweep of kept steps takes.
    let stray = mgr
        .step_dir(5)
        .unwrap()
        .join(".ckpt-tmp-shard-0123456789abcdef0123456789abcdef-00000.safetensors");
    std::fs::write(&stray, b"stray").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&stray)
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000))
        .unwrap();
}

fn copy_tree(from: &Path, to: &Path) {
    // `-a` keeps the modification times the sweep of kept steps compares.
    let ok = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(ok.success());
}

/// Every committed step opens, verifies and holds its data; the kept ones are committed.
fn committed_steps_are_whole(root: &Path, when: &str) -> Vec<u64> {
    let mgr = CheckpointManager::new(root, Retention::keep_last(100)).unwrap();
    let steps = mgr.steps().unwrap();
    for &s in &steps {
        let ck = Checkpoint::open(mgr.step_dir(s).unwrap())
            .unwrap_or_else(|e| panic!("{when}: committed step {s} does not open: {e}"));
        ck.verify()
            .unwrap_or_else(|e| panic!("{when}: committed step {s} does not verify: {e}"));
        let d = data(s);
        assert_eq!(
            ck.read("a")
                .view_unchecked()
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            &d[..10_000],
            "{when}"
        );
        assert_eq!(
            ck.read("b")
                .view_unchecked()
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            &d[10_000..],
            "{when}"
        );
    }
    for k in KEEP {
        assert!(
            steps.contains(&k),
            "{when}: kept step {k} is gone ({steps:?})"
        );
    }
    steps
}

fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect()
        })
        .unwrap_or_default()
}

/// After a gc without faults: exactly the kept steps, nothing of the engine elsewhere.
fn converged(root: &Path, when: &str) {
    let mgr = CheckpointManager::new(root, Retention::keep_last(2)).unwrap();
    mgr.gc()
        .unwrap_or_else(|e| panic!("{when}: the clean gc failed: {e}"));
    assert_eq!(committed_steps_are_whole(root, when), KEEP, "{when}");
    let top: BTreeSet<String> = names(root)
        .into_iter()
        .filter(|n| !n.starts_with(".ckpt-manager-lock"))
        .collect();
    let want: BTreeSet<String> = ["step-00000002", "step-00000004", "step-00000005"]
        .map(String::from)
        .into();
    assert_eq!(top, want, "{when}");
    assert_eq!(
        names(&root.join("step-00000002")),
        BTreeSet::from(["notes.txt".to_string()]),
        "{when}"
    );
    for k in KEEP {
        let n = names(&mgr.step_dir(k).unwrap());
        assert!(
            n.iter().all(|f| f == "ckpt-manifest.json"
                || f == ".ckpt-lock"
                || f.ends_with(".safetensors") && !f.starts_with(".ckpt-tmp-")),
            "{when}: step {k} holds {n:?}"
        );
    }
}

struct Run {
    code: Option<i32>,
    stderr: String,
}

fn gc(root: &Path, shim: &Path, env: &[(&str, String)]) -> Run {
    let out = Command::new(BIN)
        .args(["gc", root.to_str().unwrap(), "--keep", "2"])
        .env("LD_PRELOAD", shim)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    Run {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[test]
fn retention_survives_eio_and_enospc_at_every_call() {
    let tmp = tempfile::tempdir().unwrap();
    let shim = build_shim(tmp.path());
    let tpl = tmp.path().join("template");
    template(&tpl);
    // The calls of a run without faults.
    let count = tmp.path().join("count");
    let base = tmp.path().join("base");
    copy_tree(&tpl, &base);
    let r = gc(
        &base,
        &shim,
        &[("CKPT_FAULT_COUNT", count.display().to_string())],
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    converged(&base, "no fault");
    let n: usize = std::fs::read_to_string(&count)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Three steps deleted (manifest, two shards, lock, directory each), the interrupted save,
    // the stray file: the sweep must reach them all.
    assert!(n >= 15, "only {n} calls in a gc");
    let mut errors = 0;
    let mut runs = 0;
    for errno in ["EIO", "ENOSPC"] {
        for persist in ["0", "1"] {
            for k in 1..=n {
                let root = tmp.path().join(format!("r-{errno}-{persist}-{k}"));
                copy_tree(&tpl, &root);
                let when = format!("{errno} at call {k} (persist {persist})");
                let r = gc(
                    &root,
                    &shim,
                    &[
                        ("CKPT_FAULT_AT", k.to_string()),
                        ("CKPT_FAULT_ERRNO", errno.to_string()),
                        ("CKPT_FAULT_PERSIST", persist.to_string()),
                    ],
                );
                assert!(
                    matches!(r.code, Some(0 | 1)) && !r.stderr.contains("panicked"),
                    "{when}: {:?} {}",
                    r.code,
                    r.stderr
                );
                if r.code == Some(1) {
                    errors += 1;
                }
                runs += 1;
                committed_steps_are_whole(&root, &when);
                assert_eq!(
                    std::fs::read(root.join("step-00000002/notes.txt")).unwrap(),
                    b"mine"
                );
                converged(&root, &when);
                std::fs::remove_dir_all(&root).unwrap();
            }
        }
    }
    eprintln!("retention: {n} calls per gc, {runs} faulted runs, {errors} reported an error");
    assert!(errors > 0, "no fault was ever reported");
}
