//! Reads as one call with a selection: [`Checkpoint::read`] names a tensor and returns a
//! [`Read`], on which the selection (the whole tensor, a region, or a byte range) and the
//! options (page release, one-pass checking) are set before one terminal call says where
//! the bytes go (a fresh buffer, the caller's, a zero-copy view, nowhere: a check) and
//! whether their CRCs are checked. Every path that skips the CRCs says `unchecked` in its
//! name. [`Checkpoint::read_batch`] is the parallel form over many tensors at once.

use super::{Checkpoint, ShardSource};
use crate::error::{Error, Result};
use crate::format::manifest::TensorInfo;
use crate::tensor::Tensor;
use crate::view::TensorView;

/// What a [`Read`] selects of its tensor.
#[derive(Debug, Clone)]
enum Selection {
    /// The whole tensor: a stored tensor, or a global tensor assembled from its chunks.
    Whole,
    /// The box `[offsets, offsets + shape)` of the tensor's (global) index space.
    Region(Vec<u64>, Vec<u64>),
    /// Stored bytes from this offset on, as many as the destination holds.
    At(u64),
}

/// One read of one tensor ([`Checkpoint::read`]): set the selection and the options, then
/// call one terminal method.
///
/// | terminal | destination | CRCs |
/// |---|---|---|
/// | [`Read::to_tensor`] | a fresh buffer | checked |
/// | [`Read::into`] | the caller's buffer | checked |
/// | [`Read::into_unchecked`] | the caller's buffer | **not checked** |
/// | [`Read::verify`] | none | checked |
/// | [`Read::view`] | a zero-copy view (resident shards) | checked |
/// | [`Read::view_unchecked`] | a zero-copy view (resident shards) | **not checked** |
/// | [`Read::plan`] | none: where the bytes lie | none read |
///
/// The selection is the whole tensor unless [`Read::region`] or [`Read::at`] says
/// otherwise. A name is a stored tensor or a global tensor (format-spec/global.md),
/// whose whole or region is assembled from the chunks it intersects.
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
/// let mut out = vec![0u8; 48];
/// ck.read("w").into(&mut out)?;
/// assert_eq!(ck.read("w").view()?.bytes(), &out[..]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "a Read does nothing until a terminal method (to_tensor, into, verify, ...) runs it"]
pub struct Read<'c, 'n, S> {
    ck: &'c Checkpoint<S>,
    name: &'n str,
    selection: Selection,
    release: bool,
    fused: bool,
}

/// Where the bytes of a [`Read`]'s selection lie ([`Read::plan`]): what a prefetcher
/// (readahead hints, ranged requests) or a planner of read amplification needs, computed
/// without reading any tensor data.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReadPlan<'c> {
    /// `(shard index, begin, end)` absolute byte ranges in [`Checkpoint::shards`], one per
    /// CRC block touched (chunks with block CRCs) or per chunk, in plan order, adjacent
    /// ranges merged. Of a two-level checkpoint, only ranges in the root's own shards.
    pub shard_ranges: Vec<(usize, u64, u64)>,
    /// The same ranges with each shard named (as [`Shard::file`](super::Shard) names it),
    /// including the shards of a two-level checkpoint's parts (the parts touched are
    /// loaded).
    pub file_ranges: Vec<(&'c str, u64, u64)>,
    /// The byte size of the selection itself.
    pub nbytes: u64,
}

impl ReadPlan<'_> {
    /// The bytes a checked read of the selection reads: of every chunk it intersects, the
    /// CRC blocks it touches (format-spec/integrity.md §Block CRCs), or the whole chunk
    /// where the chunk has no block CRCs. Divided by [`ReadPlan::nbytes`], the read
    /// amplification of a resharding layout.
    pub fn bytes_read(&self) -> u64 {
        self.file_ranges.iter().map(|(_, b, e)| e - b).sum()
    }
}

impl<S: ShardSource> Checkpoint<S> {
    /// Start a read of tensor `name` (a stored tensor, or a global tensor): see [`Read`].
    pub fn read<'c, 'n>(&'c self, name: &'n str) -> Read<'c, 'n, S> {
        Read {
            ck: self,
            name,
            selection: Selection::Whole,
            release: false,
            fused: false,
        }
    }

