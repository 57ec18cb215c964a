//! The checkpoint manifest: encoding with its CRC trailer, decoding and validation
//! (format-spec/manifest.md); its serde types are in [`super::schema`] (re-exported here).

pub use super::schema::{
    BlockCrcs, Encoding, GroupEntry, Manifest, OptimizerSection, ParamEntry, ShardEntry,
    StateEntry, TensorInfo,
};
use super::{check_tensor_name, MAX_MANIFEST_SIZE, MAX_RANK, MAX_SHARDS, MAX_TENSORS};
use serde::Deserialize;

use crate::dtype::checked_nbytes;

mod fast;

/// File name of the manifest inside a checkpoint directory (format-spec/manifest.md §File).
pub const MANIFEST_FILE: &str = "ckpt-manifest.json";
/// Value of the manifest's `format` field.
pub const FORMAT_NAME: &str = "ckptstore";
/// The manifest version this build writes and the newest it reads.
pub const VERSION: u64 = 1;
/// Features (`features` field) this build understands. A manifest that requires any
/// other feature is refused (format-spec/README.md §Versioning).
pub const KNOWN_FEATURES: &[&str] = &["optimizer", "global", "parts"];

/// `,"manifest_crc32":"` — the start of the fixed trailer (format-spec/manifest.md §Trailer).
pub const TRAILER_HEAD: &[u8] = b",\"manifest_crc32\":\"";
/// Length of the whole trailer: head, 8 hex digits, `"}`, newline.
pub const TRAILER_LEN: usize = TRAILER_HEAD.len() + 8 + 3;

/// Serialize a manifest with its CRC trailer (format-spec/manifest.md §Trailer).
pub fn encode(m: &Manifest) -> Vec<u8> {
    // Serializing plain data types into a Vec cannot fail.
    let mut body = serde_json::to_vec(m).unwrap_or_default();
    // `body` ends with the object's closing brace; the trailer replaces it.
    body.pop();
    append_trailer(body)
}

/// `body` (a JSON object without its closing brace) followed by the CRC trailer for it
/// (format-spec/manifest.md §Trailer). [`encode`] uses it; tests and fuzzers use it to
/// build manifests whose content is hostile but whose CRC checks.
pub fn append_trailer(mut body: Vec<u8>) -> Vec<u8> {
    let crc = crc32fast::hash(&body);
    body.extend_from_slice(TRAILER_HEAD);
    body.extend_from_slice(format!("{crc:08x}\"}}\n").as_bytes());
    body
}

/// Errors from [`decode`] that callers distinguish.
#[derive(Debug)]
pub enum DecodeError {
    /// The CRC trailer does not match the bytes before it.
    Checksum {
        /// Recorded in the trailer.
        expected: u32,
        /// Computed now.
        got: u32,
    },
    /// The version is not one this reader knows.
    Version(u64),
    /// A required feature is unknown.
    Feature(String),
    /// Anything else, with the reason.
    Invalid(String),
}

/// Check the trailer, parse and validate a manifest (format-spec/manifest.md §Validation).
///
/// Validation covers everything that needs no shard file: format name, version, features,
/// id syntax, shard file names, tensor names unique, dtypes known, byte ranges consistent
/// with shapes, aligned to the element size, inside the recorded shard size and after the
/// recorded header, and non-overlapping within each shard. Shard files are checked by
/// the caller.
///
/// # Errors
/// A [`DecodeError`] saying what is wrong.
///
/// # Panics
/// Never, for any input.
pub fn decode(bytes: &[u8]) -> Result<Manifest, DecodeError> {
    decode_indexed(bytes).map(|(m, _)| m)
}

