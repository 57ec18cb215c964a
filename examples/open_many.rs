//! Profile helper: open a checkpoint directory repeatedly, and time the safetensors
//! crate's `SafeTensors::deserialize` over the same mapped shard files for comparison.
//! Run: `cargo run --release --example open_many -- DIR [N] [only]`.
fn main() {
    let dir = std::env::args().nth(1).expect("dir");
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    // A third argument `only` skips the baseline (for profiling the open alone).
    let only = std::env::args().nth(3).is_some_and(|a| a == "only");
    let ck = ckptstore::Checkpoint::open(&dir).unwrap();
    // Interleave the two measures so that machine noise hits both alike.
    let (mut ours, mut theirs) = (f64::INFINITY, f64::INFINITY);
    let (mut ours_sum, mut theirs_sum) = (0.0, 0.0);
    for _ in 0..n {
        let t = std::time::Instant::now();
        std::hint::black_box(ckptstore::Checkpoint::open(&dir).unwrap());
        let a = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        for s in ck.shards().iter().filter(|_| !only) {
            std::hint::black_box(safetensors::SafeTensors::deserialize(s.bytes.as_ref()).unwrap());
        }
        let b = t.elapsed().as_secs_f64() * 1e3;
        ours = ours.min(a);
        theirs = theirs.min(b);
        ours_sum += a;
        theirs_sum += b;
    }
    let nf = n as f64;
    // The manifest decode alone (CRC, parse, validation), from bytes already in memory.
    let path = std::path::Path::new(&dir).join(ckptstore::format::manifest::MANIFEST_FILE);
    if let Ok(bytes) = std::fs::read(path) {
        let mut best = f64::INFINITY;
        for _ in 0..n {
            let t = std::time::Instant::now();
            std::hint::black_box(ckptstore::format::manifest::decode(&bytes).is_ok());
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
        }
        println!("manifest::decode alone: {best:.3} ms min");
    }
    println!(
        "open: {:.3} ms mean, {ours:.3} ms min; safetensors deserialize: {:.3} ms mean, {theirs:.3} ms min; ratio {:.3} (mean) {:.3} (min)",
        ours_sum / nf,
        theirs_sum / nf,
        ours_sum / theirs_sum,
        ours / theirs
    );
}
