//! Seed corpora for the fuzz targets, written with the library's own writer.
//!
//! Saves a few tiny checkpoints (plain tensors of every common dtype, one and several
//! shards, optimizer states in F32, BF16, F64 and F16-scaled encodings, several groups)
//! into a temporary directory, then writes:
//!
//! * `corpus/header/`: every shard file (a safetensors file: header plus data);
//! * `corpus/manifest/`: every manifest, the two-level roots among them;
//! * `corpus/open_verify_load/`: manifest plus shards in the target's framing, once as is
//!   and once with the CRC-repair flags set;
//! * `corpus/two_level/`: two-level checkpoints (`write_part` of one to three ranks, then
//!   a `Layout::TwoLevel` commit: root, part indexes, shards) in that target's framing, as
//!   is, repaired, repaired with the reads before `verify`, and under the fixed names.
//!
//! Deterministic: every checkpoint's random id is replaced by a fixed one (in the manifest,
//! the shard file names and the shard headers, with the CRCs recomputed; the two-level
//! checkpoints are written with the fixed id `TL_SEED_ID`), so the same source gives
//! byte-identical seeds. Files are named `seed-*`; other corpus entries (what
//! the fuzzer found) are left alone.
//!
//! Usage: `gen_seeds [CORPUS_DIR]` (default: `corpus/` next to the fuzz crate's Cargo.toml).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ckptstore::format::{header, manifest};
use ckptstore::optim::{OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateValue, Tensor};
use ckptstore::write::parts::{self, PartItem};
use ckptstore::{save, Checkpoint, DType, SaveOptions, TensorRef};
use ckptstore_fuzz::{
    check_two_level, frame, frame_two_level, two_level_files, two_level_fixed_names,
    two_level_manifest_names, unframe_two_level, FIX_ALL, TL_FIXED_NAMES, TL_FIX_ALL,
    TL_READ_FIRST, TL_SEED_ID,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// One saved checkpoint, made deterministic: manifest bytes and shard files in order.
struct Saved {
    name: &'static str,
    manifest: Vec<u8>,
    shards: Vec<Vec<u8>>,
}

/// Deterministic values in [-2, 2).
fn vals(seed: u32, n: usize) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x =
                (i.wrapping_add(1).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 8;
            (x % 4096) as f32 / 1024.0 - 2.0
        })
        .collect()
}

/// BF16 by truncation of the FP32 bits (exact for the values `vals` makes).
fn bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn f64_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|&v| (v as f64).to_le_bytes()).collect()
}

/// Replace the checkpoint's random id by `fixed` everywhere and recompute the CRCs.
fn canonicalize(dir: &Path, name: &'static str, fixed: &str) -> Res<Saved> {
    let bytes = std::fs::read(dir.join(manifest::MANIFEST_FILE))?;
    let mut m = manifest::decode(&bytes).map_err(|e| format!("{name}: {e:?}"))?;
    let old = m.checkpoint_id.clone();
    assert_eq!(old.len(), fixed.len());
    let mut shards = Vec::new();
    for s in &mut m.shards {
        let mut b = std::fs::read(dir.join(&s.file))?;
        let end = 8 + s.header_size as usize;
        let hdr = &mut b[8..end];
        let mut i = 0;
        while let Some(p) = hdr[i..]
            .windows(old.len())
            .position(|w| w == old.as_bytes())
        {
            hdr[i + p..i + p + old.len()].copy_from_slice(fixed.as_bytes());
            i += p + old.len();
        }
        s.header_crc32 = crc32fast::hash(&b[8..end]);
        s.file = s.file.replace(&old, fixed);
        shards.push(b);
    }
    m.checkpoint_id = fixed.to_string();
    let manifest = manifest::encode(&m);
    // The result must be a valid checkpoint.
    let ck = Checkpoint::from_parts(&manifest, shards.clone())?;
    ck.verify()?;
    if ck.manifest().is_some_and(|m| m.optimizer.is_some()) {
        ck.load_optimizer(&Default::default())?;
    }
    Ok(Saved {
        name,
        manifest,
        shards,
    })
}

