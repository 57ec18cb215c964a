//! The safetensors shard header: parse and emit over `&[u8]` (format-spec/shard.md).
//!
//! [`parse`] never panics for any input: every length is checked against the buffer and
//! the caps in [`crate::format`], every product and sum uses checked arithmetic.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::{check_tensor_name, MAX_HEADER_SIZE, MAX_RANK, MAX_TENSORS_PER_SHARD};
use crate::dtype::{checked_nbytes, DType};

/// One tensor as a shard header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape; empty for a 0-dim tensor.
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the data section: `[begin, end)`.
    pub data_offsets: [u64; 2],
}

/// A parsed and validated shard header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Length of the JSON header in bytes (the value of the 8-byte prefix).
    pub header_size: u64,
    /// Tensors in the order the JSON lists them.
    pub tensors: Vec<HeaderEntry>,
    /// The optional `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
}

impl Header {
    /// Absolute file offset where the data section starts: `8 + header_size`.
    pub fn data_start(&self) -> u64 {
        8 + self.header_size
    }
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

enum RawItem {
    Metadata(BTreeMap<String, String>),
    Tensor(String, RawEntry),
}

struct RawHeader(Vec<RawItem>);

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object mapping tensor names to entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut items = Vec::new();
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if items.len() >= MAX_TENSORS_PER_SHARD {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_TENSORS_PER_SHARD} entries"
                        )));
                    }
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!("duplicate key {key:?}")));
                    }
                    if key == "__metadata__" {
                        items.push(RawItem::Metadata(map.next_value()?));
                    } else {
                        let entry: RawEntry = map.next_value().map_err(|e| {
                            de::Error::custom(format!("entry for tensor {key:?}: {e}"))
                        })?;
                        items.push(RawItem::Tensor(key, entry));
                    }
                }
                Ok(RawHeader(items))
            }
        }
        d.deserialize_map(V)
    }
}

/// Parse and validate the header of a safetensors file held whole in `file`.
///
/// Checks (format-spec/shard.md §Validation): the 8-byte little-endian length fits the file
/// and the cap, the JSON starts with `{` and is one object with no duplicate keys, every
/// dtype is known, shapes and offsets use checked arithmetic, each tensor's byte length
/// equals its shape times element size, and the tensors tile the data section exactly: no
/// gaps, no overlaps, no trailing bytes.
///
/// # Errors
/// `Err(reason)` naming the offending tensor where there is one; the caller adds the file.
///
/// # Panics
/// Never, for any input.
pub fn parse(file: &[u8]) -> Result<Header, String> {
    parse_head(file, file.len() as u64)
}

/// [`parse`] for a file of `file_len` bytes of which `head` holds the first ones, at least
/// the 8-byte length and the header JSON (a shard fetched by ranged reads: its header was
/// read, its data was not). The data offsets are checked against `file_len`.
///
/// # Errors
/// As [`parse`]; also when `head` ends before the header does.
///
/// # Panics
/// Never, for any input.
pub fn parse_head(head: &[u8], file_len: u64) -> Result<Header, String> {
    let file = head;
    let prefix: [u8; 8] = file
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            format!(
                "file is {} bytes, shorter than the 8-byte header length",
                file.len()
            )
        })?;
    let header_size = u64::from_le_bytes(prefix);
    if header_size > MAX_HEADER_SIZE {
        return Err(format!(
            "header length {header_size} exceeds the {MAX_HEADER_SIZE}-byte cap"
        ));
    }
    let data_start = 8u64
        .checked_add(header_size)
        .filter(|&e| e <= file_len)
        .ok_or_else(|| {
            format!("header length {header_size} runs past the end of the {file_len}-byte file")
        })?;
    // data_start <= file.len(), so these conversions and slices are in bounds.
    let json = usize::try_from(data_start)
        .ok()
        .and_then(|e| file.get(8..e))
        .ok_or_else(|| "header out of bounds".to_string())?;
    if json.first() != Some(&b'{') {
        return Err("header JSON does not start with '{'".into());
    }
    let raw: RawHeader = serde_json::from_slice(json).map_err(|e| format!("header JSON: {e}"))?;
    let data_len = file_len - data_start;

    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(raw.0.len());
    for item in raw.0 {
        match item {
            RawItem::Metadata(m) => metadata = m,
            RawItem::Tensor(name, e) => {
                check_tensor_name(&name)?;
                let dtype = DType::from_name(&e.dtype)
                    .ok_or_else(|| format!("tensor {name:?}: unknown dtype {:?}", e.dtype))?;
                if e.shape.len() > MAX_RANK {
                    return Err(format!(
                        "tensor {name:?}: {} dimensions exceed the limit of {MAX_RANK}",
                        e.shape.len()
                    ));
                }
                let nbytes = checked_nbytes(dtype, &e.shape)
                    .ok_or_else(|| format!("tensor {name:?}: shape {:?} overflows", e.shape))?;
                let [b, end] = e.data_offsets;
                if b > end {
                    return Err(format!(
                        "tensor {name:?}: inverted data_offsets [{b}, {end}]"
                    ));
                }
                if end > data_len {
                    return Err(format!(
                        "tensor {name:?}: data_offsets [{b}, {end}] past the {data_len}-byte data section"
                    ));
                }
                if end - b != nbytes {
                    return Err(format!(
                        "tensor {name:?}: data_offsets [{b}, {end}] span {} bytes but {dtype} {:?} needs {nbytes}",
                        end - b,
                        e.shape
                    ));
                }
                tensors.push(HeaderEntry {
                    name,
                    dtype,
                    shape: e.shape,
                    data_offsets: e.data_offsets,
                });
            }
        }
    }
    check_tiling(&tensors, data_len)?;
    Ok(Header {
        header_size,
        tensors,
        metadata,
    })
}

