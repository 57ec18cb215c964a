//! The one reader over the shard-source seam (issue 23): a checkpoint read through a
//! fetched source (no resident bytes: every read is a `ShardSource::fetch`, as from an
//! object store) gives exactly what the same checkpoint gives read from resident bytes:
//! tensors, regions of global tensors, streams and `verify`, bit for bit, and damaged bytes
//! fail the same reads with the same error naming the same tensor. No S3 server: the
//! fetched source is a test double that serves ranged reads from memory and counts them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ckptstore::write::parts::{self, CommitOptions, PartItem};
use ckptstore::{Checkpoint, Error, SaveOptions, TensorRef};
use proptest::prelude::*;

// The fetch-only shard source of the `fetched` fuzz target (fuzz/src/lib.rs).
#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod fuzz_support;
use fuzz_support::Fetched;

/// A checkpoint directory written by two ranks: a global tensor `w` of `rows x cols` F32
/// split by rows, a replicated 0-dim `step`, and whole tensors `bias` and `h` (F16).
fn write(dir: &std::path::Path, rows: u64, cols: u64, block: u64, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 2001) as f32 / 7.0 - 100.0
        })
        .collect();
    let id = parts::new_checkpoint_id().unwrap();
    let step = [42i64];
    let bias: Vec<f32> = (0..cols).map(|i| i as f32 * 0.25).collect();
    let h: Vec<u16> = (0..rows).map(|i| i as u16).collect();
    let opts = SaveOptions {
        block_size: block,
        max_shard_size: 64 << 10,
        ..SaveOptions::default()
    };
    let half = rows / 2;
    let mut descriptors = Vec::new();
    for rank in 0..2u64 {
        let (r0, r1) = if rank == 0 { (0, half) } else { (half, rows) };
        let part = &w[(r0 * cols) as usize..(r1 * cols) as usize];
        let mut items = vec![
            PartItem::Chunk {
                tensor: TensorRef::from_slice("w", &[r1 - r0, cols], part),
                global_shape: vec![rows, cols],
                offsets: vec![r0, 0],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("step", &[], &step),
                global_shape: vec![],
                offsets: vec![],
            },
        ];
        if rank == 0 {
            items.push(PartItem::Whole(TensorRef::from_slice(
                "bias",
                &[cols],
                &bias,
            )));
            items.push(PartItem::Whole(TensorRef::new(
                "h",
                ckptstore::DType::F16,
                &[rows],
                bytemuck::cast_slice(&h),
            )));
        }
        descriptors.push(ckptstore::write_part(dir, &id, rank as u32, &items, &opts).unwrap());
    }
    ckptstore::commit(dir, &id, &descriptors, &CommitOptions::default()).unwrap();
    w
}

/// The checkpoint at `dir` twice: over resident buffers, and over fetched shards.
fn both(
    dir: &std::path::Path,
    chunk: usize,
    damage: Option<(usize, usize)>,
) -> (Checkpoint<Vec<u8>>, Checkpoint<Fetched>, Arc<AtomicU64>) {
    let manifest = std::fs::read(dir.join("ckpt-manifest.json")).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let mut files: Vec<Vec<u8>> = ck
        .shards()
        .iter()
        .map(|s| std::fs::read(dir.join(&s.file)).unwrap())
        .collect();
    if let Some((shard, at)) = damage {
        files[shard][at] ^= 0x10;
    }
    let m = ck.manifest().unwrap();
    let fetched = Arc::new(AtomicU64::new(0));
    let sources = files
        .iter()
        .zip(&m.shards)
        .map(|(f, e)| Fetched::new(f.clone(), e.header_size, chunk).counting(Arc::clone(&fetched)))
        .collect();
    let resident = Checkpoint::from_parts(&manifest, files).unwrap();
    let lazy = Checkpoint::from_parts(&manifest, sources).unwrap();
    assert!(resident.resident() && !lazy.resident());
    (resident, lazy, fetched)
}

