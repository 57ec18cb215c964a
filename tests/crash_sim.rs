//! Crash consistency of the commit protocol (format-spec/durability.md) under a model of a
//! POSIX file system (tests/common/simfs.rs), driven through `save_with_fs`.
//!
//! For a save onto an empty directory and a save over a committed checkpoint, the save is
//! crashed after its k-th operation for every k (every operation from the k-th on fails,
//! with no effect), and every resulting state is turned into power-loss images, each written
//! into a real directory and checked with `Checkpoint::open` + `verify`:
//!
//! * A  "current": everything survived (a process crash, no power loss);
//! * B  "data-unsynced-dropped": every file reverts to its content as of its last fsync
//!   (a file never fsynced is empty); directory entries as current;
//! * C512 / C4096 "torn-last-write": as B, but the file of the most recent write keeps its
//!   durable content plus its unsynced bytes up to the last 512- / 4096-byte boundary before
//!   its current end (no image when no such boundary lies past the durable end);
//! * D  "dir-ops-lost": directory entries revert to those of the last directory fsync;
//!   file content as current;
//! * B+D, C512+D, C4096+D: both;
//! * E  (beyond the brief, needed by A4 "any order"): content per B, and of the directory
//!   operations not covered by a directory fsync only some reached the disk: every proper
//!   prefix (E-prefix: an ordered metadata journal), each one alone (E-only), all but one
//!   (E-all-but).
//!
//! Every image must open as exactly the old checkpoint or exactly the new one (same names,
//! dtypes, shapes, bytes, metadata, and the right checkpoint id) and pass `verify`; for a
//! first save `NotFound` is also allowed. A save that returned `Ok` must be the new
//! checkpoint in every image. (A crash during cleanup, step 5, makes `save` return `Ok`:
//! the writer ignores cleanup failures.)
//!
//! The saves run in a one-thread rayon pool so that the operation order, and hence the
//! crash points, are deterministic; `parallel_shard_writes_interleaved` runs the same
//! enumeration with one rayon thread per shard, the model forcing their operations to
//! interleave round-robin (deterministic too: see `simfs::Parallel`).

#[path = "common/simfs.rs"]
mod simfs;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use ckptstore::{CommitInfo, DType, Error, SaveOptions, TensorRef};
use simfs::*;

const DIR: &str = "/sim/ckpt";
const NOTES: &str = "notes.txt";
const NOTES_BODY: &[u8] = b"a user's file: never touched by the engine";
const LEFTOVER: &str = ".ckpt-tmp-shard-0123456789abcdef0123456789abcdef-00000.safetensors";

// ---------------------------------------------------------------------------------------
// Inputs.

struct Input {
    name: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
}

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn input(name: &'static str, dtype: DType, shape: &[u64], seed: u64) -> Input {
    let n = shape.iter().product::<u64>() as usize * dtype.size();
    Input {
        name,
        dtype,
        shape: shape.to_vec(),
        bytes: pattern(n, seed),
    }
}

/// The old checkpoint: 2 shards at max_shard_size 13000.
fn old_inputs() -> Vec<Input> {
    vec![
        input("t0", DType::F32, &[2500], 1),
        input("old_only", DType::I32, &[1000], 2),
        input("bias", DType::F16, &[300], 3),
    ]
}

/// The new checkpoint: 5 shards at max_shard_size 13000 (12000, 10600, 12008, 10000 and
/// 12000 bytes of data); four shards take two write calls for their data; one tensor is a
/// scalar, one is empty (no write call).
fn new_inputs() -> Vec<Input> {
    vec![
        input("t0", DType::F32, &[3000], 11),
        input("t1", DType::I64, &[700], 12),
        input("t2", DType::U8, &[5000], 13),
        input("t3", DType::F32, &[2, 1500], 14),
        input("step", DType::I64, &[], 15),
        input("empty", DType::F32, &[0], 16),
        input("t4", DType::BF16, &[3000], 17),
        input("t5", DType::I16, &[2000], 18),
        input("t6", DType::U32, &[1000], 19),
        input("t7", DType::F64, &[1000], 20),
    ]
}

