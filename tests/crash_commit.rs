//! Crash consistency of the multi-rank commit (format-spec/global.md §The commit, C1-C6;
//! format-spec/durability.md) under the POSIX model of tests/common/simfs.rs, driven through
//! `write_part_with_fs` and `commit_with_fs`.
//!
//! The directory holds a committed checkpoint A (written by a save through the model, then
//! settled) and a user file. Two ranks write their parts of checkpoint B through the model
//! (their shards and descriptors fsynced and the directory fsynced, as `write_part` does).
//! Then:
//!
//! * the coordinator's commit of B is crashed at its k-th operation for every k (every
//!   operation from the k-th on fails, with no effect), and every power-loss image variant of
//!   simfs (A current, B unsynced data dropped, C torn last write, D directory operations
//!   lost, their combinations, E some pending directory operations lost, in any order) must
//!   open and verify as exactly A or exactly B (with the right checkpoint id); a commit that
//!   returned `Ok` must be B in every image; both A and B must be seen. On every distinct
//!   image, after the reboot, committing B's parts again succeeds and gives B, and so does a
//!   fresh save;
//! * rank 1's `write_part` is crashed at every operation (rank 0's part written): every
//!   image must be exactly A; on every distinct image, a new multi-rank save (a new id) then
//!   commits, and removes the dead attempt's files.
//!
//! Everything runs in a one-thread rayon pool: the operation order, and so the crash points,
//! are deterministic. Nothing depends on timing.

#[path = "common/simfs.rs"]
mod simfs;
#[path = "common/two_ranks.rs"]
mod two_ranks;

use std::collections::HashSet;
use std::path::Path;

use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::write::parts::Layout;
use ckptstore::{CommitInfo, CommitOptions, Part, SaveOptions};
use simfs::*;
use two_ranks::*;

const DIR: &str = "/sim/ckpt";
const NOTES: &str = "notes.txt";
const NOTES_BODY: &[u8] = b"a user's file: never touched by the engine";

fn dir() -> &'static Path {
    Path::new(DIR)
}

fn save_opts(gen: &str) -> SaveOptions {
    SaveOptions {
        max_shard_size: 13000,
        metadata: serde_json::json!({ "gen": gen }),
        ..Default::default()
    }
}

fn write_part_sim(fs: &SimFs, id: &str, rank: u32, b: &BData) -> ckptstore::Result<Part> {
    pool().install(|| {
        ckptstore::write_part(
            &ckptstore::store::LocalStore::new(fs, dir()),
            id,
            rank,
            &items(b, rank),
            &part_opts(),
        )
    })
}

/// All ranks' parts of a new checkpoint id, then the commit, on `fs` without faults.
fn multi_rank_save(fs: &SimFs, b: &BData) -> (String, CommitInfo) {
    let id = new_checkpoint_id().unwrap();
    let parts: Vec<Part> = (0..2)
        .map(|r| write_part_sim(fs, &id, r, b).unwrap())
        .collect();
    let info = ckptstore::commit(
        &ckptstore::store::LocalStore::new(fs, dir()),
        &id,
        &parts,
        &commit_opts(),
    )
    .unwrap();
    (id, info)
}

/// A settled directory holding A (saved through the model) and the user's file.
fn with_a() -> (SimState, String) {
    let fs = SimFs::new(dir(), SimState::default());
    let a = a_tensors();
    let info = pool()
        .install(|| {
            ckptstore::save(
                &ckptstore::store::LocalStore::new(&fs, dir()),
                &refs(&a),
                &save_opts("old"),
            )
        })
        .unwrap();
    assert_eq!(info.shards, 2);
    let mut st = fs.snapshot();
    st.settle();
    st.add_durable_file(NOTES, NOTES_BODY);
    (st, info.checkpoint_id)
}

/// `write_part` leaves everything it wrote durable: settling only forgets the log.
fn settle_durable(st: &mut SimState) {
    assert!(st.pending.is_empty(), "directory operations not fsynced");
    assert_eq!(st.dur, st.cur, "directory entries not durable");
    for (name, &ino) in &st.cur {
        let i = &st.inodes[ino];
        assert_eq!(i.durable, i.current, "{name}: content not durable");
    }
    st.settle();
}

