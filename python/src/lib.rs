//! `ckptstore._ckptstore`: the native half of the `ckptstore` Python package.
//!
//! The Python package (`python/ckptstore/`) wraps this module: it maps numpy dtypes to
//! wire names, gathers arrays the writer cannot take as they are, and builds the optimizer
//! section of torch checkpoints. Everything that touches tensor bytes happens here, in the
//! Rust engine, with the interpreter detached:
//!
//! * [`save`] hands numpy buffers to the writer without copying them (C-contiguous arrays
//!   as they are, strided ones through `TensorRef::strided`);
//! * [`PyCheckpoint`] reads tensors as read-only numpy arrays **over the memory map**, each
//!   array keeping the mapping alive through its `base` object;
//! * `load_optimizer` returns freshly allocated, writable arrays that own the engine's
//!   buffers (no copy on the way to Python).

use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;

use ckptstore::format::manifest::{Encoding, OptimizerSection};
use ckptstore::optim::{ScaleShape, StateLayout, StateValue, Target, Tensor};
use ckptstore::{Checkpoint, DType, Error, Kind, SaveOptions, TensorRef};
use numpy::npyffi::{self, npy_intp, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

// ------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------

/// A library error on its way to Python.
struct CkError(Error);

impl From<Error> for CkError {
    fn from(e: Error) -> Self {
        CkError(e)
    }
}

/// The Python module holding the exception classes (`ckptstore/errors.py`).
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn errors_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    ERRORS
        .get_or_try_init(py, || py.import("ckptstore.errors").map(Bound::unbind))
        .map(|m| m.bind(py))
}

/// The exception class for `e` and the attributes it carries besides the message.
fn classify(e: &Error) -> (&'static str, Vec<(&'static str, Py<PyAny>)>) {
    Python::attach(|py| {
        let s = |v: &str| v.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
        let n = |v: u64| v.into_pyobject(py).map(|o| o.into_any().unbind()).ok();
        let attrs = |pairs: Vec<(&'static str, Option<Py<PyAny>>)>| {
            pairs
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| (k, v)))
                .collect::<Vec<_>>()
        };
        match e {
            Error::Io { op, path, source } => (
                "CheckpointIOError",
                attrs(vec![
                    ("op", s(op)),
                    ("filename", s(&path.display().to_string())),
                    (
                        "errno",
                        source
                            .raw_os_error()
                            .and_then(|c| c.into_pyobject(py).ok())
                            .map(|o| o.into_any().unbind()),
                    ),
                ]),
            ),
            Error::NotFound { path, .. } => (
                "CheckpointNotFoundError",
                attrs(vec![("filename", s(&path.display().to_string()))]),
            ),
            Error::InvalidHeader { file, .. } | Error::InvalidManifest { file, .. } => {
                ("CorruptCheckpointError", attrs(vec![("file", s(file))]))
            }
            Error::ShardMismatch { shard, file, .. } => (
                "CorruptCheckpointError",
                attrs(vec![("file", s(file)), ("shard", n(*shard as u64))]),
            ),
            Error::ChecksumMismatch {
                what,
                shard,
                file,
                expected,
                got,
            } => (
                "ChecksumError",
                attrs(vec![
                    ("what", s(what)),
                    ("file", s(file)),
                    ("shard", n(*shard as u64)),
                    ("expected", n(u64::from(*expected))),
                    ("got", n(u64::from(*got))),
                ]),
            ),
            Error::UnsupportedVersion { file, .. } | Error::UnsupportedFeature { file, .. } => {
                ("UnsupportedFormatError", attrs(vec![("file", s(file))]))
            }
            Error::TensorNotFound { name } => {
                ("TensorNotFoundError", attrs(vec![("name", s(name))]))
            }
            Error::InvalidTensor { name, .. } | Error::BadView { name, .. } => {
                ("InvalidTensorError", attrs(vec![("name", s(name))]))
            }
            Error::InvalidOptimizerState { param, state, .. } => (
                "OptimizerStateError",
                attrs(vec![("param", s(param)), ("state", s(state))]),
            ),
            Error::Conversion { param, state, .. } => (
                "OptimizerStateError",
                attrs(vec![("param", s(param)), ("state", s(state))]),
            ),
            Error::IncompatibleState { .. } => ("IncompatibleStateError", vec![]),
            Error::InvalidArgument(_) => ("InvalidArgumentError", vec![]),
            _ => ("CheckpointError", vec![]),
        }
    })
}

