//! Issues 12 and 25: what the manifest costs as a job grows, flat against two-level.
//!
//! Run: `cargo run --release --example manifest_scale` (every case and the crossover, each
//! case in child processes so that each peak RSS is its own, then the tables), or one part:
//! `-- cases`, `-- crossover`, `-- flat R T`, `-- two R T`, `-- cross R T`.
//!
//! Every case is T F32 global tensors of a GQA decoder (9 per layer, [`spec`]), each split by
//! rows into one chunk per rank, one shard per rank holding that rank's T chunks.
//!
//! * flat (issue 12, kept as it was): the flat [`Manifest`] built in memory with plausible
//!   offsets, CRCs and absmax; `manifest::encode` it (the coordinator's commit cost),
//!   `manifest::decode` it in a fresh process (every rank's open cost), peak RSS of both.
//! * two (issue 25): the real two-level code on real files. The builder writes every
//!   rank's shard (the crate's own safetensors header, then `File::set_len` to the full
//!   size: a sparse file whose data reads back as zeros, so each chunk records the CRC32 of
//!   that many zero bytes and absmax 0) and its part descriptor (`Part::to_bytes`) into a
//!   directory under /dev/shm. A fresh coordinator process reads and decodes the parts
//!   (`Part::from_bytes`, not timed as the commit) and runs `write::parts::commit` with
//!   `Layout::TwoLevel` (timed: C1-C6, the shard header checks, the grids, the root's
//!   encode, check and write). A fresh rank process (rank R/2) runs `Checkpoint::open` and
//!   `region_bytes_read` of its own box of each of its T tensors (which loads its own part
//!   only), then `read_region` of a few of them (CRC-checked reads of the zero data, their
//!   time storage's, reported apart). The directory is deleted after each case.
//! * cross (the `Layout::Auto` threshold): the same real build committed flat and two-level,
//!   a rank's open + locate in a fresh process for each, and a whole-checkpoint reader's
//!   plan (every tensor's full box: every part loaded).
//!
//! Each rank's open runs in [`RANK_RUNS`] fresh processes (the run of median time is
//! reported, with the range); CPU times are the process's threads' time on the CPU
//! (/proc/self/task/*/schedstat), beside wall times, since the VM is shared. The largest
//! case (1,024 x 10,000) needs about 5 GB of /dev/shm and 8 GiB of memory for its
//! coordinator. `MANIFEST_SCALE_KEEP=1` keeps each case's directory (to profile a child).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ckptstore::commit;
use ckptstore::format::global::{ChunkEntry, GlobalEntry};
use ckptstore::format::header::{self, HeaderEntry};
use ckptstore::format::manifest::{self, Manifest, ShardEntry, TensorInfo};
use ckptstore::write::parts::chunk_tensor_name;
use ckptstore::write::parts::Layout;
use ckptstore::write::parts::PartChunk;
use ckptstore::write::{part_file_name, rank_shard_file_name};
use ckptstore::{Checkpoint, CommitOptions, DType, Part};
use rayon::prelude::*;

const ID: &str = "5f0c2a7e9b1d4c3a8e6f0b2d4a6c8e10";

/// Fresh rank processes per case (the median is reported).
const RANK_RUNS: usize = 5;

/// The cases of the full run: (ranks, tensors, flat measured?). The flat manifest of
/// 1,024 x 10,000 (about 2.75 GB) is over the 1 GiB cap and is not built.
const CASES: &[(u64, u64, bool)] = &[
    (8, 10_000, true),
    (64, 10_000, true),
    (1024, 100, true),
    (1024, 1000, true),
    (1024, 10_000, false),
];

/// The crossover cases: 10k, 30k, 100k and 300k chunks at 8, 64 and 1,024 ranks.
const CROSS: &[(u64, u64)] = &[
    (8, 1250),
    (8, 3750),
    (8, 12_500),
    (8, 37_500),
    (64, 156),
    (64, 469),
    (64, 1563),
    (64, 4688),
    (1024, 10),
    (1024, 29),
    (1024, 98),
    (1024, 293),
];

