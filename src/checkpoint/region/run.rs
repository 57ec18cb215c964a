//! Running a planned region read: the bytes each piece uses (borrowed from a resident
//! shard, or fetched: only the blocks the region touches), their CRC checks, and the copy
//! into the destination, check-first, unchecked, or fused (each block checked, then copied
//! while it is in the cache).

use std::borrow::Cow;

use rayon::prelude::*;

use super::boxes::{copy_box, for_each_run, touched_blocks};
use super::{Region, Source, Step};
use crate::checkpoint::{source, Checkpoint, ShardSource};
use crate::dtype::checked_nbytes;
use crate::error::{Error, Result};
use crate::format::manifest::TensorInfo;

/// The bytes of one planned piece of a region read: a window `[base, base + buf.len())`
/// of the stored tensor's bytes (borrowed from a resident shard, or fetched), and the
/// blocks to check (`None`: the whole tensor, which has no block CRCs).
struct Window<'a> {
    base: u64,
    buf: Cow<'a, [u8]>,
    blocks: Option<Vec<u64>>,
}

/// How a region read treats the stored bytes it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Every block (or chunk) CRC-checked before any byte is copied.
    CheckFirst,
    /// Copied without any check.
    Unchecked,
    /// Each block checked as it is copied: one pass over the bytes, the copy reading what
    /// the check brought into the cache; on error the destination is partly written.
    Fused,
}

/// The rest of a region read once planned: the destination's size, the bytes each piece
/// uses, their checks (as `pass` says), the copy into `out` if given.
pub(super) fn run_plan<S: ShardSource>(
    src: &Source<'_, S>,
    plan: &[Step<'_, S>],
    region: &Region,
    out: Option<&mut [u8]>,
    pass: Pass,
) -> Result<()> {
    {
        let (name, shape) = (src.name, &region.shape);
        if let Some(out) = &out {
            let want = checked_nbytes(src.dtype, shape).ok_or_else(|| {
                Error::InvalidArgument(format!("region shape {shape:?} overflows"))
            })?;
            if want != out.len() as u64 {
                return Err(Error::InvalidArgument(format!(
                    "tensor {name:?}: a region of shape {shape:?} is {want} bytes, the destination {}",
                    out.len()
                )));
            }
        }
        // The pieces tile the region exactly (G7; L8 for a two-level checkpoint's parts):
        // checked, so that no byte of the destination is left unwritten by a damaged
        // layout.
        let volume = |lo: &[u64], hi: &[u64]| {
            lo.iter()
                .zip(hi)
                .try_fold(1u128, |v, (l, h)| v.checked_mul(u128::from(h - l)))
        };
        let covered = plan
            .iter()
            .try_fold(0u128, |v, (_, _, _, lo, hi)| v.checked_add(volume(lo, hi)?));
        let zeros = vec![0u64; shape.len()];
        if covered != volume(&zeros, shape) {
            return Err(Error::InvalidTensor {
                name: name.to_string(),
                reason: format!(
                    "the stored chunks do not cover the region at offsets {:?}, shape {shape:?} exactly (a damaged chunk layout)",
                    region.offsets
                ),
            });
        }
        let es = src.dtype.size();
        let wins = windows_by_owner(plan, region, es)?;
        let out = match (pass, out) {
            (Pass::Fused, Some(dst)) => match fill_segments(&wins, plan, region, dst, es)? {
                Ok(jobs) => return fill_jobs(&wins, plan, jobs),
                // Too many small runs to pay for a job each: check first, then copy.
                Err(dst) => Some(dst),
            },
            (_, out) => out,
        };
        if pass != Pass::Unchecked {
            // The first failure in plan order (rayon's own would be the first in time).
            wins.par_iter()
                .zip(plan.par_iter())
                .map(|(w, (_, owner, t, _, _))| owner.check_window(t, w))
                .collect::<Vec<_>>()
                .into_iter()
                .collect::<Result<()>>()?;
        }
        if let Some(dst) = out {
            for (w, (piece, _, t, lo, hi)) in wins.iter().zip(plan) {
                let base = usize::try_from(w.base).map_err(|_| too_big(t))?;
                copy_box(&w.buf, base, piece, dst, region, lo, hi, es)
                    .ok_or_else(|| bad_piece(t))?;
            }
        }
        Ok(())
    }
}

/// A unit of a fused region read: a window (by plan position) and the block of it that is
/// checked (`None`: the whole window, its tensor having no block CRCs).
type Unit = (usize, Option<u64>);
/// A unit's copies: the tensor-relative offset of each run's first byte, and its slice of
/// the destination.
type FillJob<'d> = (Unit, Vec<(u64, &'d mut [u8])>);