/// [`decode`], also returning the index of the tensor names that validation built (to
/// find duplicates), so that [`crate::Checkpoint`] need not hash every name again.
pub(crate) fn decode_indexed(bytes: &[u8]) -> Result<(Manifest, NameIndex), DecodeError> {
    use DecodeError::Invalid;
    if bytes.len() as u64 > MAX_MANIFEST_SIZE {
        return Err(Invalid(format!(
            "{} bytes exceed the {MAX_MANIFEST_SIZE}-byte cap",
            bytes.len()
        )));
    }
    let body = check_trailer(bytes)?;
    if body.first() != Some(&b'{') {
        return Err(Invalid("does not start with '{'".into()));
    }
    let m = parse(bytes)?;
    check_head(&m.format, m.version, &m.features)?;
    let mut seen = std::collections::HashSet::new();
    if let Some(f) = m.features.iter().find(|f| !seen.insert(f.as_str())) {
        return Err(Invalid(format!("feature {f:?} is listed twice")));
    }
    if m.optimizer.is_some() != m.features.iter().any(|f| f == "optimizer") {
        return Err(Invalid(
            "the \"optimizer\" feature and the optimizer section must come together".into(),
        ));
    }
    if m.globals.is_empty() == m.features.iter().any(|f| f == "global") {
        return Err(Invalid(
            "the \"global\" feature and a non-empty globals list must come together".into(),
        ));
    }
    let names = validate(&m).map_err(Invalid)?;
    super::grid::validate(&m).map_err(Invalid)?;
    let tiled = m.parts.is_empty();
    super::global::validate_with(
        &m.globals,
        &m.tensors,
        |n| names.position(&m.tensors, n),
        tiled,
    )
    .map_err(Invalid)?;
    Ok((m, names))
}

/// Check the CRC trailer of `bytes` (format-spec/manifest.md §Trailer), shared by the
/// manifest and the part descriptors (format-spec/global.md §Parts); returns the body
/// before the trailer.
pub(crate) fn check_trailer(bytes: &[u8]) -> Result<&[u8], DecodeError> {
    use DecodeError::Invalid;
    let split = bytes.len().checked_sub(TRAILER_LEN).ok_or_else(|| {
        Invalid(format!(
            "{} bytes is too short to hold the CRC trailer",
            bytes.len()
        ))
    })?;
    let (body, trailer) = bytes.split_at(split);
    let hex = trailer
        .strip_prefix(TRAILER_HEAD)
        .and_then(|t| t.strip_suffix(b"\"}\n"))
        .filter(|h| {
            h.iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        })
        .ok_or_else(|| Invalid("missing or malformed manifest_crc32 trailer".into()))?;
    let expected = std::str::from_utf8(hex)
        .ok()
        .and_then(|h| u32::from_str_radix(h, 16).ok())
        .ok_or_else(|| Invalid("malformed manifest_crc32".into()))?;
    let got = crc32fast::hash(body);
    if got != expected {
        return Err(DecodeError::Checksum { expected, got });
    }
    Ok(body)
}

/// M18: a tensor's block CRCs fit its byte size. That they combine to its `crc32` is
/// checked by `verify`, which reads the bytes anyway.
fn check_blocks(bl: &BlockCrcs, nbytes: u64) -> Result<(), String> {
    use crate::crc::{MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};
    if !bl.size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bl.size) {
        return Err(format!(
            "size {} is not a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]",
            bl.size
        ));
    }
    let want = nbytes.div_ceil(bl.size);
    if want < 2 || bl.crc32.len() as u64 != want {
        return Err(format!(
            "{} CRCs of {}-byte blocks for {nbytes} bytes (want {want}, at least 2)",
            bl.crc32.len(),
            bl.size
        ));
    }
    Ok(())
}

/// R7-R9: the format name, the version and the features this reader knows.
fn check_head(format: &str, version: u64, features: &[String]) -> Result<(), DecodeError> {
    if format != FORMAT_NAME {
        return Err(DecodeError::Invalid(format!(
            "format is {format:?}, expected {FORMAT_NAME:?}"
        )));
    }
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    match features
        .iter()
        .find(|f| !KNOWN_FEATURES.contains(&f.as_str()))
    {
        Some(f) => Err(DecodeError::Feature(f.clone())),
        None => Ok(()),
    }
}

