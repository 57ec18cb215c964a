//! Verification: every tensor's bytes (or blocks) against the CRC32s and absmax values the
//! manifest records, in parallel, with the first damaged tensor named
//! (format-spec/integrity.md).

use rayon::prelude::*;

use super::*;

/// The CRC32 of `bytes` and, if `with_abs`, the largest `|x|` bits of them read as
/// little-endian FP32 (0 otherwise): one piece's sums for
/// [`check_units`].
pub(crate) fn unit_sum(bytes: &[u8], with_abs: bool) -> (u32, u32) {
    let abs = if with_abs {
        crate::convert::absbits_le_bytes(bytes)
    } else {
        0
    };
    (crc32fast::hash(bytes), abs)
}

/// Judge tensor `t` from the sums ([`unit_sum`]: CRC32 and absmax bits) of its
/// consecutive `unit`-byte pieces, the last one shorter; errors name `file`. With block CRCs `unit` must
/// be the block size: each block is checked, then the blocks' combination against the
/// tensor's `crc32`; without, the pieces' CRCs are combined into the tensor's. `unit`
/// must be a multiple of 4 where an absmax is recorded (pieces start on elements).
pub(crate) fn check_units(
    t: &TensorInfo,
    file: &str,
    unit: u64,
    sums: &[(u32, u32)],
) -> Result<()> {
    let crcs: Vec<u32> = sums.iter().map(|s| s.0).collect();
    let combined = if let Some(bl) = &t.blocks {
        if bl.size != unit || bl.crc32.len() != sums.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: {} sums of {unit}-byte pieces for {} blocks of {}",
                t.name,
                sums.len(),
                bl.crc32.len(),
                bl.size
            )));
        }
        for (i, (&got, &expected)) in crcs.iter().zip(&bl.crc32).enumerate() {
            if got != expected {
                return Err(Error::ChecksumMismatch {
                    what: format!("tensor {:?}, block {i}", t.name),
                    shard: t.shard,
                    file: file.to_string(),
                    expected,
                    got,
                });
            }
        }
        // Counts were checked at open (M18), so this is `Some`.
        crate::crc::combine_blocks(&bl.crc32, bl.size, t.nbytes())
    } else {
        crate::crc::combine_blocks(&crcs, unit, t.nbytes())
    };
    // `None` (a count that does not fit) fails the check.
    check_crc_in(t, file, combined.unwrap_or(!t.crc32.unwrap_or(0)))?;
    let Some(recorded) = t.absmax else {
        return Ok(());
    };
    let bits = sums.iter().map(|s| s.1).max().unwrap_or(0);
    check_absmax_in(t, file, recorded, crate::convert::absmax_from_bits(bits))
}

/// Check `got` against the CRC32 the manifest records for `t` (in `file`).
pub(crate) fn check_crc_in(t: &TensorInfo, file: &str, got: u32) -> Result<()> {
    match t.crc32 {
        Some(expected) if expected != got => Err(Error::ChecksumMismatch {
            what: format!("tensor {:?}", t.name),
            shard: t.shard,
            file: file.to_string(),
            expected,
            got,
        }),
        _ => Ok(()),
    }
}

/// Check `actual` (`None`: a non-finite element) against the absmax recorded for `t`.
pub(super) fn check_absmax_in(
    t: &TensorInfo,
    file: &str,
    recorded: f32,
    actual: Option<f32>,
) -> Result<()> {
    let actual = actual.unwrap_or(f32::INFINITY);
    if actual.to_bits() != recorded.to_bits() {
        return Err(Error::AbsmaxMismatch {
            tensor: t.name.clone(),
            shard: t.shard,
            file: file.to_string(),
            recorded,
            actual,
        });
    }
    Ok(())
}