/// The jobs of a fused region read ([`Pass::Fused`]): each unit with the runs of the box
/// whose source bytes lie in it, split at block boundaries, and those runs' disjoint slices
/// of `dst`, in plan then block order. `Ok(Err(dst))` hands `dst` back when the box is
/// made of so many runs shorter than a page that a job per run would cost more than a
/// second pass.
#[allow(clippy::type_complexity)]
fn fill_segments<'d, S: ShardSource>(
    wins: &[Window<'_>],
    plan: &[Step<'_, S>],
    region: &Region,
    dst: &'d mut [u8],
    es: usize,
) -> Result<std::result::Result<Vec<FillJob<'d>>, &'d mut [u8]>> {
    let cap = 1 + dst.len() / 4096;
    let mut units: Vec<Unit> = Vec::new();
    // (unit index, source offset in the tensor, destination offset, length)
    let mut segs: Vec<(usize, u64, usize, usize)> = Vec::new();
    for (wi, (w, (piece, _, t, lo, hi))) in wins.iter().zip(plan).enumerate() {
        let bs = t
            .blocks
            .as_ref()
            .filter(|_| w.blocks.is_some())
            .map(|b| b.size);
        let mut too_many = false;
        let ok = for_each_run(piece, region, lo, hi, es, |so, dof, n| {
            let (mut at, mut d) = (so as u64, dof);
            let end = at.checked_add(n as u64)?;
            while at < end {
                let (unit, stop) = match bs {
                    Some(bs) => {
                        let i = at / bs;
                        (Some(i), i.checked_add(1)?.checked_mul(bs)?.min(end))
                    }
                    None => (None, end),
                };
                if units.last() != Some(&(wi, unit)) {
                    units.push((wi, unit));
                }
                let len = usize::try_from(stop - at).ok()?;
                segs.push((units.len() - 1, at, d, len));
                if segs.len() > cap {
                    too_many = true;
                    return None;
                }
                d = d.checked_add(len)?;
                at = stop;
            }
            Some(())
        });
        if too_many {
            return Ok(Err(dst));
        }
        ok.ok_or_else(|| bad_piece(t))?;
    }
    // Hand each run its slice of the destination, in destination order: the runs of one
    // piece increase, and pieces that overlap are a damaged layout (refused, not copied).
    let mut order: Vec<usize> = (0..segs.len()).collect();
    order.sort_unstable_by_key(|&k| segs[k].2);
    let mut slots: Vec<Option<&'d mut [u8]>> = (0..segs.len()).map(|_| None).collect();
    let mut rest: &'d mut [u8] = dst;
    let mut at = 0usize;
    for k in order {
        let (u, _, dof, len) = segs[k];
        let t = plan[units[u].0].2;
        let r = std::mem::take(&mut rest);
        let skip = dof
            .checked_sub(at)
            .filter(|&skip| skip.checked_add(len).is_some_and(|e| e <= r.len()))
            .ok_or_else(|| Error::InvalidTensor {
                name: t.name.clone(),
                reason: "the stored chunks overlap in the region read (a damaged chunk layout)"
                    .into(),
            })?;
        let (piece, r) = r.split_at_mut(skip).1.split_at_mut(len);
        slots[k] = Some(piece);
        rest = r;
        at = dof + len;
    }
    let mut jobs: Vec<FillJob<'d>> = Vec::with_capacity(units.len());
    for ((u, so, _, _), slot) in segs.into_iter().zip(slots) {
        let d = slot.unwrap_or_default();
        match jobs.last_mut() {
            Some((unit, items)) if *unit == units[u] => items.push((so, d)),
            _ => jobs.push((units[u], vec![(so, d)])),
        }
    }
    Ok(Ok(jobs))
}

/// Run the jobs of a fused region read in parallel: check each unit, then copy its runs
/// (read from the cache the check just filled). The first failure in plan order is
/// returned; the destinations of other units may be written by then.
fn fill_jobs<S: ShardSource>(
    wins: &[Window<'_>],
    plan: &[Step<'_, S>],
    jobs: Vec<FillJob<'_>>,
) -> Result<()> {
    jobs.into_par_iter()
        .map(|((wi, block), items)| {
            let (w, (_, owner, t, _, _)) = (&wins[wi], &plan[wi]);
            match block {
                Some(i) => owner.check_block(t, w, i)?,
                None => owner.check_window(t, w)?,
            }
            for (so, d) in items {
                let end = so.checked_add(d.len() as u64).ok_or_else(|| bad_piece(t))?;
                d.copy_from_slice(window_bytes(w, so, end).ok_or_else(|| bad_piece(t))?);
            }
            Ok(())
        })
        .collect::<Vec<Result<()>>>()
        .into_iter()
        .collect()
}

impl<S: ShardSource> Checkpoint<S> {
    /// The bytes each planned piece uses: the whole stored tensor borrowed where its shard
    /// is resident; fetched otherwise, exactly the blocks the region touches (adjacent
    /// ones merged), or the whole tensor where it has no block CRCs.
    fn windows<'a>(
        &'a self,
        plan: &[Step<'a, S>],
        region: &Region,
        es: usize,
    ) -> Result<Vec<Window<'a>>> {
        let mut wins = Vec::with_capacity(plan.len());
        // Per window: the `(begin, end)` ranges of the tensor's bytes to fetch.
        let mut fetch: Vec<Vec<(u64, u64)>> = Vec::new();
        for (piece, _, t, lo, hi) in plan {
            let blocks = match &t.blocks {
                None => None,
                Some(bl) => Some(touched(t, piece, region, lo, hi, es, bl.size)?),
            };
            if let Some(bytes) = self.stored_bytes(t) {
                wins.push(Window {
                    base: 0,
                    buf: Cow::Borrowed(bytes),
                    blocks,
                });
                fetch.push(Vec::new());
                continue;
            }
            let mut ranges: Vec<(u64, u64)> = Vec::new();
            match (&blocks, &t.blocks) {
                (Some(blocks), Some(bl)) => {
                    for &i in blocks {
                        let (b, e) = block_range(t, bl.size, i).ok_or_else(|| bad_piece(t))?;
                        match ranges.last_mut() {
                            Some(last) if last.1 == b => last.1 = e,
                            _ => ranges.push((b, e)),
                        }
                    }
                }
                _ => ranges.push((0, t.nbytes())),
            }
            let base = ranges.first().map_or(0, |r| r.0);
            let end = ranges.last().map_or(0, |r| r.1);
            let len = usize::try_from(end - base).map_err(|_| too_big(t))?;
            wins.push(Window {
                base,
                buf: Cow::Owned(vec![0; len]),
                blocks,
            });
            fetch.push(ranges);
        }
        if fetch.iter().all(Vec::is_empty) {
            return Ok(wins);
        }
        let mut jobs = Vec::new();
        for ((w, ranges), (_, _, t, _, _)) in wins.iter_mut().zip(&fetch).zip(plan) {
            let Cow::Owned(buf) = &mut w.buf else {
                continue;
            };
            let step = self.shards[t.shard].bytes.fetch_size();
            let mut rest: &mut [u8] = buf;
            let mut at = w.base;
            for &(b, e) in ranges {
                // Ranges are increasing, inside the window: these fit.
                let (_, r) = std::mem::take(&mut rest).split_at_mut((b - at) as usize);
                let (dst, r) = r.split_at_mut((e - b) as usize);
                source::plan_plain(t.shard, t.offsets[0] + b, dst, step, &mut jobs);
                rest = r;
                at = e;
            }
        }
        S::fetch(&self.shards, &mut jobs)?;
        if let Some(j) = jobs.iter().find(|j| !j.is_complete()) {
            let shard = j.shard();
            return Err(Error::ShardMismatch {
                shard,
                file: self.shards[shard].file.clone(),
                reason: format!("a read of bytes {:?} came back short", j.range()),
            });
        }
        drop(jobs);
        Ok(wins)
    }

    /// Check `bytes`, said to be the whole stored bytes of tensor `t` (a whole tensor, or
    /// one chunk of a global, in this checkpoint or a loaded part), against the CRC32s
    /// the manifest records for it (its blocks in parallel, or the whole), without reading
    /// the stored bytes: bytes that came from elsewhere (a peer's copy of the shard)
    /// straight into their destination.
    pub(crate) fn check_given(&self, t: &TensorInfo, bytes: &[u8]) -> Result<()> {
        if bytes.len() as u64 != t.nbytes() {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: {} bytes given for a stored tensor of {}",
                t.name,
                bytes.len(),
                t.nbytes()
            )));
        }
        let blocks = t.blocks.as_ref().map(|bl| {
            let n = t.nbytes().div_ceil(bl.size.max(1));
            (0..n).collect()
        });
        let w = Window {
            base: 0,
            buf: Cow::Borrowed(bytes),
            blocks,
        };
        self.check_window(t, &w)
    }

    /// Check a window's blocks (or its whole tensor) against the recorded CRC32s.
    fn check_window(&self, t: &TensorInfo, w: &Window<'_>) -> Result<()> {
        let Some(blocks) = &w.blocks else {
            return self.check_crc(t, crate::crc::crc32_parallel(&w.buf));
        };
        let found: Vec<Result<()>> = blocks
            .par_iter()
            .map(|&i| self.check_block(t, w, i))
            .collect();
        // The first damaged block in order.
        found.into_iter().collect()
    }

    /// Check block `i` of tensor `t` (held by window `w`) against its recorded CRC32, or
    /// the whole window where the tensor has no block CRCs.
    fn check_block(&self, t: &TensorInfo, w: &Window<'_>, i: u64) -> Result<()> {
        let Some(bl) = &t.blocks else {
            return self.check_crc(t, crate::crc::crc32_parallel(&w.buf));
        };
        let (b, e) = block_range(t, bl.size, i).ok_or_else(|| bad_piece(t))?;
        let bytes = window_bytes(w, b, e).ok_or_else(|| bad_piece(t))?;
        let expected = *bl.crc32.get(i as usize).ok_or_else(|| bad_piece(t))?;
        let got = crc32fast::hash(bytes);
        if got != expected {
            return Err(Error::ChecksumMismatch {
                what: format!("tensor {:?}, block {i} (bytes {b}..{e})", t.name),
                shard: t.shard,
                file: self.shards[t.shard].file.clone(),
                expected,
                got,
            });
        }
        Ok(())
    }
}

