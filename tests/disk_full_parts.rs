//! ENOSPC and EIO at every file-system operation of a multi-rank save (issue 27 §3;
//! format-spec/global.md §Parts, §The commit; format-spec/durability.md §Cleanup, §What
//! `save` returns), through `write_part_with_fs` and `commit_with_fs` over the model of
//! tests/common/simfs.rs. tests/disk_full.rs does the same for a single-process save and
//! tests/crash_commit.rs crashes this path; here the operations *fail* and the process goes
//! on.
//!
//! The directory holds a committed, settled checkpoint A (2 shards) and a user's file. A
//! multi-rank save of checkpoint B (rank 0's part, rank 1's part, then the coordinator's
//! commit: one sequence of file-system operations) is run with its k-th operation failing,
//! for every k from 0 to past the end, with ENOSPC and with EIO, once (a transient error)
//! and from the k-th on (a full disk or a dead device: every later operation fails too,
//! removals included). After each attempt:
//!
//! * the sequence returns `Ok` exactly when the failure can only hit what is ignored by
//!   design (the listings for leftovers that each rank and the commit make first, the
//!   cleanup after the commit point), and an error otherwise: an `Error::Io` carrying the
//!   injected errno, whose operation and path are those of an operation that failed (never
//!   a panic, never another variant: C2's shard reads included);
//! * the directory as readers see it, and as it would be after a power loss right after the
//!   error, opens and verifies as exactly A or exactly B, every tensor bit-identical, with
//!   the right checkpoint id: B as readers see it exactly when B's manifest rename happened,
//!   B after a power loss only when the commit returned `Ok`; never a mix, never nothing.
//!   Both outcomes are counted;
//! * the files are A's (or, after the commit point, B's), the parts that ranks returned,
//!   and nothing else except files whose removal failed (a failed cleanup leaves garbage,
//!   never damage);
//! * with the faults gone, the job retried as a real job would do it succeeds: the same id,
//!   the ranks whose `write_part` failed write their part again and the commit runs (again)
//!   with every part; and, on the same failed state, a fresh multi-rank save with a new id
//!   succeeds. Afterwards the directory holds exactly the committed manifest, its shards and
//!   the user's file: no `.ckpt-tmp-*`, no part descriptor, no shard of another id.
//!
//! Everything runs in a one-thread rayon pool: the operation order, and so the fault points,
//! are deterministic.
//!
//! The sweeps found two bugs in src/write/parts.rs: an EIO or ENOSPC reading a rank's shard
//! header in C2 was reported as `ShardMismatch` ("cannot open"), and a rank retried with the
//! same id after its removals had failed met its own temporary files ("create: File
//! exists") on every retry.

#[path = "common/simfs.rs"]
mod simfs;
#[path = "common/two_ranks.rs"]
mod two_ranks;

use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::Instant;

use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::write::{is_engine_file, TEMP_PREFIX};
use ckptstore::{CommitInfo, Error, Part, SaveOptions};
use simfs::*;
use two_ranks::*;

const DIR: &str = "/sim/ckpt";
const NOTES: &str = "notes.txt";
const NOTES_BODY: &[u8] = b"a user's file: never touched by the engine";
const MANIFEST: &str = "ckpt-manifest.json";

fn dir() -> &'static Path {
    Path::new(DIR)
}

/// A settled directory holding A (saved through the model) and the user's file.
fn with_a() -> (SimState, String) {
    let fs = SimFs::new(dir(), SimState::default());
    let a = a_tensors();
    let opts = SaveOptions {
        max_shard_size: 13000,
        metadata: serde_json::json!({ "gen": "old" }),
        ..Default::default()
    };
    let info = pool()
        .install(|| {
            ckptstore::save(
                &ckptstore::store::LocalStore::new(&fs, dir()),
                &refs(&a),
                &opts,
            )
        })
        .unwrap();
    assert_eq!(info.shards, 2);
    let mut st = fs.snapshot();
    st.settle();
    st.add_durable_file(NOTES, NOTES_BODY);
    (st, info.checkpoint_id)
}

