//! Zero-copy tensor views.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// A borrowed, read-only view of one tensor's bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub(crate) name: &'a str,
    pub(crate) dtype: DType,
    pub(crate) shape: &'a [u64],
    pub(crate) bytes: &'a [u8],
}

/// Rust element types that a [`TensorView`] can be cast to without a copy.
pub trait Element: bytemuck::Pod {
    /// The dtype whose bytes are this type's bytes (little-endian).
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(u8 => U8, i8 => I8, i16 => I16, u16 => U16, i32 => I32, u32 => U32, i64 => I64,
         u64 => U64, f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16);

impl<'a> TensorView<'a> {
    /// Build a view; `bytes.len()` must equal the shape's byte size (checked by callers
    /// that construct views from validated headers).
    pub fn new(name: &'a str, dtype: DType, shape: &'a [u64], bytes: &'a [u8]) -> Self {
        TensorView {
            name,
            dtype,
            shape,
            bytes,
        }
    }

    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape; empty for a 0-dim tensor.
    pub fn shape(&self) -> &'a [u64] {
        self.shape
    }

    /// Number of elements (1 for 0-dim).
    pub fn numel(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The elements as a typed slice, without copying.
    ///
    /// # Errors
    /// [`Error::BadView`] if `T` is not the tensor's dtype, if the bytes are not aligned
    /// for `T` (possible only for foreign safetensors files; ckptstore aligns every tensor),
    /// or on a big-endian host.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        let bad = |reason: String| Error::BadView {
            name: self.name.to_string(),
            requested: T::DTYPE.name(),
            reason,
        };
        if T::DTYPE != self.dtype {
            return Err(bad(format!("the tensor's dtype is {}", self.dtype)));
        }
        if cfg!(target_endian = "big") {
            return Err(bad(
                "stored bytes are little-endian and this host is big-endian".into(),
            ));
        }
        bytemuck::try_cast_slice(self.bytes).map_err(|e| {
            bad(format!(
                "{e:?}: the data at address {:p} is not {}-byte aligned (copy it with bytes())",
                self.bytes.as_ptr(),
                std::mem::align_of::<T>()
            ))
        })
    }
}
