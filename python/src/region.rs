//! Region reads into buffers the caller owns, for the `torch.distributed.checkpoint`
//! reader (`ckptstore.torch.dcp.Reader`): DCP hands the reader the destination tensor of
//! every read, and this copies the requested box of a stored (global or whole) tensor
//! straight from the read-only map into that memory, without an intermediate buffer.
//!
//! Every stored tensor a read touches has its CRC32 checked (once per reader: the
//! verified names are remembered) before any of its bytes are copied; the mapped files are
//! only ever read. The box arithmetic mirrors `ckptstore::Checkpoint::read_region`
//! (src/checkpoint/region.rs), which reads into a fresh buffer instead.

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

/// A box in a tensor's index space.
struct Box_ {
    offsets: Vec<u64>,
    shape: Vec<u64>,
}

/// A stored piece a region reads from: where it lies, the manifest tensor holding it, and
/// the intersection `[lo, hi)` with the region.
struct Step {
    piece: Box_,
    tensor: String,
    lo: Vec<u64>,
    hi: Vec<u64>,
}

/// An open checkpoint that reads regions into caller-owned buffers
/// (`ckptstore._ckptstore.RegionReader(path)`).
#[pyclass(module = "ckptstore._ckptstore", frozen)]
pub(crate) struct RegionReader {
    ck: Arc<Checkpoint>,
    /// Manifest tensors whose CRC32 was checked by this reader.
    verified: Mutex<HashSet<String>>,
}

impl RegionReader {
    /// The pieces of `name` that the box `offsets`/`shape` intersects, after checking the
    /// box against the tensor's shape; and the element size.
    fn plan(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
    ) -> Result<(Vec<Step>, usize), Error> {
        let ck = &self.ck;
        let (dtype, gshape) = ck.shape_of(name)?;
        let bad = |why: String| {
            Error::InvalidArgument(format!(
                "tensor {name:?} of shape {gshape:?}: region offsets {offsets:?}, shape {shape:?}: {why}"
            ))
        };
        if offsets.len() != gshape.len() || shape.len() != gshape.len() {
            return Err(bad(format!(
                "offsets and shape must have the tensor's rank {}",
                gshape.len()
            )));
        }
        for d in 0..gshape.len() {
            if offsets[d]
                .checked_add(shape[d])
                .is_none_or(|e| e > gshape[d])
            {
                return Err(bad(format!("dimension {d} is out of bounds")));
            }
        }
        let pieces: Vec<(Box_, String)> = match ck.global(name) {
            Some(g) => g
                .chunks
                .iter()
                .map(|c| {
                    (
                        Box_ {
                            offsets: c.offsets.clone(),
                            shape: c.shape.clone(),
                        },
                        c.tensor.clone(),
                    )
                })
                .collect(),
            None => vec![(
                Box_ {
                    offsets: vec![0; gshape.len()],
                    shape: gshape.to_vec(),
                },
                name.to_string(),
            )],
        };
        let mut steps = Vec::new();
        for (piece, tensor) in pieces {
            let mut lo = Vec::with_capacity(shape.len());
            let mut hi = Vec::with_capacity(shape.len());
            let mut empty = false;
            for d in 0..shape.len() {
                let l = offsets[d].max(piece.offsets[d]);
                // Both ends were checked against the global shape (region above, chunks at open).
                let h =
                    (offsets[d] + shape[d]).min(piece.offsets[d].saturating_add(piece.shape[d]));
                if l >= h {
                    empty = true;
                    break;
                }
                lo.push(l);
                hi.push(h);
            }
            if !empty {
                steps.push(Step {
                    piece,
                    tensor,
                    lo,
                    hi,
                });
            }
        }
        Ok((steps, dtype.size()))
    }

    /// Check the CRC32 of every tensor in `names` not checked yet (in parallel).
    fn verify_names(&self, names: Vec<String>) -> Result<(), Error> {
        let todo: Vec<String> = {
            let done = self.verified.lock().unwrap_or_else(|p| p.into_inner());
            let mut seen = HashSet::new();
            names
                .into_iter()
                .filter(|n| !done.contains(n) && seen.insert(n.clone()))
                .collect()
        };
        todo.par_iter()
            .try_for_each(|n| self.ck.tensor_verified(n).map(|_| ()))?;
        let mut done = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        done.extend(todo);
        Ok(())
    }