    /// Start a batch of whole-tensor and byte-range reads into caller-owned buffers and
    /// of CRC checks, run in parallel: see [`Batch`].
    pub fn read_batch<'c, 'd>(&'c self) -> Batch<'c, 'd, S> {
        Batch {
            ck: self,
            fills: Vec::new(),
            ranges: Vec::new(),
            check: Vec::new(),
            release: false,
        }
    }
}

impl<'c, 'n, S: ShardSource> Read<'c, 'n, S> {
    /// Select the box `[offsets, offsets + shape)` of the tensor's (global) index space,
    /// one offset and one extent per dimension (the default is the whole tensor).
    pub fn region(mut self, offsets: &[u64], shape: &[u64]) -> Self {
        self.selection = Selection::Region(offsets.to_vec(), shape.to_vec());
        self
    }

    /// Select the stored bytes of a (stored, not global) tensor from `byte_offset` on: as
    /// many as the destination of [`Read::into`] or [`Read::into_unchecked`] holds. For
    /// staging a tensor larger than a staging buffer in pieces.
    pub fn at(mut self, byte_offset: u64) -> Self {
        self.selection = Selection::At(byte_offset);
        self
    }

    /// Release the mapped pages the read used from this process once it is done (they
    /// stay in the page cache; a later read maps them again), so that a reader streaming
    /// a large checkpoint keeps its resident memory bounded. Nothing for storage the
    /// process owns or fetches, and nothing for views.
    pub fn release_pages(mut self, yes: bool) -> Self {
        self.release = yes;
        self
    }

    /// For [`Read::into`]: check and copy in one pass over the stored bytes, each block (or
    /// chunk without block CRCs) CRC-checked and then copied while it is still in the
    /// cache, blocks in parallel, for a destination that nothing uses if the read fails.
    /// **On error the destination is then partly written.** Without it (the default),
    /// every byte the read uses is checked before any is copied, and on error the
    /// destination is unchanged.
    pub fn fused(mut self, yes: bool) -> Self {
        self.fused = yes;
        self
    }