impl From<CkError> for PyErr {
    fn from(e: CkError) -> PyErr {
        let msg = e.0.to_string();
        let (class, attrs) = classify(&e.0);
        Python::attach(|py| {
            let build = || -> PyResult<PyErr> {
                let cls = errors_module(py)?.getattr(class)?;
                let exc = cls.call1((msg.clone(),))?;
                for (k, v) in attrs {
                    exc.setattr(k, v)?;
                }
                Ok(PyErr::from_value(exc))
            };
            // If the exception module cannot be imported, still report the message.
            build().unwrap_or_else(|_| pyo3::exceptions::PyRuntimeError::new_err(msg.clone()))
        })
    }
}

fn invalid_arg(msg: impl Into<String>) -> PyErr {
    CkError(Error::InvalidArgument(msg.into())).into()
}

// ------------------------------------------------------------------------------------
// dtypes
// ------------------------------------------------------------------------------------

/// numpy type strings of the dtypes numpy has natively (little-endian, as on disk).
fn numpy_typestr(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::Bool => "|b1",
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::U16 => "<u2",
        DType::F16 => "<f2",
        DType::I32 => "<i4",
        DType::U32 => "<u4",
        DType::F32 => "<f4",
        DType::I64 => "<i8",
        DType::U64 => "<u8",
        DType::F64 => "<f8",
        _ => return None,
    })
}

static DESCRS: PyOnceLock<HashMap<DType, Py<PyArrayDescr>>> = PyOnceLock::new();
static BF16: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
static UINT8: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();

/// The numpy dtype of a tensor dtype: numpy's own, or `ml_dtypes.bfloat16` for BF16.
fn descr(py: Python<'_>, d: DType) -> PyResult<Bound<'_, PyArrayDescr>> {
    if d == DType::BF16 {
        let b = BF16.get_or_try_init(py, || -> PyResult<_> {
            let ml = py.import("ml_dtypes").map_err(|e| {
                pyo3::exceptions::PyImportError::new_err(format!(
                    "reading a BF16 tensor as a numpy array needs the ml_dtypes package \
                     (pip install ml_dtypes): {e}"
                ))
            })?;
            let t = ml.getattr("bfloat16")?;
            Ok(PyArrayDescr::new(py, t)?.unbind())
        })?;
        return Ok(b.bind(py).clone());
    }
    let map = DESCRS.get_or_try_init(py, || -> PyResult<_> {
        let mut m = HashMap::new();
        for d in DType::ALL {
            if let Some(s) = numpy_typestr(d) {
                m.insert(d, PyArrayDescr::new(py, s)?.unbind());
            }
        }
        Ok(m)
    })?;
    map.get(&d)
        .map(|x| x.bind(py).clone())
        .ok_or_else(|| invalid_arg(format!("dtype {d} has no numpy equivalent")))
}

fn uint8(py: Python<'_>) -> PyResult<Bound<'_, PyArrayDescr>> {
    Ok(UINT8
        .get_or_try_init(py, || PyArrayDescr::new(py, "|u1").map(Bound::unbind))?
        .bind(py)
        .clone())
}

fn parse_dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| invalid_arg(format!("unknown dtype {name:?}")))
}

/// A numpy array over `len` bytes at `data`, C-contiguous, with `base` as its base object
/// (which must keep the bytes alive and unchanged for as long as it lives).
///
/// # Safety
/// `data` must point to `shape`-many elements of `descr` (or be any non-null pointer when
/// the shape has no elements) that stay valid while `base` lives; if `writable`, nothing
/// else may read or write them while the array (or a view of it) exists.
unsafe fn array_over(
    py: Python<'_>,
    descr: Bound<'_, PyArrayDescr>,
    shape: &[u64],
    data: *mut u8,
    writable: bool,
    base: Py<PyAny>,
) -> PyResult<Py<PyAny>> {
    let mut dims = shape
        .iter()
        .map(|&d| npy_intp::try_from(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| invalid_arg(format!("shape {shape:?} is too large for numpy")))?;
    let flags: c_int = if writable { NPY_ARRAY_WRITEABLE } else { 0 };
    // SAFETY: the API table is loaded by `PY_ARRAY_API` on first use (attached to the
    // interpreter); `descr.into_dtype_ptr()` hands over the reference the call steals; `dims`
    // has `dims.len()` entries; null strides ask for C-contiguous strides; the caller
    // guarantees `data` is valid for the array's extent.
    let arr = unsafe {
        PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            descr.into_dtype_ptr(),
            dims.len() as c_int,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            data.cast::<c_void>(),
            flags,
            std::ptr::null_mut(),
        )
    };
    if arr.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `arr` is a new, owned reference to an ndarray, just checked non-null.
    let owned = unsafe { Bound::from_owned_ptr(py, arr) };
    // SAFETY: `arr` is an ndarray without a base; the call steals the reference to `base`
    // (also on failure).
    let rc = unsafe {
        PY_ARRAY_API.PyArray_SetBaseObject(py, arr.cast::<npyffi::PyArrayObject>(), base.into_ptr())
    };
    if rc < 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(owned.unbind())
}

