//! The commit of a two-level manifest (feature `parts`, format-spec/global.md §The
//! two-level manifest, rules C3'-C4'): the root keeps the whole tensors, the global tensor
//! table and one shared chunk grid per distinct chunking; the chunk entries stay in the part
//! descriptors, which the root names with their size and CRC32 and which the commit keeps.

use std::collections::HashMap;

use super::Store;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::global::GlobalEntry;
use crate::format::grid::{build_grid, Grid, GridBox, GridError, PartRef, FEATURE};
use crate::format::manifest::{self, Manifest, TensorInfo};
use crate::format::part::{Part, PartChunk};

use rayon::prelude::*;

/// Chunks (over all parts) from which [`super::parts::Layout::Auto`] commits a two-level
/// manifest: below it the flat manifest is smaller in all, one file for the readers that see
/// everything (1.5-2x faster for them) and under 0.4 s and 28 MB of decode for each rank;
/// the two-level one opens faster for one rank at every size (BENCHMARKS.md §Current
/// figures, the rows "two-level vs flat").
pub const AUTO_TWO_LEVEL_CHUNKS: usize = 100_000;

/// One global tensor being gathered: its name and declaration, the rank that first declared
/// it, and every chunk box offered for it: the chunk, the part holding it and the CRC32 of
/// the chunk's tensor (replicas of a box are grouped after the gather, [`distinct_boxes`]).
/// An offer is 24 bytes, and there is one per chunk of every part: 10,240,000 of them at
/// 1,024 ranks x 10,000 tensors.
struct Gathered<'p> {
    name: &'p str,
    dtype: DType,
    shape: &'p [u64],
    first: u32,
    boxes: Vec<Offered<'p>>,
}

/// A distinct chunk box for [`build_grid`]: the chunk and its part's index.
#[derive(Clone, Copy)]
struct Distinct<'p>(&'p PartChunk, u32);

impl GridBox for Distinct<'_> {
    fn offsets(&self) -> &[u64] {
        &self.0.offsets
    }
    fn shape(&self) -> &[u64] {
        &self.0.shape
    }
    fn part(&self) -> u32 {
        self.1
    }
}

/// A chunk box as a part offered it: the chunk, its part's index, the CRC32 of its tensor.
type Offered<'p> = (&'p PartChunk, u32, Option<u32>);

/// An offer's box, the key that groups replicas.
fn box_of<'p>(o: &Offered<'p>) -> (&'p [u64], &'p [u64]) {
    (&o.0.offsets, &o.0.shape)
}

/// One part's chunks and whole tensors, resolved against its tensor table (part by part, in
/// parallel): per chunk (in the part's order) the CRC32 of its tensor; the first shard that
/// would hold both whole tensors and chunks, if any.
struct Resolved<'p> {
    crcs: Vec<Option<u32>>,
    wholes: Vec<&'p TensorInfo>,
    mixed: Option<usize>,
}

fn resolve(p: &Part) -> Resolved<'_> {
    // Every chunk's tensor is in its part, and tensor names are unique (C1).
    let positions = p.chunk_positions(None);
    let mut is_chunk = vec![false; p.tensors.len()];
    for &i in positions.iter().flatten() {
        if let Some(c) = is_chunk.get_mut(i) {
            *c = true;
        }
    }
    let wholes: Vec<&TensorInfo> = p
        .tensors
        .iter()
        .zip(&is_chunk)
        .filter(|(_, &c)| !c)
        .map(|(t, _)| t)
        .collect();
    let mut whole_shard = vec![false; p.shards.len()];
    for t in &wholes {
        // Shard indexes were checked with the part (C1).
        if let Some(w) = whole_shard.get_mut(t.shard) {
            *w = true;
        }
    }
    let mut mixed = None;
    let crcs = positions
        .into_iter()
        .map(|i| {
            let t = p.tensors.get(i?)?;
            if mixed.is_none() && whole_shard.get(t.shard).copied().unwrap_or(false) {
                mixed = Some(t.shard);
            }
            t.crc32
        })
        .collect();
    Resolved {
        crcs,
        wholes,
        mixed,
    }
}

