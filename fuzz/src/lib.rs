//! Helpers shared by the ckptstore fuzz targets and the seed generator.
//!
//! * [`with_valid_trailer`]: rewrite arbitrary bytes into a manifest candidate whose
//!   `manifest_crc32` trailer is correct, so the fuzzer gets past the CRC check.
//! * [`frame`] / [`unframe`]: the input format of the `open_verify_load` target, one flags
//!   byte, then a manifest and 1-3 shard files, each but the last preceded by its length.
//! * [`fix_up`]: the optional repairs the flags ask for (manifest trailer, shard sizes and
//!   header CRCs, tensor CRCs), so mutated shard bytes reach the loaders instead of
//!   stopping at a checksum.
//! * [`frame_two_level`] / [`unframe_two_level`] / [`two_level_files`] /
//!   [`check_two_level`]: the `two_level` target's input format (a root manifest, 1-3 part
//!   indexes, 1-4 shards, named as the manifests name them, with optional repairs) and its
//!   check, which tests/hostile.rs replays.
//! * [`check_part`]: the `part` target's check (decode, re-encode, decode again), which
//!   tests/hostile.rs replays too.

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

impl ckptstore::checkpoint::ShardSource for Fetched {
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
        shards: &[ckptstore::checkpoint::Shard<Self>],
        jobs: &mut [ckptstore::checkpoint::Fetch<'_>],
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
        same(
            a.read(&t.name).to_tensor(),
            b.read(&t.name).to_tensor(),
            &t.name,
        );
    }
    for g in a.catalog().globals() {
        same(
            a.read(&g.name).to_tensor(),
            b.read(&g.name).to_tensor(),
            &g.name,
        );
        // A box from the middle of the global shape to its end.
        let off: Vec<u64> = g.global_shape.iter().map(|d| d / 2).collect();
        let shape: Vec<u64> = g
            .global_shape
            .iter()
            .zip(&off)
            .map(|(d, o)| d - o)
            .collect();
        same(
            a.read(&g.name).region(&off, &shape).to_tensor(),
            b.read(&g.name).region(&off, &shape).to_tensor(),
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

// ---------------------------------------------------------------------------------------
// The `two_level` target: a root manifest, its part indexes and their shards, by name.
// ---------------------------------------------------------------------------------------

/// `two_level` layout bit (input byte 0): name the files from the fixed table
/// ([`two_level_fixed_names`]) instead of from the manifests.
pub const TL_FIXED_NAMES: u8 = 1 << 4;
/// `two_level` layout bit: read every global and tensor before `verify` (parts load
/// lazily, on first use: the order decides which call loads them).
pub const TL_READ_FIRST: u8 = 1 << 5;
/// `two_level` repair bit (input byte 1): recompute the root manifest's CRC trailer.
pub const TL_FIX_ROOT_TRAILER: u8 = 1 << 0;
/// `two_level` repair bit: recompute each part index's CRC trailer.
pub const TL_FIX_PART_TRAILERS: u8 = 1 << 1;
/// `two_level` repair bit: set every shard entry (`size`, `header_size`, `header_crc32`)
/// and every tensor's `crc32`, block CRCs and `absmax`, in the root and in each part
/// index that decodes, from the shard bytes given (then re-encode them).
pub const TL_FIX_SHARDS: u8 = 1 << 2;
/// `two_level` repair bit: set the root's `parts[i].size` and `crc32` from the bytes of
/// the part index files given (after the other repairs), then re-encode the root.
pub const TL_FIX_PART_REFS: u8 = 1 << 3;
/// Every `two_level` repair.
pub const TL_FIX_ALL: u8 =
    TL_FIX_ROOT_TRAILER | TL_FIX_PART_TRAILERS | TL_FIX_SHARDS | TL_FIX_PART_REFS;
/// The checkpoint id of the `two_level` seeds, and of the fixed name table.
pub const TL_SEED_ID: &str = "5eed00000000000000000000000000ff";
/// Most part index slots of a `two_level` input.
pub const TL_MAX_PARTS: usize = 3;
/// Most shard slots of a `two_level` input.
pub const TL_MAX_SHARDS: usize = 4;

/// A decoded `two_level` input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwoLevelFramed<'a> {
    /// Byte 0: bits 0-1 part slots - 1 (modulo 3), bits 2-3 shard slots - 1,
    /// [`TL_FIXED_NAMES`], [`TL_READ_FIRST`].
    pub layout: u8,
    /// Byte 1: the `TL_FIX_*` bits.
    pub fix: u8,
    /// The root manifest, `ckpt-manifest.json`.
    pub root: &'a [u8],
    /// One to three part index files (an empty slot: no such file).
    pub parts: Vec<&'a [u8]>,
    /// One to four shard files (an empty slot: no such file).
    pub shards: Vec<&'a [u8]>,
}

/// A little-endian `u32` length (clamped to what is left) and that many bytes.
fn take_prefixed<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let mut len = [0u8; 4];
    let n = rest.len().min(4);
    len[..n].copy_from_slice(&rest[..n]);
    let body = &rest[n..];
    let (a, b) = body.split_at((u32::from_le_bytes(len) as usize).min(body.len()));
    *rest = b;
    a
}

/// Split a `two_level` input: the layout byte, the repair byte, then the root, every part
/// slot and every shard slot but the last, each preceded by its length as a little-endian
/// `u32` (clamped to what is left); the last shard slot is the rest. Never fails: short
/// inputs give empty slots.
pub fn unframe_two_level(data: &[u8]) -> TwoLevelFramed<'_> {
    let layout = data.first().copied().unwrap_or(0);
    let fix = data.get(1).copied().unwrap_or(0);
    let mut rest = data.get(2..).unwrap_or_default();
    let nparts = usize::from(layout & 3) % TL_MAX_PARTS + 1;
    let nshards = usize::from((layout >> 2) & 3) + 1;
    let root = take_prefixed(&mut rest);
    let parts = (0..nparts).map(|_| take_prefixed(&mut rest)).collect();
    let mut shards: Vec<&[u8]> = (1..nshards).map(|_| take_prefixed(&mut rest)).collect();
    shards.push(rest);
    TwoLevelFramed {
        layout,
        fix,
        root,
        parts,
        shards,
    }
}

