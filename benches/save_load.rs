//! Optimizer-state save and load throughput, each beside baselines over the same bytes,
//! on the synthetic FP32 state of `ckpt bench`: one parameter group of 64 parameters
//! `p0000..p0063`, each with an FP32 `exp_avg`, saved in shards of at most 256 MiB into a
//! temp dir (hot page cache). Every id reports `Throughput::Bytes` of the FP32 source bytes.
//!
//! Run: `cargo bench --bench save_load`. `CKPT_BENCH_MIB` sets the total FP32 size in MiB
//! (default 256; allow about 8x that in memory, and 4x on the temp dir's disk).
//!
//! Group `save`:
//! - `ckptstore_save`: `OptimizerState::save` into the same dir every iteration (it
//!   atomically replaces the previous checkpoint: shards and manifest written and fsynced,
//!   renamed, dir fsynced).
//! - `raw_write_fsync` (baseline): `File::create`, `write_all` of each tensor's bytes,
//!   `sync_all`; the file is removed before each iteration, outside the timing.
//!
//! Group `load` (the checkpoint is opened once; every load checks each tensor's CRC32),
//! for each target `t` in `f16_scaled` (`Target::F16Scaled(ScaleShape::One)`), `bf16`,
//! `f32`, with `StateLayout::default().state("exp_avg", t)`:
//! - `load_<t>_pooled`: `Checkpoint::load_optimizer_with` through a `BufferPool` warmed by
//!   one untimed load; each result is dropped, its buffers going back to the pool (the
//!   steady state). Baselines: `kernel_f32_to_f16_prefaulted` (f16_scaled; the scaled
//!   kernels `kernel_f32_mul_to_f16_*` are also given), `kernel_f32_to_bf16_prefaulted`
//!   (bf16), `memcpy_prefaulted` (f32).
//! - `load_<t>_fresh`: `Checkpoint::load_optimizer`, into fresh memory every time (page
//!   faults and kernel page zeroing). Baseline: `memcpy_fresh`.
//!
//! Baselines, over one concatenated `Vec<f32>` of the same data; the `_prefaulted` and
//! kernel ones write into destinations allocated and touched once, before timing:
//! - `memcpy_prefaulted`: `convert::copy_bytes` (rayon-parallel copy).
//! - `kernel_f32_to_f16_prefaulted`: `convert::f32_to_f16` (plain, unscaled).
//! - `kernel_f32_to_bf16_prefaulted`: `convert::f32_to_bf16`.
//! - `kernel_f32_mul_to_f16_simd`: `convert::f32_mul_to_f16(src, 0.5, dst)` (SIMD where the
//!   CPU has AVX2 + F16C, rayon-parallel).
//! - `kernel_f32_mul_to_f16_portable`: `convert::f32_mul_to_f16_portable`, run per
//!   64K-element chunk under rayon so it is as parallel as the SIMD one.
//! - `crc32fast_1core`: `crc32fast::hash` over the bytes, one pass on one core.
//! - `memcpy_fresh`: new buffers every iteration, one per tensor as a load allocates them,
//!   then `convert::copy_bytes` into each (fresh memory from the allocator: page faults, or
//!   memory glibc kept from the previous iteration, exactly as for the `_fresh` loads).
//!
//! Group `region` (issue 24: the DCP reader's two ways): the same bytes saved as 64 plain
//! 2-D FP32 tensors (256 KiB block CRCs), each read whole as a region into a destination
//! allocated and touched once, tensors in parallel as `ckptstore.torch.dcp.Reader` reads:
//! - `read_region_into`: every block checked, then the box copied (two passes; the
//!   destination unchanged on error).
//! - `fill_region_into`: each block checked and copied while in the cache (one pass; for
//!   fresh destinations).
//! - `copy_region_unchecked` (baseline): the copy alone, the floor of any region read.
//! - `verify_region` (baseline): the check alone.
#![allow(missing_docs)] // criterion's macros generate undocumented items

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use ckptstore::convert;
use ckptstore::optim::{BufferPool, OptimizerState, ScaleShape, StateLayout, Target};
use ckptstore::{Checkpoint, SaveOptions};
use criterion::measurement::WallTime;
use criterion::{
    black_box, criterion_group, criterion_main, BatchSize, BenchmarkGroup, Criterion, SamplingMode,
    Throughput,
};
use half::{bf16, f16};
use rayon::prelude::*;