/// C4' for one global: its distinct chunk boxes (offsets, shape, part), the first offer of
/// each (the lowest rank's) kept; every other offer of a box is a replica and must carry the
/// same CRC32. The boxes come back in part order.
fn distinct_boxes<'p>(g: &mut Gathered<'p>, sorted: &[&Part]) -> Result<Vec<Distinct<'p>>> {
    // Stable: offers of one box stay in part (rank) order. Ranks usually offer boxes in
    // their order, so this is one linear pass over sorted input.
    g.boxes.sort_by(|a, b| box_of(a).cmp(&box_of(b)));
    let mut out: Vec<Distinct<'p>> = Vec::with_capacity(g.boxes.len());
    let mut first: Option<&Offered<'p>> = None;
    for b in &g.boxes {
        match first {
            Some(f) if box_of(f) == box_of(b) => {
                if f.2 != b.2 {
                    return Err(Error::PartConflict {
                        name: g.name.to_string(),
                        ranks: [rank_of(sorted, f.1), rank_of(sorted, b.1)],
                        reason: format!(
                            "both ranks store the chunk at offsets {:?} (shape {:?}) with different bytes (CRC32 {} and {})",
                            b.0.offsets,
                            b.0.shape,
                            hex(f.2),
                            hex(b.2)
                        ),
                    });
                }
            }
            _ => {
                first = Some(b);
                out.push(Distinct(b.0, b.1));
            }
        }
    }
    out.sort_by_key(|b| b.1);
    Ok(out)
}

