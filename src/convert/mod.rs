//! Dtype conversion kernels: FP32 <-> FP16 with a per-tensor scale (TransformerEngine
//! FusedAdam arithmetic), FP32 <-> BF16 (round to nearest even), widening copies.
//!
//! Every kernel reads a borrowed source and writes a destination the caller allocated
//! fresh: there is no in-place variant, so a load cannot modify its source. Large inputs
//! are split into chunks processed rayon-parallel; results are identical to the scalar
//! reference in [`reference`](mod@reference) (property-tested), whatever the chunking.
//!
//! Arithmetic (format-spec/optimizer.md §Conversions): `s = absmax(x) / 32752` in FP32;
//! `r = 1 / s` if `s > 0` else `0`; `q = f16(x * r)` (product in FP32, round to nearest
//! even); the value of `q` is `f32(q) * s`.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

/// FP16 max over two: the target range of scaled values (TransformerEngine's `max_range`).
pub const F16_MAX_RANGE: f32 = 32752.0;

/// Elements per parallel chunk.
const PAR_CHUNK: usize = 1 << 16;
/// Elements per inner block (stack buffer).
const BLOCK: usize = 1024;

/// Why an FP16 scaling cannot be done.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleError {
    /// The input holds an infinity or NaN: the scale would turn every finite value into 0
    /// or NaN.
    NonFinite,
    /// `absmax` is so small that `1/s` overflows FP32 (below about 9.6e-35).
    ScaleUnderflow(f32),
}

impl std::fmt::Display for ScaleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScaleError::NonFinite => f.write_str(
                "the FP32 values hold an infinity or NaN, which FP16 scaling cannot represent; load as F32 or BF16 instead",
            ),
            ScaleError::ScaleUnderflow(a) => write!(
                f,
                "absmax {a:e} is too small for FP16 scaling (1/scale overflows FP32); load as F32 or BF16 instead"
            ),
        }
    }
}

/// Bits of `|x|`: for finite values their integer order is the numeric order of `|x|`,
/// and every infinity or NaN is at or above [`NON_FINITE_BITS`].
const ABS_MASK: u32 = 0x7fff_ffff;
/// The smallest `|x|` bit pattern that is not finite (+infinity).
pub const NON_FINITE_BITS: u32 = 0x7f80_0000;

/// Maximum of `x.to_bits() & 0x7fff_ffff` over one slice (vectorized integer max, AVX2
/// where the CPU has it).
fn chunk_absbits(c: &[f32]) -> u32 {
    crate::sys::simd::absbits(c)
}

/// The absmax for a maximum of `|x|` bits: `None` if it is an infinity or NaN.
pub fn absmax_from_bits(bits: u32) -> Option<f32> {
    (bits < NON_FINITE_BITS).then(|| f32::from_bits(bits))
}

/// The largest absolute value, or `None` if any element is not finite.
pub fn absmax_f32(x: &[f32]) -> Option<f32> {
    absmax_from_bits(
        x.par_chunks(PAR_CHUNK)
            .map(chunk_absbits)
            .max()
            .unwrap_or(0),
    )
}

/// The absmax of little-endian FP32 bytes (`None` if any value is not finite); a trailing
/// partial element is ignored. Used by the writer, whose chunks need not be aligned.
pub fn absmax_f32_le_bytes(bytes: &[u8]) -> Option<f32> {
    absmax_from_bits(absbits_le_bytes(bytes))
}

/// Maximum `|x|` bits of little-endian FP32 bytes, for folding over chunks. `bytes` must
/// start at an element boundary; a trailing partial element is ignored.
pub fn absbits_le_bytes(bytes: &[u8]) -> u32 {
    let slow = |b: &[u8]| {
        b.chunks_exact(4).fold(0u32, |m, b| {
            m.max(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & ABS_MASK)
        })
    };
    if cfg!(target_endian = "big") {
        return slow(bytes);
    }
    // The aligned middle as `u32`s (vectorizes); an unaligned head is handled bytewise,
    // and only when it is whole elements (otherwise the slice is not element-aligned in
    // memory and everything goes bytewise).
    let (head, body, _) = bytemuck::pod_align_to::<u8, u32>(bytes);
    if head.len() % 4 != 0 {
        return slow(bytes);
    }
    let tail = &bytes[head.len() + body.len() * 4..];
    slow(head)
        .max(chunk_absbits(bytemuck::cast_slice(body)))
        .max(slow(tail))
}

