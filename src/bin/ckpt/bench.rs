//! `ckpt bench`: save, open, verify and load throughput on a synthetic FP32 checkpoint,
//! each beside a baseline measured in the same run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ckptstore::optim::{BufferPool, ScaleShape, StateLayout, Target};
use ckptstore::{convert, Checkpoint, Result, SaveOptions};
use half::{bf16, f16};
use serde_json::json;

use crate::util::{gibps, human, parse_size};

mod cold;

#[derive(clap::Args)]
pub struct Args {
    /// Bytes of FP32 optimizer state (split evenly over --tensors tensors).
    #[arg(long, value_parser = parse_size, default_value = "1GiB")]
    size: u64,
    /// Number of state tensors.
    #[arg(long, default_value_t = 64)]
    tensors: usize,
    /// Directory for the checkpoint (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Repetitions of each measurement (the best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print one JSON object (keys documented in the README).
    #[arg(long)]
    json: bool,
    /// Also load from a cold page cache (the shard files evicted before each run), beside
    /// a raw cold read of the same files.
    #[arg(long)]
    cold: bool,
    /// With --cold: compare every read strategy (page faults only; a read-ahead thread;
    /// the read-ahead thread with tensors converted in file order; a streaming reader
    /// with converters following it in file order), not only the default.
    #[arg(long)]
    strategies: bool,
}

fn best<T>(reps: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let mut b = f64::MAX;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        std::hint::black_box(f()?);
        b = b.min(t.elapsed().as_secs_f64());
    }
    Ok(b)
}

