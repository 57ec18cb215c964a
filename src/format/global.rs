//! Global tensors (format-spec/global.md): a tensor too large for one rank, stored as chunks
//! that tile its index space, each chunk an ordinary stored tensor of the manifest.
//!
//! This module holds the manifest's `globals` entries and their rules G1-G7; reading regions
//! is in `checkpoint`, writing parts and committing them in `write::parts`.

use std::collections::HashMap;

use super::schema::TensorInfo;
pub use super::schema::{ChunkEntry, GlobalEntry};
use super::{check_tensor_name, MAX_RANK};
use crate::dtype::{checked_nbytes, checked_numel};

/// Most chunks one global tensor may have (format-spec/global.md §Limits).
pub const MAX_CHUNKS: usize = 1 << 20;

/// Largest number of grid cells the tiling check marks for one global tensor: chunkings
/// that are not close to a grid fall back to pairwise checks, below.
const MAX_CELLS: u128 = 1 << 24;

/// Chunk counts up to which a non-grid chunking is checked pair by pair.
const MAX_PAIRWISE: usize = 4096;

/// Check `globals` against rules G1-G7 of format-spec/global.md. `index(name)` finds a
/// tensor of `tensors` by name.
///
/// # Errors
/// The first rule broken, as a sentence naming the global tensor (and chunk).
#[cfg(test)]
pub(crate) fn validate(
    globals: &[GlobalEntry],
    tensors: &[TensorInfo],
    index: impl Fn(&str) -> Option<usize>,
) -> Result<(), String> {
    validate_with(globals, tensors, index, true)
}

/// [`validate`]; with `tiled` false (a two-level manifest, whose globals list no chunks:
/// `format::grid`), G1-G2 only.
pub(crate) fn validate_with(
    globals: &[GlobalEntry],
    tensors: &[TensorInfo],
    index: impl Fn(&str) -> Option<usize>,
    tiled: bool,
) -> Result<(), String> {
    let mut names: HashMap<&str, ()> = HashMap::with_capacity(globals.len());
    // Every manifest tensor is a chunk (or replica) of at most one global (G5).
    let mut used = vec![false; tensors.len()];
    for g in globals {
        let err = |r: String| format!("global tensor {:?}: {r}", g.name);
        // G1
        check_tensor_name(&g.name).map_err(&err)?;
        if names.insert(&g.name, ()).is_some() {
            return Err(err("listed twice in globals".into()));
        }
        if index(&g.name).is_some() {
            return Err(err("the name is also a tensor's name".into()));
        }
        // G2
        if g.global_shape.len() > MAX_RANK {
            return Err(err(format!(
                "rank {} exceeds the limit of {MAX_RANK}",
                g.global_shape.len()
            )));
        }
        let total = checked_nbytes(g.dtype, &g.global_shape)
            .and(g.numel())
            .ok_or_else(|| err(format!("global shape {:?} overflows", g.global_shape)))?;
        if g.chunks.len() > MAX_CHUNKS {
            return Err(err(format!(
                "{} chunks exceed the limit of {MAX_CHUNKS}",
                g.chunks.len()
            )));
        }
        let mut volume: u128 = 0;
        for (c, ch) in g.chunks.iter().enumerate() {
            let cerr = |r: String| err(format!("chunk {c} (offsets {:?}): {r}", ch.offsets));
            // G3
            if ch.offsets.len() != g.global_shape.len() || ch.shape.len() != g.global_shape.len() {
                return Err(cerr(format!(
                    "offsets and shape must have the global rank {}",
                    g.global_shape.len()
                )));
            }
            for (d, ((&o, &n), &full)) in ch
                .offsets
                .iter()
                .zip(&ch.shape)
                .zip(&g.global_shape)
                .enumerate()
            {
                if n == 0 {
                    return Err(cerr(format!(
                        "dimension {d} is empty (chunks hold elements)"
                    )));
                }
                if o.checked_add(n).is_none_or(|end| end > full) {
                    return Err(cerr(format!(
                        "dimension {d}: [{o}, {o}+{n}) is outside the global extent {full}"
                    )));
                }
            }
            let n = checked_numel(&ch.shape).ok_or_else(|| cerr("shape overflows".into()))?;
            volume += u128::from(n);
            // G4, G5
            let primary =
                chunk_tensor(tensors, &index, &ch.tensor, g, ch, &mut used).map_err(&cerr)?;
            for r in &ch.replicas {
                let rep = chunk_tensor(tensors, &index, r, g, ch, &mut used).map_err(&cerr)?;
                // G6
                if rep.crc32 != primary.crc32 {
                    let hex = |c: Option<u32>| c.map_or("none".into(), |c| format!("{c:08x}"));
                    return Err(cerr(format!(
                        "replica {r:?} has CRC32 {}, the chunk's tensor {:?} has {}: the copies differ",
                        hex(rep.crc32),
                        ch.tensor,
                        hex(primary.crc32)
                    )));
                }
            }
        }
        if !tiled {
            continue;
        }
        // G7: exact tiling. No chunk is empty or outside, so the chunks tile the global
        // tensor exactly if their volumes add up to its own and no two overlap.
        if volume != u128::from(total) {
            return Err(err(format!(
                "the chunks hold {volume} elements, the global shape {:?} {total}: {}",
                g.global_shape,
                if volume < u128::from(total) {
                    "a gap"
                } else {
                    "an overlap"
                }
            )));
        }
        check_no_overlap(g).map_err(&err)?;
    }
    Ok(())
}