fn model_tensors<'a>(
    w: &'a [f32],
    emb: &'a [u8],
    h: &'a [u8],
    d: &'a [u8],
    step: &'a [i64],
) -> Vec<TensorRef<'a>> {
    vec![
        TensorRef::from_slice("model.w", &[2, 3], w),
        TensorRef::from_slice("train.step", &[], step),
        TensorRef::new("model.emb", DType::BF16, &[4], emb),
        TensorRef::new("model.mask", DType::Bool, &[5], &[1, 0, 1, 1, 0]),
        TensorRef::new("model.ids", DType::U8, &[3], &[7, 0, 255]),
        TensorRef::new("model.d", DType::F64, &[2], d),
        TensorRef::new("model.h", DType::F16, &[3], h),
        TensorRef::from_slice("model.i", &[2], &[-3i32, 9][..]),
        TensorRef::new("model.empty", DType::F32, &[0, 3], &[]),
    ]
}

fn plain_group(params: &[(&str, &[u64])], hyper: serde_json::Value) -> ParamGroup {
    ParamGroup {
        params: params.iter().map(|(n, s)| ParamSpec::new(*n, s)).collect(),
        hyper: hyper.as_object().cloned().unwrap_or_default(),
    }
}

fn numel(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

/// Adam with F32 moments and an F32 step, over params of shapes [4,4], [4], [].
fn adam_f32() -> Res<OptimizerState> {
    let params: [(&str, &[u64]); 3] = [("w", &[4, 4]), ("b", &[4]), ("temp", &[])];
    let mut opt = OptimizerState::new(vec![plain_group(
        &params,
        serde_json::json!({"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}),
    )]);
    for (k, (n, s)) in params.iter().enumerate() {
        let mut st = BTreeMap::new();
        st.insert(
            "step".to_string(),
            StateValue::Plain(Tensor::scalar_f32(3.0)),
        );
        for (j, sn) in ["exp_avg", "exp_avg_sq"].iter().enumerate() {
            let x = vals(10 * k as u32 + j as u32, numel(s));
            let x: Vec<f32> = if j == 1 {
                x.iter().map(|v| v * v).collect()
            } else {
                x
            };
            st.insert(
                sn.to_string(),
                StateValue::Plain(Tensor::from_slice(s, &x)?),
            );
        }
        opt.state.insert(n.to_string(), st);
    }
    Ok(opt)
}

/// Two groups; F16-scaled states (scale [] and [1]), BF16, F64 and I64 states; one
/// parameter without state.
fn mixed() -> Res<OptimizerState> {
    let g0: [(&str, &[u64]); 2] = [("enc.w", &[3, 2]), ("enc.b", &[2])];
    let g1: [(&str, &[u64]); 2] = [("dec.w", &[5]), ("frozen", &[2, 2])];
    let mut opt = OptimizerState::new(vec![
        plain_group(&g0, serde_json::json!({"lr": 0.1, "momentum": 0.9})),
        plain_group(
            &g1,
            serde_json::json!({"lr": 0.01, "kind": "AdamW", "fused": true}),
        ),
    ]);
    let mut a = BTreeMap::new();
    a.insert(
        "exp_avg".to_string(),
        StateValue::f16_scaled_from_f32(&[3, 2], &vals(1, 6), ScaleShape::One)?,
    );
    a.insert(
        "exp_avg_sq".to_string(),
        StateValue::f16_scaled_from_f32(&[3, 2], &vals(2, 6), ScaleShape::Scalar)?,
    );
    a.insert(
        "step".to_string(),
        StateValue::Plain(Tensor::from_slice(&[], &[12i64][..])?),
    );
    opt.state.insert("enc.w".into(), a);
    let mut b = BTreeMap::new();
    b.insert(
        "momentum_buffer".to_string(),
        StateValue::Plain(Tensor::from_bytes(
            DType::BF16,
            &[2],
            &bf16_bytes(&vals(3, 2)),
        )?),
    );
    opt.state.insert("enc.b".into(), b);
    let mut c = BTreeMap::new();
    c.insert(
        "exp_avg".to_string(),
        StateValue::Plain(Tensor::from_bytes(
            DType::F64,
            &[5],
            &f64_bytes(&vals(4, 5)),
        )?),
    );
    c.insert(
        "exp_avg_sq".to_string(),
        StateValue::f16_scaled_from_f32(&[5], &[0.0; 5], ScaleShape::One)?,
    );
    c.insert(
        "step".to_string(),
        StateValue::Plain(Tensor::from_slice(&[1], &[2.0f32][..])?),
    );
    opt.state.insert("dec.w".into(), c);
    Ok(opt)
}

fn save_all(tmp: &Path) -> Res<Vec<Saved>> {
    let w = vals(100, 6);
    let emb = bf16_bytes(&vals(101, 4));
    let h: Vec<u8> = [0x3c00u16, 0xbc00, 0x7bff]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let d = f64_bytes(&vals(102, 2));
    let step = [7i64];
    let model = model_tensors(&w, &emb, &h, &d, &step);
    let meta = serde_json::json!({"run": "fuzz-seed", "step": 7, "nested": {"a": [1, 2.5, null]}});
    let opts = |max: u64| SaveOptions {
        max_shard_size: max,
        metadata: meta.clone(),
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut k = 0u32;
    let mut next = |dir: &Path, name: &'static str| -> Res<Saved> {
        k += 1;
        canonicalize(dir, name, &format!("5eed{k:028x}"))
    };

    let dir = tmp.join("model");
    save(&dir, &model, &opts(1 << 20))?;
    out.push(next(&dir, "model")?);

    let dir = tmp.join("model3");
    save(&dir, &model, &opts(32))?;
    out.push(next(&dir, "model3")?);

    let dir = tmp.join("adam");
    adam_f32()?.save(&dir, &model[..2], &opts(1 << 20))?;
    out.push(next(&dir, "adam")?);

    let dir = tmp.join("adam2");
    adam_f32()?.save(&dir, &[], &opts(100))?;
    out.push(next(&dir, "adam2")?);

    let dir = tmp.join("mixed");
    mixed()?.save(&dir, &model[3..5], &SaveOptions::default())?;
    out.push(next(&dir, "mixed")?);

    // Block CRCs (format-spec/integrity.md §Block CRCs): a 12 KiB tensor in 4 KiB blocks.
    let dir = tmp.join("blocks");
    let big = vals(103, 3072);
    save(
        &dir,
        &[TensorRef::from_slice("big", &[3, 1024], &big)],
        &SaveOptions {
            block_size: 4096,
            ..opts(1 << 20)
        },
    )?;
    out.push(next(&dir, "blocks")?);

    // Two ranks, global tensors in chunks (format-spec/global.md): rows of `g`, a
    // replicated 0-dim `s` (one chunk plus a replica), a whole tensor from rank 0.
    let dir = tmp.join("global");
    let id = parts::new_checkpoint_id()?;
    let g = vals(103, 12);
    let mut descriptors = Vec::new();
    for rank in 0..2u32 {
        let rows = &g[rank as usize * 6..rank as usize * 6 + 6];
        let mut items = vec![
            PartItem::Chunk {
                tensor: TensorRef::from_slice("g", &[2, 3], rows),
                global_shape: vec![4, 3],
                offsets: vec![u64::from(rank) * 2, 0],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("s", &[], &step[..]),
                global_shape: vec![],
                offsets: vec![],
            },
        ];
        if rank == 0 {
            items.push(PartItem::Whole(model[0].clone()));
        }
        descriptors.push(ckptstore::write_part(&dir, &id, rank, &items, &opts(1 << 20))?);
    }
    ckptstore::commit(&dir, &id, &descriptors, &parts::CommitOptions::default())?;
    out.push(next(&dir, "global")?);
    PART_SEEDS.with(|p| {
        p.borrow_mut()
            .extend(descriptors.iter().map(parts::Part::to_bytes))
    });

    Ok(out)
}

/// One two-level checkpoint (format-spec/global.md §The two-level manifest) as the
/// `two_level` target frames it: the root, the part indexes in the root's order, the shard
/// files in the order `two_level_manifest_names` names the slots.
struct TwoLevel {
    name: &'static str,
    root: Vec<u8>,
    parts: Vec<Vec<u8>>,
    shards: Vec<Vec<u8>>,
    /// The shards in the fixed name table's order, if the table names exactly them.
    fixed_order: Option<Vec<Vec<u8>>>,
}

/// Commit `descriptors` (written into `dir` with id [`TL_SEED_ID`]) as a two-level root and
/// read the directory's files back in slot order; the framed files must open, verify and
/// pass the target's checks, with and without the repairs.
fn commit_two_level(dir: &Path, name: &'static str, descriptors: &[parts::Part]) -> Res<TwoLevel> {
    let opts = ckptstore::CommitOptions {
        layout: parts::Layout::TwoLevel,
        world_size: Some(descriptors.len() as u32),
        ..Default::default()
    };
    ckptstore::commit(dir, TL_SEED_ID, descriptors, &opts)?;
    let root = std::fs::read(dir.join(manifest::MANIFEST_FILE))?;
    let m = manifest::decode(&root).map_err(|e| format!("{name}: {e:?}"))?;
    assert!(!m.parts.is_empty(), "{name}: not a two-level root");
    let part_files = m
        .parts
        .iter()
        .map(|p| std::fs::read(dir.join(&p.file)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let views: Vec<&[u8]> = part_files.iter().map(Vec::as_slice).collect();
    // Every engine file of the directory is the root, a part index or a shard.
    let on_disk: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<Vec<_>>>()?
        .into_iter()
        .filter(|n| !n.starts_with('.') && n != manifest::MANIFEST_FILE && !n.starts_with("part-"))
        .collect();
    let (part_names, shard_names) = two_level_manifest_names(&root, &views, on_disk.len());
    assert_eq!(
        part_names,
        m.parts.iter().map(|p| p.file.clone()).collect::<Vec<_>>(),
        "{name}"
    );
    let mut sorted = shard_names.clone();
    sorted.sort();
    let mut disk = on_disk.clone();
    disk.sort();
    assert_eq!(sorted, disk, "{name}: the manifests name every shard once");
    let shards = shard_names
        .iter()
        .map(|n| std::fs::read(dir.join(n)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let (fixed_parts, fixed_shards) = two_level_fixed_names(part_names.len(), shards.len());
    let fixed_order = (fixed_parts == part_names)
        .then(|| {
            fixed_shards
                .iter()
                .map(|n| std::fs::read(dir.join(n)).ok())
                .collect::<Option<Vec<_>>>()
        })
        .flatten();
    let seed = TwoLevel {
        name,
        root,
        parts: part_files,
        shards,
        fixed_order,
    };
    for data in two_level_framings(&seed) {
        let files = two_level_files(&unframe_two_level(&data.1));
        let ck = Checkpoint::from_files(files).map_err(|e| format!("{name}{}: {e}", data.0))?;
        ck.verify().map_err(|e| format!("{name}{}: {e}", data.0))?;
        assert_eq!(
            ck.catalog().parts_read().0,
            part_names.len(),
            "{name}{}",
            data.0
        );
        check_two_level(&data.1);
    }
    Ok(seed)
}

/// The `two_level` seeds of one checkpoint: as is, repaired, repaired with the reads
/// before `verify`, and (where the fixed table names its files) repaired under the fixed
/// names.
fn two_level_framings(s: &TwoLevel) -> Vec<(&'static str, Vec<u8>)> {
    let mut out = vec![
        ("", frame_two_level(0, 0, &s.root, &s.parts, &s.shards)),
        (
            "-fix",
            frame_two_level(0, TL_FIX_ALL, &s.root, &s.parts, &s.shards),
        ),
        (
            "-fix-lazy",
            frame_two_level(TL_READ_FIRST, TL_FIX_ALL, &s.root, &s.parts, &s.shards),
        ),
    ];
    if let Some(fixed) = &s.fixed_order {
        out.push((
            "-fix-named",
            frame_two_level(TL_FIXED_NAMES, TL_FIX_ALL, &s.root, &s.parts, fixed),
        ));
    }
    out
}

fn f16_bytes(bits: &[u16]) -> Vec<u8> {
    bits.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Two-level checkpoints, each under its own directory of `tmp`, id [`TL_SEED_ID`]:
///
/// * `tl3`: three ranks; `w` [6, 4] F32 split by rows, `c` [3, 6] BF16 split by columns,
///   `bias` [4] replicated on every rank (one chunk, two replicas), a 0-dim global `s`
///   (I64) on rank 1 only, whole tensors `lr` and `step` from rank 0;
/// * `tlblocks`: two ranks; `blk` [4, 6] F16 in 2x2 uneven blocks (two per rank), `big`
///   [2, 2048] F32 split by rows with 4 KiB block CRCs (two blocks per chunk);
/// * `tl1`: one rank holding all of `w` [3, 2], a 0-dim global `s` and a whole `step`;
/// * `tlshards`: two ranks; `w` [4, 4] with rank 0's two one-row chunks in shards of
///   their own, rank 1's two rows, and a whole `note` (U8) from rank 1.
fn save_two_level(tmp: &Path) -> Res<Vec<TwoLevel>> {
    let opts = SaveOptions::default();
    let write = |dir: &Path, rank: u32, items: &[PartItem<'_>], o: &SaveOptions| {
        ckptstore::write_part(dir, TL_SEED_ID, rank, items, o)
    };
    let mut out = Vec::new();

    let dir = tmp.join("tl3");
    let w = vals(200, 24);
    let c = bf16_bytes(&vals(201, 18));
    // Column block r of `c` [3, 6]: rows of 2 elements (4 bytes) each.
    let cols: Vec<Vec<u8>> = (0..3)
        .map(|r| {
            (0..3)
                .flat_map(|i| c[i * 12 + r * 4..][..4].to_vec())
                .collect()
        })
        .collect();
    let bias = vals(202, 4);
    let (lr, step, s) = ([0.001f32], [7i64], [-3i64]);
    let mut descriptors = Vec::new();
    for r in 0..3u32 {
        let ru = r as usize;
        let mut items = vec![
            PartItem::Chunk {
                tensor: TensorRef::from_slice("w", &[2, 4], &w[ru * 8..ru * 8 + 8]),
                global_shape: vec![6, 4],
                offsets: vec![2 * u64::from(r), 0],
            },
            PartItem::Chunk {
                tensor: TensorRef::new("c", DType::BF16, &[3, 2], &cols[ru]),
                global_shape: vec![3, 6],
                offsets: vec![0, 2 * u64::from(r)],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("bias", &[4], &bias),
                global_shape: vec![4],
                offsets: vec![0],
            },
        ];
        if r == 1 {
            items.push(PartItem::Chunk {
                tensor: TensorRef::from_slice("s", &[], &s[..]),
                global_shape: vec![],
                offsets: vec![],
            });
        }
        if r == 0 {
            items.push(PartItem::Whole(TensorRef::from_slice("lr", &[1], &lr[..])));
            items.push(PartItem::Whole(TensorRef::from_slice(
                "step",
                &[],
                &step[..],
            )));
        }
        descriptors.push(write(&dir, r, &items, &opts)?);
    }
    out.push(commit_two_level(&dir, "tl3", &descriptors)?);

    let dir = tmp.join("tlblocks");
    let blk: Vec<u16> = (0..24u16).map(|i| 0x3c00 + i * 0x40).collect();
    // Block (row block a, column block b) of `blk` [4, 6], columns split 1 + 5.
    let block = |a: usize, b: usize| -> Vec<u8> {
        let cols = if b == 0 { 0..1 } else { 1..6 };
        let bits: Vec<u16> = (2 * a..2 * a + 2)
            .flat_map(|i| cols.clone().map(move |j| i * 6 + j))
            .map(|k| blk[k])
            .collect();
        f16_bytes(&bits)
    };
    let blocks: Vec<Vec<u8>> = (0..4).map(|k| block(k / 2, k % 2)).collect();
    let big = vals(203, 4096);
    let block_opts = SaveOptions {
        block_size: 4096,
        ..Default::default()
    };
    let mut descriptors = Vec::new();
    for r in 0..2u32 {
        let ru = r as usize;
        let items = vec![
            PartItem::Chunk {
                tensor: TensorRef::new("blk", DType::F16, &[2, 1], &blocks[2 * ru]),
                global_shape: vec![4, 6],
                offsets: vec![2 * u64::from(r), 0],
            },
            PartItem::Chunk {
                tensor: TensorRef::new("blk", DType::F16, &[2, 5], &blocks[2 * ru + 1]),
                global_shape: vec![4, 6],
                offsets: vec![2 * u64::from(r), 1],
            },
            PartItem::Chunk {
                tensor: TensorRef::from_slice("big", &[1, 2048], &big[ru * 2048..][..2048]),
                global_shape: vec![2, 2048],
                offsets: vec![u64::from(r), 0],
            },
        ];
        descriptors.push(write(&dir, r, &items, &block_opts)?);
    }
    out.push(commit_two_level(&dir, "tlblocks", &descriptors)?);

    let dir = tmp.join("tl1");
    let w1 = vals(204, 6);
    let items = vec![
        PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[3, 2], &w1),
            global_shape: vec![3, 2],
            offsets: vec![0, 0],
        },
        PartItem::Chunk {
            tensor: TensorRef::from_slice("s", &[], &s[..]),
            global_shape: vec![],
            offsets: vec![],
        },
        PartItem::Whole(TensorRef::from_slice("step", &[], &step[..])),
    ];
    let descriptors = vec![write(&dir, 0, &items, &opts)?];
    out.push(commit_two_level(&dir, "tl1", &descriptors)?);

    let dir = tmp.join("tlshards");
    let w4 = vals(205, 16);
    let small = SaveOptions {
        max_shard_size: 16,
        ..Default::default()
    };
    let r0 = vec![
        PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[1, 4], &w4[..4]),
            global_shape: vec![4, 4],
            offsets: vec![0, 0],
        },
        PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[1, 4], &w4[4..8]),
            global_shape: vec![4, 4],
            offsets: vec![1, 0],
        },
    ];
    let r1 = vec![
        PartItem::Chunk {
            tensor: TensorRef::from_slice("w", &[2, 4], &w4[8..]),
            global_shape: vec![4, 4],
            offsets: vec![2, 0],
        },
        PartItem::Whole(TensorRef::new("note", DType::U8, &[3], &[1, 2, 3])),
    ];
    let descriptors = vec![write(&dir, 0, &r0, &small)?, write(&dir, 1, &r1, &opts)?];
    out.push(commit_two_level(&dir, "tlshards", &descriptors)?);
    Ok(out)
}

thread_local! {
    /// Part descriptors written by [`save_all`], the seeds of the `part` target.
    static PART_SEEDS: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A plain safetensors file the writer would not make: no ckptstore metadata, a header
/// not padded to 8, tensors listed out of offset order.
fn foreign_safetensors() -> Vec<u8> {
    let json = br#"{"b":{"dtype":"I16","shape":[2],"data_offsets":[4,8]},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"__metadata__":{"format":"pt"}}"#;
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json);
    v.extend_from_slice(&1.5f32.to_le_bytes());
    v.extend_from_slice(&[1, 0, 0xff, 0xff]);
    v
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Res<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)?;
    Ok(())
}

fn main() -> Res<()> {
    let corpus = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let tmp = tempfile::tempdir()?;
    let saved = save_all(tmp.path())?;

    let (hdr, man, ovl) = (
        corpus.join("header"),
        corpus.join("manifest"),
        corpus.join("open_verify_load"),
    );
    let fetched = corpus.join("fetched");
    let mut counts = [0usize; 3];
    for s in &saved {
        for (i, b) in s.shards.iter().enumerate() {
            write(&hdr, &format!("seed-{}-shard{i}", s.name), b)?;
            counts[0] += 1;
        }
        write(&man, &format!("seed-{}", s.name), &s.manifest)?;
        counts[1] += 1;
        assert!(
            (1..=3).contains(&s.shards.len()),
            "{}: {} shards cannot be framed",
            s.name,
            s.shards.len()
        );
        write(
            &ovl,
            &format!("seed-{}", s.name),
            &frame(0, &s.manifest, &s.shards),
        )?;
        write(
            &ovl,
            &format!("seed-{}-fix", s.name),
            &frame(FIX_ALL, &s.manifest, &s.shards),
        )?;
        // The `fetched` target reads the same framing; the high flag bits pick its chunk.
        for (fix, tag) in [(0u8, ""), (FIX_ALL | 0x80, "-fix")] {
            write(
                &fetched,
                &format!("seed-{}{tag}", s.name),
                &frame(fix, &s.manifest, &s.shards),
            )?;
        }
        counts[2] += 2;
    }
    let part_dir = corpus.join("part");
    let part_seeds = PART_SEEDS.with(|p| p.borrow().clone());
    for (i, b) in part_seeds.iter().enumerate() {
        write(&part_dir, &format!("seed-global-r{i}"), b)?;
    }
    // Upload journals as the writer encodes them, behind the prefix-picking first byte.
    let journal_dir = corpus.join("journal");
    let shard = "shard-0123456789abcdef0123456789abcdef-00000.safetensors";
    for (pick, key) in [(0u8, shard.to_string()), (2, format!("run/a/{shard}"))] {
        let j = ckptstore::format::journal::UploadJournal {
            key,
            upload_id: "2~Zm9vYmFyLWJhemlvbg".into(),
        };
        let mut b = vec![pick];
        b.extend_from_slice(&j.encode());
        write(&journal_dir, &format!("seed-journal-{pick}"), &b)?;
    }
    // Two-level checkpoints: framed for `two_level`, their roots for `manifest`.
    let two_level_dir = corpus.join("two_level");
    let mut two_level_seeds = 0usize;
    for s in save_two_level(tmp.path())? {
        for (tag, data) in two_level_framings(&s) {
            write(&two_level_dir, &format!("seed-{}{tag}", s.name), &data)?;
            two_level_seeds += 1;
        }
        write(&man, &format!("seed-{}", s.name), &s.root)?;
        counts[1] += 1;
    }
    let foreign = foreign_safetensors();
    header::parse(&foreign).map_err(|e| format!("foreign seed: {e}"))?;
    write(&hdr, "seed-foreign", &foreign)?;
    counts[0] += 1;

    println!(
        "gen_seeds: {} header, {} manifest, {} open_verify_load, {} fetched, {} part, {} two_level seeds in {}",
        counts[0],
        counts[1],
        counts[2],
        counts[2],
        part_seeds.len(),
        two_level_seeds,
        corpus.display()
    );
    Ok(())
}