/// Tensor `i` of a 9-tensors-per-layer decoder (GQA, 4096 hidden, 14336 MLP): name and shape.
fn spec(i: u64) -> (String, Vec<u64>) {
    let (h, kv, ff) = (4096, 1024, 14336);
    let (kind, shape): (&str, Vec<u64>) = match i % 9 {
        0 => ("self_attn.q_proj.weight", vec![h, h]),
        1 => ("self_attn.k_proj.weight", vec![kv, h]),
        2 => ("self_attn.v_proj.weight", vec![kv, h]),
        3 => ("self_attn.o_proj.weight", vec![h, h]),
        4 => ("mlp.gate_proj.weight", vec![ff, h]),
        5 => ("mlp.up_proj.weight", vec![ff, h]),
        6 => ("mlp.down_proj.weight", vec![h, ff]),
        7 => ("input_layernorm.weight", vec![h]),
        _ => ("post_attention_layernorm.weight", vec![h]),
    };
    (format!("model.layers.{}.{kind}", i / 9), shape)
}

/// Rows `[begin, end)` of `n` held by rank `r` of `ranks` (uneven split, never empty for
/// `n >= ranks`).
fn rows(n: u64, r: u64, ranks: u64) -> (u64, u64) {
    (r * n / ranks, (r + 1) * n / ranks)
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The chunk of tensor `t` held by rank `r`: (global name, global shape, offsets, shape).
fn chunk(t: u64, r: u64, ranks: u64) -> (String, Vec<u64>, Vec<u64>, Vec<u64>) {
    let (name, gshape) = spec(t);
    let (b, e) = rows(gshape[0], r, ranks);
    let mut offsets = vec![0; gshape.len()];
    let mut shape = gshape.clone();
    offsets[0] = b;
    shape[0] = e - b;
    (name, gshape, offsets, shape)
}

fn nbytes(shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() * 4
}

// ---- the flat manifest, simulated in memory (issue 12) ----

fn chunk_name(global: &str, offsets: &[u64]) -> String {
    let o: Vec<String> = offsets.iter().map(u64::to_string).collect();
    format!("{global}@{}", o.join(","))
}

/// Rank `r`'s shard (index `shard`) and its chunk tensors, one per global tensor.
fn rank_entries(r: u64, ranks: u64, tensors: u64, shard: usize) -> (ShardEntry, Vec<TensorInfo>) {
    let mut list = Vec::with_capacity(tensors as usize);
    for t in 0..tensors {
        let (name, _, offsets, shape) = chunk(t, r, ranks);
        list.push((chunk_name(&name, &offsets), shape));
    }
    // A safetensors header entry is about the name plus 60 bytes; 8-byte aligned.
    let header: u64 = list.iter().map(|(n, _)| n.len() as u64 + 60).sum::<u64>() + 64;
    let header_size = header.div_ceil(8) * 8;
    let mut at = 8 + header_size;
    let mut out = Vec::with_capacity(list.len());
    for (t, (name, shape)) in list.into_iter().enumerate() {
        let nbytes = nbytes(&shape);
        let h = mix(r << 32 | t as u64);
        out.push(TensorInfo {
            name,
            shard,
            dtype: DType::F32,
            shape,
            offsets: [at, at + nbytes],
            crc32: Some(h as u32),
            // A weight's largest magnitude, 0.01 to about 4, as an FP32 value.
            absmax: Some(0.01 + ((h >> 32) % 40_000) as f32 * 1e-4),
            blocks: None,
        });
        at += nbytes;
    }
    let file = format!("shard-{ID}-r{r}-0.safetensors");
    let shard = ShardEntry {
        file,
        size: at,
        header_size,
        header_crc32: mix(r) as u32,
    };
    (shard, out)
}

fn flat_manifest(ranks: u64, tensors: u64) -> Manifest {
    let mut shards = Vec::with_capacity(ranks as usize);
    let mut all = Vec::with_capacity((ranks * tensors) as usize);
    let mut globals: Vec<GlobalEntry> = (0..tensors)
        .map(|t| {
            let (name, global_shape) = spec(t);
            GlobalEntry {
                name,
                dtype: DType::F32,
                global_shape,
                chunks: Vec::with_capacity(ranks as usize),
                grid: None,
            }
        })
        .collect();
    for r in 0..ranks {
        let (s, ts) = rank_entries(r, ranks, tensors, r as usize);
        shards.push(s);
        for (t, info) in ts.into_iter().enumerate() {
            let (_, _, offsets, shape) = chunk(t as u64, r, ranks);
            globals[t].chunks.push(ChunkEntry {
                offsets,
                shape,
                tensor: info.name.clone(),
                replicas: Vec::new(),
            });
            all.push(info);
        }
    }
    Manifest {
        format: "ckptstore".into(),
        version: 1,
        features: vec!["global".into()],
        checkpoint_id: ID.into(),
        shards,
        tensors: all,
        metadata: serde_json::json!({}),
        optimizer: None,
        globals,
        parts: Vec::new(),
        grids: Vec::new(),
    }
}

/// A line of /proc/self/status, in MiB (0 where unavailable).
fn status_mib(key: &str) -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Peak resident set of this process, in MiB, from /proc/self/status (0 where unavailable).
fn peak_rss() -> f64 {
    status_mib("VmHWM:")
}

/// CPU time this process's threads have run, in seconds: the sum over
/// /proc/self/task/*/schedstat (nanoseconds on the CPU; 0 where unavailable).
fn cpu_s() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e9
}

