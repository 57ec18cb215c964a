//! Reading checkpoints: [`Checkpoint`] over ckptstore directories, plain safetensors files
//! and Hugging Face sharded directories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

mod catalog;
mod fill;
mod open;
mod parts;
mod pread;
mod readahead;
pub(crate) mod region;
#[cfg(feature = "s3")]
pub mod remote;
pub mod source;
mod storage;
pub use catalog::Entry;
pub(crate) use open::{open_native_retrying, read_capped};
pub use pread::{FileShard, ReadAt};
pub use readahead::{
    cached_pages, drop_page_cache, read_strategy, set_read_strategy, ReadStrategy,
};
pub(crate) use readahead::{in_order, with_readahead, Gate};
pub use region::{Region, StoredChunk};
pub use source::{Fetch, ShardSource};
pub use storage::Storage;

use crate::crc::crc32_parallel;
use crate::error::{Error, Result};
pub use crate::format::manifest::TensorInfo;
use crate::format::manifest::{Manifest, NameIndex, MANIFEST_FILE};
use crate::format::{header, META_CHECKPOINT_ID};
use crate::mmap::Map;
use crate::view::TensorView;

/// Reason given when a shard file the manifest lists does not exist.
pub(crate) const SHARD_MISSING: &str = "the file is missing";
/// The index file of a Hugging Face sharded directory.
pub const HF_INDEX_FILE: &str = "model.safetensors.index.json";

/// What kind of store a [`Checkpoint`] was opened from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// A ckptstore checkpoint directory: manifest plus shards, with CRC32 per tensor.
    Native,
    /// A single safetensors file (read-only, no checksums).
    Safetensors,
    /// A Hugging Face sharded directory with `model.safetensors.index.json` (read-only,
    /// no checksums).
    HfSharded,
}

/// One shard: its file name and its bytes (a read-only map, or any `AsRef<[u8]>`).
#[derive(Debug)]
pub struct Shard<B> {
    /// File name inside the checkpoint directory (or the path opened, for a single file).
    pub file: String,
    /// The whole file.
    pub bytes: B,
}

/// What [`Checkpoint::verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Tensors whose CRC32 was checked.
    pub tensors: usize,
    /// Bytes whose CRC32 was checked.
    pub bytes: u64,
    /// False for stores without checksums (plain safetensors, HF directories): only the
    /// structure was validated.
    pub checksummed: bool,
}

/// An open checkpoint: validated structure, no tensor data read.
///
/// Generic over where the shard bytes come from ([`ShardSource`]): [`Checkpoint::open`]
/// maps local shard files read-only ([`Map`]); tests and fuzzers run on `Vec<u8>`; an
/// object store's checkpoint is downloaded into buffers or read lazily by ranged requests
/// (`store::s3::RemoteShard`, [`remote::open_lazy`]). The catalog, checks and fresh-buffer reads
/// ([`Checkpoint::read_tensor`], [`Checkpoint::read_region`],
/// [`Checkpoint::stream_tensors`], [`Checkpoint::verify`]) work over any source;
/// zero-copy views ([`Checkpoint::tensor`]) need resident bytes (`S: AsRef<[u8]>`).
#[derive(Debug)]
pub struct Checkpoint<S = Map> {
    root: PathBuf,
    kind: Kind,
    shards: Vec<Shard<S>>,
    /// Tensors of foreign stores; native checkpoints keep theirs in the manifest.
    foreign: Vec<TensorInfo>,
    /// Name -> index into `tensors()`, hashing the names in place (no copies).
    by_name: NameIndex,
    metadata: serde_json::Value,
    manifest: Option<Manifest>,
    /// Global tensor name -> index into the manifest's `globals`.
    globals: HashMap<String, usize>,
    /// For each tensor of `tensors()`: the index of the global tensor it stores a chunk (or
    /// a replica of a chunk) of, or [`NOT_A_CHUNK`]; empty when there are no globals. Built
    /// by the first catalog call ([`Checkpoint::entries`]), so that `open` stays as cheap.
    chunk_of: std::sync::OnceLock<Vec<u32>>,
    /// Every tensor's CRC32 (and absmax) was checked against the manifest while the
    /// bytes were fetched into buffers this checkpoint owns and nobody can change (an
    /// object-store download, [`Checkpoint::accept_unit_sums`]): checks that would read
    /// them again are skipped.
    data_verified: bool,
    /// A two-level checkpoint's part indexes (feature `parts`), loaded on first use.
    parts: Option<parts::PartSet<S>>,
}

/// [`Checkpoint`]'s `chunk_of` entry of a whole tensor.
const NOT_A_CHUNK: u32 = u32::MAX;

/// The CRC32 of `bytes` and, if `with_abs`, the largest `|x|` bits of them read as
/// little-endian FP32 (0 otherwise): one piece's sums for
/// [`check_units`].
pub(crate) fn unit_sum(bytes: &[u8], with_abs: bool) -> (u32, u32) {
    let abs = if with_abs {
        crate::convert::absbits_le_bytes(bytes)
    } else {
        0
    };
    (crc32fast::hash(bytes), abs)
}