// ------------------------------------------------------------------------------------
// Save
// ------------------------------------------------------------------------------------

/// The bytes a numpy array's elements span, and its strides in elements (`None` when
/// C-contiguous).
fn array_bytes<'a>(
    name: &str,
    arr: &'a Bound<'_, PyUntypedArray>,
    dtype: DType,
) -> PyResult<(&'a [u8], Option<Vec<u64>>)> {
    let es = dtype.size();
    let itemsize = arr.dtype().itemsize();
    if itemsize != es {
        return Err(invalid_arg(format!(
            "tensor {name:?}: the array's items are {itemsize} bytes, {dtype} needs {es}"
        )));
    }
    if arr.dtype().is_native_byteorder() == Some(false) {
        return Err(invalid_arg(format!(
            "tensor {name:?}: the array is not in native byte order"
        )));
    }
    let shape = arr.shape();
    let numel = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid_arg(format!("tensor {name:?}: shape overflows")))?;
    // SAFETY: `arr` is a live ndarray (attached to the interpreter); the fields pointer is
    // valid for as long as the array is.
    let data = unsafe { (*npyffi::_PyArray_GET_ITEM_DATA(arr.as_array_ptr())).data }.cast::<u8>();
    if numel == 0 || data.is_null() {
        return Ok((&[], None));
    }
    let (len, strides) = if arr.is_c_contiguous() {
        (numel * es, None)
    } else {
        let mut extent = es;
        let mut st = Vec::with_capacity(shape.len());
        for (&d, &s) in shape.iter().zip(arr.strides()) {
            if s < 0 || !(s as usize).is_multiple_of(es) {
                return Err(invalid_arg(format!(
                    "tensor {name:?}: strides {:?} are negative or not whole elements; pass a contiguous copy",
                    arr.strides()
                )));
            }
            extent += (d - 1) * s as usize;
            st.push((s as usize / es) as u64);
        }
        (extent, Some(st))
    };
    // SAFETY: numpy guarantees that an array's elements lie within `data .. data + extent`
    // for the non-negative strides checked above (C-contiguous: `numel * itemsize` bytes).
    // The slice borrows `arr`, which holds a reference to the array (and so its memory) for
    // the slice's whole life; the writer only reads it.
    let bytes = unsafe { std::slice::from_raw_parts(data, len) };
    Ok((bytes, strides))
}