/// The inverse of [`unframe_two_level`] for 1-3 parts and 1-4 shards: `layout` gives the
/// [`TL_FIXED_NAMES`] and [`TL_READ_FIRST`] bits (the counts are set from the slices).
///
/// # Panics
/// For counts out of range or a file over `u32::MAX` bytes.
pub fn frame_two_level(
    layout: u8,
    fix: u8,
    root: &[u8],
    parts: &[Vec<u8>],
    shards: &[Vec<u8>],
) -> Vec<u8> {
    assert!((1..=TL_MAX_PARTS).contains(&parts.len()), "1-3 parts");
    assert!((1..=TL_MAX_SHARDS).contains(&shards.len()), "1-4 shards");
    let counts = (parts.len() as u8 - 1) | ((shards.len() as u8 - 1) << 2);
    let mut out = vec![(layout & !0x0f) | counts, fix];
    let (last, init) = shards.split_last().expect("non-empty");
    let prefixed = std::iter::once(root)
        .chain(parts.iter().map(Vec::as_slice))
        .chain(init.iter().map(Vec::as_slice));
    for f in prefixed {
        out.extend_from_slice(&u32::try_from(f.len()).expect("small file").to_le_bytes());
        out.extend_from_slice(f);
    }
    out.extend_from_slice(last);
    out
}

/// The fixed name table (the names of the seeds' checkpoints, id [`TL_SEED_ID`]): part
/// slot `i` is rank `i`'s index `part-<id>-r<i>.json`; shard slots are rank 0's, 1's and
/// 2's first shards, then rank 0's second (`shard-<id>-r<rank>-<k>.safetensors`).
pub fn two_level_fixed_names(nparts: usize, nshards: usize) -> (Vec<String>, Vec<String>) {
    use ckptstore::format::names::{part_file_name, rank_shard_file_name};
    const SHARDS: [(u32, usize); TL_MAX_SHARDS] = [(0, 0), (1, 0), (2, 0), (0, 1)];
    let parts = (0..nparts as u32)
        .map(|r| part_file_name(TL_SEED_ID, r))
        .collect();
    let shards = SHARDS
        .iter()
        .cycle()
        .take(nshards)
        .map(|&(r, k)| rank_shard_file_name(TL_SEED_ID, r, k))
        .collect();
    (parts, shards)
}

