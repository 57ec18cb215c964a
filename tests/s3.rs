//! Checkpoints on a real S3 server (s3s-fs on loopback, started per test; see
//! tests/common/s3server.rs): round trips bit for bit, loads with conversions, the CLI on
//! s3:// URLs, damaged and foreign objects refused with the key named, bad credentials and
//! missing buckets, and a server killed in the middle of an upload.

// The layout `ckpt _write-part` writes (only the expected bytes are used here).
#[allow(dead_code)]
#[path = "../src/bin/ckpt/part_layout.rs"]
mod part_layout;
#[path = "common/s3server.rs"]
mod s3server;

use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use ckptstore::format::manifest::MANIFEST_FILE;
use ckptstore::manager::CheckpointManager;
use ckptstore::manager::Retention;
use ckptstore::optim::{
    OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout, StateValue, Target, Tensor,
};
use ckptstore::store::s3::{self, Remote, S3Config};
use ckptstore::store::{Location, RemoteUrl};
use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::{Checkpoint, CommitOptions, DType, Error, Part, PartItem, SaveOptions, TensorRef};
use s3server::S3Server;

const BUCKET: &str = "ckpt";

fn url(prefix: &str) -> RemoteUrl {
    match Location::parse(&format!("s3://{BUCKET}/{prefix}")).unwrap() {
        Location::Remote(u) => u,
        Location::Local(_) => unreachable!(),
    }
}

/// Deterministic pseudo-random f32s (no two runs differ).
fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

/// A small multipart-sized config: 5 MiB parts (the S3 minimum), small ranged GETs.
fn small_parts(srv: &S3Server) -> S3Config {
    S3Config {
        part_size: 5 << 20,
        range_size: 1 << 20,
        ..srv.config()
    }
}

struct Fixture {
    big: Vec<f32>,
    w: Vec<f32>,
    b: Vec<half::bf16>,
    step: [i64; 1],
}

impl Fixture {
    fn new(seed: u32) -> Fixture {
        Fixture {
            // 12 MiB: three multipart parts of 5 MiB.
            big: data(3 << 20, seed),
            w: data(1000, seed + 1),
            b: data(64, seed + 2)
                .iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect(),
            step: [i64::from(seed)],
        }
    }

    fn tensors(&self) -> Vec<TensorRef<'_>> {
        vec![
            TensorRef::from_slice("big", &[3 << 10, 1 << 10], &self.big),
            TensorRef::from_slice("layer.w", &[10, 100], &self.w),
            TensorRef::from_slice("layer.b", &[64], &self.b),
            TensorRef::from_slice("step", &[], &self.step),
        ]
    }
}

fn opts() -> SaveOptions {
    SaveOptions {
        // The big tensor alone, the three small ones together: two shards.
        max_shard_size: 1 << 20,
        metadata: serde_json::json!({"run": "s3"}),
        ..Default::default()
    }
}

fn assert_same<B: ckptstore::checkpoint::ShardSource>(ck: &Checkpoint<B>, f: &Fixture) {
    assert_eq!(
        ck.read("big")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &f.big[..]
    );
    assert_eq!(
        ck.read("layer.w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &f.w[..]
    );
    assert_eq!(
        ck.read("layer.b").view_unchecked().unwrap().bytes(),
        bytemuck::cast_slice::<_, u8>(&f.b)
    );
    assert_eq!(
        ck.read("step")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &f.step[..]
    );
}

#[test]
fn round_trip_bit_for_bit_and_ranged_reads() {
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let f = Fixture::new(7);
    let u = url("runs/one");
    let info = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f.tensors(), &opts()))
        .unwrap();
    assert_eq!((info.tensors, info.shards), (4, 2));

    let ck = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    assert_same(&ck, &f);
    // Every CRC block was summed as it landed: verify reads nothing again.
    assert!(ck.data_verified());
    let rep = ck.verify().unwrap();
    assert_eq!((rep.tensors, rep.checksummed), (4, true));
    assert_eq!(ck.metadata()["run"], "s3");
    // Shard objects are named by the checkpoint id; the checkpoint names them by URL.
    let id = &ck.manifest().unwrap().checkpoint_id;
    for (s, e) in ck.shards().iter().zip(&ck.manifest().unwrap().shards) {
        assert!(e.file.contains(id.as_str()), "{}", e.file);
        assert_eq!(s.file, u.child(&e.file).to_string());
    }

    // The lazy reader fetches single tensors and streams all of them, CRC-checked.
    let rc = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .unwrap();
    assert_eq!(
        rc.read("big")
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &f.big[..]
    );
    let mut seen = Vec::new();
    rc.stream_tensors(16 << 20, |t, x| {
        assert_eq!(
            x.bytes(),
            ck.read(&t.name).view_unchecked().unwrap().bytes()
        );
        seen.push(t.name.clone());
        Ok(())
    })
    .unwrap();
    seen.sort();
    assert_eq!(seen, ["big", "layer.b", "layer.w", "step"]);
    assert!(matches!(
        rc.stream_tensors(1 << 20, |_, _| Ok(())),
        Err(Error::InvalidArgument(_))
    ));

    // A second save replaces the first; the first's shard objects are deleted.
    let g = Fixture::new(8);
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &g.tensors(), &opts()))
        .unwrap();
    let ck2 = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    assert_same(&ck2, &g);
    let r = Remote::new(&u, &cfg).unwrap();
    let objects = r.list().unwrap().objects;
    let mut names: Vec<&str> = objects.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    let m2 = ck2.manifest().unwrap();
    let mut want: Vec<&str> = m2.shards.iter().map(|s| s.file.as_str()).collect();
    want.push(MANIFEST_FILE);
    want.sort();
    assert_eq!(names, want);
}

fn adam_state() -> (OptimizerState, Vec<f32>) {
    let w = data(256, 3);
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("w", &[16, 16])],
        hyper: serde_json::json!({"lr": 1e-3}).as_object().unwrap().clone(),
    }]);
    opt.state.insert(
        "w".into(),
        [
            (
                "step".to_string(),
                StateValue::Plain(Tensor::scalar_f32(10.0)),
            ),
            (
                "exp_avg".to_string(),
                StateValue::Plain(Tensor::from_slice(&[16, 16], &data(256, 4)).unwrap()),
            ),
            (
                "exp_avg_sq".to_string(),
                StateValue::Plain(Tensor::from_slice(&[16, 16], &data(256, 5)).unwrap()),
            ),
        ]
        .into(),
    );
    (opt, w)
}

