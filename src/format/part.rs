//! The part descriptor of a multi-rank save (format-spec/global.md §Parts): one rank's
//! shards, tensors and chunks, as JSON with the manifest's CRC trailer; its encoding,
//! decoding and internal checks, and the names of stored chunks. Writing parts and
//! committing them is in `write::parts`.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::manifest::{self, DecodeError};
use super::names::{is_id, part_file_name};
use super::schema::{ShardEntry, TensorInfo};
use super::{check_tensor_name, MAX_RANK, MAX_SHARDS, MAX_TENSORS};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The `format` member of a part descriptor.
pub const PART_FORMAT: &str = "ckptstore-part";
/// The part descriptor version this build writes and reads.
pub const PART_VERSION: u64 = 1;
/// One chunk listed by a part descriptor: which stored tensor of the part holds which box
/// of which global tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartChunk {
    /// The global tensor's name.
    pub global: String,
    /// The global tensor's dtype.
    pub dtype: DType,
    /// The global tensor's shape.
    pub global_shape: Vec<u64>,
    /// Where the chunk starts.
    pub offsets: Vec<u64>,
    /// The chunk's shape.
    pub shape: Vec<u64>,
    /// The part's tensor holding the chunk.
    pub tensor: String,
}

/// A decoded part descriptor (format-spec/global.md §Parts): one rank's contribution.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    /// The checkpoint id the part was written for.
    pub checkpoint_id: String,
    /// The rank that wrote it.
    pub rank: u32,
    /// The rank's shard files (`shard-<id>-r<rank>-<k>.safetensors`, `k` = index).
    pub shards: Vec<ShardEntry>,
    /// Every tensor of those shards; `shard` indexes into [`Part::shards`].
    pub tensors: Vec<TensorInfo>,
    /// Which tensors are chunks of which global tensors.
    pub chunks: Vec<PartChunk>,
    /// The size and CRC32 of the descriptor's bytes as written or read (set by
    /// `write_part` and [`Part::from_bytes`]): what a two-level root records for the file.
    pub(crate) encoded: Option<(u64, u32)>,
}

/// The descriptor as stored (member order as in format-spec/global.md).
#[derive(Serialize, Deserialize)]
struct Wire {
    format: String,
    version: u64,
    checkpoint_id: String,
    rank: u32,
    shards: Vec<ShardEntry>,
    tensors: Vec<TensorInfo>,
    chunks: Vec<PartChunk>,
}

impl Part {
    /// A descriptor from its members, for tools that write a rank's shards themselves
    /// (converters, simulations); `write_part` returns one for shards it wrote. Checked by
    /// the commit (format-spec/global.md §The commit) like any other.
    pub fn new(
        checkpoint_id: String,
        rank: u32,
        shards: Vec<ShardEntry>,
        tensors: Vec<TensorInfo>,
        chunks: Vec<PartChunk>,
    ) -> Part {
        Part {
            checkpoint_id,
            rank,
            shards,
            tensors,
            chunks,
            encoded: None,
        }
    }