/// The manifest tensor `name` of chunk `ch` of `g`, checked against the chunk (G4) and
/// marked used (G5).
fn chunk_tensor<'t>(
    tensors: &'t [TensorInfo],
    index: &impl Fn(&str) -> Option<usize>,
    name: &str,
    g: &GlobalEntry,
    ch: &ChunkEntry,
    used: &mut [bool],
) -> Result<&'t TensorInfo, String> {
    let i = index(name)
        .ok_or_else(|| format!("names tensor {name:?}, which the manifest does not list"))?;
    let t = &tensors[i];
    if t.dtype != g.dtype || t.shape != ch.shape {
        return Err(format!(
            "tensor {name:?} is {} {:?}, the chunk needs {} {:?}",
            t.dtype, t.shape, g.dtype, ch.shape
        ));
    }
    if std::mem::replace(&mut used[i], true) {
        return Err(format!("tensor {name:?} is used by more than one chunk"));
    }
    Ok(t)
}

/// No two chunks of `g` overlap (part of G7). Chunkings close to a grid (the usual case:
/// row, column and block splits, uneven or not) are checked by marking the cells of the
/// grid the chunks' edges draw; others pair by pair, up to [`MAX_PAIRWISE`] chunks.
fn check_no_overlap(g: &GlobalEntry) -> Result<(), String> {
    check_no_overlap_with(g, MAX_CELLS)
}