/// Check an optimizer section against the tensors about to be saved, by the rules the
/// reader enforces (format-spec/optimizer.md §Rules O2-O8), so that a bad section fails
/// before anything is written.
fn check_section(sec: &OptimizerSection, tensors: &[TensorRef<'_>]) -> Result<(), Error> {
    let bad = |p: &str, s: &str, r: String| Error::InvalidOptimizerState {
        param: p.into(),
        state: s.into(),
        reason: r,
    };
    let by_name: HashMap<&str, &TensorRef<'_>> = tensors.iter().map(|t| (t.name(), t)).collect();
    let mut in_groups = HashSet::new();
    for (gi, g) in sec.groups.iter().enumerate() {
        if !g.hyper.is_object() {
            return Err(bad(
                "",
                "",
                format!("group {gi}: hyper is not a JSON object"),
            ));
        }
        for p in &g.params {
            if p.is_empty() {
                return Err(bad(
                    "",
                    "",
                    format!("group {gi} has an empty parameter name"),
                ));
            }
            if !in_groups.insert(p.as_str()) {
                return Err(bad(
                    p,
                    "",
                    "the parameter is named twice in the groups".into(),
                ));
            }
        }
    }
    let mut listed = HashSet::new();
    let mut used = HashSet::new();
    for p in &sec.params {
        if !in_groups.contains(p.name.as_str()) {
            return Err(bad(
                &p.name,
                "",
                "state for a parameter that no group names".into(),
            ));
        }
        if !listed.insert(p.name.as_str()) {
            return Err(bad(&p.name, "", "listed twice".into()));
        }
        let mut names = HashSet::new();
        for s in &p.state {
            let err = |r: String| bad(&p.name, &s.name, r);
            if s.name.is_empty() || !names.insert(s.name.as_str()) {
                return Err(err("state name empty or repeated".into()));
            }
            let t = by_name
                .get(s.tensor.as_str())
                .ok_or_else(|| err(format!("names tensor {:?}, which is not saved", s.tensor)))?;
            if !used.insert(s.tensor.as_str()) {
                return Err(err(format!("tensor {:?} is referenced twice", s.tensor)));
            }
            let scalar = t.shape().len() <= 1 && t.shape().iter().product::<u64>() <= 1;
            if t.shape() != p.shape.as_slice() && !scalar {
                return Err(err(format!(
                    "shape {:?} fits neither the parameter's {:?} nor a scalar",
                    t.shape(),
                    p.shape
                )));
            }
            match (s.encoding, &s.scale) {
                (Encoding::Plain, None) => {}
                (Encoding::F16Scaled, Some(sc)) => {
                    let st = by_name
                        .get(sc.as_str())
                        .ok_or_else(|| err(format!("names scale {sc:?}, which is not saved")))?;
                    if !used.insert(sc.as_str()) {
                        return Err(err(format!("tensor {sc:?} is referenced twice")));
                    }
                    if t.dtype() != DType::F16
                        || st.dtype() != DType::F32
                        || st.shape().len() > 1
                        || st.shape().iter().product::<u64>() != 1
                    {
                        return Err(err(format!(
                            "f16_scaled needs F16 codes and an F32 scale of shape [] or [1], got {} codes and a {} {:?} scale",
                            t.dtype(),
                            st.dtype(),
                            st.shape()
                        )));
                    }
                }
                _ => {
                    return Err(err(
                        "a plain state has no scale; an f16_scaled state needs one".into(),
                    ))
                }
            }
        }
    }
    if let Some(p) = in_groups.iter().find(|p| !listed.contains(*p)) {
        return Err(bad(
            p,
            "",
            "named by a group but missing from params".into(),
        ));
    }
    Ok(())
}

/// Save tensors as a checkpoint (see `ckptstore.save`, which prepares the arguments).
///
/// `tensors` is a list of `(name, wire dtype, ndarray)`; arrays must be in native byte
/// order with non-negative strides that are whole elements. `metadata` and `optimizer`
/// are JSON text (the manifest's `metadata` object and optimizer section).
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata = None, max_shard_size = None, optimizer = None))]
fn save<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Vec<(String, String, Bound<'py, PyUntypedArray>)>,
    metadata: Option<&str>,
    max_shard_size: Option<u64>,
    optimizer: Option<&str>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut opts = SaveOptions::default();
    if let Some(m) = metadata {
        opts.metadata = serde_json::from_str(m)
            .map_err(|e| invalid_arg(format!("metadata is not valid JSON: {e}")))?;
    }
    if let Some(s) = max_shard_size {
        opts.max_shard_size = s;
    }
    let section: Option<OptimizerSection> = optimizer
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| invalid_arg(format!("optimizer section: {e}")))?;
    let mut refs = Vec::with_capacity(tensors.len());
    for (name, dt, arr) in &tensors {
        let dtype = parse_dtype(dt)?;
        let shape: Vec<u64> = arr.shape().iter().map(|&d| d as u64).collect();
        let (bytes, strides) = array_bytes(name, arr, dtype)?;
        refs.push(match strides {
            None => TensorRef::new(name.as_str(), dtype, &shape, bytes),
            Some(st) => TensorRef::strided(name.as_str(), dtype, &shape, &st, 0, bytes),
        });
    }
    if let Some(sec) = &section {
        check_section(sec, &refs).map_err(CkError)?;
    }
    let info = py
        .detach(|| ckptstore::save_with_section(&path, &refs, &opts, section))
        .map_err(CkError)?;
    let d = PyDict::new(py);
    d.set_item("checkpoint_id", info.checkpoint_id)?;
    d.set_item("shards", info.shards)?;
    d.set_item("tensors", info.tensors)?;
    d.set_item("data_bytes", info.data_bytes)?;
    d.set_item("removed", info.removed)?;
    Ok(d)
}

