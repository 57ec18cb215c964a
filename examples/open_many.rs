//! Profile helper: open a checkpoint directory repeatedly.
fn main() {
    let dir = std::env::args().nth(1).expect("dir");
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let t = std::time::Instant::now();
    for _ in 0..n {
        std::hint::black_box(ckptstore::Checkpoint::open(&dir).unwrap());
    }
    println!(
        "{:.3} ms per open",
        t.elapsed().as_secs_f64() * 1e3 / n as f64
    );
}
