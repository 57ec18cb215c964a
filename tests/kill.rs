//! Real processes killed mid-save: `ckpt pack` (the shipped binary, through the real file
//! system, writer lock and rayon threads) is SIGKILLed at delays sweeping its run time, and
//! every time the output directory must open and verify as exactly the old checkpoint A or
//! exactly the new one B.
//!
//! A SIGKILL is a process crash, not a power loss: what the kernel has accepted survives, so
//! this checks the ordering of the writer's operations as the OS sees them (the simulated
//! power-loss images are in crash_sim.rs). Timing-dependent by nature: the test asserts that
//! some kills landed before the commit and some after it (so the sweep covered the window);
//! to make the post-commit window (cleanup, exit) wide enough to be hit, every run starts
//! from A plus `LEFTOVERS` empty leftover temporary files, as interrupted saves leave them,
//! which the save's cleanup must remove after its commit.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckptstore::{save, Checkpoint, DType, SaveOptions, TensorRef};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt");
/// Empty `.ckpt-tmp-*` files put next to A before each run.
const LEFTOVERS: usize = 4000;
const MAX_KILLS: usize = 40;
const BUDGET: Duration = Duration::from_secs(40);

/// Tensor `i` of generation `g`: `words` u32 words of a cheap pattern.
fn tensor_bytes(g: u32, i: u32, words: usize) -> Vec<u8> {
    let mut x = g.wrapping_mul(0x9E37_79B9) ^ i.wrapping_mul(0x85EB_CA6B) ^ 1;
    let mut v = Vec::with_capacity(words * 4);
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

/// Write an input checkpoint of `n` F32 tensors of `words` elements each, named w0.. (plus
/// a small `step`), with ckptstore itself; returns the tensors' bytes.
fn write_input(dir: &Path, g: u32, n: u32, words: usize) -> Vec<(String, Vec<u8>)> {
    let mut data: Vec<(String, Vec<u8>)> = (0..n)
        .map(|i| (format!("w{i}"), tensor_bytes(g, i, words)))
        .collect();
    data.push(("step".into(), (g as i64 * 1000).to_le_bytes().to_vec()));
    let refs: Vec<TensorRef<'_>> = data
        .iter()
        .map(|(name, b)| {
            if name == "step" {
                TensorRef::new(name.as_str(), DType::I64, &[], b)
            } else {
                TensorRef::new(name.as_str(), DType::F32, &[words as u64], b)
            }
        })
        .collect();
    save(
        dir,
        &refs,
        &SaveOptions {
            metadata: serde_json::json!({ "gen": g }),
            ..Default::default()
        },
    )
    .unwrap();
    data
}

/// What a committed checkpoint must be.
struct Reference {
    label: &'static str,
    /// The id, when fixed (A); B gets a new id on every run.
    id: Option<String>,
    /// name, dtype, shape, crc32 for every tensor, from the manifest.
    tensors: Vec<(String, DType, Vec<u64>, Option<u32>)>,
    /// A few tensors compared byte for byte.
    samples: Vec<(String, Vec<u8>)>,
}

fn manifest_tensors(ck: &Checkpoint) -> Vec<(String, DType, Vec<u64>, Option<u32>)> {
    ck.tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.crc32))
        .collect()
}

fn reference(
    label: &'static str,
    dir: &Path,
    fixed_id: bool,
    data: &[(String, Vec<u8>)],
) -> Reference {
    let ck = Checkpoint::open(dir).unwrap();
    ck.verify().unwrap();
    let n = data.len();
    let samples = [0, n / 2, n - 2, n - 1]
        .iter()
        .map(|&i| data[i].clone())
        .collect();
    Reference {
        label,
        id: fixed_id.then(|| ck.manifest().unwrap().checkpoint_id.clone()),
        tensors: manifest_tensors(&ck),
        samples,
    }
}

