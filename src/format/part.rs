//! The part descriptor of a multi-rank save (format-spec/global.md §Parts): one rank's
//! shards, tensors and chunks, as JSON with the manifest's CRC trailer; its encoding,
//! decoding and internal checks, and the names of stored chunks. Writing parts and
//! committing them is in `write::parts`.

use serde::{Deserialize, Serialize};

use super::manifest::{self, DecodeError, NameIndex};
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

    /// For each chunk, the position in `tensors` of the tensor holding it (`None`: the part
    /// lists no tensor of that name). `write_part` stores the chunk tensors last, in chunk
    /// order, so each is first looked for at that position (a string comparison); only a
    /// part laid out otherwise is looked up by name, in `index` or one built here.
    /// Meaningful only for a part whose tensor names are unique (what [`Part::check`]
    /// checks before it asks).
    pub(crate) fn chunk_positions(&self, index: Option<&NameIndex>) -> Vec<Option<usize>> {
        let base = self.tensors.len().checked_sub(self.chunks.len());
        let mut built: Option<NameIndex> = None;
        self.chunks
            .iter()
            .enumerate()
            .map(|(j, c)| {
                let at = base.and_then(|b| b.checked_add(j));
                if let Some(at) =
                    at.filter(|&at| self.tensors.get(at).is_some_and(|t| t.name == c.tensor))
                {
                    return Some(at);
                }
                let ix = match index {
                    Some(ix) => ix,
                    None => built
                        .get_or_insert_with(|| NameIndex::build(&self.tensors).unwrap_or_default()),
                };
                ix.position(&self.tensors, &c.tensor)
            })
            .collect()
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
        let names = NameIndex::build(&self.tensors).map_err(|i| {
            let name = self.tensors.get(i).map_or("", |t| t.name.as_str());
            format!("tensor {name:?} is listed twice")
        })?;
        if let Some(t) = self.tensors.iter().find(|t| t.shard >= self.shards.len()) {
            return Err(format!(
                "tensor {:?} is in shard {}, but the part lists {} shards",
                t.name,
                t.shard,
                self.shards.len()
            ));
        }
        let mut is_chunk = vec![false; self.tensors.len()];
        for (c, pos) in self.chunks.iter().zip(self.chunk_positions(Some(&names))) {
            check_tensor_name(&c.global).map_err(|e| format!("chunk of {:?}: {e}", c.global))?;
            let (t, seen) = pos
                .and_then(|i| Some((self.tensors.get(i)?, is_chunk.get_mut(i)?)))
                .ok_or_else(|| {
                    format!(
                        "chunk of {:?} names tensor {:?}, which the part does not list",
                        c.global, c.tensor
                    )
                })?;
            if std::mem::replace(seen, true) {
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

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef";

    fn tensor(name: &str, shard: usize, crc: u32) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            shard,
            dtype: DType::U8,
            shape: vec![2],
            offsets: [0, 2],
            crc32: Some(crc),
            absmax: None,
            blocks: None,
        }
    }

    fn chunk(global: &str, row: u64, tensor: &str) -> PartChunk {
        PartChunk {
            global: global.into(),
            dtype: DType::U8,
            global_shape: vec![4, 2],
            offsets: vec![row, 0],
            shape: vec![1, 2],
            tensor: tensor.into(),
        }
    }

    /// A part with a whole tensor `w` and chunk tensors `names` (stored in that order),
    /// whose chunks are listed in `order` (indexes into `names`).
    fn part(names: &[&str], order: &[usize]) -> Part {
        let shard = ShardEntry {
            file: "shard.safetensors".into(),
            size: 64,
            header_size: 8,
            header_crc32: 0,
        };
        let mut tensors = vec![tensor("w", 0, 99)];
        for (i, n) in names.iter().enumerate() {
            let mut t = tensor(n, 0, i as u32);
            t.shape = vec![1, 2];
            tensors.push(t);
        }
        let chunks = order
            .iter()
            .map(|&i| chunk("g", i as u64, names[i]))
            .collect();
        Part::new(ID.into(), 0, vec![shard.clone(), shard], tensors, chunks)
    }

    #[test]
    fn chunk_positions_find_each_tensor_in_any_layout() {
        let names = ["g@0~r0", "g@1~r0", "g@2~r0", "g@3~r0"];
        // As write_part lays them out (the positional path), reversed, and one out of place
        // (the name lookup), with and without an index given.
        for order in [[0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3]] {
            let p = part(&names, &order);
            p.check().unwrap();
            let want: Vec<Option<usize>> = order.iter().map(|&i| Some(i + 1)).collect();
            assert_eq!(p.chunk_positions(None), want, "{order:?}");
            let ix = NameIndex::build(&p.tensors).unwrap();
            assert_eq!(p.chunk_positions(Some(&ix)), want, "{order:?}");
        }
        // Fewer tensors than chunks: no positional base, every name looked up.
        let mut p = part(&names, &[0, 1, 2, 3]);
        p.tensors.truncate(2);
        assert_eq!(p.chunk_positions(None), vec![Some(1), None, None, None]);
    }

    #[test]
    fn check_refuses_each_inconsistency() {
        let names = ["g@0~r0", "g@1~r0"];
        type Edit = fn(&mut Part);
        let cases: [(Edit, &str); 6] = [
            (
                |p| p.tensors[2].name = "w".into(),
                "tensor \"w\" is listed twice",
            ),
            (
                |p| p.tensors[0].shard = 2,
                "is in shard 2, but the part lists 2 shards",
            ),
            (
                |p| p.chunks[1].tensor = "nope".into(),
                "names tensor \"nope\", which the part does not list",
            ),
            (
                |p| p.chunks[1].tensor = "g@0~r0".into(),
                "tensor \"g@0~r0\" is listed as two chunks",
            ),
            (
                |p| p.chunks[0].offsets = vec![0],
                "do not have the global rank 2",
            ),
            (|p| p.chunks[0].dtype = DType::F32, "its tensor is U8"),
        ];
        part(&names, &[0, 1]).check().unwrap();
        for (edit, want) in cases {
            let mut p = part(&names, &[0, 1]);
            edit(&mut p);
            let e = p.check().unwrap_err();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
    }
}
