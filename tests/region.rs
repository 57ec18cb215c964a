//! Region reads of global tensors (format-spec/global.md §Reading regions): any box of a
//! tensor chunked any way, compared element for element with the global tensor the test
//! built, and hostile `globals` refused at open with the rule broken named.
//!
//! The chunked checkpoints here are made independently of the multi-rank writer: the chunks
//! are saved as ordinary tensors, then the manifest is given its `globals` by hand (with a
//! correct CRC), so the reader is checked against the spec, not against the writer.

#[path = "common/manifest_edit.rs"]
mod manifest_edit;

use std::path::Path;

use ckptstore::{save, Checkpoint, DType, Error, SaveOptions, TensorRef};
use proptest::prelude::*;

/// Element `i` (row-major index into the global tensor) as `es` bytes.
fn element(i: u64, es: usize) -> Vec<u8> {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i >> 7);
    x.to_le_bytes()[..es].to_vec()
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Row-major index of `idx` in `shape`.
fn linear(idx: &[u64], shape: &[u64]) -> u64 {
    idx.iter().zip(shape).fold(0, |a, (&i, &n)| a * n + i)
}

/// Every index tuple of the box `[offsets, offsets + shape)`, row-major.
fn box_indices(offsets: &[u64], shape: &[u64]) -> Vec<Vec<u64>> {
    let mut out = vec![vec![]];
    for (&o, &n) in offsets.iter().zip(shape) {
        out = out
            .into_iter()
            .flat_map(|p| {
                (o..o + n).map(move |i| {
                    let mut q = p.clone();
                    q.push(i);
                    q
                })
            })
            .collect();
    }
    out
}

/// The bytes of the box of the global tensor of `gshape`.
fn expected(gshape: &[u64], offsets: &[u64], shape: &[u64], es: usize) -> Vec<u8> {
    box_indices(offsets, shape)
        .iter()
        .flat_map(|idx| element(linear(idx, gshape), es))
        .collect()
}

/// Save global tensor `name` of `gshape` chunked as `chunks` (offsets, shape) into `dir`,
/// with a whole tensor `plain` beside it.
fn save_chunked(dir: &Path, dtype: DType, gshape: &[u64], chunks: &[(Vec<u64>, Vec<u64>)]) {
    save_chunked_with(
        dir,
        dtype,
        gshape,
        chunks,
        SaveOptions::default().block_size,
    )
}

/// [`save_chunked`] with per-block CRCs of `block_size` bytes (0: none).
fn save_chunked_with(
    dir: &Path,
    dtype: DType,
    gshape: &[u64],
    chunks: &[(Vec<u64>, Vec<u64>)],
    block_size: u64,
) {
    let es = dtype.size();
    let datas: Vec<(String, Vec<u8>)> = chunks
        .iter()
        .map(|(o, s)| {
            let name = format!(
                "g@{}",
                o.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
            );
            (name, expected(gshape, o, s, es))
        })
        .collect();
    let plain = vec![7u8; 12];
    let mut refs: Vec<TensorRef<'_>> = datas
        .iter()
        .zip(chunks)
        .map(|((n, d), (_, s))| TensorRef::new(n.as_str(), dtype, s, d))
        .collect();
    refs.push(TensorRef::new("plain", DType::U8, &[3, 4], &plain));
    save(
        dir,
        &refs,
        &SaveOptions {
            max_shard_size: 4096,
            block_size,
            ..Default::default()
        },
    )
    .unwrap();
    manifest_edit::rewrite_manifest(dir, |m| {
        let chunks: Vec<serde_json::Value> = chunks
            .iter()
            .zip(&datas)
            .map(|((o, s), (n, _))| serde_json::json!({"offsets": o, "shape": s, "tensor": n}))
            .collect();
        m["features"] = serde_json::json!(["global"]);
        m["globals"] = serde_json::json!([{
            "name": "g", "dtype": dtype.name(), "global_shape": gshape, "chunks": chunks
        }]);
    });
}

/// Split points of `n` into `k` uneven parts (at least 1 element each).
fn splits(n: u64, cuts: &[u64]) -> Vec<(u64, u64)> {
    let mut c: Vec<u64> = cuts
        .iter()
        .map(|&x| x % n.max(1))
        .filter(|&x| x < n)
        .collect();
    c.push(0);
    c.push(n);
    c.sort_unstable();
    c.dedup();
    c.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
}