/// Judge tensor `t` from the sums ([`unit_sum`]: CRC32 and absmax bits) of its
/// consecutive `unit`-byte pieces, the last one shorter; errors name `file`. With block CRCs `unit` must
/// be the block size: each block is checked, then the blocks' combination against the
/// tensor's `crc32`; without, the pieces' CRCs are combined into the tensor's. `unit`
/// must be a multiple of 4 where an absmax is recorded (pieces start on elements).
pub(crate) fn check_units(
    t: &TensorInfo,
    file: &str,
    unit: u64,
    sums: &[(u32, u32)],
) -> Result<()> {
    let crcs: Vec<u32> = sums.iter().map(|s| s.0).collect();
    let combined = if let Some(bl) = &t.blocks {
        if bl.size != unit || bl.crc32.len() != sums.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: {} sums of {unit}-byte pieces for {} blocks of {}",
                t.name,
                sums.len(),
                bl.crc32.len(),
                bl.size
            )));
        }
        for (i, (&got, &expected)) in crcs.iter().zip(&bl.crc32).enumerate() {
            if got != expected {
                return Err(Error::ChecksumMismatch {
                    what: format!("tensor {:?}, block {i}", t.name),
                    shard: t.shard,
                    file: file.to_string(),
                    expected,
                    got,
                });
            }
        }
        // Counts were checked at open (M18), so this is `Some`.
        crate::crc::combine_blocks(&bl.crc32, bl.size, t.nbytes())
    } else {
        crate::crc::combine_blocks(&crcs, unit, t.nbytes())
    };
    // `None` (a count that does not fit) fails the check.
    check_crc_in(t, file, combined.unwrap_or(!t.crc32.unwrap_or(0)))?;
    let Some(recorded) = t.absmax else {
        return Ok(());
    };
    let bits = sums.iter().map(|s| s.1).max().unwrap_or(0);
    check_absmax_in(t, file, recorded, crate::convert::absmax_from_bits(bits))
}

/// Check `got` against the CRC32 the manifest records for `t` (in `file`).
pub(crate) fn check_crc_in(t: &TensorInfo, file: &str, got: u32) -> Result<()> {
    match t.crc32 {
        Some(expected) if expected != got => Err(Error::ChecksumMismatch {
            what: format!("tensor {:?}", t.name),
            shard: t.shard,
            file: file.to_string(),
            expected,
            got,
        }),
        _ => Ok(()),
    }
}

/// Check `actual` (`None`: a non-finite element) against the absmax recorded for `t`.
fn check_absmax_in(t: &TensorInfo, file: &str, recorded: f32, actual: Option<f32>) -> Result<()> {
    let actual = actual.unwrap_or(f32::INFINITY);
    if actual.to_bits() != recorded.to_bits() {
        return Err(Error::AbsmaxMismatch {
            tensor: t.name.clone(),
            shard: t.shard,
            file: file.to_string(),
            recorded,
            actual,
        });
    }
    Ok(())
}

pub(crate) use crate::format::manifest::decode_checked as decode_manifest;

