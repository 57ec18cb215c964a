//! Issue 25, export without running out of memory: the peak resident memory and the speed
//! of `ckpt consolidate` on a checkpoint written by several ranks, against a plain copy of
//! the same bytes between the same directories, measured in the same run.
//!
//! Run: `cargo build --release --bin ckpt && cargo run --release --example consolidate_rss --
//! [--size 1GiB] [--tensors 16] [--ranks 4] [--dir DIR] [--reps 3] [--json]` (`--make DIR`:
//! only write the source there, a directory or an `s3://` URL, for `ckpt consolidate` by hand).
//!
//! The source: `--tensors` F32 globals `[rows, 4096]` of `--size` bytes in all, each row-sharded
//! over `--ranks` parts (`write_part`, then `commit`). Then, alternating, best of `--reps`:
//! `ckpt consolidate SRC --out DST` (its peak RSS from `wait4`'s `ru_maxrss`, through
//! `/usr/bin/time -f %M`) and `cp` of SRC's shard files into a fresh directory followed by
//! `sync` of it (the plain copy). Both read a warm page cache and write into page cache
//! plus fsync. Prints one line of figures and, with `--json`, one JSON object.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::{commit, write_part};
use ckptstore::{CommitOptions, PartItem, SaveOptions, TensorRef};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const COLS: u64 = 4096;

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1).cloned())
}

fn size(s: &str) -> u64 {
    let (n, m) = match s.strip_suffix("GiB") {
        Some(n) => (n, 1u64 << 30),
        None => match s.strip_suffix("MiB") {
            Some(n) => (n, 1 << 20),
            None => (s, 1),
        },
    };
    n.parse::<u64>().expect("a size") * m
}

/// Write the source at `dir`, a path or an `s3://` URL.
fn make_source(dir: &str, bytes: u64, tensors: u64, ranks: u64) -> Res<()> {
    let rows = bytes / tensors / COLS / 4;
    let id = new_checkpoint_id()?;
    let mut parts = Vec::new();
    for r in 0..ranks {
        let (r0, r1) = (rows * r / ranks, rows * (r + 1) / ranks);
        let data: Vec<Vec<f32>> = (0..tensors)
            .map(|t| {
                (r0 * COLS..r1 * COLS)
                    .map(|i| (i as f32) * 1e-3 + t as f32)
                    .collect()
            })
            .collect();
        let names: Vec<String> = (0..tensors).map(|t| format!("layers.{t}.weight")).collect();
        let items: Vec<PartItem<'_>> = data
            .iter()
            .zip(&names)
            .map(|(d, n)| PartItem::Chunk {
                tensor: TensorRef::from_slice(n.as_str(), &[r1 - r0, COLS], d),
                global_shape: vec![rows, COLS],
                offsets: vec![r0, 0],
            })
            .collect();
        let opts = SaveOptions {
            max_shard_size: 256 << 20,
            ..Default::default()
        };
        parts.push(write_part(dir, &id, r as u32, &items, &opts)?);
    }
    commit(dir, &id, &parts, &CommitOptions::default())?;
    Ok(())
}

fn ckpt_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the example's path");
    // target/release/examples/consolidate_rss -> target/release/ckpt
    exe.parent()
        .and_then(Path::parent)
        .map(|d| d.join("ckpt"))
        .expect("target/release")
}

/// Seconds and peak RSS (bytes) of `ckpt consolidate src --out dst`.
fn consolidate(src: &Path, dst: &Path) -> Res<(f64, u64)> {
    let _ = std::fs::remove_dir_all(dst);
    let t = Instant::now();
    let out = Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(ckpt_bin())
        .arg("consolidate")
        .arg(src)
        .arg("--out")
        .arg(dst)
        .output()?;
    let s = t.elapsed().as_secs_f64();
    if !out.status.success() {
        return Err(format!(
            "consolidate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let kib: u64 = err
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .ok_or("no RSS figure from /usr/bin/time")?;
    Ok((s, kib * 1024))
}

/// Seconds of a plain copy of src's shard files into a fresh dst, synced.
fn plain_copy(src: &Path, dst: &Path) -> Res<f64> {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst)?;
    let shards: Vec<PathBuf> = std::fs::read_dir(src)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    let t = Instant::now();
    let ok = Command::new("cp")
        .args(&shards)
        .arg(dst)
        .status()?
        .success()
        && Command::new("sync").arg("-f").arg(dst).status()?.success();
    if !ok {
        return Err("cp or sync failed".into());
    }
    Ok(t.elapsed().as_secs_f64())
}

fn main() -> Res<()> {
    let bytes = size(&arg("--size").unwrap_or_else(|| "1GiB".into()));
    let tensors: u64 = arg("--tensors").map_or(16, |s| s.parse().expect("a count"));
    let ranks: u64 = arg("--ranks").map_or(4, |s| s.parse().expect("a count"));
    let reps: usize = arg("--reps").map_or(3, |s| s.parse().expect("a count"));
    if let Some(dir) = arg("--make") {
        // Only write the source, for profiling `ckpt consolidate` by hand.
        return make_source(&dir, bytes, tensors, ranks);
    }
    let tmp = tempfile::tempdir_in(arg("--dir").unwrap_or_else(|| ".".into()))?;
    let (src, dst, cp) = (
        tmp.path().join("src"),
        tmp.path().join("dst"),
        tmp.path().join("cp"),
    );
    make_source(
        src.to_str().ok_or("a UTF-8 temporary path")?,
        bytes,
        tensors,
        ranks,
    )?;
    let largest = bytes / tensors;
    let (mut best_c, mut best_p, mut peak) = (f64::MAX, f64::MAX, 0u64);
    for _ in 0..reps {
        let (s, rss) = consolidate(&src, &dst)?;
        best_c = best_c.min(s);
        peak = peak.max(rss);
        best_p = best_p.min(plain_copy(&src, &cp)?);
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "consolidate {:.0} MiB ({tensors} globals x {ranks} ranks): {best_c:.2} s, peak RSS {:.0} MiB \
         (largest tensor {:.0} MiB; goal <= {:.0} MiB); plain copy {best_p:.2} s: speed {:.2}x a plain copy (goal >= 0.8)",
        mib(bytes),
        mib(peak),
        mib(largest),
        mib(largest + (256 << 20)),
        best_p / best_c,
    );
    if std::env::args().any(|a| a == "--json") {
        println!(
            "{}",
            serde_json::json!({"bytes": bytes, "tensors": tensors, "ranks": ranks,
                "consolidate_s": best_c, "peak_rss": peak, "largest_tensor": largest,
                "plain_copy_s": best_p, "speed_vs_copy": best_p / best_c})
        );
    }
    Ok(())
}
