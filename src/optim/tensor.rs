//! Owned tensors in freshly allocated, 8-byte-aligned buffers.

use crate::dtype::{checked_nbytes, DType};
use crate::error::{Error, Result};
use crate::view::Element;

/// An owned tensor: dtype, shape and its own buffer, aligned for every element type.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<u64>,
    words: Vec<u64>,
    len: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({} {:?}, {} bytes)",
            self.dtype, self.shape, self.len
        )
    }
}

impl Tensor {
    /// A zero-filled tensor.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the byte size overflows.
    pub fn zeros(dtype: DType, shape: &[u64]) -> Result<Self> {
        let len = checked_nbytes(dtype, shape)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| Error::InvalidArgument(format!("{dtype} {shape:?} is too large")))?;
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            words: vec![0u64; len.div_ceil(8)],
            len,
        })
    }

    /// A tensor holding a copy of `data` (typed).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `data.len()` is not the shape's element count.
    pub fn from_slice<T: Element>(shape: &[u64], data: &[T]) -> Result<Self> {
        Self::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(data))
    }

    /// A tensor holding a copy of little-endian `bytes`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the byte count does not match dtype and shape.
    pub fn from_bytes(dtype: DType, shape: &[u64], bytes: &[u8]) -> Result<Self> {
        let mut t = Self::zeros(dtype, shape)?;
        if bytes.len() != t.len {
            return Err(Error::InvalidArgument(format!(
                "{dtype} {shape:?} needs {} bytes, got {}",
                t.len,
                bytes.len()
            )));
        }
        t.bytes_mut().copy_from_slice(bytes);
        Ok(t)
    }

    /// A 0-dim F32 tensor.
    pub fn scalar_f32(v: f32) -> Self {
        let mut t = Tensor {
            dtype: DType::F32,
            shape: vec![],
            words: vec![0],
            len: 4,
        };
        t.bytes_mut().copy_from_slice(&v.to_le_bytes());
        t
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape; empty for 0-dim.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        self.len / self.dtype.size()
    }

    /// The bytes, little-endian.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// The elements as `T`.
    ///
    /// # Errors
    /// [`Error::BadView`] if `T` is not the dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check::<T>()?;
        Ok(bytemuck::cast_slice(self.bytes()))
    }

    /// The elements as `T`, mutable.
    ///
    /// # Errors
    /// [`Error::BadView`] if `T` is not the dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check::<T>()?;
        Ok(bytemuck::cast_slice_mut(self.bytes_mut()))
    }

    fn check<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype || cfg!(target_endian = "big") {
            return Err(Error::BadView {
                name: String::new(),
                requested: T::DTYPE.name(),
                reason: format!(
                    "the tensor's dtype is {} (or the host is big-endian)",
                    self.dtype
                ),
            });
        }
        Ok(())
    }

    /// The same data under another shape of equal element count.
    pub(crate) fn reshaped(mut self, shape: &[u64]) -> Self {
        self.shape = shape.to_vec();
        self
    }

    /// True if every bit equals `other`'s (dtype, shape and bytes).
    pub fn bit_eq(&self, other: &Tensor) -> bool {
        self.dtype == other.dtype && self.shape == other.shape && self.bytes() == other.bytes()
    }
}
