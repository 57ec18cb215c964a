//! The synthetic, deterministic multi-rank layout written by the hidden `ckpt _write-part`
//! (for tests/parts.rs, which includes this file to rebuild the expected bytes).
//!
//! Globals: `w` F32 [8, 6] split by rows, `b` BF16 [2*world+1] split in 1-D, `h` F16 [4, 4]
//! split by columns (at most 4 ranks hold a column; the others hold none), `d` F64 0-dim
//! replicated on every rank, `i` I64 `[1]` on the last rank. Rank 0 also holds the whole
//! tensor `step` (I64, 0-dim).

use ckptstore::DType;

/// One global tensor of the layout.
pub struct GlobalSpec {
    pub name: &'static str,
    pub dtype: DType,
    pub shape: Vec<u64>,
}

/// The layout's globals for `world` ranks.
pub fn globals(world: u32) -> Vec<GlobalSpec> {
    let g = |name, dtype, shape: &[u64]| GlobalSpec {
        name,
        dtype,
        shape: shape.to_vec(),
    };
    vec![
        g("w", DType::F32, &[8, 6]),
        g("b", DType::BF16, &[2 * u64::from(world) + 1]),
        g("h", DType::F16, &[4, 4]),
        g("d", DType::F64, &[]),
        g("i", DType::I64, &[1]),
    ]
}

/// `[start, end)` of part `k` of `n` even-as-possible parts of `len`.
fn split(len: u64, n: u64, k: u64) -> (u64, u64) {
    (len * k / n, len * (k + 1) / n)
}

/// The chunks rank `rank` of `world` holds: (index into [`globals`], offsets, shape).
pub fn rank_chunks(world: u32, rank: u32) -> Vec<(usize, Vec<u64>, Vec<u64>)> {
    let (w, r) = (u64::from(world), u64::from(rank));
    let mut out = Vec::new();
    let (a, b) = split(8, w, r);
    if b > a {
        out.push((0, vec![a, 0], vec![b - a, 6]));
    }
    let (a, b) = split(2 * w + 1, w, r);
    out.push((1, vec![a], vec![b - a]));
    let cols = w.min(4);
    if r < cols {
        let (a, b) = split(4, cols, r);
        out.push((2, vec![0, a], vec![4, b - a]));
    }
    out.push((3, vec![], vec![]));
    if r + 1 == w {
        out.push((4, vec![0], vec![1]));
    }
    out
}

/// The whole tensor `step` of rank 0: its value.
pub const STEP: i64 = 1234;

/// The bytes of a whole global tensor (little-endian, row-major).
pub fn global_bytes(g: &GlobalSpec) -> Vec<u8> {
    let n: u64 = g.shape.iter().product();
    let mut out = Vec::new();
    for i in 0..n {
        let x = i as f64 * 0.25 - 3.0 + g.name.len() as f64;
        match g.dtype {
            DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(x + 0.125).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(x).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(i as i64 * 7 - 5).to_le_bytes()),
            _ => out.extend_from_slice(&[i as u8]),
        }
    }
    out
}

/// The bytes of the box `[offsets, offsets + shape)` of `bytes`, a row-major tensor of
/// shape `full` with elements of `es` bytes.
pub fn box_bytes(bytes: &[u8], es: usize, full: &[u64], offsets: &[u64], shape: &[u64]) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    let mut out = Vec::new();
    for k in 0..n {
        // The k-th element of the box, as a global flat index.
        let mut rem = k;
        let mut flat = 0u64;
        for d in 0..shape.len() {
            let inner: u64 = shape[d + 1..].iter().product();
            let idx = rem / inner;
            rem %= inner;
            let stride: u64 = full[d + 1..].iter().product();
            flat += (offsets[d] + idx) * stride;
        }
        let s = flat as usize * es;
        out.extend_from_slice(&bytes[s..s + es]);
    }
    out
}
