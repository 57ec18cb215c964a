//! A publish that happened but reported failure (an object store applies a PUT and its
//! answer is lost; a file system renames and then reports an error): the writer reads the
//! manifest back, and never deletes the shards of the manifest that is committed (issue 27
//! §2, found by tests/python/test_flaky_s3.py on S3; here over the local store's `Fs` seam).

use std::io;
use std::path::Path;

use ckptstore::write::fs::{Fs, StdFs};
use ckptstore::{Checkpoint, SaveOptions, TensorRef};

/// The real file system, except that renaming onto `ckpt-manifest.json` happens and then
/// reports `EIO` (when `lie` is set), or does not happen and reports `EIO` (when unset).
struct RenameAnswerLost {
    lie: bool,
}

impl Fs for RenameAnswerLost {
    type File = std::fs::File;
    fn create(&self, path: &Path) -> io::Result<Self::File> {
        StdFs.create(path)
    }
    fn sync(&self, file: &mut Self::File, path: &Path) -> io::Result<()> {
        StdFs.sync(file, path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if to.file_name().is_some_and(|n| n == "ckpt-manifest.json") {
            if self.lie {
                StdFs.rename(from, to)?;
            }
            return Err(io::Error::from_raw_os_error(5));
        }
        StdFs.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        StdFs.sync_dir(dir)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        StdFs.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        StdFs.list(dir)
    }
    fn read_prefix(&self, path: &Path, max: u64) -> io::Result<(u64, Vec<u8>)> {
        StdFs.read_prefix(path, max)
    }
}

fn tensors(v: f32) -> Vec<f32> {
    vec![v; 4096]
}

#[test]
fn a_manifest_publish_that_happened_is_a_commit_whatever_it_answered() {
    let dir = tempfile::tempdir().unwrap();
    let old = tensors(1.0);
    ckptstore::save(
        dir.path(),
        &[TensorRef::from_slice("w", &[4096], &old)],
        &SaveOptions::default(),
    )
    .unwrap();
    let new = tensors(2.0);
    let fs = RenameAnswerLost { lie: true };
    let info = ckptstore::save(
        &ckptstore::store::LocalStore::new(&fs, dir.path()),
        &[TensorRef::from_slice("w", &[4096], &new)],
        &SaveOptions::default(),
    )
    .expect("the manifest is ours: the save committed");
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.manifest().unwrap().checkpoint_id, info.checkpoint_id);
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &new[..]
    );
    ck.verify().unwrap();
}

#[test]
fn a_manifest_publish_that_did_not_happen_leaves_the_old_checkpoint_and_no_new_file() {
    let dir = tempfile::tempdir().unwrap();
    let old = tensors(1.0);
    let first = ckptstore::save(
        dir.path(),
        &[TensorRef::from_slice("w", &[4096], &old)],
        &SaveOptions::default(),
    )
    .unwrap();
    let before: std::collections::BTreeSet<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let fs = RenameAnswerLost { lie: false };
    let new = tensors(2.0);
    assert!(ckptstore::save(
        &ckptstore::store::LocalStore::new(&fs, dir.path()),
        &[TensorRef::from_slice("w", &[4096], &new)],
        &SaveOptions::default(),
    )
    .is_err());
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.manifest().unwrap().checkpoint_id, first.checkpoint_id);
    assert_eq!(
        ck.read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &old[..]
    );
    let after: std::collections::BTreeSet<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "the failed save left files behind");
}
