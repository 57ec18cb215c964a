//! A URL is never taken as a local path by the Rust API (issue 23, finding 1): the root
//! verbs (`ckptstore::{save, open, write_part, commit}`) take a location and send `s3://` to
//! the object store; what works on local files only (`Checkpoint::open`,
//! `CheckpointManager::step_dir`) refuses URL text with `UnsupportedUrl` naming itself,
//! and the manager, like the root verbs, takes `s3://` roots to the object store.
//! Before the fix both `ckptstore::save("s3://bucket/run", ..)` and
//! `Checkpoint::open("s3://bucket/run")` reported success on a local directory
//! `s3:/bucket/run`.
//!
//! One test in this binary: it sets the process's working directory and the `AWS_*`
//! environment (an s3s-fs server on loopback), which no other test may see change.

#[path = "common/s3server.rs"]
mod s3server;

use std::path::Path;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::write::parts::{self, CommitOptions, PartItem};
use ckptstore::{Checkpoint, Error, SaveOptions, TensorRef};
use s3server::S3Server;

fn refused<T: std::fmt::Debug>(r: ckptstore::Result<T>, verb: &str) {
    match r {
        Err(Error::UnsupportedUrl { reason, .. }) => {
            assert!(reason.contains(verb), "{verb}: {reason}")
        }
        other => panic!("{verb}: expected UnsupportedUrl, got {other:?}"),
    }
}

#[test]
fn the_rust_api_never_takes_a_url_as_a_local_path() {
    let cwd = tempfile::tempdir().unwrap();
    std::env::set_current_dir(cwd.path()).unwrap();
    let srv = S3Server::start("bkt");
    for (k, v) in srv.env() {
        std::env::set_var(k, v);
    }
    let w: Vec<f32> = (0..16).map(|i| i as f32 * 0.5).collect();
    let t = [TensorRef::from_slice("w", &[4, 4], &w)];
    let url = "s3://bkt/run/one";

    // The root verbs: to the object store and back, bit for bit.
    let info = ckptstore::save(url, &t, &SaveOptions::default()).unwrap();
    assert_eq!(info.tensors, 1);
    let ck = ckptstore::open(url).unwrap();
    ck.verify().unwrap();
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w[..]
    );
    // A path whose text is a URL is that URL, too.
    let ck = ckptstore::open(Path::new(url)).unwrap();
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w[..]
    );
    // Other schemes are refused, never written locally.
    assert!(matches!(
        ckptstore::save("gs://b/p", &t, &SaveOptions::default()),
        Err(Error::UnsupportedUrl { .. })
    ));

    // What works on local files only refuses URL text, naming itself.
    refused(Checkpoint::open(url), "Checkpoint::open");
    // The multi-rank verbs take a location too: parts and commit on the object store.
    let id = parts::new_checkpoint_id().unwrap();
    let item = PartItem::Whole(TensorRef::from_slice("w", &[4, 4], &w));
    let part = ckptstore::write_part(
        "s3://bkt/run/parts",
        &id,
        0,
        &[item],
        &SaveOptions::default(),
    )
    .unwrap();
    ckptstore::commit(
        "s3://bkt/run/parts",
        &id,
        &[part],
        &CommitOptions::default(),
    )
    .unwrap();
    let ck = ckptstore::open("s3://bkt/run/parts").unwrap();
    ck.verify().unwrap();
    assert_eq!(
        ck.read("w").view().unwrap().as_slice::<f32>().unwrap(),
        &w[..]
    );
    // The manager takes a location: its steps go to the object store.
    let mgr = CheckpointManager::new("s3://bkt/run/mgr", Retention::keep_last(1)).unwrap();
    mgr.save(5, &t, None, &SaveOptions::default()).unwrap();
    assert_eq!(mgr.steps().unwrap(), [5]);
    let ck = ckptstore::open("s3://bkt/run/mgr/step-00000005").unwrap();
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w[..]
    );
    refused(mgr.step_dir(5), "CheckpointManager::step_dir");

    // Nothing was created in the working directory (before: `s3:/bkt/run/one`).
    let names: Vec<_> = std::fs::read_dir(cwd.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        names.is_empty(),
        "a URL was taken as a local path: {names:?}"
    );

    // file:// URLs are local paths.
    let local = cwd.path().join("local");
    let file_url = format!("file://{}", local.display());
    ckptstore::save(file_url.as_str(), &t, &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(&file_url).unwrap();
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &w[..]
    );
    std::env::set_current_dir("/").unwrap();
}
