//! Tensor dtypes as numpy sees them, and numpy arrays over engine memory (and back).
//!
//! The bindings' FFI module: the only one allowed `unsafe` code (the crate denies it), each
//! block with its `// SAFETY:` argument.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use ckptstore::DType;
use numpy::npyffi::{self, npy_intp, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::invalid_arg;

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
pub(crate) fn descr(py: Python<'_>, d: DType) -> PyResult<Bound<'_, PyArrayDescr>> {
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

/// `dtype_table()`: the one dtype table of the Python package, the engine's: `(wire name,
/// numpy type string or None, item size, floating-point)` for every dtype a numpy array can
/// hold (None: BF16, `ml_dtypes.bfloat16`, imported only when used).
#[pyfunction]
pub(crate) fn dtype_table() -> Vec<(&'static str, Option<&'static str>, usize, bool)> {
    DType::ALL
        .into_iter()
        .filter(|&d| d == DType::BF16 || numpy_typestr(d).is_some())
        .map(|d| (d.name(), numpy_typestr(d), d.size(), d.is_float()))
        .collect()
}

pub(crate) fn uint8(py: Python<'_>) -> PyResult<Bound<'_, PyArrayDescr>> {
    Ok(UINT8
        .get_or_try_init(py, || PyArrayDescr::new(py, "|u1").map(Bound::unbind))?
        .bind(py)
        .clone())
}

pub(crate) fn parse_dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| invalid_arg(format!("unknown dtype {name:?}")))
}

/// A numpy array over `len` bytes at `data`, C-contiguous, with `base` as its base object
/// (which must keep the bytes alive and unchanged for as long as it lives).
///
/// # Safety
/// `data` must point to `shape`-many elements of `descr` (or be any non-null pointer when
/// the shape has no elements) that stay valid while `base` lives; if `writable`, nothing
/// else may read or write them while the array (or a view of it) exists.
pub(crate) unsafe fn array_over(
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

/// The bytes a numpy array's elements span, and its strides in elements (`None` when
/// C-contiguous).
pub(crate) fn array_bytes<'a>(
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