const NEW_SHARDS: usize = 5;

fn refs(inputs: &[Input]) -> Vec<TensorRef<'_>> {
    inputs
        .iter()
        .map(|t| TensorRef::new(t.name, t.dtype, &t.shape, &t.bytes))
        .collect()
}

fn opts(gen: &str) -> SaveOptions {
    SaveOptions {
        max_shard_size: 13000,
        metadata: serde_json::json!({ "gen": gen }),
        ..Default::default()
    }
}

fn expected(label: &'static str, inputs: &[Input]) -> Expected {
    Expected {
        label,
        tensors: inputs
            .iter()
            .map(|t| {
                (
                    t.name.to_string(),
                    t.dtype,
                    t.shape.clone(),
                    t.bytes.clone(),
                )
            })
            .collect(),
        metadata: serde_json::json!({ "gen": label }),
    }
}

// ---------------------------------------------------------------------------------------
// Scenarios.

struct Scenario {
    label: &'static str,
    base: SimState,
    old: Option<(Expected, String)>,
    new_inputs: Vec<Input>,
    new: Expected,
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

fn empty_dir() -> Scenario {
    let new_inputs = new_inputs();
    Scenario {
        label: "first save (empty directory)",
        base: SimState::default(),
        old: None,
        new: expected("new", &new_inputs),
        new_inputs,
    }
}

/// A directory holding a committed, settled old checkpoint (written through the model by
/// the real writer), a leftover temporary shard of an interrupted save, and a user file.
fn over_old() -> Scenario {
    let old_inputs = old_inputs();
    let fs = SimFs::new(Path::new(DIR), SimState::default());
    let info = pool(1)
        .install(|| {
            ckptstore::save(
                &ckptstore::store::LocalStore::new(&fs, Path::new(DIR)),
                &refs(&old_inputs),
                &opts("old"),
            )
        })
        .unwrap();
    assert_eq!(info.shards, 2);
    let mut base = fs.snapshot();
    base.settle();
    base.add_durable_file(LEFTOVER, &pattern(3000, 99));
    base.add_durable_file(NOTES, NOTES_BODY);
    let new_inputs = new_inputs();
    Scenario {
        label: "save over a committed checkpoint",
        base,
        old: Some((expected("old", &old_inputs), info.checkpoint_id)),
        new: expected("new", &new_inputs),
        new_inputs,
    }
}

/// Run the new save of `scn` from its base state with `fault` and `disabled_sync`.
fn run(
    scn: &Scenario,
    pool: &rayon::ThreadPool,
    fault: Fault,
    disabled_sync: Option<usize>,
) -> (ckptstore::Result<CommitInfo>, SimState) {
    let mut st = scn.base.clone();
    st.fault = fault;
    st.disabled_sync = disabled_sync;
    if pool.current_num_threads() > 1 {
        st.parallel = Some(Parallel::new(NEW_SHARDS));
    }
    let fs = SimFs::new(Path::new(DIR), st);
    let r = pool.install(|| {
        ckptstore::save(
            &ckptstore::store::LocalStore::new(&fs, Path::new(DIR)),
            &refs(&scn.new_inputs),
            &opts("new"),
        )
    });
    let st = fs.snapshot();
    st.check_invariant();
    if let Some(p) = &st.parallel {
        assert!(
            !p.timed_out,
            "parallel mode: a shard waited 2 s for its turn ({fault:?})"
        );
    }
    (r, st)
}

/// The id of the save run in `st` (from the names it created), if it created any file.
fn run_id(st: &SimState) -> Option<String> {
    st.log.iter().find_map(|r| match &r.kind {
        OpKind::Create { name, .. } => {
            let rest = name
                .strip_prefix(".ckpt-tmp-shard-")
                .or_else(|| name.strip_prefix(".ckpt-tmp-"))?;
            Some(rest.get(..32)?.to_string())
        }
        _ => None,
    })
}

fn describe_result(r: &ckptstore::Result<CommitInfo>) -> String {
    match r {
        Ok(i) => format!("Ok (removed {})", i.removed),
        Err(e) => format!("Err({})", shorten_ids(&e.to_string())),
    }
}

// ---------------------------------------------------------------------------------------
// Checking one state.

#[derive(Debug, Clone)]
struct Failure {
    k: usize,
    variant: String,
    /// What was seen, in brief.
    summary: String,
    /// Everything: what was seen, the save's result, the operation, the files.
    what: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "crash point k={} variant {}: {}",
            self.k, self.variant, self.what
        )
    }
}

