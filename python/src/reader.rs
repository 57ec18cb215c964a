//! The one reader's face for Python: [`Reader`], an object-safe view of
//! `ckptstore::Checkpoint<S>` over any shard source, so that `ckptstore.Checkpoint` has one
//! code path whether the shards are memory-mapped files, downloaded buffers or objects
//! fetched by ranged GETs (`ckptstore.open(url, lazy=True)`); and [`Regions`], the region
//! reads into caller-owned buffers that `ckptstore.torch.dcp.Reader` uses.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

use ckptstore::checkpoint::Entry;
use ckptstore::checkpoint::Kind;
use ckptstore::checkpoint::ShardSource;
use ckptstore::format::global::GlobalEntry;
use ckptstore::format::manifest::Manifest;
use ckptstore::{Checkpoint, DType, Error, Region, Tensor, TensorInfo};
use rayon::prelude::*;

/// What `ckptstore.Checkpoint` needs of a checkpoint, over any shard source (the methods
/// of `ckptstore::Checkpoint<S>` that do not need resident bytes).
pub(crate) trait Reader: Send + Sync {
    fn resident(&self) -> bool;
    fn kind(&self) -> Kind;
    fn root(&self) -> &Path;
    fn manifest(&self) -> Option<&Manifest>;
    fn metadata(&self) -> &serde_json::Value;
    fn tensors(&self) -> &[TensorInfo];
    fn shard_file(&self, i: usize) -> Option<&str>;
    fn shard_count(&self) -> usize;
    fn info(&self, name: &str) -> Result<&TensorInfo, Error>;
    fn entries(&self) -> Vec<Entry<'_>>;
    fn entry(&self, name: &str) -> Result<Entry<'_>, Error>;
    fn entry_count(&self) -> usize;
    fn globals(&self) -> &[GlobalEntry];
    fn shape_of(&self, name: &str) -> Result<(DType, Vec<u64>), Error>;
    fn chunks(&self, name: &str) -> Result<Vec<Region>, Error>;
    fn chunks_within(&self, name: &str, o: &[u64], s: &[u64]) -> Result<Vec<Region>, Error>;
    fn data_bytes(&self) -> u64;
    fn check_optimizer_section(&self) -> Result<(), Error>;
    fn verify(&self) -> Result<ckptstore::VerifyReport, Error>;
    fn read_tensor(&self, name: &str) -> Result<Tensor, Error>;
    fn read_global(&self, name: &str) -> Result<Tensor, Error>;
    fn read_region(&self, name: &str, o: &[u64], s: &[u64]) -> Result<Tensor, Error>;
    fn read_region_into(&self, n: &str, o: &[u64], s: &[u64], out: &mut [u8]) -> Result<(), Error>;
    fn fill_region_into(&self, n: &str, o: &[u64], s: &[u64], out: &mut [u8]) -> Result<(), Error>;
    fn verify_region(&self, name: &str, o: &[u64], s: &[u64]) -> Result<(), Error>;
    fn verify_region_given(&self, n: &str, o: &[u64], s: &[u64], bytes: &[u8])
        -> Result<(), Error>;
    fn copy_region_unchecked(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error>;
    fn region_byte_ranges(
        &self,
        name: &str,
        o: &[u64],
        s: &[u64],
    ) -> Result<Vec<(usize, u64, u64)>, Error>;
    /// Whether the chunk entries live in part indexes read on first use (feature `parts`).
    fn two_level(&self) -> bool;
    /// Part indexes loaded so far and their bytes; `(0, 0)` for a flat checkpoint.
    fn parts_read(&self) -> (usize, u64);
    /// A two-level global's grid cells, from the root alone (loading no part); `None` for
    /// flat globals and whole tensors.
    fn grid_cells(&self, name: &str) -> Option<Vec<Region>>;
    /// Those of `grid_cells` that intersect the box `(offsets, shape)`.
    fn grid_cells_within(&self, name: &str, o: &[u64], s: &[u64]) -> Option<Vec<Region>>;
    /// `region_byte_ranges` with each range's shard file named (as `Shard::file` names it),
    /// the shards of a two-level checkpoint's parts included (loading the parts touched).
    fn region_file_ranges(
        &self,
        name: &str,
        o: &[u64],
        s: &[u64],
    ) -> Result<Vec<(&str, u64, u64)>, Error>;
}

impl<S: ShardSource + Send> Reader for Checkpoint<S> {
    fn resident(&self) -> bool {
        Checkpoint::resident(self)
    }
    fn kind(&self) -> Kind {
        Checkpoint::kind(self)
    }
    fn root(&self) -> &Path {
        Checkpoint::root(self)
    }
    fn manifest(&self) -> Option<&Manifest> {
        Checkpoint::manifest(self)
    }
    fn metadata(&self) -> &serde_json::Value {
        Checkpoint::metadata(self)
    }
    fn tensors(&self) -> &[TensorInfo] {
        Checkpoint::tensors(self)
    }
    fn shard_file(&self, i: usize) -> Option<&str> {
        self.shards().get(i).map(|s| s.file.as_str())
    }
    fn shard_count(&self) -> usize {
        self.shards().len()
    }
    fn info(&self, name: &str) -> Result<&TensorInfo, Error> {
        Checkpoint::info(self, name)
    }
    fn entries(&self) -> Vec<Entry<'_>> {
        self.catalog().entries()
    }
    fn entry(&self, name: &str) -> Result<Entry<'_>, Error> {
        self.catalog().entry(name)
    }
    fn entry_count(&self) -> usize {
        self.catalog().entry_count()
    }
    fn globals(&self) -> &[GlobalEntry] {
        self.catalog().globals()
    }
    fn shape_of(&self, name: &str) -> Result<(DType, Vec<u64>), Error> {
        self.catalog().shape_of(name).map(|(d, s)| (d, s.to_vec()))
    }
    fn chunks(&self, name: &str) -> Result<Vec<Region>, Error> {
        self.catalog().chunks(name)
    }
    fn chunks_within(&self, name: &str, o: &[u64], s: &[u64]) -> Result<Vec<Region>, Error> {
        self.catalog().chunks_within(name, o, s)
    }
    fn data_bytes(&self) -> u64 {
        Checkpoint::data_bytes(self)
    }
    fn check_optimizer_section(&self) -> Result<(), Error> {
        Checkpoint::check_optimizer_section(self)
    }
    fn verify(&self) -> Result<ckptstore::VerifyReport, Error> {
        Checkpoint::verify(self)
    }
    fn read_tensor(&self, name: &str) -> Result<Tensor, Error> {
        self.read(name).to_tensor()
    }
    fn read_global(&self, name: &str) -> Result<Tensor, Error> {
        self.read(name).to_tensor()
    }
    fn read_region(&self, name: &str, o: &[u64], s: &[u64]) -> Result<Tensor, Error> {
        self.read(name).region(o, s).to_tensor()
    }
    fn read_region_into(&self, n: &str, o: &[u64], s: &[u64], out: &mut [u8]) -> Result<(), Error> {
        self.read(n).region(o, s).into(out)
    }
    fn fill_region_into(&self, n: &str, o: &[u64], s: &[u64], out: &mut [u8]) -> Result<(), Error> {
        self.read(n).region(o, s).fused(true).into(out)
    }
    fn verify_region(&self, name: &str, o: &[u64], s: &[u64]) -> Result<(), Error> {
        self.read(name).region(o, s).verify()
    }
    fn verify_region_given(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        bytes: &[u8],
    ) -> Result<(), Error> {
        self.read(n).region(o, s).verify_given(bytes)
    }
    fn copy_region_unchecked(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error> {
        self.read(n).region(o, s).into_unchecked(out)
    }
    fn region_byte_ranges(
        &self,
        name: &str,
        o: &[u64],
        s: &[u64],
    ) -> Result<Vec<(usize, u64, u64)>, Error> {
        self.read(name).region(o, s).plan().map(|p| p.shard_ranges)
    }
    fn two_level(&self) -> bool {
        self.catalog().two_level()
    }
    fn parts_read(&self) -> (usize, u64) {
        self.catalog().parts_read()
    }
    fn grid_cells(&self, name: &str) -> Option<Vec<Region>> {
        self.catalog().grid_cells(name)
    }
    fn grid_cells_within(&self, name: &str, o: &[u64], s: &[u64]) -> Option<Vec<Region>> {
        self.catalog().grid_cells_within(name, o, s)
    }
    fn region_file_ranges(
        &self,
        name: &str,
        o: &[u64],
        s: &[u64],
    ) -> Result<Vec<(&str, u64, u64)>, Error> {
        self.read(name).region(o, s).plan().map(|p| p.file_ranges)
    }
}