/// A machine rebooted on `img`: every file durable, no log.
fn rebooted(img: &Image) -> SimFs {
    let mut st = SimState::default();
    for (name, bytes) in img {
        st.add_durable_file(name, bytes);
    }
    SimFs::new(dir(), st)
}

fn current_image(fs: &SimFs) -> Image {
    images(&fs.snapshot(), false).swap_remove(0).1
}

/// Check one image: exactly one of `allowed` (label, checkpoint id), and the user's file.
fn check_image(
    ev: &mut Evaluator,
    variant: &str,
    img: &Image,
    cands: &[&Expected],
    allowed: &[(&str, &str)],
) -> Result<&'static str, String> {
    let seen = ev.eval(variant, img, cands);
    if img.get(NOTES).map(|v| &v[..]) != Some(NOTES_BODY) {
        return Err("the user's notes.txt was lost or changed".into());
    }
    match &seen {
        Seen::Is(l, id) if allowed.iter().any(|&(a, i)| a == *l && i == id.as_str()) => Ok(l),
        _ => Err(format!(
            "saw {} {:?} (allowed: {allowed:?}); files: [{}]",
            seen.label(),
            seen,
            describe_image(img)
        )),
    }
}

#[test]
fn crash_at_every_operation_of_the_coordinators_commit() {
    coordinator_crash_sweep(Layout::Flat);
}

/// The same sweep for a two-level root (format-spec/global.md §The two-level manifest):
/// the part descriptors become part of the checkpoint, the root is still written last.
#[test]
fn crash_at_every_operation_of_a_two_level_commit() {
    coordinator_crash_sweep(Layout::TwoLevel);
}