    /// The descriptor's bytes: JSON with the manifest's CRC trailer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let w = Wire {
            format: PART_FORMAT.into(),
            version: PART_VERSION,
            checkpoint_id: self.checkpoint_id.clone(),
            rank: self.rank,
            shards: self.shards.clone(),
            tensors: self.tensors.clone(),
            chunks: self.chunks.clone(),
        };
        // Serializing plain data into a Vec cannot fail.
        let mut body = serde_json::to_vec(&w).unwrap_or_default();
        body.pop(); // the closing brace; the trailer replaces it
        manifest::append_trailer(body)
    }

    /// Decode and check a part descriptor: trailer CRC, format `ckptstore-part`, version 1,
    /// and its internal consistency (shard indexes, chunk tensors, ranks of shapes).
    ///
    /// # Errors
    /// [`Error::InvalidPart`] saying what is wrong. Never panics, whatever the bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Part> {
        decode_part(bytes, "part descriptor")
    }

    /// The size and CRC32 of the descriptor's bytes: as written or read, else encoded now.
    pub(crate) fn size_and_crc(&self) -> (u64, u32) {
        self.encoded.unwrap_or_else(|| {
            let b = self.to_bytes();
            (b.len() as u64, crc32fast::hash(&b))
        })
    }

    /// The descriptor's file name, `part-<id>-r<rank>.json`.
    pub fn file_name(&self) -> String {
        part_file_name(&self.checkpoint_id, self.rank)
    }

    /// Internal consistency (everything that needs no file and no other part).
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        if !is_id(&self.checkpoint_id) {
            return Err(format!(
                "checkpoint_id {:?} is not 32 lowercase hex digits",
                self.checkpoint_id
            ));
        }
        if self.shards.len() > MAX_SHARDS || self.tensors.len() > MAX_TENSORS {
            return Err(format!(
                "{} shards and {} tensors exceed the format's limits",
                self.shards.len(),
                self.tensors.len()
            ));
        }
        let mut names: HashMap<&str, &TensorInfo> = HashMap::with_capacity(self.tensors.len());
        for t in &self.tensors {
            if t.shard >= self.shards.len() {
                return Err(format!(
                    "tensor {:?} is in shard {}, but the part lists {} shards",
                    t.name,
                    t.shard,
                    self.shards.len()
                ));
            }
            if names.insert(t.name.as_str(), t).is_some() {
                return Err(format!("tensor {:?} is listed twice", t.name));
            }
        }
        let mut chunk_tensors = HashSet::new();
        for c in &self.chunks {
            check_tensor_name(&c.global).map_err(|e| format!("chunk of {:?}: {e}", c.global))?;
            let t = names.get(c.tensor.as_str()).ok_or_else(|| {
                format!(
                    "chunk of {:?} names tensor {:?}, which the part does not list",
                    c.global, c.tensor
                )
            })?;
            if !chunk_tensors.insert(c.tensor.as_str()) {
                return Err(format!("tensor {:?} is listed as two chunks", c.tensor));
            }
            let r = c.global_shape.len();
            if r > MAX_RANK || c.offsets.len() != r || c.shape.len() != r {
                return Err(format!(
                    "chunk {:?} of {:?}: offsets {:?} and shape {:?} do not have the global rank {r} (at most {MAX_RANK})",
                    c.tensor, c.global, c.offsets, c.shape
                ));
            }
            if t.dtype != c.dtype || t.shape != c.shape {
                return Err(format!(
                    "chunk {:?} of {:?} is {} {:?}, its tensor is {} {:?}",
                    c.tensor, c.global, c.dtype, c.shape, t.dtype, t.shape
                ));
            }
        }
        Ok(())
    }
}

/// [`Part::from_bytes`], naming the descriptor `what` in errors.
pub(crate) fn decode_part(bytes: &[u8], what: &str) -> Result<Part> {
    let bad = |reason: String| Error::InvalidPart {
        part: what.to_string(),
        reason,
    };
    manifest::check_trailer(bytes).map_err(|e| match e {
        DecodeError::Checksum { expected, got } => bad(format!(
            "CRC32 mismatch: the trailer records {expected:08x}, the bytes have {got:08x} (a damaged or edited descriptor)"
        )),
        other => bad(decode_reason(other)),
    })?;
    #[derive(Deserialize)]
    struct Head {
        format: String,
        version: u64,
    }
    let head: Head = serde_json::from_slice(bytes).map_err(|e| bad(format!("JSON: {e}")))?;
    if head.format != PART_FORMAT {
        return Err(bad(format!(
            "format is {:?}, expected {PART_FORMAT:?}",
            head.format
        )));
    }
    if head.version != PART_VERSION {
        return Err(bad(format!(
            "version {} is not supported (this build reads version {PART_VERSION})",
            head.version
        )));
    }
    let w: Wire = serde_json::from_slice(bytes).map_err(|e| bad(format!("JSON: {e}")))?;
    let p = Part {
        checkpoint_id: w.checkpoint_id,
        rank: w.rank,
        shards: w.shards,
        tensors: w.tensors,
        chunks: w.chunks,
        encoded: Some((bytes.len() as u64, crc32fast::hash(bytes))),
    };
    p.check().map_err(|r| Error::InvalidPart {
        part: format!("{what} (rank {})", p.rank),
        reason: r,
    })?;
    Ok(p)
}

pub(crate) fn decode_reason(e: DecodeError) -> String {
    match e {
        DecodeError::Checksum { expected, got } => {
            format!("CRC32 mismatch: recorded {expected:08x}, computed {got:08x}")
        }
        DecodeError::Version(v) => format!("unsupported version {v}"),
        DecodeError::Feature(f) => format!("requires unknown feature {f:?}"),
        DecodeError::Invalid(r) => r,
    }
}

/// The name under which rank `rank` stores the chunk of `global` starting at `offsets`:
/// `<global>@<o0>,<o1>,...~r<rank>` (`<global>@~r<rank>` for 0-dim). The rank suffix keeps
/// copies of one chunk written by several ranks (replicas) distinct.
pub fn chunk_tensor_name(global: &str, offsets: &[u64], rank: u32) -> String {
    let o: Vec<String> = offsets.iter().map(u64::to_string).collect();
    format!("{global}@{}~r{rank}", o.join(","))
}