/// The names the manifests give the slots: part slot `i` is the root's `parts[i].file`;
/// the shard slots take the root's shards, then the shards of each part slot that decodes
/// (`Part::from_bytes`), in slot order, each name once. Slots the manifests leave unnamed
/// (a root or part that does not decode, too few entries) take the fixed table's names.
pub fn two_level_manifest_names(
    root: &[u8],
    parts: &[&[u8]],
    nshards: usize,
) -> (Vec<String>, Vec<String>) {
    let (mut part_names, mut shard_names) = two_level_fixed_names(parts.len(), nshards);
    let mut listed: Vec<String> = Vec::new();
    if let Ok(m) = manifest::decode(root) {
        for (slot, p) in part_names.iter_mut().zip(&m.parts) {
            slot.clone_from(&p.file);
        }
        listed.extend(m.shards.iter().map(|s| s.file.clone()));
    }
    for p in parts {
        if let Ok(p) = ckptstore::Part::from_bytes(p) {
            listed.extend(p.shards.iter().map(|s| s.file.clone()));
        }
    }
    let mut seen = std::collections::HashSet::new();
    listed.retain(|f| seen.insert(f.clone()));
    for (slot, f) in shard_names.iter_mut().zip(listed) {
        *slot = f;
    }
    (part_names, shard_names)
}