/// [`check_no_overlap`] with the grid's cell limit as a parameter (tests force the pairwise
/// path with 0).
fn check_no_overlap_with(g: &GlobalEntry, max_cells: u128) -> Result<(), String> {
    let rank = g.global_shape.len();
    let n = g.chunks.len();
    if n <= 1 {
        return Ok(());
    }
    // The edges along each dimension, sorted and distinct.
    let edges: Vec<Vec<u64>> = (0..rank)
        .map(|d| {
            let mut e: Vec<u64> = g
                .chunks
                .iter()
                .flat_map(|c| [c.offsets[d], c.offsets[d] + c.shape[d]])
                .collect();
            e.sort_unstable();
            e.dedup();
            e
        })
        .collect();
    let cells = edges
        .iter()
        .try_fold(1u128, |a, e| a.checked_mul(e.len() as u128 - 1))
        .unwrap_or(u128::MAX);
    let overlap = |a: usize, b: usize| {
        format!(
            "chunks {a} (offsets {:?}) and {b} (offsets {:?}) overlap",
            g.chunks[a].offsets, g.chunks[b].offsets
        )
    };
    if cells <= max_cells {
        // Strides of the cell grid, row-major.
        let mut strides = vec![1usize; rank];
        for d in (0..rank.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * (edges[d + 1].len() - 1);
        }
        let mut owner = vec![u32::MAX; cells as usize];
        for (c, ch) in g.chunks.iter().enumerate() {
            // The chunk's cell range along each dimension.
            let ranges: Vec<(usize, usize)> = (0..rank)
                .map(|d| {
                    let lo = edges[d].partition_point(|&e| e < ch.offsets[d]);
                    let hi = edges[d].partition_point(|&e| e < ch.offsets[d] + ch.shape[d]);
                    (lo, hi)
                })
                .collect();
            let mut idx: Vec<usize> = ranges.iter().map(|r| r.0).collect();
            'cells: loop {
                let cell: usize = idx.iter().zip(&strides).map(|(i, s)| i * s).sum();
                if owner[cell] != u32::MAX {
                    return Err(overlap(owner[cell] as usize, c));
                }
                owner[cell] = c as u32;
                // The chunk's next cell, last dimension fastest.
                let mut d = rank;
                loop {
                    if d == 0 {
                        break 'cells;
                    }
                    d -= 1;
                    idx[d] += 1;
                    if idx[d] < ranges[d].1 {
                        break;
                    }
                    idx[d] = ranges[d].0;
                }
            }
        }
        return Ok(());
    }
    if n > MAX_PAIRWISE {
        return Err(format!(
            "{n} chunks that do not form a grid of at most {MAX_CELLS} cells: too irregular to check"
        ));
    }
    for a in 0..n {
        for b in a + 1..n {
            let (x, y) = (&g.chunks[a], &g.chunks[b]);
            let disjoint = (0..rank).any(|d| {
                x.offsets[d] + x.shape[d] <= y.offsets[d]
                    || y.offsets[d] + y.shape[d] <= x.offsets[d]
            });
            if !disjoint {
                return Err(overlap(a, b));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    /// A global shape and its chunks as (offsets, shape).
    type Layout<'a> = (&'a [u64], Vec<(&'a [u64], &'a [u64])>);
    /// A layout and what to expect of it.
    type Case<'a, T> = (&'a [u64], Vec<(&'a [u64], &'a [u64])>, T);

    fn entry(shape: &[u64], chunks: &[(&[u64], &[u64])]) -> (GlobalEntry, Vec<TensorInfo>) {
        let mut tensors = Vec::new();
        let mut g = GlobalEntry {
            name: "g".into(),
            dtype: DType::F32,
            global_shape: shape.to_vec(),
            chunks: Vec::new(),
            grid: None,
        };
        let mut off = 0;
        for (i, (o, s)) in chunks.iter().enumerate() {
            let nb = checked_nbytes(DType::F32, s).unwrap();
            tensors.push(TensorInfo {
                name: format!("c{i}"),
                shard: 0,
                dtype: DType::F32,
                shape: s.to_vec(),
                offsets: [off, off + nb],
                crc32: Some(0),
                absmax: None,
                blocks: None,
            });
            off += nb;
            g.chunks.push(ChunkEntry {
                offsets: o.to_vec(),
                shape: s.to_vec(),
                tensor: format!("c{i}"),
                replicas: vec![],
            });
        }
        (g, tensors)
    }

    fn check(g: &GlobalEntry, t: &[TensorInfo]) -> Result<(), String> {
        validate(std::slice::from_ref(g), t, |n| {
            t.iter().position(|x| x.name == n)
        })
    }

    #[test]
    fn tilings_accepted() {
        let ok: Vec<Layout<'_>> = vec![
            (&[], vec![(&[], &[])]),
            (&[1], vec![(&[0], &[1])]),
            (&[10], vec![(&[0], &[3]), (&[3], &[7])]),
            (&[4, 6], vec![(&[0, 0], &[4, 2]), (&[0, 2], &[4, 4])]),
            (
                &[5, 5],
                vec![
                    (&[0, 0], &[2, 3]),
                    (&[0, 3], &[2, 2]),
                    (&[2, 0], &[3, 1]),
                    (&[2, 1], &[3, 4]),
                ],
            ),
        ];
        for (shape, chunks) in ok {
            let (g, t) = entry(shape, &chunks);
            check(&g, &t).unwrap();
        }
    }

    #[test]
    fn defects_refused() {
        let bad: Vec<Case<'_, &str>> = vec![
            (&[10], vec![(&[0], &[3]), (&[4], &[6])], "a gap"),
            (&[10], vec![(&[0], &[4]), (&[3], &[6])], "overlap"),
            (&[10], vec![(&[0], &[4]), (&[4], &[7])], "outside"),
            (
                &[4, 4],
                vec![
                    (&[0, 0], &[2, 4]),
                    (&[1, 0], &[2, 4]),
                    (&[3, 0], &[1, 4]),
                    (&[0, 0], &[0, 4]),
                ],
                "empty",
            ),
            // Same volume, overlap and gap together.
            (
                &[4, 4],
                vec![
                    (&[0, 0], &[2, 2]),
                    (&[1, 1], &[2, 2]),
                    (&[0, 2], &[2, 2]),
                    (&[2, 0], &[2, 2]),
                ],
                "overlap",
            ),
            (&[4], vec![(&[0, 0], &[4, 1])], "global rank"),
        ];
        for (shape, chunks, want) in bad {
            let (g, t) = entry(shape, &chunks);
            let e = check(&g, &t).unwrap_err();
            assert!(e.contains(want), "{chunks:?}: {want:?} not in {e}");
        }
    }

    #[test]
    fn pairwise_path_agrees_with_the_grid() {
        let cases: Vec<Case<'_, bool>> = vec![
            (
                &[5, 5],
                vec![
                    (&[0, 0], &[2, 3]),
                    (&[0, 3], &[2, 2]),
                    (&[2, 0], &[3, 1]),
                    (&[2, 1], &[3, 4]),
                ],
                true,
            ),
            (
                &[4, 4],
                vec![
                    (&[0, 0], &[2, 2]),
                    (&[1, 1], &[2, 2]),
                    (&[0, 2], &[2, 2]),
                    (&[2, 0], &[2, 2]),
                ],
                false,
            ),
        ];
        for (shape, chunks, ok) in cases {
            let (g, _) = entry(shape, &chunks);
            assert_eq!(check_no_overlap_with(&g, 0).is_ok(), ok, "{chunks:?}");
            assert_eq!(
                check_no_overlap_with(&g, MAX_CELLS).is_ok(),
                ok,
                "{chunks:?}"
            );
        }
    }

    #[test]
    fn staircase_chunkings() {
        // A staircase: edges everywhere, few chunks per cell row.
        let n = 300u64;
        let chunks: Vec<(Vec<u64>, Vec<u64>)> = (0..n)
            .flat_map(|i| {
                [
                    (vec![i, 0], vec![1, i + 1]),
                    (vec![i, i + 1], vec![1, n - i]),
                ]
            })
            .collect();
        let refs: Vec<(&[u64], &[u64])> = chunks.iter().map(|(o, s)| (&o[..], &s[..])).collect();
        let (g, t) = entry(&[n, n + 1], &refs);
        check(&g, &t).unwrap();
    }
}