/// Parse the whole file (R6-R10; format, version and features are checked by the caller).
///
/// The common case, a manifest in the compact form writers emit, takes [`fast::parse`];
/// whatever that does not handle goes through serde_json, which then decides alone, so
/// the result and every error are serde_json's.
fn parse(bytes: &[u8]) -> Result<Manifest, DecodeError> {
    use DecodeError::Invalid;
    if let Some(m) = fast::parse(bytes) {
        return Ok(m);
    }
    // One full parse. Only if it fails, peek at format and version, so that another
    // version gets its own error even if its fields have changed shape.
    #[derive(Deserialize)]
    struct Head {
        format: String,
        version: u64,
        #[serde(default)]
        features: Vec<String>,
    }
    // serde_json checks UTF-8 only in the strings it keeps; the file must be UTF-8 whole
    // (R6), unknown members included.
    let text = std::str::from_utf8(bytes).map_err(|e| {
        Invalid(format!(
            "the manifest is not UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    match serde_json::from_str(text) {
        Ok(m) => Ok(m),
        Err(e) => {
            let head: Head =
                serde_json::from_str(text).map_err(|e| Invalid(format!("JSON: {e}")))?;
            check_head(&head.format, head.version, &head.features)?;
            Err(Invalid(format!("JSON: {e}")))
        }
    }
}

/// The hand-written parser alone: no trailer check, no validation, and `None` where
/// [`decode`] would hand the bytes to serde_json. For `benches/manifest_parse.rs` only.
#[doc(hidden)]
pub fn fast_parse(bytes: &[u8]) -> Option<Manifest> {
    fast::parse(bytes)
}

/// The manifest rules (M1-M16) of `m` alone, without features: for the flat checkpoint a
/// reader builds from a two-level checkpoint's part (format-spec/global.md §Reading a
/// region). Returns the name index of `m.tensors`.
pub(crate) fn validate_flat(m: &Manifest) -> Result<NameIndex, String> {
    validate(m)
}

/// A shard file name must be a plain file name (format-spec/manifest.md §Shard files).
pub(crate) fn check_file_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.starts_with('.')
        && !name.contains(['/', '\\', '\0'])
        && name != MANIFEST_FILE;
    if ok {
        Ok(())
    } else {
        Err(format!(
            "shard file name {name:?} is not a plain file name inside the checkpoint directory"
        ))
    }
}

fn validate(m: &Manifest) -> Result<NameIndex, String> {
    if m.checkpoint_id.len() != 32
        || !m
            .checkpoint_id
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    {
        return Err(format!(
            "checkpoint_id {:?} is not 32 lowercase hex digits",
            m.checkpoint_id
        ));
    }
    if m.shards.len() > MAX_SHARDS {
        return Err(format!(
            "{} shards exceed the limit of {MAX_SHARDS}",
            m.shards.len()
        ));
    }
    if m.tensors.len() > MAX_TENSORS {
        return Err(format!(
            "{} tensors exceed the limit of {MAX_TENSORS}",
            m.tensors.len()
        ));
    }
    if !m.metadata.is_object() {
        return Err("metadata is not a JSON object".into());
    }
    let mut files = std::collections::HashSet::new();
    for (i, s) in m.shards.iter().enumerate() {
        check_file_name(&s.file).map_err(|e| format!("shard {i}: {e}"))?;
        if !files.insert(s.file.as_str()) {
            return Err(format!("shard {i}: file {:?} is listed twice", s.file));
        }
        let data_start = s
            .header_size
            .checked_add(8)
            .filter(|&d| d <= s.size && s.header_size <= super::MAX_HEADER_SIZE);
        if data_start.is_none() {
            return Err(format!(
                "shard {i} ({}): header_size {} does not fit size {}",
                s.file, s.header_size, s.size
            ));
        }
    }
    let mut names = NameIndex::with_capacity(m.tensors.len());
    // The overlap check (M13). Per shard, the end of the last range in manifest order:
    // while each range begins at or after it, the ranges come sorted by (begin, end) and
    // do not overlap. Only if that fails somewhere are the ranges sorted (below).
    let mut last_end = vec![0u64; m.shards.len()];
    let mut in_order = true;
    for (i, t) in m.tensors.iter().enumerate() {
        check_tensor_name(&t.name).map_err(|e| format!("tensor {i}: {e}"))?;
        if !names.insert(&m.tensors, i) {
            return Err(format!("tensor {:?} is listed twice", t.name));
        }
        let shard = m.shards.get(t.shard).ok_or_else(|| {
            format!(
                "tensor {:?}: shard index {} out of range ({} shards)",
                t.name,
                t.shard,
                m.shards.len()
            )
        })?;
        let dtype = t.dtype;
        if t.crc32.is_none() {
            return Err(format!("tensor {:?}: no crc32", t.name));
        }
        if t.absmax.is_some() && t.dtype != crate::DType::F32 {
            return Err(format!(
                "tensor {:?}: absmax is recorded only for F32 tensors, not {}",
                t.name, t.dtype
            ));
        }
        if t.shape.len() > MAX_RANK {
            return Err(format!(
                "tensor {:?}: rank {} exceeds {MAX_RANK}",
                t.name,
                t.shape.len()
            ));
        }
        let nbytes = checked_nbytes(dtype, &t.shape)
            .ok_or_else(|| format!("tensor {:?}: shape {:?} overflows", t.name, t.shape))?;
        let [b, e] = t.offsets;
        let data_start = shard.header_size + 8; // checked above
        if b > e || e - b != nbytes || b < data_start || e > shard.size {
            return Err(format!(
                "tensor {:?}: offsets [{b}, {e}] do not hold {dtype} {:?} ({nbytes} bytes) inside the data section [{data_start}, {}) of shard {}",
                t.name, t.shape, shard.size, t.shard
            ));
        }
        let size = dtype.size() as u64;
        // Element sizes are powers of two, whose remainder is a mask (no division).
        let misaligned = if size.is_power_of_two() {
            b & (size - 1) != 0
        } else {
            !b.is_multiple_of(size)
        };
        if misaligned {
            return Err(format!(
                "tensor {:?}: offset {b} is not a multiple of its {}-byte element size",
                t.name,
                dtype.size()
            ));
        }
        if let Some(bl) = &t.blocks {
            check_blocks(bl, nbytes).map_err(|e| format!("tensor {:?}: blocks: {e}", t.name))?;
        }
        if let Some(last) = last_end.get_mut(t.shard) {
            in_order &= b >= *last;
            *last = e;
        }
    }
    if in_order {
        return Ok(names);
    }
    // Per shard: (begin, end, tensor index), sorted, for the overlap check.
    let mut ranges: Vec<Vec<(u64, u64, usize)>> = vec![Vec::new(); m.shards.len()];
    for (i, t) in m.tensors.iter().enumerate() {
        if let Some(r) = ranges.get_mut(t.shard) {
            r.push((t.offsets[0], t.offsets[1], i));
        }
    }
    for (s, r) in ranges.iter_mut().enumerate() {
        r.sort_unstable();
        for w in r.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(format!(
                    "tensors {:?} and {:?} overlap in shard {s}",
                    m.tensors[w[0].2].name, m.tensors[w[1].2].name
                ));
            }
        }
    }
    Ok(names)
}

