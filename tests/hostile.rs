//! Hostile inputs: saved fuzz regressions replayed through the fuzz targets' entry points,
//! and inputs that declare enormous counts or sizes, which must be refused with a typed
//! error (never a panic) while peak memory stays bounded.
//!
//! All memory-measuring cases run sequentially in ONE test (`huge_counts_bounded_memory`):
//! VmHWM is per process and the test harness runs the tests of a file on parallel threads.
//! The other test here (`replay_fuzz_regressions`) allocates only the regression files
//! themselves (a few KiB) and is not measured.

#[path = "common/rss.rs"]
mod rss;
use rss::status;

// The fuzz crate's helpers (framing, repairs, trailers), so that a regression replays
// exactly as its target saw it.
#[path = "../fuzz/src/lib.rs"]
#[allow(dead_code)]
mod fuzz_support;
use fuzz_support::{append_trailer as with_trailer, fix_up, unframe, with_valid_trailer};

use std::path::{Path, PathBuf};

use ckptstore::format::{header, manifest, MAX_HEADER_SIZE};
use ckptstore::optim::StateLayout;
use ckptstore::{Checkpoint, Error};

// ---------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------

const ID: &str = "0123456789abcdef0123456789abcdef";

/// A shard file: 8-byte length, `json` padded with spaces to a multiple of 8, `data`.
fn shard_file(json: &[u8], data: &[u8]) -> Vec<u8> {
    let mut h = json.to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

/// Run `f` and return its result and the growth of peak RSS (VmHWM) over the RSS at the
/// start. Everything `f` needs must already be allocated by the caller.
fn peak_growth<T>(f: impl FnOnce() -> T) -> (T, u64) {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let base = status("VmRSS:");
    let r = f();
    let grew = status("VmHWM:").saturating_sub(base);
    (r, grew)
}

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------------------------------
// (a) Fuzz regressions
// ---------------------------------------------------------------------------------------

/// `header` target: parse; an accepted header re-emits identically and opens.
fn replay_header(data: &[u8]) {
    if let Ok(h) = header::parse(data) {
        let mut file = header::emit(&h.tensors, &h.metadata);
        file.extend_from_slice(&data[h.data_start() as usize..]);
        let h2 = header::parse(&file).expect("re-emitted header parses");
        assert_eq!(h2.tensors, h.tensors);
        Checkpoint::from_safetensors(PathBuf::from("r.safetensors"), data.to_vec())
            .expect("a header that parses opens");
    }
}

/// `manifest` target: decode as given and with a valid trailer; decode(encode(m)) == m.
fn replay_manifest(data: &[u8]) {
    for bytes in [data.to_vec(), with_valid_trailer(data)] {
        if let Ok(m) = manifest::decode(&bytes) {
            let m2 = manifest::decode(&manifest::encode(&m)).expect("re-encoded decodes");
            assert_eq!(m2, m);
        }
    }
}

/// `open_verify_load` target: from_parts, verify, every tensor, load_optimizer.
fn replay_open(data: &[u8]) {
    let f = unframe(data);
    let shards = f.shards;
    let m = fix_up(f.flags, f.manifest, &shards);
    let owned: Vec<Vec<u8>> = shards.iter().map(|s| s.to_vec()).collect();
    let Ok(ck) = Checkpoint::from_parts(&m, owned) else {
        return;
    };
    let verified = ck.verify().is_ok();
    for t in ck.tensors() {
        let v = ck.read(&t.name).view_unchecked().expect("listed tensor");
        assert_eq!(v.bytes().len() as u64, t.nbytes());
        let tv = ck.read(&t.name).view();
        assert!(
            !verified || tv.is_ok(),
            "verify passed but {:?} fails",
            t.name
        );
    }
    if let Ok(st) = ck.load_optimizer(&StateLayout::default()) {
        st.validate().expect("a loaded state validates");
    }
}

/// Every saved regression, replayed through the entry points of the target its name
/// starts with (`<target>-<name>.bin`); files of other targets (`structured-*`, whose
/// operation sequences need the fuzz crate: `cargo +nightly fuzz run structured FILE`)
/// and unknown files go through all three byte-level entry points, which must not panic.
/// `two_level-*` files go through `check_two_level` in a child process (this test binary
/// run again on that one file), so that one that aborts (a failed allocation) fails this
/// test rather than every test of the file.
#[test]
fn replay_fuzz_regressions() {
    const ONE: &str = "CKPT_REPLAY_TWO_LEVEL";
    if let Some(one) = std::env::var_os(ONE) {
        fuzz_support::check_two_level(&std::fs::read(one).unwrap());
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(rd) => rd
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_file())
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    // The two_level regressions that failed (each reported, then the test fails).
    let mut failed: Vec<String> = Vec::new();
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let data = std::fs::read(f).unwrap();
        eprintln!("replaying {name} ({} bytes)", data.len());
        if name.starts_with("header-") {
            replay_header(&data);
        } else if name.starts_with("manifest-") {
            replay_manifest(&data);
        } else if name.starts_with("open_verify_load-") {
            replay_open(&data);
        } else if name.starts_with("two_level-") {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["replay_fuzz_regressions", "--exact", "--nocapture"])
                .env(ONE, f)
                .output()
                .unwrap();
            if !out.status.success() {
                failed.push(format!(
                    "{name}: check_two_level failed ({}):\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        } else if name.starts_with("part-") {
            // A part target failure is found only past a successful decode: a saved one
            // that no longer decodes tests nothing and must be re-made.
            assert!(
                ckptstore::write::parts::Part::from_bytes(&data).is_ok()
                    || ckptstore::write::parts::Part::from_bytes(&with_valid_trailer(&data))
                        .is_ok(),
                "{name} no longer decodes: it no longer reaches the part check"
            );
            fuzz_support::check_part(&data);
            fuzz_support::check_part(&with_valid_trailer(&data));
        } else if name.starts_with("fetched-") {
            // Resident and fetched shards give the same answers (and replay_open's).
            fuzz_support::check_fetched_like_resident(&data);
            replay_open(&data);
        } else {
            replay_header(&data);
            replay_manifest(&data);
            replay_open(&data);
        }
    }
    // The named hostile inputs below also go through the targets' entry points here, so
    // this test covers them even while the directory is empty.
    for data in [
        small_header_huge_len(),
        header_shape_overflow(),
        small_header_above_cap(),
    ] {
        replay_header(&data);
        replay_open(&data);
    }
    for (m, shards) in [manifest_max_size(), manifest_many_tensors(1000)] {
        replay_manifest(&m);
        let mut framed = vec![8u8 | 16];
        framed.extend_from_slice(&(m.len() as u32).to_le_bytes());
        framed.extend_from_slice(&m);
        framed.extend_from_slice(&shards);
        replay_open(&framed);
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

// ---------------------------------------------------------------------------------------
// (b) Huge counts and sizes
// ---------------------------------------------------------------------------------------

/// A 64-byte shard whose header length prefix is `u64::MAX / 2`.
fn small_header_huge_len() -> Vec<u8> {
    let mut f = (u64::MAX / 2).to_le_bytes().to_vec();
    f.extend_from_slice(&[b'{'; 56]);
    f
}

/// A header whose only tensor's shape multiplies past `u64::MAX` (2^32 * 2^32 * 16).
fn header_shape_overflow() -> Vec<u8> {
    shard_file(
        br#"{"t":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
        &[],
    )
}

/// A 64-byte shard whose length prefix is one above the header cap.
fn small_header_above_cap() -> Vec<u8> {
    let mut f = (MAX_HEADER_SIZE + 1).to_le_bytes().to_vec();
    f.extend_from_slice(&[b'{'; 56]);
    f
}

/// A one-tensor manifest whose `shards[0].size` is `u64::MAX`, and a real 24-byte shard.
fn manifest_max_size() -> (Vec<u8>, Vec<u8>) {
    let shard = shard_file(b"{}", &[7u8; 8]);
    let hcrc = crc32fast::hash(&shard[8..16]);
    let body = format!(
        r#"{{"format":"ckptstore","version":1,"features":[],"checkpoint_id":"{ID}","shards":[{{"file":"s0.safetensors","size":{},"header_size":8,"header_crc32":{hcrc}}}],"tensors":[{{"name":"t","shard":0,"dtype":"U8","shape":[8],"offsets":[16,24],"crc32":{}}}],"metadata":{{}}"#,
        u64::MAX,
        crc32fast::hash(&[7u8; 8]),
    );
    (with_trailer(body.as_bytes()), shard)
}

/// A manifest listing `n` one-byte tensors, all in one shard whose header is `{}`, and
/// that shard (consistent sizes and CRCs: every check of `from_parts` passes; the header
/// does not list the tensors, so `verify` must fail).
fn manifest_many_tensors(n: usize) -> (Vec<u8>, Vec<u8>) {
    use std::fmt::Write;
    let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
    let shard = shard_file(b"{}", &data);
    let hcrc = crc32fast::hash(&shard[8..16]);
    let crcs: Vec<u32> = (0..=255u8).map(|b| crc32fast::hash(&[b])).collect();
    let mut body = String::with_capacity(n * 90 + 512);
    write!(
        body,
        r#"{{"format":"ckptstore","version":1,"features":[],"checkpoint_id":"{ID}","shards":[{{"file":"s0.safetensors","size":{},"header_size":8,"header_crc32":{hcrc}}}],"tensors":["#,
        shard.len()
    )
    .unwrap();
    for i in 0..n {
        if i > 0 {
            body.push(',');
        }
        write!(
            body,
            r#"{{"name":"t{i}","shard":0,"dtype":"U8","shape":[1],"offsets":[{},{}],"crc32":{}}}"#,
            16 + i,
            17 + i,
            crcs[i % 256]
        )
        .unwrap();
    }
    body.push_str(r#"],"metadata":{}"#);
    (with_trailer(body.as_bytes()), shard)
}

fn is_header_err(e: &Error) -> bool {
    matches!(e, Error::InvalidHeader { .. })
}

#[test]
fn huge_counts_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let mut report = Vec::new();
    let mut check = |case: &str, grew: u64, bound: u64| {
        eprintln!(
            "{case}: peak RSS grew by {:.2} MiB (bound {:.0} MiB)",
            grew as f64 / MIB as f64,
            bound as f64 / MIB as f64
        );
        assert!(
            grew <= bound,
            "{case}: peak RSS grew by {grew} bytes, over the {bound}-byte bound"
        );
        report.push((case.to_string(), grew));
    };

    // 1. Header length u64::MAX/2 in a 64-byte file: refused before any allocation.
    let f = small_header_huge_len();
    let path = tmp.path().join("huge-len.safetensors");
    std::fs::write(&path, &f).unwrap();
    let (r, grew) = peak_growth(|| {
        (
            header::parse(&f).map(|_| ()),
            Checkpoint::from_safetensors(PathBuf::from("x.safetensors"), f.clone()).map(|_| ()),
            Checkpoint::open(&path).map(|_| ()),
        )
    });
    let e = r.0.unwrap_err();
    assert!(e.contains("cap"), "{e}");
    assert!(is_header_err(&r.1.unwrap_err()));
    assert!(is_header_err(&r.2.unwrap_err()));
    check("header length u64::MAX/2, 64-byte file", grew, 8 * MIB);

    // 2. Shape product overflow in the header JSON.
    let f = header_shape_overflow();
    let path = tmp.path().join("overflow.safetensors");
    std::fs::write(&path, &f).unwrap();
    let (r, grew) = peak_growth(|| {
        (
            header::parse(&f).map(|_| ()),
            Checkpoint::open(&path).map(|_| ()),
        )
    });
    let e = r.0.unwrap_err();
    assert!(e.contains("overflows"), "{e}");
    assert!(is_header_err(&r.1.unwrap_err()));
    check("header shape product overflow", grew, 8 * MIB);

    // 3. Header length one above the cap: in a 64-byte file, and in a sparse file long
    //    enough to hold it (so the cap, not the file size, is what refuses it; the map is
    //    never touched past the prefix, so RSS must not grow by the header's size).
    let f = small_header_above_cap();
    let path = tmp.path().join("above-cap.safetensors");
    {
        let file = std::fs::File::create(&path).unwrap();
        std::io::Write::write_all(&mut &file, &(MAX_HEADER_SIZE + 1).to_le_bytes()).unwrap();
        file.set_len(8 + MAX_HEADER_SIZE + 1 + 64).unwrap();
    }
    let (r, grew) = peak_growth(|| {
        (
            header::parse(&f).map(|_| ()),
            Checkpoint::open(&path).map(|_| ()),
        )
    });
    assert!(r.0.unwrap_err().contains("cap"));
    let e = r.1.unwrap_err();
    assert!(is_header_err(&e) && e.to_string().contains("cap"), "{e}");
    check(
        "header length MAX_HEADER_SIZE+1 (64-byte and 100 MB sparse file)",
        grew,
        8 * MIB,
    );

    // 4. shards[0].size = u64::MAX: decodes (a number within the format), but the real
    //    24-byte shard must be refused by its size, through from_parts and open alike.
    let (m, shard) = manifest_max_size();
    let dir = tmp.path().join("max-size");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("ckpt-manifest.json"), &m).unwrap();
    std::fs::write(dir.join("s0.safetensors"), &shard).unwrap();
    let (r, grew) = peak_growth(|| {
        (
            manifest::decode(&m).map(|_| ()),
            Checkpoint::from_parts(&m, vec![shard.clone()]).map(|_| ()),
            Checkpoint::open(&dir).map(|_| ()),
        )
    });
    // Either refused at decode, or accepted there and refused against the shard file.
    match r.0 {
        Ok(()) => {}
        Err(manifest::DecodeError::Invalid(_)) => {}
        Err(e) => panic!("shards[0].size = u64::MAX: {e:?}"),
    }
    for e in [r.1.unwrap_err(), r.2.unwrap_err()] {
        assert!(
            matches!(
                e,
                Error::ShardMismatch { .. } | Error::InvalidManifest { .. }
            ),
            "{e:?}"
        );
    }
    check("manifest shards[0].size = u64::MAX", grew, 8 * MIB);

    // 5. One million one-byte tensors in one shard (~80 MB of manifest JSON, within the
    //    1 GiB / 2^24-tensor caps): parsed within a bound proportional to the input,
    //    from_parts succeeds (its checks are all consistent), verify must refuse it with a
    //    typed error because the shard's header lists no tensor.
    let n = 1_000_000;
    let (m, shard) = manifest_many_tensors(n);
    let input = m.len() as u64;
    let ((decoded, verified), grew) = peak_growth(|| {
        let decoded = manifest::decode(&m).map(|d| d.tensors.len());
        let ck = Checkpoint::from_parts(&m, vec![shard.clone()]).expect("consistent parts open");
        assert_eq!(ck.tensors().len(), n);
        let v = ck.verify().map(|_| ());
        (decoded, v)
    });
    assert_eq!(decoded.unwrap(), n);
    let e = verified.unwrap_err();
    assert!(
        matches!(e, Error::InvalidHeader { .. } | Error::ShardMismatch { .. }),
        "{e:?}"
    );
    // The parsed form (name String, shape Vec, offsets, CRC per tensor, plus the name
    // index) is a few times the ~80-byte JSON entry: allow 4x the input plus 64 MiB.
    check(
        &format!(
            "manifest with {n} tensors in one shard ({:.1} MiB JSON)",
            input as f64 / MIB as f64
        ),
        grew,
        4 * input + 64 * MIB,
    );
    drop((m, shard));

    eprintln!("peak RSS growth per case: {report:?}");
}

/// A `ckpt-manifest.json` one byte over the 1 GiB cap (a sparse file): `open` must refuse
/// it with `InvalidManifest` without reading it. Ignored because it currently fails:
/// `read_capped` (src/checkpoint.rs) reads `cap + 1` bytes into a `Vec` before comparing,
/// so the refusal costs 1 GiB of RSS and ~5 s. Run alone (`-- --ignored`) after a fix, so
/// nothing else moves VmHWM.
#[test]
fn manifest_over_cap_is_refused_without_reading_it() {
    let tmp = tempfile::tempdir().unwrap();
    let f = std::fs::File::create(tmp.path().join("ckpt-manifest.json")).unwrap();
    f.set_len(ckptstore::format::MAX_MANIFEST_SIZE + 1).unwrap();
    drop(f);
    let (r, grew) = peak_growth(|| Checkpoint::open(tmp.path()).map(|_| ()));
    let e = r.unwrap_err();
    assert!(matches!(e, Error::InvalidManifest { .. }), "{e:?}");
    eprintln!(
        "manifest over the cap: peak RSS grew by {:.1} MiB",
        grew as f64 / MIB as f64
    );
    assert!(
        grew <= 64 * MIB,
        "refusing an over-cap manifest grew RSS by {grew} bytes"
    );
}

/// User JSON nested deeper than a JSON parser reads would be committed in a manifest that
/// no reader opens (found by tests/python/test_hostile_api.py: a save with 127-level
/// metadata replaced a good checkpoint with one that did not open). Writers refuse it
/// before writing anything; at the limit it commits and opens.
#[test]
fn deeply_nested_metadata_is_refused_before_anything_changes() {
    use ckptstore::format::MAX_JSON_DEPTH;
    fn nested(levels: usize) -> serde_json::Value {
        let mut v = serde_json::json!(1);
        for i in 0..levels {
            v = if i % 2 == 0 {
                serde_json::json!([v])
            } else {
                serde_json::json!({ "k": v })
            };
        }
        v
    }
    let dir = tempfile::tempdir().unwrap();
    let w = [1.0f32, 2.0];
    let t = [ckptstore::TensorRef::from_slice("w", &[2], &w)];
    let at_limit = ckptstore::SaveOptions {
        // The metadata object itself is one level.
        metadata: serde_json::json!({ "deep": nested(MAX_JSON_DEPTH - 1) }),
        ..Default::default()
    };
    ckptstore::save(dir.path(), &t, &at_limit).unwrap();
    let ck = ckptstore::Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.metadata(), &at_limit.metadata);
    drop(ck);
    let before: Vec<(std::ffi::OsString, Vec<u8>)> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    for levels in [MAX_JSON_DEPTH, 127, 1000] {
        let over = ckptstore::SaveOptions {
            metadata: serde_json::json!({ "deep": nested(levels) }),
            ..Default::default()
        };
        match ckptstore::save(dir.path(), &t, &over) {
            Err(ckptstore::Error::InvalidArgument(m)) => {
                assert!(m.contains("nests more than"), "{m}")
            }
            other => panic!("{levels} levels: {other:?}"),
        }
    }
    let mut after: Vec<(std::ffi::OsString, Vec<u8>)> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    let mut before = before;
    before.sort();
    after.sort();
    assert_eq!(before, after, "a refused save changed the directory");
    ckptstore::Checkpoint::open(dir.path())
        .unwrap()
        .verify()
        .unwrap();
}
