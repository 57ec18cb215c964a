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
//!
//! On an object store (`s3://bucket/prefix`) the checkpoint is opened lazily
//! (`ckptstore::store::s3::open_lazy`: the manifest and the shard headers) and
//! `verify_regions` fetches each region with ranged GETs of only the CRC blocks it touches,
//! checks them, and keeps the checked bytes until `read_into` copies them into the
//! destination: every destination is written only after every region was checked, and
//! from the very bytes that were checked.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Mutex;

use ckptstore::store::Location;
use ckptstore::{Checkpoint, Error, Tensor};
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
    src: Box<dyn Regions>,
    /// Regions whose CRCs (blocks or chunks) this reader has checked.
    verified: Mutex<HashSet<Key>>,
    /// Fetched (remote) checkpoints: the checked bytes of each verified region, until
    /// `read_into` takes them.
    fetched: Mutex<HashMap<Key, Tensor>>,
}

/// What the reader needs of a checkpoint, over any shard source: a memory-mapped local
/// directory (`Checkpoint<Map>`, resident) or an object store read by ranged GETs
/// (`Checkpoint<RemoteShard>`, fetched). One object-safe face of the one reader
/// (`ckptstore::Checkpoint<S>`), so that this class has no per-backend code.
trait Regions: Send + Sync {
    fn ck_resident(&self) -> bool;
    fn ck_verify_region(&self, n: &str, o: &[u64], s: &[u64]) -> Result<(), Error>;
    fn ck_read_region(&self, n: &str, o: &[u64], s: &[u64]) -> Result<Tensor, Error>;
    fn ck_read_region_into(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error>;
    fn ck_copy_region_unchecked(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error>;
    fn ck_shape_of(&self, n: &str) -> Result<(ckptstore::DType, Vec<u64>), Error>;
    fn ck_chunks(&self, n: &str) -> Result<Vec<ckptstore::Region>, Error>;
    fn ck_region_byte_ranges(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
    ) -> Result<Vec<(usize, u64, u64)>, Error>;
    fn ck_metadata(&self) -> &serde_json::Value;
    fn ck_checkpoint_id(&self) -> Option<String>;
    /// The local path of shard `i`, for resident local checkpoints.
    fn ck_shard_path(&self, i: usize) -> Option<PathBuf>;
}

impl<S: ckptstore::ShardSource + Send> Regions for Checkpoint<S> {
    fn ck_resident(&self) -> bool {
        self.resident()
    }
    fn ck_verify_region(&self, n: &str, o: &[u64], s: &[u64]) -> Result<(), Error> {
        self.verify_region(n, o, s)
    }
    fn ck_read_region(&self, n: &str, o: &[u64], s: &[u64]) -> Result<Tensor, Error> {
        self.read_region(n, o, s)
    }
    fn ck_read_region_into(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error> {
        self.read_region_into(n, o, s, out)
    }
    fn ck_copy_region_unchecked(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error> {
        self.copy_region_unchecked(n, o, s, out)
    }
    fn ck_shape_of(&self, n: &str) -> Result<(ckptstore::DType, Vec<u64>), Error> {
        self.shape_of(n).map(|(d, s)| (d, s.to_vec()))
    }
    fn ck_chunks(&self, n: &str) -> Result<Vec<ckptstore::Region>, Error> {
        self.chunks(n)
    }
    fn ck_region_byte_ranges(
        &self,
        n: &str,
        o: &[u64],
        s: &[u64],
    ) -> Result<Vec<(usize, u64, u64)>, Error> {
        self.region_byte_ranges(n, o, s)
    }
    fn ck_metadata(&self) -> &serde_json::Value {
        self.metadata()
    }
    fn ck_checkpoint_id(&self) -> Option<String> {
        self.manifest().map(|m| m.checkpoint_id.clone())
    }
    fn ck_shard_path(&self, i: usize) -> Option<PathBuf> {
        if !self.resident() {
            return None;
        }
        self.shards().get(i).map(|x| self.root().join(&x.file))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl RegionReader {
    fn is_verified(&self, k: &Key) -> bool {
        lock(&self.verified).contains(k)
    }

    /// Check every region not checked yet (in parallel) and remember them (remote: with
    /// their checked bytes).
    fn verify_keys(&self, keys: Vec<Key>) -> Result<(), Error> {
        let todo: Vec<Key> = {
            let done = lock(&self.verified);
            let mut seen = HashSet::new();
            keys.into_iter()
                .filter(|k| !done.contains(k) && seen.insert(k.clone()))
                .collect()
        };
        let ck = &self.src;
        if ck.ck_resident() {
            todo.par_iter()
                .try_for_each(|(n, o, s)| ck.ck_verify_region(n, o, s))?;
        } else {
            // Each read runs its own concurrent ranged GETs; a few regions at a time. The
            // checked bytes are kept, so destinations are written from the very bytes
            // that were checked.
            let got = todo
                .par_iter()
                .with_max_len(1)
                .map(|k| ck.ck_read_region(&k.0, &k.1, &k.2).map(|t| (k.clone(), t)))
                .collect::<Result<Vec<_>, Error>>()?;
            lock(&self.fetched).extend(got);
        }
        lock(&self.verified).extend(todo);
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
        let ck = &self.src;
        let kept = lock(&self.fetched).remove(&key);
        let Some(t) = kept else {
            return if self.is_verified(&key) && ck.ck_resident() {
                ck.ck_copy_region_unchecked(name, offsets, shape, out)
            } else {
                ck.ck_read_region_into(name, offsets, shape, out)
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

    fn shape(&self, name: &str) -> Result<(ckptstore::DType, Vec<u64>), Error> {
        self.src.ck_shape_of(name)
    }
}

#[pymethods]
impl RegionReader {
    /// Open the checkpoint at `path` (validated and mapped read-only, as `ckptstore.open`),
    /// or at an `s3://bucket/prefix` URL (the manifest and the shard headers fetched and
    /// checked; tensor bytes fetched by the reads).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let src = py
            .detach(|| -> Result<Box<dyn Regions>, Error> {
                match Location::from_path(&path)? {
                    Location::Local(p) => Ok(Box::new(Checkpoint::open(&p)?)),
                    Location::Remote(u) => Ok(Box::new(ckptstore::store::s3::open_lazy(
                        &u,
                        &ckptstore::store::s3::S3Config::from_env(),
                    )?)),
                }
            })
            .map_err(CkError)?;
        Ok(RegionReader {
            src,
            verified: Mutex::new(HashSet::new()),
            fetched: Mutex::new(HashMap::new()),
        })
    }

    /// The manifest's user metadata as JSON text.
    fn metadata_json(&self) -> PyResult<String> {
        serde_json::to_string(self.src.ck_metadata()).map_err(|e| invalid_arg(e.to_string()))
    }

    /// The checkpoint id (ckptstore checkpoints), `None` for foreign stores.
    #[getter]
    fn checkpoint_id(&self) -> Option<String> {
        self.src.ck_checkpoint_id()
    }

    /// Whether the checkpoint is local (memory-mapped), so that `byte_ranges` name files.
    #[getter]
    fn is_local(&self) -> bool {
        self.src.ck_resident()
    }

    /// `(wire dtype, shape)` of a global or whole tensor.
    fn shape_of(&self, name: &str) -> PyResult<(String, Vec<u64>)> {
        let (d, s) = self.shape(name).map_err(CkError)?;
        Ok((d.name().to_string(), s))
    }

    /// `(offsets, shape)` of every stored chunk of `name` (one at the origin for a whole tensor).
    fn chunks(&self, name: &str) -> PyResult<Vec<(Vec<u64>, Vec<u64>)>> {
        Ok(self
            .src
            .ck_chunks(name)
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
    /// Remote checkpoints have no files to prefetch: the list is empty (their reads fetch
    /// exactly these ranges).
    fn byte_ranges(
        &self,
        regions: Vec<(String, Vec<u64>, Vec<u64>)>,
    ) -> PyResult<Vec<(PathBuf, u64, u64)>> {
        let ck = &self.src;
        if !ck.ck_resident() {
            return Ok(Vec::new());
        }
        let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
        for (n, o, s) in &regions {
            ranges.extend(ck.ck_region_byte_ranges(n, o, s).map_err(CkError)?);
        }
        ranges.sort_unstable();
        let mut merged: Vec<(usize, u64, u64)> = Vec::new();
        for (sh, b, e) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == sh && b <= last.2 => last.2 = last.2.max(e),
                _ => merged.push((sh, b, e)),
            }
        }
        Ok(merged
            .into_iter()
            .filter_map(|(sh, b, e)| Some((ck.ck_shard_path(sh)?, b, e)))
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