/// The 1-minute load average (as `uptime` shows it).
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn reps(chunks: u64) -> usize {
    match chunks {
        0..=200_000 => 5,
        200_001..=1_000_000 => 2,
        _ => 1,
    }
}

/// Best of `n` runs of `f`, in seconds, and its last result.
fn best<T>(n: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut t_best = f64::INFINITY;
    let mut out = None;
    for _ in 0..n {
        let t = Instant::now();
        let v = std::hint::black_box(f());
        t_best = t_best.min(t.elapsed().as_secs_f64());
        out = Some(v);
    }
    (t_best, out.expect("n > 0"))
}

/// Run this program with `args` in a child process; its stdout, trimmed.
fn child(args: &[String]) -> String {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .args(args)
        .output()
        .expect("child runs");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn flat(ranks: u64, tensors: u64) {
    let chunks = ranks * tensors;
    let n = reps(chunks);
    let t = Instant::now();
    let m = flat_manifest(ranks, tensors);
    let build = t.elapsed().as_secs_f64();
    let (enc, bytes) = best(n, || manifest::encode(&m));
    let writer_peak = peak_rss();
    drop(m);
    let len = bytes.len() as u64;
    let mut line = format!(
        "flat ranks={ranks} tensors={tensors} chunks={chunks} bytes={len} build_s={build:.3} encode_s={enc:.3} writer_peak_mib={writer_peak:.0} load={}",
        load()
    );
    if len <= ckptstore::format::MAX_MANIFEST_SIZE {
        // The reader is a fresh process, as a rank opening the checkpoint is: its peak RSS
        // is the file's bytes plus the decoded manifest, nothing of the writer's.
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), &bytes).expect("write");
        drop(bytes);
        line += " ";
        line += &child(&[
            "read".into(),
            file.path().display().to_string(),
            n.to_string(),
        ]);
    } else {
        line += " decode_s=refused";
    }
    println!("{line}");
}

/// A rank's open: read the manifest, decode it (best of `n`), peak RSS of this process.
fn read(path: &str, n: usize) {
    let bytes = std::fs::read(path).expect("read");
    let (dec, ok) = best(n, || manifest::decode(&bytes).is_ok());
    assert!(ok, "the simulated manifest must decode");
    let peak = peak_rss();
    println!("decode_s={dec:.3} reader_peak_mib={peak:.0}");
}

// ---- real checkpoints on disk: the builder ----

