//! Issue 16: `Checkpoint::fill_and_verify`, the single-pass restore into caller memory.
//! Behaviour only (bytes, errors, order of checks); speed is measured by
//! `python/benches/bench_torch.py --restore`, never here.

#[path = "common/sample.rs"]
mod sample;

use ckptstore::optim::synthetic_state;
use ckptstore::{Checkpoint, Error, SaveOptions};
use sample::{damage_in_file_order, saved, stored};

#[test]
fn fills_are_exact_and_names_and_lengths_are_checked_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let (names, want) = stored(&ck);
    // Half filled, half only verified; released pages read back the same afterwards.
    let mut bufs: Vec<Vec<u8>> = want.iter().map(|w| vec![0xAA; w.len()]).collect();
    let half = names.len() / 2;
    let fills: Vec<(&str, &mut [u8])> = names[..half]
        .iter()
        .map(String::as_str)
        .zip(bufs.iter_mut().map(Vec::as_mut_slice))
        .collect();
    let verify: Vec<&str> = names[half..].iter().map(String::as_str).collect();
    ck.read_batch()
        .fill(fills)
        .check(&verify)
        .release_pages(true)
        .run()
        .unwrap();
    for i in 0..half {
        assert_eq!(bufs[i], want[i], "{}", names[i]);
    }
    for b in &bufs[half..] {
        assert!(
            b.iter().all(|&x| x == 0xAA),
            "a verified tensor was written"
        );
    }
    assert_eq!(stored(&ck).1, want);

    // A short destination or an unknown name anywhere: nothing is written.
    let mut a = vec![0u8; want[0].len()];
    let mut short = vec![0u8; want[1].len() - 1];
    match ck
        .read_batch()
        .fill(vec![
            (names[0].as_str(), &mut a),
            (names[1].as_str(), &mut short),
        ])
        .run()
    {
        Err(Error::InvalidArgument(m)) => assert!(m.contains(&names[1]), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        ck.read_batch()
            .fill(vec![(names[0].as_str(), &mut a)])
            .check(&["nope"])
            .run(),
        Err(Error::TensorNotFound { .. })
    ));
    assert!(a.iter().all(|&x| x == 0));
}

#[test]
fn the_first_damaged_tensor_in_fills_then_verify_order_is_named() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let order = damage_in_file_order(dir.path(), &[1, 3], 5, 0x20);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut b0 = vec![0u8; order[0].nbytes() as usize];
    let mut b3 = vec![0u8; order[3].nbytes() as usize];
    // A damaged fill comes before a damaged verify, whatever the file order.
    match ck
        .read_batch()
        .fill(vec![
            (order[0].name.as_str(), &mut b0),
            (order[3].name.as_str(), &mut b3),
        ])
        .check(&[order[1].name.as_str()])
        .release_pages(true)
        .run()
    {
        Err(Error::ChecksumMismatch { what, .. }) => assert!(what.contains(&order[3].name)),
        other => panic!("{other:?}"),
    }
    match ck
        .read_batch()
        .fill(vec![(order[0].name.as_str(), &mut b0)])
        .check(&[order[2].name.as_str(), order[1].name.as_str()])
        .run()
    {
        Err(Error::ChecksumMismatch { what, .. }) => assert!(what.contains(&order[1].name)),
        other => panic!("{other:?}"),
    }
    ck.read_batch()
        .fill(vec![(order[0].name.as_str(), &mut b0)])
        .check(&[order[2].name.as_str()])
        .run()
        .unwrap();
}

/// Optimizer state of 2.5M FP32 elements (10 MB) per tensor, saved in `dir` and opened:
/// several parallel blocks each, the last one partial.
fn large_states(dir: &std::path::Path) -> Checkpoint {
    let (opt, _) = synthetic_state(2, 2_500_000).unwrap();
    opt.save(dir, &[], &SaveOptions::default()).unwrap();
    Checkpoint::open(dir).unwrap()
}

#[test]
fn tensors_of_many_blocks_fill_copy_and_verify_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = large_states(dir.path());
    let names: Vec<String> = ck.tensors().iter().map(|t| t.name.clone()).collect();
    let big: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| ck.info(n).unwrap().nbytes() > 8 << 20)
        .collect();
    assert!(big.len() >= 2, "{names:?}");
    let want: Vec<Vec<u8>> = big
        .iter()
        .map(|n| ck.read(n).view_unchecked().unwrap().bytes().to_vec())
        .collect();
    for release in [false, true] {
        let mut a = vec![0u8; want[0].len()];
        ck.read_batch()
            .fill(vec![(big[0], &mut a)])
            .check(&big[1..])
            .release_pages(release)
            .run()
            .unwrap();
        assert!(a == want[0]);
        let mut b: Vec<Vec<u8>> = want.iter().map(|w| vec![0u8; w.len()]).collect();
        let pairs: Vec<(&str, &mut [u8])> = big
            .iter()
            .copied()
            .zip(b.iter_mut().map(Vec::as_mut_slice))
            .collect();
        ck.read_batch()
            .fill(pairs)
            .release_pages(release)
            .run_unchecked()
            .unwrap();
        assert!(b == want);
    }
}

#[test]
fn ranges_of_large_tensors_copy_exactly_and_are_checked_before_any_write() {
    // 10 MB states copied in uneven pieces (the way CUDA staging cuts a large tensor).
    let dir = tempfile::tempdir().unwrap();
    let ck = large_states(dir.path());
    let t = ck
        .tensors()
        .iter()
        .find(|t| t.nbytes() > 8 << 20)
        .unwrap()
        .clone();
    let want = ck.read(&t.name).view_unchecked().unwrap().bytes().to_vec();
    let piece = (3 << 20) + 5;
    let mut got = vec![0u8; want.len()];
    let items: Vec<(&str, u64, &mut [u8])> = got
        .chunks_mut(piece)
        .enumerate()
        .map(|(i, d)| (t.name.as_str(), (i * piece) as u64, d))
        .collect();
    ck.read_batch().fill_ranges(items).run_unchecked().unwrap();
    assert!(got == want);

    // One range past the end: refused, and the valid one beside it is not written.
    let mut a = [0u8; 16];
    let mut b = [0u8; 16];
    let e = ck
        .read_batch()
        .fill_ranges(vec![
            (t.name.as_str(), 0, &mut a[..]),
            (t.name.as_str(), want.len() as u64 - 8, &mut b[..]),
        ])
        .run_unchecked()
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(a.iter().all(|&x| x == 0));
    let e = ck
        .read_batch()
        .fill_ranges(vec![("no such tensor", 0, &mut a[..])])
        .run_unchecked()
        .unwrap_err();
    assert!(matches!(e, Error::TensorNotFound { .. }), "{e}");
    let e = ck
        .read_batch()
        .fill_ranges(vec![(t.name.as_str(), u64::MAX, &mut a[..])])
        .run_unchecked()
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}