#[test]
fn optimizer_loads_and_conversions_match_local_and_manager_retention() {
    let srv = S3Server::start(BUCKET);
    let cfg = srv.config();
    let (opt, w) = adam_state();
    let model = [TensorRef::from_slice("w", &[16, 16], &w)];
    let local = tempfile::tempdir().unwrap();
    opt.save(local.path(), &model, &SaveOptions::default())
        .unwrap();
    let lck = Checkpoint::open(local.path()).unwrap();

    let mgr = CheckpointManager::remote(
        Remote::new(&url("mgr"), &cfg).unwrap(),
        Retention {
            keep_last: 2,
            keep_every: Some(100),
        },
    )
    .unwrap();
    for step in [100u64, 150, 200, 250] {
        mgr.save(
            step,
            &model,
            Some(&opt.as_borrowed()),
            &SaveOptions::default(),
        )
        .unwrap();
    }
    // Retention: the newest two, and multiples of 100.
    assert_eq!(mgr.steps().unwrap(), [100, 200, 250]);
    assert_eq!(mgr.latest().unwrap(), Some(250));
    let rck = mgr.open_latest().unwrap().unwrap();
    let step = rck.step();
    assert_eq!(step, 250);
    for layout in [
        StateLayout::default(),
        StateLayout::with_default(Target::BF16),
        StateLayout::default().state("exp_avg", Target::F16Scaled(ScaleShape::One)),
    ] {
        let a = lck.load_optimizer(&layout).unwrap();
        let b = rck.load_optimizer(&layout).unwrap();
        assert_eq!(format!("{:?}", a.state), format!("{:?}", b.state));
    }
    // An object the engine did not write survives gc; an uncommitted step's objects go.
    let r = Remote::new(&url("mgr/step-00000200"), &cfg).unwrap();
    r.put_small("notes.txt", b"mine".to_vec()).unwrap();
    let r300 = Remote::new(&url("mgr/step-00000300"), &cfg).unwrap();
    r300.put_small(
        "shard-0123456789abcdef0123456789abcdef-00000.safetensors",
        vec![0; 16],
    )
    .unwrap();
    let mgr1 = CheckpointManager::remote(
        Remote::new(&url("mgr"), &cfg).unwrap(),
        Retention::keep_last(1),
    )
    .unwrap();
    let rep = mgr1.gc().unwrap();
    assert_eq!(rep.deleted, [100, 200]);
    assert_eq!(rep.interrupted_removed, 1);
    assert_eq!(mgr1.steps().unwrap(), [250]);
    assert_eq!(r.get_small("notes.txt", 100).unwrap().unwrap(), b"mine");
    assert!(r300.list().unwrap().objects.is_empty());
}

/// The one manager on an object store: background saves (the buffers may change as soon
/// as `save_async` returns), retention, a lease, `restore_latest`, and the multi-rank commit
/// of a step.
#[test]
fn manager_async_saves_restore_and_commit_parts_on_s3() {
    let srv = S3Server::start(BUCKET);
    let cfg = srv.config();
    let (opt, mut w) = adam_state();
    let mgr = CheckpointManager::remote(
        Remote::new(&url("amgr"), &cfg).unwrap(),
        Retention::keep_last(2),
    )
    .unwrap()
    .with_max_in_flight(2);
    assert_eq!(
        mgr.location_of(3),
        Location::Remote(url("amgr/step-00000003"))
    );
    assert!(matches!(mgr.step_dir(3), Err(Error::UnsupportedUrl { .. })));
    let mut handles = Vec::new();
    for step in 1..=3u64 {
        w[0] = step as f32;
        let model = [TensorRef::from_slice("w", &[16, 16], &w)];
        handles.push(
            mgr.save_async(step, &model, Some(&opt), SaveOptions::default())
                .unwrap(),
        );
        w[0] = -1.0; // the snapshot is the save's own
    }
    for h in handles {
        h.wait().unwrap();
    }
    mgr.gc().unwrap();
    assert_eq!(mgr.steps().unwrap(), [2, 3]);
    let ck = mgr.open(3).unwrap();
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap()[0],
        3.0
    );
    assert!(matches!(mgr.lease(1), Err(Error::NotFound { .. })));
    let mut live = adam_state().0;
    live.state.clear();
    assert_eq!(
        mgr.restore_latest(&mut live, &StateLayout::default())
            .unwrap(),
        Some(3)
    );
    assert_eq!(format!("{:?}", live.state), format!("{:?}", opt.state));

    // Two ranks write their parts under the step's prefix; the manager commits them.
    let step_url = match mgr.location_of(4) {
        Location::Remote(u) => u,
        Location::Local(_) => unreachable!(),
    };
    let id = new_checkpoint_id().unwrap();
    let halves = [data(8, 40), data(8, 41)];
    let parts: Vec<Part> = (0..2u32)
        .map(|rank| {
            let item = PartItem::Chunk {
                tensor: TensorRef::from_slice("g", &[8], &halves[rank as usize]),
                global_shape: vec![16],
                offsets: vec![u64::from(rank) * 8],
            };
            ckptstore::write_part(
                &Remote::new(&step_url, &cfg).unwrap(),
                &id,
                rank,
                &[item],
                &SaveOptions::default(),
            )
            .unwrap()
        })
        .collect();
    mgr.commit_parts(4, &id, &parts, &CommitOptions::default())
        .unwrap();
    assert_eq!(mgr.steps().unwrap(), [3, 4]);
    let g = mgr.open(4).unwrap().read("g").to_tensor().unwrap();
    let want: Vec<f32> = halves.concat();
    assert_eq!(g.as_slice::<f32>().unwrap(), &want[..]);
}

/// Save two checkpoints under different prefixes for the damage tests.
fn two_checkpoints(srv: &S3Server) -> (RemoteUrl, RemoteUrl, S3Config) {
    let cfg = small_parts(srv);
    let (a, b) = (url("dmg/a"), url("dmg/b"));
    Remote::new(&a, &cfg)
        .and_then(|r| ckptstore::save(&r, &Fixture::new(1).tensors(), &opts()))
        .unwrap();
    Remote::new(&b, &cfg)
        .and_then(|r| ckptstore::save(&r, &Fixture::new(2).tensors(), &opts()))
        .unwrap();
    (a, b, cfg)
}

fn err_text(r: ckptstore::Result<Checkpoint<Vec<u8>>>) -> (Error, String) {
    let e = r.expect_err("a damaged checkpoint opened");
    let s = e.to_string();
    (e, s)
}

