//! The two-level manifest (feature `parts`, format-spec/global.md §The two-level manifest):
//! the root names the part indexes (`parts`) and, per global tensor, a shared chunk grid
//! (`grids`) that says which part holds each cell; the chunk entries stay in the parts.
//!
//! This module holds the root's rules P1-P5, the commit's grid builder and the reader's
//! cell lookups. Loading parts is in `checkpoint`, writing the root in `write::parts`.

use std::collections::HashSet;

use super::manifest::check_file_name;
use super::schema::{GlobalEntry, Manifest};
pub use super::schema::{Grid, PartRef};
use super::MAX_RANK;

/// The feature a two-level manifest lists (beside `global`).
pub const FEATURE: &str = "parts";
/// Most part indexes one root may name.
pub const MAX_PARTS: usize = 1 << 20;
/// Most cells one grid may have (the commit refuses a chunking that would need more).
pub const MAX_GRID_CELLS: u64 = 1 << 24;

/// The number of cells of a grid with these split points, if it is at most
/// [`MAX_GRID_CELLS`]: the product of `splits[d].len() - 1` (1 for a 0-dim grid).
fn cell_count(splits: &[Vec<u64>]) -> Option<u64> {
    splits.iter().try_fold(1u64, |n, s| {
        n.checked_mul((s.len() as u64).checked_sub(1)?)
            .filter(|&n| n <= MAX_GRID_CELLS)
    })
}

/// Rules P1-P5 of a manifest (format-spec/global.md §Root rules); `m` has passed the
/// manifest rules (M*); the global rules run after these.
///
/// # Errors
/// The first rule broken, as a sentence.
pub(crate) fn validate(m: &Manifest) -> Result<(), String> {
    let has = m.features.iter().any(|f| f == FEATURE);
    if !has {
        // P1: nothing of the two-level form without the feature.
        if !m.parts.is_empty() || !m.grids.is_empty() {
            return Err(format!(
                "parts and grids need the {FEATURE:?} feature, which the manifest does not list"
            ));
        }
        if let Some(g) = m.globals.iter().find(|g| g.grid.is_some()) {
            return Err(format!(
                "global tensor {:?} names a grid without the {FEATURE:?} feature",
                g.name
            ));
        }
        return Ok(());
    }
    // P1
    if !m.features.iter().any(|f| f == "global") {
        return Err(format!(
            "the {FEATURE:?} feature needs the \"global\" feature"
        ));
    }
    // P2
    if m.parts.is_empty() || m.parts.len() > MAX_PARTS {
        return Err(format!(
            "{} parts: a two-level manifest names 1 to {MAX_PARTS}",
            m.parts.len()
        ));
    }
    let shard_files: HashSet<&str> = m.shards.iter().map(|s| s.file.as_str()).collect();
    let mut files = HashSet::with_capacity(m.parts.len());
    for (i, p) in m.parts.iter().enumerate() {
        check_file_name(&p.file).map_err(|e| format!("part {i}: {e}"))?;
        if !files.insert(p.file.as_str()) || shard_files.contains(p.file.as_str()) {
            return Err(format!("part {i}: file {:?} is listed twice", p.file));
        }
        if p.size > super::MAX_MANIFEST_SIZE {
            return Err(format!(
                "part {i} ({}): {} bytes exceed the {}-byte cap",
                p.file,
                p.size,
                super::MAX_MANIFEST_SIZE
            ));
        }
    }
    // P3
    for (k, g) in m.grids.iter().enumerate() {
        check_grid(g, m.parts.len()).map_err(|e| format!("grid {k}: {e}"))?;
    }
    // P4, P5
    for g in &m.globals {
        check_global(g, &m.grids).map_err(|e| format!("global tensor {:?}: {e}", g.name))?;
    }
    Ok(())
}

/// P3: split points strictly increasing from 0, at most [`MAX_GRID_CELLS`] cells, one
/// entry per cell, each naming one of `parts` parts.
fn check_grid(g: &Grid, parts: usize) -> Result<(), String> {
    if g.splits.len() > MAX_RANK {
        return Err(format!("rank {} exceeds {MAX_RANK}", g.splits.len()));
    }
    for (d, s) in g.splits.iter().enumerate() {
        if s.len() < 2 || s[0] != 0 || s.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!(
                "the split points of dimension {d} do not increase strictly from 0 (at least two)"
            ));
        }
    }
    let n = cell_count(&g.splits).ok_or_else(|| format!("more than {MAX_GRID_CELLS} cells"))?;
    if g.cells.len() as u64 != n {
        return Err(format!(
            "{} cells listed, the split points make {n}",
            g.cells.len()
        ));
    }
    if let Some(c) = g.cells.iter().position(|&p| p as usize >= parts) {
        return Err(format!(
            "cell {c} names part {}, but there are {parts} parts",
            g.cells[c]
        ));
    }
    Ok(())
}

