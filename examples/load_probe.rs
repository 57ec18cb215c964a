//! Load the optimizer state of a checkpoint into F16-scaled buffers, each time from a newly
//! opened checkpoint (new mappings, as a resuming process sees them): fresh memory, then
//! through a warm BufferPool. For profiling (`perf record`) and first-touch measurements.
//!
//! `cargo run --release --example load_probe -- DIR [REPS]` (make DIR with `ckpt bench --dir`).
fn main() -> ckptstore::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "bench-ckpt".into());
    let reps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let layout = ckptstore::optim::StateLayout::with_default(ckptstore::optim::Target::F16Scaled(
        ckptstore::optim::ScaleShape::One,
    ));
    let pool = ckptstore::optim::BufferPool::new(usize::MAX);
    let bytes: u64 = ckptstore::Checkpoint::open(&dir)?
        .tensors()
        .iter()
        .map(|t| t.nbytes())
        .sum();
    let gib = bytes as f64 / (1u64 << 30) as f64;
    for _ in 0..reps {
        let ck = ckptstore::Checkpoint::open(&dir)?;
        let t = std::time::Instant::now();
        drop(std::hint::black_box(ck.load_optimizer(&layout)?));
        let fresh = t.elapsed().as_secs_f64();
        let ck = ckptstore::Checkpoint::open(&dir)?;
        let t = std::time::Instant::now();
        drop(std::hint::black_box(ck.load_optimizer_opts(
            &layout,
            &ckptstore::optim::LoadOptions::default().pool(&pool),
        )?));
        let pooled = t.elapsed().as_secs_f64();
        println!(
            "new map: fresh {:.3} s ({:.2} GiB/s), pooled {:.3} s ({:.2} GiB/s)",
            fresh,
            gib / fresh,
            pooled,
            gib / pooled
        );
    }
    Ok(())
}
