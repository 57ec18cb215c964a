//! [`Storage`]: the shard bytes of a checkpoint opened at any location.

use crate::mmap::{Map, ReleasePages};

/// The shard bytes of a checkpoint opened through [`crate::open`]: a read-only map of a local
/// file, or a buffer downloaded from an object store.
#[derive(Debug)]
pub enum Storage {
    /// A local shard file, mapped read-only.
    Mapped(Map),
    /// A shard downloaded into memory (there is nothing to map).
    Owned(Vec<u8>),
}

impl ReleasePages for Storage {
    fn release_pages(&self, offset: usize, len: usize) {
        if let Storage::Mapped(m) = self {
            m.release(offset, len);
        }
    }
    fn advise_sequential(&self) {
        if let Storage::Mapped(m) = self {
            m.advise_sequential();
        }
    }
}

impl AsRef<[u8]> for Storage {
    fn as_ref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m.as_ref(),
            Storage::Owned(v) => v,
        }
    }
}