/// Check every image of `st` (full set, or A and B+D only). `acked`: the save returned Ok.
#[allow(clippy::too_many_arguments)]
fn check_state(
    scn: &Scenario,
    ev: &mut Evaluator,
    k: usize,
    st: &SimState,
    r: &ckptstore::Result<CommitInfo>,
    full: bool,
    extra_rule: Option<(&'static str, &str)>,
    tag: &str,
    failures: &mut Vec<Failure>,
) {
    ev.clear();
    let acked = r.is_ok();
    let id = match r {
        Ok(i) => Some(i.checkpoint_id.clone()),
        Err(_) => run_id(st),
    };
    let mut cands: Vec<&Expected> = vec![&scn.new];
    if let Some((old, _)) = &scn.old {
        cands.push(old);
    }
    let at_op = st
        .log
        .get(k)
        .map(|o| o.describe())
        .unwrap_or_else(|| "none: the save ran to the end".into());
    for (variant, img) in images(st, full) {
        let seen = ev.eval(&variant, &img, &cands);
        let mut allowed: Vec<&str> = vec!["new"];
        if !acked {
            allowed.push(if scn.old.is_some() { "old" } else { "NotFound" });
        }
        // A stronger rule for some states (the documented error contract).
        if let Some((only, v)) = extra_rule {
            if variant.starts_with(v) {
                allowed = vec![only];
            }
        }
        let mut bad = match &seen {
            Seen::NotFound => !allowed.contains(&"NotFound"),
            Seen::Is(l, _) => !allowed.contains(l),
            Seen::Bad(_) => true,
        };
        let mut why = String::new();
        if let Seen::Is(l, got) = &seen {
            let want = match *l {
                "old" => scn.old.as_ref().map(|o| o.1.clone()),
                _ => id.clone(),
            };
            if want.as_deref() != Some(got.as_str()) {
                bad = true;
                why = format!(" with checkpoint id {got}, expected {want:?}");
            }
        }
        if scn.old.is_some() && img.get(NOTES).map(|v| &v[..]) != Some(NOTES_BODY) {
            bad = true;
            why.push_str(" and the user's notes.txt was lost or changed");
        }
        if bad {
            let detail = match &seen {
                Seen::Bad(m) => format!(": {}", shorten_ids(m)),
                _ => String::new(),
            };
            let summary = format!(
                "{tag}saw {}{}{} (allowed: {}{})",
                seen.label(),
                detail,
                why,
                allowed.join(" or "),
                if acked {
                    ", the save was acknowledged"
                } else {
                    ""
                },
            );
            failures.push(Failure {
                k,
                variant: variant.clone(),
                what: format!(
                    "{summary}; save returned {}; operation k: {}; files: [{}]",
                    describe_result(r),
                    at_op,
                    describe_image(&img)
                ),
                summary,
            });
        }
    }
}

// ---------------------------------------------------------------------------------------
// The enumeration.

struct Enumeration {
    /// Operations of an uninterrupted save.
    ops: Vec<OpRecord>,
    /// Index of the first cleanup operation (`list`).
    cleanup_at: usize,
    crash_points: usize,
    cases: usize,
    distinct: usize,
    by_variant: BTreeMap<String, usize>,
    failures: Vec<Failure>,
}

fn enumerate(
    scn: &Scenario,
    pool: &rayon::ThreadPool,
    disabled_sync: Option<usize>,
) -> Enumeration {
    let (r, st) = run(scn, pool, Fault::None, disabled_sync);
    let info = r.unwrap_or_else(|e| panic!("{}: the uninterrupted save failed: {e}", scn.label));
    assert_eq!(info.shards, NEW_SHARDS);
    let n = st.log.len();
    let ops = st.log.clone();
    let cleanup_at = ops
        .iter()
        .position(|o| o.kind == OpKind::List)
        .expect("the save lists the directory in cleanup");
    let mut ev = Evaluator::new();
    let mut failures = Vec::new();
    for k in 0..=n {
        let (r, st) = run(scn, pool, Fault::CrashFrom(k), disabled_sync);
        if r.is_ok() != (k >= cleanup_at) {
            failures.push(Failure {
                k,
                variant: "-".into(),
                summary: "wrong save result".into(),
                what: format!(
                    "save returned {} but the crash was {} cleanup (operation k: {})",
                    describe_result(&r),
                    if k >= cleanup_at { "in" } else { "before" },
                    st.log.get(k).map(|o| o.describe()).unwrap_or_default()
                ),
            });
        }
        check_state(scn, &mut ev, k, &st, &r, true, None, "", &mut failures);
        if k == n && scn.old.is_some() && disabled_sync.is_none() {
            // Cleanup removed the old shards and the leftover, and nothing else.
            let mut names: Vec<&str> = st.cur.keys().map(String::as_str).collect();
            names.sort();
            let mut want: Vec<String> = (0..NEW_SHARDS)
                .map(|i| ckptstore::write::shard_file_name(&info_id(&r), i))
                .collect();
            want.extend(["ckpt-manifest.json".to_string(), NOTES.to_string()]);
            want.sort();
            assert_eq!(names, want, "{}: files after a complete save", scn.label);
        }
    }
    Enumeration {
        ops,
        cleanup_at,
        crash_points: n + 1,
        cases: ev.cases,
        distinct: ev.distinct,
        by_variant: ev.by_variant.clone(),
        failures,
    }
}

fn info_id(r: &ckptstore::Result<CommitInfo>) -> String {
    r.as_ref().unwrap().checkpoint_id.clone()
}

fn report_failures(label: &str, f: &[Failure]) -> String {
    let mut s = format!("{label}: {} failing cases:\n", f.len());
    for x in f.iter().take(25) {
        s.push_str(&format!("  {x}\n"));
    }
    if f.len() > 25 {
        s.push_str(&format!("  ... and {} more\n", f.len() - 25));
    }
    s
}

fn check_enumeration(scn: &Scenario, threads: usize) -> Enumeration {
    let t = Instant::now();
    let e = enumerate(scn, &pool(threads), None);
    eprintln!(
        "{} ({threads} thread(s)): {} operations per save ({} before cleanup), {} crash points, {} cases checked ({} distinct images opened), {:.1?}\n  cases per variant: {:?}",
        scn.label,
        e.ops.len(),
        e.cleanup_at,
        e.crash_points,
        e.cases,
        e.distinct,
        t.elapsed(),
        e.by_variant
    );
    assert!(
        e.failures.is_empty(),
        "{}",
        report_failures(scn.label, &e.failures)
    );
    e
}

#[test]
fn crash_at_every_operation_first_save() {
    let scn = empty_dir();
    let e = check_enumeration(&scn, 1);
    for o in &e.ops {
        eprintln!("  {}", o.describe());
    }
    assert!(e.cases >= 300, "only {} cases", e.cases);
}

#[test]
fn crash_at_every_operation_over_committed_checkpoint() {
    let scn = over_old();
    let e = check_enumeration(&scn, 1);
    for o in &e.ops {
        eprintln!("  {}", o.describe());
    }
    assert!(e.cases >= 500, "only {} cases", e.cases);
}

/// The same enumeration with the shards written by several rayon threads at once: the
/// model's `create` of each temporary shard waits until all of them have been called, so
/// every shard runs on its own thread, and then their creates, writes, fsyncs and renames
/// take turns (round-robin), so a crash point can fall with every shard half-written.
#[test]
fn parallel_shard_writes_interleaved() {
    let scn = over_old();
    let threads = NEW_SHARDS + 1;
    let (r, st) = run(&scn, &pool(threads), Fault::None, None);
    r.unwrap();
    assert!(
        !st.parallel.as_ref().unwrap().timed_out,
        "the shards did not run on separate threads"
    );
    let ids: std::collections::BTreeSet<&str> = st.log.iter().map(|o| o.thread.as_str()).collect();
    let switches = st
        .log
        .windows(2)
        .filter(|w| w[0].thread != w[1].thread)
        .count();
    eprintln!(
        "parallel: {} threads performed the operations of one save; the log switches thread {switches} times",
        ids.len()
    );
    assert!(
        ids.len() >= NEW_SHARDS,
        "the shards were not written by separate threads"
    );
    let e = check_enumeration(&scn, threads);
    assert!(e.cases >= 500, "only {} cases", e.cases);
}

// ---------------------------------------------------------------------------------------
// Necessity of each fsync.

fn category(variant: &str) -> &str {
    variant.split(' ').next().unwrap_or(variant)
}

#[test]
fn every_fsync_is_necessary() {
    let t = Instant::now();
    let scn = over_old();
    let p = pool(1);
    let (_, st) = run(&scn, &p, Fault::None, None);
    let syncs: Vec<OpRecord> = st.log.iter().filter(|o| o.is_sync()).cloned().collect();
    assert_eq!(
        syncs.len(),
        NEW_SHARDS + 1 + 2,
        "a fsync per shard, the manifest's, 2 directory fsyncs"
    );
    let mut total = 0;
    let mut not_necessary = Vec::new();
    for (j, s) in syncs.iter().enumerate() {
        let e = enumerate(&scn, &p, Some(j));
        total += e.cases;
        let mut by: BTreeMap<&str, usize> = BTreeMap::new();
        for f in &e.failures {
            *by.entry(category(&f.variant)).or_default() += 1;
        }
        eprintln!(
            "sync {j} ({}) disabled: {} of {} cases fail; failing cases per variant {:?}",
            s.describe(),
            e.failures.len(),
            e.cases,
            by
        );
        if e.failures.is_empty() {
            not_necessary.push(s.describe());
        }
        // The earliest catch of each variant.
        for cat in by.keys() {
            let f = e
                .failures
                .iter()
                .filter(|f| category(&f.variant) == *cat)
                .min_by_key(|f| f.k)
                .unwrap();
            let op = e
                .ops
                .get(f.k)
                .map(|o| o.describe())
                .unwrap_or_else(|| "end".into());
            eprintln!(
                "    {:<9} first at k={} (crash before {}), {}: {}",
                cat, f.k, op, f.variant, f.summary
            );
        }
        if !e.failures.is_empty() && e.failures.iter().all(|f| f.variant.starts_with("E-")) {
            eprintln!("    NOT caught by variants A-D: only by E (directory operations reaching the disk out of order)");
        }
    }
    eprintln!(
        "fsync necessity: {} syncs, {total} cases in all, {:.1?}",
        syncs.len(),
        t.elapsed()
    );
    assert!(
        not_necessary.is_empty(),
        "no crash point/variant fails when these fsyncs are no-ops: {not_necessary:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Errno injection.

fn errno_name(e: i32) -> &'static str {
    match e {
        EIO => "EIO",
        ENOSPC => "ENOSPC",
        EACCES => "EACCES",
        _ => "?",
    }
}

fn same_op(a: &OpRecord, b: &OpRecord) -> bool {
    // Same kind of operation on the same names, ids masked (every run draws a new id, and
    // the manifest's length varies with the decimal header CRCs it holds).
    let key = |o: &OpRecord| match &o.kind {
        OpKind::Create { name, .. } => format!("create {}", shorten_ids(name)),
        OpKind::Write { name, offset, .. } => format!("write {} @{offset}", shorten_ids(name)),
        OpKind::Sync { name, .. } => format!("sync {}", shorten_ids(name)),
        OpKind::Rename { from, to } => format!("rename {} {}", shorten_ids(from), shorten_ids(to)),
        OpKind::SyncDir => "sync_dir".into(),
        OpKind::Remove { name } => format!("remove {}", shorten_ids(name)),
        OpKind::List => "list".into(),
        OpKind::Read { name } => format!("read {}", shorten_ids(name)),
    };
    key(a) == key(b)
}

#[test]
fn injected_errors_leave_old_or_new_and_fsync_is_never_retried() {
    let t = Instant::now();
    let p = pool(1);
    let mut runs = 0;
    let mut cases = 0;
    let mut ok_in_cleanup = 0;
    let mut failures = Vec::new();
    for scn in [empty_dir(), over_old()] {
        let (_, reference) = run(&scn, &p, Fault::None, None);
        let n = reference.log.len();
        let last_sync_dir = reference
            .log
            .iter()
            .rposition(|o| o.kind == OpKind::SyncDir)
            .unwrap();
        let mut ev = Evaluator::new();
        for k in 0..n {
            let op = &reference.log[k];
            let in_cleanup = matches!(op.kind, OpKind::List | OpKind::Remove { .. });
            for errno in [EIO, ENOSPC, EACCES] {
                for (mode, fault) in [
                    ("once", Fault::ErrnoOnce(k, errno)),
                    ("forever", Fault::ErrnoFrom(k, errno)),
                ] {
                    runs += 1;
                    let (r, st) = run(&scn, &p, fault, None);
                    let ctx = format!(
                        "{}: {} {mode} at operation k={k} ({})",
                        scn.label,
                        errno_name(errno),
                        op.describe()
                    );
                    assert!(
                        same_op(&st.log[k], op),
                        "{ctx}: the run diverged: {}",
                        st.log[k].describe()
                    );
                    assert!(
                        matches!(st.log[k].result, OpResult::Failed(_)),
                        "{ctx}: the operation was not failed"
                    );
                    // Ok exactly when the failure hit cleanup, which the writer ignores.
                    match &r {
                        Ok(_) if in_cleanup => ok_in_cleanup += 1,
                        Ok(_) => panic!("{ctx}: save returned Ok although a protocol step failed"),
                        Err(e) if in_cleanup => {
                            panic!("{ctx}: a cleanup failure failed the save: {e}")
                        }
                        Err(Error::Io { source, .. }) => assert_eq!(
                            source.raw_os_error(),
                            Some(errno),
                            "{ctx}: the error does not carry the errno: {source}"
                        ),
                        Err(e) => panic!("{ctx}: not an I/O error: {e}"),
                    }
                    // A failed fsync is never retried.
                    for (i, o) in st.log.iter().enumerate() {
                        if !matches!(o.result, OpResult::Failed(_)) {
                            continue;
                        }
                        let retried = st.log[i + 1..].iter().find(|l| match (&o.kind, &l.kind) {
                            (OpKind::Sync { ino: a, .. }, OpKind::Sync { ino: b, .. }) => a == b,
                            (OpKind::SyncDir, OpKind::SyncDir) => true,
                            _ => false,
                        });
                        assert!(
                            retried.is_none(),
                            "{ctx}: {} failed and was retried as {}",
                            o.describe(),
                            retried.unwrap().describe()
                        );
                    }
                    // After an error the directory holds the old checkpoint (none for a
                    // first save), except when only the final directory fsync failed.
                    let rule = if r.is_ok() {
                        None
                    } else if k == last_sync_dir {
                        Some(("new", "A "))
                    } else {
                        Some((if scn.old.is_some() { "old" } else { "NotFound" }, "A "))
                    };
                    let before = ev.cases;
                    let tag = format!("[{} {mode}] ", errno_name(errno));
                    check_state(
                        &scn,
                        &mut ev,
                        k,
                        &st,
                        &r,
                        r.is_ok(),
                        rule,
                        &tag,
                        &mut failures,
                    );
                    cases += ev.cases - before;
                }
            }
        }
    }
    eprintln!(
        "errno injection: {runs} saves ({ok_in_cleanup} returned Ok: the failure hit cleanup), {cases} images checked, {:.1?}",
        t.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{}",
        report_failures("errno injection", &failures)
    );
    assert!(cases >= 300);
}