    /// Copy the box into `out` (its bytes, row-major), after checking every piece's CRC.
    fn copy_region(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
    ) -> Result<(), Error> {
        let (steps, es) = self.plan(name, offsets, shape)?;
        let want = shape
            .iter()
            .try_fold(es as u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument(format!("region shape {shape:?} overflows")))?;
        if want != out.len() as u64 {
            return Err(Error::InvalidArgument(format!(
                "tensor {name:?}: region of shape {shape:?} is {want} bytes, the destination {} bytes",
                out.len()
            )));
        }
        self.verify_names(steps.iter().map(|s| s.tensor.clone()).collect())?;
        let region = Box_ {
            offsets: offsets.to_vec(),
            shape: shape.to_vec(),
        };
        for s in &steps {
            let v = self.ck.tensor(&s.tensor)?;
            copy_box(v.bytes(), &s.piece, out, &region, &s.lo, &s.hi, es).ok_or_else(|| {
                Error::InvalidTensor {
                    name: s.tensor.clone(),
                    reason: "stored bytes do not match the chunk's shape".into(),
                }
            })?;
        }
        Ok(())
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

    /// `verify_regions([(name, offsets, shape), ...])`: check the CRC32 of every stored
    /// tensor these regions read from (each once, in parallel, interpreter released).
    /// Raises `ChecksumError` naming the damaged tensor and its shard.
    fn verify_regions(
        &self,
        py: Python<'_>,
        regions: Vec<(String, Vec<u64>, Vec<u64>)>,
    ) -> PyResult<()> {
        py.detach(|| {
            let mut names = Vec::new();
            for (n, o, s) in &regions {
                let (steps, _) = self.plan(n, o, s)?;
                names.extend(steps.into_iter().map(|s| s.tensor));
            }
            self.verify_names(names)
        })
        .map_err(CkError)?;
        Ok(())
    }

    /// `byte_ranges([(name, offsets, shape), ...]) -> [(file, begin, end)]`: where the
    /// stored tensors these boxes read from lie (each once, merged per file when adjacent):
    /// the shard file's path and the byte range, for the caller to prefetch.
    fn byte_ranges(
        &self,
        regions: Vec<(String, Vec<u64>, Vec<u64>)>,
    ) -> PyResult<Vec<(PathBuf, u64, u64)>> {
        let mut seen = HashSet::new();
        let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
        for (n, o, s) in &regions {
            let (steps, _) = self.plan(n, o, s).map_err(CkError)?;
            for st in steps {
                if seen.insert(st.tensor.clone()) {
                    let t = self.ck.info(&st.tensor).map_err(CkError)?;
                    ranges.push((t.shard, t.offsets[0], t.offsets[1]));
                }
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<(usize, u64, u64)> = Vec::new();
        for (sh, b, e) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == sh && last.2 == b => last.2 = e,
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

/// Copy the box `[lo, hi)` (global indices) from `src`, a row-major piece at
/// `piece.offsets` of shape `piece.shape`, into `dst`, a row-major region at
/// `region.offsets` of shape `region.shape`; `es` bytes per element. `None` if a range
/// falls outside either buffer (never for validated pieces).
fn copy_box(
    src: &[u8],
    piece: &Box_,
    dst: &mut [u8],
    region: &Box_,
    lo: &[u64],
    hi: &[u64],
    es: usize,
) -> Option<()> {
    let rank = lo.len();
    let strides = |shape: &[u64]| -> Option<Vec<u64>> {
        let mut s = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1].checked_mul(shape[d + 1])?;
        }
        Some(s)
    };
    let (ss, ds) = (strides(&piece.shape)?, strides(&region.shape)?);
    let run = if rank == 0 {
        1
    } else {
        hi[rank - 1] - lo[rank - 1]
    };
    let run_bytes = usize::try_from(run).ok()?.checked_mul(es)?;
    let mut idx: Vec<u64> = lo.to_vec();
    loop {
        let (mut so, mut dof) = (0u64, 0u64);
        for d in 0..rank {
            so = so.checked_add((idx[d] - piece.offsets[d]).checked_mul(ss[d])?)?;
            dof = dof.checked_add((idx[d] - region.offsets[d]).checked_mul(ds[d])?)?;
        }
        let so = usize::try_from(so).ok()?.checked_mul(es)?;
        let dof = usize::try_from(dof).ok()?.checked_mul(es)?;
        dst.get_mut(dof..dof.checked_add(run_bytes)?)?
            .copy_from_slice(src.get(so..so.checked_add(run_bytes)?)?);
        let mut d = rank.saturating_sub(1);
        loop {
            if d == 0 {
                return Some(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}
