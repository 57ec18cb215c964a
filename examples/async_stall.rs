//! Measure the stall a training loop sees inside `save_async` against a blocking save, for
//! 1 GiB of state (or the size in MiB given as the first argument).
use std::time::Instant;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::{SaveOptions, TensorRef};

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(2)).unwrap();
    let n = mib << 18; // f32 elements
    let tensors: Vec<Vec<f32>> = (0..16).map(|k| vec![k as f32; n / 16]).collect();
    let names: Vec<String> = (0..16).map(|k| format!("layer{k}.w")).collect();
    let refs: Vec<TensorRef<'_>> = tensors
        .iter()
        .zip(&names)
        .map(|(t, n)| TensorRef::from_slice(n.as_str(), &[t.len() as u64], t))
        .collect();
    let opts = SaveOptions {
        max_shard_size: 256 << 20,
        ..Default::default()
    };
    // Warm-up save (page cache, allocator).
    mgr.save(1, &refs, None, &opts).unwrap();
    let t = Instant::now();
    mgr.save(2, &refs, None, &opts).unwrap();
    let blocking = t.elapsed().as_secs_f64();
    // First async save allocates its snapshot buffers; later ones reuse them.
    for step in 3..=5 {
        let t = Instant::now();
        let h = mgr.save_async(step, &refs, None, opts.clone()).unwrap();
        let stall = t.elapsed().as_secs_f64();
        h.wait().unwrap();
        let total = t.elapsed().as_secs_f64();
        println!(
            "{mib} MiB, async save #{}: stall in save_async {stall:.3} s = {:.1}% of a blocking save ({blocking:.3} s); save done after {total:.3} s",
            step - 2,
            100.0 * stall / blocking
        );
    }
}
