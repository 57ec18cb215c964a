//! `ckptstore.Checkpoint`'s access to its open checkpoint: the reader over any shard
//! source, the resident checkpoint behind zero-copy arrays, arrays over stored bytes, and
//! region requests decoded for the engine.

use super::*;
use ckptstore::checkpoint::Region;

impl PyCheckpoint {
    pub(super) fn inner(&self) -> PyResult<&Inner> {
        self.inner
            .as_ref()
            .ok_or_else(|| invalid_arg("the checkpoint is closed"))
    }

    /// The reader, over any shard source.
    pub(super) fn reader(&self) -> PyResult<&Arc<dyn Reader>> {
        Ok(&self.inner()?.any)
    }

    /// The checkpoint with its bytes in memory, for `what`; raises for a lazily opened one.
    pub(super) fn open_parts_for(
        &self,
        what: &str,
    ) -> PyResult<(&Arc<Checkpoint>, &Py<MappedCheckpoint>)> {
        match &self.inner()?.resident {
            Some((a, b)) => Ok((a, b)),
            None => Err(invalid_arg(format!(
                "{what} needs the shard bytes in memory; this checkpoint was opened with \
                 lazy=True (shards fetched on read): open it with lazy=False"
            ))),
        }
    }

    pub(super) fn view_array(
        &self,
        py: Python<'_>,
        name: &str,
        verify: bool,
        raw: bool,
    ) -> PyResult<Py<PyAny>> {
        let any = self.reader()?;
        if any.entry(name).map_err(CkError)?.global {
            return read_global(py, any, name, raw);
        }
        let Some((ck, base)) = &self.inner()?.resident else {
            // Fetched shards: a fresh array, CRC-checked as its bytes landed.
            let any = any.clone();
            let n = name.to_string();
            let t = py.detach(move || any.read_tensor(&n)).map_err(CkError)?;
            return owned_array(py, t, raw);
        };
        if verify {
            let ck = ck.clone();
            let n = name.to_string();
            py.detach(move || ck.read(&n).view().map(|_| ()))
                .map_err(CkError)?;
        }
        let v = ck.read(name).view_unchecked().map_err(CkError)?;
        self.wrap(py, base, v, raw)
    }

    #[allow(unsafe_code)] // the one call of `array_over` for mapped (or fetched) bytes
    pub(super) fn wrap(
        &self,
        py: Python<'_>,
        base: &Py<MappedCheckpoint>,
        v: ckptstore::TensorView<'_>,
        raw: bool,
    ) -> PyResult<Py<PyAny>> {
        let (d, shape) = if raw {
            (uint8(py)?, vec![v.bytes().len() as u64])
        } else {
            (descr(py, v.dtype())?, v.shape().to_vec())
        };
        // SAFETY: the view's bytes lie in a read-only memory map (or, for a checkpoint
        // downloaded from an object store, a buffer nothing writes) owned by the `Checkpoint`
        // behind `base`'s Arc, which the array holds as its base; the array is read-only
        // (`writable == false`), and the mapped files are never modified in place (the
        // engine's contract, see `ckptstore::Map`).
        unsafe {
            array_over(
                py,
                d,
                &shape,
                v.bytes().as_ptr().cast_mut(),
                false,
                base.clone_ref(py).into_any(),
            )
        }
    }

    /// `read_into` (`fill` false) and `fill_into` (`fill` true): decode the requests,
    /// then run them in parallel with the interpreter released.
    pub(super) fn region_requests(
        &self,
        py: Python<'_>,
        mut requests: Vec<Request<'_>>,
        fill: bool,
    ) -> PyResult<()> {
        let ck = self.reader()?;
        let mut owned: Vec<Decoded<'_>> = requests
            .drain(..)
            .map(|(n, o, s, a)| (n.0, indexes(o), indexes(s), a))
            .collect();
        let mut jobs: Vec<Job<'_>> = Vec::with_capacity(owned.len());
        for (name, offsets, shape, out) in owned.iter_mut() {
            let buf = out.as_slice_mut().map_err(|_| {
                invalid_arg(format!(
                    "tensor {name:?}: the destination must be C-contiguous"
                ))
            })?;
            jobs.push((name.as_str(), offsets.as_slice(), shape.as_slice(), buf));
        }
        py.detach(|| {
            jobs.par_iter_mut()
                .try_for_each(|(n, o, s, buf)| self.regions.copy(ck.as_ref(), n, o, s, buf, fill))
        })
        .map_err(CkError)?;
        Ok(())
    }
    /// `verify_received`: check each request's buffer against the CRC32s of the one
    /// stored chunk its box is, in parallel with the interpreter released.
    pub(super) fn given_requests(
        &self,
        py: Python<'_>,
        mut requests: Vec<Request<'_>>,
    ) -> PyResult<()> {
        let ck = self.reader()?;
        let owned: Vec<Decoded<'_>> = requests
            .drain(..)
            .map(|(n, o, s, a)| (n.0, indexes(o), indexes(s), a))
            .collect();
        let mut jobs: Vec<Given<'_>> = Vec::with_capacity(owned.len());
        for (name, offsets, shape, arr) in owned.iter() {
            let buf = arr.as_slice().map_err(|_| {
                invalid_arg(format!("tensor {name:?}: the buffer must be C-contiguous"))
            })?;
            jobs.push((name.as_str(), offsets.as_slice(), shape.as_slice(), buf));
        }
        py.detach(|| {
            // The first failure in request order (rayon's own would be the first in time).
            jobs.par_iter()
                .map(|(n, o, s, b)| ck.verify_region_given(n, o, s, b))
                .collect::<Vec<_>>()
                .into_iter()
                .collect::<Result<(), _>>()
        })
        .map_err(CkError)?;
        Ok(())
    }
}

