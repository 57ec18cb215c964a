//! Helpers shared by the ckptstore fuzz targets and the seed generator.
//!
//! * [`with_valid_trailer`]: rewrite arbitrary bytes into a manifest candidate whose
//!   `manifest_crc32` trailer is correct, so the fuzzer gets past the CRC check.
//! * [`frame`] / [`unframe`]: the input format of the `open_verify_load` target, one flags
//!   byte, then a manifest and 1-3 shard files, each but the last preceded by its length.
//! * [`fix_up`]: the optional repairs the flags ask for (manifest trailer, shard sizes and
//!   header CRCs, tensor CRCs), so mutated shard bytes reach the loaders instead of
//!   stopping at a checksum.

use ckptstore::format::manifest;

pub use manifest::TRAILER_HEAD;

/// Flags bit: recompute the manifest's CRC trailer.
pub const FIX_TRAILER: u8 = 1 << 2;
/// Flags bit: set each shard's `size`, `header_size` and `header_crc32` in the manifest
/// from the shard bytes given (then re-encode the manifest).
pub const FIX_SHARDS: u8 = 1 << 3;
/// Flags bit: set each tensor's `crc32` in the manifest from the shard bytes given.
pub const FIX_TENSORS: u8 = 1 << 4;
/// Every repair.
pub const FIX_ALL: u8 = FIX_TRAILER | FIX_SHARDS | FIX_TENSORS;

/// The body of a manifest candidate: `bytes` without a trailer if it has one, else without
/// trailing whitespace and one closing brace.
pub fn manifest_body(bytes: &[u8]) -> &[u8] {
    if let Some(split) = bytes.len().checked_sub(manifest::TRAILER_LEN) {
        if bytes[split..].starts_with(TRAILER_HEAD) {
            return &bytes[..split];
        }
    }
    let mut end = bytes.len();
    while end > 0 && bytes[end - 1].is_ascii_whitespace() {
        end -= 1;
    }
    if end > 0 && bytes[end - 1] == b'}' {
        end -= 1;
    }
    &bytes[..end]
}

/// `body` followed by the correct CRC trailer for it.
pub fn append_trailer(body: &[u8]) -> Vec<u8> {
    manifest::append_trailer(body.to_vec())
}

/// [`manifest_body`] of `bytes` with a correct trailer: a manifest whose CRC checks.
pub fn with_valid_trailer(bytes: &[u8]) -> Vec<u8> {
    append_trailer(manifest_body(bytes))
}

/// A decoded `open_verify_load` input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Framed<'a> {
    /// The flags byte (bits 0-1: shard count - 1, modulo 3; the `FIX_*` bits).
    pub flags: u8,
    /// The manifest bytes.
    pub manifest: &'a [u8],
    /// One to three shard files.
    pub shards: Vec<&'a [u8]>,
}

/// Split an `open_verify_load` input: `flags`, then for the manifest and every shard but
/// the last a little-endian `u32` length (clamped to what is left) and that many bytes;
/// the last shard is the rest. Never fails: short inputs give empty parts.
pub fn unframe(data: &[u8]) -> Framed<'_> {
    let (flags, mut rest) = match data.split_first() {
        Some((&f, r)) => (f, r),
        None => (0, data),
    };
    let nshards = (flags & 3) % 3 + 1;
    let take = |rest: &mut &'_ [u8]| -> usize {
        let mut len = [0u8; 4];
        let n = rest.len().min(4);
        len[..n].copy_from_slice(&rest[..n]);
        *rest = &rest[n..];
        (u32::from_le_bytes(len) as usize).min(rest.len())
    };
    let mut parts = Vec::with_capacity(nshards as usize + 1);
    for _ in 0..nshards {
        let n = take(&mut rest);
        let (a, b) = rest.split_at(n);
        parts.push(a);
        rest = b;
    }
    parts.push(rest);
    let manifest = parts.remove(0);
    Framed {
        flags,
        manifest,
        shards: parts,
    }
}

/// The inverse of [`unframe`] for 1-3 shards (the low flag bits are set from their count).
///
/// # Panics
/// If `shards` is empty or holds more than three files, or a part exceeds `u32::MAX` bytes.
pub fn frame(fix: u8, manifest: &[u8], shards: &[Vec<u8>]) -> Vec<u8> {
    assert!((1..=3).contains(&shards.len()), "1-3 shards can be framed");
    let mut out = vec![(fix & !3) | (shards.len() as u8 - 1)];
    let (last, init) = shards.split_last().expect("non-empty");
    for part in std::iter::once(manifest).chain(init.iter().map(Vec::as_slice)) {
        out.extend_from_slice(&u32::try_from(part.len()).expect("small part").to_le_bytes());
        out.extend_from_slice(part);
    }
    out.extend_from_slice(last);
    out
}