// ------------------------------------------------------------------------------------
// Reading
// ------------------------------------------------------------------------------------

/// Keeps an open checkpoint (its read-only memory maps) alive: the `base` of every array
/// `Checkpoint` hands out, so a mapping lives as long as any array over it.
#[pyclass(module = "ckptstore._ckptstore", frozen)]
struct MappedCheckpoint {
    #[allow(dead_code)] // held for its lifetime only
    ck: Arc<Checkpoint>,
}

/// Owns one buffer loaded by `load_optimizer`: the `base` of the writable array over it.
#[pyclass(module = "ckptstore._ckptstore", frozen)]
struct OwnedBuffer {
    #[allow(dead_code)] // held for its lifetime only
    tensor: Tensor,
}

/// A numpy array that owns a freshly loaded tensor's buffer (no copy).
fn owned_array(py: Python<'_>, mut t: Tensor, raw: bool) -> PyResult<Py<PyAny>> {
    let (d, shape) = if raw {
        (uint8(py)?, vec![t.bytes().len() as u64])
    } else {
        (descr(py, t.dtype())?, t.shape().to_vec())
    };
    let ptr = t.bytes_mut().as_mut_ptr();
    // The Tensor's bytes live in a heap allocation that moving the Tensor does not move.
    let base = Py::new(py, OwnedBuffer { tensor: t })?;
    // SAFETY: `ptr` points to the tensor's `numel * size` bytes, owned by `base` (which the
    // array keeps alive and nothing else reads or writes: it is frozen and exposes nothing).
    unsafe { array_over(py, d, &shape, ptr, true, base.into_any()) }
}

fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(v).map_err(|e| invalid_arg(e.to_string()))?;
    py.import("json")?.call_method1("loads", (text,))
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Native => "ckptstore",
        Kind::Safetensors => "safetensors",
        Kind::HfSharded => "hf-sharded",
        _ => "unknown",
    }
}

/// Parse one layout target name.
fn parse_target(s: &str) -> PyResult<Target> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "as_stored" | "stored" => Target::AsStored,
        "f32" | "float32" => Target::F32,
        "bf16" | "bfloat16" => Target::BF16,
        "f16_scaled" => Target::F16Scaled(ScaleShape::Keep),
        "f16_scaled_scalar" => Target::F16Scaled(ScaleShape::Scalar),
        "f16_scaled_one" => Target::F16Scaled(ScaleShape::One),
        _ => {
            return Err(invalid_arg(format!(
                "unknown layout target {s:?}: use \"as_stored\", \"f32\", \"bf16\", \
                 \"f16_scaled\", \"f16_scaled_scalar\" or \"f16_scaled_one\""
            )))
        }
    })
}

/// Build a `StateLayout` from the Python description (see `Checkpoint.load_optimizer`).
fn parse_layout(layout: Option<&Bound<'_, PyAny>>, counters: Vec<String>) -> PyResult<StateLayout> {
    let mut l = StateLayout::default();
    match layout {
        None => {}
        Some(obj) if obj.is_none() => {}
        Some(obj) => {
            if let Ok(s) = obj.extract::<String>() {
                l = StateLayout::with_default(parse_target(&s)?);
            } else if let Ok(d) = obj.cast::<PyDict>() {
                // The default first, so that the per-state entries survive it.
                if let Some(t) = d.get_item("*")? {
                    l = StateLayout::with_default(parse_target(&t.extract::<String>()?)?);
                }
                for (k, v) in d.iter() {
                    let target = parse_target(&v.extract::<String>().map_err(|_| {
                        invalid_arg(format!("layout value for {k} must be a string"))
                    })?)?;
                    if let Ok(key) = k.extract::<String>() {
                        if key != "*" {
                            l = l.state(key, target);
                        }
                    } else if let Ok((param, state)) = k.extract::<(String, String)>() {
                        l = l.param_state(param, state, target);
                    } else {
                        return Err(invalid_arg(format!(
                            "layout keys are state names, \"*\" or (param, state) tuples, not {k}"
                        )));
                    }
                }
            } else {
                return Err(invalid_arg(
                    "layout must be None, a target name or a dict of state name -> target name",
                ));
            }
        }
    }
    for c in counters {
        l = l.counter(c);
    }
    Ok(l)
}

