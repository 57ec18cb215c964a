//! Two-level checkpoints (feature `parts`, format-spec/global.md §The two-level manifest):
//! the root names part indexes, which hold the chunk entries of global tensors. A part is
//! read on first use, checked against the root (its size and CRC32, its id, and every chunk
//! against the cells the root's grid assigns it), and kept: the shards it lists become a
//! flat sub-checkpoint, whose tensors the region reads use like the root's own.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::{Checkpoint, Region, Shard, ShardSource};
use crate::error::{Error, Result};
use crate::format::grid::{cell_ranges, dims, for_each_cell};
use crate::format::manifest::{Manifest, NameIndex, ShardEntry, TensorInfo};
use crate::format::part::decode_part;

/// Where a two-level checkpoint's part indexes and their shards come from.
pub(crate) trait PartStore<S>: Send + Sync {
    /// The bytes of part index `file`, whose recorded size is `size` (read at most
    /// `size + 1` bytes: a longer file is refused by its length).
    fn read_index(&self, file: &str, size: u64) -> Result<Vec<u8>>;
    /// Open the shards `shards` lists, in order, named as errors should name them.
    fn open_shards(&self, shards: &[ShardEntry]) -> Result<Vec<Shard<S>>>;
    /// How errors name `file` (a path, a URL).
    fn describe(&self, file: &str) -> String;
}

/// A loaded part: its chunk shards as a flat checkpoint, and per global tensor (by index
/// into the root's `globals`) the chunks whose cells the root assigns to this part, as
/// `(box, index into the sub-checkpoint's tensors)`. Replicas (copies of chunks another part
/// holds) are in the sub-checkpoint, for `verify`, and not in `chunks`.
pub(crate) struct Loaded<S> {
    pub(crate) ck: Checkpoint<S>,
    pub(crate) chunks: HashMap<u32, Vec<(Region, usize)>>,
    /// The same for the part's replicas: copies of chunks whose cells another part holds.
    pub(crate) replicas: HashMap<u32, Vec<(Region, usize)>>,
}

/// The part indexes of a two-level checkpoint, each loaded once.
pub(crate) struct PartSet<S> {
    store: Box<dyn PartStore<S>>,
    loaded: Vec<OnceLock<Loaded<S>>>,
    /// Bytes of part indexes read so far.
    index_bytes: AtomicU64,
    /// Per grid of the root: how many cells it assigns to each part (built on first use).
    cell_counts: Vec<OnceLock<HashMap<u32, u64>>>,
    /// Per part: held while it loads, so that it is read and checked once.
    loading: Vec<std::sync::Mutex<()>>,
}

impl<S> fmt::Debug for PartSet<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartSet")
            .field("parts", &self.loaded.len())
            .field(
                "loaded",
                &self.loaded.iter().filter(|l| l.get().is_some()).count(),
            )
            .finish()
    }
}

impl<S: 'static> PartSet<S> {
    pub(crate) fn new(store: Box<dyn PartStore<S>>, m: &Manifest) -> Self {
        PartSet {
            store,
            loaded: (0..m.parts.len()).map(|_| OnceLock::new()).collect(),
            index_bytes: AtomicU64::new(0),
            cell_counts: (0..m.grids.len()).map(|_| OnceLock::new()).collect(),
            loading: (0..m.parts.len()).map(|_| Default::default()).collect(),
        }
    }

    /// The same parts over another storage type (see [`Checkpoint::map_storage`]).
    pub(crate) fn map<C: 'static, F>(self, f: F) -> PartSet<C>
    where
        F: Fn(S) -> C + Clone + Send + Sync + 'static,
        S: Send + Sync,
    {
        let loaded = self
            .loaded
            .into_iter()
            .map(|l| {
                let out = OnceLock::new();
                if let Some(l) = l.into_inner() {
                    let _ = out.set(Loaded {
                        ck: l.ck.map_storage(f.clone()),
                        chunks: l.chunks,
                        replicas: l.replicas,
                    });
                }
                out
            })
            .collect();
        PartSet {
            store: Box::new(Mapped {
                inner: self.store,
                f,
                _c: std::marker::PhantomData,
            }),
            loaded,
            index_bytes: self.index_bytes,
            cell_counts: self.cell_counts,
            loading: self.loading,
        }
    }
}