/// [`TL_FIX_SHARDS`] for one shard list and its tensors: sizes, header lengths and header
/// CRCs from the named shard bytes; each tensor's CRC32, block CRCs (when the recorded
/// block count fits) and recorded absmax from its byte range.
fn fix_entries(
    shards: &mut [manifest::ShardEntry],
    tensors: &mut [manifest::TensorInfo],
    bytes: &std::collections::HashMap<&str, &[u8]>,
) {
    for s in shards.iter_mut() {
        let Some(b) = bytes.get(s.file.as_str()) else {
            continue;
        };
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
    for t in tensors.iter_mut() {
        let Some(data) = shards
            .get(t.shard)
            .and_then(|s| bytes.get(s.file.as_str()))
            .and_then(|b| {
                let [s, e] = t.offsets;
                b.get(usize::try_from(s).ok()?..usize::try_from(e).ok()?)
            })
        else {
            continue;
        };
        t.crc32 = Some(crc32fast::hash(data));
        if let Some(bl) = &mut t.blocks {
            let fits = usize::try_from(bl.size)
                .ok()
                .filter(|&n| n > 0 && data.len().div_ceil(n) == bl.crc32.len());
            if let Some(n) = fits {
                bl.crc32 = data.chunks(n).map(crc32fast::hash).collect();
            }
        }
        if t.absmax.is_some() && t.dtype == ckptstore::DType::F32 && data.len() % 4 == 0 {
            let vals = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")));
            t.absmax = vals
                .map(|v| v.is_finite().then_some(v.abs()))
                .try_fold(0f32, |m, v| Some(m.max(v?)));
        }
    }
}

/// The files of a `two_level` input, by name, with the repairs its repair byte asks for:
/// `ckpt-manifest.json` (always present), then the non-empty part and shard slots under
/// the names [`two_level_manifest_names`] (or, with [`TL_FIXED_NAMES`],
/// [`two_level_fixed_names`]) gives them; a name already taken keeps its first file.
pub fn two_level_files(f: &TwoLevelFramed<'_>) -> std::collections::HashMap<String, Vec<u8>> {
    use std::collections::HashMap;
    let mut root = f.root.to_vec();
    if f.fix & TL_FIX_ROOT_TRAILER != 0 {
        root = with_valid_trailer(&root);
    }
    let mut parts: Vec<Vec<u8>> = f
        .parts
        .iter()
        .map(|p| {
            if f.fix & TL_FIX_PART_TRAILERS != 0 && !p.is_empty() {
                with_valid_trailer(p)
            } else {
                p.to_vec()
            }
        })
        .collect();
    let (part_names, shard_names) = if f.layout & TL_FIXED_NAMES != 0 {
        two_level_fixed_names(parts.len(), f.shards.len())
    } else {
        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        two_level_manifest_names(&root, &views, f.shards.len())
    };
    let shard_bytes: HashMap<&str, &[u8]> = shard_names
        .iter()
        .zip(&f.shards)
        .filter(|(_, b)| !b.is_empty())
        .map(|(n, b)| (n.as_str(), *b))
        .collect();
    if f.fix & TL_FIX_SHARDS != 0 {
        for p in parts.iter_mut() {
            if let Ok(mut d) = ckptstore::Part::from_bytes(p) {
                fix_entries(&mut d.shards, &mut d.tensors, &shard_bytes);
                *p = d.to_bytes();
            }
        }
        if let Ok(mut m) = manifest::decode(&root) {
            fix_entries(&mut m.shards, &mut m.tensors, &shard_bytes);
            root = manifest::encode(&m);
        }
    }
    if f.fix & TL_FIX_PART_REFS != 0 {
        if let Ok(mut m) = manifest::decode(&root) {
            for r in &mut m.parts {
                let slot = part_names.iter().position(|n| *n == r.file);
                if let Some(b) = slot.map(|i| &parts[i]).filter(|b| !b.is_empty()) {
                    r.size = b.len() as u64;
                    r.crc32 = crc32fast::hash(b);
                }
            }
            root = manifest::encode(&m);
        }
    }
    let mut files = HashMap::new();
    files.insert(manifest::MANIFEST_FILE.to_string(), root);
    let slots = part_names
        .into_iter()
        .zip(
            parts
                .into_iter()
                .zip(&f.parts)
                .map(|(b, orig)| (b, orig.is_empty())),
        )
        .chain(
            shard_names
                .into_iter()
                .zip(f.shards.iter().map(|s| (s.to_vec(), s.is_empty()))),
        );
    for (name, (bytes, empty)) in slots {
        if !empty {
            files.entry(name).or_insert(bytes);
        }
    }
    files
}

/// The bytes of the box `[offsets, offsets + shape)` of a row-major tensor of `dims` with
/// `es`-byte elements (`None` if it does not fit).
fn box_bytes(
    all: &[u8],
    es: usize,
    dims: &[u64],
    offsets: &[u64],
    shape: &[u64],
) -> Option<Vec<u8>> {
    let us =
        |v: &[u64]| -> Option<Vec<usize>> { v.iter().map(|&x| usize::try_from(x).ok()).collect() };
    let (d, o, s) = (us(dims)?, us(offsets)?, us(shape)?);
    if d.len() != o.len() || d.len() != s.len() {
        return None;
    }
    for i in 0..d.len() {
        if o[i].checked_add(s[i])? > d[i] {
            return None;
        }
    }
    if s.contains(&0) {
        return Some(Vec::new());
    }
    let Some((&row, outer)) = s.split_last() else {
        return all.get(..es).map(<[u8]>::to_vec);
    };
    let mut out = Vec::new();
    let mut at = vec![0usize; outer.len()];
    loop {
        // The element at `o + (at, 0)`, row-major.
        let mut lin = 0usize;
        for i in 0..d.len() {
            let idx = o[i] + if i < at.len() { at[i] } else { 0 };
            lin = lin.checked_mul(d[i])?.checked_add(idx)?;
        }
        let start = lin.checked_mul(es)?;
        out.extend_from_slice(all.get(start..start.checked_add(row.checked_mul(es)?)?)?);
        let mut k = at.len();
        loop {
            if k == 0 {
                return Some(out);
            }
            k -= 1;
            at[k] += 1;
            if at[k] < outer[k] {
                break;
            }
            at[k] = 0;
        }
    }
}

/// The `two_level` target's check, shared with the regression replay (tests/hostile.rs):
/// `data` framed as [`unframe_two_level`] says, opened with `Checkpoint::from_files` and
/// read every way a reader can (`verify`, `entries`, per global `chunks`, `stored_chunks`,
/// `read_global`, `read_region` and `region_file_ranges` of a few boxes; per whole tensor
/// `tensor`, `read_tensor`, a whole-box region). Nothing may panic; panics on a
/// cross-check that fails.
pub fn check_two_level(data: &[u8]) {
    use ckptstore::Checkpoint;
    use std::collections::{HashMap, HashSet};
    let f = unframe_two_level(data);
    let files = two_level_files(&f);
    let sizes: HashMap<String, u64> = files
        .iter()
        .map(|(k, v)| (k.clone(), v.len() as u64))
        .collect();
    let Ok(ck) = Checkpoint::from_files(files) else {
        return;
    };
    assert_eq!(
        ck.catalog().parts_read(),
        (0, 0),
        "opening reads no part index"
    );
    let (nparts, part_bytes) = ck.manifest().map_or((0, 0), |m| {
        let bytes = m.parts.iter().fold(0u64, |a, p| a.saturating_add(p.size));
        (m.parts.len(), bytes)
    });
    assert_eq!(
        ck.catalog().two_level(),
        nparts > 0,
        "two_level() iff the root names parts"
    );
    let mut verified = None;
    if f.layout & TL_READ_FIRST == 0 {
        verified = Some(ck.verify());
    }

    // The catalog: every name once; each looks itself up.
    let entries = ck.catalog().entries();
    let mut names = HashSet::new();
    for e in &entries {
        assert!(names.insert(e.name), "entries() lists {:?} twice", e.name);
        assert_eq!(
            ck.catalog().entry(e.name).ok(),
            Some(*e),
            "entry({:?})",
            e.name
        );
        assert_eq!(
            e.global,
            ck.catalog().global(e.name).is_some(),
            "{:?}",
            e.name
        );
    }
    assert_eq!(ck.catalog().entry_count(), entries.len(), "entry_count()");

    // Global tensors: what `verify` passing promises of each.
    let mut promised: Vec<String> = Vec::new();
    for g in ck.catalog().globals() {
        let name = g.name.as_str();
        let es = g.dtype.size();
        let shape = &g.global_shape;
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let chunks = ck.catalog().chunks(name);
        if let Ok(list) = &chunks {
            let mut cover = 0u128;
            for r in list {
                assert_eq!(r.offsets.len(), shape.len(), "{name}: chunk rank");
                assert_eq!(r.shape.len(), shape.len(), "{name}: chunk rank");
                for ((&o, &n), &d) in r.offsets.iter().zip(&r.shape).zip(shape) {
                    assert!(
                        o.checked_add(n).is_some_and(|e| e <= d),
                        "{name}: chunk {r:?} outside {shape:?}"
                    );
                }
                cover += r.shape.iter().map(|&n| u128::from(n)).product::<u128>();
            }
            assert_eq!(
                Some(cover),
                numel.map(u128::from),
                "{name}: the chunks do not tile {shape:?}"
            );
        }
        let stored = ck.catalog().stored_chunks(name);
        if let Ok(st) = &stored {
            let mut own = Vec::new();
            for c in st {
                assert_eq!(c.tensor.dtype, g.dtype, "{name}: stored chunk dtype");
                assert_eq!(c.tensor.shape, c.region.shape, "{name}: stored chunk shape");
                assert!(
                    sizes.get(c.file).is_some_and(|&n| c.tensor.offsets[1] <= n),
                    "{name}: stored chunk {:?} outside its file {:?}",
                    c.tensor.name,
                    c.file
                );
                if !c.replica {
                    own.push(c.region.clone());
                }
            }
            let mut listed = match &chunks {
                Ok(l) => l.clone(),
                Err(e) => panic!("{name}: stored_chunks() is Ok but chunks() fails: {e}"),
            };
            let key = |r: &ckptstore::Region| (r.offsets.clone(), r.shape.clone());
            own.sort_by_key(key);
            listed.sort_by_key(key);
            assert_eq!(own, listed, "{name}: stored_chunks() and chunks() disagree");
        }
        let whole = ck.read(name).to_tensor();
        if let Ok(t) = &whole {
            assert_eq!(t.dtype(), g.dtype, "{name}");
            assert_eq!(t.shape(), &shape[..], "{name}");
            assert_eq!(
                Some(t.bytes().len() as u64),
                numel.and_then(|n| n.checked_mul(es as u64)),
                "{name}: read_global() size"
            );
        }
        // A few boxes: the whole, the first and the last row, the two halves along
        // dimension 0 (whose bytes concatenate to the whole), the middle to the end.
        let mut boxes: Vec<(Vec<u64>, Vec<u64>)> = vec![(vec![0; shape.len()], shape.clone())];
        if let Some((&d0, rest)) = shape.split_first() {
            let row = |o: u64, n: u64| {
                let mut off = vec![0; shape.len()];
                off[0] = o;
                let mut s = vec![n];
                s.extend_from_slice(rest);
                (off, s)
            };
            if d0 > 0 {
                boxes.push(row(0, 1));
                boxes.push(row(d0 - 1, 1));
                boxes.push(row(0, d0 / 2));
                boxes.push(row(d0 / 2, d0 - d0 / 2));
            }
            let mid: Vec<u64> = shape.iter().map(|d| d / 2).collect();
            let ext: Vec<u64> = shape.iter().zip(&mid).map(|(d, m)| d - m).collect();
            boxes.push((mid, ext));
        }
        let mut reads = Vec::with_capacity(boxes.len());
        for (o, s) in &boxes {
            let r = ck.read(name).region(o, s).to_tensor();
            let ranges = ck.read(name).region(o, s).plan().map(|p| p.file_ranges);
            if let Ok(t) = &r {
                assert_eq!(t.shape(), &s[..], "{name}: region {o:?} {s:?}");
                if let Err(e) = &ranges {
                    panic!("{name}: region {o:?} {s:?} reads but region_file_ranges() fails: {e}");
                }
            }
            if let Ok(rs) = &ranges {
                for &(file, b, e) in rs {
                    assert!(
                        b <= e && sizes.get(file).is_some_and(|&n| e <= n),
                        "{name}: region {o:?} {s:?}: range {b}..{e} outside {file:?}"
                    );
                }
            }
            if let Ok(all) = &whole {
                let want = box_bytes(all.bytes(), es, shape, o, s);
                match &r {
                    Ok(t) => assert!(
                        want.as_deref() == Some(t.bytes()),
                        "{name}: region {o:?} {s:?} differs from read_global()"
                    ),
                    Err(e) => {
                        panic!("{name}: read_global() is Ok but region {o:?} {s:?} fails: {e}")
                    }
                }
            }
            reads.push(r);
        }
        if let (Ok(all), Some(Ok(a)), Some(Ok(b))) = (&whole, reads.get(3), reads.get(4)) {
            let mut cat = a.bytes().to_vec();
            cat.extend_from_slice(b.bytes());
            assert!(
                cat == all.bytes(),
                "{name}: the halves do not concatenate to the whole"
            );
        }
        if whole.is_err() || chunks.is_err() || stored.is_err() {
            promised.push(format!(
                "{name}: chunks {:?}, stored_chunks {:?}, read_global {:?}",
                chunks.err(),
                stored.err(),
                whole.err()
            ));
        }
    }

    // Whole tensors: resident views, fresh reads, a whole-box region.
    for e in entries.iter().filter(|e| !e.global) {
        let v = match ck.read(e.name).view_unchecked() {
            Ok(v) => v,
            Err(err) => panic!("listed whole tensor {:?} has no view: {err}", e.name),
        };
        assert_eq!(v.shape(), e.shape, "{:?}", e.name);
        let read = ck.read(e.name).to_tensor();
        if let Ok(t) = &read {
            assert!(
                t.bytes() == v.bytes(),
                "{:?}: read_tensor() differs from tensor()",
                e.name
            );
        }
        let zeros = vec![0; e.shape.len()];
        if let Ok(t) = ck.read(e.name).region(&zeros, e.shape).to_tensor() {
            assert!(
                t.bytes() == v.bytes(),
                "{:?}: read_region() differs from tensor()",
                e.name
            );
        }
        let tv = ck.read(e.name).view();
        if read.is_err() || tv.is_err() {
            promised.push(format!(
                "{:?}: read_tensor {:?}, tensor_verified {:?}",
                e.name,
                read.err(),
                tv.err().map(|e| e.to_string())
            ));
        }
    }

    let verified = verified.unwrap_or_else(|| ck.verify());
    let (loaded, bytes) = ck.catalog().parts_read();
    assert!(loaded <= nparts, "{loaded} parts read of {nparts}");
    assert!(
        bytes <= part_bytes,
        "{bytes} part bytes read of {part_bytes}"
    );
    if let Ok(r) = &verified {
        assert!(r.checksummed);
        assert!(r.tensors >= ck.tensors().len());
        assert_eq!(
            (loaded, bytes),
            (nparts, part_bytes),
            "verify() reads every part"
        );
        assert!(promised.is_empty(), "verify() passed, but: {promised:?}");
    }
}

/// The `part` target's check, shared with the regression replay (tests/hostile.rs):
/// `Part::from_bytes` must never panic, and whatever it accepts must survive `to_bytes`
/// with the same decoded fields, and `to_bytes` must be deterministic. Panics on a
/// cross-check that fails.
///
/// The decoded fields are compared, not the recorded size and CRC of the bytes each was
/// decoded from: an input with a key the decoder ignores re-encodes shorter
/// (tests/fuzz_regressions/part-unknown-key-re-encodes-shorter.bin).
pub fn check_part(bytes: &[u8]) {
    use ckptstore::write::parts::Part;
    let Ok(p) = Part::from_bytes(bytes) else {
        return;
    };
    let encoded = p.to_bytes();
    let p2 = match Part::from_bytes(&encoded) {
        Ok(p2) => p2,
        Err(e) => panic!(
            "re-encoded part does not decode: {e:?}\n{}",
            String::from_utf8_lossy(&encoded)
        ),
    };
    let fields = |p: &Part| {
        (
            p.checkpoint_id.clone(),
            p.rank,
            p.shards.clone(),
            p.tensors.clone(),
            p.chunks.clone(),
        )
    };
    assert_eq!(
        fields(&p2),
        fields(&p),
        "part changed through to_bytes/from_bytes"
    );
    assert_eq!(p2.to_bytes(), encoded, "to_bytes is not deterministic");
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
    fn two_level_frame_round_trip() {
        let root = b"root".to_vec();
        for np in 1..=TL_MAX_PARTS {
            for ns in 1..=TL_MAX_SHARDS {
                let parts: Vec<Vec<u8>> = (0..np).map(|i| vec![b'p'; 3 + i]).collect();
                let shards: Vec<Vec<u8>> = (0..ns).map(|i| vec![i as u8; 10 + i]).collect();
                let f = frame_two_level(TL_READ_FIRST, TL_FIX_ALL, &root, &parts, &shards);
                let u = unframe_two_level(&f);
                assert_eq!(u.layout & !0x0f, TL_READ_FIRST);
                assert_eq!(u.fix, TL_FIX_ALL);
                assert_eq!(u.root, &root[..]);
                assert_eq!(u.parts, parts.iter().map(Vec::as_slice).collect::<Vec<_>>());
                assert_eq!(
                    u.shards,
                    shards.iter().map(Vec::as_slice).collect::<Vec<_>>()
                );
            }
        }
        // Short and empty inputs never fail, and always name the root.
        for l in 0..16 {
            let u = unframe_two_level(&[0xffu8; 16][..l]);
            assert!(!u.parts.is_empty() && !u.shards.is_empty());
            let files = two_level_files(&u);
            assert!(files.contains_key(manifest::MANIFEST_FILE));
            check_two_level(&[0xffu8; 16][..l]);
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
