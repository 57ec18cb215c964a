//! The shard-source seam: where a [`Checkpoint`](super::Checkpoint)'s shard bytes come
//! from.
//!
//! A shard is either **resident** (a read-only map of a local file, a buffer the process
//! owns: [`ShardSource::bytes`] hands out zero-copy slices) or **fetched** (an object on
//! a store, read by ranged requests when asked for: [`ShardSource::fetch`]). The reader is
//! written once over this trait: the catalog, header checks, CRC checks, region reads and
//! `stream_tensors` do not know which kind they read.
//!
//! Reads that fill fresh buffers go through [`Fetch`]es: each names a byte range of one
//! shard and a destination, and carries the CRC pieces it covers, summed as its bytes land
//! ([`Fetch::write`]), so the CRC pass overlaps the copy (or the network) instead of
//! reading the bytes a second time. The reader plans the fetches (a range holding tensors
//! cut between the tensors' CRC blocks) and judges the sums; a source only moves bytes.

use std::ops::Range;

use rayon::prelude::*;

use super::Shard;
use crate::error::{Error, Result};
use crate::format::manifest::TensorInfo;
use crate::mmap::ReleasePages;

/// Where one shard's bytes come from (see the [module docs](self)).
///
/// Implemented for every `AsRef<[u8]>` storage with [`ReleasePages`] (memory maps,
/// `Vec<u8>`, [`super::Storage`]): those are resident. A fetched source (the lazy
/// object-store reader over `store::s3::RemoteShard`) returns `None` from
/// [`ShardSource::bytes`] and implements [`ShardSource::fetch`].
pub trait ShardSource: Send + Sync {
    /// The shard's size in bytes (for resident sources, the length of [`ShardSource::bytes`]).
    fn len(&self) -> u64;

    /// Whether the shard is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole shard in memory, for zero-copy reads; `None` where bytes are fetched on
    /// demand.
    fn bytes(&self) -> Option<&[u8]>;

    /// The shard's first bytes, at least its safetensors header (the 8-byte length and the
    /// JSON) where the shard is well formed: a resident shard's whole bytes, the header a
    /// fetched shard read when it was opened.
    fn head(&self) -> &[u8];

    /// Release what backs `[offset, offset + len)` from this process, where that is
    /// possible (mapped pages); never changes what a later read sees.
    fn release(&self, _offset: u64, _len: u64) {}

    /// Hint that the shard will be read sequentially soon.
    fn advise_sequential(&self) {}

    /// The largest number of bytes one [`Fetch`] should cover: the ranged-request size of a
    /// remote source; for resident sources the unit of parallel copying.
    fn fetch_size(&self) -> u64 {
        4 << 20
    }

