//! Issue 12, "At 1,000 ranks, on paper and by simulation": what the flat manifest costs as a
//! job grows, and what a two-level manifest (a root naming per-rank part indexes) would cost
//! instead. No tensor data: manifests are built in memory, with realistic names and plausible
//! offsets, CRCs and absmax, one shard per rank, every global tensor split by rows into one
//! chunk per rank.
//!
//! Run: `cargo run --release --example manifest_scale` (every case, each in a child process,
//! so that each peak RSS is its own), or `-- flat R T` / `-- two R T` for one case.
//!
//! * flat: build the [`Manifest`], `manifest::encode` it (the coordinator's commit cost),
//!   `manifest::decode` it (every rank's open cost; it validates the tiling too), peak RSS
//!   of the writer (build + encode) and of the reader (bytes + decode).
//! * two: per rank a part index (today's part descriptor of format-spec/global.md: the rank's
//!   shards, tensors and chunks), serialized with its CRC trailer; the root built from the
//!   ranks' chunk boxes (grids of split points, each cell naming its part; tiling checked),
//!   in two variants: a grid inline in every global, or grids shared by the globals that
//!   have the same one. Sizes, serialize and parse times (serde_json).

use std::collections::HashMap;
use std::time::Instant;

use ckptstore::format::global::{ChunkEntry, GlobalEntry};
use ckptstore::format::manifest::{self, Manifest, ShardEntry, TensorInfo};
use ckptstore::DType;
use serde::{Deserialize, Serialize};

const ID: &str = "5f0c2a7e9b1d4c3a8e6f0b2d4a6c8e10";