/// Bytes `[b, e)` of a tensor, out of the window that holds them.
fn window_bytes<'w>(w: &'w Window<'_>, b: u64, e: u64) -> Option<&'w [u8]> {
    let x = usize::try_from(b.checked_sub(w.base)?).ok()?;
    let y = usize::try_from(e.checked_sub(w.base)?).ok()?;
    w.buf.get(x..y)
}

/// [`Checkpoint::windows`] of each checkpoint the plan reads from (the one read, and the
/// loaded parts of a two-level one), in plan order.
fn windows_by_owner<'a, S: ShardSource>(
    plan: &[Step<'a, S>],
    region: &Region,
    es: usize,
) -> Result<Vec<Window<'a>>> {
    let mut out: Vec<Option<Window<'a>>> = (0..plan.len()).map(|_| None).collect();
    for i in 0..plan.len() {
        if out[i].is_some() {
            continue;
        }
        let owner = plan[i].1;
        let idx: Vec<usize> = (i..plan.len())
            .filter(|&j| out[j].is_none() && std::ptr::eq(plan[j].1, owner))
            .collect();
        let sub: Vec<Step<'a, S>> = idx.iter().map(|&j| plan[j].clone()).collect();
        for (j, w) in idx.into_iter().zip(owner.windows(&sub, region, es)?) {
            out[j] = Some(w);
        }
    }
    Ok(out.into_iter().flatten().collect())
}

fn too_big(t: &TensorInfo) -> Error {
    Error::InvalidArgument(format!("tensor {:?} does not fit in memory", t.name))
}

fn bad_piece(t: &TensorInfo) -> Error {
    Error::InvalidTensor {
        name: t.name.clone(),
        reason: "stored bytes do not match the chunk's shape".into(),
    }
}

/// Byte range `[begin, end)` of block `i` within tensor `t`'s bytes.
pub(super) fn block_range(t: &TensorInfo, bs: u64, i: u64) -> Option<(u64, u64)> {
    let b = i.checked_mul(bs)?;
    let n = t.nbytes();
    (b < n).then(|| (b, b.saturating_add(bs).min(n)))
}

/// [`touched_blocks`] of a planned step, as a `Result`.
pub(super) fn touched(
    t: &TensorInfo,
    piece: &Region,
    region: &Region,
    lo: &[u64],
    hi: &[u64],
    es: usize,
    bs: u64,
) -> Result<Vec<u64>> {
    touched_blocks(piece, region, lo, hi, es, bs).ok_or_else(|| bad_piece(t))
}