impl<S> PartSet<S> {
    /// Bytes of part indexes read so far.
    pub(crate) fn index_bytes(&self) -> u64 {
        self.index_bytes.load(Ordering::Relaxed)
    }

    /// How many parts the root names.
    pub(crate) fn len(&self) -> usize {
        self.loaded.len()
    }

    /// How many parts are loaded.
    pub(crate) fn loaded_count(&self) -> usize {
        self.loaded.iter().filter(|l| l.get().is_some()).count()
    }

    /// The parts loaded so far.
    pub(crate) fn loaded(&self) -> impl Iterator<Item = &Loaded<S>> {
        self.loaded.iter().filter_map(OnceLock::get)
    }
}

struct Mapped<S, C, F> {
    inner: Box<dyn PartStore<S>>,
    f: F,
    _c: std::marker::PhantomData<fn() -> C>,
}

impl<S, C, F: Fn(S) -> C + Send + Sync> PartStore<C> for Mapped<S, C, F> {
    fn read_index(&self, file: &str, size: u64) -> Result<Vec<u8>> {
        self.inner.read_index(file, size)
    }
    fn open_shards(&self, shards: &[ShardEntry]) -> Result<Vec<Shard<C>>> {
        Ok(self
            .inner
            .open_shards(shards)?
            .into_iter()
            .map(|s| Shard {
                file: s.file,
                bytes: (self.f)(s.bytes),
            })
            .collect())
    }
    fn describe(&self, file: &str) -> String {
        self.inner.describe(file)
    }
}

/// Part indexes and shards in a local directory, shards opened with `open_shard`.
pub(crate) struct LocalParts<S> {
    pub(crate) root: PathBuf,
    pub(crate) open_shard: super::open::OpenShard<S>,
}

impl<S: ShardSource + Send> PartStore<S> for LocalParts<S> {
    fn read_index(&self, file: &str, size: u64) -> Result<Vec<u8>> {
        let p = self.root.join(file);
        super::read_capped(&p, size.saturating_add(1))
    }
    fn open_shards(&self, shards: &[ShardEntry]) -> Result<Vec<Shard<S>>> {
        super::open::open_shard_files(&self.root, shards, self.open_shard)
    }
    fn describe(&self, file: &str) -> String {
        self.root.join(file).display().to_string()
    }
}

/// A damaged part index: the error names it.
fn damaged(part: String, reason: String) -> Error {
    Error::InvalidPart { part, reason }
}

impl<S: ShardSource> Checkpoint<S> {
    /// The loaded part `p` of this two-level checkpoint (loading it on first use).
    ///
    /// # Errors
    /// [`Error::InvalidPart`] naming the index for a missing, damaged or inconsistent one
    /// (nothing is cached: a later call tries again); the shard errors of an open.
    pub(crate) fn part(&self, p: u32) -> Result<&Loaded<S>> {
        let (Some(set), Some(m)) = (&self.parts, &self.manifest) else {
            return Err(Error::InvalidArgument("not a two-level checkpoint".into()));
        };
        let slot = set
            .loaded
            .get(p as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("no part {p}")))?;
        if let Some(l) = slot.get() {
            return Ok(l);
        }
        // One loader per part: a thread that finds it loading waits for it, then takes it
        // (a failed load leaves the slot empty for the next try). A poisoned lock only
        // means another loader panicked; the slot is still consistent.
        let _one = set.loading[p as usize]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(l) = slot.get() {
            return Ok(l);
        }
        let l = load(
            set.store.as_ref(),
            &set.cell_counts,
            m,
            &self.globals,
            p,
            &self.root,
        )?;
        set.index_bytes
            .fetch_add(m.parts[p as usize].size, Ordering::Relaxed);
        let _ = slot.set(l);
        slot.get()
            .ok_or_else(|| Error::InvalidArgument(format!("part {p} did not load")))
    }
}

