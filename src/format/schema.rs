//! The manifest's schema: the serde types of `ckpt-manifest.json` (format-spec/manifest.md,
//! format-spec/global.md, format-spec/optimizer.md), and nothing else. The rules live beside
//! it: [`super::manifest`] (decoding, the trailer, rules M*), [`super::global`] (rules G*)
//! and [`super::optimizer`] (rules O*), each importing this module and none importing a
//! module above it.

use serde::{Deserialize, Serialize};

use crate::dtype::{checked_numel, DType};

/// The manifest of a ckptstore checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// Always `"ckptstore"`.
    pub format: String,
    /// Format version; see [`crate::format::manifest::VERSION`].
    pub version: u64,
    /// Features a reader must implement to read this checkpoint correctly.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
    /// 32 lowercase hex digits, random per save.
    pub checkpoint_id: String,
    /// The shard files, in index order.
    pub shards: Vec<ShardEntry>,
    /// Every tensor, in save order.
    pub tensors: Vec<TensorInfo>,
    /// User metadata: any JSON object.
    #[serde(default = "empty_object")]
    pub metadata: serde_json::Value,
    /// The optimizer section (format-spec/optimizer.md), if the checkpoint holds one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerSection>,
    /// Global tensors stored in chunks (format-spec/global.md); present, and not empty,
    /// exactly when `features` lists `global`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub globals: Vec<GlobalEntry>,
    /// The part indexes of a two-level manifest (feature `parts`, format-spec/global.md
    /// §The two-level manifest): `parts[p]` holds the chunk entries of the cells the grids
    /// assign to `p`. Empty without the feature.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<PartRef>,
    /// The chunk grids of a two-level manifest, each shared by every global that has it.
    /// Empty without the feature `parts`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grids: Vec<Grid>,
}

/// One part index of a two-level manifest: a part descriptor (format-spec/global.md
/// §Parts) kept beside the shards, named by the root with its exact size and CRC32.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PartRef {
    /// File name inside the checkpoint directory: `part-<checkpoint_id>-r<rank>.json`.
    pub file: String,
    /// Exact size in bytes.
    pub size: u64,
    /// CRC32 of the whole file's bytes.
    pub crc32: u32,
}

/// A chunk grid of a two-level manifest: split points per dimension, and for each cell
/// (row-major over the cells) the index in `parts` of the part holding it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct Grid {
    /// Per dimension, strictly increasing split points from 0 to the global extent.
    pub splits: Vec<Vec<u64>>,
    /// Per cell, row-major, an index into the manifest's `parts`.
    pub cells: Vec<u32>,
}

impl Manifest {
    /// Every file the manifest names besides itself: its shards, and under the feature
    /// `parts` its part indexes (whose own shards it does not name: see
    /// [`Manifest::keeps`]).
    pub fn files(&self) -> impl Iterator<Item = &str> {
        self.shards
            .iter()
            .map(|s| s.file.as_str())
            .chain(self.parts.iter().map(|p| p.file.as_str()))
    }

    /// Whether the committed checkpoint this manifest describes uses the file `name`, so
    /// that a cleanup must keep it: every file it names ([`Manifest::files`]), and in a
    /// two-level checkpoint every shard of its checkpoint id (the parts' shards, named only
    /// in the part indexes).
    pub fn keeps(&self, name: &str) -> bool {
        self.files().any(|f| f == name)
            || (!self.parts.is_empty()
                && name.starts_with("shard-")
                && crate::format::names::engine_file_id(name) == Some(self.checkpoint_id.as_str()))
    }
}

pub(crate) fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// One shard file as the manifest records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShardEntry {
    /// File name inside the checkpoint directory (no directory components).
    pub file: String,
    /// Exact file size in bytes.
    pub size: u64,
    /// The shard's header length (the value of its 8-byte prefix).
    pub header_size: u64,
    /// CRC32 of the header JSON bytes (file bytes `[8, 8 + header_size)`).
    pub header_crc32: u32,
}

/// One tensor: as the manifest records it, and as [`crate::Checkpoint`] reports it for
/// every kind of store.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, unique in the checkpoint.
    pub name: String,
    /// Index into the shard list.
    pub shard: usize,
    /// Element type (safetensors wire name on disk).
    pub dtype: DType,
    /// Shape; empty for 0-dim.
    pub shape: Vec<u64>,
    /// Absolute byte range `[begin, end)` in the shard file.
    pub offsets: [u64; 2],
    /// CRC32 of the tensor's bytes. Always present in a manifest; `None` for tensors of
    /// foreign stores (plain safetensors, Hugging Face), which carry no checksums.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
    /// For F32 tensors whose values are all finite: the largest absolute value, recorded
    /// at save time so that an FP16-scaled load can scale in the same pass that checks the
    /// CRC (format-spec/manifest.md §Tensors). Written as the exact decimal value of the
    /// FP32 number widened to FP64, so every JSON reader gets it back exactly.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_absmax",
        deserialize_with = "de_absmax"
    )]
    pub absmax: Option<f32>,
    /// CRC32s of the tensor's bytes in fixed-size blocks, so that a read of part of a
    /// large tensor (a region) checks only the blocks it touches
    /// (format-spec/integrity.md §Block CRCs). Optional; readers that do not know it
    /// ignore it and check `crc32`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<BlockCrcs>,
}

