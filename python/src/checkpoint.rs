//! Reading: `ckptstore.Checkpoint` over an open checkpoint, numpy arrays over its
//! read-only maps, and freshly loaded optimizer state in arrays that own their buffers.

mod access;
mod convert;

use std::path::PathBuf;
use std::sync::Arc;

use ckptstore::checkpoint::Kind;
use ckptstore::optim::{StateValue, Tensor};
use ckptstore::Error;

/// A checkpoint whose shard bytes are in memory: open from a path (memory-mapped) or an
/// `s3://` URL (downloaded).
type Checkpoint = ckptstore::Checkpoint<ckptstore::Storage>;

use crate::reader::{Reader, Regions};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use rayon::prelude::*;

use crate::args::{indexes, Index, Name};
use crate::dtypes::{array_over, descr, uint8};

use crate::errors::{invalid_arg, CkError};
use crate::state::parse_layout;
use access::*;
pub(crate) use access::{region_reader, MappedCheckpoint};
use convert::*;
pub(crate) use convert::{owned_array, OwnedBuffer};

/// An open checkpoint: a ckptstore directory, a plain `.safetensors` file, or a Hugging
/// Face sharded directory. Opening validates the structure and maps the shards read-only;
/// no tensor data is read.
///
/// `ck[name]` returns a **read-only, zero-copy** numpy array over the mapped file. The
/// array keeps the mapping alive: it stays valid after the `Checkpoint` is closed or
/// garbage-collected. Use `np.array(ck[name])` for a writable copy.
///
/// Opened with `lazy=True` from an object store, the shards are not downloaded: reads
/// fetch the byte ranges they need, CRC-checked as they land, into fresh writable arrays
/// (`ck[name]`, `read`, `read_region`, `read_into`, `verify`); the zero-copy staging
/// primitives and `load_optimizer` need the bytes in memory and raise there.
#[pyclass(module = "ckptstore", name = "Checkpoint")]
pub(crate) struct PyCheckpoint {
    inner: Option<Inner>,
    /// Region reads into caller-owned buffers (`verify_regions`, `read_into`).
    regions: Regions,
}

/// An open checkpoint: the one reader over any shard source, and the same checkpoint typed
/// as resident (with the `base` its zero-copy arrays keep alive) when its bytes are in
/// memory.
struct Inner {
    any: Arc<dyn Reader>,
    resident: Option<(Arc<Checkpoint>, Py<MappedCheckpoint>)>,
}

#[pymethods]
impl PyCheckpoint {
    /// Open the checkpoint at `path` (see `ckptstore.open`); `lazy=True` opens an
    /// object-store checkpoint without downloading its shards.
    #[new]
    #[pyo3(signature = (path, *, lazy = false))]
    fn new(py: Python<'_>, path: PathBuf, lazy: bool) -> PyResult<Self> {
        let inner = match py
            .detach(|| crate::remote::open_any(&path, lazy))
            .map_err(CkError)?
        {
            crate::remote::Opened::Resident(ck) => {
                let ck: Arc<Checkpoint> = Arc::from(ck);
                let base = Py::new(py, MappedCheckpoint { ck: ck.clone() })?;
                Inner {
                    any: ck.clone(),
                    resident: Some((ck, base)),
                }
            }
            crate::remote::Opened::Fetched(any) => Inner {
                any,
                resident: None,
            },
        };
        Ok(PyCheckpoint {
            inner: Some(inner),
            regions: Regions::default(),
        })
    }

