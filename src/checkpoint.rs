//! Reading checkpoints: [`Checkpoint`] over ckptstore directories, plain safetensors files
//! and Hugging Face sharded directories.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

mod build;
mod catalog;
mod fill;
mod open;
mod parts;
mod pread;
mod read;
mod readahead;
pub(crate) mod region;
#[cfg(feature = "s3")]
pub mod remote;
pub mod source;
mod storage;
mod verify;
use build::chunk_owners;
pub use catalog::{Catalog, Entry};
pub(crate) use open::{open_native_retrying, read_capped};
pub use pread::{FileShard, ReadAt};
pub use read::{Batch, Read, ReadPlan};
pub use readahead::{
    cached_pages, drop_page_cache, read_strategy, set_read_strategy, ReadStrategy,
};
pub(crate) use readahead::{in_order, with_readahead, Gate};
pub use region::{Region, StoredChunk};
pub use source::{Fetch, ShardSource};
pub use storage::Storage;
pub use verify::VerifyOptions;
pub(crate) use verify::{check_units, unit_sum};

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
/// (`store::s3::RemoteShard`, `remote::open_lazy`). The catalog ([`Checkpoint::catalog`]),
/// the checks and the reads ([`Checkpoint::read`], [`Checkpoint::read_batch`],
/// [`Checkpoint::stream_tensors`], [`Checkpoint::verify`]) work over any source;
/// zero-copy views ([`Read::view`]) need resident bytes ([`Checkpoint::resident`]).
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
    /// by the first catalog call ([`Catalog::entries`]), so that `open` stays as cheap.
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
    pub(crate) fn with_shard_names(mut self, mut f: impl FnMut(&str) -> String) -> Self {
        for s in &mut self.shards {
            s.file = f(&s.file);
        }
        self
    }

    /// Whether every tensor's CRC32 (and recorded absmax) was already checked, in buffers
    /// this checkpoint owns, while they were filled: a download from an object store sums
    /// each piece as it lands (`checkpoint::remote::open_with`). Then
    /// [`Checkpoint::verify`] reads no tensor data and checked reads rely on those sums. `false`
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
    /// in its parts ([`Catalog::stored_chunks`]).
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

    /// A whole stored tensor of this checkpoint in a fresh buffer, checked ([`Read::to_tensor`]).
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
    pub(crate) fn view<'a>(&'a self, t: &'a TensorInfo) -> TensorView<'a> {
        // Offsets were validated against the shard's length when the checkpoint was built.
        let bytes = self.shards[t.shard]
            .bytes
            .as_ref()
            .get(t.offsets[0] as usize..t.offsets[1] as usize)
            .unwrap_or(&[]);
        TensorView::new(&t.name, t.dtype, &t.shape, bytes)
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
}

impl<S: ShardSource> Checkpoint<S> {
    /// Check the CRC32 of every tensor named (rayon-parallel across tensors and within large
    /// ones, with read-ahead of cold bytes), releasing each tensor's mapped pages from this
    /// process afterwards when `release` is set, calling `progress` with each tensor's byte
    /// count. From shards that are not resident, each tensor is fetched and checked in turn.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] for an unknown name (before anything is read);
    /// [`Error::ChecksumMismatch`] for damaged bytes (the first in `names` order).
    pub(crate) fn verify_tensors(
        &self,
        names: &[&str],
        release: bool,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        let infos: Vec<&TensorInfo> = names.iter().map(|n| self.info(n)).collect::<Result<_>>()?;
        if !self.resident() {
            for t in infos {
                self.read_info(t)?;
                progress(t.nbytes());
            }
            return Ok(());
        }
        let ranges = self.ranges_in_file_order(&infos);
        let first_bad = with_readahead(&ranges, false, |_| {
            infos
                .par_iter()
                .enumerate()
                .filter_map(|(i, t)| {
                    let bytes = self.stored_bytes(t).unwrap_or(&[]);
                    let r = self.check_crc(t, crc32_parallel(bytes));
                    progress(t.nbytes());
                    if release {
                        self.shards[t.shard].bytes.release(t.offsets[0], t.nbytes());
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

    /// Copy the stored bytes of tensor `t` (resident) into `dst` (exactly its byte length),
    /// rayon-parallel, releasing its mapped pages afterwards when `release` is set. The
    /// CRC is not checked here.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `dst` is not exactly the tensor's byte length.
    pub(crate) fn copy_tensor_into_unchecked(
        &self,
        t: &TensorInfo,
        dst: &mut [u8],
        release: bool,
    ) -> Result<()> {
        let src = self.stored_bytes(t).unwrap_or(&[]);
        if src.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?} is {} bytes, the destination {} bytes",
                t.name,
                src.len(),
                dst.len()
            )));
        }
        crate::convert::copy_bytes(src, dst);
        if release {
            self.shards[t.shard].bytes.release(t.offsets[0], t.nbytes());
        }
        Ok(())
    }
}