/// P4: no chunks in the root; P5: a grid of the global's rank and extents, or no grid for a
/// global of zero elements.
fn check_global(g: &GlobalEntry, grids: &[Grid]) -> Result<(), String> {
    if !g.chunks.is_empty() {
        return Err("a two-level manifest keeps chunks in the parts, not the root".into());
    }
    let empty = g.numel() == Some(0);
    match (g.grid, empty) {
        (None, true) => Ok(()),
        (Some(_), true) => Err("a global of zero elements has no chunks and no grid".into()),
        (None, false) => Err("no grid".into()),
        (Some(k), false) => {
            let grid = grids
                .get(k as usize)
                .ok_or_else(|| format!("grid {k} does not exist ({} grids)", grids.len()))?;
            let ends: Vec<u64> = grid
                .splits
                .iter()
                .filter_map(|s| s.last().copied())
                .collect();
            if ends != g.global_shape {
                return Err(format!(
                    "grid {k} spans {ends:?}, the global shape is {:?}",
                    g.global_shape
                ));
            }
            Ok(())
        }
    }
}

/// Per dimension, the half-open range of cell indexes that the box `[offsets, offsets +
/// shape)` intersects; `None` if the box is empty or does not fit the grid's rank.
pub(crate) fn cell_ranges(
    grid: &Grid,
    offsets: &[u64],
    shape: &[u64],
) -> Option<Vec<(usize, usize)>> {
    if offsets.len() != grid.splits.len() || shape.len() != grid.splits.len() {
        return None;
    }
    grid.splits
        .iter()
        .zip(offsets.iter().zip(shape))
        .map(|(s, (&o, &n))| {
            let last = *s.last()?;
            let end = o.checked_add(n).filter(|&e| n > 0 && e <= last)?;
            // The cell holding `o`: the last split point <= o.
            let lo = s.partition_point(|&x| x <= o).checked_sub(1)?;
            // One past the cell holding `end - 1`.
            let hi = s.partition_point(|&x| x < end);
            Some((lo, hi))
        })
        .collect()
}

/// Visit the row-major index of every cell in `ranges` (per dimension, cell index ranges of
/// a grid whose dimensions have `dims` cells).
pub(crate) fn for_each_cell(dims: &[usize], ranges: &[(usize, usize)], mut f: impl FnMut(usize)) {
    if ranges.iter().any(|&(a, b)| a >= b) {
        return;
    }
    let mut at: Vec<usize> = ranges.iter().map(|r| r.0).collect();
    loop {
        let idx = at
            .iter()
            .zip(dims)
            .fold(0usize, |acc, (&i, &n)| acc * n + i);
        f(idx);
        // Odometer over the ranges, last dimension fastest.
        let mut d = at.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            at[d] += 1;
            if at[d] < ranges[d].1 {
                break;
            }
            at[d] = ranges[d].0;
        }
        if at.is_empty() {
            return;
        }
    }
}

/// The cell counts per dimension of `grid`.
pub(crate) fn dims(grid: &Grid) -> Vec<usize> {
    grid.splits.iter().map(|s| s.len() - 1).collect()
}

/// The parts holding any cell of the box, sorted, each once.
pub(crate) fn parts_in_box(grid: &Grid, offsets: &[u64], shape: &[u64]) -> Vec<u32> {
    let Some(ranges) = cell_ranges(grid, offsets, shape) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for_each_cell(&dims(grid), &ranges, |c| {
        if let Some(&p) = grid.cells.get(c) {
            out.push(p);
        }
    });
    out.sort_unstable();
    out.dedup();
    out
}

/// Why chunk boxes do not make a grid ([`build_grid`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum GridError {
    /// Two boxes share a cell: the owners of the box being placed and of the cell.
    Overlap(u32, u32),
    /// A cell no box covers: its starting offsets.
    Gap(Vec<u64>),
    /// The boxes' edges draw more than [`MAX_GRID_CELLS`] cells.
    TooManyCells,
}

/// A box [`build_grid`] places: its offsets and shape (of the global's rank) and the part
/// that holds it.
pub(crate) trait GridBox {
    /// The box's offsets in the global.
    fn offsets(&self) -> &[u64];
    /// The box's shape.
    fn shape(&self) -> &[u64];
    /// The index of the part holding it.
    fn part(&self) -> u32;
}

impl GridBox for (&[u64], &[u64], u32) {
    fn offsets(&self) -> &[u64] {
        self.0
    }
    fn shape(&self) -> &[u64] {
        self.1
    }
    fn part(&self) -> u32 {
        self.2
    }
}

