//! Issue 12, Performance: multi-rank save against a single-process save of the same bytes,
//! and the read amplification and throughput of resharding reads. Every figure sits beside a
//! baseline measured in the same run (BENCHMARKS.md §Current figures, the "N-process save"
//! and "reshard" rows).
//!
//! Run: `cargo run --release --example multirank_bench -- [--size 1GiB] [--tensors 64]
//! [--ranks 2] [--reps 3] [--dir DIR] [--only save|reshard] [--block-size 1MiB] [--json]`.
//!
//! * save: `--tensors` F32 global tensors `[rows, cols]` of `--size` bytes in all, written
//!   (a) by `ckptstore::save` in this process (whole tensors; shards, fsyncs, manifest), and
//!   (b) by `--ranks` real processes (this example re-executed with `CKPT_MR_RANK` set), each
//!   writing its row slice of every tensor with `write_part`, then `commit` here; and (c) the
//!   same with one process (the control: process and part overhead without parallelism).
//!   The rank processes live across saves, as a training job's ranks do. (b) and (c) are
//!   timed once from spawn to the first commit's return (`multirank_save_gibps`: process
//!   start-up and each rank building its bytes in fresh memory included), then each
//!   repetition from "go" (every rank has its bytes in memory) to the commit's return
//!   (`multirank_write_gibps`: what the single save is timed on, since its bytes are in
//!   memory before its clock starts). The three run in a rotated order each repetition;
//!   medians of `--reps`.
//! * reshard: the same tensors chunked by rows over 4 ranks (`write_part` in process, then
//!   `commit`), read back by M = 1..4 readers as row splits, column splits and 2-D blocks:
//!   bytes read / bytes needed (`ReadPlan::bytes_read` / `ReadPlan::nbytes`, summed over every
//!   reader's regions) and read throughput (GiB/s of region bytes, all readers one after the
//!   other, hot page cache, best of `--reps`) against memcpy of the same region sizes into
//!   pre-faulted memory.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use ckptstore::commit;
use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::write_part;
use ckptstore::{Checkpoint, CommitOptions, DType, Part, PartItem, SaveOptions, TensorRef};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const SHARD: u64 = 256 << 20;
const READ_RANKS_WRITTEN: u64 = 4;

struct Cfg {
    size: u64,
    tensors: u64,
    ranks: u64,
    reps: usize,
    dir: Option<PathBuf>,
    only: Option<String>,
    json: bool,
}

/// Rows and columns of each tensor: `cols` 1024 F32 (4 KiB rows), rows from the size.
fn shape(c: &Cfg) -> (u64, u64) {
    let cols = 1024;
    let rows = (c.size / 4 / c.tensors / cols).max(4 * 12);
    (rows, cols)
}

/// The elements of rows `[r0, r1)` of tensor `t`: a cheap function of the global index.
fn rows_data(t: u64, r0: u64, r1: u64, cols: u64) -> Vec<f32> {
    (r0 * cols..r1 * cols)
        .map(|i| ((i % 1021) as f32) * 1e-3 - 0.5 + t as f32)
        .collect()
}

fn split(len: u64, n: u64, k: u64) -> (u64, u64) {
    (len * k / n, len * (k + 1) / n)
}

/// Save options; `--block-size` (block CRC size, 0 for none) reaches the rank processes
/// through `CKPT_MR_BLOCK_SIZE`.
fn opts() -> SaveOptions {
    let mut o = SaveOptions {
        max_shard_size: SHARD,
        ..Default::default()
    };
    if let Some(b) = std::env::var("CKPT_MR_BLOCK_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        o.block_size = b;
    }
    o
}