#[test]
fn damaged_missing_and_foreign_objects_are_refused_with_the_key_named() {
    let srv = S3Server::start(BUCKET);
    let (a, b, cfg) = two_checkpoints(&srv);
    let ra = Remote::new(&a, &cfg).unwrap();
    let ck = Remote::new(&a, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    let m = ck.manifest().unwrap().clone();
    // The shard holding `big` (shard 0 or 1, whichever the plan made).
    let big = ck.info("big").unwrap();
    let shard = m.shards[big.shard].file.clone();
    let key = a.child(&shard).to_string();
    let original = ra.get_small(&shard, 1 << 30).unwrap().unwrap();

    // Truncated.
    ra.put_small(&shard, original[..original.len() - 100].to_vec())
        .unwrap();
    let (e, s) =
        err_text(Remote::new(&a, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)));
    assert!(matches!(e, Error::ShardMismatch { .. }), "{s}");
    assert!(s.contains(&key), "{s}");
    let e = Remote::new(&a, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .and_then(|r| r.read("big").to_tensor())
        .unwrap_err();
    assert!(e.to_string().contains(&key), "{e}");
    // A ranged read past the shorter object's end is a short shard, said in the shard's
    // terms (s3s-fs answers with the object's size; S3 and Garage answer 416 InvalidRange).
    ra.put_small(&shard, original[..64].to_vec()).unwrap();
    let e = Remote::new(&a, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .and_then(|r| r.read("big").to_tensor())
        .unwrap_err();
    assert!(
        matches!(e, Error::ShardMismatch { .. }) && e.to_string().contains("manifest records"),
        "{e}"
    );

    // Longer than recorded (an object whose size lies).
    let mut longer = original.clone();
    longer.extend_from_slice(&[0; 64]);
    ra.put_small(&shard, longer).unwrap();
    let (_, s) =
        err_text(Remote::new(&a, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)));
    assert!(s.contains(&key) && s.contains("manifest records"), "{s}");

    // Replaced, same size: one data byte flipped. Open is cheap; verify and the ranged read
    // name the tensor and the key.
    let mut flipped = original.clone();
    let at = big.offsets[0] as usize + 12345;
    flipped[at] ^= 0x40;
    ra.put_small(&shard, flipped).unwrap();
    let bad = Remote::new(&a, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    // The sums taken during the download failed, so nothing is taken as verified.
    assert!(!bad.data_verified());
    let e = bad.verify().unwrap_err();
    assert!(
        matches!(e, Error::ChecksumMismatch { .. })
            && e.to_string().contains("\"big\", block")
            && e.to_string().contains(&key),
        "{e}"
    );
    let e = Remote::new(&a, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .unwrap()
        .read("big")
        .to_tensor()
        .unwrap_err();
    assert!(
        e.to_string().contains(&key) && e.to_string().contains("big"),
        "{e}"
    );

    // Header replaced (another checkpoint's shard under this name): header CRC refused.
    let rb = Remote::new(&b, &cfg).unwrap();
    let ckb = Remote::new(&b, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    let other = &ckb.manifest().unwrap().shards[ckb.info("big").unwrap().shard].file;
    ra.put_small(&shard, rb.get_small(other, 1 << 30).unwrap().unwrap())
        .unwrap();
    let (e, s) =
        err_text(Remote::new(&a, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)));
    assert!(
        matches!(e, Error::ChecksumMismatch { .. }) && s.contains(&key),
        "{s}"
    );

    // Missing.
    ra.delete(&shard).unwrap();
    let (e, s) =
        err_text(Remote::new(&a, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)));
    assert!(
        matches!(e, Error::ShardMismatch { .. }) && s.contains(&key) && s.contains("missing"),
        "{s}"
    );
    ra.put_small(&shard, original).unwrap();
    assert_same(
        &Remote::new(&a, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &Fixture::new(1),
    );

    // A manifest from another checkpoint: it names its own shards, which are not here.
    let mb = rb.get_small(MANIFEST_FILE, 1 << 30).unwrap().unwrap();
    ra.put_small(MANIFEST_FILE, mb).unwrap();
    let (e, s) =
        err_text(Remote::new(&a, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)));
    assert!(
        matches!(e, Error::ShardMismatch { .. }) && s.contains("s3://ckpt/dmg/a/shard-"),
        "{s}"
    );

    // A damaged manifest.
    let mut mbad = ra.get_small(MANIFEST_FILE, 1 << 30).unwrap().unwrap();
    mbad[20] ^= 1;
    ra.put_small(MANIFEST_FILE, mbad).unwrap();
    let (_, s) =
        err_text(Remote::new(&a, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)));
    assert!(s.contains("dmg/a/ckpt-manifest.json"), "{s}");

    // Nothing committed under a prefix.
    let (e, _) = err_text(
        Remote::new(&url("dmg/none"), &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)),
    );
    assert!(matches!(e, Error::NotFound { .. }));
}

