//! The background half of a manager's save: the snapshot of the caller's tensors (into
//! pooled buffers, so that training can go on), the handle that waits for the save, and
//! the set of steps in flight.

use super::*;

/// A background save started by [`CheckpointManager::save_async`].
#[derive(Debug)]
pub struct SaveHandle {
    pub(super) step: u64,
    pub(super) thread: Option<JoinHandle<Result<CommitInfo>>>,
}

impl SaveHandle {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Wait for the save: `Ok` once the checkpoint is committed and durable (and retention
    /// applied), or the save's error.
    ///
    /// # Errors
    /// Any error of the save ([`Error::Io`] and others).
    pub fn wait(mut self) -> Result<CommitInfo> {
        self.join()
    }

    pub(super) fn join(&mut self) -> Result<CommitInfo> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(Error::InvalidArgument(
                    "the background save panicked".into(),
                ))
            }),
            None => Err(Error::InvalidArgument("already waited".into())),
        }
    }
}

impl Drop for SaveHandle {
    /// Dropping a handle waits for the save (a save is never abandoned half-way).
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.join();
        }
    }
}

/// Owned, gathered copies of tensors: the snapshot an async save writes.
pub(super) struct Snapshot {
    tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)>,
}

impl Snapshot {
    pub(super) fn take(tensors: &[TensorRef<'_>], pool: &BufferPool) -> Result<Snapshot> {
        use rayon::prelude::*;
        // Hand each tensor a pooled buffer (largest buffers to largest tensors).
        let mut free = std::mem::take(&mut *pool.lock().unwrap_or_else(|p| p.into_inner()));
        free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(tensors[i].nbytes_hint()));
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); tensors.len()];
        let mut free = free.into_iter();
        for i in order {
            match free.next() {
                Some(b) => bufs[i] = b,
                None => break,
            }
        }
        let tensors = tensors
            .par_iter()
            .zip(bufs)
            .map(|(t, buf)| {
                Ok((
                    t.name().to_string(),
                    t.dtype(),
                    t.shape().to_vec(),
                    t.gather_into(buf)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Snapshot { tensors })
    }

    pub(super) fn recycle(self, pool: &BufferPool) {
        let mut p = pool.lock().unwrap_or_else(|p| p.into_inner());
        p.clear();
        p.extend(self.tensors.into_iter().map(|t| t.3));
    }

    pub(super) fn refs(&self) -> Vec<TensorRef<'_>> {
        self.tensors
            .iter()
            .map(|(n, d, s, b)| TensorRef::new(n.as_str(), *d, s, b))
            .collect()
    }
}

/// Snapshot buffers of finished async saves, reused by the next one: after the first save
/// the snapshot copy runs into memory that is already faulted in.
pub(super) type BufferPool = Arc<Mutex<Vec<Vec<u8>>>>;

/// Marks a step as being saved by this manager while it lives.
pub(super) struct Saving(Arc<Mutex<Vec<u64>>>, u64);

impl Saving {
    pub(super) fn new(set: &Arc<Mutex<Vec<u64>>>, step: u64) -> Saving {
        set.lock().unwrap_or_else(|p| p.into_inner()).push(step);
        Saving(Arc::clone(set), step)
    }
}

impl Drop for Saving {
    fn drop(&mut self) {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = v.iter().position(|&s| s == self.1) {
            v.swap_remove(i);
        }
    }
}
