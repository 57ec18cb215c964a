//! SIMD kernels with runtime CPU detection and a portable fallback.
//!
//! Only one kernel needs hand-written SIMD: the scaled FP32 -> FP16 conversion, where the
//! multiply and the conversion must happen in one pass (through a stack buffer and
//! `half`'s slice conversion they cost an extra store and load per element). The AVX2 +
//! F16C path computes exactly what the portable path computes: an IEEE FP32 multiply
//! (`vmulps`, round to nearest even) followed by an FP32 -> FP16 conversion rounding to
//! nearest even (`vcvtps2ph` with `_MM_FROUND_TO_NEAREST_INT`, which also produces FP16
//! subnormals, as `half` does). The results are bit-identical for every input except NaN,
//! where both produce a NaN (payloads may differ; the loader refuses NaN for scaling).
//! Property tests in `crate::convert` check both paths on random and edge-case inputs.
//!
//! Two more loops, FP32 -> BF16 and the absmax integer max, are plain Rust that the
//! compiler vectorizes; they are compiled a second time with AVX2 enabled and dispatched
//! the same way, because the baseline x86-64 target (SSE2) vectorizes them poorly.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Bits of `|x|` for an FP32 value: for finite values the integer order of these bits is
/// the numeric order of `|x|`, and every infinity or NaN is `>= 0x7f80_0000`.
pub(crate) const ABS_MASK: u32 = 0x7fff_ffff;

/// `dst[i] = f16(src[i] * r)`; returns the maximum of `src[i].to_bits() & ABS_MASK`.
///
/// Uses AVX2 + F16C when the CPU has them (detected at run time, cached by std), else the
/// portable path. `force_portable` selects the portable path (for tests and benchmarks).
///
/// # Panics
/// If `src.len() != dst.len()` (a caller bug).
pub(crate) fn f32_mul_to_f16_absbits(
    src: &[f32],
    r: f32,
    dst: &mut [f16],
    force_portable: bool,
) -> u32 {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if !force_portable && has_avx2_f16c() {
        // SAFETY: the CPU supports AVX2 and F16C (checked just above), which is the only
        // requirement of this `#[target_feature]` function; lengths are equal (asserted).
        return unsafe { x86::f32_mul_to_f16_absbits_avx2(src, r, dst) };
    }
    portable(src, r, dst)
}

/// `dst[i] = bf16(src[i])`, round to nearest even; a NaN keeps its sign and top payload
/// bits and is made quiet (as `half::bf16::from_f32`).
///
/// The loop is branch-free integer arithmetic that the compiler vectorizes; on x86-64 it is
/// compiled twice, for the baseline (SSE2) and for AVX2, and the AVX2 copy runs where the CPU
/// has it. Both copies are the same source, so they compute the same bits.
///
/// # Panics
/// If `src.len() != dst.len()` (a caller bug).
pub(crate) fn f32_to_bf16(src: &[f32], dst: &mut [bf16], force_portable: bool) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if !force_portable && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of this
        // `#[target_feature]` function; it reads and writes through safe slices only.
        unsafe { x86::f32_to_bf16_avx2(src, dst) };
        return;
    }
    f32_to_bf16_loop(src, dst);
}

/// The maximum of `x.to_bits() & ABS_MASK` over `x` (0 for an empty slice): the absmax
/// bits of finite data, `>= 0x7f80_0000` if any element is infinite or NaN.
///
/// An integer max that the compiler vectorizes; compiled twice on x86-64 like
/// [`f32_to_bf16`], because the baseline target (SSE2) has no unsigned 32-bit max and the
/// emulation costs a third of a fused CRC pass.
pub(crate) fn absbits(x: &[f32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of this
        // `#[target_feature]` function; it only reads through a safe slice.
        return unsafe { x86::absbits_avx2(x) };
    }
    absbits_loop(x)
}

#[inline(always)]
fn absbits_loop(x: &[f32]) -> u32 {
    x.iter().fold(0u32, |m, v| m.max(v.to_bits() & ABS_MASK))
}

/// The branch-free FP32 -> BF16 loop (see [`f32_to_bf16`]).
#[inline(always)]
fn f32_to_bf16_loop(src: &[f32], dst: &mut [bf16]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        let b = x.to_bits();
        let nan = (b & ABS_MASK) > 0x7f80_0000;
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
        let quiet = (b >> 16) | 0x0040;
        *d = bf16::from_bits(if nan { quiet } else { rounded } as u16);
    }
}

/// Whether the fast path is available on this CPU.
pub(crate) fn has_fast_f16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_f16c()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_f16c() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
}

/// Portable path: multiply into a small stack buffer, then `half`'s slice conversion.
fn portable(src: &[f32], r: f32, dst: &mut [f16]) -> u32 {
    const BLOCK: usize = 1024;
    let mut buf = [0f32; BLOCK];
    let mut m = 0u32;
    for (d, s) in dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let b = &mut buf[..s.len()];
        for (o, &v) in b.iter_mut().zip(s) {
            m = m.max(v.to_bits() & ABS_MASK);
            *o = v * r;
        }
        d.convert_from_f32_slice(b);
    }
    m
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ABS_MASK;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// [`super::absbits_loop`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn absbits_avx2(x: &[f32]) -> u32 {
        super::absbits_loop(x)
    }

    /// [`super::f32_to_bf16_loop`] compiled for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn f32_to_bf16_avx2(src: &[f32], dst: &mut [bf16]) {
        super::f32_to_bf16_loop(src, dst);
    }

    /// AVX2 + F16C: eight elements per step, the tail through the same scalar formula.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C, and `src.len() == dst.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_mul_to_f16_absbits_avx2(src: &[f32], r: f32, dst: &mut [f16]) -> u32 {
        let n = src.len().min(dst.len());
        let body = n / 8 * 8;
        let rv = _mm256_set1_ps(r);
        let mask = _mm256_set1_epi32(ABS_MASK as i32);
        let mut mx = _mm256_setzero_si256();
        let sp = src.as_ptr();
        let dp = dst.as_mut_ptr();
        let mut i = 0;
        while i < body {
            // SAFETY: `i + 8 <= body <= n`, so the 8 floats read at `sp + i` and the 8
            // halves (16 bytes) written at `dp + i` lie inside `src` and `dst`; the
            // unaligned load/store intrinsics have no alignment requirement. `dst` is a
            // unique borrow, so the write aliases nothing else.
            unsafe {
                let x = _mm256_loadu_ps(sp.add(i));
                mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(x), mask));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(x, rv));
                _mm_storeu_si128(dp.add(i).cast::<__m128i>(), h);
            }
            i += 8;
        }
        let mut lanes = [0u32; 8];
        // SAFETY: `lanes` is 32 writable bytes; the unaligned store needs no alignment.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), mx) };
        let mut m = lanes.into_iter().max().unwrap_or(0);
        for (d, &v) in dst[body..n].iter_mut().zip(&src[body..n]) {
            m = m.max(v.to_bits() & ABS_MASK);
            *d = f16::from_f32(v * r);
        }
        m
    }
}