#[test]
fn wrong_credentials_and_missing_bucket_are_one_clear_error() {
    let srv = S3Server::start(BUCKET);
    let (a, _, cfg) = two_checkpoints(&srv);
    let f = Fixture::new(3);
    let wrong = S3Config {
        secret_access_key: Some("not-the-secret".into()),
        ..cfg.clone()
    };
    let e = Remote::new(&a, &wrong)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap_err();
    assert!(
        matches!(e, Error::Remote { .. }) && e.to_string().contains("access denied"),
        "{e}"
    );
    let e = Remote::new(&url("x"), &wrong)
        .and_then(|r| ckptstore::save(&r, &f.tensors(), &opts()))
        .unwrap_err();
    assert!(
        matches!(e, Error::Remote { .. }) && e.to_string().contains("access denied"),
        "{e}"
    );

    let nob = RemoteUrl {
        bucket: "no-such-bucket".into(),
        ..url("p")
    };
    let e = Remote::new(&nob, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap_err();
    assert!(
        matches!(e, Error::Remote { .. }) && e.to_string().contains("does not exist"),
        "{e}"
    );
    let e = Remote::new(&nob, &cfg)
        .and_then(|r| ckptstore::save(&r, &f.tensors(), &opts()))
        .unwrap_err();
    assert!(
        matches!(e, Error::Remote { .. }) && e.to_string().contains("does not exist"),
        "{e}"
    );
}

#[test]
fn server_killed_mid_upload_then_restarted() {
    let srv = Arc::new(Mutex::new(S3Server::start(BUCKET)));
    let cfg = small_parts(&srv.lock().unwrap());
    let u = url("crash");
    let f1 = Fixture::new(11);
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f1.tensors(), &opts()))
        .unwrap();

    // Kill the server once 8 MiB of the next save have gone into its uploads: the writer
    // is then inside the multipart upload of the big shard (a deterministic point).
    let f2 = Fixture::new(12);
    let written = Arc::new(Mutex::new(0u64));
    let killer = {
        let srv = Arc::clone(&srv);
        let written = Arc::clone(&written);
        Arc::new(move |n: u64| {
            let mut w = written.lock().unwrap();
            let before = *w;
            *w += n;
            if before < (8 << 20) && *w >= (8 << 20) {
                srv.lock().unwrap().kill();
            }
        })
    };
    let o = SaveOptions {
        progress: Some(killer),
        ..opts()
    };
    let e = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f2.tensors(), &o))
        .unwrap_err();
    assert!(matches!(e, Error::Remote { .. }), "{e}");
    assert!(*written.lock().unwrap() >= 8 << 20);

    srv.lock().unwrap().restart();
    // The previous checkpoint is intact.
    assert_same(
        &Remote::new(&u, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f1,
    );
    // The killed save left its multipart upload on the server (s3s-fs keeps an upload as
    // `.upload-<id>.json` plus `.upload_id-<id>.part-<n>` files in its data directory)
    // and the upload's journal object under the prefix.
    let data = srv.lock().unwrap().data_dir().to_path_buf();
    assert!(!uploads_on_server(&data).is_empty());
    let r = Remote::new(&u, &cfg).unwrap();
    let journals: Vec<String> = r
        .list()
        .unwrap()
        .objects
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| n.starts_with(".ckpt-tmp-upload-"))
        .collect();
    assert_eq!(journals.len(), 1, "{journals:?}");
    // gc aborts it and deletes its journal: no upload is left.
    let deleted = s3::gc_prefix(&r).unwrap();
    assert!(deleted.contains(&journals[0]), "{deleted:?}");
    assert_eq!(uploads_on_server(&data), Vec::<String>::new());
    assert_same(
        &Remote::new(&u, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f1,
    );

    // The next save succeeds and replaces it.
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f2.tensors(), &opts()))
        .unwrap();
    let ck = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    assert_same(&ck, &f2);
    ck.verify().unwrap();
    // Only the committed checkpoint's objects remain; completed uploads left no journal.
    assert!(s3::gc_prefix(&r).unwrap().is_empty());
    assert_eq!(r.list().unwrap().objects.len(), ck.shards().len() + 1);
    assert_eq!(uploads_on_server(&data), Vec::<String>::new());

    // A killed save's upload is also aborted by the next save's start (it deletes the
    // temporary objects of interrupted saves), and in a manager root by `ckpt gc`.
    let kill_at_8mib = || {
        let srv = Arc::clone(&srv);
        let written = Arc::new(Mutex::new(0u64));
        SaveOptions {
            progress: Some(Arc::new(move |n: u64| {
                let mut w = written.lock().unwrap();
                let before = *w;
                *w += n;
                if before < (8 << 20) && *w >= (8 << 20) {
                    srv.lock().unwrap().kill();
                }
            })),
            ..opts()
        }
    };
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f1.tensors(), &kill_at_8mib()))
        .unwrap_err();
    srv.lock().unwrap().restart();
    assert!(!uploads_on_server(&data).is_empty());
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f1.tensors(), &opts()))
        .unwrap();
    assert_eq!(uploads_on_server(&data), Vec::<String>::new());
    assert_same(
        &Remote::new(&u, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f1,
    );

    let root = url("crashroot");
    Remote::new(&root.child("step-00000001"), &cfg)
        .and_then(|r| ckptstore::save(&r, &f1.tensors(), &opts()))
        .unwrap();
    let step2 = root.child("step-00000002");
    Remote::new(&step2, &cfg)
        .and_then(|r| ckptstore::save(&r, &f2.tensors(), &kill_at_8mib()))
        .unwrap_err();
    srv.lock().unwrap().restart();
    assert!(!uploads_on_server(&data).is_empty());
    let env = srv.lock().unwrap().env();
    let dir = tempfile::tempdir().unwrap();
    ok(&ckpt(
        dir.path(),
        &env,
        &["gc", &root.to_string(), "--keep", "1"],
    ));
    assert_eq!(uploads_on_server(&data), Vec::<String>::new());
    assert!(Remote::new(&step2, &cfg)
        .unwrap()
        .list()
        .unwrap()
        .objects
        .is_empty());
    assert_same(
        &Remote::new(&root.child("step-00000001"), &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f1,
    );
}

/// The multipart uploads s3s-fs holds: its `.upload-<id>.json` files.
fn uploads_on_server(data: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(data)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(".upload"))
        .collect();
    out.sort();
    out
}

// ---- the CLI --------------------------------------------------------------------------