/// A hash index from tensor name to position, storing only `u32` positions: the names stay
/// in the tensor list (at most [`MAX_TENSORS`] < 2^32 entries).
#[derive(Debug, Default)]
pub(crate) struct NameIndex {
    table: hashbrown::HashTable<u32>,
    hasher: foldhash::fast::RandomState,
}

impl NameIndex {
    fn with_capacity(n: usize) -> NameIndex {
        NameIndex {
            table: hashbrown::HashTable::with_capacity(n),
            ..Default::default()
        }
    }

    /// Index `tensors`; on a repeated name, returns the position of the second occurrence.
    pub(crate) fn build(tensors: &[TensorInfo]) -> Result<NameIndex, usize> {
        let mut ix = NameIndex::with_capacity(tensors.len());
        match (0..tensors.len()).find(|&i| !ix.insert(tensors, i)) {
            Some(i) => Err(i),
            None => Ok(ix),
        }
    }

    /// Add `tensors[i]` (whose predecessors were added in order); false if its name is
    /// already there.
    fn insert(&mut self, tensors: &[TensorInfo], i: usize) -> bool {
        use std::hash::BuildHasher;
        let (Some(t), Ok(pos)) = (tensors.get(i), u32::try_from(i)) else {
            return false;
        };
        let hasher = &self.hasher;
        let name = |j: &u32| tensors.get(*j as usize).map(|t| t.name.as_str());
        match self.table.entry(
            hasher.hash_one(t.name.as_str()),
            |j| name(j) == Some(t.name.as_str()),
            |j| hasher.hash_one(name(j).unwrap_or_default()),
        ) {
            hashbrown::hash_table::Entry::Occupied(_) => false,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(pos);
                true
            }
        }
    }

    /// The tensor named `name`, in the list this index was built over.
    pub(crate) fn get<'t>(&self, tensors: &'t [TensorInfo], name: &str) -> Option<&'t TensorInfo> {
        self.position(tensors, name).and_then(|j| tensors.get(j))
    }

    /// The position of the tensor named `name` in the list this index was built over.
    pub(crate) fn position(&self, tensors: &[TensorInfo], name: &str) -> Option<usize> {
        use std::hash::BuildHasher;
        self.table
            .find(self.hasher.hash_one(name), |&j| {
                tensors.get(j as usize).is_some_and(|t| t.name == name)
            })
            .map(|&j| j as usize)
    }
}

