//! CRC32 (IEEE, as zlib.crc32) helpers: parallel by chunks, combined.

use rayon::prelude::*;

/// Chunk size for parallel CRC: big enough that combining costs nothing.
const CHUNK: usize = 4 << 20;

/// CRC32 of `bytes`, computed rayon-parallel in chunks and combined with
/// [`crc32fast::Hasher::combine`]. Equal to `crc32fast::hash(bytes)`.
pub fn crc32_parallel(bytes: &[u8]) -> u32 {
    if bytes.len() <= CHUNK {
        return crc32fast::hash(bytes);
    }
    bytes
        .par_chunks(CHUNK)
        .map(|c| {
            let mut h = crc32fast::Hasher::new();
            h.update(c);
            h
        })
        .reduce_with(|mut a, b| {
            a.combine(&b);
            a
        })
        .map(|h| h.finalize())
        .unwrap_or(0)
}

/// Block size of the per-block CRC32s a save records for large tensors
/// (format-spec/integrity.md §Block CRCs): 256 KiB, small enough that a region read of a
/// few MiB reads at most a few percent more than it needs (BENCHMARKS.md §Current figures,
/// the "reshard read amplification" rows), large
/// enough that the manifest grows by only about 44 bytes per MiB of data.
pub const DEFAULT_BLOCK_SIZE: u64 = 256 << 10;

/// Smallest and largest block size a manifest may declare.
pub const MIN_BLOCK_SIZE: u64 = 4096;
/// See [`MIN_BLOCK_SIZE`].
pub const MAX_BLOCK_SIZE: u64 = 1 << 30;

/// A streaming CRC32 that also records the CRC32 of every `block`-byte block of the
/// stream. The whole stream's CRC is combined from the blocks' (no second pass over the
/// bytes), so recording blocks costs almost nothing.
pub struct BlockHasher {
    block: u64,
    whole: crc32fast::Hasher,
    cur: crc32fast::Hasher,
    cur_len: u64,
    blocks: Vec<u32>,
}

impl BlockHasher {
    /// A hasher with blocks of `block` bytes; `block == 0` records no blocks.
    pub fn new(block: u64) -> Self {
        BlockHasher {
            block,
            whole: crc32fast::Hasher::new(),
            cur: crc32fast::Hasher::new(),
            cur_len: 0,
            blocks: Vec::new(),
        }
    }

    /// Feed the next bytes of the stream.
    pub fn update(&mut self, mut data: &[u8]) {
        if self.block == 0 {
            self.whole.update(data);
            return;
        }
        while !data.is_empty() {
            let room = self.block - self.cur_len;
            let take = data.len().min(usize::try_from(room).unwrap_or(usize::MAX));
            let (head, rest) = data.split_at(take);
            self.cur.update(head);
            self.cur_len += take as u64;
            data = rest;
            if self.cur_len == self.block {
                self.end_block();
            }
        }
    }

    fn end_block(&mut self) {
        let done = std::mem::replace(&mut self.cur, crc32fast::Hasher::new());
        self.whole.combine(&done);
        self.blocks.push(done.finalize());
        self.cur_len = 0;
    }

    /// The stream's CRC32, and the blocks' CRC32s if the stream was longer than one
    /// block (a stream of one block needs none: its CRC is the block's).
    pub fn finish(mut self) -> (u32, Option<Vec<u32>>) {
        if self.block == 0 {
            return (self.whole.finalize(), None);
        }
        if self.cur_len > 0 {
            self.end_block();
        }
        let whole = self.whole.finalize();
        if self.blocks.len() > 1 {
            (whole, Some(self.blocks))
        } else {
            (whole, None)
        }
    }
}

/// The CRC32 of a stream of `total` bytes from its blocks' CRC32s (blocks of `block`
/// bytes, the last one shorter). `None` if the count of CRCs does not fit `total`.
pub fn combine_blocks(crcs: &[u32], block: u64, total: u64) -> Option<u32> {
    if block == 0 || total.div_ceil(block) != crcs.len() as u64 {
        return None;
    }
    let mut whole = crc32fast::Hasher::new();
    for (i, &c) in crcs.iter().enumerate() {
        let start = (i as u64).checked_mul(block)?;
        let len = block.min(total - start);
        whole.combine(&crc32fast::Hasher::new_with_initial_len(c, len));
    }
    Some(whole.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hasher_matches_blocks_and_whole() {
        let v: Vec<u8> = (0..(3 << 14) + 77)
            .map(|i: u32| (i.wrapping_mul(2654435761) >> 11) as u8)
            .collect();
        for split in [1usize, 7, 4096, 5000, 1 << 16] {
            let mut h = BlockHasher::new(4096);
            for piece in v.chunks(split) {
                h.update(piece);
            }
            let (whole, blocks) = h.finish();
            assert_eq!(whole, crc32fast::hash(&v));
            let blocks = blocks.expect("more than one block");
            let want: Vec<u32> = v.chunks(4096).map(crc32fast::hash).collect();
            assert_eq!(blocks, want);
            assert_eq!(combine_blocks(&blocks, 4096, v.len() as u64), Some(whole));
        }
        // One block or less: no block list; none at all with block 0.
        let mut h = BlockHasher::new(4096);
        h.update(&v[..4096]);
        assert_eq!(h.finish(), (crc32fast::hash(&v[..4096]), None));
        let mut h = BlockHasher::new(0);
        h.update(&v);
        assert_eq!(h.finish(), (crc32fast::hash(&v), None));
        assert_eq!(combine_blocks(&[1, 2], 4096, 9000), None);
    }

    #[test]
    fn parallel_equals_serial() {
        let v: Vec<u8> = (0..(9 << 20) + 13)
            .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        assert_eq!(super::crc32_parallel(&v), crc32fast::hash(&v));
        assert_eq!(super::crc32_parallel(&v[..5]), crc32fast::hash(&v[..5]));
        assert_eq!(super::crc32_parallel(&[]), 0);
    }
}