/// With `CKPT_MR_DEBUG` set, each phase's time on stderr.
fn debug(msg: std::fmt::Arguments<'_>) {
    if std::env::var_os("CKPT_MR_DEBUG").is_some() {
        eprintln!("{msg}");
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn gib(bytes: u64, s: f64) -> f64 {
    bytes as f64 / s / (1u64 << 30) as f64
}

/// The part of rank `rank` of `world`: its rows of every tensor.
fn rank_part(
    dir: &Path,
    id: &str,
    rank: u64,
    world: u64,
    data: &[Vec<f32>],
    rows: u64,
    cols: u64,
) -> ckptstore::Result<Part> {
    let (r0, r1) = split(rows, world, rank);
    let shapes: Vec<[u64; 2]> = data.iter().map(|_| [r1 - r0, cols]).collect();
    let names: Vec<String> = (0..data.len()).map(|t| format!("t{t:03}")).collect();
    let items: Vec<PartItem<'_>> = data
        .iter()
        .enumerate()
        .map(|(t, d)| PartItem::Chunk {
            tensor: TensorRef::new(&names[t], DType::F32, &shapes[t], bytemuck::cast_slice(d)),
            global_shape: vec![rows, cols],
            offsets: vec![r0, 0],
        })
        .collect();
    write_part(dir, id, rank as u32, &items, &opts())
}

/// A rank process: build its bytes, say "ready", then for each line "<checkpoint id>" on
/// stdin write its part of that checkpoint and answer with the part descriptor (its length
/// on a line, then the bytes); exit when stdin closes. Like a training rank, it lives
/// across saves.
fn child(rank: u64) -> Res<()> {
    let var = |k: &str| std::env::var(k).map_err(|e| format!("{k}: {e}"));
    let (world, tensors, rows, cols) = (
        var("CKPT_MR_WORLD")?.parse::<u64>()?,
        var("CKPT_MR_TENSORS")?.parse::<u64>()?,
        var("CKPT_MR_ROWS")?.parse::<u64>()?,
        var("CKPT_MR_COLS")?.parse::<u64>()?,
    );
    let dir = PathBuf::from(var("CKPT_MR_DIR")?);
    let (r0, r1) = split(rows, world, rank);
    let data: Vec<Vec<f32>> = (0..tensors).map(|t| rows_data(t, r0, r1, cols)).collect();
    let mut out = std::io::stdout().lock();
    out.write_all(b"ready\n")?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let id = line?;
        let tw = Instant::now();
        let part = rank_part(&dir, id.trim(), rank, world, &data, rows, cols)?;
        debug(format_args!(
            "rank {rank}/{world}: write_part {:.3} s",
            tw.elapsed().as_secs_f64()
        ));
        let bytes = part.to_bytes();
        out.write_all(format!("{}\n", bytes.len()).as_bytes())?;
        out.write_all(&bytes)?;
        out.flush()?;
    }
    Ok(())
}

/// `world` live rank processes (this example re-executed with `CKPT_MR_RANK`).
struct Ranks {
    world: u64,
    kids: Vec<std::process::Child>,
    ins: Vec<std::process::ChildStdin>,
    outs: Vec<BufReader<std::process::ChildStdout>>,
}

impl Ranks {
    /// Start the ranks and wait until each has its bytes in memory.
    fn start(c: &Cfg, dir: &Path, world: u64) -> Res<Ranks> {
        let (rows, cols) = shape(c);
        let exe = std::env::current_exe()?;
        let mut r = Ranks {
            world,
            kids: Vec::new(),
            ins: Vec::new(),
            outs: Vec::new(),
        };
        for k in 0..world {
            let mut cmd = Command::new(&exe);
            if let Ok(t) = std::env::var("CKPT_MR_RANK_THREADS") {
                cmd.env("RAYON_NUM_THREADS", t);
            }
            let mut kid = cmd
                .env("CKPT_MR_RANK", k.to_string())
                .env("CKPT_MR_WORLD", world.to_string())
                .env("CKPT_MR_TENSORS", c.tensors.to_string())
                .env("CKPT_MR_ROWS", rows.to_string())
                .env("CKPT_MR_COLS", cols.to_string())
                .env("CKPT_MR_DIR", dir)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            r.ins.push(kid.stdin.take().ok_or("no stdin")?);
            r.outs
                .push(BufReader::new(kid.stdout.take().ok_or("no stdout")?));
            r.kids.push(kid);
        }
        for rd in &mut r.outs {
            let mut line = String::new();
            rd.read_line(&mut line)?;
            if line != "ready\n" {
                return Err(format!("a rank said {line:?}").into());
            }
        }
        Ok(r)
    }

    /// One checkpoint: every rank writes its part, then `commit` here. Returns the seconds
    /// from "go" to the commit's return.
    fn save(&mut self, dir: &Path) -> Res<f64> {
        let id = new_checkpoint_id()?;
        let t = Instant::now();
        for i in &mut self.ins {
            i.write_all(format!("{id}\n").as_bytes())?;
            i.flush()?;
        }
        let mut parts = Vec::new();
        for rd in &mut self.outs {
            let mut line = String::new();
            rd.read_line(&mut line)?;
            let len: usize = line
                .trim_end()
                .parse()
                .map_err(|_| format!("a rank failed (said {line:?})"))?;
            let mut bytes = vec![0u8; len];
            rd.read_exact(&mut bytes)?;
            parts.push(Part::from_bytes(&bytes)?);
        }
        let co = CommitOptions {
            world_size: Some(self.world as u32),
            ..Default::default()
        };
        let tc = Instant::now();
        commit(dir, &id, &parts, &co)?;
        debug(format_args!(
            "{} rank(s): commit {:.3} s; go -> commit {:.3} s",
            self.world,
            tc.elapsed().as_secs_f64(),
            t.elapsed().as_secs_f64()
        ));
        Ok(t.elapsed().as_secs_f64())
    }

    /// Close the ranks' stdin and wait for them.
    fn stop(self) -> Res<()> {
        drop(self.ins);
        for mut k in self.kids {
            if !k.wait()?.success() {
                return Err("a rank failed".into());
            }
        }
        Ok(())
    }
}

/// Start `world` ranks and make their first save: (the ranks, spawn -> first commit seconds).
fn start_and_save(c: &Cfg, dir: &Path, world: u64) -> Res<(Ranks, f64)> {
    let t = Instant::now();
    let mut r = Ranks::start(c, dir, world)?;
    r.save(dir)?;
    Ok((r, t.elapsed().as_secs_f64()))
}

fn bench_save(
    c: &Cfg,
    root: &Path,
    out: &mut serde_json::Map<String, serde_json::Value>,
) -> Res<()> {
    let (rows, cols) = shape(c);
    let bytes = rows * cols * 4 * c.tensors;
    let data: Vec<Vec<f32>> = (0..c.tensors)
        .map(|t| rows_data(t, 0, rows, cols))
        .collect();
    let names: Vec<String> = (0..c.tensors).map(|t| format!("t{t:03}")).collect();
    let sh = [rows, cols];
    let refs: Vec<TensorRef<'_>> = data
        .iter()
        .zip(&names)
        .map(|(d, n)| TensorRef::new(n, DType::F32, &sh, bytemuck::cast_slice(d)))
        .collect();
    // All three write into one directory: each replaces (and removes) the previous one's
    // files, as a training job's next checkpoint does.
    let dir = root.join("save");
    // The ranks live across saves, as a training job's do: each world is started once
    // (spawn -> first commit: process start-up, building the bytes in fresh memory and the
    // first save), then every repetition times one save by each from "go" to the commit's
    // return. Each repetition runs the three in a rotated order, so that none always
    // follows the same one (the removal of the previous checkpoint's files, done inline by
    // every save and commit, and the disk's write-back state differ by position); medians
    // are reported: on a shared VM a best-of picks whichever measure had the luckiest
    // outlier.
    let (mut ranks, multi) = start_and_save(c, &dir, c.ranks)?;
    let (mut alone, one) = start_and_save(c, &dir, 1)?;
    let (mut single, mut multi_w, mut one_w) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..c.reps.max(1) {
        for k in 0..3 {
            match (rep + k) % 3 {
                0 => {
                    let t = Instant::now();
                    ckptstore::save(&dir, &refs, &opts())?;
                    single.push(t.elapsed().as_secs_f64());
                    debug(format_args!(
                        "single save {:.3} s",
                        t.elapsed().as_secs_f64()
                    ));
                }
                1 => multi_w.push(ranks.save(&dir)?),
                _ => one_w.push(alone.save(&dir)?),
            }
        }
    }
    ranks.stop()?;
    alone.stop()?;
    let [single, multi_w, one_w] = [single, multi_w, one_w].map(median);
    // The last commit must read back as the same tensors.
    let ck = Checkpoint::open(&dir)?;
    let g = ck
        .read("t001")
        .region(&[rows / 2, 0], &[1, cols])
        .to_tensor()?;
    assert_eq!(
        g.as_slice::<f32>()?,
        &data[1][(rows / 2 * cols) as usize..][..cols as usize]
    );
    drop(ck);
    let g = |s| gib(bytes, s);
    let rows_out = [
        ("single_save", g(single), 1.0),
        ("multirank_save", g(multi), single / multi),
        ("multirank_write", g(multi_w), single / multi_w),
        ("onerank_save", g(one), single / one),
        ("onerank_write", g(one_w), single / one_w),
    ];
    out.insert("save_bytes".into(), bytes.into());
    out.insert("ranks".into(), c.ranks.into());
    for (k, v, r) in rows_out {
        out.insert(format!("{k}_gibps"), v.into());
        if k != "single_save" {
            out.insert(format!("{k}_ratio"), r.into());
        }
    }
    if !c.json {
        println!(
            "save: {} MiB in {} F32 tensors [{rows}, {cols}], median of {} (rotated order)",
            bytes >> 20,
            c.tensors,
            c.reps
        );
        println!("{:<34} {:>7} {:>9}", "measure", "GiB/s", "/ single");
        let label = |k: &str| match k {
            "single_save" => "save, 1 process (baseline)".to_string(),
            "multirank_save" => format!("{} procs, spawn -> commit", c.ranks),
            "multirank_write" => format!("{} procs, bytes ready -> commit", c.ranks),
            "onerank_save" => "1 proc part, spawn -> commit".to_string(),
            _ => "1 proc part, bytes ready -> commit".to_string(),
        };
        for (k, v, r) in rows_out {
            println!("{:<34} {v:>7.2} {r:>9.2}", label(k));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A reader layout: name, readers M, and each reader's box as (row range, col range).
type Layout = (String, u64, Vec<((u64, u64), (u64, u64))>);

fn layouts(rows: u64, cols: u64) -> Vec<Layout> {
    let grid = |name: &str, pr: u64, pc: u64| -> Layout {
        let mut boxes = Vec::new();
        for i in 0..pr {
            for j in 0..pc {
                boxes.push((split(rows, pr, i), split(cols, pc, j)));
            }
        }
        (format!("{name} M={}", pr * pc), pr * pc, boxes)
    };
    let mut v = Vec::new();
    for m in 1..=4 {
        v.push(grid("rows", m, 1));
    }
    for m in 2..=4 {
        v.push(grid("cols", 1, m));
    }
    v.push(grid("blocks 2x2", 2, 2));
    v
}

fn bench_reshard(
    c: &Cfg,
    root: &Path,
    out: &mut serde_json::Map<String, serde_json::Value>,
) -> Res<()> {
    let (rows, cols) = shape(c);
    let dir = root.join("reshard");
    let id = new_checkpoint_id()?;
    let mut parts = Vec::new();
    for r in 0..READ_RANKS_WRITTEN {
        let (r0, r1) = split(rows, READ_RANKS_WRITTEN, r);
        let data: Vec<Vec<f32>> = (0..c.tensors).map(|t| rows_data(t, r0, r1, cols)).collect();
        parts.push(rank_part(
            &dir,
            &id,
            r,
            READ_RANKS_WRITTEN,
            &data,
            rows,
            cols,
        )?);
    }
    let co = CommitOptions {
        world_size: Some(READ_RANKS_WRITTEN as u32),
        ..Default::default()
    };
    commit(&dir, &id, &parts, &co)?;
    let ck = Checkpoint::open(&dir)?;
    let names: Vec<String> = (0..c.tensors).map(|t| format!("t{t:03}")).collect();
    // memcpy source and (pre-faulted) destination, each as large as the whole checkpoint:
    // every region is copied from and to its own place, so that small regions do not run
    // from the CPU caches while the reads come from the page cache.
    let total = (rows * cols * 4 * c.tensors) as usize;
    let src = vec![1u8; total];
    let mut dst = vec![2u8; total];
    if !c.json {
        println!(
            "reshard: {} MiB in {} F32 tensors [{rows}, {cols}], written as 4 row chunks each; \
             read by M readers, one after the other; best of {}",
            (rows * cols * 4 * c.tensors) >> 20,
            c.tensors,
            c.reps
        );
        println!(
            "{:<14} {:>7} {:>7} {:>6} {:>7} {:>7} {:>6} {:>7} {:>6}",
            "layout", "needMiB", "readMiB", "ampl.", "GiB/s", "memcpy", "ratio", "m.fresh", "ratio"
        );
    }
    let mut rows_json = Vec::new();
    for (name, m, boxes) in layouts(rows, cols) {
        let (mut needed, mut read) = (0u64, 0u64);
        for ((r0, r1), (c0, c1)) in &boxes {
            for n in &names {
                let sh = [r1 - r0, c1 - c0];
                let plan = ck.read(n).region(&[*r0, *c0], &sh).plan()?;
                needed += plan.nbytes;
                read += plan.bytes_read();
            }
        }
        let (mut rd, mut mc, mut mf) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..c.reps.max(1) {
            let t = Instant::now();
            for ((r0, r1), (c0, c1)) in &boxes {
                for n in &names {
                    let r = ck
                        .read(n)
                        .region(&[*r0, *c0], &[r1 - r0, c1 - c0])
                        .to_tensor()?;
                    std::hint::black_box(&r);
                }
            }
            rd = rd.min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let mut at = 0;
            for ((r0, r1), (c0, c1)) in &boxes {
                let nb = ((r1 - r0) * (c1 - c0) * 4) as usize;
                for _ in &names {
                    dst[at..at + nb].copy_from_slice(&src[at..at + nb]);
                    std::hint::black_box(&dst);
                    at += nb;
                }
            }
            mc = mc.min(t.elapsed().as_secs_f64());
            // Into a fresh zeroed buffer per region, as `read_region` allocates its result.
            let t = Instant::now();
            let mut at = 0;
            for ((r0, r1), (c0, c1)) in &boxes {
                let nb = ((r1 - r0) * (c1 - c0) * 4) as usize;
                for _ in &names {
                    let mut d = vec![0u8; nb];
                    d.copy_from_slice(&src[at..at + nb]);
                    std::hint::black_box(&d);
                    at += nb;
                }
            }
            mf = mf.min(t.elapsed().as_secs_f64());
        }
        let amp = read as f64 / needed as f64;
        let (g, gm, gf) = (gib(needed, rd), gib(needed, mc), gib(needed, mf));
        if !c.json {
            println!(
                "{name:<14} {:>7} {:>7} {amp:>6.2} {g:>7.2} {gm:>7.2} {:>6.2} {gf:>7.2} {:>6.2}",
                needed >> 20,
                read >> 20,
                g / gm,
                g / gf
            );
        }
        rows_json.push(serde_json::json!({
            "layout": name, "readers": m, "bytes_needed": needed, "bytes_read": read,
            "amplification": amp, "read_gibps": g, "memcpy_gibps": gm, "ratio": g / gm,
            "memcpy_fresh_gibps": gf, "ratio_fresh": g / gf,
        }));
    }
    out.insert("reshard".into(), rows_json.into());
    drop(ck);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn parse_size(s: &str) -> Res<u64> {
    let t = s.trim().to_ascii_lowercase();
    let i = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let n: u64 = t[..i].parse()?;
    let m = match &t[i..] {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        u => return Err(format!("unknown unit {u:?} (B, KiB, MiB, GiB)").into()),
    };
    Ok(n * m)
}

fn main() -> Res<()> {
    if let Ok(r) = std::env::var("CKPT_MR_RANK") {
        return child(r.parse()?);
    }
    let mut c = Cfg {
        size: 1 << 30,
        tensors: 64,
        ranks: 2,
        reps: 3,
        dir: None,
        only: None,
        json: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--size" => c.size = parse_size(&val()?)?,
            "--tensors" => c.tensors = val()?.parse()?,
            "--ranks" => c.ranks = val()?.parse()?,
            "--reps" => c.reps = val()?.parse()?,
            "--dir" => c.dir = Some(PathBuf::from(val()?)),
            "--only" => c.only = Some(val()?),
            "--json" => c.json = true,
            "--block-size" => {
                std::env::set_var("CKPT_MR_BLOCK_SIZE", parse_size(&val()?)?.to_string())
            }
            _ => return Err(format!("unknown argument {a:?}").into()),
        }
    }
    if c.tensors == 0 || c.ranks == 0 || c.ranks > 1024 {
        return Err("--tensors and --ranks (at most 1024) must be positive".into());
    }
    let tmp = tempfile::tempdir_in(c.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let mut out = serde_json::Map::new();
    out.insert("tensors".into(), c.tensors.into());
    if c.only.as_deref() != Some("reshard") {
        bench_save(&c, tmp.path(), &mut out)?;
    }
    if c.only.as_deref() != Some("save") {
        bench_reshard(&c, tmp.path(), &mut out)?;
    }
    if c.json {
        println!("{}", serde_json::Value::Object(out));
    }
    Ok(())
}