impl<S: ShardSource> Checkpoint<S> {
    /// Check everything `open` does not: parse every shard header and check it agrees
    /// with the manifest (names, dtypes, shapes, offsets, checkpoint id), check the
    /// optimizer section's references, and check the CRC32 of every tensor, rayon-parallel
    /// across tensors and within large ones.
    ///
    /// # Errors
    /// [`Error::InvalidHeader`] / [`Error::ShardMismatch`] for a header that disagrees with
    /// the manifest; [`Error::InvalidOptimizerState`] for a broken optimizer section;
    /// [`Error::ChecksumMismatch`] naming the shard and tensor of the first mismatch in
    /// manifest order; [`Error::AbsmaxMismatch`] if an F32 tensor's recorded absmax is not
    /// its data's (checked in the same pass as its CRC). For stores without checksums the structure was validated at open
    /// and the report says `checksummed: false`.
    pub fn verify(&self) -> Result<VerifyReport> {
        self.verify_opts(&VerifyOptions::default())
    }

    /// [`Checkpoint::verify`] with options ([`VerifyOptions`]): only some tensors' CRC32s,
    /// a progress callback, pages released as tensors are checked.
    ///
    /// # Errors
    /// As [`Checkpoint::verify`]; for [`VerifyOptions::tensors`], [`Error::TensorNotFound`]
    /// for an unknown name (before anything is read) and [`Error::ChecksumMismatch`] for
    /// the first damaged tensor in the order named.
    pub fn verify_opts(&self, opts: &VerifyOptions<'_>) -> Result<VerifyReport> {
        let progress = opts.progress.unwrap_or(&|_| {});
        if let Some(names) = opts.tensors {
            self.verify_tensors(names, opts.release_pages, progress)?;
            let mut bytes = 0;
            for n in names {
                bytes += self.info(n)?.nbytes();
            }
            return Ok(VerifyReport {
                tensors: names.len(),
                bytes,
                checksummed: self.kind == Kind::Native,
            });
        }
        self.verify_all(progress, opts.release_pages)
    }

    /// Every check of [`Checkpoint::verify`], calling `progress` with the byte count of each
    /// tensor checked, releasing each tensor's pages once checked when `release` is set.
    fn verify_all(&self, progress: &(dyn Fn(u64) + Sync), release: bool) -> Result<VerifyReport> {
        self.check_headers()?;
        self.check_optimizer_section()?;
        if self.kind != Kind::Native {
            return Ok(VerifyReport {
                tensors: 0,
                bytes: 0,
                checksummed: false,
            });
        }
        let first_bad = if self.resident() {
            self.tensors()
                .par_iter()
                .enumerate()
                .filter_map(|(i, t)| {
                    let r = self.check_tensor(t);
                    progress(t.nbytes());
                    if release {
                        self.shards[t.shard].bytes.release(t.offsets[0], t.nbytes());
                    }
                    r.err().map(|e| (i, e))
                })
                .min_by_key(|(i, _)| *i)
        } else {
            // Fetched shards: one tensor at a time (memory stays about one tensor), in
            // file order, each CRC-checked as its bytes land; the first failure in
            // manifest order is reported, as for resident shards.
            let mut bad: Option<(usize, Error)> = None;
            for (i, t) in self.in_file_order() {
                if !self.data_verified {
                    if let Err(e) = self.read_info(t) {
                        if bad.as_ref().is_none_or(|(j, _)| i < *j) {
                            bad = Some((i, e));
                        }
                    }
                }
                progress(t.nbytes());
            }
            bad
        };
        if let Some((_, e)) = first_bad {
            return Err(e);
        }
        let mut report = VerifyReport {
            tensors: self.tensors().len(),
            bytes: self.tensors().iter().map(TensorInfo::nbytes).sum(),
            checksummed: true,
        };
        // A two-level checkpoint: every part, each checked as a checkpoint of its own.
        if let Some(set) = &self.parts {
            for p in 0..set.len() {
                let l = self.part(p as u32)?;
                let r = l.ck.verify_all(progress, release)?;
                report.tensors += r.tensors;
                report.bytes += r.bytes;
            }
        }
        Ok(report)
    }

