//! Region reads into buffers the caller owns, for the `torch.distributed.checkpoint`
//! reader (`ckptstore.torch.dcp.Reader`): DCP hands the reader the destination tensor of
//! every read, and this copies the requested box of a stored (global or whole) tensor
//! straight from the read-only map into that memory, without an intermediate buffer
//! (`Checkpoint::read_region_into` and its halves, `verify_region` and
//! `copy_region_unchecked`, in src/checkpoint/region.rs).
//!
//! Every block or chunk a read uses has its CRC32 checked before any of its bytes are
//! copied (once per reader: the verified regions are remembered); the mapped files are
//! only ever read.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ckptstore::{Checkpoint, Error};
use numpy::PyReadwriteArray1;
use pyo3::prelude::*;
use rayon::prelude::*;

use crate::errors::{invalid_arg, CkError};

/// One read: the stored tensor's name, the box `[offsets, offsets + shape)` of its global
/// index space, and the destination buffer (the box's elements, row-major).
type Request<'py> = (String, Vec<u64>, Vec<u64>, PyReadwriteArray1<'py, u8>);

/// A request ready for the engine: name, offsets, shape and the destination bytes.
type Job<'a> = (&'a str, &'a [u64], &'a [u64], &'a mut [u8]);

/// A region: name, offsets, shape.
type Key = (String, Vec<u64>, Vec<u64>);

/// An open checkpoint that reads regions into caller-owned buffers
/// (`ckptstore._ckptstore.RegionReader(path)`).
#[pyclass(module = "ckptstore._ckptstore", frozen)]
pub(crate) struct RegionReader {
    ck: Arc<Checkpoint>,
    /// Regions whose CRCs (blocks or chunks) this reader has checked.
    verified: Mutex<HashSet<Key>>,
}

impl RegionReader {
    fn is_verified(&self, k: &Key) -> bool {
        self.verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(k)
    }

    /// Check every region not checked yet (in parallel) and remember them.
    fn verify_keys(&self, keys: Vec<Key>) -> Result<(), Error> {
        let todo: Vec<Key> = {
            let done = self.verified.lock().unwrap_or_else(|p| p.into_inner());
            let mut seen = HashSet::new();
            keys.into_iter()
                .filter(|k| !done.contains(k) && seen.insert(k.clone()))
                .collect()
        };
        todo.par_iter()
            .try_for_each(|(n, o, s)| self.ck.verify_region(n, o, s))?;
        let mut done = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        done.extend(todo);
        Ok(())
    }

    /// Copy the box into `out` (its bytes, row-major), CRC-checking it first unless this
    /// reader already did.
    fn copy_region(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error> {
        let key = (name.to_string(), offsets.to_vec(), shape.to_vec());
        if self.is_verified(&key) {
            self.ck.copy_region_unchecked(name, offsets, shape, out)
        } else {
            self.ck.read_region_into(name, offsets, shape, out)
        }
    }
}

#[pymethods]
impl RegionReader {
    /// Open the checkpoint at `path` (validated and mapped read-only, as `ckptstore.open`).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let ck = py.detach(|| Checkpoint::open(&path)).map_err(CkError)?;
        Ok(RegionReader {
            ck: Arc::new(ck),
            verified: Mutex::new(HashSet::new()),
        })
    }

    /// The manifest's user metadata as JSON text.
    fn metadata_json(&self) -> PyResult<String> {
        serde_json::to_string(self.ck.metadata()).map_err(|e| invalid_arg(e.to_string()))
    }

    /// The checkpoint id (ckptstore checkpoints), `None` for foreign stores.
    #[getter]
    fn checkpoint_id(&self) -> Option<String> {
        self.ck.manifest().map(|m| m.checkpoint_id.clone())
    }

    /// `(wire dtype, shape)` of a global or whole tensor.
    fn shape_of(&self, name: &str) -> PyResult<(String, Vec<u64>)> {
        let (d, s) = self.ck.shape_of(name).map_err(CkError)?;
        Ok((d.name().to_string(), s.to_vec()))
    }

    /// `(offsets, shape)` of every stored chunk of `name` (one at the origin for a whole tensor).
    fn chunks(&self, name: &str) -> PyResult<Vec<(Vec<u64>, Vec<u64>)>> {
        Ok(self
            .ck
            .chunks(name)
            .map_err(CkError)?
            .into_iter()
            .map(|r| (r.offsets, r.shape))
            .collect())
    }

    /// `verify_regions([(name, offsets, shape), ...])`: check the CRC32s of everything
    /// these regions read (the blocks they touch, or whole chunks without block CRCs; each
    /// region once, in parallel, interpreter released). Raises `ChecksumError` naming the
    /// damaged tensor (and block) and its shard.
    fn verify_regions(
        &self,
        py: Python<'_>,
        regions: Vec<(String, Vec<u64>, Vec<u64>)>,
    ) -> PyResult<()> {
        py.detach(|| self.verify_keys(regions)).map_err(CkError)?;
        Ok(())
    }

    /// `byte_ranges([(name, offsets, shape), ...]) -> [(file, begin, end)]`: where the
    /// bytes these boxes read lie (blocks or whole chunks; merged per file where they
    /// touch or overlap): the shard file's path and the byte range, for the caller to
    /// prefetch.
    fn byte_ranges(
        &self,
        regions: Vec<(String, Vec<u64>, Vec<u64>)>,
    ) -> PyResult<Vec<(PathBuf, u64, u64)>> {
        let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
        for (n, o, s) in &regions {
            ranges.extend(self.ck.region_byte_ranges(n, o, s).map_err(CkError)?);
        }
        ranges.sort_unstable();
        let mut merged: Vec<(usize, u64, u64)> = Vec::new();
        for (sh, b, e) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == sh && b <= last.2 => last.2 = last.2.max(e),
                _ => merged.push((sh, b, e)),
            }
        }
        let shards = self.ck.shards();
        Ok(merged
            .into_iter()
            .filter_map(|(sh, b, e)| shards.get(sh).map(|x| (self.ck.root().join(&x.file), b, e)))
            .collect())
    }

    /// `read_into([(name, offsets, shape, out), ...])`: copy each box into `out`, a
    /// writable, C-contiguous 1-D `uint8` array of exactly the box's bytes (the memory of
    /// the destination tensor), every stored tensor read from CRC-checked first. Requests
    /// run in parallel with the interpreter released; the destinations must not overlap.
    fn read_into(&self, py: Python<'_>, mut requests: Vec<Request<'_>>) -> PyResult<()> {
        let mut jobs: Vec<Job<'_>> = Vec::with_capacity(requests.len());
        for (name, offsets, shape, out) in requests.iter_mut() {
            let buf = out.as_slice_mut().map_err(|_| {
                invalid_arg(format!(
                    "tensor {name:?}: the destination must be C-contiguous"
                ))
            })?;
            jobs.push((name.as_str(), offsets.as_slice(), shape.as_slice(), buf));
        }
        py.detach(|| {
            jobs.par_iter_mut()
                .try_for_each(|(n, o, s, buf)| self.copy_region(n, o, s, buf))
        })
        .map_err(CkError)?;
        Ok(())
    }
}