/// A grid chunking of `gshape` from per-dimension cut points.
fn grid(gshape: &[u64], cuts: &[Vec<u64>]) -> Vec<(Vec<u64>, Vec<u64>)> {
    let mut out = vec![(vec![], vec![])];
    for (d, &n) in gshape.iter().enumerate() {
        let parts = splits(n, &cuts[d]);
        out = out
            .into_iter()
            .flat_map(|(o, s)| {
                parts.iter().map(move |&(a, l)| {
                    let (mut o, mut s) = (o.clone(), s.clone());
                    o.push(a);
                    s.push(l);
                    (o, s)
                })
            })
            .collect();
    }
    out
}

fn check_regions(ck: &Checkpoint, gshape: &[u64], es: usize, regions: &[(Vec<u64>, Vec<u64>)]) {
    for (o, s) in regions {
        let t = ck.read("g").region(o, s).to_tensor().unwrap();
        assert_eq!(t.shape(), &s[..]);
        assert_eq!(
            t.bytes(),
            &expected(gshape, o, s, es)[..],
            "region {o:?} {s:?}"
        );
    }
}

#[test]
fn row_column_block_and_uneven_chunkings_read_back_exactly() {
    let gshape = [7u64, 10];
    let layouts: Vec<(&str, Vec<Vec<u64>>)> = vec![
        ("one chunk", vec![vec![], vec![]]),
        ("rows", vec![vec![3, 5], vec![]]),
        ("columns", vec![vec![], vec![2, 7]]),
        ("blocks", vec![vec![3], vec![4]]),
        ("uneven blocks", vec![vec![0, 5], vec![0, 2, 8]]),
    ];
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F64,
        DType::I64,
        DType::U8,
    ] {
        for (what, cuts) in &layouts {
            let dir = tempfile::tempdir().unwrap();
            let chunks = grid(&gshape, cuts);
            save_chunked(dir.path(), dtype, &gshape, &chunks);
            let ck = Checkpoint::open(dir.path()).unwrap();
            ck.verify().unwrap();
            assert_eq!(
                ck.catalog().chunks("g").unwrap().len(),
                chunks.len(),
                "{what}"
            );
            let es = dtype.size();
            // Whole, each row, each column, a block across every chunk edge, one element.
            let mut regions = vec![
                (vec![0, 0], vec![7, 10]),
                (vec![2, 1], vec![4, 8]),
                (vec![6, 9], vec![1, 1]),
            ];
            regions.extend((0..7).map(|r| (vec![r, 0], vec![1, 10])));
            regions.extend((0..10).map(|c| (vec![0, c], vec![7, 1])));
            check_regions(&ck, &gshape, es, &regions);
            assert_eq!(
                ck.read("g").to_tensor().unwrap().bytes(),
                &expected(&gshape, &[0, 0], &gshape, es)[..]
            );
            // A whole tensor reads by region too.
            let p = ck
                .read("plain")
                .region(&[1, 1], &[2, 2])
                .to_tensor()
                .unwrap();
            assert_eq!(p.bytes(), &[7u8; 4]);
        }
    }
}

#[test]
fn zero_dim_and_one_element_globals() {
    for gshape in [vec![], vec![1u64], vec![1, 1, 1]] {
        let dir = tempfile::tempdir().unwrap();
        let chunk = (vec![0; gshape.len()], gshape.clone());
        save_chunked(dir.path(), DType::F32, &gshape, &[chunk]);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let t = ck.read("g").to_tensor().unwrap();
        assert_eq!(t.shape(), &gshape[..]);
        assert_eq!(t.bytes(), &element(0, 4)[..]);
    }
}

