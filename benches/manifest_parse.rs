//! Decoding a 10,000-tensor manifest's bytes into a [`Manifest`]: the hand-written parser
//! (`format/manifest/fast.rs`; run with `--features json-bench`) against serde_json (the baseline), sonic-rs and simd-json,
//! all through the same derived `Deserialize` for the crates (issue 11, part 4). Plus the
//! whole of `manifest::decode` (trailer CRC, parse, validation) for scale.
//! Run: `cargo bench --bench manifest_parse`.
//!
//! Times are the benchmark thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), not wall time:
//! on a shared machine, wall time also counts the slices other processes run in, which
//! moved single runs by +-50%. `CKPT_BENCH_WALL=1` measures wall time instead (group
//! `manifest_parse_wall`).

use std::time::Duration;

use ckptstore::format::manifest::{self, Manifest, ShardEntry, TensorInfo};
use ckptstore::{save, DType, SaveOptions, TensorRef};
use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{black_box, BatchSize, BenchmarkId, Criterion, Throughput};

/// Criterion measurement: CPU time of the calling thread (user and system).
struct ThreadCpu;

impl Measurement for ThreadCpu {
    type Intermediate = cpu_time::ThreadTime;
    type Value = Duration;
    fn start(&self) -> cpu_time::ThreadTime {
        cpu_time::ThreadTime::now()
    }
    fn end(&self, t: cpu_time::ThreadTime) -> Duration {
        t.elapsed()
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, v: &Duration) -> f64 {
        v.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuFormatter
    }
}

/// Values in CPU nanoseconds, shown in us or ms; byte throughputs in MiB/s.
struct CpuFormatter;

impl ValueFormatter for CpuFormatter {
    fn scale_values(&self, ns: f64, values: &mut [f64]) -> &'static str {
        let (factor, unit) = if ns < 1e6 {
            (1e-3, "us (cpu)")
        } else {
            (1e-6, "ms (cpu)")
        };
        values.iter_mut().for_each(|v| *v *= factor);
        unit
    }
    fn scale_throughputs(&self, _: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        let (n, unit) = match *t {
            Throughput::Bytes(b) | Throughput::BytesDecimal(b) => {
                (b as f64 / f64::from(1u32 << 20), "MiB/s (cpu)")
            }
            Throughput::Elements(e) => (e as f64, "elem/s (cpu)"),
        };
        values.iter_mut().for_each(|v| *v = n * 1e9 / *v);
        unit
    }
    fn scale_for_machines(&self, _: &mut [f64]) -> &'static str {
        "ns"
    }
}

/// The manifest `benches/open_verify.rs` opens (`open/ckptstore_10k_tensors/80MiB`):
/// 10,000 one-dimensional F32 tensors, each with its absmax, as `save` writes it.
fn open_verify_manifest() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let tensors = 10_000usize;
    let per = ((80u64 << 20) / tensors as u64) as usize / 4 * 4;
    let buf = vec![0x3cu8; per];
    let names: Vec<String> = (0..tensors)
        .map(|i| format!("model.layers.{}.block.{}.weight", i / 16, i % 16))
        .collect();
    let refs: Vec<TensorRef<'_>> = names
        .iter()
        .map(|n| TensorRef::new(n.as_str(), DType::F32, &[(per / 4) as u64], &buf))
        .collect();
    let opts = SaveOptions {
        max_shard_size: 1 << 30,
        ..Default::default()
    };
    save(dir.path(), &refs, &opts).unwrap();
    std::fs::read(dir.path().join(manifest::MANIFEST_FILE)).unwrap()
}