fn ckpt(dir: &Path, env: &[(&'static str, String)], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .args(args)
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn urls_are_never_local_paths() {
    let cwd = tempfile::tempdir().unwrap();
    let w = vec![1.0f32; 16];
    ckptstore::save(
        cwd.path().join("src"),
        &[TensorRef::from_slice("w", &[4, 4], &w)],
        &SaveOptions::default(),
    )
    .unwrap();
    for args in [
        &["pack", "src", "--out", "gs://b/p"][..],
        &["inspect", "gs://b/p"],
        &["verify", "hdfs://b/p"],
        &["ls", "azure://x"],
        &["convert", "src", "--out", "gs://b/p", "--dtype", "bf16"],
        &["consolidate", "src", "--out", "gs://b/p"],
        &["diff", "src", "gs://b/p"],
        &["gc", "gs://b/p", "--keep", "1"],
    ] {
        let o = ckpt(cwd.path(), &[], args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("cannot use") && err.contains("is not supported"),
            "{args:?}: {err}"
        );
    }
    let mut names: Vec<String> = std::fs::read_dir(cwd.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["src"], "a URL was taken as a local path");
    // The library refuses them too.
    let e = ckptstore::save(
        "gs://b/p",
        &[TensorRef::from_slice("w", &[4, 4], &w)],
        &SaveOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::UnsupportedUrl { .. }));
    assert!(matches!(
        ckptstore::open("gs://b/p"),
        Err(Error::UnsupportedUrl { .. })
    ));
}

#[test]
fn cli_on_s3_urls() {
    let srv = S3Server::start(BUCKET);
    let env = srv.env();
    let cwd = tempfile::tempdir().unwrap();
    let f = Fixture::new(21);
    ckptstore::save(cwd.path().join("src"), &f.tensors(), &opts()).unwrap();

    // pack --out s3:// writes to the server, not to a local `s3:` directory.
    ok(&ckpt(
        cwd.path(),
        &env,
        &["pack", "src", "--out", "s3://ckpt/cli/a"],
    ));
    assert!(!cwd.path().join("s3:").exists());
    let js: serde_json::Value = serde_json::from_str(&ok(&ckpt(
        cwd.path(),
        &env,
        &["inspect", "s3://ckpt/cli/a", "--json"],
    )))
    .unwrap();
    assert_eq!(js["total_tensors"], 4);
    assert_eq!(js["kind"], "ckptstore");
    let v: serde_json::Value = serde_json::from_str(&ok(&ckpt(
        cwd.path(),
        &env,
        &["verify", "s3://ckpt/cli/a", "--json"],
    )))
    .unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["tensors"], 4);
    ok(&ckpt(cwd.path(), &env, &["diff", "src", "s3://ckpt/cli/a"]));

    // convert s3 -> s3, and back to local; consolidate s3 -> s3.
    ok(&ckpt(
        cwd.path(),
        &env,
        &[
            "convert",
            "s3://ckpt/cli/a",
            "--out",
            "s3://ckpt/cli/bf16",
            "--dtype",
            "bf16",
        ],
    ));
    ok(&ckpt(
        cwd.path(),
        &env,
        &[
            "convert",
            "s3://ckpt/cli/bf16",
            "--out",
            "bf16",
            "--dtype",
            "bf16",
        ],
    ));
    let c = Checkpoint::open(cwd.path().join("bf16")).unwrap();
    assert_eq!(c.info("big").unwrap().dtype, DType::BF16);
    ok(&ckpt(
        cwd.path(),
        &env,
        &[
            "consolidate",
            "s3://ckpt/cli/a",
            "--out",
            "s3://ckpt/cli/cons",
        ],
    ));
    let r = Remote::new(&url("cli/cons"), &srv.config()).unwrap();
    assert!(r
        .get_small("model.safetensors.index.json", 1 << 20)
        .unwrap()
        .is_some());
    assert_same(
        &Remote::new(&url("cli/cons"), &srv.config())
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f,
    );
    // And from s3:// to a local directory and back (the source read lazily, streamed).
    ok(&ckpt(
        cwd.path(),
        &env,
        &[
            "consolidate",
            "s3://ckpt/cli/a",
            "--out",
            "cons-local",
            "--memory",
            "1MiB",
        ],
    ));
    assert_same(
        &Checkpoint::open(cwd.path().join("cons-local")).unwrap(),
        &f,
    );
    ok(&ckpt(
        cwd.path(),
        &env,
        &[
            "consolidate",
            "cons-local",
            "--out",
            "s3://ckpt/cli/cons-back",
        ],
    ));
    assert_same(
        &Remote::new(&url("cli/cons-back"), &srv.config())
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f,
    );

    // A damaged object: verify exits 1 naming the key.
    let ck = Remote::new(&url("cli/a"), &srv.config())
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    let shard = ck.manifest().unwrap().shards[ck.info("layer.w").unwrap().shard]
        .file
        .clone();
    let ra = Remote::new(&url("cli/a"), &srv.config()).unwrap();
    let mut bytes = ra.get_small(&shard, 1 << 30).unwrap().unwrap();
    let at = ck.info("layer.w").unwrap().offsets[0] as usize;
    bytes[at] ^= 1;
    ra.put_small(&shard, bytes).unwrap();
    let o = ckpt(cwd.path(), &env, &["verify", "s3://ckpt/cli/a"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("s3://ckpt/cli/a/{shard}")) && err.contains("layer.w"),
        "{err}"
    );

    // ls / gc on a manager root on S3.
    let mgr = CheckpointManager::remote(
        Remote::new(&url("cli/run"), &srv.config()).unwrap(),
        Retention::keep_last(5),
    )
    .unwrap();
    for step in [10u64, 20, 30] {
        mgr.save(step, &f.tensors(), None, &opts()).unwrap();
    }
    let ls: serde_json::Value = serde_json::from_str(&ok(&ckpt(
        cwd.path(),
        &env,
        &["ls", "s3://ckpt/cli/run", "--json"],
    )))
    .unwrap();
    assert_eq!(ls["latest"], 30);
    assert_eq!(ls["steps"].as_array().unwrap().len(), 3);
    let gc: serde_json::Value = serde_json::from_str(&ok(&ckpt(
        cwd.path(),
        &env,
        &["gc", "s3://ckpt/cli/run", "--keep", "1", "--json"],
    )))
    .unwrap();
    assert_eq!(gc["deleted"], serde_json::json!([10, 20]));
    assert_eq!(mgr.steps().unwrap(), [30]);

    // Wrong credentials: exit 1, one line saying so.
    let mut bad = env.clone();
    bad.retain(|(k, _)| *k != "AWS_SECRET_ACCESS_KEY");
    bad.push(("AWS_SECRET_ACCESS_KEY", "wrong".into()));
    let o = ckpt(cwd.path(), &bad, &["inspect", "s3://ckpt/cli/a"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("access denied"), "{err}");
}

// ---- multi-rank checkpoints on S3 ------------------------------------------------------

/// The global tensor "w" [ROWS, COLS] f32: 16 MiB, so each rank's half (8 MiB) is a
/// multipart upload of two 5 MiB parts; plus the global "v" [6] i64 and a whole tensor.
const ROWS: u64 = 4096;
const COLS: u64 = 1024;

fn global_w() -> Vec<f32> {
    data((ROWS * COLS) as usize, 21)
}

fn global_v() -> Vec<i64> {
    (0..6).map(|i| i * 1000 - 7).collect()
}

/// Rank `rank` of 2: rows `[rank * ROWS/2, ...)` of "w", elements `[rank * 3, +3)` of "v",
/// and (rank 0 only) the whole tensor "step".
fn rank_items<'a>(rank: u32, w: &'a [f32], v: &'a [i64], step: &'a [i64]) -> Vec<PartItem<'a>> {
    let half = (ROWS / 2) as usize * COLS as usize;
    let r = rank as usize;
    let mut items = vec![
        PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[ROWS / 2, COLS], &w[r * half..][..half]),
            global_shape: vec![ROWS, COLS],
            offsets: vec![u64::from(rank) * (ROWS / 2), 0],
        },
        PartItem::Chunk {
            tensor: TensorRef::from_slice("v", &[3], &v[r * 3..][..3]),
            global_shape: vec![6],
            offsets: vec![u64::from(rank) * 3],
        },
    ];
    if rank == 0 {
        items.push(PartItem::Whole(TensorRef::from_slice("step", &[], step)));
    }
    items
}

/// The rows `[r0, r0 + nr)` and columns `[c0, c0 + nc)` of "w", row-major.
fn w_box(w: &[f32], r0: u64, nr: u64, c0: u64, nc: u64) -> Vec<f32> {
    let mut out = Vec::new();
    for r in r0..r0 + nr {
        let row = (r * COLS) as usize;
        out.extend_from_slice(&w[row + c0 as usize..row + (c0 + nc) as usize]);
    }
    out
}

fn part_opts() -> SaveOptions {
    SaveOptions {
        max_shard_size: 4 << 20,
        ..Default::default()
    }
}

