//! Single-pass restores into caller-owned memory (issue 16): each stored byte is read once
//! from the mapped shard, its CRC32 computed on the way, and written once into the memory
//! the caller will use (for the Python bindings, the storage of `torch.empty` tensors).

use rayon::prelude::*;

use super::{with_readahead, Checkpoint, ShardSource};
use crate::error::{Error, Result};
use crate::format::manifest::TensorInfo;

/// Bytes per parallel block: each block's mapped pages are released as soon as the block
/// is done, so at most a few blocks per thread are resident beyond what was restored.
const RELEASE_BLOCK: usize = 4 << 20;
/// Bytes hashed then copied at a time inside a block: the copy reads them from the cache.
const SUB_BLOCK: usize = 64 << 10;

/// The CRC32 hasher of `src`, copying it into `dst` on the way when given (per
/// [`SUB_BLOCK`], so that the copy reads what the hash just brought into the cache).
fn hash_block(src: &[u8], dst: Option<&mut [u8]>) -> crc32fast::Hasher {
    let mut h = crc32fast::Hasher::new();
    match dst {
        Some(d) => {
            for (s, d) in src.chunks(SUB_BLOCK).zip(d.chunks_mut(SUB_BLOCK)) {
                h.update(s);
                d.copy_from_slice(s);
            }
        }
        None => h.update(src),
    }
    h
}

