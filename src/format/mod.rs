//! On-disk formats: the safetensors shard header and the checkpoint manifest.
//!
//! Byte layouts and rules live in `format-spec/`; the constants here cite its sections.

pub use crate::crc::crc32_parallel;

pub mod global;
pub mod grid;
pub mod header;
pub mod journal;
pub mod manifest;
pub mod names;
pub mod optimizer;
pub mod part;
pub mod schema;

/// Metadata key, in every ckptstore shard header, holding the checkpoint id
/// (format-spec/shard.md §Metadata).
pub const META_CHECKPOINT_ID: &str = "ckptstore.checkpoint_id";

/// Largest shard header (the JSON after the 8-byte length) a reader accepts, in bytes
/// (format-spec/shard.md §Limits). The same cap as the safetensors crate.
pub const MAX_HEADER_SIZE: u64 = 100_000_000;
/// Most tensors one shard header may describe (format-spec/shard.md §Limits).
pub const MAX_TENSORS_PER_SHARD: usize = 1 << 20;
/// Longest tensor name, in bytes of UTF-8 (format-spec/shard.md §Limits).
pub const MAX_NAME_LEN: usize = 4096;
/// Most dimensions a tensor may have (format-spec/shard.md §Limits).
pub const MAX_RANK: usize = 64;
/// Largest manifest file a reader accepts, in bytes (format-spec/manifest.md §Limits).
pub const MAX_MANIFEST_SIZE: u64 = 1 << 30;
/// Most shards one manifest may list (format-spec/manifest.md §Limits).
pub const MAX_SHARDS: usize = 1 << 20;
/// Most tensors one manifest may list (format-spec/manifest.md §Limits).
pub const MAX_TENSORS: usize = 1 << 24;

/// Deepest nesting of the user JSON a writer stores in a manifest (its `metadata`, each
/// optimizer group's `hyper`), in levels of arrays and objects (format-spec/manifest.md
/// §Limits): well inside a JSON parser's own limit (serde_json: 128 levels, the manifest's
/// own counted), so that a committed manifest always opens.
pub const MAX_JSON_DEPTH: usize = 64;

/// `v` nests at most [`MAX_JSON_DEPTH`] levels of arrays and objects (walked with an
/// explicit stack: a value built in memory may be deeper than the call stack allows).
pub(crate) fn check_json_depth(v: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(a) => Box::new(a.iter()),
            Value::Object(o) => Box::new(o.values()),
            _ => continue,
        };
        if depth > MAX_JSON_DEPTH {
            return Err(format!(
                "nests more than {MAX_JSON_DEPTH} levels of arrays and objects (a manifest that deep would not open)"
            ));
        }
        stack.extend(children.map(|c| (c, depth + 1)));
    }
    Ok(())
}

/// Check a tensor name against format-spec/shard.md §Tensor names.
pub(crate) fn check_tensor_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty tensor name".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "tensor name of {} bytes exceeds the {MAX_NAME_LEN}-byte limit",
            name.len()
        ));
    }
    if name == "__metadata__" {
        return Err("\"__metadata__\" is reserved and cannot name a tensor".into());
    }
    if name.contains('\0') {
        return Err(format!("tensor name {name:?} contains a NUL byte"));
    }
    Ok(())
}