/// A checkpoint directory under /dev/shm (tmpfs: sparse files cost nothing), else the
/// system's temporary directory; removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("manifest_scale-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // `MANIFEST_SCALE_KEEP=1` keeps the directory (to profile a child on it).
        if std::env::var_os("MANIFEST_SCALE_KEEP").is_some() {
            eprintln!("kept {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The CRC32 of `n` zero bytes.
fn zero_crc(n: u64) -> u32 {
    let zeros = vec![0u8; 1 << 20];
    let mut h = crc32fast::Hasher::new();
    let mut left = n;
    while left > 0 {
        let k = left.min(zeros.len() as u64);
        h.update(&zeros[..k as usize]);
        left -= k;
    }
    h.finalize()
}

/// The CRC32 of every chunk byte length the case has (few: rows split almost evenly).
fn zero_crcs(ranks: u64, tensors: u64) -> HashMap<u64, u32> {
    let mut lens: Vec<u64> = (0..tensors.min(9))
        .flat_map(|t| (0..ranks).map(move |r| nbytes(&chunk(t, r, ranks).3)))
        .collect();
    lens.sort_unstable();
    lens.dedup();
    lens.into_par_iter().map(|n| (n, zero_crc(n))).collect()
}

/// Write rank `r`'s shard (sparse) and part descriptor into `dir`: the descriptor's size.
fn write_rank(dir: &Path, r: u64, ranks: u64, tensors: u64, crcs: &HashMap<u64, u32>) -> u64 {
    let rank = r as u32;
    let mut entries = Vec::with_capacity(tensors as usize);
    let mut chunks = Vec::with_capacity(tensors as usize);
    let mut at = 0u64;
    for t in 0..tensors {
        let (global, global_shape, offsets, shape) = chunk(t, r, ranks);
        let name = chunk_tensor_name(&global, &offsets, rank);
        let n = nbytes(&shape);
        entries.push(HeaderEntry {
            name: name.clone(),
            dtype: DType::F32,
            shape: shape.clone(),
            data_offsets: [at, at + n],
        });
        chunks.push(PartChunk {
            global,
            dtype: DType::F32,
            global_shape,
            offsets,
            shape,
            tensor: name,
        });
        at += n;
    }
    // The shard's header as the writer makes it (src/write/mod.rs shard_header).
    let meta: BTreeMap<String, String> = [
        (
            ckptstore::format::META_CHECKPOINT_ID.to_string(),
            ID.to_string(),
        ),
        ("ckptstore.shard".to_string(), "0".to_string()),
    ]
    .into();
    let head = header::emit(&entries, &meta);
    let header_size = head.len() as u64 - 8;
    let file = rank_shard_file_name(ID, rank, 0);
    let size = head.len() as u64 + at;
    {
        let mut f = std::fs::File::create(dir.join(&file)).expect("create shard");
        f.write_all(&head).expect("write header");
        f.set_len(size).expect("sparse data");
    }
    let data_start = head.len() as u64;
    let tensors_info: Vec<TensorInfo> = entries
        .into_iter()
        .map(|e| {
            let n = e.data_offsets[1] - e.data_offsets[0];
            TensorInfo {
                name: e.name,
                shard: 0,
                dtype: e.dtype,
                shape: e.shape,
                offsets: [
                    data_start + e.data_offsets[0],
                    data_start + e.data_offsets[1],
                ],
                crc32: Some(crcs[&n]),
                absmax: Some(0.0),
                blocks: None,
            }
        })
        .collect();
    let shard = ShardEntry {
        file,
        size,
        header_size,
        header_crc32: crc32fast::hash(&head[8..]),
    };
    let part = Part::new(ID.into(), rank, vec![shard], tensors_info, chunks);
    let bytes = part.to_bytes();
    std::fs::write(dir.join(part_file_name(ID, rank)), &bytes).expect("write part");
    bytes.len() as u64
}

/// Build every rank's files into `dir`: (seconds, part bytes of all ranks, largest part).
fn build(dir: &Path, ranks: u64, tensors: u64) -> (f64, u64, u64) {
    let t = Instant::now();
    let crcs = zero_crcs(ranks, tensors);
    let sizes: Vec<u64> = (0..ranks)
        .into_par_iter()
        .map(|r| write_rank(dir, r, ranks, tensors, &crcs))
        .collect();
    (
        t.elapsed().as_secs_f64(),
        sizes.iter().sum(),
        sizes.iter().copied().max().unwrap_or(0),
    )
}

fn layout_name(l: Layout) -> &'static str {
    match l {
        Layout::Flat => "flat",
        _ => "two",
    }
}

// ---- the coordinator and the rank, each a fresh process ----

/// The coordinator: read and decode every part descriptor (as `commit_rendezvous` does;
/// not timed as the commit), then `commit` them (timed).
fn coordinator(dir: &Path, ranks: u64, layout: Layout) {
    let load0 = load();
    let t = Instant::now();
    // As `commit_rendezvous` does: every descriptor read and decoded, in parallel.
    let parts: Vec<Part> = (0..ranks as u32)
        .into_par_iter()
        .map(|r| {
            let bytes = std::fs::read(dir.join(part_file_name(ID, r))).expect("read part");
            Part::from_bytes(&bytes).expect("the part decodes")
        })
        .collect();
    let gather = t.elapsed().as_secs_f64();
    let rss_parts = status_mib("VmRSS:");
    let opts = CommitOptions {
        world_size: Some(ranks as u32),
        layout,
        ..Default::default()
    };
    let (t, c) = (Instant::now(), cpu_s());
    let info = commit(dir, ID, &parts, &opts).expect("the commit succeeds");
    let commit_s = t.elapsed().as_secs_f64();
    let commit_cpu = cpu_s() - c;
    let peak = peak_rss();
    let root = std::fs::metadata(dir.join(manifest::MANIFEST_FILE))
        .expect("root")
        .len();
    println!(
        "gather_s={gather:.3} parts_rss_mib={rss_parts:.0} commit_s={commit_s:.3} commit_cpu_s={commit_cpu:.2} coordinator_peak_mib={peak:.0} root_bytes={root} committed_tensors={} commit_load={load0}",
        info.tensors
    );
}

/// Rank `r`'s open: `Checkpoint::open`, then the plan of its own box of each of its
/// tensors; then `read_region` of `reads` of them; with `all`, a whole-checkpoint reader's
/// plan (every tensor's full box) after that.
fn rank_open(dir: &Path, ranks: u64, tensors: u64, r: u64, reads: u64, all: bool) {
    let load0 = load();
    let t = Instant::now();
    let ck = Checkpoint::open(dir).expect("open");
    let open_s = t.elapsed().as_secs_f64();
    let mut planned = 0u64;
    let mut own = 0u64;
    let mut first_s = 0.0;
    for i in 0..tensors {
        let (name, _, offsets, shape) = chunk(i, r, ranks);
        planned += ck
            .read(&name)
            .region(&offsets, &shape)
            .plan()
            .expect("plan the rank's region")
            .bytes_read();
        own += nbytes(&shape);
        if i == 0 {
            // The first plan loads the rank's part.
            first_s = t.elapsed().as_secs_f64() - open_s;
        }
    }
    let locate_s = t.elapsed().as_secs_f64();
    let cpu = cpu_s();
    assert_eq!(planned, own, "a rank's own region reads exactly its chunks");
    let (parts, index_bytes) = ck.catalog().parts_read();
    if ck.catalog().two_level() {
        assert_eq!(parts, 1, "a rank's own regions load its own part only");
    }
    let root = std::fs::metadata(dir.join(manifest::MANIFEST_FILE))
        .expect("root")
        .len();
    let grids = ck.manifest().map_or(0, |m| m.grids.len());
    let peak = peak_rss();
    let mut line = format!(
        "open_s={open_s:.4} first_plan_s={first_s:.4} open_locate_s={locate_s:.4} rank_cpu_s={cpu:.3} parts_loaded={parts} index_bytes={index_bytes} meta_bytes={} grids={grids} rank_peak_mib={peak:.0} planned_bytes={planned} rank_load={load0}",
        root + index_bytes
    );
    let t = Instant::now();
    let mut read_bytes = 0u64;
    for i in 0..reads.min(tensors) {
        let (name, _, offsets, shape) = chunk(i, r, ranks);
        let x = ck
            .read(&name)
            .region(&offsets, &shape)
            .to_tensor()
            .expect("read the rank's region");
        assert!(x.bytes().iter().all(|&b| b == 0), "sparse data is zeros");
        read_bytes += x.bytes().len() as u64;
    }
    line += &format!(
        " read_tensors={} read_bytes={read_bytes} read_s={:.4} peak_after_reads_mib={:.0}",
        reads.min(tensors),
        t.elapsed().as_secs_f64(),
        peak_rss()
    );
    if all {
        let t = Instant::now();
        let mut total = 0u64;
        for i in 0..tensors {
            let (name, shape) = spec(i);
            total += ck
                .read(&name)
                .region(&vec![0; shape.len()], &shape)
                .plan()
                .expect("plan a whole tensor")
                .bytes_read();
        }
        let (parts, index_bytes) = ck.catalog().parts_read();
        line += &format!(
            " all_plan_s={:.4} all_parts_loaded={parts} all_meta_bytes={} all_planned_bytes={total} peak_after_all_mib={:.0}",
            t.elapsed().as_secs_f64(),
            root + index_bytes,
            peak_rss()
        );
    }
    println!("{line}");
}

/// Build the case into a scratch directory, commit it with `layout` in a fresh coordinator
/// process, open it as rank R/2 in a fresh rank process; one line of figures.
fn real_case(kind: &str, ranks: u64, tensors: u64, layout: Layout, all: bool) -> String {
    let name = layout_name(layout);
    let dir = Scratch::new(&format!("{ranks}x{tensors}-{name}"));
    let d = dir.0.display().to_string();
    let (build_s, part_bytes, part_max) = build(&dir.0, ranks, tensors);
    let coord = child(&["_commit".into(), d.clone(), ranks.to_string(), name.into()]);
    // The rank's open in RANK_RUNS fresh processes (the VM is shared and busy): the run of
    // median open + locate time, with the fastest and slowest.
    let mut runs: Vec<(f64, String)> = (0..RANK_RUNS)
        .map(|_| {
            let line = child(&[
                "_rank".into(),
                d.clone(),
                ranks.to_string(),
                tensors.to_string(),
                (ranks / 2).to_string(),
                if all { "all" } else { "own" }.into(),
            ]);
            (num(&parse(&line), "open_locate_s"), line)
        })
        .collect();
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let rank = format!(
        "{} open_locate_min_s={:.4} open_locate_max_s={:.4}",
        runs[runs.len() / 2].1,
        runs[0].0,
        runs[runs.len() - 1].0
    );
    format!(
        "{kind} layout={name} ranks={ranks} tensors={tensors} chunks={} build_s={build_s:.2} part_bytes_all={part_bytes} part_bytes_max={part_max} {coord} {rank}",
        ranks * tensors
    )
}

// ---- the tables ----

type Row = HashMap<String, String>;

fn parse(line: &str) -> Row {
    let mut it = line.split_whitespace();
    let mut row: Row = it
        .by_ref()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let Some(kind) = line.split_whitespace().next() {
        row.insert("kind".into(), kind.into());
    }
    row
}

fn get<'a>(r: &'a Row, k: &str) -> &'a str {
    r.get(k).map_or("-", String::as_str)
}

