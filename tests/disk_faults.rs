//! Disks that fail under a load (issue 27 §3): a shard read with `pread`
//! (`Checkpoint::open_pread`, `FileShard`) that returns EIO, or shrinks while open, fails
//! the read that touches the bad bytes with an error naming the file, never `SIGBUS`
//! (which is what a memory map turns the same failure into); the caller's destination is
//! unchanged after a failed read, and reads that do not touch the bad bytes still work.

use std::fs::File;
use std::io;
use std::path::Path;

use ckptstore::checkpoint::{FileShard, ReadAt};
use ckptstore::{Checkpoint, Error, SaveOptions, TensorRef};

/// Three F32 tensors of 1 Mi elements (4 MiB, 16 CRC blocks) each, in one shard.
fn save(dir: &Path) -> Vec<Vec<f32>> {
    let ts: Vec<Vec<f32>> = (0..3)
        .map(|k| (0..1 << 20).map(|i| (i * 3 + k) as f32 * 0.5).collect())
        .collect();
    let refs: Vec<TensorRef<'_>> = ts
        .iter()
        .enumerate()
        .map(|(k, t)| TensorRef::from_slice(format!("t{k}"), &[1024, 1024], t))
        .collect();
    ckptstore::save(dir, &refs, &SaveOptions::default()).unwrap();
    ts
}

/// A file that returns EIO for any read touching bytes at or past `bad`.
struct FailsFrom {
    file: File,
    bad: u64,
}

impl ReadAt for FailsFrom {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if offset + buf.len() as u64 > self.bad {
            return Err(io::Error::from_raw_os_error(5)); // EIO
        }
        std::os::unix::fs::FileExt::read_at(&self.file, buf, offset)
    }
}

#[test]
fn pread_reads_what_the_map_reads() {
    let dir = tempfile::tempdir().unwrap();
    let ts = save(dir.path());
    let map = Checkpoint::open(dir.path()).unwrap();
    let pread = Checkpoint::open_pread(dir.path()).unwrap();
    assert!(!pread.resident());
    for (k, t) in ts.iter().enumerate() {
        let name = format!("t{k}");
        assert_eq!(
            pread
                .read(&name)
                .to_tensor()
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            &t[..]
        );
        assert_eq!(
            pread
                .read(&name)
                .region(&[10, 20], &[5, 7])
                .to_tensor()
                .unwrap()
                .bytes(),
            map.read(&name)
                .region(&[10, 20], &[5, 7])
                .to_tensor()
                .unwrap()
                .bytes()
        );
    }
    assert_eq!(pread.verify().unwrap(), map.verify().unwrap());
    // A directory without a manifest is not found (foreign stores open with `open`).
    assert!(matches!(
        Checkpoint::open_pread(dir.path().join("nope")),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn eio_fails_only_the_reads_that_touch_the_bad_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let ts = save(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let m = ck.manifest().unwrap().clone();
    let t2 = ck.info("t2").unwrap().clone();
    let path = dir.path().join(&m.shards[0].file);
    // The disk fails from the middle of t2 on.
    let bad = t2.offsets[0] + t2.nbytes() / 2;
    let src = FailsFrom {
        file: File::open(&path).unwrap(),
        bad,
    };
    let shard = FileShard::new(
        Box::new(src),
        &path,
        m.shards[0].size,
        m.shards[0].header_size,
    )
    .unwrap();
    let manifest = std::fs::read(dir.path().join("ckpt-manifest.json")).unwrap();
    let faulty = Checkpoint::from_parts(&manifest, vec![shard]).unwrap();

    // Tensors before the bad bytes read; t2 fails naming the file, as an I/O error.
    assert_eq!(
        faulty
            .read("t0")
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &ts[0][..]
    );
    match faulty.read("t2").to_tensor() {
        Err(Error::Io { op, path: p, .. }) => {
            assert_eq!(op, "read");
            assert_eq!(p, path);
        }
        other => panic!("{other:?}"),
    }
    // A region before the bad bytes of t2 reads; one across them fails and leaves the
    // caller's destination as it was.
    assert!(faulty
        .read("t2")
        .region(&[0, 0], &[4, 1024])
        .to_tensor()
        .is_ok());
    let mut out = vec![0xABu8; 4 * 1024 * 4];
    assert!(faulty
        .read("t2")
        .region(&[600, 0], &[4, 1024])
        .into(&mut out)
        .is_err());
    assert!(
        out.iter().all(|&b| b == 0xAB),
        "a failed read changed its destination"
    );
    // verify and streams report the failure; the process is alive to say so.
    assert!(matches!(faulty.verify(), Err(Error::Io { .. })));
    let mut seen = Vec::new();
    let r = faulty.stream_tensors(u64::MAX, |t, _| {
        seen.push(t.name.clone());
        Ok(())
    });
    assert!(matches!(r, Err(Error::Io { .. })));
    assert_eq!(seen, ["t0", "t1"]);
}

#[test]
fn a_shard_truncated_while_open_is_an_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let ts = save(dir.path());
    let ck = Checkpoint::open_pread(dir.path()).unwrap();
    let file = &ck.manifest().unwrap().shards[0].file;
    let cut = ck.info("t1").unwrap().offsets[0] + 100;
    // Against the contract (ckptstore never truncates a committed file): another program
    // cuts the shard while it is open. Under a map, touching t2 would be SIGBUS.
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join(file))
        .unwrap()
        .set_len(cut)
        .unwrap();
    assert_eq!(
        ck.read("t0")
            .to_tensor()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &ts[0][..]
    );
    for name in ["t1", "t2"] {
        match ck.read(name).to_tensor() {
            Err(Error::ShardMismatch {
                file: f, reason, ..
            }) => {
                assert_eq!(&f, file);
                assert!(reason.contains("truncated"), "{reason}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    // Opening it again refuses it by its size, as any open does.
    assert!(matches!(
        Checkpoint::open_pread(dir.path()),
        Err(Error::ShardMismatch { .. })
    ));
}
