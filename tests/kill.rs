//! Real processes killed mid-save: `ckpt pack` (the shipped binary, through the real file
//! system, writer lock and rayon threads) is SIGKILLed during a save of checkpoint B over
//! checkpoint A, and every time the output directory must open and verify as exactly A or
//! exactly B.
//!
//! A SIGKILL is a process crash, not a power loss: what the kernel has accepted survives, so
//! this checks the ordering of the writer's operations as the OS sees them (the simulated
//! power-loss images are in crash_sim.rs).
//!
//! No timing luck: both sides of the commit point are hit deterministically through the
//! writer's test-only pause seam (`ckptstore::write::pause`): the writer is told to stop at
//! a named point of the protocol, announces it by creating a file, and is SIGKILLed only
//! once the announcement is seen (waiting at most `PAUSE_TIMEOUT`). Each point has a known
//! outcome (A before the manifest rename, B after it) and the directory is checked to be in
//! the state that point implies. A random sweep on top kills unpaused runs at random
//! moments of their run time and asserts only the A-or-B invariant.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckptstore::write::pause::{Point, PAUSE_DIR_ENV, PAUSE_ENV};
use ckptstore::{save, Checkpoint, DType, SaveOptions, TensorRef};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt");
/// Longest wait for a paused writer's announcement (a loaded machine is slow, not stuck).
const PAUSE_TIMEOUT: Duration = Duration::from_secs(60);
/// Kills at random moments on top of the deterministic ones.
const RANDOM_KILLS: usize = 24;
/// A user's file in the output directory: never touched by the writer.
const NOTES: &str = "notes.txt";
/// Temporary files of earlier interrupted saves, planted in the output directory: the
/// writer removes them under its lock before writing its shards.
const LEFTOVERS: [&str; 2] = [
    ".ckpt-tmp-shard-0123456789abcdef0123456789abcdef-00000.safetensors",
    ".ckpt-tmp-0123456789abcdef0123456789abcdef-manifest",
];

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
            let v = ck.read(name).view_unchecked().map_err(|e| e.to_string())?;
            if v.bytes() != &bytes[..] {
                return Err(format!("{}'s manifest, but tensor {name} differs", r.label));
            }
        }
        return Ok(r.label);
    }
    Err(format!("neither checkpoint: {}", why.join("; ")))
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A fresh output directory holding A, a user's file and the leftovers of an interrupted
/// save. A's files are hard links to the
/// pristine copy (the writer never modifies a file in place, only renames over or unlinks
/// it: if it ever wrote into one, A's check would fail from then on).
fn prepare(pristine_a: &Path, out: &Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    for e in std::fs::read_dir(pristine_a).unwrap() {
        let e = e.unwrap();
        if e.file_name() != ".ckpt-lock" {
            std::fs::hard_link(e.path(), out.join(e.file_name())).unwrap();
        }
    }
    std::fs::write(out.join(NOTES), b"mine").unwrap();
    for n in LEFTOVERS {
        std::fs::write(out.join(n), b"partial").unwrap();
    }
}

/// The paths of the test.
struct Setup {
    input_b: PathBuf,
    pristine_a: PathBuf,
    out: PathBuf,
    /// Where a paused writer announces itself.
    rendezvous: PathBuf,
    /// The child's stderr, for failure messages.
    log: PathBuf,
}

impl Setup {
    /// `ckpt pack B --out out`, paused at `pause` if given.
    fn pack(&self, input: &Path, pause: Option<Point>) -> Command {
        let mut c = Command::new(BIN);
        c.arg("pack")
            .arg(input)
            .arg("--out")
            .arg(&self.out)
            .arg("--max-shard-size")
            .arg("8MiB")
            .env_remove(PAUSE_ENV)
            .env_remove(PAUSE_DIR_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&self.log).unwrap());
        if let Some(p) = pause {
            c.env(PAUSE_ENV, p.name())
                .env(PAUSE_DIR_ENV, &self.rendezvous);
        }
        c
    }

    fn child_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// SIGKILL `child` and check that the kill landed (it was still running).
fn kill(child: &mut Child, what: &str) {
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(9),
        "{what}: ckpt pack was not killed by the SIGKILL: {status:?}"
    );
}