/// CRC32 of `bytes` and the absmax of the same data viewed as `x` (`None` if any value is
/// not finite), in one parallel pass: each chunk is checksummed and scanned while it is in
/// cache, and the chunk CRCs are combined. `x` must be `bytes` reinterpreted.
pub fn crc32_and_absmax_f32(bytes: &[u8], x: &[f32]) -> (u32, Option<f32>) {
    debug_assert_eq!(bytes.len(), x.len() * 4);
    let (crc, m) = fused_fold(x, &mut [] as &mut [u8], |c, _| {
        let mut h = crc32fast::Hasher::new();
        h.update(bytemuck::cast_slice(c));
        (h, chunk_absbits(c))
    });
    (crc, absmax_from_bits(m))
}

/// Elements per chunk of the fused loaders: small enough (64 KiB of FP32) that a chunk
/// read once for the CRC is still in L2 when it is converted, large enough that
/// scheduling and CRC combination cost nothing.
const FUSED_CHUNK: usize = 1 << 14;

/// Parallel fold over matching chunks of `src` and `dst` (`dst` may be empty: then each
/// call gets an empty slice). Each call returns its chunk's CRC hasher and a `u32` folded
/// by max; hashers are combined in order, so the CRC is that of the whole source.
fn fused_fold<S: Sync, D: Send>(
    src: &[S],
    dst: &mut [D],
    f: impl Fn(&[S], &mut [D]) -> (crc32fast::Hasher, u32) + Sync + Send,
) -> (u32, u32) {
    let reduce = |(mut h, m): (crc32fast::Hasher, u32), (h2, m2): (crc32fast::Hasher, u32)| {
        h.combine(&h2);
        (h, m.max(m2))
    };
    let (h, m) = if dst.is_empty() {
        src.par_chunks(FUSED_CHUNK)
            .map(|s| f(s, &mut []))
            .reduce_with(reduce)
    } else {
        assert_eq!(src.len(), dst.len());
        src.par_chunks(FUSED_CHUNK)
            .zip(dst.par_chunks_mut(FUSED_CHUNK))
            .map(|(s, d)| f(s, d))
            .reduce_with(reduce)
    }
    .unwrap_or((crc32fast::Hasher::new(), 0));
    (h.finalize(), m)
}

fn hasher_of(bytes: &[u8]) -> crc32fast::Hasher {
    let mut h = crc32fast::Hasher::new();
    h.update(bytes);
    h
}

/// One pass for an FP32 -> FP16-scaled load whose absmax is known in advance (recorded in
/// the manifest): per chunk, the CRC of the source bytes, then `dst[i] = f16(src[i] * r)`
/// from cache (SIMD where the CPU has it). Returns the CRC32 of `src`'s bytes and the
/// maximum `|x|` bits seen, which the caller compares with the recorded absmax.
///
/// # Panics
/// If `dst.len() != src.len()` (a caller bug).
pub fn crc32_f32_mul_to_f16(src: &[f32], r: f32, dst: &mut [f16]) -> (u32, u32) {
    assert_eq!(src.len(), dst.len());
    if src.is_empty() {
        return (0, 0);
    }
    fused_fold(src, dst, |s, d| {
        let h = hasher_of(bytemuck::cast_slice(s));
        (h, crate::sys::simd::f32_mul_to_f16_absbits(s, r, d, false))
    })
}

/// One pass for an FP32 -> BF16 load: per chunk, the CRC of the source bytes, then the
/// conversion from cache. Returns the CRC32 of `src`'s bytes.
///
/// # Panics
/// If `dst.len() != src.len()` (a caller bug).
pub fn crc32_f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> u32 {
    assert_eq!(src.len(), dst.len());
    if src.is_empty() {
        return 0;
    }
    fused_fold(src, dst, |s, d| {
        let h = hasher_of(bytemuck::cast_slice(s));
        crate::sys::simd::f32_to_bf16(s, d, false);
        (h, 0)
    })
    .0
}

