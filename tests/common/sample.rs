//! A small saved optimizer checkpoint, and byte damage to its tensors by position in file
//! order, and the bytes of every tensor (shared by tests/cold.rs and tests/fill.rs).

use std::path::Path;

use ckptstore::optim::synthetic_state;
use ckptstore::{Checkpoint, SaveOptions, TensorInfo};

/// Save a 6-parameter synthetic Adam state in `dir`, in shards of at most 400 KB.
pub fn saved(dir: &Path) {
    let (opt, _) = synthetic_state(6, 40_000).unwrap();
    let opts = SaveOptions {
        max_shard_size: 400_000,
        ..Default::default()
    };
    opt.save(dir, &[], &opts).unwrap();
}

/// The name of every tensor of `ck`, and its stored bytes (for bit-exact comparisons).
pub fn stored(ck: &Checkpoint) -> (Vec<String>, Vec<Vec<u8>>) {
    let names: Vec<String> = ck.tensors().iter().map(|t| t.name.clone()).collect();
    let bytes = names
        .iter()
        .map(|n| ck.read(n).view_unchecked().unwrap().bytes().to_vec())
        .collect();
    (names, bytes)
}

/// Flip `mask` in byte `at` of each tensor at the positions `picks` of the file order
/// (shard, then offset); each damaged shard is written as a new file of the same name
/// (the old one may still be mapped). Returns the tensors in file order.
pub fn damage_in_file_order(dir: &Path, picks: &[usize], at: u64, mask: u8) -> Vec<TensorInfo> {
    let ck = Checkpoint::open(dir).unwrap();
    let mut order: Vec<TensorInfo> = ck.tensors().to_vec();
    order.sort_by_key(|t| (t.shard, t.offsets[0]));
    let files = ck.shard_paths();
    drop(ck);
    for &i in picks {
        let t = &order[i];
        let p = &files[t.shard];
        let mut b = std::fs::read(p).unwrap();
        b[(t.offsets[0] + at) as usize] ^= mask;
        std::fs::remove_file(p).unwrap();
        std::fs::write(p, &b).unwrap();
    }
    order
}