/// Apply the repairs `flags` asks for to a manifest, given the shard bytes. Returns the
/// manifest bytes to open (borrowed unchanged when no repair applies).
pub fn fix_up<'a>(
    flags: u8,
    manifest_bytes: &'a [u8],
    shards: &[&[u8]],
) -> std::borrow::Cow<'a, [u8]> {
    use std::borrow::Cow;
    let mut bytes: Cow<'a, [u8]> = Cow::Borrowed(manifest_bytes);
    if flags & FIX_TRAILER != 0 {
        bytes = Cow::Owned(with_valid_trailer(&bytes));
    }
    if flags & (FIX_SHARDS | FIX_TENSORS) == 0 {
        return bytes;
    }
    let Ok(mut m) = manifest::decode(&bytes) else {
        return bytes;
    };
    if flags & FIX_SHARDS != 0 {
        for (s, b) in m.shards.iter_mut().zip(shards) {
            s.size = b.len() as u64;
            if let Some(p) = b.get(..8) {
                let hs = u64::from_le_bytes(p.try_into().expect("8 bytes"));
                s.header_size = hs;
                if let Some(h) = usize::try_from(hs)
                    .ok()
                    .and_then(|hs| hs.checked_add(8))
                    .and_then(|e| b.get(8..e))
                {
                    s.header_crc32 = crc32fast::hash(h);
                }
            }
        }
    }
    if flags & FIX_TENSORS != 0 {
        for t in &mut m.tensors {
            let range = shards.get(t.shard).and_then(|b| {
                let [s, e] = t.offsets;
                b.get(usize::try_from(s).ok()?..usize::try_from(e).ok()?)
            });
            if let Some(r) = range {
                // `.into()`: the field is `u32` or `Option<u32>` depending on the library version.
                t.crc32 = crc32fast::hash(r).into();
            }
        }
    }
    Cow::Owned(manifest::encode(&m))
}