/// Read, check and open part `p` of root `m` (format-spec/global.md §Reading a region,
/// step 3 and 4).
fn load<S: ShardSource>(
    store: &dyn PartStore<S>,
    cell_counts: &[OnceLock<HashMap<u32, u64>>],
    m: &Manifest,
    globals: &HashMap<String, usize>,
    p: u32,
    root: &Path,
) -> Result<Loaded<S>> {
    let r = &m.parts[p as usize];
    let what = store.describe(&r.file);
    let bytes = match store.read_index(&r.file, r.size) {
        Ok(b) => b,
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Err(damaged(what, "the part index is missing".into()))
        }
        Err(Error::NotFound { .. }) => {
            return Err(damaged(what, "the part index is missing".into()))
        }
        // Over the read cap (the recorded size + 1): longer than the root records.
        Err(Error::InvalidManifest { reason, .. }) => {
            return Err(damaged(
                what,
                format!("{reason} (the root records {} bytes)", r.size),
            ))
        }
        Err(e) => return Err(e),
    };
    if bytes.len() as u64 != r.size {
        return Err(damaged(
            what,
            format!(
                "the file is {} bytes, the root records {} (truncated or replaced)",
                bytes.len(),
                r.size
            ),
        ));
    }
    let got = crc32fast::hash(&bytes);
    if got != r.crc32 {
        return Err(damaged(
            what,
            format!(
                "CRC32 mismatch: the root records {:08x}, the bytes have {got:08x} (a damaged or replaced index)",
                r.crc32
            ),
        ));
    }
    let part = decode_part(&bytes, &what)?;
    let bad = |reason: String| damaged(what.clone(), reason);
    if part.checkpoint_id != m.checkpoint_id || part.file_name() != r.file {
        return Err(bad(format!(
            "it is rank {}'s part of checkpoint {}, not {:?} of checkpoint {}",
            part.rank, part.checkpoint_id, r.file, m.checkpoint_id
        )));
    }
    // The sub-checkpoint: the part's shards that hold chunks (the root lists the others),
    // with exactly their tensors.
    let chunk_of: HashMap<&str, usize> = part
        .chunks
        .iter()
        .enumerate()
        .map(|(i, c)| (c.tensor.as_str(), i))
        .collect();
    let mut holds = vec![(false, false); part.shards.len()]; // (chunks, whole tensors)
    for t in &part.tensors {
        let h = &mut holds[t.shard]; // indexes checked by decode_part
        if chunk_of.contains_key(t.name.as_str()) {
            h.0 = true;
        } else {
            h.1 = true;
        }
    }
    if let Some(k) = holds.iter().position(|&(c, w)| c && w) {
        return Err(bad(format!(
            "shard {} holds both chunks and whole tensors",
            part.shards[k].file
        )));
    }
    let mut remap = vec![usize::MAX; part.shards.len()];
    let mut shards = Vec::new();
    for (k, s) in part.shards.iter().enumerate() {
        if holds[k].0 {
            remap[k] = shards.len();
            shards.push(s.clone());
        }
    }
    let mut tensors = Vec::with_capacity(part.chunks.len());
    let mut tensor_of_chunk = vec![usize::MAX; part.chunks.len()];
    for t in &part.tensors {
        if let Some(&c) = chunk_of.get(t.name.as_str()) {
            tensor_of_chunk[c] = tensors.len();
            let mut t: TensorInfo = t.clone();
            t.shard = remap[t.shard];
            tensors.push(t);
        }
    }
    let sub = Manifest {
        format: m.format.clone(),
        version: m.version,
        features: Vec::new(),
        checkpoint_id: m.checkpoint_id.clone(),
        shards,
        tensors,
        metadata: serde_json::Value::Object(Default::default()),
        optimizer: None,
        globals: Vec::new(),
        parts: Vec::new(),
        grids: Vec::new(),
    };
    let by_name: NameIndex = crate::format::manifest::validate_flat(&sub)
        .map_err(|e| bad(format!("its tensors: {e}")))?;
    // Step 4: every chunk against the root's grid.
    let mut chunks: HashMap<u32, Vec<(Region, usize)>> = HashMap::new();
    let mut replicas: HashMap<u32, Vec<(Region, usize)>> = HashMap::new();
    for (ci, c) in part.chunks.iter().enumerate() {
        let cerr = |r: String| bad(format!("chunk {:?} of {:?}: {r}", c.tensor, c.global));
        let gi = *globals
            .get(&c.global)
            .ok_or_else(|| cerr("the root lists no such global tensor".into()))?;
        let g = &m.globals[gi];
        if g.dtype != c.dtype || g.global_shape != c.global_shape {
            return Err(cerr(format!(
                "declared {} {:?}, the root says {} {:?}",
                c.dtype, c.global_shape, g.dtype, g.global_shape
            )));
        }
        let grid = g
            .grid
            .and_then(|k| m.grids.get(k as usize))
            .ok_or_else(|| cerr("the global has no grid".into()))?;
        // The chunk's edges are split points.
        for (d, s) in grid.splits.iter().enumerate() {
            let (o, n) = (c.offsets[d], c.shape[d]);
            let end = o.checked_add(n);
            if n == 0
                || s.binary_search(&o).is_err()
                || end.is_none_or(|e| s.binary_search(&e).is_err())
            {
                return Err(cerr(format!(
                    "its box (offsets {:?}, shape {:?}) does not lie on the root's grid",
                    c.offsets, c.shape
                )));
            }
        }
        let ranges = cell_ranges(grid, &c.offsets, &c.shape)
            .ok_or_else(|| cerr("its box does not fit the grid".into()))?;
        let (mut mine, mut others) = (0u64, 0u64);
        for_each_cell(&dims(grid), &ranges, |cell| {
            if grid.cells.get(cell) == Some(&p) {
                mine += 1;
            } else {
                others += 1;
            }
        });
        match (mine, others) {
            (_, 0) => {
                let gi = gi as u32;
                chunks
                    .entry(gi)
                    .or_default()
                    .push((Region::new(&c.offsets, &c.shape), tensor_of_chunk[ci]));
            }
            // A replica of a chunk another part holds.
            (0, _) => replicas
                .entry(gi as u32)
                .or_default()
                .push((Region::new(&c.offsets, &c.shape), tensor_of_chunk[ci])),
            _ => {
                return Err(cerr(
                    "the root assigns some of its cells to this part and some to another".into(),
                ))
            }
        }
    }
    // Every cell the root assigns to this part is covered by exactly one of its chunks:
    // counted against each grid's per-part cell counts (computed once per grid), so a load
    // costs the part's own chunks plus one look per global, not the whole grid.
    let counts = |k: u32| -> u64 {
        let Some(slot) = cell_counts.get(k as usize) else {
            return 0;
        };
        let c = slot.get_or_init(|| {
            let mut c: HashMap<u32, u64> = HashMap::new();
            if let Some(g) = m.grids.get(k as usize) {
                for &q in &g.cells {
                    *c.entry(q).or_default() += 1;
                }
            }
            c
        });
        c.get(&p).copied().unwrap_or(0)
    };
    for (gi, g) in m.globals.iter().enumerate() {
        let Some(k) = g.grid else {
            continue;
        };
        let Some(grid) = m.grids.get(k as usize) else {
            continue;
        };
        let assigned = counts(k);
        let list = chunks.get(&(gi as u32));
        if assigned == 0 && list.is_none() {
            continue;
        }
        let dims = dims(grid);
        let mut cover: std::collections::HashSet<usize> = std::collections::HashSet::new();
        let mut twice = false;
        for (reg, _) in list.into_iter().flatten() {
            if let Some(ranges) = cell_ranges(grid, &reg.offsets, &reg.shape) {
                for_each_cell(&dims, &ranges, |c| twice |= !cover.insert(c));
            }
        }
        let covered = cover.len() as u64;
        if twice || covered != assigned {
            return Err(bad(format!(
                "global tensor {:?}: its chunks cover {covered} of the {assigned} cells the root assigns to this part{}",
                g.name,
                if twice { ", some twice" } else { "" }
            )));
        }
    }
    let opened = store.open_shards(&sub.shards)?;
    let ck = Checkpoint::build_native(root.to_path_buf(), sub, by_name, opened)?;
    Ok(Loaded {
        ck,
        chunks,
        replicas,
    })
}

