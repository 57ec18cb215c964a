//! Issue 16: the cold-read helpers and the restore paths that release mapped pages.
//! Behaviour only (bytes, errors); speed is measured by `ckpt bench --cold`, never here.

use ckptstore::checkpoint::{
    cached_pages, drop_page_cache, read_strategy, set_read_strategy, ReadStrategy,
};
#[path = "common/sample.rs"]
mod sample;

use ckptstore::optim::{ScaleShape, StateLayout, Target};
use ckptstore::{Checkpoint, Error};
use sample::{damage_in_file_order, saved, stored};

fn layouts() -> Vec<StateLayout> {
    vec![
        StateLayout::default(),
        StateLayout::default().state("exp_avg", Target::F16Scaled(ScaleShape::One)),
        StateLayout::default().state("exp_avg", Target::BF16),
        StateLayout::with_default(Target::F32),
    ]
}

#[test]
fn every_read_strategy_and_releasing_load_give_identical_state() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(ck.shards().len() > 1, "the test wants several shards");
    let default = read_strategy();
    for layout in layouts() {
        let want = ck.load_optimizer(&layout).unwrap();
        for s in [
            ReadStrategy::Faults,
            ReadStrategy::WillNeed,
            ReadStrategy::WillNeedInOrder,
            ReadStrategy::Stream,
        ] {
            set_read_strategy(s);
            // From a new map each time, after dropping the files from the page cache (a
            // no-op where the system keeps them, e.g. tmpfs: the bytes are the same).
            for p in ck.shard_paths() {
                drop_page_cache(&p).unwrap();
            }
            let fresh = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(fresh.load_optimizer(&layout).unwrap(), want, "{s:?}");
            assert_eq!(
                fresh
                    .load_optimizer_opts(
                        &layout,
                        &ckptstore::optim::LoadOptions::default().release_pages(true)
                    )
                    .unwrap(),
                want,
                "{s:?}"
            );
            // Released pages are mapped again by the next load.
            assert_eq!(
                fresh
                    .load_optimizer_opts(
                        &layout,
                        &ckptstore::optim::LoadOptions::default().release_pages(true)
                    )
                    .unwrap(),
                want,
                "{s:?}"
            );
        }
    }
    set_read_strategy(default);
}

#[test]
fn every_read_strategy_reports_a_damaged_tensor() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    // Damage one byte of the last tensor in file order.
    let n = Checkpoint::open(dir.path()).unwrap().tensors().len();
    let t = damage_in_file_order(dir.path(), &[n - 1], 0, 0x40).swap_remove(n - 1);
    let default = read_strategy();
    for s in [
        ReadStrategy::Faults,
        ReadStrategy::WillNeed,
        ReadStrategy::WillNeedInOrder,
        ReadStrategy::Stream,
    ] {
        set_read_strategy(s);
        for layout in layouts() {
            let ck = Checkpoint::open(dir.path()).unwrap();
            for p in ck.shard_paths() {
                drop_page_cache(&p).unwrap();
            }
            match ck.load_optimizer(&layout) {
                Err(Error::ChecksumMismatch { what, .. }) => {
                    assert_eq!(what, format!("tensor {:?}", t.name), "{s:?}")
                }
                other => panic!("{s:?}: expected a checksum mismatch, got {other:?}"),
            }
        }
    }
    set_read_strategy(default);
}

#[test]
fn cache_helpers_report_pages_and_name_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    for p in ck.shard_paths() {
        let len = std::fs::metadata(&p).unwrap().len() as usize;
        drop_page_cache(&p).unwrap();
        if let Some((cached, total)) = cached_pages(&p).unwrap() {
            assert_eq!(total, len.div_ceil(4096));
            assert!(cached <= total);
        }
    }
    let missing = dir.path().join("no-such-shard.safetensors");
    match drop_page_cache(&missing) {
        Err(Error::Io { path, .. }) => assert_eq!(path, missing),
        other => panic!("{other:?}"),
    }
    assert!(matches!(cached_pages(&missing), Err(Error::Io { .. })));
}