/// One pass for an exact copy: per chunk, the CRC of the source, then the copy from cache.
/// Returns the CRC32 of `src`.
///
/// # Panics
/// If `dst.len() != src.len()` (a caller bug).
pub fn crc32_copy(src: &[u8], dst: &mut [u8]) -> u32 {
    assert_eq!(src.len(), dst.len());
    if src.is_empty() {
        return 0;
    }
    // FUSED_CHUNK FP32 elements' worth of bytes per chunk.
    let bytes = FUSED_CHUNK * 4;
    src.par_chunks(bytes)
        .zip(dst.par_chunks_mut(bytes))
        .map(|(s, d)| {
            let h = hasher_of(s);
            d.copy_from_slice(s);
            h
        })
        .reduce_with(|mut a, b| {
            a.combine(&b);
            a
        })
        .map(|h| h.finalize())
        .unwrap_or(0)
}

/// The scale and its reciprocal for a given absmax.
///
/// # Errors
/// [`ScaleError::ScaleUnderflow`] if `1/s` is not finite.
pub fn scale_for(absmax: f32) -> Result<(f32, f32), ScaleError> {
    let s = absmax / F16_MAX_RANGE;
    if s > 0.0 {
        let r = 1.0 / s;
        if !r.is_finite() {
            return Err(ScaleError::ScaleUnderflow(absmax));
        }
        Ok((s, r))
    } else {
        Ok((0.0, 0.0))
    }
}

/// Scale FP32 values into FP16 codes: returns the scale `s` and writes `q` into `dst`.
///
/// # Errors
/// [`ScaleError`] for non-finite input or an underflowing scale; `dst` is then untouched
/// or partly written (it is a fresh buffer the caller discards).
///
/// # Panics
/// If `dst.len() != src.len()` (a caller bug, not an input property).
pub fn f32_to_f16_scaled(src: &[f32], dst: &mut [f16]) -> Result<f32, ScaleError> {
    assert_eq!(src.len(), dst.len());
    let absmax = absmax_f32(src).ok_or(ScaleError::NonFinite)?;
    let (s, r) = scale_for(absmax)?;
    f32_mul_to_f16(src, r, dst);
    Ok(s)
}

/// `dst[i] = f16(src[i] * r)`, rayon-parallel; AVX2 + F16C where the CPU has them
/// (detected at run time), else a portable path with bit-identical results.
pub fn f32_mul_to_f16(src: &[f32], r: f32, dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| {
            crate::sys::simd::f32_mul_to_f16_absbits(s, r, d, false);
        });
}

/// The portable path of [`f32_mul_to_f16`] (no SIMD dispatch), for tests and benchmarks.
#[doc(hidden)]
pub fn f32_mul_to_f16_portable(src: &[f32], r: f32, dst: &mut [f16]) {
    crate::sys::simd::f32_mul_to_f16_absbits(src, r, dst, true);
}

/// Whether [`f32_mul_to_f16`] runs its SIMD path (AVX2 + F16C) on this CPU.
pub fn has_simd_f16() -> bool {
    crate::sys::simd::has_fast_f16()
}

/// Plain FP32 -> FP16 (no scale), rayon-parallel: the baseline kernel for benchmarks.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| d.convert_from_f32_slice(s));
}

/// `dst[i] = f32(q[i]) * s`.
pub fn f16_scaled_to_f32(q: &[f16], s: f32, dst: &mut [f32]) {
    assert_eq!(q.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(q.par_chunks(PAR_CHUNK))
        .for_each(|(d, q)| {
            q.convert_to_f32_slice(d);
            for v in d.iter_mut() {
                *v *= s;
            }
        });
}

/// `dst[i] = f32(f16(src[i] * r)) * s`: the FP32 values an FP16-scaled state holds (the codes
/// of [`f32_mul_to_f16`], unscaled as [`f16_scaled_to_f32`] does), fused per block so that
/// the codes never leave the cache; rayon-parallel, bit-identical to the two kernels in turn.
/// Returns the maximum of `src[i].to_bits() & 0x7fff_ffff` (see [`absmax_from_bits`]).
///
/// # Panics
/// If `src.len() != dst.len()` (a caller bug).
pub fn f32_round_f16_scaled(src: &[f32], r: f32, s: f32, dst: &mut [f32]) -> u32 {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .map(|(d, x)| {
            let mut q = [f16::ZERO; BLOCK];
            let mut bits = 0;
            for (dc, xc) in d.chunks_mut(BLOCK).zip(x.chunks(BLOCK)) {
                let q = &mut q[..xc.len()];
                bits = bits.max(crate::sys::simd::f32_mul_to_f16_absbits(xc, r, q, false));
                q.convert_to_f32_slice(dc);
                for v in dc.iter_mut() {
                    *v *= s;
                }
            }
            bits
        })
        .max()
        .unwrap_or(0)
}

/// `dst[i] = f32(bf16(src[i]))`: the FP32 values a BF16 state holds ([`f32_to_bf16`] then
/// [`bf16_to_f32`]), fused per block, rayon-parallel.
///
/// # Panics
/// If `src.len() != dst.len()` (a caller bug).
pub fn f32_round_bf16(src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, x)| {
            let mut b = [bf16::ZERO; BLOCK];
            for (dc, xc) in d.chunks_mut(BLOCK).zip(x.chunks(BLOCK)) {
                let b = &mut b[..xc.len()];
                crate::sys::simd::f32_to_bf16(xc, b, false);
                b.convert_to_f32_slice(dc);
            }
        });
}

