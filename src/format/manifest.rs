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
mod tests;