#[test]
fn verify_tensors_and_copy_into_check_names_lengths_and_crcs() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let names: Vec<String> = ck.tensors().iter().map(|t| t.name.clone()).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    ck.verify_opts(
        &ckptstore::checkpoint::VerifyOptions::default()
            .tensors(&refs)
            .release_pages(true),
    )
    .map(drop)
    .unwrap();
    ck.verify_opts(&ckptstore::checkpoint::VerifyOptions::default().tensors(&refs))
        .map(drop)
        .unwrap();
    assert!(matches!(
        ck.verify_opts(
            &ckptstore::checkpoint::VerifyOptions::default()
                .tensors(&["nope"])
                .release_pages(true)
        )
        .map(drop),
        Err(Error::TensorNotFound { .. })
    ));
    // Copies are exact, also after the pages were released.
    for t in ck.tensors() {
        let want = ck.read(&t.name).view_unchecked().unwrap().bytes().to_vec();
        let mut got = vec![0xAAu8; want.len()];
        ck.read(&t.name)
            .release_pages(true)
            .into_unchecked(&mut got)
            .unwrap();
        assert_eq!(got, want, "{}", t.name);
        let mut short = vec![0u8; want.len() - 1];
        assert!(matches!(
            ck.read(&t.name).into_unchecked(&mut short),
            Err(Error::InvalidArgument(_))
        ));
        assert!(
            short.iter().all(|&b| b == 0),
            "nothing written on a length error"
        );
    }
    drop(ck);

    // Damage one byte of the third tensor in file order, and one of the fifth: the error
    // names the first damaged tensor in `names` order.
    let order = damage_in_file_order(dir.path(), &[2, 4], 7, 0x10);
    let ck = Checkpoint::open(dir.path()).unwrap();
    for (names, want) in [
        (
            vec![
                order[0].name.as_str(),
                order[4].name.as_str(),
                order[2].name.as_str(),
            ],
            &order[4],
        ),
        (
            vec![order[2].name.as_str(), order[4].name.as_str()],
            &order[2],
        ),
    ] {
        match ck
            .verify_opts(
                &ckptstore::checkpoint::VerifyOptions::default()
                    .tensors(&names)
                    .release_pages(true),
            )
            .map(drop)
        {
            Err(Error::ChecksumMismatch { what, shard, .. }) => {
                assert_eq!(what, format!("tensor {:?}", want.name));
                assert_eq!(shard, want.shard);
            }
            other => panic!("{other:?}"),
        }
    }
    ck.verify_opts(
        &ckptstore::checkpoint::VerifyOptions::default()
            .tensors(&[order[0].name.as_str(), order[1].name.as_str()])
            .release_pages(true),
    )
    .map(drop)
    .unwrap();
    assert!(matches!(
        ck.load_optimizer_opts(
            &StateLayout::default(),
            &ckptstore::optim::LoadOptions::default().release_pages(true)
        ),
        Err(Error::ChecksumMismatch { .. })
    ));
}

#[test]
fn cold_fills_into_fresh_and_written_memory_are_exact_and_damage_is_named() {
    let dir = tempfile::tempdir().unwrap();
    saved(dir.path());
    let ck = Checkpoint::open(dir.path()).unwrap();
    let (names, want) = stored(&ck);
    drop(ck);
    // From a new map over evicted files (cold where the file system drops pages; elsewhere
    // the same bytes hot), into fresh zeroed memory and into memory already written.
    let fill = |fill_byte: u8| {
        let ck = Checkpoint::open(dir.path()).unwrap();
        for p in ck.shard_paths() {
            drop_page_cache(&p).unwrap();
        }
        let mut bufs: Vec<Vec<u8>> = want.iter().map(|w| vec![fill_byte; w.len()]).collect();
        let fills: Vec<(&str, &mut [u8])> = names
            .iter()
            .map(String::as_str)
            .zip(bufs.iter_mut().map(Vec::as_mut_slice))
            .collect();
        ck.read_batch()
            .fill(fills)
            .release_pages(true)
            .run()
            .map(|()| bufs)
    };
    for fill_byte in [0u8, 0xAA] {
        assert_eq!(fill(fill_byte).unwrap(), want, "memory {fill_byte:#x}");
    }
    // One damaged byte in the second tensor in file order: the cold fill names it.
    let t = damage_in_file_order(dir.path(), &[1], 3, 0x01).swap_remove(1);
    match fill(0) {
        Err(Error::ChecksumMismatch { what, .. }) => {
            assert_eq!(what, format!("tensor {:?}", t.name))
        }
        other => panic!("expected a checksum mismatch, got {:?}", other.map(|_| ())),
    }
}