    /// Fill every fetch in `jobs` from `shards` (the checkpoint's shards, indexed by
    /// [`Fetch::shard`]): write each one's bytes in order with [`Fetch::write`]. The
    /// default copies from [`ShardSource::bytes`], rayon-parallel across fetches.
    ///
    /// # Errors
    /// [`Error::ShardMismatch`] naming the shard for a range outside it or bytes that are
    /// not there; a fetched source's request errors.
    fn fetch(shards: &[Shard<Self>], jobs: &mut [Fetch<'_>]) -> Result<()>
    where
        Self: Sized,
    {
        jobs.par_iter_mut().try_for_each(|j| {
            let shard = shards.get(j.shard).ok_or_else(|| {
                Error::InvalidArgument(format!("fetch from shard {}, of {}", j.shard, shards.len()))
            })?;
            let src = shard
                .bytes
                .bytes()
                .and_then(|b| {
                    b.get(usize::try_from(j.range.start).ok()?..usize::try_from(j.range.end).ok()?)
                })
                .ok_or_else(|| Error::ShardMismatch {
                    shard: j.shard,
                    file: shard.file.clone(),
                    reason: format!("bytes {:?} are not in the shard", j.range),
                })?;
            // Piece by piece, so each piece is summed while it is still in cache.
            for c in src.chunks(PIECE_MIN as usize) {
                j.write(c)
                    .map_err(|_| Error::InvalidArgument("fetch overflow".into()))?;
            }
            Ok(())
        })
    }
}

impl<B: AsRef<[u8]> + ReleasePages + Send + Sync> ShardSource for B {
    fn len(&self) -> u64 {
        self.as_ref().len() as u64
    }
    fn bytes(&self) -> Option<&[u8]> {
        Some(self.as_ref())
    }
    fn head(&self) -> &[u8] {
        self.as_ref()
    }
    fn release(&self, offset: u64, len: u64) {
        if let (Ok(o), Ok(l)) = (usize::try_from(offset), usize::try_from(len)) {
            self.release_pages(o, l);
        }
    }
    fn advise_sequential(&self) {
        ReleasePages::advise_sequential(self);
    }
}

/// The smallest CRC piece of tensors without block CRCs (and the copy unit of resident
/// fetches): pieces are multiples of it, so they start on elements.
const PIECE_MIN: u64 = 1 << 16;

/// One range of one shard to read into a destination, with the CRC pieces it covers
/// (see the [module docs](self)). A source fills it with [`Fetch::write`].
#[derive(Debug)]
pub struct Fetch<'d> {
    shard: usize,
    range: Range<u64>,
    dst: &'d mut [u8],
    landed: usize,
    pieces: Vec<Piece>,
    next: usize,
    sums: Vec<PieceSum>,
}

pub use crate::store::ranged::Overflow;

impl<'d> Fetch<'d> {
    fn new(shard: usize, range: Range<u64>, dst: &'d mut [u8], pieces: Vec<Piece>) -> Self {
        Fetch {
            shard,
            range,
            dst,
            landed: 0,
            pieces,
            next: 0,
            sums: Vec::new(),
        }
    }

    /// The index of the shard to read from.
    pub fn shard(&self) -> usize {
        self.shard
    }

    /// The absolute byte range of the shard to read.
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// Bytes written so far.
    pub fn landed(&self) -> usize {
        self.landed
    }

    /// Whether every byte asked for has been written.
    pub fn is_complete(&self) -> bool {
        self.landed == self.dst.len()
    }

    /// Append the next bytes of the range, summing every CRC piece they complete.
    ///
    /// # Errors
    /// [`Overflow`] (and nothing written) if `bytes` run past the end of the range.
    pub fn write(&mut self, bytes: &[u8]) -> std::result::Result<(), Overflow> {
        let end = self
            .landed
            .checked_add(bytes.len())
            .filter(|&e| e <= self.dst.len())
            .ok_or(Overflow)?;
        self.dst[self.landed..end].copy_from_slice(bytes);
        self.landed = end;
        while let Some(p) = self.pieces.get(self.next).filter(|p| p.at.end <= end) {
            self.sums.push(p.sum(self.dst));
            self.next += 1;
        }
        Ok(())
    }
}

impl crate::store::ranged::RangeSink for Fetch<'_> {
    fn object(&self) -> usize {
        self.shard
    }
    fn range(&self) -> Range<u64> {
        self.range.clone()
    }
    fn write(&mut self, bytes: &[u8]) -> std::result::Result<(), Overflow> {
        Fetch::write(self, bytes)
    }
    fn landed(&self) -> usize {
        self.landed
    }
    fn is_complete(&self) -> bool {
        Fetch::is_complete(self)
    }
}

/// One CRC piece of a fetch: piece `unit` of tensor `tensor` (an index the planner's
/// caller chose), at `at` in the fetch's destination; `abs`: also its absmax bits.
#[derive(Debug)]
struct Piece {
    tensor: usize,
    unit: usize,
    at: Range<usize>,
    abs: bool,
}

impl Piece {
    fn sum(&self, dst: &[u8]) -> PieceSum {
        let (crc, abs) = super::unit_sum(dst.get(self.at.clone()).unwrap_or(&[]), self.abs);
        PieceSum {
            tensor: self.tensor,
            unit: self.unit,
            crc,
            abs,
        }
    }
}

/// The sums of one [`Piece`], computed as its bytes landed.
#[derive(Debug)]
struct PieceSum {
    tensor: usize,
    unit: usize,
    crc: u32,
    abs: u32,
}

