//! The logical catalog of a checkpoint: what it holds as a user names it. A checkpoint
//! written by several ranks stores each global tensor in chunks (`w@0,0~r0`, ...:
//! format-spec/global.md); the catalog lists the global tensor `w` once, beside the whole
//! tensors, and never its chunks, whose layout [`Catalog::chunks`] gives.

use super::{Checkpoint, Region, ShardSource, StoredChunk, NOT_A_CHUNK};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::global::GlobalEntry;

/// One name of a checkpoint's logical catalog ([`Catalog::entries`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The name a user reads it by.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// The (global) shape.
    pub shape: &'a [u64],
    /// How many stored chunks hold it: 1 for a whole tensor.
    pub chunks: usize,
    /// A global tensor (stored in chunks, assembled by [`Checkpoint::read`]) rather than
    /// one whole stored tensor (viewable zero-copy: [`Read::view`](super::Read::view)).
    pub global: bool,
}

impl<S> Checkpoint<S> {
    /// The `chunk_of` table, built on first use.
    fn chunk_of(&self) -> &[u32] {
        self.chunk_of.get_or_init(|| match self.manifest() {
            Some(m) => super::chunk_owners(m, &self.by_name),
            None => Vec::new(),
        })
    }

    /// The logical catalog: every whole tensor and every global tensor, once each, in the
    /// order they are stored (a global tensor where its first chunk is); chunks and their
    /// replicas are not listed. For a checkpoint without global tensors these are exactly
    /// [`Checkpoint::tensors`].
    pub(crate) fn entries(&self) -> Vec<Entry<'_>> {
        let tensors = self.tensors();
        let globals = self.manifest().map_or(&[][..], |m| &m.globals);
        let mut listed = vec![false; globals.len()];
        let mut out = Vec::with_capacity(tensors.len() + globals.len());
        for (i, t) in tensors.iter().enumerate() {
            let owner = self.chunk_of().get(i).copied().unwrap_or(NOT_A_CHUNK);
            if owner == NOT_A_CHUNK {
                out.push(Entry {
                    name: &t.name,
                    dtype: t.dtype,
                    shape: &t.shape,
                    chunks: 1,
                    global: false,
                });
                continue;
            }
            let g = owner as usize;
            if let (Some(seen), Some(e)) = (listed.get_mut(g), globals.get(g)) {
                if !*seen {
                    *seen = true;
                    out.push(Entry {
                        name: &e.name,
                        dtype: e.dtype,
                        shape: &e.global_shape,
                        chunks: e.chunks.len(),
                        global: true,
                    });
                }
            }
        }
        // Globals no stored tensor of this manifest holds a chunk of follow the whole
        // tensors, in manifest order: every global of a two-level root (its chunks are in
        // the parts), and globals of zero elements (no chunks at all).
        for (e, _) in globals.iter().zip(&listed).filter(|(_, &seen)| !seen) {
            out.push(Entry {
                name: &e.name,
                dtype: e.dtype,
                shape: &e.global_shape,
                chunks: self.chunk_count(e),
                global: true,
            });
        }
        out
    }

    /// How many chunks hold global `e`: in a two-level root, which lists none, the cells of
    /// its grid (each held by one chunk; a chunk may hold several).
    fn chunk_count(&self, e: &crate::format::global::GlobalEntry) -> usize {
        match (e.grid, self.manifest()) {
            (Some(k), Some(m)) => m.grids.get(k as usize).map_or(0, |g| g.cells.len()),
            _ => e.chunks.len(),
        }
    }

    /// How many names [`Checkpoint::entries`] lists (without building the list).
    pub(crate) fn entry_count(&self) -> usize {
        let chunks = self
            .chunk_of()
            .iter()
            .filter(|&&g| g != NOT_A_CHUNK)
            .count();
        self.tensors().len() - chunks + self.globals.len()
    }

    /// The catalog entry called `name`: a global tensor, or a whole tensor that is not a
    /// chunk of one.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if the catalog has no such name (a chunk's stored name is
    /// not one: read it through its global tensor).
    pub(crate) fn entry(&self, name: &str) -> Result<Entry<'_>> {
        let not_found = || Error::TensorNotFound {
            name: name.to_string(),
        };
        if let Some(&g) = self.globals.get(name) {
            let e = self
                .manifest()
                .and_then(|m| m.globals.get(g))
                .ok_or_else(not_found)?;
            return Ok(Entry {
                name: &e.name,
                dtype: e.dtype,
                shape: &e.global_shape,
                chunks: self.chunk_count(e),
                global: true,
            });
        }
        let i = self
            .by_name
            .position(self.tensors(), name)
            .ok_or_else(not_found)?;
        if self.chunk_of().get(i).is_some_and(|&g| g != NOT_A_CHUNK) {
            return Err(not_found());
        }
        let t = &self.tensors()[i];
        Ok(Entry {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            chunks: 1,
            global: false,
        })
    }
}