fn coordinator_crash_sweep(layout: Layout) {
    let copts = CommitOptions {
        layout,
        ..commit_opts()
    };
    let commit_opts = || copts.clone();
    let b = b_data();
    let (base_a, a_id) = with_a();
    let a = expected("old", a_tensors());
    let bx = b_expected(&b);
    let fs = SimFs::new(dir(), base_a);
    let id = new_checkpoint_id().unwrap();
    let parts: Vec<Part> = (0..2)
        .map(|r| write_part_sim(&fs, &id, r, &b).unwrap())
        .collect();
    assert_eq!(parts[0].shards.len(), 2);
    assert_eq!(parts[1].shards.len(), 2);
    let mut base = fs.snapshot();
    settle_durable(&mut base);

    let run = |fault: Fault| {
        let mut st = base.clone();
        st.fault = fault;
        let fs = SimFs::new(dir(), st);
        let r = ckptstore::commit(
            &ckptstore::store::LocalStore::new(&fs, dir()),
            &id,
            &parts,
            &commit_opts(),
        );
        let st = fs.snapshot();
        st.check_invariant();
        (r, st)
    };
    let (r, full) = run(Fault::None);
    let info = r.unwrap();
    assert_eq!((info.shards, info.tensors), (4, 7));
    let n = full.log.len();
    let cleanup_at = full
        .log
        .iter()
        .rposition(|o| o.kind == OpKind::List)
        .expect("the commit lists the directory in cleanup");
    for o in &full.log {
        eprintln!("  {}", o.describe());
    }

    let mut ev = Evaluator::new();
    let cands = [&bx, &a];
    let (mut saw_a, mut saw_b) = (0usize, 0usize);
    let mut failures = Vec::new();
    let mut distinct: Vec<Image> = Vec::new();
    let mut seen_imgs: HashSet<Image> = HashSet::new();
    for k in 0..=n {
        let (r, st) = run(Fault::CrashFrom(k));
        let at = full.log.get(k).map_or("end".into(), |o| o.describe());
        if r.is_ok() != (k >= cleanup_at) {
            failures.push(format!(
                "k={k} ({at}): commit returned {:?}",
                r.as_ref().map(|i| i.removed)
            ));
        }
        let allowed: Vec<(&str, &str)> = if r.is_ok() {
            vec![("new", id.as_str())]
        } else {
            vec![("new", id.as_str()), ("old", a_id.as_str())]
        };
        for (variant, img) in images(&st, true) {
            match check_image(&mut ev, &variant, &img, &cands, &allowed) {
                Ok("new") => saw_b += 1,
                Ok(_) => saw_a += 1,
                Err(e) => failures.push(format!("k={k} ({at}) variant {variant}: {e}")),
            }
            if seen_imgs.insert(img.clone()) {
                distinct.push(img);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "coordinator's commit: {n} operations ({cleanup_at} before cleanup), {} crash points, {} images checked ({} distinct): {saw_a} old, {saw_b} new; per variant {:?}",
        n + 1,
        ev.cases,
        ev.distinct,
        ev.by_variant
    );
    assert!(saw_a > 0 && saw_b > 0, "old {saw_a}, new {saw_b}");

    // After the reboot: B's parts committed again (their shards are durable in every image),
    // or a fresh save, succeed.
    let (mut recommits, mut saves) = (0, 0);
    for img in &distinct {
        for s in &parts[..] {
            for sh in &s.shards {
                assert!(img.contains_key(&sh.file), "{} lost", sh.file);
            }
        }
        let fs = rebooted(img);
        match ckptstore::commit(
            &ckptstore::store::LocalStore::new(&fs, dir()),
            &id,
            &parts,
            &commit_opts(),
        ) {
            Ok(_) => {
                let after = current_image(&fs);
                if let Err(e) = check_image(&mut ev, "recommit", &after, &cands, &[("new", &id)]) {
                    failures.push(format!("after recommitting: {e}"));
                }
                if after
                    .keys()
                    .any(|n| n.starts_with(".ckpt-tmp-") || n.contains(&a_id))
                {
                    failures.push(format!("recommit left [{}]", describe_image(&after)));
                }
                recommits += 1;
            }
            Err(e) => failures.push(format!(
                "recommitting on [{}] failed: {e}",
                describe_image(img)
            )),
        }
        let fs = rebooted(img);
        let a_in = a_tensors();
        match pool().install(|| {
            ckptstore::save(
                &ckptstore::store::LocalStore::new(&fs, dir()),
                &refs(&a_in),
                &save_opts("old"),
            )
        }) {
            Ok(info) => {
                let after = current_image(&fs);
                if let Err(e) = check_image(
                    &mut ev,
                    "fresh-save",
                    &after,
                    &cands,
                    &[("old", &info.checkpoint_id)],
                ) {
                    failures.push(format!("after a fresh save: {e}"));
                }
                saves += 1;
            }
            Err(e) => failures.push(format!(
                "a fresh save on [{}] failed: {e}",
                describe_image(img)
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "after the reboot: {recommits} recommits of B's parts and {saves} fresh saves on the {} distinct images",
        distinct.len()
    );

    // The retry crashes too: on every distinct image, the recommit crashed at every
    // operation leaves A or B (only B if the image already was B, or the retry returned Ok).
    let (mut points, before) = (0usize, ev.cases);
    for img in &distinct {
        let prior = check_image(
            &mut ev,
            "retry-base",
            img,
            &cands,
            &[("new", &id), ("old", &a_id)],
        )
        .unwrap();
        let retry = |fault: Fault| {
            let fs = rebooted(img);
            fs.lock().fault = fault;
            let r = ckptstore::commit(
                &ckptstore::store::LocalStore::new(&fs, dir()),
                &id,
                &parts,
                &commit_opts(),
            );
            let st = fs.snapshot();
            st.check_invariant();
            (r, st)
        };
        let m = retry(Fault::None).1.log.len();
        for k in 0..=m {
            points += 1;
            let (r, st) = retry(Fault::CrashFrom(k));
            let allowed: Vec<(&str, &str)> = if r.is_ok() || prior == "new" {
                vec![("new", id.as_str())]
            } else {
                vec![("new", id.as_str()), ("old", a_id.as_str())]
            };
            for (variant, img2) in images(&st, true) {
                if let Err(e) = check_image(&mut ev, &variant, &img2, &cands, &allowed) {
                    failures.push(format!(
                        "retry on [{}] crashed at k={k}, variant {variant}: {e}",
                        describe_image(img)
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "the retried commit crashed at each of its {points} crash points on the {} images: {} images checked",
        distinct.len(),
        ev.cases - before
    );
}

#[test]
fn crash_while_a_rank_writes_its_part_leaves_the_old_checkpoint() {
    let b = b_data();
    let (base_a, a_id) = with_a();
    let a = expected("old", a_tensors());
    let bx = b_expected(&b);
    let fs = SimFs::new(dir(), base_a);
    let id = new_checkpoint_id().unwrap();
    write_part_sim(&fs, &id, 0, &b).unwrap();
    let mut base = fs.snapshot();
    settle_durable(&mut base);

    let run = |fault: Fault| {
        let mut st = base.clone();
        st.fault = fault;
        let fs = SimFs::new(dir(), st);
        let r = write_part_sim(&fs, &id, 1, &b);
        let st = fs.snapshot();
        st.check_invariant();
        (r, st)
    };
    let (r, full) = run(Fault::None);
    r.unwrap();
    let n = full.log.len();
    let cands = [&bx, &a];
    let mut ev = Evaluator::new();
    let mut failures = Vec::new();
    let mut distinct: Vec<Image> = Vec::new();
    let mut seen_imgs: HashSet<Image> = HashSet::new();
    for k in 0..n {
        let (r, st) = run(Fault::CrashFrom(k));
        let at = full.log[k].describe();
        if r.is_ok() {
            failures.push(format!("k={k} ({at}): write_part returned Ok"));
        }
        for (variant, img) in images(&st, true) {
            if let Err(e) = check_image(&mut ev, &variant, &img, &cands, &[("old", a_id.as_str())])
            {
                failures.push(format!("k={k} ({at}) variant {variant}: {e}"));
            }
            if seen_imgs.insert(img.clone()) {
                distinct.push(img);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "rank 1's write_part: {n} crash points, {} images checked ({} distinct), all the old checkpoint; per variant {:?}",
        ev.cases, ev.distinct, ev.by_variant
    );
    // After the reboot a new multi-rank save commits and removes the dead attempt's files.
    for img in &distinct {
        let fs = rebooted(img);
        let (new_id, _) = multi_rank_save(&fs, &b);
        let after = current_image(&fs);
        if let Err(e) = check_image(&mut ev, "new-save", &after, &cands, &[("new", &new_id)]) {
            failures.push(format!("after a new multi-rank save: {e}"));
        }
        if after.keys().any(|n| n.contains(&id) || n.contains(&a_id)) {
            failures.push(format!(
                "the new save left files of the dead attempt or of A: [{}]",
                describe_image(&after)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "after the reboot: {} new multi-rank saves committed",
        distinct.len()
    );
}

/// On the real file system: a commit retried after a crash that left its temporary
/// manifest (same id, same name) succeeds and removes it.
#[test]
fn retried_commit_replaces_the_crashed_attempts_temporary_manifest() {
    use ckptstore::commit;
    use ckptstore::write_part;
    let b = b_data();
    let d = tempfile::tempdir().unwrap();
    let id = new_checkpoint_id().unwrap();
    let parts: Vec<Part> = (0..2)
        .map(|r| write_part(d.path(), &id, r, &items(&b, r), &part_opts()).unwrap())
        .collect();
    let tmp = d.path().join(format!(".ckpt-tmp-{id}-manifest"));
    std::fs::write(&tmp, b"{\"format\": \"ckptst").unwrap();
    let info = commit(d.path(), &id, &parts, &commit_opts()).unwrap();
    assert_eq!(info.removed, 2 + 1, "the part descriptors and the leftover");
    assert!(!tmp.exists());
    let seen = classify(d.path(), &[&b_expected(&b)]);
    assert_eq!(seen, Seen::Is("new", id));
}