/// Compare two results: equal bytes, or the same error (by its message).
fn same(
    a: ckptstore::Result<ckptstore::Tensor>,
    b: ckptstore::Result<ckptstore::Tensor>,
    what: &str,
) {
    match (a, b) {
        (Ok(x), Ok(y)) => assert_eq!(x.bytes(), y.bytes(), "{what}"),
        (Err(x), Err(y)) => assert_eq!(x.to_string(), y.to_string(), "{what}"),
        (x, y) => panic!("{what}: resident {:?}, fetched {:?}", x.err(), y.err()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn fetched_shards_read_exactly_like_resident_ones(
        rows in 2u64..300,
        cols in 1u64..200,
        block in prop::sample::select(vec![0u64, 4096, 65536]),
        chunk in prop::sample::select(vec![1usize, 777, 65536, 1 << 20]),
        seed in any::<u64>(),
        region in (any::<prop::sample::Index>(), any::<prop::sample::Index>(), any::<prop::sample::Index>(), any::<prop::sample::Index>()),
        damage in prop::option::of((any::<prop::sample::Index>(), any::<prop::sample::Index>())),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let w = write(dir.path(), rows, cols, block, seed);
        // Damage one byte of the data section of one shard (never its header: both
        // opens would refuse it the same way, by the header CRC, before any read).
        let probe = Checkpoint::open(dir.path()).unwrap();
        let m = probe.manifest().unwrap();
        let hit = damage.map(|(s, at)| {
            let i = s.index(m.shards.len());
            let e = &m.shards[i];
            let start = 8 + e.header_size as usize;
            (i, start + at.index(e.size as usize - start))
        });
        let (res, lazy, fetched) = both(dir.path(), chunk, hit);

        for t in res.tensors() {
            same(res.read(&t.name).to_tensor(), lazy.read(&t.name).to_tensor(), &t.name);
        }
        let (r0, r1) = (region.0.index(rows as usize) as u64, region.1.index(rows as usize) as u64);
        let (c0, c1) = (region.2.index(cols as usize) as u64, region.3.index(cols as usize) as u64);
        let (off, shape) = ([r0.min(r1), c0.min(c1)], [r0.abs_diff(r1) + 1, c0.abs_diff(c1) + 1]);
        let before = fetched.load(Ordering::Relaxed);
        let got = lazy.read("w").region(&off, &shape).to_tensor();
        // A region read fetches exactly the byte ranges the plan names.
        let want: u64 = lazy.read("w").region(&off, &shape).plan().unwrap().bytes_read();
        prop_assert_eq!(fetched.load(Ordering::Relaxed) - before, want);
        same(res.read("w").region(&off, &shape).to_tensor(), got, "region of w");
        if hit.is_none() {
            let r = res.read("w").region(&off, &shape).to_tensor().unwrap();
            let x = r.as_slice::<f32>().unwrap();
            for (i, row) in (off[0]..off[0] + shape[0]).enumerate() {
                let a = (row * cols + off[1]) as usize;
                prop_assert_eq!(&x[i * shape[1] as usize..(i + 1) * shape[1] as usize], &w[a..a + shape[1] as usize]);
            }
        }
        same(res.read("w").to_tensor(), lazy.read("w").to_tensor(), "global w");
        same(res.read("step").to_tensor(), lazy.read("step").to_tensor(), "global step");

        // Streams hand over the same tensors in the same order, or stop at the same one.
        let mut a = Vec::new();
        let ra = res.stream_tensors(u64::MAX, |t, x| { a.push((t.name.clone(), x.bytes().to_vec())); Ok(()) });
        let mut b = Vec::new();
        let rb = lazy.stream_tensors(u64::MAX, |t, x| { b.push((t.name.clone(), x.bytes().to_vec())); Ok(()) });
        prop_assert_eq!(a, b);
        prop_assert_eq!(ra.map_err(|e| e.to_string()), rb.map_err(|e| e.to_string()));

        // verify: the same report, or the same first damaged tensor.
        match (res.verify(), lazy.verify()) {
            (Ok(x), Ok(y)) => { prop_assert!(hit.is_none()); prop_assert_eq!(x, y); }
            (Err(x), Err(y)) => {
                prop_assert!(hit.is_some());
                prop_assert!(matches!(x, Error::ChecksumMismatch { .. } | Error::AbsmaxMismatch { .. }), "{}", x);
                prop_assert_eq!(x.to_string(), y.to_string());
            }
            (x, y) => prop_assert!(false, "resident {:?}, fetched {:?}", x, y),
        }
    }
}

#[test]
fn a_fetched_stream_needs_one_tensor_of_budget_a_resident_one_two() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), 64, 64, 0, 7);
    let (res, lazy, _) = both(dir.path(), 4096, None);
    let biggest = res.tensors().iter().map(|t| t.nbytes()).max().unwrap();
    assert!(lazy.stream_tensors(biggest, |_, _| Ok(())).is_ok());
    assert!(matches!(
        res.stream_tensors(biggest, |_, _| Ok(())),
        Err(Error::InvalidArgument(_))
    ));
    assert!(res.stream_tensors(2 * biggest, |_, _| Ok(())).is_ok());
}
