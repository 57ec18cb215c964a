//! The commit of a two-level manifest (feature `parts`, format-spec/global.md §The
//! two-level manifest, rules C3'-C4'): the root keeps the whole tensors, the global tensor
//! table and one shared chunk grid per distinct chunking; the chunk entries stay in the part
//! descriptors, which the root names with their size and CRC32 and which the commit keeps.

use std::collections::{HashMap, HashSet};

use super::Store;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::global::GlobalEntry;
use crate::format::grid::{build_grid, Grid, GridError, PartRef, FEATURE};
use crate::format::manifest::{self, Manifest, TensorInfo};
use crate::format::part::Part;

/// Chunks (over all parts) from which [`super::parts::Layout::Auto`] commits a two-level
/// manifest: below it the flat manifest is smaller in all and as fast to open
/// (BENCHMARKS.md §Manifest at scale).
pub const AUTO_TWO_LEVEL_CHUNKS: usize = 100_000;

/// One global tensor being gathered: its declaration, the rank that first declared it, the
/// boxes of its distinct chunks with the part holding each, and per chunk box the rank and
/// CRC32 of its first copy (replicas must match it).
struct Gathered<'p> {
    dtype: DType,
    shape: &'p [u64],
    first: u32,
    boxes: Vec<(&'p [u64], &'p [u64], u32)>,
    copies: HashMap<ChunkBox<'p>, (u32, Option<u32>)>,
}

/// A chunk box: offsets and shape.
type ChunkBox<'p> = (&'p [u64], &'p [u64]);

/// C1'-C4' on parts sorted by rank (C1 and C2 already passed): the root manifest.
pub(crate) fn root<S: Store>(
    store: &S,
    id: &str,
    sorted: &[&Part],
    metadata: &serde_json::Value,
) -> Result<Manifest> {
    let mut shards = Vec::new();
    let mut tensors: Vec<TensorInfo> = Vec::new();
    let mut wholes: HashMap<&str, u32> = HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    let mut gathered: HashMap<&str, Gathered<'_>> = HashMap::new();
    let mut parts = Vec::with_capacity(sorted.len());
    for (pi, p) in sorted.iter().enumerate() {
        let pi =
            u32::try_from(pi).map_err(|_| Error::InvalidArgument("more than 2^32 parts".into()))?;
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
        let chunk_names: HashSet<&str> = p.chunks.iter().map(|c| c.tensor.as_str()).collect();
        let by_name: HashMap<&str, &TensorInfo> =
            p.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        // The root lists the shards of whole tensors; they must hold no chunk.
        let mut in_root: Vec<Option<usize>> = vec![None; p.shards.len()];
        for t in p
            .tensors
            .iter()
            .filter(|t| !chunk_names.contains(t.name.as_str()))
        {
            if let Some(&other) = wholes.get(t.name.as_str()) {
                return Err(Error::PartConflict {
                    name: t.name.clone(),
                    ranks: [other, p.rank],
                    reason: "both ranks offer this whole tensor; to replicate a tensor, offer it from each rank as one chunk covering the whole tensor".into(),
                });
            }
            wholes.insert(&t.name, p.rank);
            // Shard indexes were checked with the part (C1).
            let si = match in_root[t.shard] {
                Some(i) => i,
                None => {
                    shards.push(p.shards[t.shard].clone());
                    in_root[t.shard] = Some(shards.len() - 1);
                    shards.len() - 1
                }
            };
            let mut t = t.clone();
            t.shard = si;
            tensors.push(t);
        }
        for c in &p.chunks {
            // Every chunk's tensor is in its part (C1).
            let Some(t) = by_name.get(c.tensor.as_str()) else {
                continue;
            };
            if in_root[t.shard].is_some() {
                return Err(Error::InvalidPart {
                    part: store.describe(&p.file_name()),
                    reason: format!(
                        "shard {} holds both whole tensors and chunks (written by an older version?): commit it with Layout::Flat",
                        p.shards[t.shard].file
                    ),
                });
            }
            let g = match gathered.get_mut(c.global.as_str()) {
                Some(g) => {
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
                    g
                }
                None => {
                    order.push(&c.global);
                    gathered.entry(&c.global).or_insert(Gathered {
                        dtype: c.dtype,
                        shape: &c.global_shape,
                        first: p.rank,
                        boxes: Vec::new(),
                        copies: HashMap::new(),
                    })
                }
            };
            // C4': a chunk already offered by a lower rank is a replica of it.
            match g.copies.get(&(c.offsets.as_slice(), c.shape.as_slice())) {
                Some(&(r, crc)) => {
                    if crc != t.crc32 {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [r, p.rank],
                            reason: format!(
                                "both ranks store the chunk at offsets {:?} (shape {:?}) with different bytes (CRC32 {} and {})",
                                c.offsets,
                                c.shape,
                                hex(crc),
                                hex(t.crc32)
                            ),
                        });
                    }
                }
                None => {
                    g.copies.insert((&c.offsets, &c.shape), (p.rank, t.crc32));
                    g.boxes.push((&c.offsets, &c.shape, pi));
                }
            }
        }
    }
    if let Some(w) = order.iter().find(|g| wholes.contains_key(**g)) {
        let g = &gathered[w];
        return Err(Error::PartConflict {
            name: w.to_string(),
            ranks: [wholes[w], g.first],
            reason: "one rank offers it as a whole tensor, another as chunks of a global tensor"
                .into(),
        });
    }
    // C3': one grid per global, identical grids shared.
    let mut grids: Vec<Grid> = Vec::new();
    let mut grid_ix: HashMap<Grid, u32> = HashMap::new();
    let mut globals = Vec::with_capacity(order.len());
    let not_written = || {
        format!(
            "{} (the root of checkpoint {id}; not written)",
            store.location().join(manifest::MANIFEST_FILE).display()
        )
    };
    for name in order {
        let g = &gathered[name];
        let grid = build_grid(g.shape, &g.boxes).map_err(|e| match e {
            GridError::Overlap(a, b) => Error::PartConflict {
                name: name.to_string(),
                ranks: [rank_of(sorted, b), rank_of(sorted, a)],
                reason: "the ranks' chunks overlap".into(),
            },
            GridError::Gap(at) => Error::InvalidManifest {
                file: not_written(),
                reason: format!(
                    "global tensor {name:?}: no rank's chunk covers offsets {at:?} (a gap)"
                ),
            },
            GridError::TooManyCells => Error::InvalidManifest {
                file: not_written(),
                reason: format!(
                    "global tensor {name:?}: its chunks' edges draw more than {} grid cells (too irregular for a two-level manifest; commit it with Layout::Flat)",
                    crate::format::grid::MAX_GRID_CELLS
                ),
            },
        })?;
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