#[test]
fn bad_regions_and_damaged_chunks_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let gshape = [6u64, 4];
    save_chunked(
        dir.path(),
        DType::F32,
        &gshape,
        &grid(&gshape, &[vec![3], vec![]]),
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    for (o, s, want) in [
        (vec![0u64], vec![1u64], "rank 2"),
        (vec![5, 0], vec![2, 4], "out of bounds"),
        (vec![u64::MAX, 0], vec![2, 4], "out of bounds"),
    ] {
        let e = ck.read("g").region(&o, &s).to_tensor().unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(want),
            "{e}"
        );
    }
    assert!(matches!(
        ck.read("nope").region(&[], &[]).to_tensor(),
        Err(Error::TensorNotFound { .. })
    ));
    // Flip one byte of the second chunk: a region touching only the first still reads, one
    // touching the second fails naming the chunk's tensor.
    let t = ck.info("g@3,0").unwrap().clone();
    let path = dir.path().join(&ck.shards()[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[t.offsets[0] as usize + 5] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    ck.read("g").region(&[0, 0], &[3, 4]).to_tensor().unwrap();
    let e = ck
        .read("g")
        .region(&[2, 0], &[2, 4])
        .to_tensor()
        .unwrap_err();
    assert!(
        matches!(e, Error::ChecksumMismatch { .. }) && e.to_string().contains("g@3,0"),
        "{e}"
    );
    // The bytes read for a region are whole chunks: reported, not hidden.
    assert_eq!(
        ck.read("g")
            .region(&[2, 0], &[2, 4])
            .plan()
            .unwrap()
            .bytes_read(),
        2 * 3 * 4 * 4
    );
}

#[test]
fn hostile_globals_are_refused_at_open() {
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "gap",
            |m| m["globals"][0]["global_shape"] = serde_json::json!([7, 4]),
            "a gap",
        ),
        (
            "overlap",
            |m| m["globals"][0]["chunks"][1]["offsets"] = serde_json::json!([2, 0]),
            "overlap",
        ),
        (
            "overlap inside",
            |m| {
                m["globals"][0]["global_shape"] = serde_json::json!([6, 8]);
                m["globals"][0]["chunks"][1]["offsets"] = serde_json::json!([2, 4]);
            },
            "a gap",
        ),
        (
            "out of bounds",
            |m| m["globals"][0]["chunks"][1]["offsets"] = serde_json::json!([3, 1]),
            "outside",
        ),
        (
            "wrong dtype",
            |m| m["globals"][0]["dtype"] = "I32".into(),
            "the chunk needs",
        ),
        (
            "wrong rank",
            |m| m["globals"][0]["chunks"][0]["offsets"] = serde_json::json!([0]),
            "global rank",
        ),
        (
            "missing chunk tensor",
            |m| m["globals"][0]["chunks"][0]["tensor"] = "zz".into(),
            "does not list",
        ),
        (
            "chunk used twice",
            |m| m["globals"][0]["chunks"][1]["tensor"] = "g@0,0".into(),
            "tensor \"g@0,0\" is",
        ),
        (
            "name clash",
            |m| m["globals"][0]["name"] = "plain".into(),
            "also a tensor",
        ),
        (
            "no feature",
            |m| m["features"] = serde_json::json!([]),
            "must come together",
        ),
        (
            "empty globals",
            |m| m["globals"] = serde_json::json!([]),
            "must come together",
        ),
        (
            "replica differs",
            |m| m["globals"][0]["chunks"][0]["replicas"] = serde_json::json!(["g@3,0"]),
            "the copies differ",
        ),
    ];
    for (what, edit, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let gshape = [6u64, 4];
        save_chunked(
            dir.path(),
            DType::F32,
            &gshape,
            &grid(&gshape, &[vec![3], vec![]]),
        );
        manifest_edit::rewrite_manifest(dir.path(), edit);
        let e = Checkpoint::open(dir.path()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidManifest { .. }) && e.to_string().contains(want),
            "{what}: {want:?} not in {e}"
        );
    }
}