/// An open checkpoint: a ckptstore directory, a plain `.safetensors` file, or a Hugging
/// Face sharded directory. Opening validates the structure and maps the shards read-only;
/// no tensor data is read.
///
/// `ck[name]` returns a **read-only, zero-copy** numpy array over the mapped file. The
/// array keeps the mapping alive: it stays valid after the `Checkpoint` is closed or
/// garbage-collected. Use `np.array(ck[name])` for a writable copy.
#[pyclass(module = "ckptstore", name = "Checkpoint")]
struct PyCheckpoint {
    inner: Option<(Arc<Checkpoint>, Py<MappedCheckpoint>)>,
}

impl PyCheckpoint {
    fn open_parts(&self) -> PyResult<(&Arc<Checkpoint>, &Py<MappedCheckpoint>)> {
        self.inner
            .as_ref()
            .map(|(a, b)| (a, b))
            .ok_or_else(|| PyValueError::new_err("the checkpoint is closed"))
    }

    fn view_array(
        &self,
        py: Python<'_>,
        name: &str,
        verify: bool,
        raw: bool,
    ) -> PyResult<Py<PyAny>> {
        let (ck, base) = self.open_parts()?;
        if verify {
            let ck = ck.clone();
            let n = name.to_string();
            py.detach(move || ck.tensor_verified(&n).map(|_| ()))
                .map_err(CkError)?;
        }
        let v = ck.tensor(name).map_err(CkError)?;
        self.wrap(py, base, v, raw)
    }

    fn wrap(
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
        // SAFETY: the view's bytes lie in a read-only memory map owned by the `Checkpoint`
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
}

#[pymethods]
impl PyCheckpoint {
    /// Open the checkpoint at `path` (see `ckptstore.open`).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let ck = Arc::new(py.detach(|| Checkpoint::open(&path)).map_err(CkError)?);
        let base = Py::new(py, MappedCheckpoint { ck: ck.clone() })?;
        Ok(PyCheckpoint {
            inner: Some((ck, base)),
        })
    }

