//! Streaming load: peak resident memory bounded by the budget, not the checkpoint size.
//! (One test in this file, so the process's peak RSS is this test's.)

#[path = "common/rss.rs"]
mod rss;
use rss::status;

use ckptstore::{Checkpoint, DType, SaveOptions, TensorRef};

#[test]
fn streaming_peak_rss_stays_under_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    // 256 MiB of checkpoint from four 4 MiB buffers referenced 64 times (the CI disk is
    // shared: kept to 16x the budget, the least that shows the bound is not the size).
    let n = 64usize;
    let per = 4usize << 20;
    let bufs: Vec<Vec<u8>> = (0..4).map(|k| vec![k as u8 + 1; per]).collect();
    let names: Vec<String> = (0..n).map(|i| format!("layer{i:02}")).collect();
    let refs: Vec<TensorRef<'_>> = names
        .iter()
        .enumerate()
        .map(|(i, s)| TensorRef::new(s.as_str(), DType::U8, &[per as u64], &bufs[i % 4]))
        .collect();
    ckptstore::save(
        dir.path(),
        &refs,
        &SaveOptions {
            max_shard_size: 64 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    drop(refs);
    drop(bufs);

    let ck = Checkpoint::open(dir.path()).unwrap();
    let total = ck.data_bytes();
    let budget = 16u64 << 20;
    // Reset the peak (VmHWM) to the current RSS, then stream.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let base = status("VmRSS:");
    let mut seen = 0u64;
    let mut sum = 0u64;
    ck.stream_tensors(budget, |t, tensor| {
        assert_eq!(tensor.bytes().len() as u64, t.nbytes());
        sum += tensor.bytes()[0] as u64;
        seen += t.nbytes();
        Ok(()) // the tensor is dropped: a real loop would move it to a device
    })
    .unwrap();
    let peak = status("VmHWM:");
    let grew = peak.saturating_sub(base);
    eprintln!(
        "streamed {} MiB with a {} MiB budget: peak RSS grew by {:.1} MiB",
        total >> 20,
        budget >> 20,
        grew as f64 / (1 << 20) as f64
    );
    assert_eq!(seen, total);
    assert_eq!(sum, (0..n as u64).map(|i| i % 4 + 1).sum::<u64>());
    assert!(total >= 16 * budget);
    assert!(
        grew <= budget,
        "peak RSS grew by {grew} bytes, over the {budget}-byte budget"
    );

    // Without releasing pages, reading everything through the map would have grown RSS by
    // the whole checkpoint: the bound is the release, not luck.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let base = status("VmRSS:");
    let mut x = 0u64;
    for t in ck.tensors() {
        x += ck
            .read(&t.name)
            .view()
            .unwrap()
            .bytes()
            .iter()
            .step_by(4096)
            .map(|&b| b as u64)
            .sum::<u64>();
    }
    let grew_mapped = status("VmHWM:").saturating_sub(base);
    assert!(x > 0);
    assert!(
        grew_mapped > 4 * budget,
        "reading through the map grew RSS by only {grew_mapped}"
    );
}