/// A region: name, offsets, shape.
pub(crate) type Key = (String, Vec<u64>, Vec<u64>);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Region reads into caller-owned buffers, all-or-nothing across a job: every block or
/// chunk a region uses is CRC-checked (once per reader: the verified regions are
/// remembered) before any destination is written. From fetched shards the checked bytes
/// of each verified region are kept until it is copied, so destinations are written from
/// the very bytes that were checked.
#[derive(Default)]
pub(crate) struct Regions {
    /// Regions whose CRCs (blocks or chunks) this reader has checked.
    verified: Mutex<HashSet<Key>>,
    /// Fetched shards: the checked bytes of each verified region, until `copy` takes them.
    fetched: Mutex<HashMap<Key, Tensor>>,
}

impl Regions {
    /// Check every region not checked yet (in parallel) and remember them.
    pub(crate) fn verify(&self, ck: &dyn Reader, keys: Vec<Key>) -> Result<(), Error> {
        let todo: Vec<Key> = {
            let done = lock(&self.verified);
            let mut seen = HashSet::new();
            keys.into_iter()
                .filter(|k| !done.contains(k) && seen.insert(k.clone()))
                .collect()
        };
        if ck.resident() {
            todo.par_iter()
                .try_for_each(|(n, o, s)| ck.verify_region(n, o, s))?;
        } else {
            // Each read runs its own concurrent ranged GETs; a few regions at a time.
            let got = todo
                .par_iter()
                .with_max_len(1)
                .map(|k| ck.read_region(&k.0, &k.1, &k.2).map(|t| (k.clone(), t)))
                .collect::<Result<Vec<_>, Error>>()?;
            lock(&self.fetched).extend(got);
        }
        lock(&self.verified).extend(todo);
        Ok(())
    }

    /// Copy the box into `out` (its bytes, row-major), CRC-checking it first unless this
    /// reader already did. With `fill`, a region not checked yet is read in one pass, each
    /// block checked as it is copied (`Read::fused`): on error `out` is
    /// then partly written.
    pub(crate) fn copy(
        &self,
        ck: &dyn Reader,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
        fill: bool,
    ) -> Result<(), Error> {
        let key = (name.to_string(), offsets.to_vec(), shape.to_vec());
        let kept = lock(&self.fetched).remove(&key);
        let Some(t) = kept else {
            let verified = lock(&self.verified).contains(&key);
            return if ck.resident() && verified {
                ck.copy_region_unchecked(name, offsets, shape, out)
            } else if fill && !verified {
                ck.fill_region_into(name, offsets, shape, out)
            } else {
                ck.read_region_into(name, offsets, shape, out)
            };
        };
        let b = t.bytes();
        if b.len() != out.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {name:?}: a region of shape {shape:?} is {} bytes, the destination {}",
                b.len(),
                out.len()
            )));
        }
        out.copy_from_slice(b);
        Ok(())
    }
}
