//! Profile helper: load the optimizer state of a checkpoint into F16-scaled buffers, repeatedly.
fn main() {
    let dir = std::env::args().nth(1).expect("dir");
    let ck = ckptstore::Checkpoint::open(&dir).unwrap();
    let layout = ckptstore::optim::StateLayout::default().state(
        "exp_avg",
        ckptstore::optim::Target::F16Scaled(ckptstore::optim::ScaleShape::One),
    );
    for _ in 0..5 {
        let t = std::time::Instant::now();
        std::hint::black_box(ck.load_optimizer(&layout).unwrap());
        println!("{:.3} s", t.elapsed().as_secs_f64());
    }
}