    /// The stored tensor this read names, unless it names a global tensor.
    fn stored(&self) -> Result<Option<&'c TensorInfo>> {
        if self.ck.global(self.name).is_some() {
            return Ok(None);
        }
        self.ck.info(self.name).map(Some)
    }

    /// The selection as a region: the whole tensor's for [`Selection::Whole`].
    fn region_of(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        match &self.selection {
            Selection::Region(o, s) => Ok((o.clone(), s.clone())),
            Selection::Whole => {
                let (_, shape) = self.ck.shape_of(self.name)?;
                Ok((vec![0; shape.len()], shape.to_vec()))
            }
            Selection::At(_) => Err(self.no_range("this read")),
        }
    }

    fn no_range(&self, what: &str) -> Error {
        Error::InvalidArgument(format!(
            "tensor {:?}: {what} takes the whole tensor or a region, not a byte range (`at`)",
            self.name
        ))
    }

    /// After the read: release the pages of everything `name` is stored in, if asked.
    fn done(&self) -> Result<()> {
        if self.release {
            self.ck.release_pages(self.name)?;
        }
        Ok(())
    }

    /// Read the selection into a freshly allocated tensor (of the region's shape for a
    /// region), CRC-checked: a whole stored tensor in one pass over its bytes, its CRC32
    /// (and absmax, block CRCs) checked as they are copied or fetched; a global tensor or
    /// a region assembled from the chunks it intersects, each chunk's CRC (or the CRCs of
    /// the blocks it touches) checked before its bytes are used. From fetched shards only
    /// the byte ranges [`Read::plan`] names are fetched.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a region of the wrong rank
    /// or out of bounds, or a byte range ([`Read::at`]: it has no shape);
    /// [`Error::ChecksumMismatch`] / [`Error::AbsmaxMismatch`] naming the tensor (and
    /// block) and shard for damaged bytes (nothing is returned); the source's errors for a
    /// fetch that fails.
    pub fn to_tensor(self) -> Result<Tensor> {
        let t = match (&self.selection, self.stored()?) {
            (Selection::Whole, Some(t)) => self.ck.read_info(t)?,
            (Selection::At(_), _) => return Err(self.no_range("to_tensor")),
            _ => {
                let (o, s) = self.region_of()?;
                self.ck.read_region(self.name, &o, &s)?
            }
        };
        self.done()?;
        Ok(t)
    }

    /// Read the selection into `dst` (exactly its bytes: row-major, the tensor's
    /// little-endian element bytes), CRC-checked: every block or chunk the read uses is
    /// checked before any byte is copied and on error `dst` is unchanged, unless
    /// [`Read::fused`] asks for one pass (then `dst` is partly written on error). A byte
    /// range ([`Read::at`]) checks its whole tensor's CRC, then copies.
    ///
    /// # Errors
    /// As [`Read::to_tensor`]; [`Error::InvalidArgument`] if `dst` is not the selection's
    /// byte size or a byte range is outside its tensor.
    pub fn into(self, dst: &mut [u8]) -> Result<()> {
        match (&self.selection, self.stored()?) {
            (Selection::At(_), Some(t)) => {
                self.ck.verify_tensors(&[&t.name], false, &|_| {})?;
                return self.into_unchecked(dst);
            }
            (Selection::At(_), None) => return Err(self.no_range("a global tensor")),
            (Selection::Whole, Some(t)) if self.fused && self.ck.stored_bytes(t).is_some() => {
                // One pass in parallel blocks, each block's pages released as it is done.
                return self
                    .ck
                    .fill_and_verify(vec![(self.name, dst)], &[], self.release);
            }
            _ => {}
        }
        let (o, s) = self.region_of()?;
        if self.fused {
            self.ck.fill_region_into(self.name, &o, &s, dst)?;
        } else {
            self.ck.read_region_into(self.name, &o, &s, dst)?;
        }
        self.done()
    }

    /// Copy the selection into `dst` (exactly its bytes; for a byte range, `dst.len()`
    /// bytes from [`Read::at`]'s offset) **without checking any CRC**: for callers that
    /// checked the bytes just before ([`Read::verify`], [`Checkpoint::verify`]). A whole
    /// stored tensor or a byte range of one is copied rayon-parallel from its resident
    /// shard.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a region of the wrong
    /// rank or out of bounds, a `dst` of the wrong size, or a byte range outside its
    /// tensor; the source's errors for a fetch that fails.
    pub fn into_unchecked(self, dst: &mut [u8]) -> Result<()> {
        match (&self.selection, self.stored()?) {
            (Selection::Whole, Some(t)) if self.ck.stored_bytes(t).is_some() => {
                return self.ck.copy_tensor_into_unchecked(t, dst, self.release);
            }
            (Selection::At(offset), Some(t)) => {
                let offset = *offset;
                if self.ck.stored_bytes(t).is_some() {
                    self.ck
                        .copy_ranges_into_unchecked(vec![(self.name, offset, dst)])?;
                } else {
                    // Fetched shards: the tensor, then the range of it.
                    let x = self.ck.read_info(t)?;
                    let src = usize::try_from(offset)
                        .ok()
                        .and_then(|a| x.bytes().get(a..a.checked_add(dst.len())?))
                        .ok_or_else(|| {
                            Error::InvalidArgument(format!(
                                "bytes {offset}..+{} are outside tensor {:?} ({} bytes)",
                                dst.len(),
                                self.name,
                                x.bytes().len()
                            ))
                        })?;
                    dst.copy_from_slice(src);
                }
                return self.done();
            }
            (Selection::At(_), None) => return Err(self.no_range("a global tensor")),
            _ => {}
        }
        let (o, s) = self.region_of()?;
        self.ck.copy_region_unchecked(self.name, &o, &s, dst)?;
        self.done()
    }

    /// Check the CRC32s of everything a read of the selection uses, reading nothing else:
    /// a whole stored tensor's bytes (or, for a byte range, its tensor's); of a region or a
    /// global tensor, the blocks it touches of chunks with block CRCs
    /// (format-spec/integrity.md §Block CRCs), whole chunks otherwise, in parallel. A
    /// reader that must check many selections before it writes any destination
    /// (all-or-nothing across a job) calls this for each, then [`Read::into_unchecked`].
    ///
    /// # Errors
    /// As [`Read::to_tensor`].
    pub fn verify(self) -> Result<()> {
        match (&self.selection, self.stored()?) {
            (Selection::Whole | Selection::At(_), Some(t)) => {
                self.ck.verify_tensors(&[&t.name], self.release, &|_| {})
            }
            (Selection::At(_), None) => Err(self.no_range("a global tensor")),
            _ => {
                let (o, s) = self.region_of()?;
                self.ck.verify_region(self.name, &o, &s)?;
                self.done()
            }
        }
    }

    /// Check that `bytes` are the stored bytes of the selection, by the CRC32s the
    /// manifest records (its blocks, or the whole), without reading the stored bytes: for
    /// bytes that came from elsewhere (a peer's copy of the shard, sent over the network)
    /// straight into their destination. The selection must be exactly one stored piece:
    /// a whole tensor, or a region equal to one chunk of a global tensor.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] for a byte range, a region
    /// that is not one whole stored chunk, or `bytes` of another size;
    /// [`Error::ChecksumMismatch`] naming the tensor (and block) and shard where `bytes`
    /// differ from what was stored.
    pub fn verify_given(self, bytes: &[u8]) -> Result<()> {
        match (&self.selection, self.stored()?) {
            (Selection::Whole, Some(t)) => self.ck.check_given(t, bytes),
            (Selection::At(_), _) => Err(self.no_range("verify_given")),
            _ => {
                let (o, s) = self.region_of()?;
                self.ck.verify_region_given(self.name, &o, &s, bytes)
            }
        }
    }

    /// A zero-copy view of the whole stored tensor, its CRC32 checked just now (not again
    /// where the checkpoint's data was checked as it was downloaded:
    /// [`Checkpoint::data_verified`]).
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] (a global tensor has no single stored view: read it with
    /// [`Read::to_tensor`]); [`Error::InvalidArgument`] for a region or byte range, or a
    /// shard that is not resident ([`Checkpoint::resident`]); [`Error::ChecksumMismatch`]
    /// if the bytes are damaged.
    pub fn view(self) -> Result<TensorView<'c>> {
        let v = self.view_unchecked_inner()?;
        let t = self.ck.info(self.name)?;
        if !self.ck.data_verified {
            self.ck
                .check_crc(t, crate::crc::crc32_parallel(v.bytes()))?;
        }
        Ok(v)
    }

    /// A zero-copy view of the whole stored tensor **without checking its CRC** (see
    /// [`Read::view`], [`Checkpoint::verify`]).
    ///
    /// # Errors
    /// As [`Read::view`], without the checksum error.
    pub fn view_unchecked(self) -> Result<TensorView<'c>> {
        self.view_unchecked_inner()
    }

    fn view_unchecked_inner(&self) -> Result<TensorView<'c>> {
        if !matches!(self.selection, Selection::Whole) {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: a view is of a whole stored tensor",
                self.name
            )));
        }
        let t = self.ck.info(self.name)?;
        let bytes = self.ck.stored_bytes(t).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "tensor {:?}: its shard is not resident (fetched or read by pread): read it with to_tensor",
                self.name
            ))
        })?;
        Ok(TensorView::new(&t.name, t.dtype, &t.shape, bytes))
    }

    /// Where the bytes of the selection (the whole tensor or a region) lie, reading no
    /// tensor data: see [`ReadPlan`].
    ///
    /// # Errors
    /// As [`Read::to_tensor`], without reading any tensor data.
    pub fn plan(self) -> Result<ReadPlan<'c>> {
        let (o, s) = self.region_of()?;
        Ok(ReadPlan {
            shard_ranges: self.ck.region_byte_ranges(self.name, &o, &s)?,
            file_ranges: self.ck.region_file_ranges(self.name, &o, &s)?,
            nbytes: self.ck.region_nbytes(self.name, &s)?,
        })
    }
}