/// The CRC piece size of `t`: its block size if it records block CRCs, else `step`.
pub(crate) fn piece_unit(t: &TensorInfo, step: u64) -> u64 {
    t.blocks.as_ref().map_or(step, |b| b.size)
}

/// The piece size for tensors without block CRCs for fetches of about `fetch_size` bytes:
/// rounded down to a multiple of [`PIECE_MIN`] (so pieces start on elements).
pub(crate) fn piece_step(fetch_size: u64) -> u64 {
    fetch_size.max(PIECE_MIN) & !(PIECE_MIN - 1)
}

/// Cut `[start, start + dst.len())` of shard `shard` into plain fetches of at most `step`
/// bytes (no CRC pieces).
pub(crate) fn plan_plain<'d>(
    shard: usize,
    start: u64,
    dst: &'d mut [u8],
    step: u64,
    out: &mut Vec<Fetch<'d>>,
) {
    let step = usize::try_from(step.max(PIECE_MIN)).unwrap_or(usize::MAX);
    let mut off = start;
    for piece in dst.chunks_mut(step) {
        let end = off + piece.len() as u64;
        out.push(Fetch::new(shard, off..end, piece, Vec::new()));
        off = end;
    }
}

/// Cut `[start, start + dst.len())` of shard `shard`, holding `tensors` (index and entry,
/// sorted by offset, each within the range), into fetches of about `step` bytes cut only
/// between CRC pieces ([`piece_unit`]: a tensor's blocks, or `step` pieces), each fetch
/// carrying its pieces: the sources sum each piece as it lands, and [`gather_sums`] with
/// [`super::check_units`] judge the sums.
///
/// # Errors
/// Gives `dst` back, having pushed no fetch, if the tensors do not lie in order inside the
/// range or a tensor's blocks cannot be cut into pieces (the caller then fetches plainly
/// and checks afterwards, where the checks name what is wrong).
pub(crate) fn plan_summed<'d>(
    shard: usize,
    start: u64,
    dst: &'d mut [u8],
    tensors: &[(usize, &TensorInfo)],
    step: u64,
    out: &mut Vec<Fetch<'d>>,
) -> std::result::Result<(), &'d mut [u8]> {
    let step = piece_step(step);
    let Some(end) = start.checked_add(dst.len() as u64) else {
        return Err(dst);
    };
    // (start, end, tensor, unit, absmax) in shard coordinates.
    let mut pieces: Vec<(u64, u64, usize, usize, bool)> = Vec::new();
    let mut prev = start;
    for &(ti, t) in tensors {
        let [a, b] = t.offsets;
        let unit = piece_unit(t, step);
        let abs = t.absmax.is_some();
        if a < prev || b < a || b > end || unit == 0 || (abs && !unit.is_multiple_of(4)) {
            return Err(dst);
        }
        let (mut p, mut k) = (a, 0usize);
        while p < b {
            let q = p.saturating_add(unit).min(b);
            pieces.push((p, q, ti, k, abs));
            (p, k) = (q, k + 1);
        }
        prev = b;
    }
    let mut cuts = Vec::new();
    let mut from = start;
    for &(_, q, ..) in &pieces {
        if q - from >= step {
            cuts.push(q);
            from = q;
        }
    }
    if from < end {
        cuts.push(end);
    }
    let mut rest = dst;
    let (mut from, mut next) = (start, 0usize);
    for cut in cuts {
        // `cut - from <= rest.len()`: cuts rise from `start` to at most `end`.
        let (head, tail) = std::mem::take(&mut rest).split_at_mut((cut - from) as usize);
        let mut mine = Vec::new();
        while let Some(&(p, q, tensor, unit, abs)) = pieces.get(next).filter(|x| x.1 <= cut) {
            mine.push(Piece {
                tensor,
                unit,
                at: (p - from) as usize..(q - from) as usize,
                abs,
            });
            next += 1;
        }
        out.push(Fetch::new(shard, from..cut, head, mine));
        (rest, from) = (tail, cut);
    }
    Ok(())
}