/// A transformer-shaped manifest of 10,000 tensors (1,111 layers of seven BF16 matrices
/// and two F32 norms with absmax, plus the embedding): 2-D shapes, offsets of ten
/// digits and more, 5 GiB shards.
fn llm_like_manifest() -> Vec<u8> {
    let (d, ff) = (4096u64, 11008u64);
    let mut specs: Vec<(String, DType, Vec<u64>)> = vec![(
        "model.embed_tokens.weight".into(),
        DType::BF16,
        vec![32000, d],
    )];
    for l in 0..1111 {
        let p = format!("model.layers.{l}");
        for (n, s) in [
            ("self_attn.q_proj", vec![d, d]),
            ("self_attn.k_proj", vec![d, d]),
            ("self_attn.v_proj", vec![d, d]),
            ("self_attn.o_proj", vec![d, d]),
            ("mlp.gate_proj", vec![ff, d]),
            ("mlp.up_proj", vec![ff, d]),
            ("mlp.down_proj", vec![d, ff]),
        ] {
            specs.push((format!("{p}.{n}.weight"), DType::BF16, s));
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            specs.push((format!("{p}.{n}.weight"), DType::F32, vec![d]));
        }
    }
    assert_eq!(specs.len(), 10_000);
    let header = 1u64 << 20;
    let mut shards: Vec<ShardEntry> = Vec::new();
    let mut tensors = Vec::new();
    let mut at = u64::MAX;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for (name, dtype, shape) in specs {
        let n = shape.iter().product::<u64>() * dtype.size() as u64;
        if at.saturating_add(n) > (5 << 30) {
            if let Some(s) = shards.last_mut() {
                s.size = at;
            }
            shards.push(ShardEntry {
                file: format!("model-{:05}.safetensors", shards.len()),
                size: 0,
                header_size: header,
                header_crc32: 0x1234_5678,
            });
            at = header + 8;
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        tensors.push(TensorInfo {
            name,
            shard: shards.len() - 1,
            dtype,
            shape,
            offsets: [at, at + n],
            crc32: Some(seed as u32),
            absmax: (dtype == DType::F32).then(|| (seed >> 40) as f32 / (1u64 << 22) as f32),
            blocks: None,
        });
        at += n;
    }
    if let Some(s) = shards.last_mut() {
        s.size = at;
    }
    let m = Manifest {
        format: manifest::FORMAT_NAME.into(),
        version: manifest::VERSION,
        features: vec![],
        checkpoint_id: "0123456789abcdef0123456789abcdef".into(),
        shards,
        tensors,
        metadata: serde_json::json!({"step": 100000, "model": "llm-like", "lr": 3e-4}),
        optimizer: None,
        globals: Vec::new(),
        parts: Vec::new(),
        grids: Vec::new(),
    };
    manifest::encode(&m)
}

/// A decoder from a manifest's bytes to a [`Manifest`].
type Decode = fn(&mut [u8]) -> Manifest;

/// The decoders measured.
const VARIANTS: [(&str, Decode); 6] = [
    ("hand_written", |b| manifest::fast_parse(b).unwrap()),
    ("serde_json", |b| serde_json::from_slice(b).unwrap()),
    ("sonic_rs", |b| sonic_rs::from_slice(b).unwrap()),
    // simd-json parses in place: `decode` takes `&[u8]`, so it would copy first ...
    ("simd_json_with_copy", |b| {
        simd_json::serde::from_slice(&mut b.to_vec()).unwrap()
    }),
    // ... unless `open` handed it its own read buffer: the copy excluded (untimed).
    (IN_PLACE, |b| simd_json::serde::from_slice(b).unwrap()),
    // For scale: the whole decode (trailer CRC, hand-written parse, validation).
    ("decode_total", |b| manifest::decode(b).unwrap()),
];

/// The variant that overwrites its input: each call gets a fresh, untimed copy.
const IN_PLACE: &str = "simd_json_in_place";

fn manifests() -> Vec<(&'static str, Vec<u8>)> {
    let all = vec![
        ("open_verify_10k", open_verify_manifest()),
        ("llm_like_10k", llm_like_manifest()),
    ];
    // Every variant must produce the same manifest, or the comparison means nothing.
    for (_, bytes) in &all {
        let want = manifest::decode(bytes).unwrap();
        for (name, f) in VARIANTS {
            assert_eq!(f(&mut bytes.clone()), want, "{name}");
        }
    }
    all
}

fn manifest_parse<M: Measurement>(c: &mut Criterion<M>, group: &str) {
    let mut g = c.benchmark_group(group);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(4));
    for (label, bytes) in manifests() {
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        for (name, f) in VARIANTS {
            g.bench_with_input(BenchmarkId::new(name, label), &bytes, |x, b| {
                if name == IN_PLACE {
                    x.iter_batched_ref(|| b.clone(), |v| black_box(f(v)), BatchSize::LargeInput)
                } else {
                    let mut v = b.clone();
                    x.iter(|| black_box(f(&mut v)))
                }
            });
        }
    }
    g.finish();
}

/// `CKPT_BENCH_INTERLEAVED=ROUNDS`: instead of criterion, one call of each variant in
/// turn, ROUNDS times, and the median thread CPU time of each; load that comes and goes
/// then hits every variant alike.
fn interleaved(rounds: usize) {
    println!("{rounds} interleaved rounds, median thread CPU time per decode");
    println!("| manifest | variant | ms | x hand_written | x serde_json |");
    println!("| --- | --- | --- | --- | --- |");
    for (label, bytes) in manifests() {
        let mut times = vec![Vec::with_capacity(rounds); VARIANTS.len()];
        let mut shared = bytes.clone();
        for r in 0..rounds {
            for k in (0..VARIANTS.len()).map(|k| (k + r) % VARIANTS.len()) {
                let (name, f) = VARIANTS[k];
                let mut fresh = (name == IN_PLACE).then(|| bytes.clone());
                let input = fresh.as_mut().unwrap_or(&mut shared);
                let t = cpu_time::ThreadTime::now();
                drop(black_box(f(input)));
                times[k].push(t.elapsed());
            }
        }
        let med: Vec<f64> = times
            .iter_mut()
            .map(|t| {
                t.sort_unstable();
                t[t.len() / 2].as_secs_f64() * 1e3
            })
            .collect();
        for (k, (name, _)) in VARIANTS.iter().enumerate() {
            println!(
                "| {label} | {name} | {:.2} | {:.2} | {:.2} |",
                med[k],
                med[k] / med[0],
                med[k] / med[1]
            );
        }
    }
}

fn main() {
    if let Ok(r) = std::env::var("CKPT_BENCH_INTERLEAVED") {
        interleaved(r.parse().unwrap_or(100));
    } else if std::env::var_os("CKPT_BENCH_WALL").is_some() {
        let mut c = Criterion::default().configure_from_args();
        manifest_parse(&mut c, "manifest_parse_wall");
        c.final_summary();
    } else {
        let mut c = Criterion::default()
            .with_measurement(ThreadCpu)
            .configure_from_args();
        manifest_parse(&mut c, "manifest_parse");
        c.final_summary();
    }
}
