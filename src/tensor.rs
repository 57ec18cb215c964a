//! Tensors: element types ([`DType`], [`Element`]), borrowed views ([`TensorView`]),
//! owned tensors in 8-byte-aligned buffers of their own ([`Tensor`]), and the
//! [`BufferPool`] that can recycle those buffers across loads.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

pub use crate::dtype::{checked_nbytes, checked_numel, DType};
use crate::error::{Error, Result};
pub use crate::view::{Element, TensorView};

/// An owned tensor: dtype, shape and its own buffer, aligned for every element type.
///
/// A tensor made by a load through a [`BufferPool`] gives its buffer back to the pool
/// when it is dropped; every other tensor frees it.
pub struct Tensor {
    dtype: DType,
    shape: Vec<u64>,
    words: Vec<u64>,
    len: usize,
    pool: Option<Arc<PoolInner>>,
}

impl Clone for Tensor {
    /// A copy in a new buffer (returned to the same pool, if any, when dropped).
    fn clone(&self) -> Self {
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            words: self.words.clone(),
            len: self.len,
            pool: self.pool.clone(),
        }
    }
}

impl PartialEq for Tensor {
    /// Equal dtype, shape and bytes (where the buffer came from does not matter).
    fn eq(&self, other: &Self) -> bool {
        self.bit_eq(other)
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Some(p) = self.pool.take() {
            p.give_back(std::mem::take(&mut self.words));
        }
    }
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

/// The byte size of a tensor of `dtype` and `shape`, if it fits in memory's address space.
fn byte_len(dtype: DType, shape: &[u64]) -> Result<usize> {
    checked_nbytes(dtype, shape)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Error::InvalidArgument(format!("{dtype} {shape:?} is too large")))
}

impl Tensor {
    /// A zero-filled tensor.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the byte size overflows.
    pub fn zeros(dtype: DType, shape: &[u64]) -> Result<Self> {
        let len = byte_len(dtype, shape)?;
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            words: vec![0u64; len.div_ceil(8)],
            len,
            pool: None,
        })
    }

    /// A tensor whose bytes the caller overwrites entirely: a buffer from `pool` when it
    /// holds one of the right size (its old contents are stale, never exposed: every caller
    /// writes all `len` bytes), else a new zeroed one. The buffer goes back to `pool` on drop.
    pub(crate) fn for_overwrite(
        dtype: DType,
        shape: &[u64],
        pool: Option<&BufferPool>,
    ) -> Result<Self> {
        let Some(pool) = pool else {
            return Self::zeros(dtype, shape);
        };
        let len = byte_len(dtype, shape)?;
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            words: pool.inner.take(len.div_ceil(8)),
            len,
            pool: Some(pool.inner.clone()),
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
            pool: None,
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

/// A retaining allocator for the destination buffers of loads.
///
/// Freshly mapped memory costs a page fault and a kernel page clear per 4 KiB on first
/// touch, which makes a load into new memory run at the speed of the page-fault path, not
/// of the conversion (`BENCHMARKS.md`). A `BufferPool` keeps the buffers of dropped
/// tensors it handed out (up to `max_retained_bytes`) and hands them to the next load of
/// the same sizes, already faulted in: the steady state of a training job that resumes,
/// evaluates or converts repeatedly, and what torch's caching allocators do.
///
/// A pooled buffer is still a fresh destination in the sense that matters: the pool only
/// holds buffers no live [`Tensor`] owns, so a load never writes to memory anyone can
/// observe (the optimizer's current state keeps its buffers until it is replaced), and a
/// failed load returns what it took. Clones share one pool; it is thread-safe.
///
/// # Example
/// ```no_run
/// use ckptstore::optim::{BufferPool, LoadOptions, StateLayout};
/// # fn main() -> ckptstore::Result<()> {
/// let pool = BufferPool::new(8 << 30);
/// let ck = ckptstore::Checkpoint::open("ckpt")?;
/// let opts = LoadOptions::default().pool(&pool);
/// let mut state = ck.load_optimizer_opts(&StateLayout::default(), &opts)?;
/// // ... later: the replaced state's buffers go back to the pool for the next load.
/// state = ck.load_optimizer_opts(&StateLayout::default(), &opts)?;
/// # drop(state);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

/// Counters of a [`BufferPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held for reuse now.
    pub retained_bytes: usize,
    /// Buffers handed out from the pool.
    pub hits: u64,
    /// Buffers that had to be allocated (no retained buffer fit).
    pub misses: u64,
}