/// Per-block CRC32s of one tensor: block `i` covers the tensor's bytes
/// `[i * size, min((i + 1) * size, nbytes))`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCrcs {
    /// Block size in bytes: a power of two in `[4096, 2^30]`.
    pub size: u64,
    /// One CRC32 per block, `ceil(nbytes / size)` of them (at least two), combining to
    /// the tensor's `crc32`.
    pub crc32: Vec<u32>,
}

fn ser_absmax<S: serde::Serializer>(v: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(x) => s.serialize_f64(f64::from(*x)),
        None => s.serialize_none(),
    }
}

fn de_absmax<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
    use serde::de::Error as _;
    let x = f64::deserialize(d)?;
    let f = x as f32;
    // Exactly an FP32 value, finite and non-negative: anything else is a bad manifest.
    if f64::from(f) != x || !f.is_finite() || f.is_sign_negative() {
        return Err(D::Error::custom(format!(
            "absmax {x} is not a finite, non-negative FP32 value"
        )));
    }
    Ok(Some(f))
}

impl TensorInfo {
    /// Size of the tensor's data in bytes.
    pub fn nbytes(&self) -> u64 {
        self.offsets[1].saturating_sub(self.offsets[0])
    }
}

/// The optimizer section (format-spec/optimizer.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OptimizerSection {
    /// Parameter groups in order.
    pub groups: Vec<GroupEntry>,
    /// Every parameter named by a group, with its shape and state.
    pub params: Vec<ParamEntry>,
}

/// One parameter group.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GroupEntry {
    /// Parameter names, in group order.
    pub params: Vec<String>,
    /// Hyperparameters (lr, betas, ...): a JSON object.
    #[serde(default = "empty_object")]
    pub hyper: serde_json::Value,
}

/// One parameter: its shape and its named state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ParamEntry {
    /// Parameter name.
    pub name: String,
    /// The parameter's shape.
    pub shape: Vec<u64>,
    /// Its state tensors; empty before the first step.
    #[serde(default)]
    pub state: Vec<StateEntry>,
}

/// One named state of a parameter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StateEntry {
    /// State name (`step`, `exp_avg`, ...).
    pub name: String,
    /// The tensor holding the values (or the FP16 codes, for `f16_scaled`).
    pub tensor: String,
    /// How the tensor encodes the state.
    pub encoding: Encoding,
    /// For `f16_scaled`: the F32 scale tensor (0-dim or `[1]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<String>,
}

/// How a state tensor encodes its values (format-spec/optimizer.md §Encodings).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// The tensor holds the values directly, in its dtype.
    Plain,
    /// F16 codes `q` and an F32 scale `s`; the value is `f32(q) * s`.
    F16Scaled,
}

/// One global tensor (`globals[g]`): its dtype, global shape and the chunks that tile it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct GlobalEntry {
    /// The global tensor's name: unique among globals and distinct from every name in
    /// `tensors`.
    pub name: String,
    /// Element type, the same for every chunk.
    pub dtype: DType,
    /// The global shape; `[]` for a 0-dim tensor (one chunk of shape `[]`).
    pub global_shape: Vec<u64>,
    /// The chunks, in any order; together they cover every element exactly once. Empty
    /// in a two-level manifest (feature `parts`), whose chunks live in the part indexes.
    pub chunks: Vec<ChunkEntry>,
    /// In a two-level manifest: the index in the manifest's `grids` of this global's chunk
    /// grid (absent for a global of zero elements, which has no chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid: Option<u32>,
}

/// One chunk of a global tensor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChunkEntry {
    /// Where the chunk starts in the global index space, one entry per dimension.
    pub offsets: Vec<u64>,
    /// The chunk's shape (the stored tensor's shape).
    pub shape: Vec<u64>,
    /// The manifest tensor holding the chunk's elements, row-major.
    pub tensor: String,
    /// Other manifest tensors holding a copy of the same chunk (a replicated tensor saved
    /// by several ranks): same dtype, shape and CRC32 as `tensor`. Readers use `tensor`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
}

impl GlobalEntry {
    /// Number of elements of the global tensor, if it does not overflow.
    pub fn numel(&self) -> Option<u64> {
        checked_numel(&self.global_shape)
    }
}