pub fn run(a: Args) -> Result<ExitCode> {
    let (dir, _tmp) = crate::util::dir_or_temp(&a.dir)?;
    let n_t = a.tensors.max(1);
    let per = ((a.size / 4) as usize / n_t).max(1);
    let bytes = (per * n_t * 4) as u64;
    // Synthetic Adam-like moments: smooth values with a per-tensor range.
    let (opt, data) = ckptstore::optim::synthetic_state(n_t, per)?;
    let opts = SaveOptions {
        max_shard_size: 256 << 20,
        ..Default::default()
    };
    let ckdir = dir.join("bench-ckpt");

    // Save, beside raw writes + fsync of the same bytes, three ways (one file; shard-sized
    // files written by two threads; the same through O_DIRECT); the best way is the
    // baseline. They alternate, so that all see the same state of a shared disk; the best
    // of each is kept. Like the save, which replaces the previous checkpoint, each raw
    // write replaces its files.
    let ways = [
        cold::RawWrite::OneFile,
        cold::RawWrite::Parallel,
        cold::RawWrite::Direct,
    ];
    let rawdir = dir.join("bench-raw");
    std::fs::create_dir_all(&rawdir).map_err(|e| ckptstore::Error::Io {
        op: "create dir",
        path: rawdir.clone(),
        source: e,
    })?;
    let mut save_s = f64::MAX;
    let mut raw_each = [f64::MAX; 3];
    // The save runs before each raw way, so that it is measured as many times as the three
    // ways together: the best of as many samples on each side (the best of three ways,
    // each the best of `reps`, would otherwise be the maximum of three times more samples
    // of the same noisy disk than the save gets).
    for _ in 0..a.reps.max(1) {
        for (w, r) in ways.iter().zip(raw_each.iter_mut()) {
            save_s = save_s.min(best(1, || opt.save(&ckdir, &[], &opts))?);
            *r = r.min(best(1, || {
                cold::raw_write(&rawdir, &data, opts.max_shard_size, *w)
            })?);
        }
    }
    let raw_s = raw_each.iter().copied().fold(f64::MAX, f64::min);
    let _ = std::fs::remove_dir_all(&rawdir);

    let open_s = best(a.reps.max(5), || Checkpoint::open(&ckdir))?;
    let ck = Checkpoint::open(&ckdir)?;
    let verify_s = best(a.reps, || ck.verify())?;
    // crc32fast, one pass on one core, over the same bytes.
    let crc_s = best(a.reps, || {
        Ok(ck
            .tensors()
            .iter()
            .map(|t| {
                crc32fast::hash(
                    ck.read(&t.name)
                        .view_unchecked()
                        .map(|v| v.bytes())
                        .unwrap_or(&[]),
                )
            })
            .fold(0u32, |a, b| a ^ b))
    })?;

    // Loads into fresh memory (every page faulted in and cleared by the kernel on first
    // touch), and through a BufferPool (the steady state: the buffers of the previous
    // load's state, dropped, are reused). The pool is warmed by one untimed load.
    let load = |t: Target| {
        best(a.reps, || {
            ck.load_optimizer(&StateLayout::default().state("exp_avg", t))
        })
    };
    let pool = BufferPool::new(usize::MAX);
    let load_pooled = |t: Target| {
        let layout = StateLayout::default().state("exp_avg", t);
        drop(ck.load_optimizer_opts(
            &layout,
            &ckptstore::optim::LoadOptions::default().pool(&pool),
        )?);
        best(a.reps, || {
            ck.load_optimizer_opts(
                &layout,
                &ckptstore::optim::LoadOptions::default().pool(&pool),
            )
        })
    };
    let f16p_s = load_pooled(Target::F16Scaled(ScaleShape::One))?;
    let bf16p_s = load_pooled(Target::BF16)?;
    let f32p_s = load_pooled(Target::F32)?;
    pool.clear();
    let f16_s = load(Target::F16Scaled(ScaleShape::One))?;
    let bf16_s = load(Target::BF16)?;
    let f32_s = load(Target::F32)?;

    // Baselines over the same bytes: memcpy and the plain conversion kernels into memory
    // that is already faulted in, and memcpy into fresh memory.
    let src: Vec<f32> = data.concat();
    let mut dst32 = vec![0f32; src.len()];
    let mut dst16 = vec![f16::ZERO; src.len()];
    let mut dstb = vec![bf16::ZERO; src.len()];
    convert::copy_bytes(
        bytemuck::cast_slice(&src),
        bytemuck::cast_slice_mut(&mut dst32),
    );
    convert::f32_to_f16(&src, &mut dst16);
    convert::f32_to_bf16(&src, &mut dstb);
    let memcpy_s = best(a.reps, || {
        convert::copy_bytes(
            bytemuck::cast_slice(&src),
            bytemuck::cast_slice_mut(&mut dst32),
        );
        Ok(())
    })?;
    // One new buffer per tensor, as a load allocates them.
    let memcpy_fresh_s = best(a.reps, || {
        Ok(data
            .iter()
            .map(|c| {
                let mut d = vec![0f32; c.len()];
                convert::copy_bytes(bytemuck::cast_slice(c), bytemuck::cast_slice_mut(&mut d));
                d
            })
            .collect::<Vec<_>>())
    })?;

    let kern16_s = best(a.reps, || {
        convert::f32_to_f16(&src, &mut dst16);
        Ok(())
    })?;
    let kernb_s = best(a.reps, || {
        convert::f32_to_bf16(&src, &mut dstb);
        Ok(())
    })?;

    let g = |s: f64| gibps(bytes, s);
    let rows = [
        ("save", g(save_s), "raw_write_fsync", g(raw_s)),
        ("verify", g(verify_s), "crc32fast_1core", g(crc_s)),
        (
            "load_f16_scaled",
            g(f16p_s),
            "kernel_f32_to_f16_prefaulted",
            g(kern16_s),
        ),
        (
            "load_bf16",
            g(bf16p_s),
            "kernel_f32_to_bf16_prefaulted",
            g(kernb_s),
        ),
        ("load_f32", g(f32p_s), "memcpy_prefaulted", g(memcpy_s)),
        (
            "load_f16_scaled_fresh",
            g(f16_s),
            "memcpy_fresh",
            g(memcpy_fresh_s),
        ),
        (
            "load_bf16_fresh",
            g(bf16_s),
            "memcpy_fresh",
            g(memcpy_fresh_s),
        ),
        (
            "load_f32_fresh",
            g(f32_s),
            "memcpy_fresh",
            g(memcpy_fresh_s),
        ),
    ];
    drop(ck);
    let cold = if a.cold {
        Some(cold::run(&ckdir, bytes, a.reps, a.strategies)?)
    } else {
        None
    };
    if a.json {
        let mut o = serde_json::Map::new();
        o.insert("bytes".into(), json!(bytes));
        o.insert("tensors".into(), json!(n_t));
        o.insert("open_ms".into(), json!(open_s * 1e3));
        o.insert("simd_f16".into(), json!(ckptstore::convert::has_simd_f16()));
        for (name, v, base, b) in rows {
            o.insert(format!("{name}_gibps"), json!(v));
            o.insert(format!("{base}_gibps"), json!(b));
            o.insert(format!("{name}_ratio"), json!(v / b));
        }
        for (w, r) in ways.iter().zip(raw_each) {
            o.insert(format!("{}_gibps", w.name()), json!(g(r)));
        }
        if let Some(c) = &cold {
            o.insert("raw_read_cold_gibps".into(), json!(c.raw_gibps));
            for (n, v) in &c.raw_by_readers {
                o.insert(format!("raw_read_cold_{n}_readers_gibps"), json!(v));
            }
            o.insert(
                "cold_cached_pages_after_evict".into(),
                json!([c.cached_after_evict.0, c.cached_after_evict.1]),
            );
            for (t, st, v) in &c.loads {
                let key = if *st == "default" {
                    format!("load_{t}_cold")
                } else {
                    format!("load_{t}_cold_{st}")
                };
                o.insert(format!("{key}_gibps"), json!(v));
                o.insert(format!("{key}_ratio"), json!(v / c.raw_gibps));
            }
        }
        outln!("{}", serde_json::Value::Object(o));
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "ckpt bench: {} of FP32 state in {n_t} tensors, best of {} runs, hot page cache",
        human(bytes),
        a.reps
    );
    outln!("loads (CRC checked) into pooled buffers, and into fresh memory (_fresh)");
    outln!(
        "{:<22} {:>9}   {:<30} {:>9}   {:>6}",
        "measure",
        "GiB/s",
        "baseline (same run)",
        "GiB/s",
        "ratio"
    );
    for (name, v, base, b) in rows {
        outln!("{name:<22} {v:>9.2}   {base:<30} {b:>9.2}   {:>6.2}", v / b);
    }
    outln!("{:<22} {:>9.2}", "open (ms)", open_s * 1e3);
    for (w, r) in ways.iter().zip(raw_each) {
        outln!(
            "  save baseline candidate {:<22} {:>9.2} GiB/s",
            w.name(),
            g(r)
        );
    }
    if let Some(c) = &cold {
        outln!(
            "cold page cache (shard files evicted before each run; {} of {} pages cached after eviction)",
            c.cached_after_evict.0, c.cached_after_evict.1
        );
        for (n, v) in &c.raw_by_readers {
            outln!("  raw cold pread, {n} reader(s), 8 MiB blocks: {v:.2} GiB/s");
        }
        for (t, st, v) in &c.loads {
            outln!(
                "{:<40} {v:>9.2}   {:<30} {:>9.2}   {:>6.2}",
                format!("load_{t}_cold ({st})"),
                "raw_read_cold (best readers)",
                c.raw_gibps,
                v / c.raw_gibps
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