/// Open + verify `dir` and say which reference it is exactly.
fn classify(dir: &Path, refs: &[&Reference]) -> Result<&'static str, String> {
    let ck = Checkpoint::open(dir).map_err(|e| format!("open failed: {e}"))?;
    ck.verify().map_err(|e| format!("verify failed: {e}"))?;
    let id = ck
        .manifest()
        .map(|m| m.checkpoint_id.clone())
        .unwrap_or_default();
    let got = manifest_tensors(&ck);
    let mut why = Vec::new();
    for r in refs {
        if got != r.tensors {
            why.push(format!(
                "not {}: the manifest's tensors/CRCs differ",
                r.label
            ));
            continue;
        }
        match &r.id {
            Some(want) if *want != id => {
                why.push(format!("not {}: id {id} != {want}", r.label));
                continue;
            }
            None if refs.iter().any(|o| o.id.as_deref() == Some(id.as_str())) => {
                why.push(format!("not {}: it has the other checkpoint's id", r.label));
                continue;
            }
            _ => {}
        }
        for (name, bytes) in &r.samples {
            let v = ck.tensor(name).map_err(|e| e.to_string())?;
            if v.bytes() != &bytes[..] {
                return Err(format!("{}'s manifest, but tensor {name} differs", r.label));
            }
        }
        return Ok(r.label);
    }
    Err(format!("neither checkpoint: {}", why.join("; ")))
}

/// A fresh output directory holding A and the leftovers. A's files are hard links to the
/// pristine copy (the writer never modifies a file in place, only renames over or unlinks
/// it: if it ever wrote into one, A's check would fail from then on); the leftovers are hard
/// links to one empty file (creating files is slow on some file systems, linking is not).
fn prepare(pristine_a: &Path, empty: &Path, out: &Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    for e in std::fs::read_dir(pristine_a).unwrap() {
        let e = e.unwrap();
        if e.file_name() != ".ckpt-lock" {
            std::fs::hard_link(e.path(), out.join(e.file_name())).unwrap();
        }
    }
    for i in 0..LEFTOVERS {
        std::fs::hard_link(empty, out.join(format!(".ckpt-tmp-leftover-{i:05}"))).unwrap();
    }
}