const TENSORS: usize = 64;
/// Elements per chunk for the rayon-split portable kernel (the library's own chunk size).
const CHUNK: usize = 1 << 16;

/// The synthetic state and the same data as one flat vector.
struct Fixture {
    opt: OptimizerState,
    src: Vec<f32>,
    /// Elements per tensor.
    per: usize,
    /// FP32 bytes in all.
    bytes: u64,
}

impl Fixture {
    fn new() -> Self {
        let mib: u64 = std::env::var("CKPT_BENCH_MIB")
            .ok()
            .and_then(|s| s.trim().trim_end_matches("MiB").parse().ok())
            .unwrap_or(256);
        let per = (((mib << 20) / 4) as usize / TENSORS).max(1);
        // Synthetic Adam-like moments, as `ckpt bench` makes them.
        let (opt, data) = ckptstore::optim::synthetic_state(TENSORS, per).unwrap();
        Fixture {
            opt,
            src: data.concat(),
            per,
            bytes: (per * TENSORS * 4) as u64,
        }
    }

    fn save_to(&self, dir: &Path) {
        self.opt.save(dir, &[], &save_opts()).unwrap();
    }
}

fn save_opts() -> SaveOptions {
    SaveOptions {
        max_shard_size: 256 << 20,
        ..Default::default()
    }
}

fn configure(g: &mut BenchmarkGroup<'_, WallTime>, bytes: u64, secs: u64) {
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(secs));
    g.throughput(Throughput::Bytes(bytes));
}

