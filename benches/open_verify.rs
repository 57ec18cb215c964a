//! `open` versus tensor count and data size, and `verify` beside a plain crc32fast pass
//! over the same bytes. Run: `cargo bench --bench open_verify`.
//! `CKPT_BENCH_BIG` sets the large data size (default 8GiB; it is written to a temp dir
//! once, so allow the disk space).
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::path::Path;

use ckptstore::{save, Checkpoint, DType, SaveOptions, TensorRef};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn write(dir: &Path, tensors: usize, total: u64) {
    let per = (total / tensors as u64) as usize / 4 * 4;
    let buf = vec![0x3cu8; per];
    let names: Vec<String> = (0..tensors)
        .map(|i| format!("model.layers.{}.block.{}.weight", i / 16, i % 16))
        .collect();
    let refs: Vec<TensorRef<'_>> = names
        .iter()
        .map(|n| TensorRef::new(n.as_str(), DType::F32, &[(per / 4) as u64], &buf))
        .collect();
    save(
        dir,
        &refs,
        &SaveOptions {
            max_shard_size: 1 << 30,
            ..Default::default()
        },
    )
    .unwrap();
}

fn big_size() -> u64 {
    std::env::var("CKPT_BENCH_BIG")
        .ok()
        .and_then(|s| s.trim_end_matches("GiB").parse::<u64>().ok())
        .unwrap_or(8)
        << 30
}

fn open(c: &mut Criterion) {
    let mut g = c.benchmark_group("open");
    g.sample_size(20);
    // Versus data size at 10,000 tensors: the time must not grow with the data.
    for (label, size) in [("80MiB", 80u64 << 20), ("big", big_size())] {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 10_000, size);
        g.bench_with_input(
            BenchmarkId::new("ckptstore_10k_tensors", label),
            &dir,
            |b, d| b.iter(|| black_box(Checkpoint::open(d.path()).unwrap())),
        );
        // Baseline: the safetensors crate's deserialize over a map of the same shard files.
        let ck = Checkpoint::open(dir.path()).unwrap();
        g.bench_with_input(
            BenchmarkId::new("safetensors_deserialize_10k_tensors", label),
            &ck,
            |b, ck| {
                b.iter(|| {
                    for s in ck.shards() {
                        black_box(safetensors::SafeTensors::deserialize(s.bytes.as_ref()).unwrap());
                    }
                })
            },
        );
    }
    // Versus tensor count at fixed data size.
    for n in [100usize, 1_000, 10_000] {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), n, 64 << 20);
        g.bench_with_input(BenchmarkId::new("ckptstore_64MiB", n), &dir, |b, d| {
            b.iter(|| black_box(Checkpoint::open(d.path()).unwrap()))
        });
    }
    g.finish();
}

fn verify(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let size = 512u64 << 20;
    write(dir.path(), 64, size);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let bytes = ck.data_bytes();
    let mut g = c.benchmark_group("verify_512MiB");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("ckptstore_verify", |b| {
        b.iter(|| black_box(ck.verify().unwrap()))
    });
    // Baseline: one crc32fast pass over the same bytes, tensor by tensor.
    g.bench_function("crc32fast_single_pass", |b| {
        b.iter(|| {
            for t in ck.tensors() {
                black_box(crc32fast::hash(
                    ck.read(&t.name).view_unchecked().unwrap().bytes(),
                ));
            }
        })
    });
    g.finish();
}

criterion_group!(benches, open, verify);
criterion_main!(benches);