fn pack(input: &Path, out: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.arg("pack")
        .arg(input)
        .arg("--out")
        .arg(out)
        .arg("--max-shard-size")
        .arg("16MiB")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

#[derive(Default)]
struct Tally {
    killed_old: usize,
    killed_new: usize,
    completed: usize,
    /// (delay, outcome) in run order.
    runs: Vec<(Duration, &'static str)>,
}

/// The paths of the test.
struct Setup {
    input_b: PathBuf,
    pristine_a: PathBuf,
    empty: PathBuf,
    out: PathBuf,
}

/// One run: start `ckpt pack B --out out`, SIGKILL it after `delay`, check the directory.
/// Returns the label seen and whether the kill landed (the process was still running).
fn kill_after(delay: Duration, s: &Setup, a: &Reference, b: &Reference) -> (&'static str, bool) {
    let out = s.out.as_path();
    prepare(&s.pristine_a, &s.empty, out);
    let start = Instant::now();
    let mut child = pack(&s.input_b, out).spawn().unwrap();
    if let Some(left) = delay.checked_sub(start.elapsed()) {
        std::thread::sleep(left);
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    let killed = status.signal() == Some(9);
    assert!(
        killed || status.success(),
        "ckpt pack neither completed nor was killed: {status:?}"
    );
    let seen = classify(out, &[a, b]).unwrap_or_else(|e| {
        let mut names: Vec<String> = std::fs::read_dir(out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with(".ckpt-tmp-leftover-"))
            .collect();
        names.sort();
        panic!(
            "SIGKILL after {delay:?} ({}): the directory is neither A nor B: {e}\nfiles: {names:?}",
            if killed { "killed" } else { "had completed" }
        )
    });
    if seen == "A" {
        // Cleanup runs only after the commit: while A is committed no leftover is gone.
        let left = std::fs::read_dir(out)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(".ckpt-tmp-leftover-")
            })
            .count();
        assert_eq!(
            left, LEFTOVERS,
            "SIGKILL after {delay:?}: A is there but cleanup already removed leftovers (cleanup before the commit?)"
        );
    }
    (seen, killed)
}

#[test]
fn sigkill_during_pack_leaves_old_or_new() {
    let t0 = Instant::now();
    let root = tempfile::tempdir().unwrap();
    let in_a = root.path().join("in-a");
    let in_b = root.path().join("in-b");
    let pristine_a = root.path().join("a");
    // A: 4 MiB; B: 128 MiB in 16 tensors, packed into 8 shards of 16 MiB.
    let data_a = write_input(&in_a, 1, 4, 1 << 18);
    let data_b = write_input(&in_b, 2, 16, 2 << 20);
    let st = pack(&in_a, &pristine_a).status().unwrap();
    assert!(st.success());
    let a = reference("A", &pristine_a, true, &data_a);

    let empty = root.path().join("empty");
    std::fs::File::create(&empty).unwrap();
    let setup = Setup {
        input_b: in_b.clone(),
        pristine_a: pristine_a.clone(),
        empty,
        out: root.path().join("out"),
    };
    let out = setup.out.as_path();
    let a_manifest = std::fs::read(pristine_a.join("ckpt-manifest.json")).unwrap();

    // Calibrate: complete runs over A, polling for the moment the new manifest appears (they
    // also give B's manifest).
    let mut times = Vec::new();
    let mut b = None;
    for _ in 0..3 {
        prepare(&pristine_a, &setup.empty, out);
        let s = Instant::now();
        let mut child = pack(&in_b, out).spawn().unwrap();
        let mut commit = None;
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if commit.is_none() {
                if let Ok(m) = std::fs::read(out.join("ckpt-manifest.json")) {
                    if m != a_manifest {
                        commit = Some(s.elapsed());
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        let exit = s.elapsed();
        assert!(status.success());
        times.push((commit.unwrap_or(exit), exit));
        b = Some(reference("B", out, false, &data_b));
        let names: Vec<_> = std::fs::read_dir(out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".ckpt-tmp"))
            .collect();
        assert!(
            names.is_empty(),
            "a complete save left {} temporary files",
            names.len()
        );
    }
    let b = b.unwrap();
    assert_ne!(a.tensors, b.tensors);
    times.sort();
    let (commit, t) = times[times.len() / 2];
    eprintln!(
        "calibration: `ckpt pack` of 128 MiB over A + {LEFTOVERS} leftovers: (new manifest visible, exit) = {times:?}; setup took {:.1?}",
        t0.elapsed()
    );

    let mut tally = Tally::default();
    let run = |delay: Duration, tally: &mut Tally| {
        let (seen, killed) = kill_after(delay, &setup, &a, &b);
        match (seen, killed) {
            ("A", true) => tally.killed_old += 1,
            ("B", true) => tally.killed_new += 1,
            ("B", false) => tally.completed += 1,
            _ => panic!("A with a process that completed"),
        }
        tally
            .runs
            .push((delay, if !killed { "completed" } else { seen }));
    };
    // Phase 1: a uniform sweep from 0 to 1.1 x the completion time.
    let sweep = 28;
    for i in 0..sweep {
        if t0.elapsed() > BUDGET {
            break;
        }
        run(t.mul_f64(1.1 * i as f64 / (sweep - 1) as f64), &mut tally);
    }
    // Phase 2: kills aimed between the commit and the exit seen in calibration (cleanup of
    // the old files and the leftovers), spread over that window and shifted by feedback
    // (later after a kill that left A, earlier after a run that completed), until both
    // outcomes have been seen a few times.
    let window = t.saturating_sub(commit);
    let mut shift = 0.0f64;
    let mut i = 0usize;
    while tally.runs.len() < MAX_KILLS && t0.elapsed() < BUDGET {
        if tally.killed_old >= 3 && tally.killed_new >= 3 {
            break;
        }
        let f = [0.5, 0.25, 0.75, 0.1, 0.9, 0.4, 0.6][i % 7] + shift;
        i += 1;
        let d = (commit.as_secs_f64() + window.as_secs_f64() * f).max(0.0);
        run(Duration::from_secs_f64(d), &mut tally);
        match tally.runs.last().unwrap().1 {
            "A" => shift += 0.25,
            "completed" => shift -= 0.25,
            _ => {}
        }
    }
    eprintln!(
        "{} kills in {:.1?}: {} before the commit (old checkpoint A), {} after it (new checkpoint B), {} runs completed before the kill",
        tally.killed_old + tally.killed_new,
        t0.elapsed(),
        tally.killed_old,
        tally.killed_new,
        tally.completed
    );
    eprintln!(
        "runs (delay -> outcome): {}",
        tally
            .runs
            .iter()
            .map(|(d, o)| format!("{:.0?}->{o}", d))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(tally.killed_old > 0, "no kill landed before the commit");
    assert!(
        tally.killed_new > 0,
        "no kill landed after the commit (between the commit and exit): the sweep never covered it"
    );
}