    /// Tensor names, in the order they are stored: whole tensors, and each global tensor
    /// of a multi-rank checkpoint once, by its global name (never its stored chunks: see
    /// `chunks(name)`).
    fn keys(&self) -> PyResult<Vec<String>> {
        let ck = self.reader()?;
        Ok(ck.entries().iter().map(|e| e.name.to_string()).collect())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.reader()?.entry_count())
    }

    fn __contains__(&self, name: &Bound<'_, PyAny>) -> PyResult<bool> {
        let ck = self.reader()?;
        // A name that is not a str, or not UTF-8, is in no checkpoint.
        let Ok(s) = name.cast::<pyo3::types::PyString>() else {
            return Ok(false);
        };
        Ok(s.to_cow().is_ok_and(|n| ck.entry(&n).is_ok()))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(PyList::new(py, self.keys()?)?.try_iter()?.into_any())
    }

    /// A read-only zero-copy numpy array over the tensor's mapped bytes (CRC not checked:
    /// see `get(name, verify=True)`); for a global tensor of a multi-rank checkpoint, the
    /// whole tensor assembled from its chunks into a fresh writable array, every chunk
    /// CRC-checked. Raises `TensorNotFoundError` (a `KeyError`).
    fn __getitem__(&self, py: Python<'_>, name: Name) -> PyResult<Py<PyAny>> {
        self.view_array(py, &name.0, false, false)
    }

    /// `ck.get(name, verify=False, raw=False)`: like `ck[name]`; with `verify=True` the
    /// tensor's CRC32 is checked first (`ChecksumError` on damage); with `raw=True` the
    /// array is the tensor's little-endian bytes as a 1-D `uint8` array (for frameworks
    /// whose dtypes numpy lacks).
    #[pyo3(signature = (name, *, verify = false, raw = false))]
    fn get(&self, py: Python<'_>, name: Name, verify: bool, raw: bool) -> PyResult<Py<PyAny>> {
        self.view_array(py, &name.0, verify, raw)
    }

    /// `ck.read(names=None, *, verify=True, raw=False) -> dict[str, ndarray]`: zero-copy
    /// read-only arrays for many tensors (all when `names` is None), their CRC32s checked
    /// first, in parallel, with the interpreter released. Raises before returning anything
    /// if a name is missing or a tensor is damaged.
    #[pyo3(signature = (names = None, *, verify = true, raw = false))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        names: Option<Vec<Name>>,
        verify: bool,
        raw: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let any = self.reader()?;
        let names: Vec<String> = match names {
            Some(n) => n.into_iter().map(|n| n.0).collect(),
            None => any.entries().iter().map(|e| e.name.to_string()).collect(),
        };
        let Some((ck, base)) = &self.inner()?.resident else {
            // Fetched shards: every tensor into a fresh array, CRC-checked as it landed,
            // all read before anything is returned.
            let any = any.clone();
            let ns = names.clone();
            let ts = py
                .detach(move || {
                    ns.par_iter()
                        .map(|n| match any.entry(n)?.global {
                            true => any.read_global(n),
                            false => any.read_tensor(n),
                        })
                        .collect::<Result<Vec<_>, Error>>()
                })
                .map_err(CkError)?;
            let out = PyDict::new(py);
            for (n, t) in names.iter().zip(ts) {
                out.set_item(n, owned_array(py, t, raw)?)?;
            }
            return Ok(out);
        };
        let mut whole = Vec::with_capacity(names.len());
        for n in &names {
            if !ck.entry(n).map_err(CkError)?.global {
                whole.push(n.clone());
            }
        }
        if verify {
            let ck2 = ck.clone();
            let ns = &whole;
            py.detach(move || verify_many(&ck2, ns)).map_err(CkError)?;
        }
        // Global tensors are assembled (and their chunks CRC-checked) before anything is
        // returned, like the whole tensors' checks above.
        let mut assembled = Vec::new();
        for n in &names {
            if ck.entry(n).map_err(CkError)?.global {
                assembled.push((n, read_global(py, any, n, raw)?));
            }
        }
        let out = PyDict::new(py);
        let mut assembled = assembled.into_iter().peekable();
        for n in &names {
            if assembled.peek().is_some_and(|(a, _)| *a == n) {
                let (_, arr) = assembled.next().ok_or_else(|| invalid_arg("internal"))?;
                out.set_item(n, arr)?;
                continue;
            }
            let v = ck.read(n).view_unchecked().map_err(CkError)?;
            out.set_item(n, self.wrap(py, base, v, raw)?)?;
        }
        Ok(out)
    }

    /// `ck.read_region(name, offsets, shape) -> ndarray`: the box `[offsets, offsets +
    /// shape)` of a global tensor (or of a whole tensor) in a fresh writable array,
    /// assembled from the chunks it intersects, every chunk read CRC-checked; the
    /// interpreter is released while it reads.
    fn read_region(
        &self,
        py: Python<'_>,
        name: Name,
        offsets: Vec<Index>,
        shape: Vec<Index>,
    ) -> PyResult<Py<PyAny>> {
        let ck = self.reader()?.clone();
        let (offsets, shape) = (indexes(offsets), indexes(shape));
        let t = py
            .detach(move || ck.read_region(&name.0, &offsets, &shape))
            .map_err(CkError)?;
        owned_array(py, t, false)
    }

    /// `ck.chunks(name, within=None) -> list[(offsets, shape)]`: how `name` is stored, as
    /// boxes of its global index space (one at the origin for a whole tensor). Of a
    /// two-level checkpoint's global this loads every part holding one (`grid_cells` reads
    /// the root only); `within=(offsets, shape)`: the chunks meeting that box, from the
    /// parts holding it alone.
    #[pyo3(signature = (name, within = None))]
    fn chunks(&self, name: Name, within: Option<(Vec<Index>, Vec<Index>)>) -> PyResult<Boxes> {
        Ok(chunks_of(self.reader()?.as_ref(), &name.0, within).map_err(CkError)?)
    }

    /// `ck.grid_cells(name, within=None) -> list[(offsets, shape)] | None`: of a global
    /// tensor of a two-level checkpoint, the cells of its chunk grid (row-major), from the
    /// root manifest alone (no part index loaded), each inside one stored chunk: a reader
    /// may plan with them as with `chunks(name)` (which loads every part holding one).
    /// `within`: boxes `(offsets, shape)` (a rank's reads): only the cells touching one,
    /// each once. `None` for flat globals and whole tensors; else `TensorNotFoundError`.
    #[pyo3(signature = (name, within = None))]
    fn grid_cells(
        &self,
        name: Name,
        within: Option<Vec<(Vec<Index>, Vec<Index>)>>,
    ) -> PyResult<Option<Boxes>> {
        let ck = self.reader()?;
        ck.shape_of(&name.0).map_err(CkError)?; // known?
        Ok(cells_within(ck.as_ref(), &name.0, within)
            .map(|cells| cells.into_iter().map(|r| (r.offsets, r.shape)).collect()))
    }

    /// Whether this is a two-level checkpoint (feature `parts`): the root manifest names
    /// part indexes, which hold the chunk entries of the global tensors and are read on
    /// first use (see `parts_read()`).
    #[getter]
    fn two_level(&self) -> PyResult<bool> {
        Ok(self.reader()?.two_level())
    }

    /// `ck.parts_read() -> (parts, bytes)`: how many part indexes of a two-level checkpoint
    /// this object has read so far, and their bytes; `(0, 0)` for a flat checkpoint.
    fn parts_read(&self) -> PyResult<(usize, u64)> {
        Ok(self.reader()?.parts_read())
    }

    /// `ck.globals() -> dict[str, (dtype, global_shape)]`: the global tensors (stored in
    /// chunks), by name.
    fn globals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ck = self.reader()?;
        let d = PyDict::new(py);
        for g in ck.globals() {
            d.set_item(&g.name, (g.dtype.name(), g.global_shape.clone()))?;
        }
        Ok(d)
    }

    /// `ck.info(name) -> dict`: `dtype` (wire name such as "F32"), `shape` (tuple; the
    /// global shape of a global tensor), `nbytes`, `global` (stored in chunks), `chunks`
    /// (how many), and for a whole tensor `shard` (index), `file` (shard file name) and
    /// `crc32` (None for foreign stores); those three are None for a global tensor (see
    /// `chunks(name)`).
    fn info<'py>(&self, py: Python<'py>, name: Name) -> PyResult<Bound<'py, PyDict>> {
        let name = name.0.as_str();
        let ck = self.reader()?;
        let e = ck.entry(name).map_err(CkError)?;
        let d = PyDict::new(py);
        d.set_item("dtype", e.dtype.name())?;
        d.set_item("shape", PyTuple::new(py, e.shape)?)?;
        let nbytes = ckptstore::tensor::checked_nbytes(e.dtype, e.shape)
            .ok_or_else(|| invalid_arg(format!("{name}: size overflows")))?;
        d.set_item("nbytes", nbytes)?;
        d.set_item("global", e.global)?;
        d.set_item("chunks", e.chunks)?;
        if e.global {
            d.set_item("shard", py.None())?;
            d.set_item("file", py.None())?;
            d.set_item("crc32", py.None())?;
        } else {
            let t = ck.info(name).map_err(CkError)?;
            d.set_item("shard", t.shard)?;
            d.set_item("file", ck.shard_file(t.shard))?;
            d.set_item("crc32", t.crc32)?;
        }
        Ok(d)
    }

    /// User metadata: a dict (the manifest's `metadata`; for foreign stores the
    /// safetensors `__metadata__` strings).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_py(py, self.reader()?.metadata())
    }

    /// "ckptstore", "safetensors" (a single file) or "hf-sharded".
    #[getter]
    fn kind(&self) -> PyResult<&'static str> {
        Ok(kind_name(self.reader()?.kind()))
    }

    /// The checkpoint id (ckptstore checkpoints only; None otherwise).
    #[getter]
    fn checkpoint_id(&self) -> PyResult<Option<String>> {
        Ok(self.reader()?.manifest().map(|m| m.checkpoint_id.clone()))
    }

    /// The directory the checkpoint was opened from (a single file's directory).
    #[getter]
    fn path(&self) -> PyResult<PathBuf> {
        Ok(self.reader()?.root().to_path_buf())
    }

    /// Paths of the shard files, in shard order (of a two-level checkpoint, the root's own
    /// shards: those of the whole tensors).
    #[getter]
    fn shard_files(&self) -> PyResult<Vec<PathBuf>> {
        let ck = self.reader()?;
        Ok((0..ck.shard_count())
            .filter_map(|i| ck.shard_file(i))
            .map(|f| shard_path(ck.as_ref(), f))
            .collect())
    }

    /// Total bytes of tensor data.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        Ok(self.reader()?.data_bytes())
    }

    /// True if the checkpoint holds an optimizer section.
    #[getter]
    fn has_optimizer(&self) -> PyResult<bool> {
        Ok(self
            .reader()?
            .manifest()
            .is_some_and(|m| m.optimizer.is_some()))
    }

    /// Check everything `open` does not: every shard header against the manifest, the
    /// optimizer section, and the CRC32 of every tensor (parallel, interpreter released).
    /// Returns `{"tensors": n, "bytes": n, "checksummed": bool}`; raises `ChecksumError` or
    /// `CorruptCheckpointError` naming the file, shard and tensor.
    fn verify<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ck = self.reader()?.clone();
        let r = py.detach(move || ck.verify()).map_err(CkError)?;
        let d = PyDict::new(py);
        d.set_item("tensors", r.tensors)?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("checksummed", r.checksummed)?;
        Ok(d)
    }

    /// `ck.load_optimizer(layout=None, *, counters=(), raw=False) -> dict`
    ///
    /// Load the optimizer state into fresh, writable arrays (each owns its buffer: no copy
    /// on the way to Python), converted to the layout the live optimizer wants. Every
    /// tensor read has its CRC32 checked; the mapped checkpoint is only read, so loading
    /// twice gives identical arrays.
    ///
    /// `layout`: None (everything as stored); a target name, applied to every
    /// floating-point state shaped like its parameter but never to counters (`step`, and
    /// the names in `counters`); or a dict of state name (or `(param, state)` tuple) ->
    /// target name, with `"*"` for the default. Targets: "as_stored", "f32", "bf16",
    /// "f16_scaled" (FP16 codes + FP32 scale: the stored scale shape, else `(1,)`),
    /// "f16_scaled_scalar" (scale shape `()`), "f16_scaled_one" (scale shape `(1,)`).
    ///
    /// Returns `{"param_groups": [{"params": [names], **hyper}], "param_shapes": {name:
    /// shape}, "state": {name: {state: ndarray | F16Scaled}}}`; parameters without state
    /// have no entry in `state`. Raises `OptimizerStateError` if there is no optimizer
    /// section or a conversion cannot be done, `ChecksumError` for damaged bytes.
    ///
    /// `release=True` drops each source tensor's mapped pages from the process once it is
    /// converted (the pages stay in the page cache): a restore's resident memory stays about
    /// the size of the state it loads.
    #[pyo3(signature = (layout = None, *, counters = Vec::new(), raw = false, release = false))]
    fn load_optimizer<'py>(
        &self,
        py: Python<'py>,
        layout: Option<&Bound<'py, PyAny>>,
        counters: Vec<String>,
        raw: bool,
        release: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let layout = parse_layout(layout, counters)?;
        let ck = self.open_parts_for("load_optimizer")?.0.clone();
        let st = py
            .detach(move || {
                if release {
                    ck.load_optimizer_opts(
                        &layout,
                        &ckptstore::optim::LoadOptions::default().release_pages(true),
                    )
                } else {
                    ck.load_optimizer(&layout)
                }
            })
            .map_err(CkError)?;
        let scaled_cls = py.import("ckptstore._types")?.getattr("F16Scaled")?;
        let groups = PyList::empty(py);
        let shapes = PyDict::new(py);
        for g in &st.groups {
            let gd = json_to_py(py, &serde_json::Value::Object(g.hyper.clone()))?
                .cast_into::<PyDict>()?;
            let names: Vec<&str> = g.params.iter().map(|p| p.name.as_str()).collect();
            gd.set_item("params", names)?;
            groups.append(gd)?;
            for p in &g.params {
                shapes.set_item(&p.name, PyTuple::new(py, &p.shape)?)?;
            }
        }
        let state = PyDict::new(py);
        for (param, states) in st.state {
            let sd = PyDict::new(py);
            for (name, v) in states {
                let obj = match v {
                    StateValue::Plain(t) => owned_array(py, t, raw)?,
                    StateValue::F16Scaled { q, scale } => scaled_cls
                        .call1((owned_array(py, q, raw)?, owned_array(py, scale, raw)?))?
                        .unbind(),
                };
                sd.set_item(name, obj)?;
            }
            state.set_item(param, sd)?;
        }
        let out = PyDict::new(py);
        out.set_item("param_groups", groups)?;
        out.set_item("param_shapes", shapes)?;
        out.set_item("state", state)?;
        Ok(out)
    }

    /// `ck.verify_tensors(names, *, release=False)`: check the CRC32 of every named tensor
    /// (parallel, read-ahead of cold bytes, interpreter released); with `release=True` each
    /// tensor's mapped pages leave the process afterwards. Raises `TensorNotFoundError`
    /// before reading anything for an unknown name, `ChecksumError` for damaged bytes.
    #[pyo3(signature = (names, *, release = false))]
    fn verify_tensors(&self, py: Python<'_>, names: Vec<Name>, release: bool) -> PyResult<()> {
        let ck = self.open_parts_for("verify_tensors")?.0.clone();
        let names: Vec<String> = names.into_iter().map(|n| n.0).collect();
        py.detach(move || batch::verify(&ck, &names, release))
            .map_err(CkError)?;
        Ok(())
    }

    /// `ck.copy_into_unchecked(pairs, *, release=False)`: copy each named tensor's stored bytes into
    /// its destination, a writable C-contiguous 1-D `uint8` array of exactly the tensor's
    /// byte length (a view of the destination tensor's memory); interpreter released. The
    /// CRC is not checked here (`verify_tensors` or `fill_and_verify` first). Every name
    /// and length is checked before any byte is written. Parallel across tensors and within
    /// large ones; with `release=True` mapped pages leave the process block by block.
    #[pyo3(signature = (pairs, *, release = false))]
    fn copy_into_unchecked(
        &self,
        py: Python<'_>,
        pairs: Vec<(Name, numpy::PyReadwriteArray1<'_, u8>)>,
        release: bool,
    ) -> PyResult<()> {
        let ck = self.open_parts_for("copy_into_unchecked")?.0.clone();
        let mut names = Vec::with_capacity(pairs.len());
        let mut arrays = Vec::with_capacity(pairs.len());
        for (Name(n), a) in pairs {
            let info = ck.info(&n).map_err(CkError)?;
            let len = a.len()?;
            if len as u64 != info.nbytes() {
                return Err(invalid_arg(format!(
                    "copy_into: tensor {n:?} is {} bytes, its destination {} bytes",
                    info.nbytes(),
                    len
                )));
            }
            names.push(n);
            arrays.push(a);
        }
        let dsts = writable_bytes("copy_into", &names, &mut arrays)?;
        py.detach(move || batch::copy(&ck, &names, dsts, release))
            .map_err(CkError)?;
        Ok(())
    }

    /// `ck.copy_ranges_into_unchecked(items)`: for each `(name, offset, dst)`, copy the tensor's
    /// stored bytes `[offset, offset + len(dst))` into `dst` (a writable C-contiguous 1-D
    /// `uint8` array); interpreter released, parallel. No CRC check here (`verify_tensors`
    /// or `fill_and_verify` first): for staging a large tensor in pieces. Every name and
    /// range is checked before any byte is written; raises `InvalidArgumentError` for a
    /// range outside its tensor.
    fn copy_ranges_into_unchecked(
        &self,
        py: Python<'_>,
        items: Vec<(Name, Index, numpy::PyReadwriteArray1<'_, u8>)>,
    ) -> PyResult<()> {
        let ck = self.open_parts_for("copy_ranges_into_unchecked")?.0.clone();
        let mut names = Vec::with_capacity(items.len());
        let mut offsets = Vec::with_capacity(items.len());
        let mut arrays = Vec::with_capacity(items.len());
        for (n, off, a) in items {
            names.push(n.0);
            offsets.push(off.0);
            arrays.push(a);
        }
        let dsts = writable_bytes("copy_ranges_into", &names, &mut arrays)?;
        py.detach(move || batch::copy_ranges(&ck, &names, offsets, dsts))
            .map_err(CkError)?;
        Ok(())
    }

    /// `ck.copy_into(pairs, *, release=False)`: the old name of `copy_into_unchecked`.
    #[pyo3(signature = (pairs, *, release = false))]
    fn copy_into(
        &self,
        py: Python<'_>,
        pairs: Vec<(Name, numpy::PyReadwriteArray1<'_, u8>)>,
        release: bool,
    ) -> PyResult<()> {
        self.copy_into_unchecked(py, pairs, release)
    }

    /// `ck.copy_ranges_into(items)`: the old name of `copy_ranges_into_unchecked`.
    fn copy_ranges_into(
        &self,
        py: Python<'_>,
        items: Vec<(Name, Index, numpy::PyReadwriteArray1<'_, u8>)>,
    ) -> PyResult<()> {
        self.copy_ranges_into_unchecked(py, items)
    }

    /// `ck.fill_and_verify(fills, verify=(), *, release=False)`: in one parallel pass
    /// (interpreter released), copy each `(name, dst)` of `fills` into `dst` with its CRC32
    /// computed on the way (every stored byte read once, written once), and check the CRC32
    /// of every name in `verify` without copying it. `dst`: a writable C-contiguous 1-D
    /// `uint8` array of exactly the tensor's byte length (a view of the memory that will
    /// hold the tensor, e.g. a fresh `torch.empty`). Names and lengths are checked before
    /// any byte is read. On `ChecksumError` the `fills` destinations hold unspecified bytes
    /// (use fresh memory); memory that must not change on failure goes through `verify`
    /// and `copy_into` afterwards. With `release=True` each tensor's mapped pages leave the
    /// process once it is done.
    #[pyo3(signature = (fills, verify = Vec::new(), *, release = false))]
    fn fill_and_verify(
        &self,
        py: Python<'_>,
        fills: Vec<(Name, numpy::PyReadwriteArray1<'_, u8>)>,
        verify: Vec<Name>,
        release: bool,
    ) -> PyResult<()> {
        let ck = self.open_parts_for("fill_and_verify")?.0.clone();
        let (names, mut arrays): (Vec<String>, Vec<_>) =
            fills.into_iter().map(|(n, a)| (n.0, a)).unzip();
        let verify: Vec<String> = verify.into_iter().map(|n| n.0).collect();
        let dsts = writable_bytes("fill_and_verify", &names, &mut arrays)?;
        py.detach(move || batch::fill(&ck, &names, dsts, &verify, release))
            .map_err(CkError)?;
        Ok(())
    }

    /// `ck.optimizer_plan() -> dict | None`: the optimizer section, checked, without reading
    /// any state: `{"param_groups": [{"params": [names], **hyper}], "param_shapes": {name:
    /// shape}, "state": {name: {state: {"tensor": name, "encoding": "plain" |
    /// "f16_scaled", "scale": name | None, "dtype": wire name | None, "shape": tuple |
    /// None}}}}` (dtype and shape None for state stored as a global tensor). None when the
    /// checkpoint holds no optimizer state. Raises `OptimizerStateError` for a broken
    /// section.
    fn optimizer_plan<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let ck = self.reader()?;
        let Some(sec) = ck.manifest().and_then(|m| m.optimizer.as_ref()) else {
            return Ok(None);
        };
        ck.check_optimizer_section().map_err(CkError)?;
        let groups = PyList::empty(py);
        for g in &sec.groups {
            let gd = json_to_py(py, &g.hyper)?.cast_into::<PyDict>()?;
            gd.set_item("params", &g.params)?;
            groups.append(gd)?;
        }
        let shapes = PyDict::new(py);
        let state = PyDict::new(py);
        for p in &sec.params {
            shapes.set_item(&p.name, PyTuple::new(py, &p.shape)?)?;
            if p.state.is_empty() {
                continue;
            }
            let sd = PyDict::new(py);
            for s in &p.state {
                let e = PyDict::new(py);
                e.set_item("tensor", &s.tensor)?;
                let enc = match s.encoding {
                    ckptstore::format::manifest::Encoding::Plain => "plain",
                    ckptstore::format::manifest::Encoding::F16Scaled => "f16_scaled",
                };
                e.set_item("encoding", enc)?;
                e.set_item("scale", s.scale.as_deref())?;
                match ck.info(&s.tensor) {
                    Ok(t) => {
                        e.set_item("dtype", t.dtype.name())?;
                        e.set_item("shape", PyTuple::new(py, &t.shape)?)?;
                    }
                    Err(_) => {
                        e.set_item("dtype", py.None())?;
                        e.set_item("shape", py.None())?;
                    }
                }
                sd.set_item(&s.name, e)?;
            }
            state.set_item(&p.name, sd)?;
        }
        let out = PyDict::new(py);
        out.set_item("param_groups", groups)?;
        out.set_item("param_shapes", shapes)?;
        out.set_item("state", state)?;
        Ok(Some(out))
    }

    /// Whether the shard bytes are in memory (memory-mapped or downloaded): then
    /// `byte_ranges` name local files and the zero-copy primitives work; `False` for an
    /// object-store checkpoint opened with `lazy=True`.
    #[getter]
    fn resident(&self) -> PyResult<bool> {
        Ok(self.reader()?.resident())
    }

    /// The old name of `resident` (the DCP reader's "is the checkpoint local").
    #[getter]
    fn is_local(&self) -> PyResult<bool> {
        self.resident()
    }

    /// The manifest's user metadata as JSON text.
    fn metadata_json(&self) -> PyResult<String> {
        serde_json::to_string(self.reader()?.metadata()).map_err(|e| invalid_arg(e.to_string()))
    }

    /// `(wire dtype, shape)` of a global or whole tensor.
    fn shape_of(&self, name: Name) -> PyResult<(String, Vec<u64>)> {
        let (d, s) = self.reader()?.shape_of(&name.0).map_err(CkError)?;
        Ok((d.name().to_string(), s))
    }

    /// `verify_regions([(name, offsets, shape), ...])`: check the CRC32s of everything
    /// these regions read (the blocks they touch, or whole chunks without block CRCs; each
    /// region once per checkpoint object, in parallel, interpreter released). Raises
    /// `ChecksumError` naming the damaged tensor (and block) and its shard. From fetched
    /// shards the checked bytes are kept until `read_into` copies them.
    fn verify_regions(
        &self,
        py: Python<'_>,
        regions: Vec<(Name, Vec<Index>, Vec<Index>)>,
    ) -> PyResult<()> {
        let ck = self.reader()?;
        let regions = regions
            .into_iter()
            .map(|(n, o, s)| (n.0, indexes(o), indexes(s)))
            .collect();
        py.detach(|| self.regions.verify(ck.as_ref(), regions))
            .map_err(CkError)?;
        Ok(())
    }

    /// `byte_ranges([(name, offsets, shape), ...]) -> [(file, begin, end)]`: where the
    /// bytes these boxes read lie (blocks or whole chunks; merged per file where they
    /// touch or overlap): the shard file's path and the byte range, for the caller to
    /// prefetch. Of a two-level checkpoint the ranges name the parts' shard files too
    /// (loading the part indexes the boxes touch, which the read needs anyway). Fetched
    /// shards have no files to prefetch: the list is empty (their reads fetch exactly
    /// these ranges).
    fn byte_ranges(
        &self,
        regions: Vec<(Name, Vec<Index>, Vec<Index>)>,
    ) -> PyResult<Vec<(PathBuf, u64, u64)>> {
        let ck = self.reader()?;
        let regions: Vec<(String, Vec<u64>, Vec<u64>)> = regions
            .into_iter()
            .map(|(n, o, s)| (n.0, indexes(o), indexes(s)))
            .collect();
        if !ck.resident() {
            return Ok(Vec::new());
        }
        if ck.two_level() {
            // The chunks lie in the parts' shards, which the root's shard list lacks: each
            // range names its file (loading the parts the boxes touch, as the read will).
            let mut ranges: Vec<(&str, u64, u64)> = Vec::new();
            for (n, o, s) in &regions {
                ranges.extend(ck.region_file_ranges(n, o, s).map_err(CkError)?);
            }
            ranges.sort_unstable();
            let mut merged: Vec<(&str, u64, u64)> = Vec::new();
            for (f, b, e) in ranges {
                match merged.last_mut() {
                    Some(last) if last.0 == f && b <= last.2 => last.2 = last.2.max(e),
                    _ => merged.push((f, b, e)),
                }
            }
            return Ok(merged
                .into_iter()
                .map(|(f, b, e)| (shard_path(ck.as_ref(), f), b, e))
                .collect());
        }
        let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
        for (n, o, s) in &regions {
            ranges.extend(ck.region_byte_ranges(n, o, s).map_err(CkError)?);
        }
        ranges.sort_unstable();
        let mut merged: Vec<(usize, u64, u64)> = Vec::new();
        for (sh, b, e) in ranges {
            match merged.last_mut() {
                Some(last) if last.0 == sh && b <= last.2 => last.2 = last.2.max(e),
                _ => merged.push((sh, b, e)),
            }
        }
        let files = self.shard_files()?;
        Ok(merged
            .into_iter()
            .filter_map(|(sh, b, e)| Some((files.get(sh)?.clone(), b, e)))
            .collect())
    }

    /// `read_into([(name, offsets, shape, out), ...])`: copy each box into `out`, a
    /// writable, C-contiguous 1-D `uint8` array of exactly the box's bytes (the memory of
    /// the destination tensor), every stored tensor read from CRC-checked first (once per
    /// checkpoint object: see `verify_regions`). Requests run in parallel with the
    /// interpreter released; the destinations must not overlap.
    fn read_into(&self, py: Python<'_>, requests: Vec<Request<'_>>) -> PyResult<()> {
        self.region_requests(py, requests, false)
    }

    /// `fill_into([(name, offsets, shape, out), ...])`: `read_into` in one pass over the
    /// stored bytes, for destinations nothing uses if the call fails: each block is
    /// CRC-checked and copied while it is in the cache (blocks and requests in parallel,
    /// interpreter released). **On `ChecksumError` the destinations are partly written**
    /// (fresh tensors to throw away, or state the caller must not use). Regions already
    /// checked by `verify_regions` are copied as `read_into` copies them.
    fn fill_into(&self, py: Python<'_>, requests: Vec<Request<'_>>) -> PyResult<()> {
        self.region_requests(py, requests, true)
    }

    /// `verify_received([(name, offsets, shape, buf), ...])`: check that each `buf` (a
    /// C-contiguous 1-D `uint8` array: the memory of a destination the bytes were received
    /// into, from a peer's copy of the shard) holds exactly the stored bytes of its box, by
    /// the CRC32s the manifest records; the stored bytes are not read. Each box must be one
    /// whole stored chunk (a whole tensor, or one chunk of a global tensor). In parallel,
    /// interpreter released. Raises `ChecksumError` naming the tensor (and block) and shard
    /// for bytes that differ, `ValueError` for a box that is not one stored chunk or a
    /// buffer of another size.
    fn verify_received(&self, py: Python<'_>, requests: Vec<Request<'_>>) -> PyResult<()> {
        self.given_requests(py, requests)
    }

    /// Drop this object's hold on the mapping. Arrays already handed out stay valid (each
    /// holds the mapping itself); further calls on this object raise `ValueError`.
    fn close(&mut self) {
        self.inner = None;
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&mut self, _args: &Bound<'_, PyTuple>) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        match &self.inner {
            None => "<ckptstore.Checkpoint (closed)>".into(),
            Some(Inner { any: ck, .. }) => format!(
                "<ckptstore.Checkpoint {:?} kind={} tensors={} bytes={}>",
                ck.root().display().to_string(),
                kind_name(ck.kind()),
                ck.tensors().len(),
                ck.data_bytes()
            ),
        }
    }
}