/// The opener of local shard files a [`LocalParts`] uses.
pub(crate) fn local<S: ShardSource + Send + 'static>(
    root: &Path,
    open_shard: fn(File, &Path, u64) -> Result<S>,
) -> Box<dyn PartStore<S>> {
    Box::new(LocalParts {
        root: root.to_path_buf(),
        open_shard,
    })
}

/// A checkpoint directory's files held in memory, by name.
struct MemParts(std::sync::Arc<HashMap<String, Vec<u8>>>);

impl PartStore<Vec<u8>> for MemParts {
    fn read_index(&self, file: &str, size: u64) -> Result<Vec<u8>> {
        match self.0.get(file) {
            Some(b) if b.len() as u64 > size.saturating_add(1) => Err(Error::manifest(
                file.to_string(),
                format!("larger than the {}-byte cap", size.saturating_add(1)),
            )),
            Some(b) => Ok(b.clone()),
            None => Err(Error::NotFound {
                path: PathBuf::from(file),
                reason: "no such file".into(),
            }),
        }
    }
    fn open_shards(&self, shards: &[ShardEntry]) -> Result<Vec<Shard<Vec<u8>>>> {
        shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let bytes = self
                    .0
                    .get(&s.file)
                    .cloned()
                    .ok_or_else(|| Error::ShardMismatch {
                        shard: i,
                        file: s.file.clone(),
                        reason: super::SHARD_MISSING.into(),
                    })?;
                Ok(Shard {
                    file: s.file.clone(),
                    bytes,
                })
            })
            .collect()
    }
    fn describe(&self, file: &str) -> String {
        file.to_string()
    }
}