impl<S> Checkpoint<S> {
    /// The same checkpoint over another storage type: `f` converts each shard's bytes (for
    /// example into [`Storage`], an enum over local maps and downloaded
    /// buffers). `f` must keep the bytes themselves unchanged.
    pub fn map_storage<C: 'static>(
        self,
        f: impl Fn(S) -> C + Clone + Send + Sync + 'static,
    ) -> Checkpoint<C>
    where
        S: Send + Sync + 'static,
    {
        let parts = self.parts.map(|p| p.map(f.clone()));
        Checkpoint {
            root: self.root,
            kind: self.kind,
            shards: self
                .shards
                .into_iter()
                .map(|s| Shard {
                    file: s.file,
                    bytes: f(s.bytes),
                })
                .collect(),
            foreign: self.foreign,
            by_name: self.by_name,
            metadata: self.metadata,
            manifest: self.manifest,
            globals: self.globals,
            chunk_of: self.chunk_of,
            // `f` keeps the bytes unchanged (its contract), so checks made still hold.
            data_verified: self.data_verified,
            parts,
        }
    }

    /// Rename the shards as errors and [`Checkpoint::shards`] show them (a checkpoint
    /// downloaded from an object store names them by URL). The bytes are unchanged.
    pub fn with_shard_names(mut self, mut f: impl FnMut(&str) -> String) -> Self {
        for s in &mut self.shards {
            s.file = f(&s.file);
        }
        self
    }

    /// Whether every tensor's CRC32 (and recorded absmax) was already checked, in buffers
    /// this checkpoint owns, while they were filled: a download from an object store sums
    /// each piece as it lands (`checkpoint::remote::open_with`). Then
    /// [`Checkpoint::verify`] reads no tensor data and checked reads skip the CRC. `false`
    /// for memory-mapped checkpoints (a file can change under a map, so every check reads
    /// it) and for a download whose check failed (`verify` reports the damage).
    pub fn data_verified(&self) -> bool {
        self.data_verified
    }

    /// The directory (or file's directory) the checkpoint was opened from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// What kind of store this is.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The manifest, for native checkpoints.
    pub fn manifest(&self) -> Option<&Manifest> {
        self.manifest.as_ref()
    }

    /// User metadata (for foreign stores: the safetensors `__metadata__` / HF index
    /// `metadata` as a JSON object).
    pub fn metadata(&self) -> &serde_json::Value {
        &self.metadata
    }

    /// Every tensor, in manifest (or header) order.
    pub fn tensors(&self) -> &[TensorInfo] {
        match &self.manifest {
            Some(m) => &m.tensors,
            None => &self.foreign,
        }
    }

    /// The shards, in index order.
    pub fn shards(&self) -> &[Shard<S>] {
        &self.shards
    }

    /// Look up a tensor's location.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`].
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        let tensors = self.tensors();
        self.by_name
            .get(tensors, name)
            .ok_or_else(|| Error::TensorNotFound {
                name: name.to_string(),
            })
    }

    pub(crate) fn check_crc(&self, t: &TensorInfo, got: u32) -> Result<()> {
        check_crc_in(t, &self.shards[t.shard].file, got)
    }

    /// Take the sums of every tensor's pieces, computed while the bytes arrived in this
    /// checkpoint's own buffers (`sums[i]` for `tensors()[i]`, in pieces of `units[i]`
    /// bytes; [`check_units`]). If every tensor passes, mark the data verified, so that
    /// [`Checkpoint::verify`] and checked reads do not read it again ([`data_verified`]).
    /// Otherwise change nothing: the checks run as usual and report the failure then.
    /// Only for storage that owns its bytes: nothing can change them after this.
    ///
    /// [`data_verified`]: Checkpoint::data_verified
    #[cfg_attr(not(feature = "s3"), allow(dead_code))] // the object-store download calls it
    pub(crate) fn accept_unit_sums(&mut self, units: &[u64], sums: &[Vec<(u32, u32)>]) {
        let ts = self.tensors();
        let ok =
            units.len() == ts.len()
                && sums.len() == ts.len()
                && ts.iter().zip(units).zip(sums).all(|((t, &unit), s)| {
                    check_units(t, &self.shards[t.shard].file, unit, s).is_ok()
                });
        self.data_verified |= ok;
    }

    fn check_absmax(&self, t: &TensorInfo, recorded: f32, actual: Option<f32>) -> Result<()> {
        check_absmax_in(t, &self.shards[t.shard].file, recorded, actual)
    }

    /// Check the optimizer section, if any, against the rules of format-spec/optimizer.md
    /// (groups, parameters, state entries and the tensors they reference). Cheap: reads no
    /// tensor data. [`Checkpoint::verify`] and [`Checkpoint::load_optimizer`] run it too.
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] naming the parameter and state.
    pub fn check_optimizer_section(&self) -> Result<()> {
        match self.manifest.as_ref().and_then(|m| m.optimizer.as_ref()) {
            // A state may be stored whole or as a global tensor (format-spec/global.md).
            Some(sec) => crate::format::optimizer::check_section(sec, |n| self.shape_of(n).ok()),
            None => Ok(()),
        }
    }

    /// Total bytes of tensor data.
    ///
    /// Of a two-level checkpoint, the root's own tensors only: its chunk tensors are listed
    /// in its parts ([`Checkpoint::stored_chunks`]).
    pub fn data_bytes(&self) -> u64 {
        self.tensors().iter().map(TensorInfo::nbytes).sum()
    }
}

impl<S: ShardSource> Checkpoint<S> {
    /// Release from this process the mapped pages of the stored tensor `name`, or of every
    /// chunk and replica of the global tensor `name` (they stay in the page cache; a later
    /// read maps them again): what a reader that streams a large checkpoint through calls
    /// after each tensor, so that its resident memory stays bounded. Nothing for storage the
    /// process owns or fetches.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`].
    pub fn release_pages(&self, name: &str) -> Result<()> {
        if let (Some(set), Some(&gi)) = (&self.parts, self.globals.get(name)) {
            for l in set.loaded() {
                for (_, ti) in l.chunks.get(&(gi as u32)).into_iter().flatten() {
                    if let Some(t) = l.ck.tensors().get(*ti) {
                        l.ck.shards[t.shard].bytes.release(t.offsets[0], t.nbytes());
                    }
                }
            }
            return Ok(());
        }
        if let Some(g) = self.global(name) {
            for c in &g.chunks {
                for t in std::iter::once(&c.tensor).chain(&c.replicas) {
                    let t = self.info(t)?;
                    self.shards[t.shard].bytes.release(t.offsets[0], t.nbytes());
                }
            }
            return Ok(());
        }
        let t = self.info(name)?;
        self.shards[t.shard].bytes.release(t.offsets[0], t.nbytes());
        Ok(())
    }