/// Check the directory after a kill: A or B, and the user's file intact.
fn check_after_kill(s: &Setup, what: &str, a: &Reference, b: &Reference) -> &'static str {
    let out = s.out.as_path();
    let seen = classify(out, &[a, b]).unwrap_or_else(|e| {
        panic!(
            "{what}: the directory is neither A nor B: {e}\nfiles: {:?}",
            names(out)
        )
    });
    assert_eq!(
        std::fs::read(out.join(NOTES)).unwrap(),
        b"mine",
        "{what}: the user's file changed"
    );
    seen
}

/// Start a save of B paused at `p`, wait for its announcement, SIGKILL it; returns the
/// names in the directory at the moment of the kill.
fn kill_at(p: Point, s: &Setup) -> Vec<String> {
    prepare(&s.pristine_a, &s.out);
    let _ = std::fs::remove_dir_all(&s.rendezvous);
    std::fs::create_dir_all(&s.rendezvous).unwrap();
    let marker = s.rendezvous.join(p.name());
    let mut child = s.pack(&s.input_b, Some(p)).spawn().unwrap();
    let start = Instant::now();
    while !marker.exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!(
                "ckpt pack exited ({st:?}) without reaching pause point {}; its stderr:\n{}",
                p.name(),
                s.child_log()
            );
        }
        if start.elapsed() > PAUSE_TIMEOUT {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!(
                "ckpt pack did not announce pause point {} within {PAUSE_TIMEOUT:?}; its stderr:\n{}",
                p.name(),
                s.child_log()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // The writer blocks at the point for good: what is in the directory now is what the
    // kill leaves.
    let at_kill = names(&s.out);
    kill(&mut child, p.name());
    at_kill
}

/// Start an unpaused save of B and SIGKILL it after `delay` (or let it complete first).
/// Returns the checkpoint seen and whether the kill landed.
fn kill_after(delay: Duration, s: &Setup, a: &Reference, b: &Reference) -> (&'static str, bool) {
    prepare(&s.pristine_a, &s.out);
    let start = Instant::now();
    let mut child = s.pack(&s.input_b, None).spawn().unwrap();
    if let Some(left) = delay.checked_sub(start.elapsed()) {
        std::thread::sleep(left);
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    let killed = status.signal() == Some(9);
    assert!(
        killed || status.success(),
        "ckpt pack neither completed nor was killed: {status:?}; its stderr:\n{}",
        s.child_log()
    );
    let what = format!(
        "SIGKILL after {delay:?} ({})",
        if killed { "killed" } else { "had completed" }
    );
    let seen = check_after_kill(s, &what, a, b);
    assert!(killed || seen == "B", "{what}: a completed save left A");
    (seen, killed)
}

/// Shard files of checkpoint `id` in `names`.
fn shards_of<'n>(names: &'n [String], id: &str) -> Vec<&'n String> {
    names
        .iter()
        .filter(|n| n.starts_with(&format!("shard-{id}-")))
        .collect()
}

/// Shard files of any checkpoint but `id` in `names`.
fn shards_not_of<'n>(names: &'n [String], id: &str) -> Vec<&'n String> {
    names
        .iter()
        .filter(|n| n.starts_with("shard-") && !n.starts_with(&format!("shard-{id}-")))
        .collect()
}