/// The logical catalog of a checkpoint ([`Checkpoint::catalog`]): the names a user reads
/// by (whole tensors and global tensors), their shapes, and how the global tensors are
/// chunked. A cheap copy of a reference to the checkpoint; what it returns borrows the
/// checkpoint.
pub struct Catalog<'c, S> {
    ck: &'c Checkpoint<S>,
}

impl<S> Clone for Catalog<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Catalog<'_, S> {}

impl<S> std::fmt::Debug for Catalog<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog")
            .field("root", &self.ck.root())
            .finish_non_exhaustive()
    }
}

impl<S> Checkpoint<S> {
    /// The logical catalog: names, shapes and chunk layouts ([`Catalog`]).
    pub fn catalog(&self) -> Catalog<'_, S> {
        Catalog { ck: self }
    }
}

impl<'c, S> Catalog<'c, S> {
    /// The logical catalog: every whole tensor and every global tensor, once each, in the
    /// order they are stored (a global tensor where its first chunk is); chunks and their
    /// replicas are not listed. For a checkpoint without global tensors these are exactly
    /// [`Checkpoint::tensors`].
    pub fn entries(self) -> Vec<Entry<'c>> {
        self.ck.entries()
    }

    /// How many names [`Catalog::entries`] lists (without building the list).
    pub fn entry_count(self) -> usize {
        self.ck.entry_count()
    }

    /// The catalog entry called `name`: a global tensor, or a whole tensor that is not a
    /// chunk of one.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if the catalog has no such name (a chunk's stored name is
    /// not one: read it through its global tensor).
    pub fn entry(self, name: &str) -> Result<Entry<'c>> {
        self.ck.entry(name)
    }

    /// The global tensors (format-spec/global.md), in manifest order; empty for checkpoints
    /// without any.
    pub fn globals(self) -> &'c [GlobalEntry] {
        self.ck.globals()
    }

    /// The global tensor called `name`, if there is one.
    pub fn global(self, name: &str) -> Option<&'c GlobalEntry> {
        self.ck.global(name)
    }

    /// The dtype and (global) shape of `name`: a global tensor, or a whole tensor.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if neither holds that name.
    pub fn shape_of(self, name: &str) -> Result<(DType, &'c [u64])> {
        self.ck.shape_of(name)
    }

    /// The cells of the chunk grid of global `name` in a two-level checkpoint, as regions
    /// in row-major cell order (format-spec/global.md §Root): each lies inside one chunk,
    /// so a reader can plan with them as it would with chunks, from the root alone,
    /// loading no part. `None` for a flat checkpoint's globals and for whole tensors.
    pub fn grid_cells(self, name: &str) -> Option<Vec<Region>> {
        self.ck.grid_cells(name, None)
    }

    /// The cells of [`grid_cells`](Self::grid_cells) that intersect the box `[offsets,
    /// offsets + shape)`: what a rank that reads only that box plans with, so that its
    /// plan's metadata grows with its own reads, not with the world's chunks. Empty for
    /// an empty box or one outside the tensor; `None` as `grid_cells`.
    pub fn grid_cells_within(
        self,
        name: &str,
        offsets: &[u64],
        shape: &[u64],
    ) -> Option<Vec<Region>> {
        self.ck.grid_cells(name, Some((offsets, shape)))
    }

    /// Whether this is a two-level checkpoint (feature `parts`, format-spec/global.md §The
    /// two-level manifest), whose chunk entries live in part indexes read on first use.
    pub fn two_level(self) -> bool {
        self.ck.parts.is_some()
    }

    /// Of a two-level checkpoint: how many part indexes have been read so far, and their
    /// bytes (the metadata decoded besides the root manifest). `(0, 0)` otherwise.
    pub fn parts_read(self) -> (usize, u64) {
        self.ck
            .parts
            .as_ref()
            .map_or((0, 0), |p| (p.loaded_count(), p.index_bytes()))
    }
}

impl<'c, S: ShardSource> Catalog<'c, S> {
    /// The chunks of `name` as regions of its global index space, in manifest order: a
    /// whole tensor is one chunk at the origin. Of a two-level checkpoint this reads every
    /// part of its grid.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; a part's load errors.
    pub fn chunks(self, name: &str) -> Result<Vec<Region>> {
        self.ck.chunks(name)
    }

    /// The chunks of `name` that intersect the box `[offsets, offsets + shape)`, in
    /// manifest order (empty for an empty box or one outside the tensor). Of a two-level
    /// checkpoint this reads only the parts holding a cell of the box: whether a rank's
    /// read is one whole stored chunk costs its own part, not every rank's.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; a part's load errors.
    pub fn chunks_within(self, name: &str, offsets: &[u64], shape: &[u64]) -> Result<Vec<Region>> {
        self.ck.chunks_within(name, offsets, shape)
    }

    /// Every stored chunk of the global tensor `name`, replicas included: for `inspect`
    /// and tools. Of a two-level checkpoint this reads every part.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] if `name` is not a global tensor; a part's load errors.
    pub fn stored_chunks(self, name: &str) -> Result<Vec<StoredChunk<'c>>> {
        self.ck.stored_chunks(name)
    }
}