/// The tensors, sorted by offset, must cover `[0, data_len)` exactly.
fn check_tiling(tensors: &[HeaderEntry], data_len: u64) -> Result<(), String> {
    let mut order: Vec<&HeaderEntry> = tensors.iter().collect();
    order.sort_by_key(|e| (e.data_offsets[0], e.data_offsets[1]));
    let mut pos = 0u64;
    for e in order {
        let [b, end] = e.data_offsets;
        if b < pos {
            return Err(format!(
                "tensor {:?}: data_offsets [{b}, {end}] overlap the previous tensor",
                e.name
            ));
        }
        if b > pos {
            return Err(format!(
                "gap of {} bytes before tensor {:?} at data offset {pos}",
                b - pos,
                e.name
            ));
        }
        pos = end;
    }
    if pos != data_len {
        return Err(format!(
            "{} trailing bytes after the last tensor",
            data_len - pos
        ));
    }
    Ok(())
}

/// Build the header bytes (8-byte length plus JSON padded with spaces) for tensors laid
/// out in `entries` order, so that the data section starts at a multiple of 8.
///
/// The offsets in `entries` are taken as given; the caller lays them out.
pub fn emit(entries: &[HeaderEntry], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    use serde_json::{json, Map, Value};
    let mut obj = Map::new();
    if !metadata.is_empty() {
        obj.insert("__metadata__".into(), json!(metadata));
    }
    for e in entries {
        obj.insert(
            e.name.clone(),
            json!({"dtype": e.dtype.name(), "shape": e.shape, "data_offsets": e.data_offsets}),
        );
    }
    let mut json = serde_json::to_vec(&Value::Object(obj)).unwrap_or_default();
    let pad = (8 - (json.len() % 8)) % 8;
    json.resize(json.len() + pad, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str, data: &[u8]) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn emit_then_parse() {
        let entries = vec![
            HeaderEntry {
                name: "a".into(),
                dtype: DType::F32,
                shape: vec![2],
                data_offsets: [0, 8],
            },
            HeaderEntry {
                name: "s".into(),
                dtype: DType::I64,
                shape: vec![],
                data_offsets: [8, 16],
            },
            HeaderEntry {
                name: "e".into(),
                dtype: DType::F16,
                shape: vec![0, 3],
                data_offsets: [16, 16],
            },
        ];
        let meta: BTreeMap<_, _> = [("k".to_string(), "v".to_string())].into();
        let mut bytes = emit(&entries, &meta);
        assert_eq!(bytes.len() % 8, 0);
        bytes.extend_from_slice(&[0u8; 16]);
        let h = parse(&bytes).unwrap();
        assert_eq!(h.tensors, entries);
        assert_eq!(h.metadata, meta);
        assert_eq!(h.data_start() as usize, bytes.len() - 16);
    }

    #[test]
    fn rejects_named_hostile_headers() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (u64::MAX.to_le_bytes().to_vec(), "cap"),
            (vec![1, 2, 3], "shorter"),
            (
                file("", b"")[..8].iter().chain(b"").copied().collect(),
                "start with",
            ),
            (
                {
                    let mut v = 50u64.to_le_bytes().to_vec();
                    v.extend(b"{}");
                    v
                },
                "past the end",
            ),
            (file("[]", b""), "start with"),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                    &[0; 8],
                ),
                "duplicate key",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                    &[0; 8],
                ),
                "overlap",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
                    &[0; 4],
                ),
                "inverted",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                    &[0; 2],
                ),
                "past the",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                    &[0; 8],
                ),
                "gap",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "overflows",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                    &[0; 5],
                ),
                "trailing",
            ),
            (
                file(
                    r#"{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "unknown dtype",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "needs 8",
            ),
        ];
        for (bytes, want) in cases {
            let err = parse(&bytes).expect_err(want);
            assert!(err.contains(want), "expected {want:?} in {err:?}");
        }
    }
}
