//! The two-rank fixture of the multi-rank commit's fault sweeps (tests/crash_commit.rs:
//! crashes at every operation; tests/disk_full_parts.rs: errors at every operation): a
//! checkpoint A saved by one writer, and a checkpoint B of globals split and replicated over
//! two ranks, with what the reader must see of each. Uses the file-system model's
//! `Expected` (tests/common/simfs.rs, the including test's `simfs` module).
#![allow(dead_code)]

use ckptstore::write::parts::chunk_tensor_name;
use ckptstore::{CommitOptions, DType, PartItem, SaveOptions, TensorRef};

use super::simfs::Expected;

pub fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
}

pub type Tensor = (String, DType, Vec<u64>, Vec<u8>);

pub fn tensor(name: &str, dtype: DType, shape: &[u64], seed: u64) -> Tensor {
    let n = shape.iter().product::<u64>() as usize * dtype.size();
    (name.to_string(), dtype, shape.to_vec(), pattern(n, seed))
}

pub fn refs(ts: &[Tensor]) -> Vec<TensorRef<'_>> {
    ts.iter()
        .map(|(n, d, s, b)| TensorRef::new(n.as_str(), *d, s, b))
        .collect()
}

pub fn expected(label: &'static str, tensors: Vec<Tensor>) -> Expected {
    Expected {
        label,
        tensors,
        metadata: serde_json::json!({ "gen": label }),
    }
}

/// Checkpoint A: 2 shards.
pub fn a_tensors() -> Vec<Tensor> {
    vec![
        tensor("t0", DType::F32, &[2500], 1),
        tensor("old_only", DType::I32, &[1000], 2),
    ]
}

/// The tensors of checkpoint B: a global `w` [8, 500] F32 split by rows between the ranks,
/// a global `shared` [100] F32 replicated on both, whole tensors on each rank.
pub struct BData {
    pub w: Vec<u8>,
    pub shared: Vec<u8>,
    pub emb: Tensor,
    pub step: Tensor,
    pub t_r1: Tensor,
}

pub fn b_data() -> BData {
    BData {
        w: pattern(8 * 500 * 4, 21),
        shared: pattern(100 * 4, 22),
        emb: tensor("emb", DType::BF16, &[3000], 23),
        step: tensor("step", DType::I64, &[], 24),
        t_r1: tensor("t_r1", DType::U8, &[5000], 25),
    }
}

pub fn whole(t: &Tensor) -> PartItem<'_> {
    PartItem::Whole(TensorRef::new(t.0.as_str(), t.1, &t.2, &t.3))
}

pub fn w_rows(b: &BData, rank: u32) -> &[u8] {
    &b.w[rank as usize * 8000..][..8000]
}

/// Rank `rank`'s items (2 shards per rank at max_shard_size 10000).
pub fn items(b: &BData, rank: u32) -> Vec<PartItem<'_>> {
    let w = PartItem::Chunk {
        tensor: TensorRef::new("w", DType::F32, &[4, 500], w_rows(b, rank)),
        global_shape: vec![8, 500],
        offsets: vec![4 * u64::from(rank), 0],
    };
    let shared = PartItem::Chunk {
        tensor: TensorRef::new("shared", DType::F32, &[100], &b.shared),
        global_shape: vec![100],
        offsets: vec![0],
    };
    match rank {
        0 => vec![whole(&b.emb), w, shared],
        _ => vec![w, whole(&b.step), whole(&b.t_r1), shared],
    }
}

/// B as the reader sees it: rank 0's stored tensors, then rank 1's, in item order.
pub fn b_expected(b: &BData) -> Expected {
    let chunk = |g: &str, offsets: &[u64], rank: u32, shape: &[u64], bytes: &[u8]| {
        (
            chunk_tensor_name(g, offsets, rank),
            DType::F32,
            shape.to_vec(),
            bytes.to_vec(),
        )
    };
    expected(
        "new",
        vec![
            b.emb.clone(),
            chunk("w", &[0, 0], 0, &[4, 500], w_rows(b, 0)),
            chunk("shared", &[0], 0, &[100], &b.shared),
            chunk("w", &[4, 0], 1, &[4, 500], w_rows(b, 1)),
            b.step.clone(),
            b.t_r1.clone(),
            chunk("shared", &[0], 1, &[100], &b.shared),
        ],
    )
}

pub fn part_opts() -> SaveOptions {
    SaveOptions {
        max_shard_size: 10000,
        ..Default::default()
    }
}

pub fn commit_opts() -> CommitOptions {
    CommitOptions {
        world_size: Some(2),
        metadata: serde_json::json!({ "gen": "new" }),
        ..Default::default()
    }
}