#[test]
fn two_ranks_write_parts_and_the_coordinator_commits_on_s3() {
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let u = url("multi/run");
    let (w, v, step) = (global_w(), global_v(), [42i64]);
    // An earlier single-rank checkpoint under the prefix: replaced by the commit.
    let f = Fixture::new(3);
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f.tensors(), &opts()))
        .unwrap();

    let id = new_checkpoint_id().unwrap();
    let remote = Remote::new(&u, &cfg).unwrap();
    let parts: Vec<Part> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|rank| {
                let (w, v, step, id, cfg, u) = (&w, &v, &step, &id, &cfg, &u);
                s.spawn(move || {
                    // Each rank has its own connection.
                    let r = Remote::new(u, cfg).unwrap();
                    ckptstore::write_part(&r, id, rank, &rank_items(rank, w, v, step), &part_opts())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert_eq!(parts.len(), 2);
    // A rank's part is written once.
    let e = ckptstore::write_part(&remote, &id, 1, &rank_items(1, &w, &v, &step), &part_opts())
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("already"),
        "{e}"
    );
    // Before the commit the old checkpoint is still the committed one.
    assert_same(
        &Remote::new(&u, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f,
    );

    // The coordinator finds the part objects by listing, GETs and checks them, PUTs the
    // manifest last.
    let copts = CommitOptions {
        metadata: serde_json::json!({"ranks": 2}),
        ..Default::default()
    };
    let info = ckptstore::commit(
        &remote,
        &id,
        &[],
        &rendezvous(2, std::time::Duration::from_secs(5), &copts),
    )
    .unwrap();
    assert_eq!(info.checkpoint_id, id);
    assert_eq!(info.tensors, 5);

    let ck = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    ck.verify().unwrap();
    assert_eq!(ck.metadata()["ranks"], 2);
    assert_eq!(
        ck.read("w").to_tensor().unwrap().as_slice::<f32>().unwrap(),
        &w[..]
    );
    assert_eq!(
        ck.read("v").to_tensor().unwrap().as_slice::<i64>().unwrap(),
        &v[..]
    );
    assert_eq!(
        ck.read("step")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[42]
    );
    // A region across both ranks' chunks, bit for bit.
    let (r0, nr, c0, nc) = (ROWS / 2 - 3, 7, 100, 50);
    assert_eq!(
        ck.read("w")
            .region(&[r0, c0], &[nr, nc])
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w_box(&w, r0, nr, c0, nc)[..]
    );
    // Resharded: three readers each take a column slab of every row.
    let slabs = [(0, 341), (341, 341), (682, 342)];
    for (c0, nc) in slabs {
        let got = ck
            .read("w")
            .region(&[0, c0], &[ROWS, nc])
            .to_tensor()
            .unwrap();
        assert_eq!(
            got.as_slice::<f32>().unwrap(),
            &w_box(&w, 0, ROWS, c0, nc)[..]
        );
    }
    // Only the committed checkpoint's objects remain: no part objects, no old shards.
    let mut names: Vec<String> = remote
        .list()
        .unwrap()
        .objects
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    names.sort();
    let mut want: Vec<String> = ck
        .manifest()
        .unwrap()
        .shards
        .iter()
        .map(|s| s.file.clone())
        .collect();
    want.push(MANIFEST_FILE.into());
    want.sort();
    assert_eq!(names, want);
    assert!(names.iter().all(|n| !n.starts_with("part-")));
    assert!(s3::gc_prefix(&remote).unwrap().is_empty());
}

#[test]
fn a_two_level_checkpoint_on_s3_reads_only_the_parts_it_needs() {
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let u = url("multi/two-level");
    let (w, v, step) = (global_w(), global_v(), [42i64]);
    let id = new_checkpoint_id().unwrap();
    let remote = Remote::new(&u, &cfg).unwrap();
    for rank in 0..2u32 {
        ckptstore::write_part(
            &remote,
            &id,
            rank,
            &rank_items(rank, &w, &v, &step),
            &part_opts(),
        )
        .unwrap();
    }
    let copts = CommitOptions {
        layout: ckptstore::write::parts::Layout::TwoLevel,
        ..Default::default()
    };
    ckptstore::commit(
        &remote,
        &id,
        &[],
        &rendezvous(2, std::time::Duration::from_secs(5), &copts),
    )
    .unwrap();
    // The part objects are the checkpoint's now: gc keeps them.
    let swept = s3::gc_prefix(&remote).unwrap();
    assert!(swept.is_empty(), "{swept:?}");
    let eager = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    let lazy = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .unwrap();
    assert!(eager.catalog().two_level() && lazy.catalog().two_level());
    // Rank 1's rows: its own part only.
    let (r0, nr) = (ROWS / 2, ROWS / 2);
    for got in [
        eager
            .read("w")
            .region(&[r0, 0], &[nr, COLS])
            .to_tensor()
            .unwrap(),
        lazy.read("w")
            .region(&[r0, 0], &[nr, COLS])
            .to_tensor()
            .unwrap(),
    ] {
        assert_eq!(
            got.as_slice::<f32>().unwrap(),
            &w_box(&w, r0, nr, 0, COLS)[..]
        );
    }
    assert_eq!(eager.catalog().parts_read().0, 1);
    assert_eq!(lazy.catalog().parts_read().0, 1);
    assert_eq!(
        eager
            .read("w")
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w[..]
    );
    assert_eq!(
        eager
            .read("v")
            .to_tensor()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &v[..]
    );
    assert_eq!(
        eager
            .read("step")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[42]
    );
    eager.verify().unwrap();
    assert_eq!(
        lazy.read("w")
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w[..]
    );
    assert_eq!(
        lazy.read("v")
            .to_tensor()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &v[..]
    );
    lazy.verify().unwrap();
    // A damaged part object is refused, named by URL; the other part still reads.
    let pname = ckptstore::write::part_file_name(&id, 0);
    let mut bytes = remote.get_small(&pname, 1 << 30).unwrap().unwrap();
    bytes[10] ^= 1;
    remote.put_small(&pname, bytes).unwrap();
    let ck = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    let e = ck
        .read("w")
        .region(&[0, 0], &[1, COLS])
        .to_tensor()
        .unwrap_err();
    match &e {
        Error::InvalidPart { part, .. } => {
            assert!(part.contains("s3://") && part.ends_with(&pname), "{e}")
        }
        other => panic!("expected InvalidPart, got {other:?}"),
    }
    assert_eq!(
        ck.read("w")
            .region(&[r0, 0], &[1, COLS])
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w_box(&w, r0, 1, 0, COLS)[..]
    );
}

#[test]
fn a_missing_rank_commits_nothing_and_gc_collects_the_leftovers() {
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let u = url("multi/missing");
    let remote = Remote::new(&u, &cfg).unwrap();
    let (w, v, step) = (global_w(), global_v(), [1i64]);
    let id = new_checkpoint_id().unwrap();
    let p0 = ckptstore::write_part(&remote, &id, 0, &rank_items(0, &w, &v, &step), &part_opts())
        .unwrap();

    // The rendezvous waits a bounded time, then names the missing rank and the prefix.
    let copts = CommitOptions::default();
    let e = ckptstore::commit(
        &remote,
        &id,
        &[],
        &rendezvous(2, std::time::Duration::ZERO, &copts),
    )
    .unwrap_err();
    match &e {
        Error::MissingParts { missing, .. } => assert_eq!(missing, &[1]),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains(&u.to_string()), "{e}");
    let e = ckptstore::commit(
        &remote,
        &id,
        &[],
        &rendezvous(2, std::time::Duration::from_millis(200), &copts),
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::MissingParts { missing, .. } if missing == &[1]),
        "{e}"
    );
    // The commit with the parts in hand refuses too.
    let ws = CommitOptions {
        world_size: Some(2),
        ..Default::default()
    };
    let e = ckptstore::commit(&remote, &id, std::slice::from_ref(&p0), &ws).unwrap_err();
    assert!(
        matches!(&e, Error::MissingParts { missing, .. } if missing == &[1]),
        "{e}"
    );
    // No manifest was written.
    assert_eq!(remote.get_small(MANIFEST_FILE, 1 << 20).unwrap(), None);
    assert!(matches!(
        Remote::new(&u, &cfg).and_then(|r| ckptstore::checkpoint::remote::open(&r)),
        Err(Error::NotFound { .. })
    ));

    // A part whose shard object is gone is refused with the object's key named.
    let shard0 = p0.shards[0].file.clone();
    let saved = remote.get_small(&shard0, 1 << 30).unwrap().unwrap();
    remote.delete(&shard0).unwrap();
    let one = CommitOptions::default();
    let e = ckptstore::commit(&remote, &id, std::slice::from_ref(&p0), &one).unwrap_err();
    assert!(
        matches!(e, Error::ShardMismatch { .. })
            && e.to_string().contains(&u.child(&shard0).to_string()),
        "{e}"
    );
    assert_eq!(remote.get_small(MANIFEST_FILE, 1 << 20).unwrap(), None);
    remote.put_small(&shard0, saved).unwrap();

    // gc collects rank 0's shards and part object: nothing engine-written remains.
    let mut deleted = s3::gc_prefix(&remote).unwrap();
    deleted.sort();
    let mut want: Vec<String> = p0.shards.iter().map(|s| s.file.clone()).collect();
    want.push(p0.file_name());
    want.sort();
    assert_eq!(deleted, want);
    assert!(remote.list().unwrap().objects.is_empty());
}

#[test]
fn location_functions_dispatch_multi_rank_saves() {
    // Local paths go to the local multi-rank writer (the s3:// side is the same code as
    // above, configured from the environment).
    let dir = tempfile::tempdir().unwrap();
    let loc = dir.path().to_str().unwrap();
    let (w, v, step) = (global_w(), global_v(), [5i64]);
    let id = new_checkpoint_id().unwrap();
    for rank in 0..2 {
        ckptstore::write_part(
            loc,
            &id,
            rank,
            &rank_items(rank, &w, &v, &step),
            &part_opts(),
        )
        .unwrap();
    }
    ckptstore::commit(
        loc,
        &id,
        &[],
        &rendezvous(
            2,
            std::time::Duration::from_secs(5),
            &CommitOptions::default(),
        ),
    )
    .unwrap();
    let ck = ckptstore::open(loc).unwrap();
    assert_eq!(
        ck.read("v")
            .region(&[2], &[2])
            .to_tensor()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &v[2..4]
    );
    assert!(matches!(
        ckptstore::commit("gs://b/p", &id, &[], &CommitOptions::default()),
        Err(Error::UnsupportedUrl { .. })
    ));
}

#[test]
fn remote_region_reads_fetch_only_the_touched_blocks() {
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let u = url("multi/regions");
    let remote = Remote::new(&u, &cfg).unwrap();
    let (w, v, step) = (global_w(), global_v(), [9i64]);
    let id = new_checkpoint_id().unwrap();
    for rank in 0..2 {
        ckptstore::write_part(
            &remote,
            &id,
            rank,
            &rank_items(rank, &w, &v, &step),
            &part_opts(),
        )
        .unwrap();
    }
    ckptstore::commit(
        &remote,
        &id,
        &[],
        &rendezvous(2, std::time::Duration::ZERO, &Default::default()),
    )
    .unwrap();
    // The downloaded checkpoint is the reference: the same region read from all the bytes.
    let full = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    let rc = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .unwrap();
    assert_eq!(rc.bytes_fetched(), 0);

    // Rows of "w" are 4 KiB, 64 to a 256 KiB block: rows [1000, 1100) x columns [10, 20)
    // of rank 0's chunk touch blocks 15..=17; a box across both chunks; the whole "v"
    // (no block CRCs: 24 bytes, chunks read whole); a column slab (every block).
    let regions: [(&str, Vec<u64>, Vec<u64>); 5] = [
        ("w", vec![1000, 10], vec![100, 10]),
        ("w", vec![ROWS / 2 - 70, 500], vec![140, 3]),
        ("w", vec![0, 341], vec![ROWS, 341]),
        ("v", vec![1], vec![4]),
        ("step", vec![], vec![]),
    ];
    for (name, off, shape) in &regions {
        let before = rc.bytes_fetched();
        let got = rc.read(name).region(off, shape).to_tensor().unwrap();
        let want = full.read(name).region(off, shape).to_tensor().unwrap();
        assert_eq!(got.bytes(), want.bytes(), "{name} {off:?} {shape:?}");
        assert_eq!(got.shape(), &shape[..]);
        assert_eq!(
            rc.bytes_fetched() - before,
            full.read(name)
                .region(off, shape)
                .plan()
                .unwrap()
                .bytes_read(),
            "{name} {off:?} {shape:?}"
        );
    }
    assert_eq!(
        full.read("w")
            .region(&[1000, 10], &[100, 10])
            .plan()
            .unwrap()
            .bytes_read(),
        3 << 18
    );
    assert!(matches!(
        rc.read("w").region(&[ROWS, 0], &[1, 1]).to_tensor(),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        rc.read("nope").region(&[0], &[1]).to_tensor(),
        Err(Error::TensorNotFound { .. })
    ));

    // Damage one byte of block 12 of rank 0's chunk (rows [768, 832)).
    let ck_m = full.manifest().unwrap();
    let t = ck_m
        .tensors
        .iter()
        .find(|t| t.name == "w@0,0~r0")
        .unwrap()
        .clone();
    let shard = ck_m.shards[t.shard].file.clone();
    let original = remote.get_small(&shard, 1 << 30).unwrap().unwrap();
    let mut bad = original.clone();
    bad[(t.offsets[0] + 12 * (256 << 10) + 123) as usize] ^= 0x40;
    remote.put_small(&shard, bad).unwrap();
    // Outside the region: the read succeeds, bit for bit.
    let got = rc
        .read("w")
        .region(&[1000, 10], &[100, 10])
        .to_tensor()
        .unwrap();
    assert_eq!(
        got.as_slice::<f32>().unwrap(),
        &w_box(&w, 1000, 100, 10, 10)[..]
    );
    // Inside it: refused, naming the tensor, the block and the object.
    let e = rc
        .read("w")
        .region(&[780, 0], &[2, COLS])
        .to_tensor()
        .unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, Error::ChecksumMismatch { .. }), "{s}");
    assert!(
        s.contains("w@0,0~r0")
            && s.contains("block 12")
            && s.contains(&u.child(&shard).to_string()),
        "{s}"
    );
    remote.put_small(&shard, original).unwrap();
    assert!(rc
        .read("w")
        .region(&[780, 0], &[2, COLS])
        .to_tensor()
        .is_ok());
}