/// A shard served only by ranged fetches (`ShardSource::bytes` is `None`), as an object
/// store serves it: the `fetched` target reads the same checkpoint through it and through
/// resident bytes and requires the same answers. `head` is what a lazy open fetched: the
/// first `8 + header_size` bytes the manifest records (clamped to the file).
pub struct Fetched {
    all: Vec<u8>,
    head: Vec<u8>,
    /// Each fetch's bytes are written in pieces of this size (a body stream's chunks).
    chunk: usize,
    /// Bytes fetched, counted where shards share a counter ([`Fetched::counting`]).
    fetched: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl Fetched {
    /// A fetched shard over `all`, whose manifest records a header of `header_size` bytes.
    pub fn new(all: Vec<u8>, header_size: u64, chunk: usize) -> Fetched {
        let n = usize::try_from(header_size)
            .ok()
            .and_then(|h| h.checked_add(8))
            .unwrap_or(usize::MAX)
            .min(all.len());
        Fetched {
            head: all[..n].to_vec(),
            all,
            chunk: chunk.max(1),
            fetched: None,
        }
    }

    /// The same shard, adding the bytes of every fetch to `counter`.
    pub fn counting(mut self, counter: std::sync::Arc<std::sync::atomic::AtomicU64>) -> Fetched {
        self.fetched = Some(counter);
        self
    }
}

impl ckptstore::ShardSource for Fetched {
    fn len(&self) -> u64 {
        self.all.len() as u64
    }
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
    fn head(&self) -> &[u8] {
        &self.head
    }
    fn fetch_size(&self) -> u64 {
        1 << 16
    }
    fn fetch(
        shards: &[ckptstore::Shard<Self>],
        jobs: &mut [ckptstore::Fetch<'_>],
    ) -> ckptstore::Result<()> {
        for j in jobs {
            let s = &shards
                .get(j.shard())
                .ok_or_else(|| ckptstore::Error::InvalidArgument("no such shard".into()))?
                .bytes;
            let r = j.range();
            if let Some(c) = &s.fetched {
                c.fetch_add(r.end - r.start, std::sync::atomic::Ordering::Relaxed);
            }
            let bytes = usize::try_from(r.start)
                .ok()
                .zip(usize::try_from(r.end).ok())
                .and_then(|(a, b)| s.all.get(a..b))
                .ok_or_else(|| {
                    ckptstore::Error::InvalidArgument("range out of the shard".into())
                })?;
            for c in bytes.chunks(s.chunk) {
                j.write(c)
                    .map_err(|_| ckptstore::Error::InvalidArgument("overflow".into()))?;
            }
        }
        Ok(())
    }
}

/// The `fetched` target's check, shared with the regression replay (tests/hostile.rs):
/// `data` (framed as for `open_verify_load`; the flags' high bits pick the fetched
/// source's write-chunk size) read through resident bytes and through [`Fetched`] shards
/// gives the same answers. Panics on a difference.
pub fn check_fetched_like_resident(data: &[u8]) {
    use ckptstore::{Checkpoint, Result, Tensor};
    fn same(a: Result<Tensor>, b: Result<Tensor>, what: &str) {
        match (a, b) {
            (Ok(x), Ok(y)) => assert!(x.bytes() == y.bytes(), "{what}: different bytes"),
            (Err(x), Err(y)) => assert_eq!(x.to_string(), y.to_string(), "{what}"),
            (x, y) => panic!("{what}: resident {:?}, fetched {:?}", x.err(), y.err()),
        }
    }
    let f = unframe(data);
    let manifest = fix_up(f.flags, f.manifest, &f.shards);
    let chunk = [1usize, 7, 4096, 1 << 20][usize::from(f.flags >> 6)];
    let resident: Vec<Vec<u8>> = f.shards.iter().map(|s| s.to_vec()).collect();
    // The header sizes a lazy open would fetch come from the manifest (when it decodes).
    let sizes: Vec<u64> = manifest::decode(&manifest)
        .map(|m| m.shards.iter().map(|s| s.header_size).collect())
        .unwrap_or_default();
    let fetched: Vec<Fetched> = f
        .shards
        .iter()
        .enumerate()
        .map(|(i, s)| Fetched::new(s.to_vec(), sizes.get(i).copied().unwrap_or(0), chunk))
        .collect();
    let (a, b) = match (
        Checkpoint::from_parts(&manifest, resident),
        Checkpoint::from_parts(&manifest, fetched),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(x), Err(y)) => {
            assert_eq!(x.to_string(), y.to_string(), "open");
            return;
        }
        (x, y) => panic!("open: resident {:?}, fetched {:?}", x.err(), y.err()),
    };
    for t in a.tensors() {
        same(a.read_tensor(&t.name), b.read_tensor(&t.name), &t.name);
    }
    for g in a.globals() {
        same(a.read_global(&g.name), b.read_global(&g.name), &g.name);
        // A box from the middle of the global shape to its end.
        let off: Vec<u64> = g.global_shape.iter().map(|d| d / 2).collect();
        let shape: Vec<u64> = g
            .global_shape
            .iter()
            .zip(&off)
            .map(|(d, o)| d - o)
            .collect();
        same(
            a.read_region(&g.name, &off, &shape),
            b.read_region(&g.name, &off, &shape),
            &g.name,
        );
    }
    let mut sa = Vec::new();
    let ra = a.stream_tensors(u64::MAX, |t, x| {
        sa.push((t.name.clone(), x.bytes().to_vec()));
        Ok(())
    });
    let mut sb = Vec::new();
    let rb = b.stream_tensors(u64::MAX, |t, x| {
        sb.push((t.name.clone(), x.bytes().to_vec()));
        Ok(())
    });
    assert!(sa == sb, "streams differ");
    assert_eq!(ra.map_err(|e| e.to_string()), rb.map_err(|e| e.to_string()));
    assert_eq!(
        a.verify().map_err(|e| e.to_string()),
        b.verify().map_err(|e| e.to_string()),
        "verify"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        let m = b"manifest".to_vec();
        for n in 1..=3 {
            let shards: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; 10 + i]).collect();
            let f = frame(FIX_ALL, &m, &shards);
            let u = unframe(&f);
            assert_eq!(u.flags & FIX_ALL, FIX_ALL);
            assert_eq!(u.manifest, &m[..]);
            assert_eq!(
                u.shards,
                shards.iter().map(Vec::as_slice).collect::<Vec<_>>()
            );
        }
        // Short and empty inputs never fail.
        for l in 0..12 {
            let u = unframe(&[0xffu8; 12][..l]);
            assert!(!u.shards.is_empty());
        }
    }

    #[test]
    fn trailer_is_recomputed() {
        let body = br#"{"a":1"#;
        let with = append_trailer(body);
        assert_eq!(with_valid_trailer(&with), with);
        let v: serde_json::Value = serde_json::from_slice(&with).unwrap();
        assert_eq!(v["a"], 1);
        assert_eq!(with_valid_trailer(b"{\"a\":1}\n"), with);
    }
}
