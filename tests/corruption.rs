//! Damaged and hostile checkpoints: every failure is a typed error naming the file, shard
//! and tensor; never a panic, never accepted as sound.

use std::path::{Path, PathBuf};

use ckptstore::{save, Checkpoint, Error, SaveOptions, TensorRef};

const MANIFEST: &str = "ckpt-manifest.json";

#[path = "common/manifest_edit.rs"]
mod manifest_edit;
use manifest_edit::rewrite_manifest;

fn small_checkpoint(dir: &Path) {
    let a: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let b: Vec<i64> = vec![7, -8];
    let c = [true as u8, false as u8, true as u8];
    let s = [0.5f32];
    save(
        dir,
        &[
            TensorRef::from_slice("a", &[2, 3], &a),
            TensorRef::from_slice("b", &[2], &b),
            TensorRef::new("c", ckptstore::DType::Bool, &[3], &c),
            TensorRef::from_slice("s", &[], &s),
        ],
        &SaveOptions {
            max_shard_size: 24,
            metadata: serde_json::json!({"k": "v"}),
            ..Default::default()
        },
    )
    .unwrap();
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.file_name().unwrap().to_str().unwrap().starts_with('.'))
        .collect();
    v.sort();
    v
}

/// Open and verify; Ok only if both accept.
fn check(dir: &Path) -> Result<(), Error> {
    let ck = Checkpoint::open(dir)?;
    ck.verify().map(|_| ())
}

fn header_len(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

#[test]
fn every_bit_flip_in_manifest_and_headers_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    small_checkpoint(dir.path());
    check(dir.path()).unwrap();
    let mut cases = 0;
    for f in files(dir.path()) {
        let orig = std::fs::read(&f).unwrap();
        let is_manifest = f.ends_with(MANIFEST);
        // Whole manifest; for shards the 8-byte length and the header JSON.
        let end = if is_manifest {
            orig.len()
        } else {
            header_len(&orig)
        };
        for bit in 0..end * 8 {
            let mut b = orig.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            std::fs::write(&f, &b).unwrap();
            let r = check(dir.path());
            assert!(r.is_err(), "{}: flip of bit {bit} accepted", f.display());
            cases += 1;
        }
        std::fs::write(&f, &orig).unwrap();
    }
    check(dir.path()).unwrap();
    assert!(cases > 5000, "only {cases} cases");
}

#[test]
fn every_bit_flip_in_tensor_data_fails_verify_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    small_checkpoint(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let infos: Vec<_> = ck.tensors().to_vec();
    let shard_files: Vec<String> = ck.shards().iter().map(|s| s.file.clone()).collect();
    drop(ck);
    for t in infos {
        let path = dir.path().join(&shard_files[t.shard]);
        let orig = std::fs::read(&path).unwrap();
        for bit in (t.offsets[0] * 8)..(t.offsets[1] * 8) {
            let mut b = orig.clone();
            b[(bit / 8) as usize] ^= 1 << (bit % 8);
            std::fs::write(&path, &b).unwrap();
            let ck = Checkpoint::open(dir.path()).unwrap();
            match ck.verify() {
                Err(Error::ChecksumMismatch {
                    what,
                    shard,
                    file,
                    expected,
                    got,
                }) => {
                    assert_eq!(what, format!("tensor {:?}", t.name));
                    assert_eq!(shard, t.shard);
                    assert_eq!(file, shard_files[t.shard]);
                    assert_ne!(expected, got);
                }
                other => panic!("expected a checksum mismatch for {}, got {other:?}", t.name),
            }
            // Reading that tensor with verification fails too; the others stay readable.
            assert!(ck.read(&t.name).view().is_err());
        }
        std::fs::write(&path, &orig).unwrap();
    }
}