#[test]
fn rank_processes_write_parts_on_s3_and_the_coordinator_commits() {
    use part_layout::{box_bytes, global_bytes, globals, STEP};
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let u = url("multi/procs");
    let world = 3u32;
    let id = new_checkpoint_id().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let env = srv.env();
    // Each rank is a process configured from the environment (ckptstore::write_part).
    let children: Vec<std::process::Child> = (0..world)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_ckpt"))
                .current_dir(dir.path())
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .args(["_write-part", &u.to_string(), "--id", &id])
                .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
                .spawn()
                .unwrap()
        })
        .collect();
    // The coordinator polls the prefix while the ranks upload.
    let remote = Remote::new(&u, &cfg).unwrap();
    let info = ckptstore::commit(
        &remote,
        &id,
        &[],
        &rendezvous(
            world,
            std::time::Duration::from_secs(120),
            &CommitOptions::default(),
        ),
    )
    .unwrap();
    for c in children {
        assert!(c.wait_with_output().unwrap().status.success());
    }
    assert_eq!(info.checkpoint_id, id);
    let ck = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    ck.verify().unwrap();
    let rc = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open_lazy(&r))
        .unwrap();
    for g in globals(world) {
        let whole = global_bytes(&g);
        assert_eq!(
            ck.read(g.name).to_tensor().unwrap().bytes(),
            &whole[..],
            "{}",
            g.name
        );
        // A sub-box, read lazily and from the downloaded checkpoint.
        let offsets: Vec<u64> = g.shape.iter().map(|&n| n / 2).collect();
        let shape: Vec<u64> = g.shape.iter().map(|&n| n - n / 2).collect();
        let want = box_bytes(&whole, g.dtype.size(), &g.shape, &offsets, &shape);
        assert_eq!(
            ck.read(g.name)
                .region(&offsets, &shape)
                .to_tensor()
                .unwrap()
                .bytes(),
            &want[..]
        );
        assert_eq!(
            rc.read(g.name)
                .region(&offsets, &shape)
                .to_tensor()
                .unwrap()
                .bytes(),
            &want[..]
        );
    }
    assert_eq!(
        ck.read("step")
            .view_unchecked()
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[STEP]
    );
}

