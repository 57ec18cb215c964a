//! On-disk formats: the safetensors shard header and the checkpoint manifest.
//!
//! Byte layouts and rules live in `format-spec/`; the constants here cite its sections.

pub mod global;
pub mod header;
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