    /// Build a native checkpoint from manifest bytes and the shard files' bytes, given in
    /// the manifest's shard order. Performs every check [`Checkpoint::open`] does.
    ///
    /// # Errors
    /// As [`Checkpoint::open`]; [`Error::InvalidArgument`] if the number of shards differs
    /// from the manifest's, or for a two-level manifest (feature `parts`), whose part
    /// indexes and their shards are files this call is not given
    /// ([`Checkpoint::from_files`] takes them).
    pub fn from_parts(manifest_bytes: &[u8], shards: Vec<S>) -> Result<Self> {
        let ck = Self::from_manifest_bytes(manifest_bytes, shards)?;
        if ck.manifest().is_some_and(|m| !m.parts.is_empty()) {
            return Err(Error::InvalidArgument(
                "a two-level manifest (feature \"parts\") names part indexes that in-memory shard buffers cannot supply: open its directory or URL".into(),
            ));
        }
        Ok(ck)
    }

    /// [`Checkpoint::from_parts`] for any manifest; the caller attaches a two-level
    /// manifest's part indexes (`parts`).
    pub(crate) fn from_manifest_bytes(manifest_bytes: &[u8], shards: Vec<S>) -> Result<Self> {
        let (m, by_name) = decode_manifest(manifest_bytes, MANIFEST_FILE)?;
        if shards.len() != m.shards.len() {
            return Err(Error::InvalidArgument(format!(
                "{} shard buffers given for a manifest of {} shards",
                shards.len(),
                m.shards.len()
            )));
        }
        let shards = m
            .shards
            .iter()
            .zip(shards)
            .map(|(s, bytes)| Shard {
                file: s.file.clone(),
                bytes,
            })
            .collect();
        Self::build_native(PathBuf::new(), m, by_name, shards)
    }

    /// `by_name` indexes `m.tensors` (built by validation, which refuses a repeated name).
    fn build_native(
        root: PathBuf,
        m: Manifest,
        by_name: NameIndex,
        shards: Vec<Shard<S>>,
    ) -> Result<Self> {
        // Cheap per-shard checks (format-spec/integrity.md §Open): exact size, the header
        // length prefix, and the CRC of the header bytes. A header whose CRC matches is the
        // one written together with this manifest, so it need not be parsed again here;
        // `verify` parses and cross-checks every header.
        m.shards
            .par_iter()
            .zip(shards.par_iter())
            .enumerate()
            .map(|(i, (entry, shard))| {
                let (len, bytes) = (shard.bytes.len(), shard.bytes.head());
                let mismatch = |reason: String| Error::ShardMismatch {
                    shard: i,
                    file: entry.file.clone(),
                    reason,
                };
                if len != entry.size {
                    return Err(mismatch(format!(
                        "the file is {len} bytes but the manifest records {} (truncated or replaced)",
                        entry.size
                    )));
                }
                // size >= 8 + header_size was validated with the manifest.
                let prefix = bytes.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok());
                if prefix.map(u64::from_le_bytes) != Some(entry.header_size) {
                    return Err(mismatch(format!(
                        "the header length prefix differs from the manifest's {}",
                        entry.header_size
                    )));
                }
                let hjson = bytes.get(8..8 + entry.header_size as usize).unwrap_or(&[]);
                let got = crc32fast::hash(hjson);
                if got != entry.header_crc32 {
                    return Err(Error::ChecksumMismatch {
                        what: "shard header".into(),
                        shard: i,
                        file: entry.file.clone(),
                        expected: entry.header_crc32,
                        got,
                    });
                }
                Ok(())
            })
            .collect::<Vec<_>>()
            // The first failure in shard order, whichever thread found it first.
            .into_iter()
            .collect::<Result<()>>()?;

