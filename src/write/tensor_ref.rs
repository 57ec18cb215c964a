//! [`TensorRef`]: a tensor handed to the writer, borrowed bytes that are contiguous or
//! strided, validated and streamed in checksummed chunks.

use std::borrow::Cow;

use super::*;

/// A tensor handed to the writer: borrowed bytes, contiguous or strided.
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    pub(super) name: Cow<'a, str>,
    pub(super) dtype: DType,
    pub(super) shape: Vec<u64>,
    pub(super) data: &'a [u8],
    /// Strides and start offset, in elements; `None` for C-contiguous data.
    pub(super) strided: Option<(Vec<u64>, u64)>,
}

impl<'a> TensorRef<'a> {
    /// A C-contiguous tensor over raw little-endian bytes. Sizes are checked by [`crate::save`].
    pub fn new(name: impl Into<Cow<'a, str>>, dtype: DType, shape: &[u64], data: &'a [u8]) -> Self {
        TensorRef {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data,
            strided: None,
        }
    }

    /// A C-contiguous tensor over a typed slice.
    pub fn from_slice<T: Element>(
        name: impl Into<Cow<'a, str>>,
        shape: &[u64],
        data: &'a [T],
    ) -> Self {
        Self::new(name, T::DTYPE, shape, bytemuck::cast_slice(data))
    }

    /// A strided tensor: element `(i0, i1, ...)` is at element index
    /// `offset + i0 * strides[0] + i1 * strides[1] + ...` of `data`. The writer gathers it
    /// contiguously. Strides are in elements, as in PyTorch and NumPy-divided-by-itemsize.
    pub fn strided(
        name: impl Into<Cow<'a, str>>,
        dtype: DType,
        shape: &[u64],
        strides: &[u64],
        offset: u64,
        data: &'a [u8],
    ) -> Self {
        TensorRef {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            data,
            strided: Some((strides.to_vec(), offset)),
        }
    }

    /// The same tensor under another name.
    pub fn renamed(self, name: impl Into<Cow<'a, str>>) -> Self {
        TensorRef {
            name: name.into(),
            ..self
        }
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The tensor's bytes gathered into a fresh contiguous buffer.
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] if the sizes or strides do not fit the data.
    pub fn to_contiguous(&self) -> Result<Vec<u8>> {
        self.gather_into(Vec::new())
    }

    /// Bytes once gathered, for sizing buffers (0 if the tensor is inconsistent).
    pub(crate) fn nbytes_hint(&self) -> u64 {
        checked_nbytes(self.dtype, &self.shape).unwrap_or(0)
    }

    /// Gather into `buf` (reusing its allocation when large enough).
    pub(crate) fn gather_into(&self, mut buf: Vec<u8>) -> Result<Vec<u8>> {
        let n = usize::try_from(self.validate()?).unwrap_or(usize::MAX);
        if self.strided.is_none() {
            // Parallel copy: page faults of a fresh buffer are taken on every core.
            if buf.capacity() < n {
                buf = vec![0u8; n]; // calloc: zero pages come from the kernel untouched
            } else {
                buf.resize(n, 0);
                buf.truncate(n);
            }
            crate::convert::copy_bytes(self.data, &mut buf);
            return Ok(buf);
        }
        buf.clear();
        let mut out = buf;
        self.for_each_chunk(&mut |c| {
            out.extend_from_slice(c);
            Ok(())
        })
        .map_err(|e| Error::InvalidTensor {
            name: self.name.to_string(),
            reason: e.to_string(),
        })?;
        Ok(out)
    }

    /// Bytes the tensor occupies once gathered.
    pub(super) fn validate(&self) -> Result<u64> {
        let bad = |reason: String| Error::InvalidTensor {
            name: self.name.to_string(),
            reason,
        };
        check_tensor_name(&self.name).map_err(bad)?;
        if self.shape.len() > MAX_RANK {
            return Err(bad(format!("rank {} exceeds {MAX_RANK}", self.shape.len())));
        }
        let nbytes =
            checked_nbytes(self.dtype, &self.shape).ok_or_else(|| bad("shape overflows".into()))?;
        let avail = self.data.len() as u64;
        match &self.strided {
            None if nbytes != avail => Err(bad(format!(
                "{} {:?} needs {nbytes} bytes but {avail} were given",
                self.dtype, self.shape
            ))),
            None => Ok(nbytes),
            Some((strides, offset)) => {
                if strides.len() != self.shape.len() {
                    return Err(bad(format!(
                        "{} strides for {} dimensions",
                        strides.len(),
                        self.shape.len()
                    )));
                }
                if !avail.is_multiple_of(self.dtype.size() as u64) {
                    return Err(bad(
                        "data length is not a multiple of the element size".into()
                    ));
                }
                if checked_numel(&self.shape) == Some(0) {
                    return Ok(0);
                }
                let last = self
                    .shape
                    .iter()
                    .zip(strides)
                    .try_fold(*offset, |acc, (&d, &s)| {
                        (d - 1).checked_mul(s).and_then(|x| x.checked_add(acc))
                    })
                    .ok_or_else(|| bad("strides overflow".into()))?;
                if last >= avail / self.dtype.size() as u64 {
                    return Err(bad(format!(
                        "strided view reaches element {last} but the buffer holds {}",
                        avail / self.dtype.size() as u64
                    )));
                }
                Ok(nbytes)
            }
        }
    }

    /// Stream the gathered bytes to `sink` in chunks of about [`CHUNK`] bytes.
    pub(super) fn for_each_chunk(
        &self,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let Some((strides, offset)) = &self.strided else {
            for c in self.data.chunks(CHUNK) {
                sink(c)?;
            }
            return Ok(());
        };
        let es = self.dtype.size();
        let numel = checked_numel(&self.shape).unwrap_or(0) as usize;
        if numel == 0 {
            return Ok(());
        }
        // Gather rows: the innermost dimension is copied as one run when its stride is 1.
        let rank = self.shape.len();
        let (inner_len, inner_stride) = match rank {
            0 => (1usize, 1u64),
            _ => (self.shape[rank - 1] as usize, strides[rank - 1]),
        };
        let outer = &self.shape[..rank.saturating_sub(1)];
        let mut idx = vec![0u64; outer.len()];
        let mut buf: Vec<u8> = Vec::with_capacity(CHUNK.max(inner_len * es));
        loop {
            let base = outer
                .iter()
                .zip(strides)
                .zip(&idx)
                .fold(*offset, |a, ((_, &s), &i)| a + i * s) as usize;
            if inner_stride == 1 {
                buf.extend_from_slice(&self.data[base * es..(base + inner_len) * es]);
            } else {
                for j in 0..inner_len {
                    let e = (base + j * inner_stride as usize) * es;
                    buf.extend_from_slice(&self.data[e..e + es]);
                }
            }
            if buf.len() >= CHUNK {
                sink(&buf)?;
                buf.clear();
            }
            // Advance the outer multi-index.
            let mut d = outer.len();
            loop {
                if d == 0 {
                    if !buf.is_empty() {
                        sink(&buf)?;
                    }
                    return Ok(());
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < outer[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}