#[test]
fn every_truncation_of_every_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    small_checkpoint(dir.path());
    for f in files(dir.path()) {
        let orig = std::fs::read(&f).unwrap();
        for len in 0..orig.len() {
            std::fs::write(&f, &orig[..len]).unwrap();
            let r = check(dir.path());
            assert!(r.is_err(), "{} truncated to {len} accepted", f.display());
        }
        std::fs::write(&f, &orig).unwrap();
    }
    check(dir.path()).unwrap();
}

#[test]
fn missing_shard_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    small_checkpoint(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let f = ck.shards()[1].file.clone();
    drop(ck);
    std::fs::remove_file(dir.path().join(&f)).unwrap();
    match Checkpoint::open(dir.path()) {
        Err(Error::ShardMismatch {
            shard: 1,
            file,
            reason,
        }) => {
            assert_eq!(file, f);
            assert!(reason.contains("missing"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn hostile_manifests_are_refused() {
    type Edit = Box<dyn Fn(&mut serde_json::Value, &Path)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "dotdot",
            Box::new(|v, _| v["shards"][0]["file"] = "../escape.safetensors".into()),
            "plain file name",
        ),
        (
            "absolute",
            Box::new(|v, _| v["shards"][0]["file"] = "/etc/passwd".into()),
            "plain file name",
        ),
        (
            "nul",
            Box::new(|v, _| v["shards"][0]["file"] = "a\u{0}b".into()),
            "plain file name",
        ),
        (
            "duplicate shard",
            Box::new(|v, _| v["shards"][1] = v["shards"][0].clone()),
            "listed twice",
        ),
        (
            "wrong size",
            Box::new(|v, _| v["shards"][0]["size"] = 10_000.into()),
            "manifest records 10000",
        ),
        (
            "tensor outside",
            Box::new(|v, _| v["tensors"][0]["offsets"] = serde_json::json!([0, 24])),
            "data section",
        ),
        (
            "duplicate tensor",
            Box::new(|v, _| v["tensors"][1]["name"] = "a".into()),
            "listed twice",
        ),
        (
            "shape lies",
            Box::new(|v, _| v["tensors"][0]["shape"] = serde_json::json!([3, 2])),
            "header says",
        ),
        (
            "dtype lies",
            Box::new(|v, _| {
                v["tensors"][0]["dtype"] = "I32".into();
                v["tensors"][0].as_object_mut().unwrap().remove("absmax");
            }),
            "header says",
        ),
        (
            "absmax on a non-F32 tensor",
            Box::new(|v, _| v["tensors"][0]["dtype"] = "I32".into()),
            "absmax is recorded only for F32 tensors",
        ),
        (
            "negative absmax",
            Box::new(|v, _| v["tensors"][0]["absmax"] = (-1.0).into()),
            "not a finite, non-negative FP32 value",
        ),
        (
            "absmax not an FP32 value",
            Box::new(|v, _| v["tensors"][0]["absmax"] = 0.1f64.into()),
            "not a finite, non-negative FP32 value",
        ),
        (
            "dropped tensor",
            Box::new(|v, _| {
                v["tensors"].as_array_mut().unwrap().remove(0);
            }),
            "shard 0",
        ),
        (
            "dropped one of two tensors in a shard",
            Box::new(|v, _| {
                let t = v["tensors"].as_array_mut().unwrap();
                let last = t.len() - 1;
                t.remove(last);
            }),
            "header lists",
        ),
        (
            "huge shard index",
            Box::new(|v, _| v["tensors"][0]["shard"] = u64::MAX.into()),
            "out of range",
        ),
        (
            "version",
            Box::new(|v, _| v["version"] = 99.into()),
            "unsupported format version 99",
        ),
        (
            "feature",
            Box::new(|v, _| v["features"] = serde_json::json!(["chunked"])),
            "chunked",
        ),
        (
            "symlink outside",
            Box::new(|v, dir| {
                let outside = dir.parent().unwrap().join("outside.safetensors");
                let name = v["shards"][0]["file"].as_str().unwrap().to_string();
                std::fs::copy(dir.join(&name), &outside).unwrap();
                std::fs::remove_file(dir.join(&name)).unwrap();
                std::os::unix::fs::symlink(&outside, dir.join(&name)).unwrap();
            }),
            "not a regular file",
        ),
    ];
    for (what, edit, want) in cases {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ck");
        small_checkpoint(&dir);
        rewrite_manifest(&dir, |v| edit(v, &dir));
        let err = check(&dir).expect_err(what);
        assert!(
            err.to_string().contains(want),
            "{what}: {want:?} not in {err}"
        );
    }
}

#[test]
fn shard_from_another_checkpoint_is_caught() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    small_checkpoint(a.path());
    small_checkpoint(b.path());
    let ca = Checkpoint::open(a.path()).unwrap();
    let cb = Checkpoint::open(b.path()).unwrap();
    // Same layout, same data: only the checkpoint id differs.
    let (fa, fb) = (ca.shards()[0].file.clone(), cb.shards()[0].file.clone());
    drop((ca, cb));
    std::fs::copy(b.path().join(&fb), a.path().join(&fa)).unwrap();
    let err = Checkpoint::open(a.path()).unwrap_err();
    assert!(
        matches!(err, Error::ChecksumMismatch { ref what, shard: 0, .. } if what == "shard header"),
        "{err}"
    );
}

#[test]
fn error_messages_name_file_shard_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    small_checkpoint(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let t = ck.info("b").unwrap().clone();
    let file = ck.shards()[t.shard].file.clone();
    drop(ck);
    let p = dir.path().join(&file);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[t.offsets[0] as usize] ^= 0xff;
    std::fs::write(&p, &bytes).unwrap();
    let msg = Checkpoint::open(dir.path())
        .unwrap()
        .verify()
        .unwrap_err()
        .to_string();
    assert!(msg.contains("tensor \"b\""), "{msg}");
    assert!(msg.contains(&file), "{msg}");
    assert!(msg.contains(&format!("shard {}", t.shard)), "{msg}");
}

#[test]
fn foreign_safetensors_and_hf_directories_open_read_only() {
    let dir = tempfile::tempdir().unwrap();
    // A stock safetensors file written by the safetensors crate.
    let data: Vec<f32> = vec![1.0, 2.0, 3.0];
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![3],
        bytemuck::cast_slice(&data),
    )
    .unwrap();
    let bytes = safetensors::serialize([("w", view.clone())], None).unwrap();
    std::fs::write(dir.path().join("model-00001-of-00002.safetensors"), &bytes).unwrap();
    let bytes2 = safetensors::serialize([("v", view)], None).unwrap();
    std::fs::write(dir.path().join("model-00002-of-00002.safetensors"), &bytes2).unwrap();
    let single = Checkpoint::open(dir.path().join("model-00001-of-00002.safetensors")).unwrap();
    assert_eq!(single.kind(), ckptstore::checkpoint::Kind::Safetensors);
    assert_eq!(
        single
            .read("w")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &data[..]
    );
    let rep = single.verify().unwrap();
    assert!(!rep.checksummed);
    // No index yet: the directory is not a checkpoint (we follow indexes, never glob).
    assert!(matches!(
        Checkpoint::open(dir.path()),
        Err(Error::NotFound { .. })
    ));
    let index = serde_json::json!({"metadata": {"total_size": 24},
        "weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let hf = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(hf.kind(), ckptstore::checkpoint::Kind::HfSharded);
    assert_eq!(hf.tensors().len(), 2);
    assert_eq!(
        hf.read("v")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &data[..]
    );
    // An index that lies is refused: two names in one file that holds only one, a path
    // outside the directory.
    for bad in [
        serde_json::json!({"weight_map": {"w": "model-00002-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}),
        serde_json::json!({"weight_map": {"w": "../x.safetensors"}}),
    ] {
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            bad.to_string(),
        )
        .unwrap();
        assert!(matches!(
            Checkpoint::open(dir.path()),
            Err(Error::InvalidManifest { .. })
        ));
    }
}