/// One unit of `Checkpoint::fill_and_verify`: a tensor to copy (fused with its CRC) into
/// a destination, or one whose CRC is only checked.
enum Job<'a, 'd> {
    Fill(&'a TensorInfo, &'d mut [u8]),
    Verify(&'a TensorInfo),
}

impl<S: ShardSource> Checkpoint<S> {
    /// In one pass over the stored bytes: copy each tensor of `fills` into its destination
    /// (exactly the tensor's byte length) with its CRC32 computed on the way (per block:
    /// every byte read once and written once), and check the CRC32 of every tensor of
    /// `verify` without copying it. Tensors one after the other in file order, each
    /// rayon-parallel over 4 MiB blocks, with read-ahead of cold bytes; with `release`,
    /// each block's mapped pages leave the process once it is done (they stay in the page
    /// cache).
    ///
    /// Every name and every destination length is checked before any byte is read or
    /// written. On a checksum error the destinations hold unspecified bytes: fill fresh
    /// memory and throw it away on error, and check the tensors whose destination must not
    /// change on failure through `verify` (copy them afterwards, with
    /// `Checkpoint::copy_tensor_into_unchecked`).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] for an unknown name; [`Error::InvalidArgument`] for a
    /// destination of the wrong length (naming the tensor); [`Error::ChecksumMismatch`] for
    /// damaged bytes, the first in `fills` then `verify` order.
    pub(crate) fn fill_and_verify(
        &self,
        fills: Vec<(&str, &mut [u8])>,
        verify: &[&str],
        release: bool,
    ) -> Result<()> {
        let mut jobs: Vec<Job<'_, '_>> = Vec::with_capacity(fills.len() + verify.len());
        for (name, dst) in fills {
            jobs.push(Job::Fill(self.destination_for(name, dst)?, dst));
        }
        for name in verify {
            jobs.push(Job::Verify(self.info(name)?));
        }
        let infos: Vec<&TensorInfo> = jobs
            .iter()
            .map(|j| match j {
                Job::Fill(t, _) | Job::Verify(t) => *t,
            })
            .collect();
        let ranges = self.ranges_in_file_order(&infos);
        // One tensor after the other in file order, each rayon-parallel over its blocks:
        // one forward stream over the device that the read-ahead thread leads (tensors
        // in parallel would read several places of the file at once).
        let mut order: Vec<(usize, Job<'_, '_>)> = jobs.into_iter().enumerate().collect();
        order.sort_by_key(|(_, j)| match j {
            Job::Fill(t, _) | Job::Verify(t) => (t.shard, t.offsets[0]),
        });
        let first_bad = with_readahead(&ranges, false, |_| {
            order
                .into_iter()
                .filter_map(|(i, job)| {
                    let (t, crc) = match job {
                        Job::Fill(t, dst) => (t, self.blocks(t, Some(dst), true, release)),
                        Job::Verify(t) => (t, self.blocks(t, None, true, release)),
                    };
                    self.check_crc(t, crc).err().map(|e| (i, e))
                })
                .min_by_key(|(i, _)| *i)
        });
        match first_bad {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Copy the stored bytes of each `(name, dst)` into `dst` (exactly the tensor's byte
    /// length), rayon-parallel across tensors and within large ones; with `release`, the
    /// mapped pages of each block leave the process as soon as it is copied. The CRC is not
    /// checked here: check it first ([`Checkpoint::fill_and_verify`]'s `verify`).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] if a destination is not
    /// exactly its tensor's byte length. Both are checked before any byte is written.
    pub(crate) fn copy_into_unchecked(
        &self,
        pairs: Vec<(&str, &mut [u8])>,
        release: bool,
    ) -> Result<()> {
        let mut jobs = Vec::with_capacity(pairs.len());
        for (name, dst) in pairs {
            jobs.push((self.destination_for(name, dst)?, dst));
        }
        jobs.into_par_iter().for_each(|(t, dst)| {
            self.blocks(t, Some(dst), false, release);
        });
        Ok(())
    }

    /// One pass over tensor `t`'s stored bytes in parallel blocks: copied into `dst` when
    /// given (of the same length: checked by the callers), hashed when `hash` (the CRC32
    /// is returned; 0 otherwise), each block's mapped pages released after it when
    /// `release`.
    fn blocks(&self, t: &TensorInfo, dst: Option<&mut [u8]>, hash: bool, release: bool) -> u32 {
        let src = self.stored_bytes(t).unwrap_or(&[]);
        let storage = &self.shards[t.shard].bytes;
        // Offsets were validated against the shard's length when the checkpoint was built.
        let base = t.offsets[0] as usize;
        let block = |i: usize, s: &[u8], d: Option<&mut [u8]>| {
            let h = match (hash, d) {
                (true, d) => Some(hash_block(s, d)),
                (false, Some(d)) => {
                    d.copy_from_slice(s);
                    None
                }
                (false, None) => None,
            };
            if release {
                storage.release((base + i * RELEASE_BLOCK) as u64, s.len() as u64);
            }
            h
        };
        let reduce = |a: Option<crc32fast::Hasher>, b: Option<crc32fast::Hasher>| match (a, b) {
            (Some(mut a), Some(b)) => {
                a.combine(&b);
                Some(a)
            }
            (a, b) => a.or(b),
        };
        let h = match dst {
            Some(d) => src
                .par_chunks(RELEASE_BLOCK)
                .zip(d.par_chunks_mut(RELEASE_BLOCK))
                .enumerate()
                .map(|(i, (s, d))| block(i, s, Some(d)))
                .reduce_with(reduce),
            None => src
                .par_chunks(RELEASE_BLOCK)
                .enumerate()
                .map(|(i, s)| block(i, s, None))
                .reduce_with(reduce),
        };
        h.flatten().map_or(0, crc32fast::Hasher::finalize)
    }
}

impl<S: ShardSource> Checkpoint<S> {
    /// Copy stored bytes `[offset, offset + dst.len())` of each named tensor into its
    /// `dst`, in parallel across items and in blocks within large ones. The CRC is not
    /// checked here ([`Checkpoint::verify_tensors`] or [`Checkpoint::fill_and_verify`]
    /// first): this stages a tensor larger than a staging buffer in pieces (the Python
    /// bindings' pinned buffers for CUDA tensors). Every name and range is checked before
    /// any byte is written.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a range outside its
    /// tensor.
    pub(crate) fn copy_ranges_into_unchecked(
        &self,
        items: Vec<(&str, u64, &mut [u8])>,
    ) -> Result<()> {
        let mut jobs = Vec::with_capacity(items.len());
        for (name, offset, dst) in items {
            let range = self.stored_range(name, offset, dst.len())?;
            jobs.push((range, dst));
        }
        jobs.into_par_iter().for_each(|(src, dst)| {
            src.par_chunks(RELEASE_BLOCK)
                .zip(dst.par_chunks_mut(RELEASE_BLOCK))
                .for_each(|(s, d)| d.copy_from_slice(s));
        });
        Ok(())
    }

    /// The tensor `name`, checked to have exactly `dst.len()` stored bytes (the stored
    /// bytes themselves, not the shape's count: a copy needs equal lengths).
    fn destination_for(&self, name: &str, dst: &[u8]) -> Result<&TensorInfo> {
        let t = self.info(name)?;
        let len = self.stored_bytes(t).map_or(0, <[u8]>::len);
        if len != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {name:?} is {len} bytes, its destination {} bytes",
                dst.len()
            )));
        }
        Ok(t)
    }

    /// Stored bytes `[offset, offset + len)` of the (resident) tensor `name`.
    fn stored_range(&self, name: &str, offset: u64, len: usize) -> Result<&[u8]> {
        let src = self.stored_bytes(self.info(name)?).unwrap_or(&[]);
        usize::try_from(offset)
            .ok()
            .and_then(|a| Some(a..a.checked_add(len)?))
            .and_then(|r| src.get(r))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "bytes {offset}..+{len} are outside tensor {name:?} ({} bytes)",
                    src.len()
                ))
            })
    }

    /// Check each byte range against its tensor before anything is read or written.
    pub(crate) fn check_ranges(&self, items: &[(&str, u64, &mut [u8])]) -> Result<()> {
        for (name, offset, dst) in items {
            self.stored_range(name, *offset, dst.len())?;
        }
        Ok(())
    }
}