/// The cases of the full run: (ranks, tensors, flat measured?).
const CASES: &[(u64, u64, bool)] = &[
    (8, 10_000, true),
    (64, 10_000, true),
    (1000, 100, true),
    (1000, 1000, true),
    (1000, 10_000, false),
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
        let nbytes = shape.iter().product::<u64>() * 4;
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

/// Peak resident set of this process, in MiB, from /proc/self/status (0 where unavailable).
fn peak_rss() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    get("VmHWM:")
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
        "flat ranks={ranks} tensors={tensors} chunks={chunks} bytes={len} build_s={build:.3} encode_s={enc:.3} writer_peak_mib={writer_peak:.0}"
    );
    if len <= ckptstore::format::MAX_MANIFEST_SIZE {
        // The reader is a fresh process, as a rank opening the checkpoint is: its peak RSS
        // is the file's bytes plus the decoded manifest, nothing of the writer's.
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), &bytes).expect("write");
        drop(bytes);
        let out = std::process::Command::new(std::env::current_exe().expect("own path"))
            .args(["read", &file.path().display().to_string(), &n.to_string()])
            .output()
            .expect("reader runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        line += " ";
        line += String::from_utf8_lossy(&out.stdout).trim();
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

// ---- the two-level design ----

/// A part index: today's part descriptor (format-spec/global.md §Parts).
#[derive(Serialize, Deserialize)]
struct Part {
    format: String,
    version: u64,
    checkpoint_id: String,
    rank: u64,
    shards: Vec<ShardEntry>,
    tensors: Vec<TensorInfo>,
    chunks: Vec<PartChunk>,
}

#[derive(Serialize, Deserialize)]
struct PartChunk {
    global: String,
    dtype: DType,
    global_shape: Vec<u64>,
    offsets: Vec<u64>,
    shape: Vec<u64>,
    tensor: String,
}

#[derive(Serialize, Deserialize)]
struct PartRef {
    file: String,
    size: u64,
    crc32: String,
}

/// A grid: split points per dimension, and the part holding each cell (row-major).
#[derive(Serialize, Deserialize, Clone, PartialEq, Eq, Hash)]
struct Grid {
    splits: Vec<Vec<u64>>,
    cells: Vec<u32>,
}

#[derive(Serialize, Deserialize)]
struct RootGlobalInline {
    name: String,
    dtype: DType,
    global_shape: Vec<u64>,
    #[serde(flatten)]
    grid: Grid,
}

#[derive(Serialize, Deserialize)]
struct RootGlobalShared {
    name: String,
    dtype: DType,
    global_shape: Vec<u64>,
    grid: usize,
}

#[derive(Serialize, Deserialize)]
struct Root<G> {
    format: String,
    version: u64,
    features: Vec<String>,
    checkpoint_id: String,
    shards: Vec<ShardEntry>,
    tensors: Vec<TensorInfo>,
    metadata: serde_json::Value,
    parts: Vec<PartRef>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    grids: Option<Vec<Grid>>,
    globals: Vec<G>,
}

/// A chunk box as a rank reports it to the coordinator (rank 1 or 2 here).
#[derive(Clone, Copy)]
struct Box2 {
    part: u32,
    offsets: [u64; 2],
    shape: [u64; 2],
}

/// The grid the boxes of one global draw, tiling checked (every cell covered exactly once).
fn grid(gshape: &[u64], boxes: &[Box2]) -> Result<Grid, String> {
    let nd = gshape.len();
    let mut splits = Vec::with_capacity(nd);
    for (d, &full) in gshape.iter().enumerate() {
        let mut s = Vec::with_capacity(boxes.len() + 2);
        s.push(0);
        s.push(full);
        for b in boxes {
            s.push(b.offsets[d]);
            s.push(b.offsets[d] + b.shape[d]);
        }
        s.sort_unstable();
        s.dedup();
        splits.push(s);
    }
    let dims: Vec<usize> = splits.iter().map(|s| s.len() - 1).collect();
    let mut cells = vec![u32::MAX; dims.iter().product()];
    for b in boxes {
        let mut lo = [0usize; 2];
        let mut hi = [1usize; 2];
        for d in 0..nd {
            lo[d] = splits[d].binary_search(&b.offsets[d]).map_err(|_| "edge")?;
            hi[d] = splits[d]
                .binary_search(&(b.offsets[d] + b.shape[d]))
                .map_err(|_| "edge")?;
        }
        let stride = if nd == 2 { dims[1] } else { 1 };
        for i in lo[0]..hi[0] {
            for j in lo[1]..hi[1] {
                let c = &mut cells[i * stride + j];
                if *c != u32::MAX {
                    return Err("overlap".into());
                }
                *c = b.part;
            }
        }
    }
    if cells.contains(&u32::MAX) {
        return Err("gap".into());
    }
    Ok(Grid { splits, cells })
}

fn root<G>(parts: Vec<PartRef>, globals: Vec<G>, grids: Option<Vec<Grid>>) -> Root<G> {
    Root {
        format: "ckptstore".into(),
        version: 1,
        features: vec!["global".into(), "parts".into()],
        checkpoint_id: ID.into(),
        shards: Vec::new(),
        tensors: Vec::new(),
        metadata: serde_json::json!({}),
        parts,
        grids,
        globals,
    }
}

fn with_trailer<T: Serialize>(v: &T) -> Vec<u8> {
    let mut body = serde_json::to_vec(v).expect("plain data");
    body.pop();
    manifest::append_trailer(body)
}

fn two(ranks: u64, tensors: u64) {
    let chunks = ranks * tensors;
    let n = reps(chunks);
    // Each rank: its part index (serialized, timed), and its chunk boxes for the coordinator.
    let mut boxes: Vec<Vec<Box2>> = (0..tensors)
        .map(|_| Vec::with_capacity(ranks as usize))
        .collect();
    let mut parts = Vec::with_capacity(ranks as usize);
    let (mut part_enc_max, mut part_bytes_max, mut part_bytes_sum) = (0f64, 0u64, 0u64);
    let mut sample: Vec<u8> = Vec::new();
    for r in 0..ranks {
        let (shard, ts) = rank_entries(r, ranks, tensors, 0);
        let mut pc = Vec::with_capacity(ts.len());
        for (t, info) in ts.iter().enumerate() {
            let (global, global_shape, offsets, shape) = chunk(t as u64, r, ranks);
            let mut b = Box2 {
                part: r as u32,
                offsets: [0; 2],
                shape: [1; 2],
            };
            b.offsets[..offsets.len()].copy_from_slice(&offsets);
            b.shape[..shape.len()].copy_from_slice(&shape);
            boxes[t].push(b);
            pc.push(PartChunk {
                global,
                dtype: DType::F32,
                global_shape,
                offsets,
                shape,
                tensor: info.name.clone(),
            });
        }
        let part = Part {
            format: "ckptstore-part".into(),
            version: 1,
            checkpoint_id: ID.into(),
            rank: r,
            shards: vec![shard],
            tensors: ts,
            chunks: pc,
        };
        let t = Instant::now();
        let bytes = with_trailer(&part);
        part_enc_max = part_enc_max.max(t.elapsed().as_secs_f64());
        let len = bytes.len() as u64;
        part_bytes_max = part_bytes_max.max(len);
        part_bytes_sum += len;
        parts.push(PartRef {
            file: format!("part-{ID}-r{r}.json"),
            size: len,
            crc32: format!("{:08x}", crc32fast::hash(&bytes)),
        });
        if r == ranks / 2 {
            sample = bytes;
        }
    }
    // Parse times include the trailer's CRC; the trailer is itself a JSON member.
    let (part_parse, _) = best(n.max(3), || {
        crc32fast::hash(&sample);
        serde_json::from_slice::<Part>(&sample).expect("parses")
    });
    // The coordinator: grids from the boxes (tiling checked), shared grids, the root.
    let t = Instant::now();
    let mut grids: Vec<Grid> = Vec::new();
    let mut by_grid: HashMap<Grid, usize> = HashMap::new();
    let mut inline = Vec::with_capacity(tensors as usize);
    let mut shared = Vec::with_capacity(tensors as usize);
    for (t, b) in boxes.iter().enumerate() {
        let (name, global_shape) = spec(t as u64);
        let g = grid(&global_shape, b).expect("the chunks tile");
        let k = *by_grid.entry(g.clone()).or_insert_with(|| {
            grids.push(g.clone());
            grids.len() - 1
        });
        shared.push(RootGlobalShared {
            name: name.clone(),
            dtype: DType::F32,
            global_shape: global_shape.clone(),
            grid: k,
        });
        inline.push(RootGlobalInline {
            name,
            dtype: DType::F32,
            global_shape,
            grid: g,
        });
    }
    let grids_s = t.elapsed().as_secs_f64();
    drop(boxes);
    let root_a = root(std::mem::take(&mut parts), inline, None);
    let (enc_a, bytes_a) = best(n, || with_trailer(&root_a));
    let root_b = root(root_a.parts, shared, Some(grids));
    let ngrids = root_b.grids.as_ref().map_or(0, Vec::len);
    let (enc_b, bytes_b) = best(n, || with_trailer(&root_b));
    let (parse_a, _) = best(n.max(3), || {
        crc32fast::hash(&bytes_a);
        serde_json::from_slice::<Root<RootGlobalInline>>(&bytes_a).expect("parses")
    });
    let (parse_b, _) = best(n.max(3), || {
        crc32fast::hash(&bytes_b);
        serde_json::from_slice::<Root<RootGlobalShared>>(&bytes_b).expect("parses")
    });
    let peak = peak_rss();
    println!(
        "two ranks={ranks} tensors={tensors} chunks={chunks} part_bytes_max={part_bytes_max} part_bytes_sum={part_bytes_sum} part_encode_s_max={part_enc_max:.4} part_parse_s={part_parse:.4} grids_s={grids_s:.3} ngrids={ngrids} root_inline_bytes={} root_inline_encode_s={enc_a:.4} root_inline_parse_s={parse_a:.4} root_shared_bytes={} root_shared_encode_s={enc_b:.4} root_shared_parse_s={parse_b:.4} peak_mib={peak:.0}",
        bytes_a.len(),
        bytes_b.len()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| args.get(i).and_then(|s| s.parse::<u64>().ok());
    match (args.first().map(String::as_str), num(1), num(2)) {
        (Some("flat"), Some(r), Some(t)) => flat(r, t),
        (Some("two"), Some(r), Some(t)) => two(r, t),
        (Some("read"), _, Some(n)) => read(&args[1], n as usize),
        _ => {
            let exe = std::env::current_exe().expect("own path");
            let start = Instant::now();
            for &(r, t, measure_flat) in CASES {
                let kinds: &[&str] = if measure_flat {
                    &["flat", "two"]
                } else {
                    &["two"]
                };
                for kind in kinds {
                    let out = std::process::Command::new(&exe)
                        .args([*kind, &r.to_string(), &t.to_string()])
                        .output()
                        .expect("child runs");
                    assert!(
                        out.status.success(),
                        "{kind} {r} {t}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    print!("{}", String::from_utf8_lossy(&out.stdout));
                }
            }
            println!("total {:.1} s", start.elapsed().as_secs_f64());
        }
    }
}