#[derive(Debug)]
struct PoolInner {
    max_bytes: usize,
    state: Mutex<PoolState>,
}

#[derive(Debug, Default)]
struct PoolState {
    /// Retained buffers by capacity in words.
    free: BTreeMap<usize, Vec<Vec<u64>>>,
    stats: PoolStats,
}

impl BufferPool {
    /// A pool that retains at most `max_retained_bytes` of dropped buffers.
    pub fn new(max_retained_bytes: usize) -> Self {
        BufferPool {
            inner: Arc::new(PoolInner {
                max_bytes: max_retained_bytes,
                state: Mutex::new(PoolState::default()),
            }),
        }
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        self.inner.lock().stats
    }

    /// Free every retained buffer.
    pub fn clear(&self) {
        let mut st = self.inner.lock();
        st.free.clear();
        st.stats.retained_bytes = 0;
    }
}

impl PoolInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // The state stays consistent even if a holder panicked (plain counters and lists).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A buffer of exactly `words` words: a retained one whose capacity is at most 1/8
    /// larger, else a new zeroed allocation.
    fn take(&self, words: usize) -> Vec<u64> {
        {
            let mut st = self.lock();
            let hit = st
                .free
                .range_mut(words..=words.saturating_add(words / 8))
                .find_map(|(&cap, list)| list.pop().map(|v| (cap, v)));
            if let Some((cap, mut v)) = hit {
                if st.free.get(&cap).is_some_and(Vec::is_empty) {
                    st.free.remove(&cap);
                }
                st.stats.retained_bytes -= cap * 8;
                st.stats.hits += 1;
                drop(st);
                // Shrinking keeps the capacity and writes nothing; growing back (a buffer
                // that was shrunk for a smaller tensor) zeroes only the difference.
                v.resize(words, 0);
                return v;
            }
            st.stats.misses += 1;
        }
        vec![0u64; words]
    }

    fn give_back(&self, mut v: Vec<u64>) {
        let cap = v.capacity();
        if cap == 0 {
            return;
        }
        let mut st = self.lock();
        if st.stats.retained_bytes.saturating_add(cap * 8) > self.max_bytes {
            return; // over the cap: dropped (freed) after the guard
        }
        v.resize(cap, 0);
        st.stats.retained_bytes += cap * 8;
        st.free.entry(cap).or_default().push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_reuses_dropped_buffers_up_to_its_cap() {
        let pool = BufferPool::new(3000);
        let a = Tensor::for_overwrite(DType::F32, &[256], Some(&pool)).unwrap();
        let b = Tensor::for_overwrite(DType::F32, &[256], Some(&pool)).unwrap();
        let c = Tensor::for_overwrite(DType::F32, &[256], Some(&pool)).unwrap();
        assert_eq!(pool.stats().misses, 3);
        drop((a, b, c)); // 3 x 1024 bytes: the third is over the 3000-byte cap
        assert_eq!(pool.stats().retained_bytes, 2048);
        let mut d = Tensor::for_overwrite(DType::F16, &[512], Some(&pool)).unwrap();
        assert_eq!(pool.stats().hits, 1);
        d.bytes_mut().fill(7);
        assert_eq!(d.bytes().len(), 1024);
        drop(d);
        // A smaller request within 1/8 reuses a buffer; a much smaller one does not.
        let e = Tensor::for_overwrite(DType::U8, &[1000], Some(&pool)).unwrap();
        assert_eq!(pool.stats().hits, 2);
        let f = Tensor::for_overwrite(DType::U8, &[10], Some(&pool)).unwrap();
        assert_eq!(pool.stats().misses, 4);
        assert_eq!(e.bytes().len(), 1000);
        drop((e, f));
        pool.clear();
        assert_eq!(pool.stats().retained_bytes, 0);
        // Without a pool: zeroed, nothing retained.
        let z = Tensor::for_overwrite(DType::F32, &[4], None).unwrap();
        assert!(z.bytes().iter().all(|&x| x == 0));
    }
}