/// Where a multi-rank save stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// This rank's `write_part` failed.
    Rank(u32),
    /// Both parts were written; the commit ran.
    Commit,
}

/// What one run of a multi-rank save did.
struct Job {
    /// The parts the ranks returned, in rank order.
    parts: Vec<Part>,
    stage: Stage,
    /// The failed `write_part`'s error, or the commit's result.
    result: ckptstore::Result<CommitInfo>,
    /// The model's log length when each call started (rank 0, rank 1, the commit).
    marks: Vec<usize>,
}

/// A multi-rank save of `id` on `fs` as a job runs it: every rank without a part in `have`
/// writes its part (the first error stops the job), then the commit of all parts.
fn run_job(fs: &SimFs, id: &str, b: &BData, have: &[Part]) -> Job {
    let mut parts = have.to_vec();
    let mut marks = Vec::new();
    let pool = pool();
    for r in 0..2u32 {
        if parts.iter().any(|p| p.rank == r) {
            continue;
        }
        marks.push(fs.lock().log.len());
        match pool.install(|| {
            ckptstore::write_part(
                &ckptstore::store::LocalStore::new(fs, dir()),
                id,
                r,
                &items(b, r),
                &part_opts(),
            )
        }) {
            Ok(p) => parts.push(p),
            Err(e) => {
                return Job {
                    parts,
                    stage: Stage::Rank(r),
                    result: Err(e),
                    marks,
                }
            }
        }
    }
    parts.sort_by_key(|p| p.rank);
    marks.push(fs.lock().log.len());
    let result = pool.install(|| {
        ckptstore::commit(
            &ckptstore::store::LocalStore::new(fs, dir()),
            id,
            &parts,
            &commit_opts(),
        )
    });
    Job {
        parts,
        stage: Stage::Commit,
        result,
        marks,
    }
}

/// `run_job`, a panic turned into an error message.
fn run_job_caught(fs: &SimFs, id: &str, b: &BData, have: &[Part]) -> Result<Job, String> {
    catch_unwind(AssertUnwindSafe(|| run_job(fs, id, b, have))).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("panicked: {msg}")
    })
}

/// The files of a committed multi-rank checkpoint: its shards, the manifest, the user's file.
fn committed_files(parts: &[Part]) -> BTreeSet<String> {
    let mut s: BTreeSet<String> = parts
        .iter()
        .flat_map(|p| p.shards.iter().map(|sh| sh.file.clone()))
        .collect();
    s.insert(MANIFEST.to_string());
    s.insert(NOTES.to_string());
    s
}

/// The files a written part leaves: its shards and its descriptor.
fn part_files(p: &Part) -> impl Iterator<Item = String> + '_ {
    p.shards
        .iter()
        .map(|s| s.file.clone())
        .chain(std::iter::once(p.file_name()))
}

fn names(st: &SimState) -> BTreeSet<String> {
    st.cur.keys().cloned().collect()
}

/// The operation name and path an `Error::Io` for this model operation carries
/// (src/store/local.rs; a directory fsync's operation says what it guards).
fn io_of(o: &OpRecord) -> (&'static str, String) {
    let p = |n: &str| format!("{DIR}/{n}");
    match &o.kind {
        OpKind::Create { name, .. } => ("create", p(name)),
        OpKind::Write { name, .. } => ("write", p(name)),
        OpKind::Sync { name, .. } => ("fsync", p(name)),
        OpKind::Rename { from, .. } => ("rename", p(from)),
        OpKind::SyncDir => ("fsync directory", DIR.to_string()),
        OpKind::Remove { name } => ("remove", p(name)),
        OpKind::List => ("list", DIR.to_string()),
        OpKind::Read { name } => ("read", p(name)),
    }
}