fn num(r: &Row, k: &str) -> f64 {
    r.get(k).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

fn mb(r: &Row, k: &str) -> String {
    let v = num(r, k);
    if v.is_nan() {
        "-".into()
    } else {
        format!("{:.3} MB", v / 1e6)
    }
}

/// A rank's open + locate: median of the runs (fastest-slowest), and its CPU time.
fn open_ms(r: &Row) -> String {
    if r.is_empty() {
        return "-".into();
    }
    format!(
        "{:.1} ms ({:.1}-{:.1}; CPU {:.1})",
        num(r, "open_locate_s") * 1e3,
        num(r, "open_locate_min_s") * 1e3,
        num(r, "open_locate_max_s") * 1e3,
        num(r, "rank_cpu_s") * 1e3
    )
}

fn main_table(flat: &[Row], two: &[Row]) {
    println!();
    println!("| R x T | chunks | flat manifest | flat encode (s) | flat decode, each rank (s) | flat reader peak | two-level root | own part | all parts | commit (two-level), CPU | coordinator peak | rank open + locate (ms: median, range; CPU) | metadata decoded | parts loaded | rank peak | reads (tensors, MB, s) | load |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for t in two {
        let f = flat
            .iter()
            .find(|f| get(f, "ranks") == get(t, "ranks") && get(f, "tensors") == get(t, "tensors"));
        let empty = Row::new();
        let f = f.unwrap_or(&empty);
        println!(
            "| {} x {} | {} | {} | {} | {} | {} MiB | {} | {} | {} | {} s, {} s | {} MiB | {} | {} | {} | {} MiB | {}, {:.1}, {} s | {} / {} / {} |",
            get(t, "ranks"),
            get(t, "tensors"),
            get(t, "chunks"),
            mb(f, "bytes"),
            get(f, "encode_s"),
            get(f, "decode_s"),
            get(f, "reader_peak_mib"),
            mb(t, "root_bytes"),
            mb(t, "part_bytes_max"),
            mb(t, "part_bytes_all"),
            get(t, "commit_s"),
            get(t, "commit_cpu_s"),
            get(t, "coordinator_peak_mib"),
            open_ms(t),
            mb(t, "meta_bytes"),
            get(t, "parts_loaded"),
            get(t, "rank_peak_mib"),
            get(t, "read_tensors"),
            num(t, "read_bytes") / 1e6,
            get(t, "read_s"),
            get(f, "load"),
            get(t, "commit_load"),
            get(t, "rank_load"),
        );
    }
}

/// A whole-checkpoint reader: open, then plan every tensor's full box (every part loaded).
fn whole(r: &Row) -> String {
    let v = num(r, "open_locate_s") + num(r, "all_plan_s");
    if v.is_nan() {
        return "-".into();
    }
    format!("{:.1} ms, {}", v * 1e3, mb(r, "all_meta_bytes"))
}

fn cross_table(rows: &[Row]) {
    println!();
    println!("| R x T | chunks | open + locate flat (ms: median, range; CPU) | two-level | metadata decoded flat | two-level | rank peak flat | two-level | commit flat (s, CPU s) | two-level | whole-checkpoint reader flat (open + every box planned) | two-level | load |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut seen: Vec<(String, String)> = Vec::new();
    for r in rows {
        let key = (get(r, "ranks").to_string(), get(r, "tensors").to_string());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        let pick = |l: &str| {
            rows.iter().find(|x| {
                get(x, "ranks") == key.0 && get(x, "tensors") == key.1 && get(x, "layout") == l
            })
        };
        let empty = Row::new();
        let (f, t) = (
            pick("flat").unwrap_or(&empty),
            pick("two").unwrap_or(&empty),
        );
        println!(
            "| {} x {} | {} | {} | {} | {} | {} | {} MiB | {} MiB | {}, {} | {}, {} | {} | {} | {} / {} |",
            key.0,
            key.1,
            get(t, "chunks"),
            open_ms(f),
            open_ms(t),
            mb(f, "meta_bytes"),
            mb(t, "meta_bytes"),
            get(f, "rank_peak_mib"),
            get(t, "rank_peak_mib"),
            get(f, "commit_s"),
            get(f, "commit_cpu_s"),
            get(t, "commit_s"),
            get(t, "commit_cpu_s"),
            whole(f),
            whole(t),
            get(f, "rank_load"),
            get(t, "rank_load"),
        );
    }
}

fn run_cases() -> (Vec<Row>, Vec<Row>) {
    let (mut flat_rows, mut two_rows) = (Vec::new(), Vec::new());
    for &(r, t, measure_flat) in CASES {
        if measure_flat {
            let line = child(&["flat".into(), r.to_string(), t.to_string()]);
            println!("{line}");
            flat_rows.push(parse(&line));
        }
        let line = real_case("two", r, t, Layout::TwoLevel, false);
        println!("{line}");
        two_rows.push(parse(&line));
    }
    (flat_rows, two_rows)
}

fn run_cross() -> Vec<Row> {
    let mut rows = Vec::new();
    for &(r, t) in CROSS {
        for layout in [Layout::Flat, Layout::TwoLevel] {
            let line = real_case("cross", r, t, layout, true);
            println!("{line}");
            rows.push(parse(&line));
        }
    }
    rows
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n = |i: usize| args.get(i).and_then(|s| s.parse::<u64>().ok());
    let start = Instant::now();
    match (args.first().map(String::as_str), n(1), n(2)) {
        (Some("flat"), Some(r), Some(t)) => flat(r, t),
        (Some("read"), _, Some(k)) => read(&args[1], k as usize),
        (Some("two"), Some(r), Some(t)) => {
            println!("{}", real_case("two", r, t, Layout::TwoLevel, false));
        }
        (Some("cross"), Some(r), Some(t)) => {
            for layout in [Layout::Flat, Layout::TwoLevel] {
                println!("{}", real_case("cross", r, t, layout, true));
            }
        }
        // `_commit DIR R LAYOUT`
        (Some("_commit"), _, Some(r)) => {
            let layout = match args.get(3).map(String::as_str) {
                Some("flat") => Layout::Flat,
                _ => Layout::TwoLevel,
            };
            coordinator(Path::new(&args[1]), r, layout);
        }
        // `_rank DIR R T RANK own|all`
        (Some("_rank"), _, Some(r)) => {
            let (t, me) = (n(3).expect("tensors"), n(4).expect("rank"));
            let all = args.get(5).map(String::as_str) == Some("all");
            rank_open(Path::new(&args[1]), r, t, me, 9, all);
        }
        (Some("cases"), _, _) => {
            let (f, t) = run_cases();
            main_table(&f, &t);
        }
        (Some("crossover"), _, _) => cross_table(&run_cross()),
        _ => {
            let (f, t) = run_cases();
            let c = run_cross();
            main_table(&f, &t);
            cross_table(&c);
        }
    }
    if !args
        .first()
        .is_some_and(|a| a.starts_with('_') || a == "read")
    {
        eprintln!("total {:.1} s", start.elapsed().as_secs_f64());
    }
}