        let mut counts = vec![0usize; shards.len()];
        for t in &m.tensors {
            counts[t.shard] += 1; // shard indexes were validated with the manifest
        }
        if let Some(i) = counts.iter().position(|&c| c == 0) {
            return Err(Error::ShardMismatch {
                shard: i,
                file: m.shards[i].file.clone(),
                reason: "the manifest places no tensor in this shard".into(),
            });
        }
        Ok(Checkpoint {
            root,
            kind: Kind::Native,
            shards,
            foreign: Vec::new(),
            by_name,
            metadata: m.metadata.clone(),
            chunk_of: std::sync::OnceLock::new(),
            globals: m
                .globals
                .iter()
                .enumerate()
                .map(|(i, g)| (g.name.clone(), i))
                .collect(),
            manifest: Some(m),
            data_verified: false,
            parts: None,
        })
    }

    /// Parse every shard header and check that it describes exactly the tensors the
    /// manifest places in that shard, with the same dtype, shape and offsets, and carries
    /// this checkpoint's id (format-spec/integrity.md §Verify).
    fn check_headers(&self) -> Result<()> {
        let Some(m) = &self.manifest else {
            return Ok(());
        };
        let found: Vec<Result<()>> = self.shards.par_iter().enumerate().map(|(i, shard)| {
            let file = &shard.file;
            let mismatch = |reason: String| Error::ShardMismatch { shard: i, file: file.clone(), reason };
            let h = header::parse_head(shard.bytes.head(), shard.bytes.len())
                .map_err(|r| Error::header(file, r))?;
            match h.metadata.get(META_CHECKPOINT_ID) {
                Some(id) if *id == m.checkpoint_id => {}
                other => {
                    return Err(mismatch(format!(
                        "the shard belongs to checkpoint {other:?}, not {:?} (a shard from another checkpoint?)",
                        m.checkpoint_id
                    )))
                }
            }
            let mine: HashMap<&str, &TensorInfo> =
                self.tensors().iter().filter(|t| t.shard == i).map(|t| (t.name.as_str(), t)).collect();
            if mine.len() != h.tensors.len() {
                return Err(mismatch(format!(
                    "the shard header lists {} tensors but the manifest places {} here",
                    h.tensors.len(),
                    mine.len()
                )));
            }
            let ds = h.data_start();
            for he in &h.tensors {
                let t = mine.get(he.name.as_str()).ok_or_else(|| {
                    mismatch(format!("the header lists tensor {:?}, which the manifest does not place here", he.name))
                })?;
                let abs = [he.data_offsets[0] + ds, he.data_offsets[1] + ds];
                if he.dtype != t.dtype || he.shape != t.shape || abs != t.offsets {
                    return Err(mismatch(format!(
                        "tensor {:?}: header says {} {:?} at {:?}, manifest says {} {:?} at {:?}",
                        t.name, he.dtype, he.shape, abs, t.dtype, t.shape, t.offsets
                    )));
                }
            }
            Ok(())
        }).collect();
        // The first failure in shard order.
        found.into_iter().collect()
    }

    /// Open one safetensors file held in `bytes` (read-only, no checksums).
    ///
    /// # Errors
    /// [`Error::InvalidHeader`] if the header is malformed.
    pub fn from_safetensors(path: PathBuf, bytes: S) -> Result<Self> {
        let file = path.display().to_string();
        let mut ck = Self::from_foreign(path, Kind::Safetensors, vec![Shard { file, bytes }])?;
        ck.root = ck.root.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(ck)
    }

    fn from_foreign(root: PathBuf, kind: Kind, shards: Vec<Shard<S>>) -> Result<Self> {
        let headers = shards
            .par_iter()
            .map(|s| {
                header::parse_head(s.bytes.head(), s.bytes.len())
                    .map_err(|r| Error::header(&s.file, r))
            })
            .collect::<Vec<_>>()
            // The first failure in shard order (rayon's own would be the first in time).
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        let mut tensors = Vec::new();
        let mut metadata = serde_json::Map::new();
        for (i, h) in headers.into_iter().enumerate() {
            let ds = h.data_start();
            for (k, v) in h.metadata {
                metadata.insert(k, serde_json::Value::String(v));
            }
            for e in h.tensors {
                tensors.push(TensorInfo {
                    name: e.name,
                    dtype: e.dtype,
                    shape: e.shape,
                    shard: i,
                    offsets: [e.data_offsets[0] + ds, e.data_offsets[1] + ds],
                    crc32: None,
                    absmax: None,
                    blocks: None,
                });
            }
        }
        let by_name = NameIndex::build(&tensors).map_err(|i| {
            let t = &tensors[i];
            Error::header(
                &shards[t.shard].file,
                format!("tensor {:?} is also held by another shard file", t.name),
            )
        })?;
        Ok(Checkpoint {
            root,
            kind,
            shards,
            foreign: tensors,
            by_name,
            metadata: metadata.into(),
            manifest: None,
            globals: HashMap::new(),
            chunk_of: std::sync::OnceLock::new(),
            data_verified: false,
            parts: None,
        })
    }

    /// Check everything `open` does not: parse every shard header and check it agrees
    /// with the manifest (names, dtypes, shapes, offsets, checkpoint id), check the
    /// optimizer section's references, and check the CRC32 of every tensor, rayon-parallel
    /// across tensors and within large ones.
    ///
    /// # Errors
    /// [`Error::InvalidHeader`] / [`Error::ShardMismatch`] for a header that disagrees with
    /// the manifest; [`Error::InvalidOptimizerState`] for a broken optimizer section;
    /// [`Error::ChecksumMismatch`] naming the shard and tensor of the first mismatch in
    /// manifest order; [`Error::AbsmaxMismatch`] if an F32 tensor's recorded absmax is not
    /// its data's (checked in the same pass as its CRC). For stores without checksums the structure was validated at open
    /// and the report says `checksummed: false`.
    pub fn verify(&self) -> Result<VerifyReport> {
        self.verify_with_progress(&|_| {})
    }

    /// [`Checkpoint::verify`], calling `progress` with the byte count of each tensor checked.
    ///
    /// # Errors
    /// As [`Checkpoint::verify`].
    pub fn verify_with_progress(&self, progress: &(dyn Fn(u64) + Sync)) -> Result<VerifyReport> {
        self.check_headers()?;
        self.check_optimizer_section()?;
        if self.kind != Kind::Native {
            return Ok(VerifyReport {
                tensors: 0,
                bytes: 0,
                checksummed: false,
            });
        }
        let first_bad = if self.resident() {
            self.tensors()
                .par_iter()
                .enumerate()
                .filter_map(|(i, t)| {
                    let r = self.check_tensor(t);
                    progress(t.nbytes());
                    r.err().map(|e| (i, e))
                })
                .min_by_key(|(i, _)| *i)
        } else {
            // Fetched shards: one tensor at a time (memory stays about one tensor), in
            // file order, each CRC-checked as its bytes land; the first failure in
            // manifest order is reported, as for resident shards.
            let mut bad: Option<(usize, Error)> = None;
            for (i, t) in self.in_file_order() {
                if !self.data_verified {
                    if let Err(e) = self.read_info(t) {
                        if bad.as_ref().is_none_or(|(j, _)| i < *j) {
                            bad = Some((i, e));
                        }
                    }
                }
                progress(t.nbytes());
            }
            bad
        };
        if let Some((_, e)) = first_bad {
            return Err(e);
        }
        let mut report = VerifyReport {
            tensors: self.tensors().len(),
            bytes: self.tensors().iter().map(TensorInfo::nbytes).sum(),
            checksummed: true,
        };
        // A two-level checkpoint: every part, each checked as a checkpoint of its own.
        if let Some(set) = &self.parts {
            for p in 0..set.len() {
                let l = self.part(p as u32)?;
                let r = l.ck.verify_with_progress(progress)?;
                report.tensors += r.tensors;
                report.bytes += r.bytes;
            }
        }
        Ok(report)
    }

    /// Whether this is a two-level checkpoint (feature `parts`, format-spec/global.md §The
    /// two-level manifest), whose chunk entries live in part indexes read on first use.
    pub fn two_level(&self) -> bool {
        self.parts.is_some()
    }

    /// Of a two-level checkpoint: how many part indexes have been read so far, and their
    /// bytes (the metadata decoded besides the root manifest). `(0, 0)` otherwise.
    pub fn parts_read(&self) -> (usize, u64) {
        self.parts
            .as_ref()
            .map_or((0, 0), |p| (p.loaded_count(), p.index_bytes()))
    }

    /// The CRC32 of one tensor and, where the manifest records one, its absmax: both in
    /// one pass over the bytes.
    ///
    /// With block CRCs (format-spec/integrity.md §Block CRCs) the pass computes each
    /// block's CRC (and absmax bits), checks every block, and checks that the blocks
    /// combine to the tensor's `crc32`.
    fn check_tensor(&self, t: &TensorInfo) -> Result<()> {
        if self.data_verified {
            return Ok(());
        }
        let Some(bytes) = self.stored_bytes(t) else {
            return self.read_info(t).map(drop);
        };
        let v = TensorView::new(&t.name, t.dtype, &t.shape, bytes);
        if let Some(bl) = &t.blocks {
            let with_abs = t.absmax.is_some();
            let sums: Vec<(u32, u32)> = v
                .bytes()
                .par_chunks(usize::try_from(bl.size).unwrap_or(usize::MAX))
                .map(|c| unit_sum(c, with_abs))
                .collect();
            return check_units(t, &self.shards[t.shard].file, bl.size, &sums);
        }
        let Some(recorded) = t.absmax else {
            return self.check_crc(t, crc32_parallel(v.bytes()));
        };
        let (crc, actual) = match v.as_slice::<f32>() {
            Ok(x) => crate::convert::crc32_and_absmax_f32(v.bytes(), x),
            Err(_) => (
                crc32_parallel(v.bytes()),
                crate::convert::absmax_f32_le_bytes(v.bytes()),
            ),
        };
        self.check_crc(t, crc)?;
        self.check_absmax(t, recorded, actual)
    }

    /// Whether every shard's bytes are resident ([`ShardSource::bytes`]): then reads are
    /// zero-copy views and fresh-buffer reads are copies; otherwise they are fetches.
    pub fn resident(&self) -> bool {
        self.shards.iter().all(|s| s.bytes.bytes().is_some())
    }

    /// The stored bytes of `t` where its shard is resident (offsets were validated against
    /// the shard's length when the checkpoint was built).
    pub(crate) fn stored_bytes(&self, t: &TensorInfo) -> Option<&[u8]> {
        let b = self.shards.get(t.shard)?.bytes.bytes()?;
        b.get(usize::try_from(t.offsets[0]).ok()?..usize::try_from(t.offsets[1]).ok()?)
    }

    /// Every tensor with its index in [`Checkpoint::tensors`], in file order (shard, offset).
    pub(crate) fn in_file_order(&self) -> Vec<(usize, &TensorInfo)> {
        let mut order: Vec<(usize, &TensorInfo)> = self.tensors().iter().enumerate().collect();
        order.sort_by_key(|(_, t)| (t.shard, t.offsets[0]));
        order
    }

    /// Tensor `name` (a whole stored tensor) in a freshly allocated buffer, its CRC32 (and
    /// absmax, block CRCs) checked as the bytes were copied or fetched: one pass over the
    /// bytes, rayon-parallel for resident shards, concurrent ranged requests for fetched
    /// ones. For a global tensor use [`Checkpoint::read_global`].
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::ChecksumMismatch`] / [`Error::AbsmaxMismatch`]
    /// naming the tensor, block and shard for damaged bytes (nothing is returned); the
    /// source's errors for a fetch that fails.
    pub fn read_tensor(&self, name: &str) -> Result<crate::tensor::Tensor> {
        self.read_info(self.info(name)?)
    }

    /// [`Checkpoint::read_tensor`] of a tensor of this checkpoint.
    pub(crate) fn read_info(&self, t: &TensorInfo) -> Result<crate::tensor::Tensor> {
        let shard = self
            .shards
            .get(t.shard)
            .ok_or_else(|| Error::TensorNotFound {
                name: t.name.clone(),
            })?;
        let mut out = crate::tensor::Tensor::zeros(t.dtype, &t.shape)?;
        let step = shard.bytes.fetch_size();
        let mut jobs = Vec::new();
        let summed = source::plan_summed_or_plain(
            t.shard,
            t.offsets[0],
            out.bytes_mut(),
            &[(0, t)],
            step,
            &mut jobs,
        );
        S::fetch(&self.shards, &mut jobs)?;
        if !jobs.iter().all(Fetch::is_complete) {
            return Err(Error::ShardMismatch {
                shard: t.shard,
                file: shard.file.clone(),
                reason: format!("a read of tensor {:?} came back short", t.name),
            });
        }
        let sums = summed
            .then(|| source::gather_sums(&[t], step, jobs))
            .flatten();
        if self.data_verified {
            return Ok(out);
        }
        match sums {
            Some((units, per)) => check_units(t, &shard.file, units[0], &per[0])?,
            None => self.check_crc(t, crc32_parallel(out.bytes()))?,
        }
        Ok(out)
    }

    /// Stream every tensor, in file order, into a freshly allocated buffer handed to `f`,
    /// checking each tensor's CRC32 (native checkpoints) as it is copied or fetched, and
    /// releasing the shard bytes it was read from (mapped pages). Resident memory stays
    /// bounded by about `budget` bytes plus the buffers `f` keeps, however large the
    /// checkpoint: restore a model larger than memory by moving each tensor on (to a
    /// device, say) and dropping it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if one tensor is larger than `budget` (than half of it
    /// for resident shards: a tensor in flight costs its buffer and, briefly, its mapped
    /// pages); [`Error::ChecksumMismatch`] for damaged bytes; the source's errors for a
    /// fetch that fails; any error `f` returns (which stops the stream).
    pub fn stream_tensors(
        &self,
        budget: u64,
        mut f: impl FnMut(&TensorInfo, crate::tensor::Tensor) -> Result<()>,
    ) -> Result<()> {
        let (factor, why) = if self.resident() {
            (2, "twice that (its buffer and its mapped pages)")
        } else {
            (1, "that (its buffer)")
        };
        if let Some(t) = self
            .tensors()
            .iter()
            .find(|t| t.nbytes().saturating_mul(factor) > budget)
        {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?} is {} bytes: streaming it needs {why}, over the budget of {budget} bytes",
                t.name,
                t.nbytes()
            )));
        }
        for (_, t) in self.in_file_order() {
            let shard = &self.shards[t.shard];
            shard.bytes.advise_sequential();
            let x = self.read_info(t);
            shard.bytes.release(t.offsets[0], t.nbytes());
            f(t, x?)?;
        }
        Ok(())
    }
}

impl<B: AsRef<[u8]> + Send + Sync> Checkpoint<B> {
    /// A zero-copy view of a tensor. Does not check its CRC; see [`Checkpoint::verify`] and
    /// [`Checkpoint::tensor_verified`].
    ///
    /// # Errors
    /// [`Error::TensorNotFound`].
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let t = self.info(name)?;
        Ok(self.view(t))
    }

    pub(crate) fn view<'a>(&'a self, t: &'a TensorInfo) -> TensorView<'a> {
        // Offsets were validated against the shard's length when the checkpoint was built.
        let bytes = self.shards[t.shard]
            .bytes
            .as_ref()
            .get(t.offsets[0] as usize..t.offsets[1] as usize)
            .unwrap_or(&[]);
        TensorView::new(&t.name, t.dtype, &t.shape, bytes)
    }

    /// A zero-copy view of a tensor whose CRC32 was checked just now.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::ChecksumMismatch`] if the bytes are damaged.
    pub fn tensor_verified(&self, name: &str) -> Result<TensorView<'_>> {
        let t = self.info(name)?;
        let v = self.view(t);
        if !self.data_verified {
            self.check_crc(t, crc32_parallel(v.bytes()))?;
        }
        Ok(v)
    }
}