/// The grid that boxes `(offsets, shape, part)` draw over a global of `shape` (split points:
/// every box edge), each cell marked with the part of the box covering it. Boxes must lie
/// inside the global and have no empty dimension (checked by the writer). A cell covered
/// twice is an overlap, a cell left uncovered a gap.
pub(crate) fn build_grid<B: GridBox>(global_shape: &[u64], boxes: &[B]) -> Result<Grid, GridError> {
    let splits: Vec<Vec<u64>> = (0..global_shape.len())
        .map(|d| {
            let mut s: Vec<u64> = Vec::with_capacity(2 * boxes.len() + 2);
            s.push(0);
            s.push(global_shape[d]);
            for b in boxes {
                let (o, n) = (b.offsets(), b.shape());
                s.push(o[d]);
                s.push(o[d].saturating_add(n[d]));
            }
            s.sort_unstable();
            s.dedup();
            s
        })
        .collect();
    let n = cell_count(&splits).ok_or(GridError::TooManyCells)?;
    let mut grid = Grid {
        splits,
        cells: vec![u32::MAX; n as usize],
    };
    let dims = dims(&grid);
    for b in boxes {
        let p = b.part();
        let Some(ranges) = cell_ranges(&grid, b.offsets(), b.shape()) else {
            continue;
        };
        let mut clash = None;
        for_each_cell(&dims, &ranges, |c| {
            let cell = &mut grid.cells[c];
            if *cell != u32::MAX {
                clash.get_or_insert(*cell);
            } else {
                *cell = p;
            }
        });
        if let Some(q) = clash {
            return Err(GridError::Overlap(p, q));
        }
    }
    if let Some(c) = grid.cells.iter().position(|&p| p == u32::MAX) {
        // Row-major cell index back to the cell's starting offsets.
        let mut rest = c;
        let mut at = vec![0u64; dims.len()];
        for d in (0..dims.len()).rev() {
            at[d] = grid.splits[d][rest % dims[d]];
            rest /= dims[d];
        }
        return Err(GridError::Gap(at));
    }
    Ok(grid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_make_a_grid_and_lookups_find_the_owners() {
        let a: (&[u64], &[u64], u32) = (&[0, 0], &[3, 4], 0);
        let b: (&[u64], &[u64], u32) = (&[3, 0], &[5, 4], 1);
        let g = build_grid(&[8, 4], &[a, b]).unwrap();
        assert_eq!(g.splits, vec![vec![0, 3, 8], vec![0, 4]]);
        assert_eq!(g.cells, vec![0, 1]);
        assert_eq!(parts_in_box(&g, &[0, 0], &[3, 4]), vec![0]);
        assert_eq!(parts_in_box(&g, &[2, 1], &[2, 1]), vec![0, 1]);
        assert_eq!(parts_in_box(&g, &[7, 3], &[1, 1]), vec![1]);
        assert!(parts_in_box(&g, &[7, 3], &[2, 1]).is_empty());
        check_grid(&g, 2).unwrap();
        assert!(check_grid(&g, 1).is_err());
    }

    #[test]
    fn overlaps_and_gaps_are_found() {
        let a: (&[u64], &[u64], u32) = (&[0, 0], &[4, 2], 0);
        let b: (&[u64], &[u64], u32) = (&[2, 0], &[2, 2], 1);
        assert_eq!(build_grid(&[4, 2], &[a, b]), Err(GridError::Overlap(1, 0)));
        let c: (&[u64], &[u64], u32) = (&[0, 0], &[2, 2], 0);
        let d: (&[u64], &[u64], u32) = (&[2, 1], &[2, 1], 1);
        assert_eq!(
            build_grid(&[4, 2], &[c, d]),
            Err(GridError::Gap(vec![2, 0]))
        );
    }

    #[test]
    fn zero_dim_and_blocks() {
        let e: (&[u64], &[u64], u32) = (&[], &[], 3);
        let g = build_grid(&[], &[e]).unwrap();
        assert_eq!(g.cells, vec![3]);
        assert_eq!(parts_in_box(&g, &[], &[]), vec![3]);
        // 2x2 blocks of a [4, 6] tensor, uneven columns.
        let bx: Vec<(Vec<u64>, Vec<u64>, u32)> = vec![
            (vec![0, 0], vec![2, 1], 0),
            (vec![0, 1], vec![2, 5], 1),
            (vec![2, 0], vec![2, 1], 2),
            (vec![2, 1], vec![2, 5], 3),
        ];
        let r: Vec<(&[u64], &[u64], u32)> =
            bx.iter().map(|(o, s, p)| (&o[..], &s[..], *p)).collect();
        let g = build_grid(&[4, 6], &r).unwrap();
        assert_eq!(g.cells, vec![0, 1, 2, 3]);
        assert_eq!(parts_in_box(&g, &[1, 0], &[2, 2]), vec![0, 1, 2, 3]);
        assert_eq!(parts_in_box(&g, &[3, 2], &[1, 4]), vec![3]);
    }
}