/// A small xorshift generator: the sweep's delays, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[test]
fn sigkill_during_pack_leaves_old_or_new() {
    let t0 = Instant::now();
    let root = tempfile::tempdir().unwrap();
    let in_a = root.path().join("in-a");
    let in_b = root.path().join("in-b");
    let pristine_a = root.path().join("a");
    // A: 4 MiB; B: 32 MiB in 8 tensors, packed into shards of 8 MiB.
    let data_a = write_input(&in_a, 1, 4, 1 << 18);
    let data_b = write_input(&in_b, 2, 8, 1 << 20);
    let s = Setup {
        input_b: in_b.clone(),
        pristine_a: pristine_a.clone(),
        out: pristine_a.clone(),
        rendezvous: root.path().join("rendezvous"),
        log: root.path().join("pack.log"),
    };
    let st = s.pack(&in_a, None).status().unwrap();
    assert!(st.success(), "ckpt pack of A failed:\n{}", s.child_log());
    let a = reference("A", &pristine_a, true, &data_a);
    let a_id = a.id.clone().unwrap();
    let s = Setup {
        out: root.path().join("out"),
        ..s
    };
    let out = s.out.as_path();

    // A complete, timed run: B's reference, and the run time the random sweep spreads over.
    prepare(&pristine_a, out);
    let started = Instant::now();
    let st = s.pack(&in_b, None).status().unwrap();
    let run_time = started.elapsed();
    assert!(st.success(), "ckpt pack of B failed:\n{}", s.child_log());
    let b = reference("B", out, false, &data_b);
    let b_shards = shard_count(out);
    assert_ne!(a.tensors, b.tensors);
    let after = names(out);
    assert!(
        shards_not_of(&after, &b_id(out)).is_empty()
            && !after.iter().any(|n| n.starts_with(".ckpt-tmp-")),
        "a complete save left old shards or temporary files: {after:?}"
    );

    // Deterministic kills: one at each pause point, each with a known outcome.
    let mut tally = Vec::new();
    for p in Point::ALL {
        let at_kill = kill_at(p, &s);
        let what = format!("SIGKILL at pause point {}", p.name());
        let seen = check_after_kill(&s, &what, &a, &b);
        let want = match p {
            Point::BeforeShards | Point::BeforeManifestRename => "A",
            _ => "B",
        };
        assert_eq!(seen, want, "{what}: files at the kill: {at_kill:?}");
        let new_id = match seen {
            "B" => b_id(out),
            _ => String::new(),
        };
        match p {
            Point::BeforeShards => {
                // The leftovers are gone already (removed under the lock, before the shards)
                // and nothing of the new save exists yet.
                assert!(
                    shards_not_of(&at_kill, &a_id).is_empty()
                        && !at_kill.iter().any(|n| n.starts_with(".ckpt-tmp-")),
                    "{what}: leftovers or files of the new save exist before its shards: {at_kill:?}"
                );
            }
            Point::BeforeManifestRename => {
                // Every new shard is in place and the new manifest waits under its temporary
                // name: the kill landed right before the commit.
                let new: Vec<_> = shards_not_of(&at_kill, &a_id);
                assert_eq!(
                    new.len(),
                    b_shards,
                    "{what}: new shards at the kill: {at_kill:?}"
                );
                assert!(
                    at_kill
                        .iter()
                        .any(|n| n.starts_with(".ckpt-tmp-") && n.ends_with("-manifest")),
                    "{what}: no temporary manifest at the kill: {at_kill:?}"
                );
            }
            Point::AfterManifestRename | Point::BeforeCleanup => {
                // The new manifest is in place and nothing of A is removed yet: the kill
                // landed right after the commit, before cleanup.
                assert_eq!(
                    shards_of(&at_kill, &new_id).len(),
                    b_shards,
                    "{what}: {at_kill:?}"
                );
                assert_eq!(
                    shards_of(&at_kill, &a_id).len(),
                    shard_count(&pristine_a),
                    "{what}: A's shards were removed before cleanup: {at_kill:?}"
                );
            }
            _ => unreachable!("a pause point this test does not know"),
        }
        tally.push(format!("{} -> {seen}", p.name()));
    }
    eprintln!("deterministic kills: {}", tally.join(", "));

    // Random kills over the run time of an unpaused save: only the A-or-B invariant.
    let seed = std::env::var("KILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("random sweep: seed {seed} (rerun with KILL_SEED={seed}), run time {run_time:.1?}");
    let mut rng = Rng(seed);
    let (mut old, mut new, mut completed) = (0, 0, 0);
    let mut runs = Vec::new();
    for _ in 0..RANDOM_KILLS {
        let delay = run_time.mul_f64(1.2 * rng.next_f64());
        let (seen, killed) = kill_after(delay, &s, &a, &b);
        match (seen, killed) {
            ("A", _) => old += 1,
            (_, true) => new += 1,
            _ => completed += 1,
        }
        runs.push(format!(
            "{delay:.0?}->{}",
            if killed { seen } else { "completed" }
        ));
    }
    eprintln!(
        "random kills: {old} left A, {new} left B, {completed} runs completed first; {}",
        runs.join(", ")
    );
    eprintln!("total {:.1?}", t0.elapsed());
}

/// The id of the checkpoint in `dir`.
fn b_id(dir: &Path) -> String {
    Checkpoint::open(dir)
        .unwrap()
        .manifest()
        .unwrap()
        .checkpoint_id
        .clone()
}

/// The number of shards of the checkpoint in `dir`.
fn shard_count(dir: &Path) -> usize {
    Checkpoint::open(dir).unwrap().shards().len()
}