/// A box inside `gshape` from random picks: offset `a mod n` and a non-empty extent that
/// fits, per dimension.
fn pick_box(gshape: &[u64], picks: &[(u64, u64)]) -> (Vec<u64>, Vec<u64>) {
    gshape
        .iter()
        .zip(picks)
        .map(|(&n, &(a, b))| {
            let o = a % n;
            (o, 1 + b % (n - o))
        })
        .unzip()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random global shapes (rank 0-3), random grid chunkings and random regions: every
    /// region equals the slice of the global tensor, element for element.
    #[test]
    fn random_regions_of_random_chunkings(
        gshape in proptest::collection::vec(1u64..7, 0..4),
        cuts in proptest::collection::vec(proptest::collection::vec(0u64..8, 0..3), 3),
        picks in proptest::collection::vec((0u64..64, 0u64..64), 3),
        es in prop_oneof![Just(DType::U8), Just(DType::BF16), Just(DType::F32), Just(DType::I64)],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let chunks = grid(&gshape, &cuts);
        save_chunked(dir.path(), es, &gshape, &chunks);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let (o, s) = pick_box(&gshape, &picks);
        let t = ck.read("g").region(&o, &s).to_tensor().unwrap();
        prop_assert_eq!(t.bytes(), &expected(&gshape, &o, &s, es.size())[..]);
        prop_assert_eq!(numel(&s) * es.size() as u64, t.bytes().len() as u64);
        let mut filled = vec![0x5au8; t.bytes().len()];
        ck.read("g").region(&o, &s).fused(true).into(&mut filled).unwrap();
        prop_assert_eq!(&filled[..], t.bytes());
    }

    /// The fused read (each block checked as it is copied) of chunks with 4 KiB block
    /// CRCs: random boxes equal the plain read byte for byte, whether the box is whole
    /// rows (one run per piece, split at blocks) or many short runs (checked first).
    #[test]
    fn fused_fill_equals_the_checked_read_over_blocks(
        gshape in proptest::collection::vec(1u64..48, 1..4),
        cuts in proptest::collection::vec(proptest::collection::vec(0u64..48, 0..3), 3),
        picks in proptest::collection::vec((0u64..64, 0u64..64), 3),
        es in prop_oneof![Just(DType::U8), Just(DType::F32), Just(DType::I64)],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let chunks = grid(&gshape, &cuts);
        save_chunked_with(dir.path(), es, &gshape, &chunks, 4096);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let (o, s) = pick_box(&gshape, &picks);
        let want = expected(&gshape, &o, &s, es.size());
        let mut filled = vec![0xa5u8; want.len()];
        ck.read("g").region(&o, &s).fused(true).into(&mut filled).unwrap();
        prop_assert_eq!(&filled, &want);
        let mut whole = vec![0u8; (numel(&gshape) * es.size() as u64) as usize];
        ck.read("g").region(&vec![0; gshape.len()], &gshape).fused(true).into(&mut whole).unwrap();
        prop_assert_eq!(whole, expected(&gshape, &vec![0; gshape.len()], &gshape, es.size()));
    }
}