fn save(c: &mut Criterion, fx: &Fixture) {
    let dir = tempfile::tempdir().unwrap();
    let ckdir = dir.path().join("ckpt");
    let raw = dir.path().join("raw.bin");
    let opts = save_opts();
    let mut g = c.benchmark_group("save");
    // A save of 256 MiB takes about half a second on a 2-core VM: 10 samples need ~8 s.
    configure(&mut g, fx.bytes, 8);
    g.bench_function("ckptstore_save", |b| {
        b.iter(|| black_box(fx.opt.save(&ckdir, &[], &opts).unwrap()))
    });
    g.bench_function("raw_write_fsync", |b| {
        b.iter_batched(
            || {
                let _ = std::fs::remove_file(&raw);
            },
            |()| {
                let mut f = std::fs::File::create(&raw).unwrap();
                for d in fx.src.chunks(fx.per) {
                    f.write_all(bytemuck::cast_slice(d)).unwrap();
                }
                f.sync_all().unwrap();
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn load(c: &mut Criterion, fx: &Fixture) {
    let dir = tempfile::tempdir().unwrap();
    fx.save_to(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let targets = [
        ("f16_scaled", Target::F16Scaled(ScaleShape::One)),
        ("bf16", Target::BF16),
        ("f32", Target::F32),
    ];
    let mut g = c.benchmark_group("load");
    configure(&mut g, fx.bytes, 5);
    for (name, t) in targets {
        let layout = StateLayout::default().state("exp_avg", t);
        let pool = BufferPool::new(usize::MAX);
        drop(
            ck.load_optimizer_opts(
                &layout,
                &ckptstore::optim::LoadOptions::default().pool(&pool),
            )
            .unwrap(),
        );
        g.bench_function(format!("load_{name}_pooled"), |b| {
            b.iter(|| {
                black_box(
                    ck.load_optimizer_opts(
                        &layout,
                        &ckptstore::optim::LoadOptions::default().pool(&pool),
                    )
                    .unwrap(),
                )
            })
        });
        drop(pool);
        g.bench_function(format!("load_{name}_fresh"), |b| {
            b.iter(|| black_box(ck.load_optimizer(&layout).unwrap()))
        });
    }

    let src = &fx.src[..];
    let src_bytes: &[u8] = bytemuck::cast_slice(src);
    let n = src.len();
    // Destinations allocated and touched once, before timing.
    let mut dst32 = vec![0f32; n];
    let mut dst16 = vec![f16::ZERO; n];
    let mut dstb = vec![bf16::ZERO; n];
    convert::copy_bytes(src_bytes, bytemuck::cast_slice_mut(&mut dst32));
    convert::f32_to_f16(src, &mut dst16);
    convert::f32_to_bf16(src, &mut dstb);

    g.bench_function("memcpy_prefaulted", |b| {
        b.iter(|| convert::copy_bytes(src_bytes, bytemuck::cast_slice_mut(&mut dst32)))
    });
    g.bench_function("kernel_f32_to_f16_prefaulted", |b| {
        b.iter(|| convert::f32_to_f16(src, &mut dst16))
    });
    g.bench_function("kernel_f32_to_bf16_prefaulted", |b| {
        b.iter(|| convert::f32_to_bf16(src, &mut dstb))
    });
    g.bench_function("kernel_f32_mul_to_f16_simd", |b| {
        b.iter(|| convert::f32_mul_to_f16(src, black_box(0.5), &mut dst16))
    });
    g.bench_function("kernel_f32_mul_to_f16_portable", |b| {
        b.iter(|| {
            src.par_chunks(CHUNK)
                .zip(dst16.par_chunks_mut(CHUNK))
                .for_each(|(s, d)| convert::f32_mul_to_f16_portable(s, black_box(0.5), d))
        })
    });
    g.bench_function("crc32fast_1core", |b| {
        b.iter(|| black_box(crc32fast::hash(src_bytes)))
    });
    g.bench_function("memcpy_fresh", |b| {
        b.iter(|| {
            // One new buffer per tensor, as a load allocates them (glibc serves buffers of
            // a few MiB from memory freed earlier once its mmap threshold has adapted).
            let d: Vec<Vec<f32>> = src
                .chunks(fx.per)
                .map(|c| {
                    let mut d = vec![0f32; c.len()];
                    convert::copy_bytes(bytemuck::cast_slice(c), bytemuck::cast_slice_mut(&mut d));
                    d
                })
                .collect();
            black_box(d)
        })
    });
    black_box((&dst32, &dst16, &dstb));
    g.finish();
}

fn region(c: &mut Criterion, fx: &Fixture) {
    let dir = tempfile::tempdir().unwrap();
    let cols = 1024usize;
    let rows = (fx.per / cols).max(1);
    let names: Vec<String> = (0..TENSORS).map(|i| format!("t{i:04}")).collect();
    let refs: Vec<ckptstore::TensorRef<'_>> = names
        .iter()
        .zip(fx.src.chunks(fx.per))
        .map(|(n, d)| {
            ckptstore::TensorRef::from_slice(n, &[rows as u64, cols as u64], &d[..rows * cols])
        })
        .collect();
    ckptstore::save(dir.path(), &refs, &save_opts()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let shape = [rows as u64, cols as u64];
    let mut dsts: Vec<Vec<u8>> = (0..TENSORS).map(|_| vec![1u8; rows * cols * 4]).collect();
    let mut g = c.benchmark_group("region");
    configure(&mut g, (TENSORS * rows * cols * 4) as u64, 5);
    type Op = fn(&Checkpoint, &str, &[u64], &[u64], &mut [u8]) -> ckptstore::Result<()>;
    let ops: [(&str, Op); 3] = [
        ("read_region_into", |ck, n, o, s, d| {
            ck.read(n).region(o, s).into(d)
        }),
        ("fill_region_into", |ck, n, o, s, d| {
            ck.read(n).region(o, s).fused(true).into(d)
        }),
        ("copy_region_unchecked", |ck, n, o, s, d| {
            ck.read(n).region(o, s).into_unchecked(d)
        }),
    ];
    for (id, op) in ops {
        g.bench_function(id, |b| {
            b.iter(|| {
                names
                    .par_iter()
                    .zip(dsts.par_iter_mut())
                    .for_each(|(n, d)| {
                        op(&ck, n, &[0, 0], &shape, d).unwrap();
                    })
            })
        });
    }
    g.bench_function("verify_region", |b| {
        b.iter(|| {
            names
                .par_iter()
                .for_each(|n| ck.read(n).region(&[0, 0], &shape).verify().unwrap())
        })
    });
    black_box(&dsts);
    g.finish();
}

fn all(c: &mut Criterion) {
    let fx = Fixture::new();
    region(c, &fx);
    save(c, &fx);
    load(c, &fx);
}

criterion_group!(benches, all);
criterion_main!(benches);