/// [`decode_indexed`] with its errors as the crate's, naming `file` (the manifest's path
/// or URL).
pub(crate) fn decode_checked(
    bytes: &[u8],
    file: &str,
) -> crate::error::Result<(Manifest, NameIndex)> {
    use crate::error::Error;
    decode_indexed(bytes).map_err(|e| match e {
        DecodeError::Checksum { expected, got } => Error::ChecksumMismatch {
            what: "manifest".into(),
            shard: 0,
            file: file.into(),
            expected,
            got,
        },
        DecodeError::Version(v) => Error::UnsupportedVersion {
            file: file.into(),
            found: v,
            supported: VERSION,
        },
        DecodeError::Feature(f) => Error::UnsupportedFeature {
            file: file.into(),
            feature: f,
        },
        DecodeError::Invalid(r) => Error::manifest(file, r),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    pub(crate) fn sample() -> Manifest {
        Manifest {
            format: FORMAT_NAME.into(),
            version: VERSION,
            features: vec![],
            checkpoint_id: "0123456789abcdef0123456789abcdef".into(),
            shards: vec![ShardEntry {
                file: "s0.safetensors".into(),
                size: 8 + 64 + 12,
                header_size: 64,
                header_crc32: 7,
            }],
            tensors: vec![
                TensorInfo {
                    name: "a".into(),
                    shard: 0,
                    dtype: DType::F32,
                    shape: vec![2],
                    offsets: [72, 80],
                    crc32: Some(1),
                    absmax: None,
                    blocks: None,
                },
                TensorInfo {
                    name: "b".into(),
                    shard: 0,
                    dtype: DType::I32,
                    shape: vec![],
                    offsets: [80, 84],
                    crc32: Some(2),
                    absmax: None,
                    blocks: None,
                },
            ],
            metadata: serde_json::json!({"step": 3}),
            optimizer: None,
            globals: Vec::new(),
            parts: Vec::new(),
            grids: Vec::new(),
        }
    }

    #[test]
    fn round_trip_with_trailer() {
        let m = sample();
        let bytes = encode(&m);
        assert!(bytes.ends_with(b"\"}\n"));
        assert_eq!(decode(&bytes).unwrap(), m);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["manifest_crc32"].is_string());
    }

    #[test]
    fn every_bit_flip_is_rejected() {
        let bytes = encode(&sample());
        for i in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert!(decode(&b).is_err(), "flip of bit {i} accepted");
        }
    }

    #[test]
    fn rejects_bad_contents() {
        type Edit = fn(&mut Manifest);
        let cases: Vec<(Edit, &str)> = vec![
            (|m| m.shards[0].file = "../x".into(), "plain file name"),
            (
                |m| m.shards[0].file = "/etc/passwd".into(),
                "plain file name",
            ),
            (|m| m.shards[0].file = "a\0b".into(), "plain file name"),
            (|m| m.tensors[1].name = "a".into(), "listed twice"),
            (|m| m.tensors[1].offsets = [76, 80], "overlap"),
            (
                |m| {
                    m.shards[0].size = 96;
                    m.tensors[1].offsets = [82, 86]
                },
                "multiple",
            ),
            (|m| m.tensors[0].offsets = [0, 8], "data section"),
            (|m| m.tensors[0].shard = 5, "out of range"),
            (|m| m.tensors[0].shape = vec![u64::MAX, 4], "overflows"),
            (|m| m.checkpoint_id = "xyz".into(), "checkpoint_id"),
            (|m| m.shards.push(m.shards[0].clone()), "listed twice"),
        ];
        for (f, want) in cases {
            let mut m = sample();
            f(&mut m);
            match decode(&encode(&m)) {
                Err(DecodeError::Invalid(r)) => assert!(r.contains(want), "{want:?} not in {r:?}"),
                other => panic!("expected Invalid({want}), got {other:?}"),
            }
        }
        let mut m = sample();
        m.version = 2;
        assert!(matches!(decode(&encode(&m)), Err(DecodeError::Version(2))));
        let mut m = sample();
        m.features = vec!["ranks".into()];
        assert!(matches!(decode(&encode(&m)), Err(DecodeError::Feature(f)) if f == "ranks"));
    }

    #[test]
    fn invalid_utf8_in_an_unknown_member_is_refused() {
        let mut body = serde_json::to_vec(&sample()).unwrap();
        body.pop();
        for bad in [&b"\xff"[..], b"\xc3", b"\xed\xa0\x80"] {
            let mut b = body.clone();
            b.extend_from_slice(b",\"x\":\"");
            b.extend_from_slice(bad);
            b.push(b'"');
            match decode(&append_trailer(b)) {
                Err(DecodeError::Invalid(r)) => assert!(r.contains("not UTF-8"), "{r}"),
                other => panic!("{bad:?} in an unknown member: {other:?}"),
            }
        }
        // The same member with valid UTF-8 is ignored, as unknown members are.
        let mut b = body.clone();
        b.extend_from_slice(",\"x\":\"\u{e9}\"".as_bytes());
        assert_eq!(decode(&append_trailer(b)).unwrap(), sample());
    }

    /// A manifest using every member: features, absmax, block CRCs (parsed only: they do
    /// not fit the tensor), an optimizer section, nested
    /// metadata, a non-ASCII tensor name.
    fn full_sample() -> Manifest {
        let mut m = sample();
        m.features = vec!["optimizer".into()];
        m.tensors[0].absmax = Some(0.75);
        m.tensors[0].blocks = Some(BlockCrcs {
            size: 4096,
            crc32: vec![0, 4_294_967_295, 7],
        });
        m.tensors[1].name = "é.b".into();
        m.metadata = serde_json::json!({"step": 3, "nested": {"a": [1, 2.5, null, "x\"y"]}});
        m.optimizer = Some(OptimizerSection {
            groups: vec![GroupEntry {
                params: vec!["a".into()],
                hyper: serde_json::json!({"lr": 1e-3, "betas": [0.9, 0.999]}),
            }],
            params: vec![ParamEntry {
                name: "a".into(),
                shape: vec![2],
                state: vec![StateEntry {
                    name: "exp_avg".into(),
                    tensor: "a".into(),
                    encoding: Encoding::F16Scaled,
                    scale: Some("b".into()),
                }],
            }],
        });
        m
    }

    /// What the fast path accepts, serde_json accepts with the same value. Returns
    /// whether the fast path accepted.
    fn agrees(bytes: &[u8]) -> bool {
        let Some(fast) = fast::parse(bytes) else {
            return false;
        };
        match serde_json::from_slice::<Manifest>(bytes) {
            Ok(slow) => assert_eq!(fast, slow, "{}", String::from_utf8_lossy(bytes)),
            Err(e) => panic!(
                "fast path accepted what serde_json refuses ({e}): {}",
                String::from_utf8_lossy(bytes)
            ),
        }
        true
    }

    #[test]
    fn fast_path_takes_what_writers_write() {
        for m in [sample(), full_sample()] {
            let bytes = encode(&m);
            assert_eq!(fast::parse(&bytes).as_ref(), Some(&m));
            assert!(agrees(&bytes));
            // Indented, and members in reverse order: still the fast path's.
            let pretty = serde_json::to_vec_pretty(&m).unwrap();
            assert!(agrees(&pretty));
            let v = serde_json::to_value(&m).unwrap();
            let mut rev = serde_json::Map::new();
            for (k, v) in v.as_object().unwrap().iter().rev() {
                let v = match v.as_array() {
                    Some(a) => a
                        .iter()
                        .map(|e| match e.as_object() {
                            Some(o) => {
                                serde_json::Value::Object(o.clone().into_iter().rev().collect())
                            }
                            None => e.clone(),
                        })
                        .collect(),
                    None => v.clone(),
                };
                rev.insert(k.clone(), v);
            }
            let rev = serde_json::to_vec(&rev).unwrap();
            assert!(agrees(&rev), "{}", String::from_utf8_lossy(&rev));
        }
    }

    #[test]
    fn fast_path_agrees_with_serde_on_every_small_edit() {
        let interesting: &[u8] = b"\"\\0019-+.eE {}[],:nul\x00\x1f\x7f\x80\xc3\xff";
        let mut accepted = 0;
        let mut total = 0;
        for m in [sample(), full_sample()] {
            let base = encode(&m);
            for p in 0..=base.len() {
                let mut variants = Vec::new();
                if p < base.len() {
                    let mut d = base.clone();
                    d.remove(p);
                    variants.push(d);
                    for &c in interesting {
                        let mut r = base.clone();
                        r[p] = c;
                        variants.push(r);
                    }
                }
                for &c in b" \"0,\\}" {
                    let mut ins = base.clone();
                    ins.insert(p, c);
                    variants.push(ins);
                }
                for v in variants {
                    total += 1;
                    accepted += usize::from(agrees(&v));
                }
            }
        }
        // Not vacuous: many edits (digits changed, whitespace) stay on the fast path.
        assert!(accepted > total / 50, "{accepted} of {total}");
    }

    #[test]
    fn fast_path_agrees_with_serde_on_hostile_members() {
        let head = r#"{"format":"ckptstore","version":1,"checkpoint_id":"0123456789abcdef0123456789abcdef","shards":[{"file":"s0","size":84,"header_size":64,"header_crc32":7}],"tensors":["#;
        let tail = r#"],"metadata":{},"manifest_crc32":"00000000"}"#;
        let tensor = |members: &str| format!(r#"{head}{{{members}}}{tail}"#);
        let ok = r#""name":"a","shard":0,"dtype":"F32","shape":[2],"offsets":[72,80],"crc32":1"#;
        let mut cases: Vec<String> = vec![tensor(ok)];
        for (from, to) in [
            (r#""crc32":1"#, r#""crc32":null"#),
            (r#""crc32":1"#, r#""crc32":4294967295"#),
            (r#""crc32":1"#, r#""crc32":4294967296"#),
            (r#""crc32":1"#, r#""crc32":-1"#),
            (r#""crc32":1"#, r#""crc32":1.0"#),
            (r#""crc32":1"#, r#""crc32":1e0"#),
            (r#""crc32":1"#, r#""crc32":01"#),
            (r#""crc32":1"#, r#""crc32":"1""#),
            (r#""crc32":1"#, r#""crc32":1,"crc32":1"#),
            (r#""crc32":1"#, r#""crc32":1,"absmax":null"#),
            (r#""crc32":1"#, r#""crc32":1,"x":{"y":[1,{"z":"\"]}"}]}"#),
            (r#""crc32":1"#, r#""crc32":1,"x":nul"#),
            (r#""crc32":1"#, r#""crc32":1,"x":[1,]"#),
            (r#""crc32":1"#, r#""crc32":1,"x":"\u0041""#),
            (r#""crc32":1"#, r#""crc32":1,"#),
            (r#""crc32":1"#, ""),
            (r#""shard":0"#, r#""shard":18446744073709551615"#),
            (r#""shard":0"#, r#""shard":18446744073709551616"#),
            (r#""shard":0"#, r#""shard":99999999999999999999"#),
            (r#""shard":0"#, r#""shard":00000000000000000000000"#),
            (r#""shard":0"#, r#""shard":-0"#),
            (r#""offsets":[72,80]"#, r#""offsets":[72,80,88]"#),
            (r#""offsets":[72,80]"#, r#""offsets":[72]"#),
            (r#""offsets":[72,80]"#, r#""offsets":[ 72 , 80 ]"#),
            (r#""shape":[2]"#, r#""shape":[]"#),
            (r#""shape":[2]"#, r#""shape":[1,2,3,4,5,6,7,8,9,10,11,12]"#),
            (r#""shape":[2]"#, r#""shape":[2,]"#),
            (r#""shape":[2]"#, r#""shape":null"#),
            (r#""dtype":"F32""#, r#""dtype":"F8_E4M3""#),
            (r#""dtype":"F32""#, r#""dtype":"BOOL""#),
            (r#""dtype":"F32""#, r#""dtype":"F\u0033\u0032""#),
            (r#""name":"a""#, r#""name":"a\"b""#),
            (r#""name":"a""#, r#""name":"a\u0000""#),
            (r#""name":"a""#, r#""name":"tab	x""#),
            (r#""name":"a""#, r#""name":"€𝄞""#),
            (r#""name":"a""#, r#""name":"a","name":"b""#),
            (r#""name":"a""#, r#""na\u006de":"a""#),
            (r#""name":"a","#, ""),
        ] {
            cases.push(tensor(&ok.replace(from, to)));
        }
        // A struct written as an array, which serde_json also accepts.
        cases.push(format!(r#"{head}["a",0,"F32",[2],[72,80],1]{tail}"#));
        // absmax: accepted values as serde_json writes them, and everything else.
        let mut absmax: Vec<String> = "0 0.0 -0.0 -0 5 1E0 1e-3 0.5 0.1 1.5e-3 3.0e38 \
            3.4028234663852886e38 3.5e38 1e400 1e-400 1. .5 01.5 0.5e 0.5e+ 1e+2 null \"1\" \
            16777217 16777216 9007199254740993 0.000000000000000000000000000000000000000000001 \
            1.00000000000000000000000000000000001"
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..3000 {
            let f = f32::from_bits(next() as u32);
            absmax.push(serde_json::to_string(&f64::from(f)).unwrap_or_default());
            // Random decimals, some exact in FP32, most not.
            let digits = |n: u64, next: &mut dyn FnMut() -> u64| -> String {
                (0..n)
                    .map(|_| char::from(b'0' + (next() % 10) as u8))
                    .collect()
            };
            let r = next();
            let mut t = digits(1 + r % 12, &mut next);
            if r & 1 << 8 != 0 {
                t = format!("{t}.{}", digits(1 + (r >> 9) % 22, &mut next));
            }
            if r & 1 << 16 != 0 {
                t = format!(
                    "{t}e{}{}",
                    ["", "+", "-"][(r >> 17) as usize % 3],
                    (r >> 20) % 60
                );
            }
            absmax.push(t);
        }
        let fp32 = ok.replace(r#""crc32":1"#, r#""crc32":1,"absmax":X"#);
        let mut accepted = 0;
        for a in &absmax {
            let doc = tensor(&fp32.replace('X', a));
            accepted += usize::from(agrees(doc.as_bytes()));
        }
        assert!(accepted > 1000, "{accepted}");
        // Nesting around the limits of serde_json (128) and of the fast path (64).
        for depth in [63, 64, 65, 126, 127, 128, 129] {
            let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            cases.push(format!(
                r#"{head}{{{ok}}}],"metadata":{{"x":{nested}}},"manifest_crc32":"00000000"}}"#
            ));
            cases.push(format!(r#"{head}{{{ok},"x":{nested}}}{tail}"#));
        }
        let mut accepted = 0;
        for c in &cases {
            accepted += usize::from(agrees(c.as_bytes()));
        }
        assert!(accepted > 10, "{accepted}");
    }

    #[test]
    fn uint_matches_a_digit_loop() {
        let naive = |s: &[u8]| -> Option<(u64, usize)> {
            let n = s.iter().take_while(|c| c.is_ascii_digit()).count();
            let v = s[..n].iter().try_fold(0u64, |v, &c| {
                v.checked_mul(10)?.checked_add(u64::from(c - b'0'))
            })?;
            Some((v, n))
        };
        let mut seed = 12345u64;
        for len in 0..26 {
            for _ in 0..200 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let mut s: Vec<u8> = (0..len)
                    .map(|k| b'0' + ((seed >> (k % 16 * 4)) % 10) as u8)
                    .collect();
                if seed & 1 == 0 {
                    s.push([b',', b']', b'}', b'/', b':', b' ', b'.'][(seed >> 40) as usize % 7]);
                    s.extend_from_slice(b"123456789");
                }
                assert_eq!(fast::uint(&s), naive(&s), "{}", String::from_utf8_lossy(&s));
            }
        }
        for s in [
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999",
        ] {
            assert_eq!(fast::uint(s.as_bytes()), naive(s.as_bytes()), "{s}");
        }
    }
}