/// The error must be `Error::Io` with the injected errno, naming the operation and path of
/// an operation that failed.
fn check_error(e: &Error, errno: i32, log: &[OpRecord]) -> Result<(), String> {
    let Error::Io { op, path, source } = e else {
        return Err(format!("not Error::Io: {e:?} ({e})"));
    };
    if source.raw_os_error() != Some(errno) {
        return Err(format!(
            "errno {:?}, not {errno}: {e}",
            source.raw_os_error()
        ));
    }
    let path = path.display().to_string();
    let matches = log.iter().filter(|o| !o.ok()).any(|o| {
        let (want_op, want_path) = io_of(o);
        op.starts_with(want_op) && path == want_path
    });
    if !matches {
        return Err(format!("{e}: names no operation that failed"));
    }
    if !e.to_string().contains(&path) {
        return Err(format!("the message does not name the path: {e}"));
    }
    Ok(())
}

/// Names whose `remove` failed in `log`: the garbage a failed cleanup may leave.
fn failed_removes(log: &[OpRecord]) -> BTreeSet<String> {
    log.iter()
        .filter(|o| !o.ok())
        .filter_map(|o| match &o.kind {
            OpKind::Remove { name } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

/// The manifest rename happened (readers see B).
fn renamed(log: &[OpRecord]) -> bool {
    log.iter()
        .any(|o| o.ok() && matches!(&o.kind, OpKind::Rename { to, .. } if to == MANIFEST))
}

/// `fs`'s state with the faults gone (the disk has room again, the device answers), its log
/// forgotten: the start of a retry.
fn healed(st: &SimState) -> SimFs {
    let mut st = st.clone();
    st.fault = Fault::None;
    st.log.clear();
    SimFs::new(dir(), st)
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Only the k-th operation fails (a transient error).
    Once,
    /// The k-th and every later operation fails (a full disk, a dead device).
    From,
}

/// Classify the images of `st` (readers' view, power-loss view) against A and B; returns
/// the labels or what is wrong.
fn outcome(
    ev: &mut Evaluator,
    st: &SimState,
    cands: &[&Expected],
    ids: &[(&str, &str)],
) -> Result<[&'static str; 2], String> {
    let imgs = images(st, false);
    assert_eq!(imgs.len(), 2);
    let mut out = ["", ""];
    for (i, (variant, img)) in imgs.iter().enumerate() {
        if img.get(NOTES).map(|v| &v[..]) != Some(NOTES_BODY) {
            return Err(format!("{variant}: the user's file was lost or changed"));
        }
        match ev.eval(variant, img, cands) {
            Seen::Is(l, id) if ids.iter().any(|&(a, i)| a == l && i == id) => out[i] = l,
            seen => {
                return Err(format!(
                    "{variant}: saw {} {seen:?} (allowed {ids:?}); files [{}]",
                    seen.label(),
                    describe_image(img)
                ))
            }
        }
    }
    Ok(out)
}

/// One sweep: the multi-rank save of B failing with `errno` at every operation.
fn sweep(errno: i32, mode: Mode) {
    let t0 = Instant::now();
    let what = format!(
        "{} {mode:?}",
        if errno == ENOSPC { "ENOSPC" } else { "EIO" }
    );
    let b = b_data();
    let (base, a_id) = with_a();
    let a = expected("old", a_tensors());
    let bx = b_expected(&b);
    let cands = [&bx, &a];
    let a_files = names(&base);
    let id = new_checkpoint_id().unwrap();

    // The sequence without faults.
    let fs = SimFs::new(dir(), base.clone());
    let job = run_job(&fs, &id, &b, &[]);
    let info = job.result.expect("the save without faults");
    assert_eq!((info.shards, info.tensors), (4, 7));
    let full = fs.snapshot();
    let log = full.log.clone();
    let n = log.len();
    assert_eq!(names(&full), committed_files(&job.parts));
    let [rank1_from, commit_from] = [job.marks[1], job.marks[2]];
    let rename_at = log
        .iter()
        .position(|o| matches!(&o.kind, OpKind::Rename { to, .. } if to == MANIFEST))
        .expect("the manifest rename");
    let point_at = rename_at + 1;
    assert_eq!(log[point_at].kind, OpKind::SyncDir, "the commit point");
    // Before the commit, the only operations whose failure is ignored are each rank's
    // listing for its own leftovers, its first operation.
    for (i, o) in log[..commit_from].iter().enumerate() {
        let ignored = matches!(o.kind, OpKind::List | OpKind::Remove { .. });
        assert_eq!(ignored, i == 0 || i == rank1_from, "{}", o.describe());
    }

    let mut ev = Evaluator::new();
    let mut failures: Vec<String> = Vec::new();
    let (mut errs, mut oks) = (0usize, 0usize);
    // Per stage that failed: rank 0, rank 1, commit.
    let mut err_at = [0usize; 3];
    // Readers' view / power-loss view: old, new.
    let (mut cur_old, mut cur_new, mut dur_old, mut dur_new) = (0usize, 0, 0, 0);
    let (mut same_retries, mut fresh_saves, mut garbage_left) = (0usize, 0, 0);
    // Errors after which readers see B (the manifest rename happened).
    let mut undetermined = 0usize;
    let mut errors_seen: BTreeSet<String> = BTreeSet::new();

    for k in 0..=n {
        let at = log
            .get(k)
            .map_or("none (past the end)".to_string(), |o| o.describe());
        let ctx = format!("{what} at k={k} ({at})");
        let mut st = base.clone();
        st.fault = match mode {
            Mode::Once => Fault::ErrnoOnce(k, errno),
            Mode::From => Fault::ErrnoFrom(k, errno),
        };
        let fs = SimFs::new(dir(), st);
        let job = match run_job_caught(&fs, &id, &b, &[]) {
            Ok(j) => j,
            Err(e) => {
                failures.push(format!("{ctx}: {e}"));
                continue;
            }
        };
        let st = fs.snapshot();
        st.check_invariant();

        // What it returned.
        let expect_ok = match mode {
            Mode::Once => log
                .get(k)
                .is_none_or(|o| matches!(o.kind, OpKind::List | OpKind::Remove { .. })),
            Mode::From => k > point_at,
        };
        match &job.result {
            Ok(_) if !expect_ok => failures.push(format!("{ctx}: returned Ok")),
            Ok(_) => oks += 1,
            Err(e) if expect_ok => failures.push(format!("{ctx}: failed: {e}")),
            Err(e) => {
                errs += 1;
                err_at[match job.stage {
                    Stage::Rank(r) => r as usize,
                    Stage::Commit => 2,
                }] += 1;
                if let Err(why) = check_error(e, errno, &st.log) {
                    failures.push(format!("{ctx}: {why}"));
                }
                errors_seen.insert(shorten_ids(&match e {
                    Error::Io { op, .. } => op.to_string(),
                    other => format!("{other:?}"),
                }));
            }
        }
        let ok = job.result.is_ok();

        // What readers see, and what a power loss right now would leave.
        let did_rename = renamed(&st.log);
        let allowed: Vec<(&str, &str)> = if ok {
            vec![("new", id.as_str())]
        } else if did_rename {
            vec![("new", id.as_str()), ("old", a_id.as_str())]
        } else {
            vec![("old", a_id.as_str())]
        };
        match outcome(&mut ev, &st, &cands, &allowed) {
            Ok([cur, dur]) => {
                if (cur == "new") != did_rename {
                    failures.push(format!(
                        "{ctx}: readers see {cur}, the manifest rename {}",
                        if did_rename {
                            "happened"
                        } else {
                            "did not happen"
                        }
                    ));
                }
                if cur == "new" {
                    cur_new += 1;
                    undetermined += usize::from(!ok);
                } else {
                    cur_old += 1
                }
                if dur == "new" {
                    dur_new += 1
                } else {
                    dur_old += 1
                }
            }
            Err(e) => failures.push(format!("{ctx}: {e}")),
        }

        // The files left: nothing but the committed checkpoint's, the parts the ranks
        // returned (before the commit point), and files whose removal failed.
        let now = names(&st);
        let want: BTreeSet<String> = if ok {
            committed_files(&job.parts)
        } else {
            let mut w = a_files.clone();
            w.extend(job.parts.iter().flat_map(part_files));
            w
        };
        let lost: Vec<&String> = want.difference(&now).collect();
        if !lost.is_empty() {
            failures.push(format!("{ctx}: files lost: {lost:?}"));
        }
        let removes_failed = failed_removes(&st.log);
        let sweep_list_failed = ok
            && st
                .log
                .iter()
                .skip(point_at + 1)
                .any(|o| o.kind == OpKind::List && !o.ok());
        let extra: Vec<&String> = now
            .difference(&want)
            .filter(|n| {
                let explained =
                    removes_failed.contains(*n) || (sweep_list_failed && is_engine_file(n));
                !explained
            })
            .collect();
        if !extra.is_empty() {
            failures.push(format!(
                "{ctx}: files left that no failed removal explains: {:?}; files [{}]",
                extra.iter().map(|n| shorten_ids(n)).collect::<Vec<_>>(),
                describe_image(&images(&st, false)[0].1)
            ));
        }
        if now.difference(&want).next().is_some() {
            garbage_left += 1;
        }

        // Retry with the faults gone. The same job: the ranks without a part write it
        // again, and the commit (re)runs over every part.
        if !ok {
            let fs = healed(&st);
            match run_job_caught(&fs, &id, &b, &job.parts) {
                Ok(Job {
                    parts,
                    result: Ok(_),
                    ..
                }) => {
                    let after = fs.snapshot();
                    match outcome(&mut ev, &after, &cands, &[("new", id.as_str())]) {
                        Ok(_) => {}
                        Err(e) => failures.push(format!("{ctx}, then the retry: {e}")),
                    }
                    if names(&after) != committed_files(&parts) {
                        failures.push(format!(
                            "{ctx}, then the retry left [{}]",
                            describe_image(&images(&after, false)[0].1)
                        ));
                    }
                    same_retries += 1;
                }
                Ok(Job {
                    stage,
                    result: Err(e),
                    ..
                }) => failures.push(format!(
                    "{ctx}: the retry of the same job failed at {stage:?}: {e}; files were [{}]",
                    describe_image(&images(&st, false)[0].1)
                )),
                Err(e) => failures.push(format!("{ctx}: the retry of the same job {e}")),
            }
        }

        // A fresh multi-rank save (a new id) on the state the attempt left.
        let fs = healed(&st);
        let c_id = new_checkpoint_id().unwrap();
        match run_job_caught(&fs, &c_id, &b, &[]) {
            Ok(Job {
                parts,
                result: Ok(_),
                ..
            }) => {
                let after = fs.snapshot();
                if let Err(e) = outcome(&mut ev, &after, &cands, &[("new", c_id.as_str())]) {
                    failures.push(format!("{ctx}, then a fresh save: {e}"));
                }
                if names(&after) != committed_files(&parts) {
                    failures.push(format!(
                        "{ctx}, then a fresh save left [{}]",
                        describe_image(&images(&after, false)[0].1)
                    ));
                }
                fresh_saves += 1;
            }
            Ok(Job {
                stage,
                result: Err(e),
                ..
            }) => failures.push(format!("{ctx}: a fresh save failed at {stage:?}: {e}")),
            Err(e) => failures.push(format!("{ctx}: a fresh save {e}")),
        }
    }
    let shown = failures.len().min(40);
    assert!(
        failures.is_empty(),
        "{what}: {} failures, the first {shown}:\n{}",
        failures.len(),
        failures[..shown].join("\n")
    );
    let points = n + 1;
    eprintln!(
        "{what}: {n} operations ({} of rank 0, {} of rank 1, {} of the commit; manifest rename #{rename_at}, commit point #{point_at}), {points} fault points: {errs} errors (rank 0 {}, rank 1 {}, commit {}; {undetermined} after the manifest rename), {oks} Ok; readers saw old {cur_old} / new {cur_new}, after a power loss old {dur_old} / new {dur_new}; garbage left by a failed removal {garbage_left}; {same_retries} retries of the same job and {fresh_saves} fresh saves committed; {} images checked ({} distinct); errors: {errors_seen:?}; {:.1} s",
        rank1_from,
        commit_from - rank1_from,
        n - commit_from,
        err_at[0],
        err_at[1],
        err_at[2],
        ev.cases,
        ev.distinct,
        t0.elapsed().as_secs_f64()
    );
    // Not vacuous: every operation up to past the commit point was a fault point, each of
    // the three calls failed, and both outcomes were seen.
    assert!(points > point_at + 1, "{points} fault points");
    assert!(
        err_at.iter().all(|&c| c > 0),
        "errors per stage: {err_at:?}"
    );
    // An error for every k up to the commit point, except (once) at the listings whose
    // failure is ignored: each rank's and the commit's own look for leftovers.
    let ignored = log[..=point_at]
        .iter()
        .filter(|o| o.kind == OpKind::List)
        .count();
    assert_eq!(ignored, 3);
    match mode {
        Mode::From => assert_eq!(errs, point_at + 1),
        Mode::Once => assert_eq!(errs, point_at + 1 - ignored),
    }
    assert!(cur_old > 0 && cur_new > 0, "old {cur_old}, new {cur_new}");
    assert!(oks > 0 && dur_new > 0);
    assert_eq!(same_retries, errs);
    assert_eq!(fresh_saves, points);
    // The one error after which readers see B: the commit point's directory fsync.
    assert_eq!(undetermined, 1);
}

#[test]
fn enospc_once_at_every_operation_of_a_multi_rank_save() {
    sweep(ENOSPC, Mode::Once);
}

#[test]
fn enospc_from_every_operation_of_a_multi_rank_save() {
    sweep(ENOSPC, Mode::From);
}

#[test]
fn eio_once_at_every_operation_of_a_multi_rank_save() {
    sweep(EIO, Mode::Once);
}

#[test]
fn eio_from_every_operation_of_a_multi_rank_save() {
    sweep(EIO, Mode::From);
}

/// On the real file system: a rank retried with the same id after an attempt that left its
/// temporary files (its removals failed, or it was killed) writes its part; the temporary
/// files of other ranks (`-r1-`, and `-r10-` which shares the prefix digit) and of other
/// ids are left alone, since those writers may still be running.
#[test]
fn a_rank_retried_with_the_same_id_replaces_its_own_leftover_temporary_files() {
    use ckptstore::commit;
    use ckptstore::write_part;
    let b = b_data();
    let d = tempfile::tempdir().unwrap();
    let id = new_checkpoint_id().unwrap();
    let other = new_checkpoint_id().unwrap();
    let own = [
        format!(".ckpt-tmp-shard-{id}-r0-0.safetensors"),
        format!(".ckpt-tmp-shard-{id}-r0-1.safetensors"),
        format!(".ckpt-tmp-part-{id}-r0.json"),
    ];
    let foreign = [
        format!(".ckpt-tmp-shard-{id}-r1-0.safetensors"),
        format!(".ckpt-tmp-shard-{id}-r10-0.safetensors"),
        format!(".ckpt-tmp-part-{id}-r10.json"),
        format!(".ckpt-tmp-shard-{other}-r0-0.safetensors"),
        format!(".ckpt-tmp-shard-{id}-r0-x.safetensors"),
    ];
    for n in own.iter().chain(&foreign) {
        std::fs::write(d.path().join(n), b"partial").unwrap();
    }
    let p0 = write_part(d.path(), &id, 0, &items(&b, 0), &part_opts())
        .expect("rank 0's own leftovers must not block its retry");
    for n in &own {
        assert!(!d.path().join(n).exists(), "{n} is left");
    }
    for n in &foreign {
        assert!(d.path().join(n).exists(), "{n} was removed");
    }
    let p1 = write_part(d.path(), &id, 1, &items(&b, 1), &part_opts()).unwrap();
    // The commit, under the exclusive lock, removes every other temporary file.
    commit(d.path(), &id, &[p0, p1], &commit_opts()).unwrap();
    assert_eq!(classify(d.path(), &[&b_expected(&b)]), Seen::Is("new", id));
    let left: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(TEMP_PREFIX) || n.starts_with("part-"))
        .collect();
    assert!(left.is_empty(), "left {left:?}");
}