    /// Tensor names, in manifest (or header) order.
    fn keys(&self) -> PyResult<Vec<String>> {
        let (ck, _) = self.open_parts()?;
        Ok(ck.tensors().iter().map(|t| t.name.clone()).collect())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.open_parts()?.0.tensors().len())
    }

    fn __contains__(&self, name: &str) -> PyResult<bool> {
        Ok(self.open_parts()?.0.info(name).is_ok())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(PyList::new(py, self.keys()?)?.try_iter()?.into_any())
    }

    /// A read-only zero-copy numpy array over the tensor's mapped bytes (CRC not checked:
    /// see `get(name, verify=True)`). Raises `TensorNotFoundError` (a `KeyError`).
    fn __getitem__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        self.view_array(py, name, false, false)
    }

    /// `ck.get(name, verify=False, raw=False)`: like `ck[name]`; with `verify=True` the
    /// tensor's CRC32 is checked first (`ChecksumError` on damage); with `raw=True` the
    /// array is the tensor's little-endian bytes as a 1-D `uint8` array (for frameworks
    /// whose dtypes numpy lacks).
    #[pyo3(signature = (name, *, verify = false, raw = false))]
    fn get(&self, py: Python<'_>, name: &str, verify: bool, raw: bool) -> PyResult<Py<PyAny>> {
        self.view_array(py, name, verify, raw)
    }

    /// `ck.read(names=None, *, verify=True, raw=False) -> dict[str, ndarray]`: zero-copy
    /// read-only arrays for many tensors (all when `names` is None), their CRC32s checked
    /// first, in parallel, with the interpreter released. Raises before returning anything
    /// if a name is missing or a tensor is damaged.
    #[pyo3(signature = (names = None, *, verify = true, raw = false))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        names: Option<Vec<String>>,
        verify: bool,
        raw: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (ck, base) = self.open_parts()?;
        let names = match names {
            Some(n) => n,
            None => ck.tensors().iter().map(|t| t.name.clone()).collect(),
        };
        for n in &names {
            ck.info(n).map_err(CkError)?;
        }
        if verify {
            let ck2 = ck.clone();
            let ns = &names;
            py.detach(move || verify_many(&ck2, ns)).map_err(CkError)?;
        }
        let out = PyDict::new(py);
        for n in &names {
            let v = ck.tensor(n).map_err(CkError)?;
            out.set_item(n, self.wrap(py, base, v, raw)?)?;
        }
        Ok(out)
    }

    /// `ck.info(name) -> dict`: `dtype` (wire name such as "F32"), `shape` (tuple),
    /// `nbytes`, `shard` (index), `file` (shard file name) and `crc32` (None for foreign
    /// stores).
    fn info<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        let (ck, _) = self.open_parts()?;
        let t = ck.info(name).map_err(CkError)?;
        let d = PyDict::new(py);
        d.set_item("dtype", t.dtype.name())?;
        d.set_item("shape", PyTuple::new(py, &t.shape)?)?;
        d.set_item("nbytes", t.nbytes())?;
        d.set_item("shard", t.shard)?;
        d.set_item("file", &ck.shards()[t.shard].file)?;
        d.set_item("crc32", t.crc32)?;
        Ok(d)
    }

    /// User metadata: a dict (the manifest's `metadata`; for foreign stores the
    /// safetensors `__metadata__` strings).
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        json_to_py(py, self.open_parts()?.0.metadata())
    }

    /// "ckptstore", "safetensors" (a single file) or "hf-sharded".
    #[getter]
    fn kind(&self) -> PyResult<&'static str> {
        Ok(kind_name(self.open_parts()?.0.kind()))
    }

    /// The checkpoint id (ckptstore checkpoints only; None otherwise).
    #[getter]
    fn checkpoint_id(&self) -> PyResult<Option<String>> {
        Ok(self
            .open_parts()?
            .0
            .manifest()
            .map(|m| m.checkpoint_id.clone()))
    }

    /// The directory the checkpoint was opened from (a single file's directory).
    #[getter]
    fn path(&self) -> PyResult<PathBuf> {
        Ok(self.open_parts()?.0.root().to_path_buf())
    }

    /// Paths of the shard files, in shard order.
    #[getter]
    fn shard_files(&self) -> PyResult<Vec<PathBuf>> {
        let (ck, _) = self.open_parts()?;
        Ok(ck
            .shards()
            .iter()
            .map(|s| match ck.kind() {
                Kind::Safetensors => PathBuf::from(&s.file),
                _ => ck.root().join(&s.file),
            })
            .collect())
    }

    /// Total bytes of tensor data.
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        Ok(self.open_parts()?.0.data_bytes())
    }

    /// True if the checkpoint holds an optimizer section.
    #[getter]
    fn has_optimizer(&self) -> PyResult<bool> {
        Ok(self
            .open_parts()?
            .0
            .manifest()
            .is_some_and(|m| m.optimizer.is_some()))
    }

    /// Check everything `open` does not: every shard header against the manifest, the
    /// optimizer section, and the CRC32 of every tensor (parallel, interpreter released).
    /// Returns `{"tensors": n, "bytes": n, "checksummed": bool}`; raises `ChecksumError` or
    /// `CorruptCheckpointError` naming the file, shard and tensor.
    fn verify<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ck = self.open_parts()?.0.clone();
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
    #[pyo3(signature = (layout = None, *, counters = Vec::new(), raw = false))]
    fn load_optimizer<'py>(
        &self,
        py: Python<'py>,
        layout: Option<&Bound<'py, PyAny>>,
        counters: Vec<String>,
        raw: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let layout = parse_layout(layout, counters)?;
        let ck = self.open_parts()?.0.clone();
        let st = py
            .detach(move || ck.load_optimizer(&layout))
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
            Some((ck, _)) => format!(
                "<ckptstore.Checkpoint {:?} kind={} tensors={} bytes={}>",
                ck.root().display().to_string(),
                kind_name(ck.kind()),
                ck.tensors().len(),
                ck.data_bytes()
            ),
        }
    }
}

/// Check the CRC32 of every named tensor, in parallel; the first failure in `names` order.
fn verify_many(ck: &Checkpoint, names: &[String]) -> Result<(), Error> {
    use rayon::prelude::*;
    let first_bad = names
        .par_iter()
        .enumerate()
        .filter_map(|(i, n)| ck.tensor_verified(n).err().map(|e| (i, e)))
        .min_by_key(|(i, _)| *i);
    match first_bad {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// The native module `ckptstore._ckptstore`.
#[pymodule]
fn _ckptstore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_class::<PyCheckpoint>()?;
    m.add_class::<MappedCheckpoint>()?;
    m.add_class::<OwnedBuffer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
