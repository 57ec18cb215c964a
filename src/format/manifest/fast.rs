//! A hand-written parser for the manifests writers produce, several times faster than
//! serde_json's derived deserializers on large tensor lists.
//!
//! It accepts a strict subset of what serde_json accepts into a [`Manifest`] and returns
//! exactly the value serde_json would: strings without escapes or control characters
//! (after one UTF-8 check of the whole file), non-negative integers without leading
//! zeros, fraction or exponent, within the field's range; each known member at most once;
//! every required member present. Anything else (an escape, a duplicate member, a number
//! out of range, a struct written as an array, deep nesting, bad syntax, ...) returns
//! `None` and the caller parses again with serde_json, which decides. `metadata`,
//! `optimizer` and unknown members are located here and handed to serde_json.

use crate::dtype::DType;
use crate::format::schema::{
    empty_object, BlockCrcs, GlobalEntry, Grid, Manifest, OptimizerSection, PartRef, ShardEntry,
    TensorInfo,
};

/// Deepest nesting handed to serde_json as one member's value. serde_json refuses
/// more than 128 levels in the whole file; staying far below keeps a member that
/// parses alone from hiding a file too deep to parse whole.
const MAX_DEPTH: u32 = 64;

pub(super) fn parse(bytes: &[u8]) -> Option<Manifest> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut p = Parser {
        text,
        b: bytes,
        i: 0,
        shape: Vec::new(),
    };
    let m = p.manifest()?;
    p.ws();
    (p.i == bytes.len()).then_some(m)
}

/// Position of the first `"`, `\\` or control character (< 0x20) in `s`, eight bytes
/// at a time.
fn special(s: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    let is_special = |c: &u8| *c == b'"' || *c == b'\\' || *c < 0x20;
    let mut chunks = s.chunks_exact(8);
    let mut off = 0;
    for c in &mut chunks {
        let w = u64::from_le_bytes(<[u8; 8]>::try_from(c).ok()?);
        let q = w ^ (ONES * u64::from(b'"'));
        let bs = w ^ (ONES * u64::from(b'\\'));
        // Nonzero exactly when some byte is zero (q, bs) or below 0x20 (w).
        let hit = (q.wrapping_sub(ONES) & !q)
            | (bs.wrapping_sub(ONES) & !bs)
            | (w.wrapping_sub(ONES * 0x20) & !w);
        if hit & HIGH != 0 {
            if let Some(p) = c.iter().position(is_special) {
                return Some(off + p);
            }
        }
        off += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(is_special)
        .map(|p| off + p)
}

/// The value `m / 10^frac` of a JSON number without sign or exponent, whose digits
/// make the integer `m`, when `m <= 2^53` and `frac <= 22`: both are exact in
/// binary64, so one IEEE division rounds correctly, as the general parse does
/// (Clinger's fast path). `None` otherwise.
fn exact_f64(m: u64, frac: usize) -> Option<f64> {
    const POW10: [f64; 23] = [
        1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
        1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
    ];
    if m > 1 << 53 {
        return None;
    }
    Some(m as f64 / POW10.get(frac)?)
}

/// [`DType::from_name`], the most common names first.
fn dtype_named(name: &str) -> Option<DType> {
    match name.as_bytes() {
        [b'F', b'3', b'2'] => Some(DType::F32),
        [b'B', b'F', b'1', b'6'] => Some(DType::BF16),
        [b'F', b'1', b'6'] => Some(DType::F16),
        _ => DType::from_name(name),
    }
}

/// The leading decimal digits of `s`: their value and count; `None` if the value
/// exceeds `u64::MAX`. Eight digits at a time while eight bytes remain.
#[inline]
pub(super) fn uint(s: &[u8]) -> Option<(u64, usize)> {
    const ZEROS: u64 = u64::from_le_bytes([b'0'; 8]);
    const SIXES: u64 = u64::from_le_bytes([6; 8]);
    const HIGH_NIBBLES: u64 = u64::from_le_bytes([0xf0; 8]);
    const POW10: [u64; 8] = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000];
    let mut v = 0u64;
    let mut n = 0usize;
    while let Some(c) = s.get(n..n + 8) {
        // Byte values 0..=9 where the input has a digit.
        let x = u64::from_le_bytes(<[u8; 8]>::try_from(c).ok()?) ^ ZEROS;
        // A high nibble is set in every byte that is not a digit; a carry only
        // disturbs bytes after the first such byte, which are not counted.
        let non_digit = (x | x.wrapping_add(SIXES)) & HIGH_NIBBLES;
        let k = (non_digit.trailing_zeros() / 8) as usize;
        if n + k > 19 {
            break; // may overflow: finish digit by digit, checked
        }
        if k > 0 {
            // The k digits in the top bytes, zeros (leading zeros) below.
            let top = x << (8 * (8 - k));
            // v < 10^n with n + k <= 19: cannot overflow (checked all the same).
            let scale = POW10.get(k).copied().unwrap_or(100_000_000);
            v = v.checked_mul(scale)?.checked_add(eight_digits(top))?;
            n += k;
        }
        if k < 8 {
            return Some((v, n));
        }
    }
    for &c in s.get(n..)? {
        if !c.is_ascii_digit() {
            break;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
        n += 1;
    }
    Some((v, n))
}

/// The value of eight decimal digits, given as byte values 0..=9 in a little-endian
/// word, the most significant first (the SWAR reduction of simdjson).
fn eight_digits(x: u64) -> u64 {
    let x = x.wrapping_mul(10).wrapping_add(x >> 8);
    let lo = (x & 0x0000_00ff_0000_00ff).wrapping_mul(100 + (1_000_000 << 32));
    let hi = ((x >> 16) & 0x0000_00ff_0000_00ff).wrapping_mul(1 + (10_000 << 32));
    lo.wrapping_add(hi) >> 32
}

/// Store the first value of a member; a second one makes serde_json refuse the file
/// ("duplicate field").
fn once<T>(slot: &mut Option<T>, v: T) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(v);
    Some(())
}

