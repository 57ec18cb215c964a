//! The geometry of a region read, on plain index boxes and byte offsets: bounds checks,
//! the contiguous runs that a box of one row-major piece makes in the region (merged where
//! they touch), their copy, and the CRC blocks they touch. No I/O and no checkpoint: the
//! executor ([`super::run`]) drives these over mapped or fetched bytes.

use super::Region;
use crate::error::{Error, Result};

/// Check `region` against `src`'s shape and rank.
pub(super) fn check_bounds(name: &str, shape: &[u64], region: &Region) -> Result<()> {
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

/// Call `f(src_offset, dst_offset, len)` (bytes) for every contiguous run of the box
/// `[lo, hi)` (global indices), where the source is a row-major piece at
/// `piece.offsets` of shape `piece.shape` and the destination a row-major region at
/// `region.offsets` of shape `region.shape`; `es` bytes per element. Runs come in
/// increasing source (and destination) order; runs that are adjacent in both the source
/// and the destination are merged (a box of whole rows is one run, one `memcpy`). `None`
/// if an offset overflows or `f` returns `None`.
pub(super) fn for_each_run(
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
pub(super) fn copy_box(
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
pub(super) fn touched_blocks(
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Row-major linear index of `idx` in a box at `offsets` of `shape`.
    fn linear(idx: &[u64], offsets: &[u64], shape: &[u64]) -> u64 {
        idx.iter()
            .zip(offsets)
            .zip(shape)
            .fold(0, |acc, ((&i, &o), &n)| acc * n + (i - o))
    }

    /// Every global index of the box `[lo, hi)`, row-major.
    fn indices(lo: &[u64], hi: &[u64]) -> Vec<Vec<u64>> {
        let mut out = vec![Vec::new()];
        for (&l, &h) in lo.iter().zip(hi) {
            out = out
                .into_iter()
                .flat_map(|p| {
                    (l..h).map(move |i| {
                        let mut q = p.clone();
                        q.push(i);
                        q
                    })
                })
                .collect();
        }
        out
    }

    /// A tensor shape, a piece and a region inside it (rank 0-3), and the element size.
    fn case() -> impl Strategy<Value = (Region, Region, usize)> {
        (0usize..=3, prop::sample::select(vec![1usize, 2, 4]))
            .prop_flat_map(|(rank, es)| {
                let dims = prop::collection::vec(1u64..6, rank);
                (dims, Just(es))
            })
            .prop_flat_map(|(shape, es)| {
                let boxes = |shape: &[u64]| {
                    shape
                        .iter()
                        .map(|&n| (0..n).prop_flat_map(move |o| (Just(o), 1..=n - o)))
                        .collect::<Vec<_>>()
                };
                (boxes(&shape), boxes(&shape), Just(es))
            })
            .prop_map(|(p, r, es)| {
                let split = |v: Vec<(u64, u64)>| {
                    let (o, s): (Vec<u64>, Vec<u64>) = v.into_iter().unzip();
                    Region::new(&o, &s)
                };
                (split(p), split(r), es)
            })
    }

    proptest! {
        /// The runs copy exactly what an element-by-element copy does, come in increasing
        /// order, and are merged wherever they touch in both buffers.
        #[test]
        fn copy_box_matches_elementwise((piece, region, es) in case()) {
            let Some((lo, hi)) = region.intersect(&piece) else { return Ok(()) };
            let n = |r: &Region| r.shape.iter().product::<u64>() as usize * es;
            let src: Vec<u8> = (0..n(&piece)).map(|i| (i * 7 + 3) as u8).collect();
            let mut got = vec![0u8; n(&region)];
            prop_assert!(copy_box(&src, 0, &piece, &mut got, &region, &lo, &hi, es).is_some());
            let mut want = vec![0u8; n(&region)];
            for idx in indices(&lo, &hi) {
                let s = linear(&idx, &piece.offsets, &piece.shape) as usize * es;
                let d = linear(&idx, &region.offsets, &region.shape) as usize * es;
                want[d..d + es].copy_from_slice(&src[s..s + es]);
            }
            prop_assert_eq!(got, want);
            let mut runs = Vec::new();
            for_each_run(&piece, &region, &lo, &hi, es, |s, d, n| { runs.push((s, d, n)); Some(()) });
            for w in runs.windows(2) {
                let ((s0, d0, n0), (s1, d1, _)) = (w[0], w[1]);
                prop_assert!(s0 + n0 <= s1 && d0 + n0 <= d1, "runs out of order: {runs:?}");
                prop_assert!(s0 + n0 != s1 || d0 + n0 != d1, "unmerged runs: {runs:?}");
            }
        }

        /// The touched blocks are exactly the blocks holding a byte the box reads.
        #[test]
        fn touched_blocks_are_the_blocks_read((piece, region, es) in case(), bs in 1u64..40) {
            let Some((lo, hi)) = region.intersect(&piece) else { return Ok(()) };
            let got = touched_blocks(&piece, &region, &lo, &hi, es, bs).unwrap();
            let mut want: Vec<u64> = indices(&lo, &hi)
                .iter()
                .flat_map(|idx| {
                    let s = linear(idx, &piece.offsets, &piece.shape) * es as u64;
                    (s..s + es as u64).map(move |b| b / bs)
                })
                .collect();
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn check_bounds_refuses_wrong_rank_and_out_of_bounds() {
        let shape = [4u64, 6];
        assert!(check_bounds("w", &shape, &Region::new(&[1, 2], &[3, 4])).is_ok());
        assert!(check_bounds("w", &shape, &Region::new(&[0, 0], &[0, 0])).is_ok());
        for (o, s) in [
            (vec![1u64], vec![1u64]),
            (vec![2, 0], vec![3, 1]),
            (vec![0, 6], vec![1, 1]),
            (vec![u64::MAX, 0], vec![2, 1]),
        ] {
            let err = check_bounds("w", &shape, &Region::new(&o, &s)).unwrap_err();
            assert!(err.to_string().contains("\"w\""), "{err}");
        }
    }

    #[test]
    fn copy_box_refuses_a_source_too_short() {
        let piece = Region::new(&[0], &[4]);
        let mut dst = [0u8; 4];
        assert!(copy_box(&[1, 2, 3], 0, &piece, &mut dst, &piece, &[0], &[4], 1).is_none());
        assert!(copy_box(&[1, 2, 3, 4], 1, &piece, &mut dst, &piece, &[0], &[4], 1).is_none());
    }
}
