//! Region reads (format-spec/global.md §Reading regions): any box of a global tensor, or
//! of a whole tensor, assembled from the chunks it intersects into a fresh buffer.

use rayon::prelude::*;

use std::borrow::Cow;

use super::{source, Checkpoint, ShardSource};
use crate::dtype::{checked_nbytes, DType};
use crate::error::{Error, Result};
use crate::format::global::GlobalEntry;
use crate::format::manifest::TensorInfo;
use crate::tensor::Tensor;

/// A box in a tensor's index space: where it starts and its extent, per dimension.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Region {
    /// The first index along each dimension.
    pub offsets: Vec<u64>,
    /// The extent along each dimension.
    pub shape: Vec<u64>,
}

impl Region {
    /// A region.
    pub fn new(offsets: &[u64], shape: &[u64]) -> Region {
        Region {
            offsets: offsets.to_vec(),
            shape: shape.to_vec(),
        }
    }

    /// The intersection with `other` (same rank), or `None` if it has no elements.
    fn intersect(&self, other: &Region) -> Option<(Vec<u64>, Vec<u64>)> {
        let mut lo = Vec::with_capacity(self.offsets.len());
        let mut hi = Vec::with_capacity(self.offsets.len());
        for d in 0..self.offsets.len() {
            let l = self.offsets[d].max(other.offsets[d]);
            let h = (self.offsets[d] + self.shape[d]).min(other.offsets[d] + other.shape[d]);
            if l >= h {
                return None;
            }
            lo.push(l);
            hi.push(h);
        }
        Some((lo, hi))
    }
}

/// A stored piece a region reads from: where it lies, the checkpoint whose shards hold it
/// (the one read, or a loaded part of a two-level one), the tensor holding it, and the
/// intersection `[lo, hi)` with the region.
type Step<'s, S> = (
    &'s Region,
    &'s Checkpoint<S>,
    &'s TensorInfo,
    Vec<u64>,
    Vec<u64>,
);

/// What a region is assembled from: the chunks of a global tensor, or one whole tensor.
struct Source<'a, S> {
    name: &'a str,
    dtype: DType,
    shape: &'a [u64],
    /// Each piece: where it lies, the checkpoint holding it, and its stored tensor.
    pieces: Vec<(Region, &'a Checkpoint<S>, &'a TensorInfo)>,
}

/// Check `region` against `src`'s shape and rank.
fn check_bounds(name: &str, shape: &[u64], region: &Region) -> Result<()> {
    let bad = |why: String| {
        Error::InvalidArgument(format!(
            "tensor {name:?} of shape {shape:?}: region offsets {:?}, shape {:?}: {why}",
            region.offsets, region.shape
        ))
    };
    if region.offsets.len() != shape.len() || region.shape.len() != shape.len() {
        return Err(bad(format!(
            "offsets and shape must have the tensor's rank {}",
            shape.len()
        )));
    }
    for (d, &extent) in shape.iter().enumerate() {
        if region.offsets[d]
            .checked_add(region.shape[d])
            .is_none_or(|e| e > extent)
        {
            return Err(bad(format!("dimension {d} is out of bounds")));
        }
    }
    Ok(())
}

/// Check `region` against `src`'s shape; the stored pieces it intersects, with the
/// intersections.
fn plan_region<'s, S>(src: &'s Source<'_, S>, region: &Region) -> Result<Vec<Step<'s, S>>> {
    check_bounds(src.name, src.shape, region)?;
    Ok(src
        .pieces
        .iter()
        .filter_map(|(r, o, t)| region.intersect(r).map(|(lo, hi)| (r, *o, *t, lo, hi)))
        .collect())
}

impl<S> Checkpoint<S> {
    /// The global tensors (format-spec/global.md), in manifest order; empty for checkpoints
    /// without any.
    pub fn globals(&self) -> &[GlobalEntry] {
        self.manifest().map_or(&[], |m| &m.globals)
    }

    /// The global tensor called `name`, if there is one.
    pub fn global(&self, name: &str) -> Option<&GlobalEntry> {
        let i = *self.globals.get(name)?;
        self.globals().get(i)
    }

    /// The dtype and (global) shape of `name`: a global tensor, or a whole tensor.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if neither holds that name.
    pub fn shape_of(&self, name: &str) -> Result<(DType, &[u64])> {
        match self.global(name) {
            Some(g) => Ok((g.dtype, &g.global_shape)),
            None => self.info(name).map(|t| (t.dtype, t.shape.as_slice())),
        }
    }