    /// The CRC32 of one tensor and, where the manifest records one, its absmax: both in
    /// one pass over the bytes.
    ///
    /// With block CRCs (format-spec/integrity.md §Block CRCs) the pass computes each
    /// block's CRC (and absmax bits), checks every block, and checks that the blocks
    /// combine to the tensor's `crc32`.
    pub(super) fn check_tensor(&self, t: &TensorInfo) -> Result<()> {
        if self.data_verified {
            return Ok(());
        }
        let Some(bytes) = self.stored_bytes(t) else {
            return self.read_info(t).map(drop);
        };
        let v = TensorView::new(&t.name, t.dtype, &t.shape, bytes);
        if let Some(bl) = &t.blocks {
            let with_abs = t.absmax.is_some();
            let sums: Vec<(u32, u32)> = v
                .bytes()
                .par_chunks(usize::try_from(bl.size).unwrap_or(usize::MAX))
                .map(|c| unit_sum(c, with_abs))
                .collect();
            return check_units(t, &self.shards[t.shard].file, bl.size, &sums);
        }
        let Some(recorded) = t.absmax else {
            return self.check_crc(t, crc32_parallel(v.bytes()));
        };
        let (crc, actual) = match v.as_slice::<f32>() {
            Ok(x) => crate::convert::crc32_and_absmax_f32(v.bytes(), x),
            Err(_) => (
                crc32_parallel(v.bytes()),
                crate::convert::absmax_f32_le_bytes(v.bytes()),
            ),
        };
        self.check_crc(t, crc)?;
        self.check_absmax(t, recorded, actual)
    }
}

impl<S> Checkpoint<S> {
    pub(crate) fn check_crc(&self, t: &TensorInfo, got: u32) -> Result<()> {
        check_crc_in(t, &self.shards[t.shard].file, got)
    }

    /// Take the sums of every tensor's pieces, computed while the bytes arrived in this
    /// checkpoint's own buffers (`sums[i]` for `tensors()[i]`, in pieces of `units[i]`
    /// bytes; [`check_units`]). If every tensor passes, mark the data verified, so that
    /// [`Checkpoint::verify`] and checked reads do not read it again ([`data_verified`]).
    /// Otherwise change nothing: the checks run as usual and report the failure then.
    /// Only for storage that owns its bytes: nothing can change them after this.
    ///
    /// [`data_verified`]: Checkpoint::data_verified
    #[cfg_attr(not(feature = "s3"), allow(dead_code))] // the object-store download calls it
    pub(crate) fn accept_unit_sums(&mut self, units: &[u64], sums: &[Vec<(u32, u32)>]) {
        let ts = self.tensors();
        let ok =
            units.len() == ts.len()
                && sums.len() == ts.len()
                && ts.iter().zip(units).zip(sums).all(|((t, &unit), s)| {
                    check_units(t, &self.shards[t.shard].file, unit, s).is_ok()
                });
        self.data_verified |= ok;
    }

    pub(super) fn check_absmax(
        &self,
        t: &TensorInfo,
        recorded: f32,
        actual: Option<f32>,
    ) -> Result<()> {
        check_absmax_in(t, &self.shards[t.shard].file, recorded, actual)
    }
}

/// How [`Checkpoint::verify_opts`] verifies. The default is [`Checkpoint::verify`]'s:
/// every header, the optimizer section and every tensor, no progress calls, pages kept.
#[derive(Clone, Copy, Default)]
#[non_exhaustive]
pub struct VerifyOptions<'a> {
    /// Check only the CRC32 of these tensors (stored tensors, by name: no header or
    /// optimizer-section checks), rayon-parallel across tensors and within large ones;
    /// `None` checks everything.
    pub tensors: Option<&'a [&'a str]>,
    /// Called with the byte count of each tensor checked.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
    /// Release each tensor's mapped pages from this process once it is checked (they stay
    /// in the page cache).
    pub release_pages: bool,
}

impl std::fmt::Debug for VerifyOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifyOptions")
            .field("tensors", &self.tensors)
            .field("progress", &self.progress.is_some())
            .field("release_pages", &self.release_pages)
            .finish()
    }
}

impl<'a> VerifyOptions<'a> {
    /// Check only these tensors' CRC32s.
    pub fn tensors(mut self, names: &'a [&'a str]) -> Self {
        self.tensors = Some(names);
        self
    }

    /// Call `f` with the byte count of each tensor checked.
    pub fn progress(mut self, f: &'a (dyn Fn(u64) + Sync)) -> Self {
        self.progress = Some(f);
        self
    }

    /// Release each tensor's mapped pages once it is checked.
    pub fn release_pages(mut self, yes: bool) -> Self {
        self.release_pages = yes;
        self
    }
}
