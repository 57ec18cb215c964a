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

#[cfg(test)]
mod tests {
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