impl Checkpoint<Vec<u8>> {
    /// A ckptstore checkpoint from the files of its directory held in memory, by file name:
    /// the manifest (`ckpt-manifest.json`), its shards and, for a two-level manifest, its
    /// part indexes and their shards (read on first use, as from a directory). For tests,
    /// tools and fuzzing; performs every check [`Checkpoint::open`] does.
    ///
    /// # Errors
    /// [`Error::NotFound`] without a manifest; otherwise as [`Checkpoint::open`], files
    /// named by their names.
    pub fn from_files(files: HashMap<String, Vec<u8>>) -> Result<Self> {
        use crate::format::manifest::MANIFEST_FILE;
        let files = std::sync::Arc::new(files);
        let bytes = files.get(MANIFEST_FILE).ok_or_else(|| Error::NotFound {
            path: PathBuf::from(MANIFEST_FILE),
            reason: "no manifest among the files".into(),
        })?;
        let (m, _) = super::decode_manifest(bytes, MANIFEST_FILE)?;
        let store = MemParts(files.clone());
        let shards = store
            .open_shards(&m.shards)?
            .into_iter()
            .map(|s| s.bytes)
            .collect();
        let mut ck = Checkpoint::from_manifest_bytes(bytes, shards)?;
        if !m.parts.is_empty() {
            ck.parts = Some(PartSet::new(Box::new(store), &m));
        }
        Ok(ck)
    }
}