    /// The chunks of `name` as regions of its global index space, in manifest order: a
    /// whole tensor is one chunk at the origin.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`].
    pub fn chunks(&self, name: &str) -> Result<Vec<Region>>
    where
        S: ShardSource,
    {
        Ok(self
            .source(name, None)?
            .pieces
            .into_iter()
            .map(|(r, _, _)| r)
            .collect())
    }

    /// The pieces of `name`: of a two-level checkpoint's global, those of the parts that
    /// hold cells `region` intersects (every part of its grid for `None`), loaded on first
    /// use; else every chunk.
    fn source(&self, name: &str, region: Option<&Region>) -> Result<Source<'_, S>>
    where
        S: ShardSource,
    {
        if let Some(g) = self.global(name) {
            if self.parts.is_some() {
                return self.source_in_parts(g, region);
            }
            if g.grid.is_some() {
                // Unreachable through the opens, which attach the parts of a two-level root.
                return Err(Error::InvalidArgument(format!(
                    "global tensor {name:?} is in a two-level checkpoint opened without its part indexes"
                )));
            }
            let pieces = g
                .chunks
                .iter()
                .map(|ch| {
                    // Validated at open (G4): every chunk's tensor exists.
                    let t = self.info(&ch.tensor)?;
                    Ok((Region::new(&ch.offsets, &ch.shape), self, t))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Source {
                name: &g.name,
                dtype: g.dtype,
                shape: &g.global_shape,
                pieces,
            });
        }
        let t = self.info(name)?;
        Ok(Source {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            pieces: vec![(Region::new(&vec![0; t.shape.len()], &t.shape), self, t)],
        })
    }

    fn source_in_parts<'a>(
        &'a self,
        g: &'a GlobalEntry,
        region: Option<&Region>,
    ) -> Result<Source<'a, S>>
    where
        S: ShardSource,
    {
        let src = |pieces| Source {
            name: &g.name,
            dtype: g.dtype,
            shape: &g.global_shape,
            pieces,
        };
        let (Some(m), Some(&gi)) = (self.manifest(), self.globals.get(&g.name)) else {
            return Ok(src(Vec::new()));
        };
        let Some(grid) = g.grid.and_then(|k| m.grids.get(k as usize)) else {
            return Ok(src(Vec::new())); // zero elements: no chunks
        };
        let parts = match region {
            Some(r) => {
                check_bounds(&g.name, &g.global_shape, r)?;
                crate::format::grid::parts_in_box(grid, &r.offsets, &r.shape)
            }
            None => {
                let mut all = grid.cells.clone();
                all.sort_unstable();
                all.dedup();
                all
            }
        };
        let mut pieces = Vec::new();
        for p in parts {
            let l = self.part(p)?;
            for (reg, ti) in l.chunks.get(&(gi as u32)).into_iter().flatten() {
                let t =
                    l.ck.tensors()
                        .get(*ti)
                        .ok_or_else(|| Error::InvalidTensor {
                            name: g.name.clone(),
                            reason: format!("part {p} lost a chunk tensor"),
                        })?;
                pieces.push((reg.clone(), &l.ck, t));
            }
        }
        Ok(src(pieces))
    }