/// [`plan_summed`], or, where the pieces cannot follow the layout, [`plan_plain`] over the
/// same range. Returns whether the fetches carry pieces.
pub(crate) fn plan_summed_or_plain<'d>(
    shard: usize,
    start: u64,
    dst: &'d mut [u8],
    tensors: &[(usize, &TensorInfo)],
    step: u64,
    out: &mut Vec<Fetch<'d>>,
) -> bool {
    match plan_summed(shard, start, dst, tensors, step, out) {
        Ok(()) => true,
        Err(dst) => {
            plan_plain(shard, start, dst, step, out);
            false
        }
    }
}

/// Per tensor: its piece size, and the `(crc, absmax bits)` of each of its pieces.
pub(crate) type UnitSums = (Vec<u64>, Vec<Vec<(u32, u32)>>);

/// Gather the sums of completed `fetches` into `(crc, absmax bits)` per tensor and piece,
/// for `tensors` cut into [`piece_unit`] pieces of `step` ([`piece_step`] applied).
/// `None` if a piece is missing or unknown.
pub(crate) fn gather_sums(
    tensors: &[&TensorInfo],
    step: u64,
    fetches: Vec<Fetch<'_>>,
) -> Option<UnitSums> {
    let step = piece_step(step);
    let units: Vec<u64> = tensors.iter().map(|t| piece_unit(t, step)).collect();
    let mut per: Vec<Vec<Option<(u32, u32)>>> = tensors
        .iter()
        .zip(&units)
        .map(|(t, &u)| usize::try_from(t.nbytes().div_ceil(u.max(1))).map(|n| vec![None; n]))
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    for f in fetches {
        if f.next != f.pieces.len() {
            return None;
        }
        for s in f.sums {
            *per.get_mut(s.tensor)?.get_mut(s.unit)? = Some((s.crc, s.abs));
        }
    }
    let per = per
        .into_iter()
        .map(|v| v.into_iter().collect::<Option<Vec<_>>>())
        .collect::<Option<Vec<_>>>()?;
    Some((units, per))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::manifest::BlockCrcs;
    use crate::DType;
    use proptest::prelude::*;

    /// F32 tensors of `lens[i]` elements after `gaps[i]` bytes, with true CRCs, blocks
    /// of `block` bytes (0: none) and absmax where `abs[i]`.
    fn layout(obj: &[u8], head: u64, lens: &[(u64, u64, bool)], block: u64) -> Vec<TensorInfo> {
        let mut at = head;
        let mut out = Vec::new();
        for (i, &(gap, n, abs)) in lens.iter().enumerate() {
            let a = at + gap;
            let b = a + 4 * n;
            let bytes = &obj[a as usize..b as usize];
            out.push(TensorInfo {
                name: format!("t{i}"),
                shard: 0,
                dtype: DType::F32,
                shape: vec![n],
                offsets: [a, b],
                crc32: Some(crc32fast::hash(bytes)),
                absmax: abs
                    .then(|| crate::convert::absmax_f32_le_bytes(bytes))
                    .flatten(),
                blocks: (block > 0).then(|| BlockCrcs {
                    size: block,
                    crc32: bytes.chunks(block as usize).map(crc32fast::hash).collect(),
                }),
            });
            at = b;
        }
        out
    }

    /// Plan fetches over `obj`, fill them (in `write` calls of `chunk` bytes, as a body
    /// stream lands), and judge every tensor from the sums.
    fn judge(step: u64, chunk: usize, obj: &[u8], ts: &[TensorInfo]) -> Vec<bool> {
        let mut dst = vec![0u8; obj.len()];
        let indexed: Vec<(usize, &TensorInfo)> = ts.iter().enumerate().collect();
        let mut jobs = Vec::new();
        assert!(plan_summed(0, 0, &mut dst, &indexed, step, &mut jobs).is_ok());
        let mut next = 0u64;
        for j in &mut jobs {
            // Fetches tile the object in order; pieces lie inside their fetch, in order.
            assert_eq!(j.range.start, next);
            next = j.range.end;
            assert!(j.pieces.windows(2).all(|w| w[0].at.end <= w[1].at.start));
            for c in obj[j.range.start as usize..j.range.end as usize].chunks(chunk.max(1)) {
                j.write(c).unwrap();
            }
            assert!(j.is_complete());
            assert_eq!(j.write(&[0]), Err(Overflow));
        }
        assert_eq!(next, obj.len() as u64);
        let refs: Vec<&TensorInfo> = ts.iter().collect();
        let (units, per) = gather_sums(&refs, step, jobs).expect("every piece summed");
        assert_eq!(dst, obj);
        ts.iter()
            .zip(&units)
            .zip(&per)
            .map(|((t, &u), s)| crate::checkpoint::check_units(t, "o", u, s).is_ok())
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The pieces summed as fetched bytes land judge every tensor exactly as a CRC
        /// pass over the whole bytes would: all pass on true bytes, and a flipped byte
        /// fails the tensor holding it and no other.
        #[test]
        fn pieces_summed_on_the_way_judge_like_a_whole_pass(
            head in 8u64..5000,
            lens in prop::collection::vec((0u64..40, 0u64..150_000, any::<bool>()), 0..6),
            block in prop::sample::select(vec![0u64, 4096, 65536]),
            step in prop::sample::select(vec![1u64, 65536, 100_000, 1 << 20]),
            chunk in prop::sample::select(vec![1usize, 1000, 16384, 1 << 20]),
            tail in 0u64..3000,
            seed in any::<u64>(),
            flip in any::<prop::sample::Index>(),
        ) {
            let total = head + lens.iter().map(|&(g, n, _)| g + 4 * n).sum::<u64>() + tail;
            let mut x = seed | 1;
            let mut obj: Vec<u8> = (0..total)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Keep floats finite (exponent below all-ones) so absmax is recorded.
                    (x >> 24) as u8 & 0x7f
                })
                .collect();
            let ts = layout(&obj, head, &lens, block);
            prop_assert!(judge(step, chunk, &obj, &ts).iter().all(|&ok| ok));

            // Damage one byte of one non-empty tensor (when there is one).
            let full: Vec<&TensorInfo> = ts.iter().filter(|t| t.nbytes() > 0).collect();
            if !full.is_empty() {
                let t = full[flip.index(full.len())];
                let at = t.offsets[0] + (seed % t.nbytes());
                obj[at as usize] ^= 0x01;
                let got = judge(step, chunk, &obj, &ts);
                for (u, ok) in ts.iter().zip(got) {
                    prop_assert_eq!(ok, u.name != t.name, "tensor {}", u.name);
                }
            }
        }
    }

    #[test]
    fn a_layout_the_pieces_cannot_follow_gives_the_buffer_back() {
        let obj = vec![0u8; 1000];
        let mut ts = layout(&obj, 8, &[(0, 100, false), (0, 100, false)], 0);
        ts.swap(0, 1); // out of order
        let indexed: Vec<(usize, &TensorInfo)> = ts.iter().enumerate().collect();
        let mut dst = vec![0u8; obj.len()];
        let mut jobs = Vec::new();
        let back = plan_summed(0, 0, &mut dst, &indexed, 1 << 16, &mut jobs);
        assert_eq!(back.map_err(|d| d.len()), Err(1000));
        assert!(jobs.is_empty());
        // Past the end of the range.
        let ts = layout(&vec![0u8; 2000], 8, &[(0, 400, false)], 0);
        let indexed: Vec<(usize, &TensorInfo)> = ts.iter().enumerate().collect();
        let mut dst = vec![0u8; 1000];
        let mut jobs = Vec::new();
        let back = plan_summed(0, 0, &mut dst, &indexed, 1 << 16, &mut jobs);
        assert!(back.is_err() && jobs.is_empty());
    }

    #[test]
    fn an_incomplete_fetch_gathers_no_sums() {
        let obj: Vec<u8> = (0..4096u32).map(|i| i as u8 & 0x3f).collect();
        let ts = layout(&obj, 0, &[(0, 1024, false)], 0);
        let indexed: Vec<(usize, &TensorInfo)> = ts.iter().enumerate().collect();
        let mut dst = vec![0u8; obj.len()];
        let mut jobs = Vec::new();
        plan_summed(0, 0, &mut dst, &indexed, 1 << 16, &mut jobs).unwrap();
        jobs[0].write(&obj[..100]).unwrap();
        let refs: Vec<&TensorInfo> = ts.iter().collect();
        assert!(gather_sums(&refs, 1 << 16, jobs).is_none());
    }
}
