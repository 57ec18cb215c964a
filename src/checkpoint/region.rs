//! Region reads (format-spec/global.md §Reading regions): any box of a global tensor, or
//! of a whole tensor, assembled from the chunks it intersects into a fresh buffer.

use super::{Checkpoint, ShardSource};
use crate::dtype::{checked_nbytes, DType};
use crate::error::{Error, Result};
use crate::format::global::GlobalEntry;
use crate::format::manifest::TensorInfo;
use crate::tensor::Tensor;

mod boxes;
mod run;

use boxes::check_bounds;
use run::{block_range, run_plan, touched, Pass};

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
    pub(crate) fn globals(&self) -> &[GlobalEntry] {
        self.manifest().map_or(&[], |m| &m.globals)
    }

    /// The global tensor called `name`, if there is one.
    pub(crate) fn global(&self, name: &str) -> Option<&GlobalEntry> {
        let i = *self.globals.get(name)?;
        self.globals().get(i)
    }

    /// The dtype and (global) shape of `name`: a global tensor, or a whole tensor.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if neither holds that name.
    pub(crate) fn shape_of(&self, name: &str) -> Result<(DType, &[u64])> {
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
    pub(crate) fn chunks(&self, name: &str) -> Result<Vec<Region>>
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

    /// The chunks of `name` that intersect the box `[offsets, offsets + shape)`, in
    /// manifest order: of a two-level checkpoint's global, only the parts holding a cell of
    /// the box are loaded. Empty for an empty box or one outside the tensor.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; a part's load errors.
    pub(crate) fn chunks_within(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
    ) -> Result<Vec<Region>>
    where
        S: ShardSource,
    {
        let (_, global) = self.shape_of(name)?;
        let inside = offsets.len() == global.len()
            && shape.len() == global.len()
            && offsets
                .iter()
                .zip(shape)
                .zip(global)
                .all(|((&o, &n), &g)| n > 0 && o.checked_add(n).is_some_and(|e| e <= g));
        if !inside {
            return Ok(Vec::new());
        }
        let region = Region::new(offsets, shape);
        let meets = |r: &Region| {
            r.offsets
                .iter()
                .zip(&r.shape)
                .zip(offsets.iter().zip(shape))
                .all(|((&a, &m), (&b, &n))| a < b + n && b < a + m)
        };
        Ok(self
            .source(name, Some(&region))?
            .pieces
            .into_iter()
            .map(|(r, _, _)| r)
            .filter(|r| meets(r))
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
    pub(crate) fn region_byte_ranges(
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
    /// `within`: only the cells that intersect that box `(offsets, shape)` (none for an
    /// empty box or one outside the tensor).
    pub(crate) fn grid_cells(
        &self,
        name: &str,
        within: Option<(&[u64], &[u64])>,
    ) -> Option<Vec<Region>> {
        let g = self.global(name)?;
        let grid = self.manifest()?.grids.get(g.grid? as usize)?;
        let dims = crate::format::grid::dims(grid);
        let ranges: Vec<(usize, usize)> = match within {
            None => dims.iter().map(|&n| (0, n)).collect(),
            Some((o, s)) => match crate::format::grid::cell_ranges(grid, o, s) {
                Some(r) => r,
                None => return Some(Vec::new()),
            },
        };
        let mut out = Vec::new();
        let mut at = vec![0usize; dims.len()];
        crate::format::grid::for_each_cell(&dims, &ranges, |c| {
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
    pub(crate) fn stored_chunks(&self, name: &str) -> Result<Vec<StoredChunk<'_>>>
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
    pub(crate) fn region_file_ranges(
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

    /// The byte size of a region of `name`.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] if it overflows.
    pub(crate) fn region_nbytes(&self, name: &str, shape: &[u64]) -> Result<u64> {
        let (dtype, _) = self.shape_of(name)?;
        checked_nbytes(dtype, shape)
            .ok_or_else(|| Error::InvalidArgument(format!("region shape {shape:?} overflows")))
    }
}

/// One stored chunk of a global tensor ([`Catalog::stored_chunks`](super::Catalog::stored_chunks)).
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
    /// let r = ck.read("w").region(&[1, 1], &[2, 2]).to_tensor()?;
    /// assert_eq!(r.as_slice::<f32>()?, &[5.0, 6.0, 9.0, 10.0]);
    /// # Ok(()) }
    /// ```
    pub(crate) fn read_region(&self, name: &str, offsets: &[u64], shape: &[u64]) -> Result<Tensor> {
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
    pub(crate) fn read_region_into(
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
    pub(crate) fn verify_region(&self, name: &str, offsets: &[u64], shape: &[u64]) -> Result<()> {
        self.region_op(name, offsets, shape, None, Pass::CheckFirst)
    }

    /// Check that `bytes` are the stored bytes of the region, which must be exactly one
    /// stored piece of `name` (a whole tensor, or one chunk of a global tensor, as its
    /// manifest places it), by the CRC32s recorded for it; the stored bytes are not read.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a region that is not one
    /// whole stored piece, or bytes of another size; [`Error::ChecksumMismatch`] naming the
    /// tensor (and block) and shard where `bytes` differ from what was stored.
    pub(crate) fn verify_region_given(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        bytes: &[u8],
    ) -> Result<()> {
        let region = Region::new(offsets, shape);
        let src = self.source(name, Some(&region))?;
        let plan = plan_region(&src, &region)?;
        match plan.as_slice() {
            [(r, owner, t, _, _)] if **r == region => owner.check_given(t, bytes),
            _ => Err(Error::InvalidArgument(format!(
                "tensor {name:?}: the region at offsets {offsets:?}, shape {shape:?} is not one whole stored chunk"
            ))),
        }
    }

    /// Copy the region into `out` (exactly its bytes) **without checking any CRC**: the
    /// second half of [`Checkpoint::read_region_into`], for callers that ran
    /// [`Checkpoint::verify_region`] on it (like [`Checkpoint::tensor`] beside
    /// [`Checkpoint::tensor_verified`]). The checkpoint's files are only read.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a region of the wrong
    /// rank, out of bounds, or an `out` of the wrong size.
    pub(crate) fn copy_region_unchecked(
        &self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
        out: &mut [u8],
    ) -> Result<()> {
        self.region_op(name, offsets, shape, Some(out), Pass::Unchecked)
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
    pub(crate) fn fill_region_into(
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