    /// Where the bytes a read of this region uses lie: `(shard index, begin, end)` absolute
    /// byte ranges in the shard files, one per block touched (chunks with block CRCs) or
    /// per chunk, in plan order, adjacent ranges merged. For prefetching (readahead hints,
    /// ranged GETs). Only ranges in [`Checkpoint::shards`]: of a two-level checkpoint, not
    /// those in its parts' shards ([`Checkpoint::region_file_ranges`] lists all).
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`], without reading any tensor data.
    pub fn region_byte_ranges(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
    ) -> Result<Vec<(usize, u64, u64)>>
    where
        S: ShardSource,
    {
        let region = Region::new(offsets, shape);
        let src = self.source(name, Some(&region))?;
        let plan = plan_region(&src, &region)?;
        let es = src.dtype.size();
        let mut out: Vec<(usize, u64, u64)> = Vec::new();
        let mut push = |sh: usize, b: u64, e: u64| match out.last_mut() {
            Some(last) if last.0 == sh && last.2 == b => last.2 = e,
            _ => out.push((sh, b, e)),
        };
        for (piece, owner, t, lo, hi) in &plan {
            if !std::ptr::eq(*owner, self) {
                continue; // in a part's shards, which `shards()` does not list
            }
            let base = t.offsets[0];
            match &t.blocks {
                None => push(t.shard, base, t.offsets[1]),
                Some(bl) => {
                    for i in touched(t, piece, &region, lo, hi, es, bl.size)? {
                        if let Some((b, e)) = block_range(t, bl.size, i) {
                            push(t.shard, base + b, base + e);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// The cells of the chunk grid of global `name` in a two-level checkpoint, as regions
    /// in row-major cell order (format-spec/global.md §Root): each lies inside one chunk,
    /// so a reader can plan with them as it would with chunks, from the root alone,
    /// loading no part. `None` for a flat checkpoint's globals and for whole tensors.
    pub fn grid_cells(&self, name: &str) -> Option<Vec<Region>> {
        let g = self.global(name)?;
        let grid = self.manifest()?.grids.get(g.grid? as usize)?;
        let dims = crate::format::grid::dims(grid);
        let all: Vec<(usize, usize)> = dims.iter().map(|&n| (0, n)).collect();
        let mut out = Vec::with_capacity(grid.cells.len());
        let mut at = vec![0usize; dims.len()];
        crate::format::grid::for_each_cell(&dims, &all, |c| {
            // Row-major cell index back to per-dimension indexes.
            let mut rest = c;
            for d in (0..dims.len()).rev() {
                at[d] = rest % dims[d];
                rest /= dims[d];
            }
            let o: Vec<u64> = at.iter().zip(&grid.splits).map(|(&i, s)| s[i]).collect();
            let n: Vec<u64> = at
                .iter()
                .zip(&grid.splits)
                .map(|(&i, s)| s[i + 1] - s[i])
                .collect();
            out.push(Region::new(&o, &n));
        });
        Some(out)
    }

    /// Every stored chunk of the global tensor `name`, replicas included: for `inspect`
    /// and tools. Of a two-level checkpoint this reads every part.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if `name` is not a global tensor; a part's load errors.
    pub fn stored_chunks(&self, name: &str) -> Result<Vec<StoredChunk<'_>>>
    where
        S: ShardSource,
    {
        let not_found = || Error::TensorNotFound {
            name: name.to_string(),
        };
        let g = self.global(name).ok_or_else(not_found)?;
        let mut out = Vec::new();
        if self.parts.is_some() {
            let (Some(m), Some(&gi)) = (self.manifest(), self.globals.get(name)) else {
                return Err(not_found());
            };
            // Replicas may sit in any part, not only those the grid names.
            for p in 0..m.parts.len() as u32 {
                let l = self.part(p)?;
                for (list, replica) in [(&l.chunks, false), (&l.replicas, true)] {
                    for (reg, ti) in list.get(&(gi as u32)).into_iter().flatten() {
                        if let Some(t) = l.ck.tensors().get(*ti) {
                            out.push(StoredChunk {
                                region: reg.clone(),
                                tensor: t,
                                file: &l.ck.shards[t.shard].file,
                                replica,
                            });
                        }
                    }
                }
            }
            return Ok(out);
        }
        for c in &g.chunks {
            for (i, n) in std::iter::once(&c.tensor).chain(&c.replicas).enumerate() {
                let t = self.info(n)?;
                out.push(StoredChunk {
                    region: Region::new(&c.offsets, &c.shape),
                    tensor: t,
                    file: &self.shards[t.shard].file,
                    replica: i > 0,
                });
            }
        }
        Ok(out)
    }

    /// [`Checkpoint::region_byte_ranges`] with each range's shard named (as
    /// [`Shard::file`](super::Shard) names it), including the shards of a two-level
    /// checkpoint's parts, which [`Checkpoint::shards`] does not list (the parts the region
    /// touches are loaded).
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`], without reading any tensor data.
    pub fn region_file_ranges(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
    ) -> Result<Vec<(&str, u64, u64)>>
    where
        S: ShardSource,
    {
        let region = Region::new(offsets, shape);
        let src = self.source(name, Some(&region))?;
        check_bounds(src.name, src.shape, &region)?;
        let es = src.dtype.size();
        let mut out: Vec<(&str, u64, u64)> = Vec::new();
        for (piece, owner, t) in &src.pieces {
            let Some((lo, hi)) = region.intersect(piece) else {
                continue;
            };
            let (owner, t, lo, hi) = (*owner, *t, &lo, &hi);
            let file = owner.shards[t.shard].file.as_str();
            let mut push = |b: u64, e: u64| match out.last_mut() {
                Some(last) if std::ptr::eq(last.0, file) && last.2 == b => last.2 = e,
                _ => out.push((file, b, e)),
            };
            let base = t.offsets[0];
            match &t.blocks {
                None => push(base, t.offsets[1]),
                Some(bl) => {
                    for i in touched(t, piece, &region, lo, hi, es, bl.size)? {
                        if let Some((b, e)) = block_range(t, bl.size, i) {
                            push(base + b, base + e);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// The bytes [`Checkpoint::read_region`] reads for this region: of every chunk it
    /// intersects, the CRC blocks it touches (format-spec/integrity.md §Block CRCs), or
    /// the whole chunk where the chunk has no block CRCs. Divided by the region's own
    /// byte size, the read amplification of a resharding layout.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`], without reading any tensor data.
    pub fn region_bytes_read(&self, name: &str, offsets: &[u64], shape: &[u64]) -> Result<u64>
    where
        S: ShardSource,
    {
        // Bounded by the checkpoint's data size, validated at open.
        Ok(self
            .region_file_ranges(name, offsets, shape)?
            .iter()
            .map(|(_, b, e)| e - b)
            .sum())
    }

    /// The byte size of a region of `name`.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] if it overflows.
    pub fn region_nbytes(&self, name: &str, shape: &[u64]) -> Result<u64> {
        let (dtype, _) = self.shape_of(name)?;
        checked_nbytes(dtype, shape)
            .ok_or_else(|| Error::InvalidArgument(format!("region shape {shape:?} overflows")))
    }
}

/// One stored chunk of a global tensor ([`Checkpoint::stored_chunks`]).
#[derive(Debug, Clone)]
pub struct StoredChunk<'a> {
    /// Where it lies in the global index space.
    pub region: Region,
    /// The stored tensor holding it.
    pub tensor: &'a TensorInfo,
    /// The shard file holding that tensor, as [`Shard::file`](super::Shard) names it.
    pub file: &'a str,
    /// A copy of a chunk that another stored tensor also holds, which reads do not use.
    pub replica: bool,
}

/// The bytes of one planned piece of a region read: a window `[base, base + buf.len())`
/// of the stored tensor's bytes (borrowed from a resident shard, or fetched), and the
/// blocks to check (`None`: the whole tensor, which has no block CRCs).
struct Window<'a> {
    base: u64,
    buf: Cow<'a, [u8]>,
    blocks: Option<Vec<u64>>,
}

impl<S: ShardSource> Checkpoint<S> {
    /// Read the box `[offsets, offsets + shape)` of `name` (a global tensor, or a whole
    /// tensor) into a freshly allocated tensor of shape `shape`, assembling it from the
    /// chunks it intersects. Every chunk read from has its CRC32 checked (whole: see
    /// [`Checkpoint::region_bytes_read`]) before its bytes are used. The checkpoint's
    /// files are only read; from fetched shards, only the byte ranges
    /// [`Checkpoint::region_byte_ranges`] names are fetched.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a region of the wrong rank
    /// or out of bounds; [`Error::ChecksumMismatch`] naming the chunk's tensor and shard
    /// for damaged bytes (nothing is returned); the source's errors for a failed fetch.
    ///
    /// # Example
    /// ```
    /// # fn main() -> ckptstore::Result<()> {
    /// let dir = tempfile::tempdir().unwrap();
    /// let w: Vec<f32> = (0..12).map(|i| i as f32).collect();
    /// ckptstore::save(dir.path(), &[ckptstore::TensorRef::from_slice("w", &[3, 4], &w)], &Default::default())?;
    /// let ck = ckptstore::Checkpoint::open(dir.path())?;
    /// let r = ck.read_region("w", &[1, 1], &[2, 2])?;
    /// assert_eq!(r.as_slice::<f32>()?, &[5.0, 6.0, 9.0, 10.0]);
    /// # Ok(()) }
    /// ```
    pub fn read_region(&self, name: &str, offsets: &[u64], shape: &[u64]) -> Result<Tensor> {
        let region = Region::new(offsets, shape);
        let src = self.source(name, Some(&region))?;
        // Planned (and a two-level checkpoint's parts checked) before the buffer exists: its
        // size is then backed by stored chunks, never by a shape alone.
        let plan = plan_region(&src, &region)?;
        let mut out = Tensor::zeros(src.dtype, shape)?;
        run_plan(
            &src,
            &plan,
            &region,
            Some(out.bytes_mut()),
            Pass::CheckFirst,
        )?;
        Ok(out)
    }

    /// [`Checkpoint::read_region`] into `out`, a buffer of exactly the region's bytes
    /// (row-major, the tensor's little-endian element bytes): for readers that own the
    /// destination (a training framework's tensor). Every block or chunk read from is
    /// CRC-checked before any byte is copied; on error `out` is unchanged.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`], and [`Error::InvalidArgument`] if `out` is not the
    /// region's byte size.
    pub fn read_region_into(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
    ) -> Result<()> {
        self.region_op(name, offsets, shape, Some(out), Pass::CheckFirst)
    }

    /// Check the CRC32s of everything a read of this region uses (in parallel), reading
    /// nothing else: the blocks it touches of chunks with block CRCs
    /// (format-spec/integrity.md §Block CRCs), whole chunks otherwise. A reader that must
    /// check many regions before it writes any destination (all-or-nothing across a job)
    /// calls this for each, then [`Checkpoint::copy_region_unchecked`].
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`].
    pub fn verify_region(&self, name: &str, offsets: &[u64], shape: &[u64]) -> Result<()> {
        self.region_op(name, offsets, shape, None, Pass::CheckFirst)
    }

    /// Copy the region into `out` (exactly its bytes) **without checking any CRC**: the
    /// second half of [`Checkpoint::read_region_into`], for callers that ran
    /// [`Checkpoint::verify_region`] on it (like [`Checkpoint::tensor`] beside
    /// [`Checkpoint::tensor_verified`]). The checkpoint's files are only read.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a region of the wrong
    /// rank, out of bounds, or an `out` of the wrong size.
    pub fn copy_region_unchecked(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
    ) -> Result<()> {
        self.region_op(name, offsets, shape, Some(out), Pass::Unchecked)
    }

    /// The whole of `name` (a global tensor assembled from its chunks, or a whole tensor),
    /// in a fresh buffer, every chunk CRC-checked.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region`].
    pub fn read_global(&self, name: &str) -> Result<Tensor> {
        let (_, shape) = self.shape_of(name)?;
        let shape = shape.to_vec();
        self.read_region(name, &vec![0; shape.len()], &shape)
    }

    /// [`Checkpoint::read_region_into`] in one pass over the stored bytes, for a
    /// destination that nothing uses if the read fails (fresh memory, or memory the
    /// caller declares unusable on error): each block (or chunk without block CRCs) is
    /// CRC-checked and then copied while it is still in the cache, blocks in parallel.
    /// **On error `out` is partly written**: some blocks copied, others not. Regions made
    /// of many runs shorter than a page are checked whole first, then copied.
    ///
    /// # Errors
    /// As [`Checkpoint::read_region_into`]: the first damaged block in the region's plan
    /// order is the one reported.
    pub fn fill_region_into(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
    ) -> Result<()> {
        self.region_op(name, offsets, shape, Some(out), Pass::Fused)
    }

    /// The one region read: plan the region, get the bytes it uses ([`Checkpoint::windows`]),
    /// check them and copy the box into `out` if given (checked for size before anything
    /// is read), as `pass` says.
    fn region_op(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: Option<&mut [u8]>,
        pass: Pass,
    ) -> Result<()> {
        let region = Region::new(offsets, shape);
        let src = self.source(name, Some(&region))?;
        let plan = plan_region(&src, &region)?;
        run_plan(&src, &plan, &region, out, pass)
    }
}

/// How a region read treats the stored bytes it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
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
fn run_plan<S: ShardSource>(
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
fn block_range(t: &TensorInfo, bs: u64, i: u64) -> Option<(u64, u64)> {
    let b = i.checked_mul(bs)?;
    let n = t.nbytes();
    (b < n).then(|| (b, b.saturating_add(bs).min(n)))
}

/// [`touched_blocks`] of a planned step, as a `Result`.
fn touched(
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

/// Call `f(src_offset, dst_offset, len)` (bytes) for every contiguous run of the box
/// `[lo, hi)` (global indices), where the source is a row-major piece at
/// `piece.offsets` of shape `piece.shape` and the destination a row-major region at
/// `region.offsets` of shape `region.shape`; `es` bytes per element. Runs come in
/// increasing source (and destination) order; runs that are adjacent in both the source
/// and the destination are merged (a box of whole rows is one run, one `memcpy`). `None`
/// if an offset overflows or `f` returns `None`.
fn for_each_run(
    piece: &Region,
    region: &Region,
    lo: &[u64],
    hi: &[u64],
    es: usize,
    mut f: impl FnMut(usize, usize, usize) -> Option<()>,
) -> Option<()> {
    let mut pending: Option<(usize, usize, usize)> = None;
    each_row_run(piece, region, lo, hi, es, |so, dof, n| {
        match &mut pending {
            Some((ps, pd, pn)) if ps.checked_add(*pn)? == so && pd.checked_add(*pn)? == dof => {
                *pn = pn.checked_add(n)?;
            }
            _ => {
                if let Some((ps, pd, pn)) = pending.replace((so, dof, n)) {
                    f(ps, pd, pn)?;
                }
            }
        }
        Some(())
    })?;
    match pending {
        Some((ps, pd, pn)) => f(ps, pd, pn),
        None => Some(()),
    }
}

/// [`for_each_run`] before merging: one call per run along the last dimension.
fn each_row_run(
    piece: &Region,
    region: &Region,
    lo: &[u64],
    hi: &[u64],
    es: usize,
    mut f: impl FnMut(usize, usize, usize) -> Option<()>,
) -> Option<()> {
    let rank = lo.len();
    let strides = |shape: &[u64]| {
        let mut s = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(&piece.shape), strides(&region.shape));
    // Elements per run: the intersection along the last dimension (1 for 0-dim).
    let run = if rank == 0 {
        1
    } else {
        hi[rank - 1] - lo[rank - 1]
    };
    let run_bytes = usize::try_from(run).ok()?.checked_mul(es)?;
    let mut idx: Vec<u64> = lo.to_vec();
    loop {
        let (mut so, mut dof) = (0u64, 0u64);
        for d in 0..rank {
            so += (idx[d] - piece.offsets[d]) * ss[d];
            dof += (idx[d] - region.offsets[d]) * ds[d];
        }
        let so = usize::try_from(so).ok()?.checked_mul(es)?;
        let dof = usize::try_from(dof).ok()?.checked_mul(es)?;
        f(so, dof, run_bytes)?;
        // Next run: every dimension but the last, last-but-one fastest.
        let mut d = rank.saturating_sub(1);
        loop {
            if d == 0 {
                return Some(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// Copy the box `[lo, hi)` from `src` (the piece's bytes from byte `base` on) into `dst`
/// (the region's), as [`for_each_run`] lays them out. `None` if a range falls outside
/// either buffer (never for validated pieces).
#[allow(clippy::too_many_arguments)]
fn copy_box(
    src: &[u8],
    base: usize,
    piece: &Region,
    dst: &mut [u8],
    region: &Region,
    lo: &[u64],
    hi: &[u64],
    es: usize,
) -> Option<()> {
    for_each_run(piece, region, lo, hi, es, |so, dof, n| {
        dst.get_mut(dof..dof.checked_add(n)?)?.copy_from_slice(
            src.get(so.checked_sub(base)?..so.checked_sub(base)?.checked_add(n)?)?,
        );
        Some(())
    })
}

/// The indices of the `bs`-byte blocks of a piece that the box `[lo, hi)` touches, in
/// increasing order, without repeats.
fn touched_blocks(
    piece: &Region,
    region: &Region,
    lo: &[u64],
    hi: &[u64],
    es: usize,
    bs: u64,
) -> Option<Vec<u64>> {
    let mut out: Vec<u64> = Vec::new();
    for_each_run(piece, region, lo, hi, es, |so, _, n| {
        if n == 0 {
            return Some(());
        }
        let first = so as u64 / bs;
        let last = (so as u64).checked_add(n as u64 - 1)? / bs;
        let from = match out.last() {
            Some(&l) => first.max(l + 1),
            None => first,
        };
        out.extend(from..=last);
        Some(())
    })?;
    Some(out)
}