/// C1'-C4' on parts sorted by rank (C1 and C2 already passed): the root manifest.
///
/// The parts are resolved in parallel, gathered per global in one sequential pass (no hash
/// of a chunk box), and each global's replicas and grid are checked in parallel; an error
/// found is the first in global order.
pub(crate) fn root<S: Store + ?Sized>(
    store: &S,
    id: &str,
    sorted: &[&Part],
    metadata: &serde_json::Value,
) -> Result<Manifest> {
    let mut shards = Vec::new();
    let mut tensors: Vec<TensorInfo> = Vec::new();
    let mut wholes: HashMap<&str, u32> = HashMap::new();
    let mut gathered: Vec<Gathered<'_>> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut parts = Vec::with_capacity(sorted.len());
    let resolved: Vec<Resolved<'_>> = sorted.par_iter().map(|p| resolve(p)).collect();
    // Per part, the global of each of its chunks (the gather's first pass; ranks list their
    // chunks in one order, so the chunk at the previous part's same position is almost
    // always of the same global); per global, the number of boxes offered, so that the
    // second pass fills vectors of the exact size.
    let mut assigned: Vec<Vec<u32>> = Vec::with_capacity(sorted.len());
    let mut counts: Vec<usize> = Vec::new();
    if u32::try_from(sorted.len()).is_err() {
        return Err(Error::InvalidArgument("more than 2^32 parts".into()));
    }
    for (p, r) in sorted.iter().zip(&resolved) {
        let file = p.file_name();
        // C1': the descriptor the root names is the one on disk.
        let (size, crc32) = p.size_and_crc();
        let (len, _) = store
            .read_prefix(&file, 0)
            .map_err(|e| Error::InvalidPart {
                part: store.describe(&file),
                reason: format!("the descriptor cannot be read: {e}"),
            })?;
        if len != size {
            return Err(Error::InvalidPart {
                part: store.describe(&file),
                reason: format!("the file is {len} bytes, the descriptor given {size}"),
            });
        }
        parts.push(PartRef { file, size, crc32 });
        // The root lists the shards of whole tensors; they must hold no chunk.
        let mut in_root: Vec<Option<usize>> = vec![None; p.shards.len()];
        for t in &r.wholes {
            if let Some(&other) = wholes.get(t.name.as_str()) {
                return Err(Error::PartConflict {
                    name: t.name.clone(),
                    ranks: [other, p.rank],
                    reason: "both ranks offer this whole tensor; to replicate a tensor, offer it from each rank as one chunk covering the whole tensor".into(),
                });
            }
            wholes.insert(&t.name, p.rank);
            let si = match in_root[t.shard] {
                Some(i) => i,
                None => {
                    shards.push(p.shards[t.shard].clone());
                    in_root[t.shard] = Some(shards.len() - 1);
                    shards.len() - 1
                }
            };
            let mut t = (*t).clone();
            t.shard = si;
            tensors.push(t);
        }
        if let Some(shard) = r.mixed {
            return Err(Error::InvalidPart {
                part: store.describe(&p.file_name()),
                reason: format!(
                    "shard {} holds both whole tensors and chunks (written by an older version?): commit it with Layout::Flat",
                    p.shards[shard].file
                ),
            });
        }
        let mut current: Vec<u32> = Vec::with_capacity(p.chunks.len());
        let previous = assigned.last().map_or(&[][..], Vec::as_slice);
        for (j, c) in p.chunks.iter().enumerate() {
            let guess = previous
                .get(j)
                .map(|&gi| gi as usize)
                .filter(|&gi| gathered[gi].name == c.global);
            let gi = match guess.or_else(|| index.get(c.global.as_str()).copied()) {
                Some(gi) => {
                    let g = &gathered[gi];
                    if g.dtype != c.dtype || g.shape != c.global_shape.as_slice() {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [g.first, p.rank],
                            reason: format!(
                                "rank {} declares the global tensor {} {:?}, rank {} {} {:?}",
                                g.first, g.dtype, g.shape, p.rank, c.dtype, c.global_shape
                            ),
                        });
                    }
                    gi
                }
                None => {
                    gathered.push(Gathered {
                        name: &c.global,
                        dtype: c.dtype,
                        shape: &c.global_shape,
                        first: p.rank,
                        boxes: Vec::new(),
                    });
                    index.insert(&c.global, gathered.len() - 1);
                    gathered.len() - 1
                }
            };
            // The first pass keeps a global's index in 4 bytes; a commit of 2^32 globals or
            // more (far beyond any memory) is refused rather than wrapped.
            let gi32 = u32::try_from(gi)
                .map_err(|_| Error::InvalidArgument("more than 2^32 global tensors".into()))?;
            if gi == counts.len() {
                counts.push(0);
            }
            counts[gi] += 1;
            current.push(gi32);
        }
        assigned.push(current);
    }
    // The second pass: each offer into its global's vector, allocated once at its size.
    for (g, &n) in gathered.iter_mut().zip(&counts) {
        g.boxes.reserve_exact(n);
    }
    for (pi, ((p, r), gis)) in sorted.iter().zip(&resolved).zip(&assigned).enumerate() {
        // `pi` < `sorted.len()`, which fits a u32 (checked above).
        let pi = pi as u32;
        for ((c, &crc), &gi) in p.chunks.iter().zip(&r.crcs).zip(gis) {
            gathered[gi as usize].boxes.push((c, pi, crc));
        }
    }
    drop(assigned);
    drop(resolved);
    if let Some(g) = gathered.iter().find(|g| wholes.contains_key(g.name)) {
        return Err(Error::PartConflict {
            name: g.name.to_string(),
            ranks: [wholes[g.name], g.first],
            reason: "one rank offers it as a whole tensor, another as chunks of a global tensor"
                .into(),
        });
    }
    // C3': one grid per global, identical grids shared.
    let mut grids: Vec<Grid> = Vec::new();
    let mut grid_ix: HashMap<Grid, u32> = HashMap::new();
    let mut globals = Vec::with_capacity(gathered.len());
    let not_written = format!(
        "{} (the root of checkpoint {id}; not written)",
        store.location().join(manifest::MANIFEST_FILE).display()
    );
    let built: Vec<Result<Grid>> = gathered
        .par_iter_mut()
        .map(|g| {
            let boxes = distinct_boxes(g, sorted)?;
            let name = g.name;
            build_grid(g.shape, &boxes).map_err(|e| match e {
                GridError::Overlap(a, b) => Error::PartConflict {
                    name: name.to_string(),
                    ranks: [rank_of(sorted, b), rank_of(sorted, a)],
                    reason: "the ranks' chunks overlap".into(),
                },
                GridError::Gap(at) => Error::InvalidManifest {
                    file: not_written.clone(),
                    reason: format!(
                        "global tensor {name:?}: no rank's chunk covers offsets {at:?} (a gap)"
                    ),
                },
                GridError::TooManyCells => Error::InvalidManifest {
                    file: not_written.clone(),
                    reason: format!(
                        "global tensor {name:?}: its chunks' edges draw more than {} grid cells (too irregular for a two-level manifest; commit it with Layout::Flat)",
                        crate::format::grid::MAX_GRID_CELLS
                    ),
                },
            })
        })
        .collect();
    for (g, grid) in gathered.iter().zip(built) {
        let grid = grid?;
        let name = g.name;
        let next = grids.len() as u32;
        let k = *grid_ix.entry(grid).or_insert_with_key(|grid| {
            grids.push(grid.clone());
            next
        });
        globals.push(GlobalEntry {
            name: name.to_string(),
            dtype: g.dtype,
            global_shape: g.shape.to_vec(),
            chunks: Vec::new(),
            grid: Some(k),
        });
    }
    Ok(Manifest {
        format: manifest::FORMAT_NAME.into(),
        version: manifest::VERSION,
        features: vec!["global".into(), FEATURE.into()],
        checkpoint_id: id.to_string(),
        shards,
        tensors,
        metadata: metadata.clone(),
        optimizer: None,
        globals,
        parts,
        grids,
    })
}

fn rank_of(sorted: &[&Part], part: u32) -> u32 {
    sorted.get(part as usize).map_or(part, |p| p.rank)
}

fn hex(c: Option<u32>) -> String {
    c.map_or("none".into(), |c| format!("{c:08x}"))
}
