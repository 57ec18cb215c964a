//! Profile helper: write a checkpoint of N small tensors.
fn main() {
    let dir = std::env::args().nth(1).expect("dir");
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let buf = vec![0u8; 8192];
    let names: Vec<String> = (0..n)
        .map(|i| format!("model.layers.{}.block.{}.weight", i / 16, i % 16))
        .collect();
    let refs: Vec<_> = names
        .iter()
        .map(|s| ckptstore::TensorRef::new(s.as_str(), ckptstore::DType::F32, &[2048], &buf))
        .collect();
    ckptstore::save(&dir, &refs, &ckptstore::SaveOptions::default()).unwrap();
}