#[test]
fn gc_takes_a_journal_of_a_completed_upload_as_done() {
    // A writer that completed an upload and stopped before deleting its journal: the
    // journal names an object that exists and an upload the server no longer has (s3s-fs
    // answers that abort with an error other than NoSuchUpload). gc removes the journal
    // and keeps the checkpoint.
    let srv = S3Server::start(BUCKET);
    let cfg = small_parts(&srv);
    let u = url("journal");
    let f = Fixture::new(21);
    Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::save(&r, &f.tensors(), &opts()))
        .unwrap();
    let r = Remote::new(&u, &cfg).unwrap();
    let ck = Remote::new(&u, &cfg)
        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
        .unwrap();
    // (Shards of a downloaded checkpoint are named by URL.)
    let file = ck.shards()[0].file.rsplit('/').next().unwrap().to_string();
    let shard_key = u.key(&file);
    let journal = ".ckpt-tmp-upload-0123456789abcdef0123456789abcdef";
    let body = format!(r#"{{"key":"{shard_key}","upload_id":"no-such-upload"}}"#);
    r.put_small(journal, body.into_bytes()).unwrap();
    let removed = s3::gc_prefix(&r).unwrap();
    assert_eq!(removed, vec![journal.to_string()]);
    assert_same(
        &Remote::new(&u, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f,
    );

    // A journal whose upload cannot be aborted and whose object does not exist stays, and
    // gc fails naming the key and the upload.
    let missing = u.key("shard-feedfacefeedfacefeedfacefeedface-00000.safetensors");
    let body = format!(r#"{{"key":"{missing}","upload_id":"no-such-upload"}}"#);
    r.put_small(journal, body.into_bytes()).unwrap();
    let e = s3::gc_prefix(&r).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Remote { .. }), "{msg}");
    assert!(
        msg.contains(&missing) && msg.contains("no-such-upload"),
        "{msg}"
    );
    assert!(r.get_small(journal, 1 << 16).unwrap().is_some());

    // A journal naming an object outside its prefix (another run's shard, any key of the
    // bucket) names nothing gc may abort: it is deleted without an abort (which would fail
    // here as above), and the checkpoint stays.
    let foreign = url("other-run").key("shard-feedfacefeedfacefeedfacefeedface-00000.safetensors");
    let body = format!(r#"{{"key":"{foreign}","upload_id":"no-such-upload"}}"#);
    r.put_small(journal, body.into_bytes()).unwrap();
    assert_eq!(s3::gc_prefix(&r).unwrap(), vec![journal.to_string()]);
    assert!(r.get_small(journal, 1 << 16).unwrap().is_none());
    assert_same(
        &Remote::new(&u, &cfg)
            .and_then(|r| ckptstore::checkpoint::remote::open(&r))
            .unwrap(),
        &f,
    );
}

/// The options of a commit that waits (at most `timeout`) for the part descriptors of ranks
/// `0..world` under the prefix (the rendezvous), from `opts`.
fn rendezvous(world: u32, timeout: std::time::Duration, opts: &CommitOptions) -> CommitOptions {
    CommitOptions {
        world_size: Some(world),
        wait_for_parts: Some(timeout),
        ..opts.clone()
    }
}