/// `dst[i] = bf16(src[i])`, round to nearest even; NaN stays NaN, infinities stay.
/// Rayon-parallel, AVX2 where the CPU has it.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| crate::sys::simd::f32_to_bf16(s, d, false));
}

/// The portable path of [`f32_to_bf16`] (no SIMD dispatch, one thread), for tests.
#[doc(hidden)]
pub fn f32_to_bf16_portable(src: &[f32], dst: &mut [bf16]) {
    crate::sys::simd::f32_to_bf16(src, dst, true);
}

/// `dst[i] = f32(src[i])`, exact.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| s.convert_to_f32_slice(d));
}

/// `dst[i] = f32(src[i])`, exact.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| s.convert_to_f32_slice(d));
}

/// `dst[i] = bf16(f32(q[i]) * s)`.
pub fn f16_scaled_to_bf16(q: &[f16], s: f32, dst: &mut [bf16]) {
    assert_eq!(q.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(q.par_chunks(PAR_CHUNK))
        .for_each(|(d, q)| {
            let mut buf = [0f32; BLOCK];
            for (dc, qc) in d.chunks_mut(BLOCK).zip(q.chunks(BLOCK)) {
                let b = &mut buf[..qc.len()];
                qc.convert_to_f32_slice(b);
                for v in b.iter_mut() {
                    *v *= s;
                }
                dc.convert_from_f32_slice(b);
            }
        });
}

/// `bf16(x)` for an `f64`, correctly rounded to nearest even (no double rounding): the
/// value is first rounded to `f32` by round-to-odd, which is exact enough for a second
/// rounding to the 8-bit BF16 significand to be correct.
pub fn f64_to_bf16(x: f64) -> bf16 {
    if !x.is_finite() {
        return bf16::from_f32(x as f32);
    }
    let t = x as f32; // round to nearest
    let mut bits = t.to_bits();
    if t.is_finite() && t as f64 != x {
        // Round toward zero, then set the lowest bit: round-to-odd.
        if (t as f64).abs() > x.abs() {
            bits -= 1;
        }
        bits |= 1;
    }
    bf16::from_f32(f32::from_bits(bits))
}

/// Parallel copy (the memcpy baseline, and exact same-dtype loads).
pub fn copy_bytes(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    dst.par_chunks_mut(PAR_CHUNK * 4)
        .zip(src.par_chunks(PAR_CHUNK * 4))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// Scalar reference implementations of the formulas, one element at a time. The kernels
/// above must agree with these bit for bit.
pub mod reference {
    use half::{bf16, f16};

    /// FP32 -> FP16 scaled, straight from the formula.
    pub fn f32_to_f16_scaled(x: &[f32]) -> Result<(Vec<f16>, f32), super::ScaleError> {
        let mut absmax = 0f32;
        for &v in x {
            if !v.is_finite() {
                return Err(super::ScaleError::NonFinite);
            }
            absmax = absmax.max(v.abs());
        }
        let s = absmax / 32752.0;
        let r = if s > 0.0 { 1.0 / s } else { 0.0 };
        if !r.is_finite() {
            return Err(super::ScaleError::ScaleUnderflow(absmax));
        }
        Ok((x.iter().map(|&v| f16::from_f32(v * r)).collect(), s))
    }

    /// FP16 scaled -> FP32.
    pub fn f16_scaled_to_f32(q: &[f16], s: f32) -> Vec<f32> {
        q.iter().map(|&v| f32::from(v) * s).collect()
    }

    /// FP32 -> BF16, round to nearest even, written out bitwise (independent of `half`).
    pub fn f32_to_bf16(x: &[f32]) -> Vec<bf16> {
        x.iter()
            .map(|&v| {
                let b = v.to_bits();
                if v.is_nan() {
                    // Quiet the NaN, keep sign and top payload bits.
                    return bf16::from_bits(((b >> 16) as u16) | 0x0040);
                }
                let round = 0x7fff + ((b >> 16) & 1);
                bf16::from_bits((b.wrapping_add(round) >> 16) as u16)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn special() -> Vec<f32> {
        vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            65504.0,
            -65504.0,
            65520.0,
            32752.0,
            1e30,
            -3.4e38,
            f32::MAX,
            0.1,
            1.0 / 3.0,
        ]
    }

    fn check_scaled(x: &[f32]) {
        let mut q = vec![f16::ZERO; x.len()];
        let got = f32_to_f16_scaled(x, &mut q);
        match reference::f32_to_f16_scaled(x) {
            Ok((rq, rs)) => {
                let s = got.expect("kernel failed where the reference succeeded");
                assert_eq!(s.to_bits(), rs.to_bits());
                assert_eq!(
                    q.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    rq.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                // Round trip back stays within half an FP16 ulp of scaled magnitude.
                let mut back = vec![0f32; x.len()];
                f16_scaled_to_f32(&q, s, &mut back);
                assert_eq!(back, reference::f16_scaled_to_f32(&rq, rs));
                // Every scaled value is in FP16 range: no infinities produced.
                assert!(q.iter().all(|v| v.is_finite()));
            }
            Err(e) => assert_eq!(got, Err(e)),
        }
    }

    #[test]
    fn scaled_specials() {
        check_scaled(&special());
        check_scaled(&[0.0; 5]);
        check_scaled(&[]);
        check_scaled(&[1e-40, -2e-41]); // subnormal absmax: 1/s overflows -> error
        check_scaled(&[1e-30, 0.0]);
        let mut q = [f16::ZERO; 2];
        assert_eq!(
            f32_to_f16_scaled(&[1.0, f32::NAN], &mut q),
            Err(ScaleError::NonFinite)
        );
        assert_eq!(
            f32_to_f16_scaled(&[1.0, f32::NEG_INFINITY], &mut q),
            Err(ScaleError::NonFinite)
        );
        // All-zero input: s = 0, r = 0, q all +0.
        let s = f32_to_f16_scaled(&[0.0, -0.0], &mut q).unwrap();
        assert_eq!(s, 0.0);
        assert_eq!(q[0].to_bits(), 0);
        // absmax maps to exactly 32752.
        let s = f32_to_f16_scaled(&[65504.0, 1.0], &mut q).unwrap();
        assert_eq!(s, 2.0);
        assert_eq!(f32::from(q[0]), 32752.0);
    }

    #[test]
    fn bf16_specials_match_reference() {
        let mut x = special();
        x.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ]);
        let mut d = vec![bf16::ZERO; x.len()];
        f32_to_bf16(&x, &mut d);
        let r = reference::f32_to_bf16(&x);
        for (i, (a, b)) in d.iter().zip(&r).enumerate() {
            if x[i].is_nan() {
                assert!(a.is_nan() && b.is_nan());
            } else {
                assert_eq!(a.to_bits(), b.to_bits(), "x = {:e}", x[i]);
            }
        }
        // Ties to even: 1 + 2^-8 rounds down to 1, 1 + 3*2^-8 rounds up.
        assert_eq!(d[d.len() - 2].to_bits(), 0x3f80);
        assert_eq!(d[d.len() - 1].to_bits(), 0x3f82);
    }

    fn any_f32() -> impl Strategy<Value = f32> {
        prop_oneof![
            any::<f32>(),
            -1e4f32..1e4,
            (-1e-6f32..1e-6),
            prop::sample::select(special()),
        ]
    }

    proptest! {
        #[test]
        fn scaled_matches_reference(x in prop::collection::vec(any_f32(), 0..3000)) {
            check_scaled(&x);
        }

        #[test]
        fn bf16_matches_reference(x in prop::collection::vec(any_f32(), 0..3000)) {
            let mut d = vec![bf16::ZERO; x.len()];
            let mut p = vec![bf16::ZERO; x.len()];
            f32_to_bf16(&x, &mut d);
            f32_to_bf16_portable(&x, &mut p);
            let r = reference::f32_to_bf16(&x);
            for (i, (a, b)) in d.iter().zip(&r).enumerate() {
                // half's own conversion too: the three agree, NaN payloads included.
                prop_assert_eq!(a.to_bits(), bf16::from_f32(x[i]).to_bits());
                prop_assert_eq!(a.to_bits(), p[i].to_bits());
                if x[i].is_nan() { prop_assert!(a.is_nan() && b.is_nan()); }
                else { prop_assert_eq!(a.to_bits(), b.to_bits()); }
            }
            let mut back = vec![0f32; x.len()];
            bf16_to_f32(&d, &mut back);
            for (i, v) in back.iter().enumerate() {
                prop_assert!(v.to_bits() == f32::from(d[i]).to_bits() || v.is_nan());
            }
        }

        #[test]
        fn scaled_to_bf16_matches_reference(x in prop::collection::vec(-1e3f32..1e3, 1..500)) {
            let (q, s) = reference::f32_to_f16_scaled(&x).unwrap();
            let mut d = vec![bf16::ZERO; q.len()];
            f16_scaled_to_bf16(&q, s, &mut d);
            let want = reference::f32_to_bf16(&reference::f16_scaled_to_f32(&q, s));
            prop_assert_eq!(d, want);
        }
    }

    /// A smooth signal of `n` values in [-7, 7].
    fn wave(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * 0.37).sin() * 7.0).collect()
    }

    #[test]
    fn fused_crc_and_absmax_match_separate_passes() {
        let x = wave(3 * PAR_CHUNK + 5);
        let b: &[u8] = bytemuck::cast_slice(&x);
        assert_eq!(
            crc32_and_absmax_f32(b, &x),
            (crc32fast::hash(b), absmax_f32(&x))
        );
        let mut y = x.clone();
        y[PAR_CHUNK + 3] = f32::NAN;
        let b: &[u8] = bytemuck::cast_slice(&y);
        assert_eq!(crc32_and_absmax_f32(b, &y), (crc32fast::hash(b), None));
        assert_eq!(crc32_and_absmax_f32(&[], &[]), (0, Some(0.0)));
    }

    /// The scalar formula `f16(x * r)`, element by element, as FP16 bits.
    fn formula(x: &[f32], r: f32) -> Vec<u16> {
        x.iter().map(|&v| f16::from_f32(v * r).to_bits()).collect()
    }

    fn check_mul_paths(x: &[f32], r: f32) -> Result<(), TestCaseError> {
        let want = formula(x, r);
        let mut simd = vec![f16::ZERO; x.len()];
        let mut port = vec![f16::ZERO; x.len()];
        f32_mul_to_f16(x, r, &mut simd);
        f32_mul_to_f16_portable(x, r, &mut port);
        let (crc, bits) = crc32_f32_mul_to_f16(x, r, &mut vec![f16::ZERO; x.len()]);
        prop_assert_eq!(crc, crc32fast::hash(bytemuck::cast_slice(x)));
        prop_assert_eq!(bits, chunk_absbits(x));
        for (i, &w) in want.iter().enumerate() {
            let (a, b) = (simd[i].to_bits(), port[i].to_bits());
            if x[i].is_nan() || (x[i] * r).is_nan() {
                // NaN stays NaN on both paths (payloads may differ).
                prop_assert!(simd[i].is_nan() && port[i].is_nan());
            } else {
                prop_assert_eq!(a, w, "simd, x = {:e}, r = {:e}", x[i], r);
                prop_assert_eq!(b, w, "portable, x = {:e}, r = {:e}", x[i], r);
            }
        }
        Ok(())
    }

    fn any_scale() -> impl Strategy<Value = f32> {
        prop_oneof![
            any::<f32>().prop_filter("finite", |r| r.is_finite()),
            Just(0.0f32),
            Just(1.0f32),
            1e-3f32..1e9,
            prop::sample::select(vec![32752.0f32 / 65504.0, 2.0f32.powi(24), 1e-30, 3.4e38]),
        ]
    }

    proptest! {
        #[test]
        fn simd_and_portable_scaled_kernels_match_the_formula(
            x in prop::collection::vec(
                prop_oneof![any_f32(), prop::sample::select(vec![f32::NAN, f32::INFINITY, -f32::INFINITY])],
                0..200,
            ),
            r in any_scale(),
        ) {
            check_mul_paths(&x, r)?;
        }
    }

    proptest! {
        #[test]
        fn absmax_bits_match_a_scalar_fold(bits in prop::collection::vec(any::<u32>(), 0..300), cut in 0usize..4) {
            let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let want = bits.iter().fold(0u32, |m, &b| m.max(b & 0x7fff_ffff));
            prop_assert_eq!(chunk_absbits(&x), want);
            prop_assert_eq!(absmax_f32(&x), absmax_from_bits(want));
            // The writer's byte path, at every alignment.
            let mut raw = vec![0u8; cut];
            raw.extend_from_slice(bytemuck::cast_slice(&x));
            prop_assert_eq!(absbits_le_bytes(&raw[cut..]), want);
        }
    }

    #[test]
    fn scaled_kernels_cover_every_fp16_rounding_boundary() {
        // Every FP16 value's neighbourhood: exact codes, the ties around each one (round to
        // even), subnormal codes, the overflow threshold 65520 and just below it.
        let mut x = Vec::new();
        for h in 0..=0x7bffu16 {
            let v = f16::from_bits(h).to_f32();
            let next = f16::from_bits(h + 1).to_f32();
            let mid = (v as f64 + next as f64) / 2.0;
            for y in [
                v,
                mid as f32,
                f32::from_bits((mid as f32).to_bits() + 1),
                -v,
            ] {
                x.push(y);
            }
        }
        x.extend([
            65519.0,
            65520.0,
            65536.0,
            1e-8,
            -6e-8,
            3e-8,
            f32::MIN_POSITIVE,
        ]);
        for r in [1.0f32, 0.5, 1.0 / 3.0, 3.0e-5] {
            check_mul_paths(&x, r).unwrap();
        }
    }

    #[test]
    fn fused_loaders_equal_separate_passes() {
        let x = wave(3 * FUSED_CHUNK + 13);
        let bytes: &[u8] = bytemuck::cast_slice(&x);
        let mut b1 = vec![bf16::ZERO; x.len()];
        let mut b2 = vec![bf16::ZERO; x.len()];
        assert_eq!(crc32_f32_to_bf16(&x, &mut b1), crc32fast::hash(bytes));
        f32_to_bf16(&x, &mut b2);
        assert_eq!(b1, b2);
        let mut c = vec![0u8; bytes.len()];
        assert_eq!(crc32_copy(bytes, &mut c), crc32fast::hash(bytes));
        assert_eq!(c, bytes);
        assert_eq!(crc32_copy(&[], &mut []), 0);
        assert_eq!(crc32_f32_to_bf16(&[], &mut []), 0);
        assert_eq!(crc32_f32_mul_to_f16(&[], 1.0, &mut []), (0, 0));
        // absmax over unaligned little-endian bytes equals the typed absmax.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(bytes);
        assert_eq!(absmax_f32_le_bytes(&shifted[1..]), absmax_f32(&x));
        assert_eq!(absmax_f32_le_bytes(bytes), absmax_f32(&x));
    }

    #[test]
    fn f64_to_bf16_is_correctly_rounded() {
        // 1 + 2^-8 + 2^-40 is just above the tie between 1 and 1 + 2^-7: must round up.
        // Rounding through f32 first would give exactly the tie and round down to even.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(f64_to_bf16(x).to_bits(), 0x3f81);
        assert_eq!(f64_to_bf16(1.0 + 2f64.powi(-8)).to_bits(), 0x3f80);
        assert_eq!(f64_to_bf16(-2.5).to_f32(), -2.5);
        assert!(f64_to_bf16(f64::NAN).is_nan());
        assert_eq!(f64_to_bf16(f64::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(f64_to_bf16(1e300).to_f32(), f32::INFINITY);
    }

    proptest! {
        #[test]
        fn f64_to_bf16_matches_exact_rounding(x in -1e30f64..1e30) {
            // Exact reference: compare the two bf16 neighbours in f64.
            let got = f64_to_bf16(x);
            let g = got.to_f64();
            let up = bf16::from_bits(got.to_bits().wrapping_add(1)).to_f64();
            let down = bf16::from_bits(got.to_bits().wrapping_sub(1)).to_f64();
            let err = (g - x).abs();
            prop_assert!(err <= (up - x).abs() && err <= (down - x).abs());
        }
    }

    #[test]
    fn large_inputs_are_chunk_independent() {
        let x: Vec<f32> = (0..(3 * PAR_CHUNK + 17))
            .map(|i| ((i as f32) * 0.37).sin() * 100.0)
            .collect();
        check_scaled(&x);
    }
}