/// Many reads into caller-owned buffers and CRC checks at once ([`Checkpoint::read_batch`]),
/// for restores into memory the caller will use (the storage of framework tensors): add
/// whole tensors ([`Batch::fill`]), byte ranges ([`Batch::fill_ranges`]) and tensors only
/// to check ([`Batch::check`]), then run it checked ([`Batch::run`]) or not
/// ([`Batch::run_unchecked`]).
#[derive(Debug)]
#[must_use = "a Batch does nothing until run or run_unchecked"]
pub struct Batch<'c, 'd, S> {
    ck: &'c Checkpoint<S>,
    fills: Vec<(&'d str, &'d mut [u8])>,
    ranges: Vec<(&'d str, u64, &'d mut [u8])>,
    check: Vec<&'d str>,
    release: bool,
}

impl<'d, S: ShardSource> Batch<'_, 'd, S> {
    /// Copy each named whole tensor into its destination (exactly the tensor's stored
    /// byte length).
    pub fn fill(mut self, items: Vec<(&'d str, &'d mut [u8])>) -> Self {
        self.fills.extend(items);
        self
    }

    /// For each `(name, offset, dst)`, copy the tensor's stored bytes
    /// `[offset, offset + dst.len())` into `dst`: a tensor larger than a staging buffer in
    /// pieces (the Python bindings' pinned buffers for CUDA tensors).
    pub fn fill_ranges(mut self, items: Vec<(&'d str, u64, &'d mut [u8])>) -> Self {
        self.ranges.extend(items);
        self
    }

    /// Check the CRC32 of each named tensor without copying it ([`Batch::run`] only): the
    /// tensors whose destination must not change on failure, copied afterwards with
    /// [`Batch::run_unchecked`] or [`Read::into_unchecked`].
    pub fn check(mut self, names: &[&'d str]) -> Self {
        self.check.extend_from_slice(names);
        self
    }

    /// Release the mapped pages of each whole tensor's blocks from this process as soon
    /// as they are done (they stay in the page cache).
    pub fn release_pages(mut self, yes: bool) -> Self {
        self.release = yes;
        self
    }

    /// Run the batch, CRC-checked, in one pass over the stored bytes: each whole tensor
    /// copied into its destination with its CRC32 computed on the way (per block: every
    /// byte read once and written once), each tensor of [`Batch::check`] and each tensor a
    /// byte range is taken from checked without copying; tensors one after the other in
    /// file order, each rayon-parallel over 4 MiB blocks, with read-ahead of cold bytes.
    /// The byte ranges are copied once every check passed. From shards that are not
    /// resident, each item is read as [`Read::into`] with [`Read::fused`] reads it.
    ///
    /// Every name and every destination length is checked before any byte is read or
    /// written. On a checksum error the destinations of whole tensors hold unspecified
    /// bytes: fill fresh memory and throw it away on error.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`] for an unknown name; [`Error::InvalidArgument`] for a
    /// destination of the wrong length (naming the tensor) or a range outside its tensor;
    /// [`Error::ChecksumMismatch`] for damaged bytes, the first in fill, then check, then
    /// range order.
    pub fn run(self) -> Result<()> {
        let Batch {
            ck,
            fills,
            ranges,
            mut check,
            release,
        } = self;
        if !ck.resident() {
            for (name, dst) in fills {
                ck.read(name).fused(true).into(dst)?;
            }
            for name in check {
                ck.read(name).verify()?;
            }
            for (name, offset, dst) in ranges {
                ck.read(name).at(offset).into(dst)?;
            }
            return Ok(());
        }
        for (name, _, _) in &ranges {
            if !check.contains(name) {
                check.push(name);
            }
        }
        // Ranges are checked for bounds before anything is read.
        ck.check_ranges(&ranges)?;
        ck.fill_and_verify(fills, &check, release)?;
        if ranges.is_empty() {
            return Ok(());
        }
        ck.copy_ranges_into_unchecked(ranges)
    }

    /// Run the batch's copies **without checking any CRC** (check first: [`Batch::run`]
    /// with [`Batch::check`], or [`Checkpoint::verify`]), rayon-parallel across items and
    /// within large ones.
    ///
    /// # Errors
    /// [`Error::TensorNotFound`]; [`Error::InvalidArgument`] if a destination is not
    /// exactly its tensor's byte length, a range is outside its tensor, or the batch names
    /// tensors to [`Batch::check`] (this run checks nothing). All are checked before any
    /// byte is written.
    pub fn run_unchecked(self) -> Result<()> {
        if !self.check.is_empty() {
            return Err(Error::InvalidArgument(
                "run_unchecked checks nothing: run the checks with run".into(),
            ));
        }
        let Batch {
            ck,
            fills,
            ranges,
            release,
            ..
        } = self;
        if !ck.resident() {
            for (name, dst) in fills {
                ck.read(name).into_unchecked(dst)?;
            }
            for (name, offset, dst) in ranges {
                ck.read(name).at(offset).into_unchecked(dst)?;
            }
            return Ok(());
        }
        ck.check_ranges(&ranges)?;
        if !fills.is_empty() {
            ck.copy_into_unchecked(fills, release)?;
        }
        if !ranges.is_empty() {
            ck.copy_ranges_into_unchecked(ranges)?;
        }
        Ok(())
    }
}