#[test]
fn cli_inspect_shows_globals_and_verify_checks_every_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let gshape = [6u64, 4];
    let chunks = grid(&gshape, &[vec![3], vec![1]]);
    save_chunked(dir.path(), DType::F32, &gshape, &chunks);
    let ckpt = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(args)
            .output()
            .unwrap()
    };
    let p = dir.path().to_str().unwrap();
    let o = ckpt(&["inspect", "--json", p]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let g = &v["globals"][0];
    assert_eq!(g["name"], "g");
    assert_eq!(g["global_shape"], serde_json::json!([6, 4]));
    let got: Vec<(serde_json::Value, serde_json::Value)> = g["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert!(c["crc32"].is_u64() && c["shard"].is_u64(), "{c}");
            (c["offsets"].clone(), c["shape"].clone())
        })
        .collect();
    let want: Vec<_> = chunks
        .iter()
        .map(|(o, s)| (serde_json::json!(o), serde_json::json!(s)))
        .collect();
    assert_eq!(got, want);
    let text = String::from_utf8_lossy(&ckpt(&["inspect", p]).stdout).to_string();
    assert!(text.contains("g  F32  [6, 4]  4 chunk(s)"), "{text}");
    assert_eq!(ckpt(&["verify", p]).status.code(), Some(0));
    // One flipped byte in one chunk: verify fails naming that chunk's tensor.
    let ck = Checkpoint::open(dir.path()).unwrap();
    let t = ck.info("g@3,1").unwrap().clone();
    let path = dir.path().join(&ck.shards()[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[t.offsets[1] as usize - 1] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let o = ckpt(&["verify", p]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout);
    assert!(err.contains("g@3,1"), "{err}");
}

/// Per-block CRCs (format-spec/integrity.md §Block CRCs): a region read checks and reads
/// only the blocks it touches; damage is found in the block it hits, by region reads that
/// touch it and by verify; block lists that do not fit are refused at open.
#[test]
fn block_crcs_check_only_the_blocks_a_region_touches() {
    let dir = tempfile::tempdir().unwrap();
    // 64 x 256 F32 rows of 1 KiB; chunks of 24, 16 and 24 rows; 4 KiB blocks = 4 rows.
    let gshape = [64u64, 256];
    let chunks = grid(&gshape, &[vec![24, 40], vec![]]);
    save_chunked_with(dir.path(), DType::F32, &gshape, &chunks, 4096);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let bl = ck
        .info("g@0,0")
        .unwrap()
        .blocks
        .clone()
        .expect("block CRCs recorded");
    assert_eq!((bl.size, bl.crc32.len()), (4096, 6));
    assert!(
        ck.info("plain").unwrap().blocks.is_none(),
        "one block: none"
    );
    ck.verify().unwrap();
    let regions: Vec<(Vec<u64>, Vec<u64>)> = vec![
        (vec![0, 0], vec![64, 256]),
        (vec![5, 3], vec![30, 200]),
        (vec![23, 255], vec![2, 1]),
        (vec![4, 0], vec![16, 256]),
    ];
    check_regions(&ck, &gshape, 4, &regions);
    // Aligned rows read exactly their bytes; unaligned ones at most a block per edge;
    // half rows touch every block of the rows they span.
    let read = |o: [u64; 2], s: [u64; 2]| ck.read("g").region(&o, &s).plan().unwrap().bytes_read();
    assert_eq!(read([4, 0], [16, 256]), 16 * 1024);
    assert_eq!(read([5, 0], [16, 256]), 20 * 1024);
    assert_eq!(read([20, 0], [8, 256]), 8 * 1024);
    assert_eq!(read([0, 0], [24, 128]), 24 * 1024);
    assert_eq!(read([0, 0], [64, 256]), 64 * 1024);
    // Damage block 3 of the first chunk (rows 12..16).
    let t = ck.info("g@0,0").unwrap().clone();
    let path = dir.path().join(&ck.shards()[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[t.offsets[0] as usize + 3 * 4096 + 17] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    check_regions(
        &ck,
        &gshape,
        4,
        &[(vec![0, 0], vec![12, 256]), (vec![16, 0], vec![48, 256])],
    );
    // The fused read checks each block as it copies it: a damaged block fails the read,
    // named like the checked read's; rows that avoid it fill exactly. Whole rows are one
    // run per chunk (split at blocks), a column is many short runs (checked first).
    for (o, s) in [([8u64, 0u64], [8u64, 256u64]), ([0, 5], [64, 1])] {
        let mut out = vec![0u8; (s[0] * s[1] * 4) as usize];
        let e = ck
            .read("g")
            .region(&o, &s)
            .fused(true)
            .into(&mut out)
            .unwrap_err();
        assert!(
            matches!(e, Error::ChecksumMismatch { .. })
                && e.to_string().contains("g@0,0")
                && e.to_string().contains("block 3"),
            "{e}"
        );
    }
    for (o, s) in [
        ([16u64, 0u64], [48u64, 256u64]),
        ([0, 0], [12, 256]),
        ([16, 9], [40, 1]),
    ] {
        let mut out = vec![0u8; (s[0] * s[1] * 4) as usize];
        ck.read("g")
            .region(&o, &s)
            .fused(true)
            .into(&mut out)
            .unwrap();
        assert_eq!(out, expected(&gshape, &o, &s, 4), "{o:?} {s:?}");
    }
    // Into a caller's buffer: nothing is written when a block is bad; the unchecked copy
    // (for callers that verified first) copies what is there; a wrong size is refused.
    let mut out = vec![0xaau8; 4 * 9 * 4];
    assert!(ck
        .read("g")
        .region(&[10, 7], &[4, 9])
        .into(&mut out)
        .is_err());
    assert!(out.iter().all(|&b| b == 0xaa));
    ck.read("g")
        .region(&[10, 7], &[4, 9])
        .into_unchecked(&mut out)
        .unwrap();
    assert!(ck.read("g").region(&[10, 7], &[4, 9]).verify().is_err());
    ck.read("g").region(&[0, 0], &[12, 256]).verify().unwrap();
    let e = ck
        .read("g")
        .region(&[0, 0], &[2, 2])
        .into(&mut out)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let mut good = vec![0u8; 12 * 256 * 4];
    ck.read("g")
        .region(&[0, 0], &[12, 256])
        .into(&mut good)
        .unwrap();
    assert_eq!(good, expected(&gshape, &[0, 0], &[12, 256], 4));
    // The byte ranges a read uses: the touched blocks, merged, absolute in the shard.
    let base = t.offsets[0];
    assert_eq!(
        ck.read("g")
            .region(&[5, 0], &[16, 256])
            .plan()
            .unwrap()
            .shard_ranges,
        vec![(t.shard, base + 4096, base + 24 * 1024)]
    );
    for e in [
        ck.read("g")
            .region(&[10, 7], &[4, 9])
            .to_tensor()
            .unwrap_err(),
        ck.verify().unwrap_err(),
    ] {
        assert!(
            matches!(e, Error::ChecksumMismatch { .. })
                && e.to_string().contains("g@0,0")
                && e.to_string().contains("block 3"),
            "{e}"
        );
    }
    drop(ck);
    bytes[t.offsets[0] as usize + 3 * 4096 + 17] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    Checkpoint::open(dir.path()).unwrap().verify().unwrap();

    // A block list that lies about a block the data still matches as a whole: the region
    // read that touches it and verify refuse it.
    let lie = tempfile::tempdir().unwrap();
    save_chunked_with(lie.path(), DType::F32, &gshape, &chunks, 4096);
    manifest_edit::rewrite_manifest(lie.path(), |m| {
        let t = m["tensors"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|t| t["name"] == "g@0,0")
            .unwrap();
        let c = t["blocks"]["crc32"][1].as_u64().unwrap();
        t["blocks"]["crc32"][1] = (c ^ 1).into();
    });
    let ck = Checkpoint::open(lie.path()).unwrap();
    ck.read("g")
        .region(&[8, 0], &[16, 256])
        .to_tensor()
        .unwrap();
    for e in [
        ck.read("g")
            .region(&[4, 0], &[1, 1])
            .to_tensor()
            .unwrap_err(),
        ck.verify().unwrap_err(),
    ] {
        assert!(
            matches!(e, Error::ChecksumMismatch { .. }) && e.to_string().contains("block 1"),
            "{e}"
        );
    }

    // Block lists that do not fit the tensor are refused at open (M18).
    for (size, count, want) in [
        (1000u64, 6usize, "power of two"),
        (4096, 5, "want 6"),
        (1 << 31, 1, "power of two"),
        (32768, 1, "at least 2"),
    ] {
        let bad = tempfile::tempdir().unwrap();
        save_chunked_with(bad.path(), DType::F32, &gshape, &chunks, 4096);
        manifest_edit::rewrite_manifest(bad.path(), |m| {
            let t = &mut m["tensors"][0];
            t["blocks"] = serde_json::json!({"size": size, "crc32": vec![0u32; count]});
        });
        let e = Checkpoint::open(bad.path()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidManifest { .. }) && e.to_string().contains(want),
            "{size} {count}: {e}"
        );
    }
}

#[test]
fn verify_given_checks_bytes_received_elsewhere_against_one_stored_chunk() {
    let dir = tempfile::tempdir().unwrap();
    // Chunks of 24, 16 and 24 rows of 1 KiB; 4 KiB blocks: the first chunk has 6.
    let gshape = [64u64, 256];
    let chunks = grid(&gshape, &[vec![24, 40], vec![]]);
    save_chunked_with(dir.path(), DType::F32, &gshape, &chunks, 4096);
    let ck = Checkpoint::open(dir.path()).unwrap();
    for (o, s) in &chunks {
        let mut bytes = expected(&gshape, o, s, 4);
        ck.read("g").region(o, s).verify_given(&bytes).unwrap();
        // One flipped bit anywhere: the block holding it is named.
        let at = bytes.len() - 5;
        bytes[at] ^= 0x04;
        let e = ck.read("g").region(o, s).verify_given(&bytes).unwrap_err();
        let last = (at as u64) / 4096;
        assert!(
            matches!(e, Error::ChecksumMismatch { .. })
                && e.to_string().contains(&format!("block {last}")),
            "{e}"
        );
    }
    // A whole tensor without block CRCs: its one CRC32.
    let plain = ck.read("plain").to_tensor().unwrap();
    let mut bytes = plain.bytes().to_vec();
    ck.read("plain").verify_given(&bytes).unwrap();
    bytes[0] ^= 1;
    let e = ck.read("plain").verify_given(&bytes).unwrap_err();
    assert!(matches!(e, Error::ChecksumMismatch { .. }), "{e}");
    // Only one whole stored chunk, of its exact size: anything else is refused, not judged.
    let first = expected(&gshape, &[0, 0], &[24, 256], 4);
    for (o, s, n) in [
        ([0u64, 0u64], [16u64, 256u64], 16 * 1024),
        ([0, 0], [40, 256], 40 * 1024),
        ([0, 0], [24, 128], 24 * 512),
    ] {
        let e = ck
            .read("g")
            .region(&o, &s)
            .verify_given(&first[..n.min(first.len())])
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{o:?} {s:?}: {e}");
    }
    let e = ck
        .read("g")
        .region(&[0, 0], &[24, 256])
        .verify_given(&first[..first.len() - 4])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = ck.read("g").at(0).verify_given(&first).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}