impl Checkpoint<Map> {
    /// Paths of the shard files, in shard order.
    pub fn shard_paths(&self) -> Vec<PathBuf> {
        self.shards
            .iter()
            .map(|s| match self.kind {
                Kind::Safetensors => PathBuf::from(&s.file),
                _ => self.root.join(&s.file),
            })
            .collect()
    }
}

impl<B: AsRef<[u8]> + Send + Sync + crate::mmap::ReleasePages> Checkpoint<B> {
    /// Release the mapped pages of tensor `t` from this process (they stay in the page
    /// cache; a later read maps them again). Nothing for storage the process owns.
    pub(crate) fn release_tensor(&self, t: &TensorInfo) {
        self.shards[t.shard]
            .bytes
            .release_pages(t.offsets[0] as usize, t.nbytes() as usize);
    }

    /// Check the CRC32 of every tensor named (rayon-parallel across tensors and within large
    /// ones, with read-ahead of cold bytes), releasing each tensor's mapped pages from this
    /// process afterwards when `release` is set.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] for an unknown name (before anything is read);
    /// [`Error::ChecksumMismatch`] for damaged bytes (the first in `names` order).
    pub fn verify_tensors(&self, names: &[&str], release: bool) -> Result<()> {
        let infos: Vec<&TensorInfo> = names.iter().map(|n| self.info(n)).collect::<Result<_>>()?;
        let ranges = self.ranges_in_file_order(&infos);
        let first_bad = with_readahead(&ranges, false, |_| {
            infos
                .par_iter()
                .enumerate()
                .filter_map(|(i, t)| {
                    let r = self.check_crc(t, crc32_parallel(self.view(t).bytes()));
                    if release {
                        self.release_tensor(t);
                    }
                    r.err().map(|e| (i, e))
                })
                .min_by_key(|(i, _)| *i)
        });
        match first_bad {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Copy the stored bytes of tensor `name` into `dst` (exactly its byte length),
    /// rayon-parallel, releasing its mapped pages afterwards when `release` is set. The
    /// CRC is not checked here: check it first ([`Checkpoint::verify_tensors`]).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] if `dst` is not exactly the
    /// tensor's byte length.
    pub fn copy_tensor_into_unchecked(
        &self,
        name: &str,
        dst: &mut [u8],
        release: bool,
    ) -> Result<()> {
        let t = self.info(name)?;
        let src = self.view(t).bytes();
        if src.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {name:?} is {} bytes, the destination {} bytes",
                src.len(),
                dst.len()
            )));
        }
        crate::convert::copy_bytes(src, dst);
        if release {
            self.release_tensor(t);
        }
        Ok(())
    }

    /// [`Checkpoint::copy_tensor_into_unchecked`] (the old name, which did not say that the
    /// CRC is not checked).
    ///
    /// # Errors
    /// As [`Checkpoint::copy_tensor_into_unchecked`].
    #[deprecated(note = "renamed copy_tensor_into_unchecked: it does not check the CRC")]
    pub fn copy_tensor_into(&self, name: &str, dst: &mut [u8], release: bool) -> Result<()> {
        self.copy_tensor_into_unchecked(name, dst, release)
    }
}

/// For each tensor of `m`: the global tensor it stores a chunk or replica of (its index in
/// `m.globals`), or [`NOT_A_CHUNK`]. Empty without globals. Every chunk and replica names a
/// manifest tensor (rule G2, checked with the manifest); a name not found is left a whole
/// tensor here and reported by the region reads that need it.
pub(crate) fn chunk_owners(m: &Manifest, by_name: &NameIndex) -> Vec<u32> {
    if m.globals.is_empty() {
        return Vec::new();
    }
    let mut of = vec![NOT_A_CHUNK; m.tensors.len()];
    for (g, entry) in m.globals.iter().enumerate() {
        // At most MAX_TENSORS (< 2^32) globals: each has a chunk.
        let g = u32::try_from(g).unwrap_or(NOT_A_CHUNK);
        for c in &entry.chunks {
            for name in std::iter::once(&c.tensor).chain(&c.replicas) {
                if let Some(i) = by_name.position(&m.tensors, name) {
                    of[i] = g;
                }
            }
        }
    }
    of
}