/// One read: the stored tensor's name, the box `[offsets, offsets + shape)` of its global
/// index space, and the destination buffer (the box's elements, row-major).
pub(super) type Request<'py> = (
    Name,
    Vec<Index>,
    Vec<Index>,
    numpy::PyReadwriteArray1<'py, u8>,
);

/// A request with its name and indexes decoded.
pub(super) type Decoded<'py> = (
    String,
    Vec<u64>,
    Vec<u64>,
    numpy::PyReadwriteArray1<'py, u8>,
);

/// A request ready for the engine: name, offsets, shape and the destination bytes.
pub(super) type Job<'a> = (&'a str, &'a [u64], &'a [u64], &'a mut [u8]);

/// A received buffer ready for the engine's check: name, offsets, shape and the bytes.
pub(super) type Given<'a> = (&'a str, &'a [u64], &'a [u64], &'a [u8]);

/// Boxes of a tensor's global index space, as Python sees them: `(offsets, shape)`.
pub(super) type Boxes = Vec<(Vec<u64>, Vec<u64>)>;

/// Keeps an open checkpoint (its read-only memory maps) alive: the `base` of every array
/// `Checkpoint` hands out, so a mapping lives as long as any array over it.
#[pyclass(module = "ckptstore._ckptstore", frozen)]
pub(crate) struct MappedCheckpoint {
    #[allow(dead_code)] // held for its lifetime only
    pub(super) ck: Arc<Checkpoint>,
}

/// `RegionReader(path)`: the old name of the region reader, now `ckptstore.Checkpoint`
/// opened with `lazy=True` (`ckptstore.open(path, lazy=True)`), which has every method the
/// region reader had.
#[pyfunction]
#[pyo3(name = "RegionReader")]
pub(crate) fn region_reader(py: Python<'_>, path: PathBuf) -> PyResult<PyCheckpoint> {
    PyCheckpoint::new(py, path, true)
}

/// The engine's batch reads behind `verify_tensors`, `copy_into_unchecked`,
/// `copy_ranges_into_unchecked` and `fill_and_verify` (run with the interpreter released).
pub(super) mod batch {
    use ckptstore::checkpoint::VerifyOptions;
    use ckptstore::{Checkpoint, Error, Storage};

    fn strs(names: &[String]) -> Vec<&str> {
        names.iter().map(String::as_str).collect()
    }

    /// The CRC32 of every named tensor, in parallel.
    pub(crate) fn verify(
        ck: &Checkpoint<Storage>,
        names: &[String],
        release: bool,
    ) -> Result<(), Error> {
        let ns = strs(names);
        let opts = VerifyOptions::default().tensors(&ns);
        ck.verify_opts(&opts.release_pages(release)).map(drop)
    }

    /// Each named tensor into its destination, unchecked.
    pub(crate) fn copy(
        ck: &Checkpoint<Storage>,
        names: &[String],
        dsts: Vec<&mut [u8]>,
        release: bool,
    ) -> Result<(), Error> {
        let batch = ck
            .read_batch()
            .fill(strs(names).into_iter().zip(dsts).collect());
        batch.release_pages(release).run_unchecked()
    }

    /// Each `(name, offset)` byte range into its destination, unchecked.
    pub(crate) fn copy_ranges(
        ck: &Checkpoint<Storage>,
        names: &[String],
        offsets: Vec<u64>,
        dsts: Vec<&mut [u8]>,
    ) -> Result<(), Error> {
        let items = strs(names).into_iter().zip(offsets).zip(dsts);
        let items = items.map(|((n, o), d)| (n, o, d)).collect();
        ck.read_batch().fill_ranges(items).run_unchecked()
    }

    /// Each named tensor into its destination and each of `verify` checked, in one pass.
    pub(crate) fn fill(
        ck: &Checkpoint<Storage>,
        names: &[String],
        dsts: Vec<&mut [u8]>,
        verify: &[String],
        release: bool,
    ) -> Result<(), Error> {
        let vs = strs(verify);
        let batch = ck
            .read_batch()
            .fill(strs(names).into_iter().zip(dsts).collect());
        batch.check(&vs).release_pages(release).run()
    }
}

/// `grid_cells(name)`, or with `within` (boxes of the tensor's index space) the cells that
/// intersect one of them, each once, in row-major order (offsets sorted). `None` where
/// the tensor has no grid.
pub(super) fn cells_within(
    ck: &dyn Reader,
    name: &str,
    within: Option<Vec<(Vec<Index>, Vec<Index>)>>,
) -> Option<Vec<Region>> {
    let Some(boxes) = within else {
        return ck.grid_cells(name);
    };
    let mut all = ck.grid_cells_within(name, &[], &[]).map(|_| Vec::new())?;
    for (o, s) in boxes {
        all.extend(ck.grid_cells_within(name, &indexes(o), &indexes(s))?);
    }
    all.sort_by(|x, y| x.offsets.cmp(&y.offsets));
    all.dedup_by(|x, y| x.offsets == y.offsets);
    Some(all)
}

/// `chunks(name)`, or with `within` (a box of the tensor's index space) the chunks that
/// intersect it, loading only the parts that hold it.
pub(super) fn chunks_of(
    ck: &dyn Reader,
    name: &str,
    within: Option<(Vec<Index>, Vec<Index>)>,
) -> Result<Boxes, Error> {
    let got = match within {
        None => ck.chunks(name)?,
        Some((o, s)) => ck.chunks_within(name, &indexes(o), &indexes(s))?,
    };
    Ok(got.into_iter().map(|r| (r.offsets, r.shape)).collect())
}