struct Parser<'a> {
    text: &'a str,
    b: &'a [u8],
    i: usize,
    /// Scratch for one tensor's shape, so each shape gets one exact allocation.
    shape: Vec<u64>,
}

impl<'a> Parser<'a> {
    /// Skip JSON whitespace (as serde_json: space, tab, LF, CR).
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        if self.peek()? != c {
            return None;
        }
        self.i += 1;
        Some(())
    }

    /// The members of an object, `{` included: `f` parses each member's value.
    fn members(&mut self, mut f: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.expect(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.expect(b':')?;
            f(self, key)?;
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The elements of an array, `[` included: `f` parses each element.
    fn elements(&mut self, mut f: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.expect(b'[')?;
        if self.peek()? == b']' {
            self.i += 1;
            return Some(());
        }
        loop {
            f(self)?;
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string without escapes or control characters.
    fn string(&mut self) -> Option<&'a str> {
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.i + 1;
        let end = start + special(self.b.get(start..)?)?;
        if self.b.get(end) != Some(&b'"') {
            return None;
        }
        self.i = end + 1;
        // Both ends are ASCII quotes, so char boundaries of the checked text.
        self.text.get(start..end)
    }

    /// `lit` exactly, next (no whitespace skipped).
    fn lit<const N: usize>(&mut self, lit: &[u8; N]) -> Option<()> {
        let next = self.b.get(self.i..self.i.checked_add(N)?)?;
        if <[u8; N]>::try_from(next).ok()? != *lit {
            return None;
        }
        self.i += N;
        Some(())
    }

    /// A non-negative integer that fits a `u64`, as serde_json accepts for one.
    #[inline]
    fn u64(&mut self) -> Option<u64> {
        self.ws();
        let start = self.i;
        let (v, n) = uint(self.b.get(start..)?)?;
        // No leading zero (serde_json refuses one).
        if n == 0 || (n > 1 && self.b.get(start) == Some(&b'0')) {
            return None;
        }
        self.i += n;
        if let Some(b'.' | b'e' | b'E') = self.b.get(self.i) {
            return None;
        }
        Some(v)
    }

    fn u32(&mut self) -> Option<u32> {
        u32::try_from(self.u64()?).ok()
    }

    /// `null`, consumed if it is next.
    fn null(&mut self) -> bool {
        self.ws();
        let is = self.b.get(self.i..self.i + 4) == Some(b"null");
        if is {
            self.i += 4;
        }
        is
    }

    /// `absmax`: what `de_absmax` accepts. The JSON number grammar without a sign (a
    /// negative value is refused anyway), short enough that the correctly rounded
    /// parses of std and of serde_json (`float_roundtrip`) agree by construction.
    fn absmax(&mut self) -> Option<f32> {
        self.ws();
        let start = self.i;
        // The digits as one integer `m` (None past u64), and the fraction's length.
        let (mut m, int) = self.digit_run();
        if int == 0 || (int > 1 && self.b.get(start) == Some(&b'0')) {
            return None;
        }
        let mut frac = 0;
        if self.b.get(self.i) == Some(&b'.') {
            self.i += 1;
            let (f, n) = self.digit_run();
            if n == 0 {
                return None;
            }
            frac = n;
            m = (|| {
                m?.checked_mul(10u64.checked_pow(u32::try_from(n).ok()?)?)?
                    .checked_add(f?)
            })();
        }
        let mut has_exp = false;
        if let Some(b'e' | b'E') = self.b.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.b.get(self.i) {
                self.i += 1;
            }
            if self.digit_run().1 == 0 {
                return None;
            }
            has_exp = true;
        }
        let text = self.text.get(start..self.i)?;
        if text.len() > 32 {
            return None;
        }
        let exact = m.filter(|_| !has_exp).and_then(|m| exact_f64(m, frac));
        let x = exact.or_else(|| text.parse::<f64>().ok())?;
        let f = x as f32;
        (f64::from(f) == x && f.is_finite() && !f.is_sign_negative()).then_some(f)
    }

    /// A run of digits, consumed: its value (None past `u64::MAX`) and length.
    fn digit_run(&mut self) -> (Option<u64>, usize) {
        let rest = self.b.get(self.i..).unwrap_or_default();
        let (v, n) = match uint(rest) {
            Some((v, n)) => (Some(v), n),
            None => (None, rest.iter().take_while(|c| c.is_ascii_digit()).count()),
        };
        self.i += n;
        (v, n)
    }

    /// The extent of any one value, for serde_json to parse: brackets counted outside
    /// strings, escapes skipped. Only valid JSON makes serde_json accept the extent,
    /// and for valid JSON the extent is exact.
    fn value_extent(&mut self) -> Option<&'a [u8]> {
        self.ws();
        let start = self.i;
        let mut depth = 0u32;
        loop {
            let c = *self.b.get(self.i)?;
            match c {
                b'"' => {
                    self.i += 1;
                    loop {
                        match *self.b.get(self.i)? {
                            b'\\' => self.i += 2,
                            b'"' => break,
                            _ => self.i += 1,
                        }
                    }
                    self.i += 1;
                }
                b'{' | b'[' => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return None;
                    }
                    self.i += 1;
                }
                b'}' | b']' if depth == 0 => break,
                b'}' | b']' => {
                    depth -= 1;
                    self.i += 1;
                }
                b',' | b' ' | b'\t' | b'\n' | b'\r' if depth == 0 => break,
                _ => self.i += 1,
            }
            if depth == 0 && matches!(c, b'"' | b'}' | b']') {
                break;
            }
        }
        self.b.get(start..self.i)
    }

    /// A value of any type, parsed by serde_json alone.
    fn serde<T: serde::de::DeserializeOwned>(&mut self) -> Option<T> {
        serde_json::from_slice(self.value_extent()?).ok()
    }

    /// The value of a member serde would ignore: it must still be valid JSON.
    fn ignored(&mut self) -> Option<()> {
        if self.peek()? == b'"' {
            return self.string().map(drop);
        }
        self.serde::<serde::de::IgnoredAny>().map(drop)
    }

    fn manifest(&mut self) -> Option<Manifest> {
        let mut format = None;
        let mut version = None;
        let mut features = None;
        let mut checkpoint_id = None;
        let mut shards = None;
        let mut tensors = None;
        let mut metadata = None;
        let mut optimizer: Option<Option<OptimizerSection>> = None;
        let mut globals: Option<Vec<GlobalEntry>> = None;
        let mut parts: Option<Vec<PartRef>> = None;
        let mut grids: Option<Vec<Grid>> = None;
        self.members(|p, key| match key {
            "format" => once(&mut format, p.string()?),
            "version" => once(&mut version, p.u64()?),
            "features" => {
                let mut v = Vec::new();
                p.elements(|p| {
                    v.push(p.string()?.to_owned());
                    Some(())
                })?;
                once(&mut features, v)
            }
            "checkpoint_id" => once(&mut checkpoint_id, p.string()?),
            "shards" => {
                let mut v = Vec::new();
                p.elements(|p| {
                    v.push(p.shard()?);
                    Some(())
                })?;
                once(&mut shards, v)
            }
            "tensors" => {
                let mut v = Vec::new();
                p.elements(|p| {
                    let start = p.i;
                    let t = match p.compact_tensor() {
                        Some(t) => t,
                        None => {
                            p.i = start;
                            p.tensor()?
                        }
                    };
                    v.push(t);
                    Some(())
                })?;
                once(&mut tensors, v)
            }
            "metadata" => once(&mut metadata, p.serde()?),
            "optimizer" => once(&mut optimizer, p.serde()?),
            "globals" => once(&mut globals, p.serde()?),
            "parts" => once(&mut parts, p.serde()?),
            "grids" => once(&mut grids, p.serde()?),
            _ => p.ignored(),
        })?;
        Some(Manifest {
            format: format?.to_owned(),
            version: version?,
            features: features.unwrap_or_default(),
            checkpoint_id: checkpoint_id?.to_owned(),
            shards: shards?,
            tensors: tensors?,
            metadata: metadata.unwrap_or_else(empty_object),
            optimizer: optimizer.flatten(),
            globals: globals.unwrap_or_default(),
            parts: parts.unwrap_or_default(),
            grids: grids.unwrap_or_default(),
        })
    }

    fn shard(&mut self) -> Option<ShardEntry> {
        let mut file = None;
        let mut size = None;
        let mut header_size = None;
        let mut header_crc32 = None;
        self.members(|p, key| match key {
            "file" => once(&mut file, p.string()?),
            "size" => once(&mut size, p.u64()?),
            "header_size" => once(&mut header_size, p.u64()?),
            "header_crc32" => once(&mut header_crc32, p.u32()?),
            _ => p.ignored(),
        })?;
        Some(ShardEntry {
            file: file?.to_owned(),
            size: size?,
            header_size: header_size?,
            header_crc32: header_crc32?,
        })
    }

    /// A shape: an array of `u64`, allocated once at its exact length.
    fn shape(&mut self) -> Option<Vec<u64>> {
        let mut dims = std::mem::take(&mut self.shape);
        dims.clear();
        let r = self.elements(|p| {
            dims.push(p.u64()?);
            Some(())
        });
        let v = dims.as_slice().to_vec();
        self.shape = dims;
        r.map(|()| v)
    }

    /// A tensor entry exactly as ckptstore writes it: compact, members in their
    /// order, `crc32` a number. A strict subset of [`Parser::tensor`]'s input, for
    /// which it gives the same value; on `None` the caller rewinds and uses that.
    fn compact_tensor(&mut self) -> Option<TensorInfo> {
        self.lit(b"{\"name\":")?;
        let name = self.string()?;
        self.lit(b",\"shard\":")?;
        let shard = usize::try_from(self.u64()?).ok()?;
        self.lit(b",\"dtype\":")?;
        let dtype = dtype_named(self.string()?)?;
        self.lit(b",\"shape\":")?;
        let shape = self.shape()?;
        self.lit(b",\"offsets\":[")?;
        let begin = self.u64()?;
        self.lit(b",")?;
        let end = self.u64()?;
        self.lit(b"],\"crc32\":")?;
        let crc32 = self.u32()?;
        let absmax = match self.lit(b",\"absmax\":") {
            Some(()) => Some(self.absmax()?),
            None => None,
        };
        let blocks = match self.lit(b",\"blocks\":{\"size\":") {
            Some(()) => {
                let size = self.u64()?;
                self.lit(b",\"crc32\":[")?;
                let mut crc32 = Vec::new();
                loop {
                    crc32.push(self.u32()?);
                    if self.lit(b",").is_none() {
                        break;
                    }
                }
                self.lit(b"]}")?;
                Some(BlockCrcs { size, crc32 })
            }
            None => None,
        };
        self.lit(b"}")?;
        Some(TensorInfo {
            name: name.to_owned(),
            shard,
            dtype,
            shape,
            offsets: [begin, end],
            crc32: Some(crc32),
            absmax,
            blocks,
        })
    }

    fn tensor(&mut self) -> Option<TensorInfo> {
        let mut name = None;
        let mut shard = None;
        let mut dtype = None;
        let mut shape = None;
        let mut offsets = None;
        let mut crc32: Option<Option<u32>> = None;
        let mut absmax: Option<Option<f32>> = None;
        let mut blocks: Option<BlockCrcs> = None;
        self.members(|p, key| match key {
            "name" => once(&mut name, p.string()?),
            "shard" => once(&mut shard, usize::try_from(p.u64()?).ok()?),
            "dtype" => once(&mut dtype, dtype_named(p.string()?)?),
            "shape" => {
                let v = p.shape()?;
                once(&mut shape, v)
            }
            "offsets" => {
                p.expect(b'[')?;
                let b = p.u64()?;
                p.expect(b',')?;
                let e = p.u64()?;
                p.expect(b']')?;
                once(&mut offsets, [b, e])
            }
            "crc32" => {
                let v = if p.null() { None } else { Some(p.u32()?) };
                once(&mut crc32, v)
            }
            // `de_absmax` refuses null: only a number.
            "absmax" => once(&mut absmax, Some(p.absmax()?)),
            "blocks" => {
                let v = p.serde()?;
                once(&mut blocks, v)
            }
            _ => p.ignored(),
        })?;
        Some(TensorInfo {
            name: name?.to_owned(),
            shard: shard?,
            dtype: dtype?,
            shape: shape?,
            offsets: offsets?,
            crc32: crc32.flatten(),
            absmax: absmax.flatten(),
            blocks,
        })
    }
}
