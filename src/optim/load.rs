//! Loading optimizer state from a checkpoint into fresh buffers.

use std::collections::{BTreeMap, HashMap};

use rayon::prelude::*;

use super::state::{convert_plain, typed, unscale};
use super::{
    BufferPool, OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout, StateValue, Target,
    Tensor,
};
use crate::checkpoint::{Checkpoint, Region, TensorInfo};
use crate::convert;
use crate::crc::crc32_parallel;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::manifest::{Encoding, OptimizerSection};
use crate::view::TensorView;

enum Source<'a> {
    Plain(&'a TensorInfo),
    Scaled {
        q: &'a TensorInfo,
        scale: &'a TensorInfo,
    },
}

struct Job<'a> {
    param: &'a str,
    state: &'a str,
    source: Source<'a>,
    target: Target,
}

/// How [`Checkpoint::load_optimizer_opts`] and [`super::OptimizerState::restore_from_opts`]
/// load: where destination buffers come from and what happens to the source's pages.
/// The default is [`Checkpoint::load_optimizer`]'s: fresh buffers, pages kept mapped.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct LoadOptions<'p> {
    /// Take destination buffers from this pool where it holds some of the right sizes.
    pub pool: Option<&'p BufferPool>,
    /// Release each source tensor's mapped pages once it is converted.
    pub release_pages: bool,
}

impl<'p> LoadOptions<'p> {
    /// Buffers from `pool`.
    pub fn pool(mut self, pool: &'p BufferPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Release the source's pages as tensors are converted.
    pub fn release_pages(mut self, yes: bool) -> Self {
        self.release_pages = yes;
        self
    }
}

impl<B: AsRef<[u8]> + Send + Sync + crate::mmap::ReleasePages> Checkpoint<B> {
    /// Load the checkpoint's optimizer state in `layout`, into freshly allocated buffers.
    ///
    /// Rayon-parallel across tensors and within large ones. The source mapping is only
    /// read; the CRC32 of every tensor read is checked against the manifest. Parameters
    /// without state in the checkpoint have no entry in the returned state.
    ///
    /// # Errors
    /// [`Error::InvalidOptimizerState`] if the checkpoint has no optimizer section or it is
    /// inconsistent (naming parameter and state); [`Error::ChecksumMismatch`] for damaged
    /// bytes; [`Error::Conversion`] for a conversion that cannot be done (a non-float state
    /// asked as F32, an FP32 state with infinities asked as F16-scaled).
    pub fn load_optimizer(&self, layout: &StateLayout) -> Result<OptimizerState> {
        self.load_optimizer_impl(layout, None, None)
    }

    /// [`Checkpoint::load_optimizer`] with options ([`LoadOptions`]): destination buffers
    /// from a [`BufferPool`] (buffers of dropped tensors, already faulted in; the loaded
    /// tensors give theirs back to the pool when dropped), and each source tensor's mapped
    /// pages released from this process once it is converted (the resident memory of a
    /// restore stays about the size of the loaded state, not that plus the mapped
    /// checkpoint; a later load from the same `Checkpoint` maps the pages again, from the
    /// page cache). Results are bit-identical to `load_optimizer`.
    ///
    /// # Errors
    /// As [`Checkpoint::load_optimizer`]; on error every buffer taken goes back to the pool.
    pub fn load_optimizer_opts(
        &self,
        layout: &StateLayout,
        opts: &LoadOptions<'_>,
    ) -> Result<OptimizerState> {
        let release: Option<&(dyn Fn(&TensorInfo) + Sync)> = if opts.release_pages {
            Some(&|t| self.release_tensor(t))
        } else {
            None
        };
        self.load_optimizer_impl(layout, opts.pool, release)
    }

    /// `release(t)` is called once tensor `t` of the checkpoint has been read.
    pub(crate) fn load_optimizer_impl(
        &self,
        layout: &StateLayout,
        pool: Option<&BufferPool>,
        release: Option<&(dyn Fn(&TensorInfo) + Sync)>,
    ) -> Result<OptimizerState> {
        let sec = self
            .manifest()
            .and_then(|m| m.optimizer.as_ref())
            .ok_or_else(|| Error::optim("", "", "the checkpoint holds no optimizer state"))?;
        self.check_optimizer_section()?;
        // State stored as global tensors (format-spec/global.md) is assembled by region:
        // the partition path with every parameter whole.
        let chunked = sec.params.iter().flat_map(|p| &p.state).any(|s| {
            self.global(&s.tensor).is_some()
                || s.scale
                    .as_deref()
                    .is_some_and(|sc| self.global(sc).is_some())
        });
        if chunked {
            if pool.is_some() {
                return Err(Error::InvalidArgument(
                    "a BufferPool cannot serve optimizer state stored as global tensors: use load_optimizer".into(),
                ));
            }
            return self.load_optimizer_partition(layout, &HashMap::new());
        }
        let shapes: HashMap<&str, &[u64]> = sec
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        let mut jobs = Vec::new();
        for p in &sec.params {
            for s in &p.state {
                // Validated above: every tensor exists.
                let source = match (s.encoding, &s.scale) {
                    (Encoding::F16Scaled, Some(sc)) => Source::Scaled {
                        q: self.info(&s.tensor)?,
                        scale: self.info(sc)?,
                    },
                    _ => Source::Plain(self.info(&s.tensor)?),
                };
                // Scaled states are floating-point by definition.
                let (float, shape) = match &source {
                    Source::Plain(t) => (t.dtype.is_float(), &t.shape),
                    Source::Scaled { q, .. } => (true, &q.shape),
                };
                let target = layout.target(&p.name, &s.name, float, shape, &p.shape);
                jobs.push(Job {
                    param: &p.name,
                    state: &s.name,
                    source,
                    target,
                });
            }
        }
        let values = self.run_jobs(&jobs, pool, release)?;

        let keys = jobs.iter().map(|j| (j.param, j.state));
        Ok(assemble(sec, keys, values, |n| {
            shapes.get(n).map_or(Vec::new(), |s| s.to_vec())
        }))
    }

    /// Load the optimizer state of one rank's partition: for each parameter named in
    /// `partition`, only the region of it that the rank holds (in the parameter's global
    /// index space), read from whatever chunking the checkpoint was saved with; parameters
    /// not named are loaded whole. States shaped like their parameter are read by region
    /// ([`Read::region`](crate::checkpoint::Read::region), every chunk read CRC-checked); scalar states (`step`)
    /// whole. The layout applies as in [`Checkpoint::load_optimizer`], to each rank's
    /// region: an F16-scaled target computes the scale from the region's own absmax, as
    /// FusedAdam does per local tensor. The returned state's parameter shapes are the
    /// regions' shapes; it is built whole in fresh buffers, or not at all.
    ///
    /// # Errors
    /// As [`Checkpoint::load_optimizer`]; [`Error::InvalidArgument`] for a partition
    /// naming a parameter the checkpoint does not have, or a region of the wrong rank or
    /// out of the parameter's bounds.
    pub fn load_optimizer_partition(
        &self,
        layout: &StateLayout,
        partition: &HashMap<String, Region>,
    ) -> Result<OptimizerState> {
        let sec = self
            .manifest()
            .and_then(|m| m.optimizer.as_ref())
            .ok_or_else(|| Error::optim("", "", "the checkpoint holds no optimizer state"))?;
        self.check_optimizer_section()?;
        let mut regions: HashMap<&str, Region> = HashMap::new();
        for p in &sec.params {
            let r = match partition.get(&p.name) {
                Some(r) => {
                    let fits = r.offsets.len() == p.shape.len()
                        && r.shape.len() == p.shape.len()
                        && (0..p.shape.len()).all(|d| {
                            r.offsets[d]
                                .checked_add(r.shape[d])
                                .is_some_and(|e| e <= p.shape[d])
                        });
                    if !fits {
                        return Err(Error::InvalidArgument(format!(
                            "partition: parameter {:?} of shape {:?}: region offsets {:?}, shape {:?} does not fit it",
                            p.name, p.shape, r.offsets, r.shape
                        )));
                    }
                    r.clone()
                }
                None => Region::new(&vec![0; p.shape.len()], &p.shape),
            };
            regions.insert(&p.name, r);
        }
        if let Some(n) = partition.keys().find(|n| !regions.contains_key(n.as_str())) {
            return Err(Error::InvalidArgument(format!(
                "partition names parameter {n:?}, which the checkpoint's optimizer state does not have"
            )));
        }
        let jobs: Vec<(
            &str,
            &str,
            &Region,
            &crate::format::manifest::StateEntry,
            &[u64],
        )> = sec
            .params
            .iter()
            .flat_map(|p| {
                let r = &regions[p.name.as_str()];
                p.state
                    .iter()
                    .map(move |s| (p.name.as_str(), s.name.as_str(), r, s, p.shape.as_slice()))
            })
            .collect();
        let values: Vec<StateValue> = jobs
            .par_iter()
            .map(|&(param, state, r, s, pshape)| {
                let conv = |reason: String| Error::Conversion {
                    param: param.into(),
                    state: state.into(),
                    reason,
                };
                let (_, stored_shape) = self.shape_of(&s.tensor)?;
                let shaped = stored_shape == pshape;
                let data = if shaped {
                    self.read_region(&s.tensor, &r.offsets, &r.shape)?
                } else {
                    self.read(&s.tensor).to_tensor()?
                };
                let float = data.dtype().is_float() || s.encoding == Encoding::F16Scaled;
                let target = layout.target(param, state, float, stored_shape, pshape);
                match (&s.scale, target) {
                    (None, Target::AsStored) => Ok(StateValue::Plain(data)),
                    (None, t) => {
                        if !data.dtype().is_float() {
                            return Err(conv(format!(
                                "the stored {} state is not floating-point and cannot be loaded as {t:?}",
                                data.dtype()
                            )));
                        }
                        if matches!(
                            (t, data.dtype()),
                            (Target::F32, DType::F32) | (Target::BF16, DType::BF16)
                        ) {
                            return Ok(StateValue::Plain(data));
                        }
                        let v = TensorView::new(&s.tensor, data.dtype(), data.shape(), data.bytes());
                        convert_plain(&v, t, None, conv)
                    }
                    (Some(sc), t) => {
                        let scale = self.read(sc).to_tensor()?;
                        match t {
                            Target::AsStored | Target::F16Scaled(ScaleShape::Keep) => {
                                Ok(StateValue::F16Scaled { q: data, scale })
                            }
                            Target::F16Scaled(sh) => Ok(StateValue::F16Scaled {
                                q: data,
                                scale: scale.reshaped(sh.dims()),
                            }),
                            t => {
                                let sv = scale
                                    .as_slice::<f32>()?
                                    .first()
                                    .copied()
                                    .ok_or_else(|| conv("empty scale".into()))?;
                                let v = TensorView::new(&s.tensor, data.dtype(), data.shape(), data.bytes());
                                unscale(&v, sv, t, None)
                            }
                        }
                    }
                }
            })
            .collect::<Result<_>>()?;
        let keys = jobs.iter().map(|j| (j.0, j.1));
        Ok(assemble(sec, keys, values, |n| {
            regions.get(n).map_or(Vec::new(), |r| r.shape.clone())
        }))
    }

    /// Run `jobs`, the results in `jobs` order, with read-ahead of their source bytes
    /// (see [`crate::checkpoint::with_readahead`]): behind a streaming reader (cold bytes,
    /// [`crate::checkpoint::ReadStrategy::Stream`]), in file order one tensor after the
    /// other (each parallel inside), or all tensors in parallel, per the read strategy.
    fn run_jobs(
        &self,
        jobs: &[Job<'_>],
        pool: Option<&BufferPool>,
        release: Option<&(dyn Fn(&TensorInfo) + Sync)>,
    ) -> Result<Vec<StateValue>> {
        let run = |j: &Job<'_>| {
            let v = self.run_job(j, pool)?;
            if let Some(r) = release {
                match &j.source {
                    Source::Plain(t) => r(t),
                    Source::Scaled { q, scale } => {
                        r(q);
                        r(scale);
                    }
                }
            }
            Ok(v)
        };
        let first = |j: &Job<'_>| match &j.source {
            Source::Plain(t) | Source::Scaled { q: t, .. } => (t.shard, t.offsets[0]),
        };
        let sources: Vec<&TensorInfo> = jobs
            .iter()
            .flat_map(|j| match &j.source {
                Source::Plain(t) => [Some(*t), None],
                Source::Scaled { q, scale } => [Some(*q), Some(*scale)],
            })
            .flatten()
            .collect();
        let ranges = self.ranges_in_file_order(&sources);
        let r = crate::checkpoint::with_readahead(&ranges, true, |gate| {
            let mut order: Vec<usize> = (0..jobs.len()).collect();
            order.sort_by_key(|&i| first(&jobs[i]));
            if gate.streaming() {
                return self.run_streamed(jobs, &order, gate, &run);
            }
            if !crate::checkpoint::in_order() {
                return jobs.par_iter().map(run).collect::<Result<Vec<_>>>();
            }
            let mut out: Vec<Option<StateValue>> = (0..jobs.len()).map(|_| None).collect();
            for i in order {
                out[i] = Some(run(&jobs[i])?);
            }
            Ok(out.into_iter().flatten().collect())
        });
        match r {
            // Damage is said before a conversion that cannot be done: a load that found a
            // state it cannot convert checks every source's CRC (in file order) and
            // refuses a damaged one as damaged, whichever job ran first.
            Err(e @ Error::Conversion { .. }) => {
                let mut sorted = sources;
                sorted.sort_by_key(|t| (t.shard, t.offsets[0]));
                for t in sorted {
                    self.checked_view(t)?;
                }
                Err(e)
            }
            r => r,
        }
    }

    /// Run `jobs` behind a streaming reader ([`crate::checkpoint::ReadStrategy::Stream`]):
    /// every rayon thread takes the next job in file order (`order`), waits until the
    /// reader has read its sources, and runs it; so the converters follow the reader
    /// together and never fault on a cold page. Results in `jobs` order; the first error
    /// in file order stops the taking of further jobs.
    fn run_streamed(
        &self,
        jobs: &[Job<'_>],
        order: &[usize],
        gate: &crate::checkpoint::Gate<'_>,
        run: &(dyn Fn(&Job<'_>) -> Result<StateValue> + Sync),
    ) -> Result<Vec<StateValue>> {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let out: Vec<std::sync::Mutex<Option<Result<StateValue>>>> =
            jobs.iter().map(|_| std::sync::Mutex::new(None)).collect();
        rayon::broadcast(|_| {
            while !failed.load(Ordering::Relaxed) {
                let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                match &jobs[i].source {
                    Source::Plain(t) => gate.wait_for(self.view(t).bytes()),
                    Source::Scaled { q, scale } => {
                        gate.wait_for(self.view(q).bytes());
                        gate.wait_for(self.view(scale).bytes());
                    }
                }
                let r = run(&jobs[i]);
                if r.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                *out[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            }
        });
        let mut out: Vec<Option<Result<StateValue>>> = out
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
            .collect();
        // The first error in file order, else every result (then every job ran).
        for &i in order {
            if matches!(out[i], Some(Err(_))) {
                if let Some(Err(e)) = out[i].take() {
                    return Err(e);
                }
            }
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(Error::InvalidArgument("a load job did not run".into())))
            })
            .collect()
    }

    /// A view of `t` whose CRC32 was just checked.
    fn checked_view<'a>(&'a self, t: &'a TensorInfo) -> Result<TensorView<'a>> {
        let v = self.view(t);
        self.check_crc(t, crc32_parallel(v.bytes()))?;
        Ok(v)
    }

    /// An exact copy of `t` into a new tensor, its CRC checked in the same pass.
    fn copy_checked(&self, t: &TensorInfo, pool: Option<&BufferPool>) -> Result<Tensor> {
        let v = self.view(t);
        let mut out = Tensor::for_overwrite(v.dtype(), v.shape(), pool)?;
        let crc = convert::crc32_copy(v.bytes(), out.bytes_mut());
        self.check_crc(t, crc)?;
        Ok(out)
    }

    fn run_job(&self, j: &Job<'_>, pool: Option<&BufferPool>) -> Result<StateValue> {
        let conv = |reason: String| Error::Conversion {
            param: j.param.into(),
            state: j.state.into(),
            reason,
        };
        match (&j.source, j.target) {
            (Source::Plain(t), Target::AsStored) => {
                Ok(StateValue::Plain(self.copy_checked(t, pool)?))
            }
            (
                Source::Scaled { q, scale },
                Target::AsStored | Target::F16Scaled(ScaleShape::Keep),
            ) => Ok(StateValue::F16Scaled {
                q: self.copy_checked(q, pool)?,
                scale: self.copy_checked(scale, None)?,
            }),
            (Source::Scaled { q, scale }, t) => {
                let sv = self.checked_view(scale)?;
                let s = typed::<f32>(&sv)
                    .first()
                    .copied()
                    .ok_or_else(|| conv("empty scale".into()))?;
                if let Target::F16Scaled(sh) = t {
                    return Ok(StateValue::F16Scaled {
                        q: self.copy_checked(q, pool)?,
                        scale: Tensor::scalar_f32(s).reshaped(sh.dims()),
                    });
                }
                let qv = self.checked_view(q)?;
                unscale(&qv, s, t, pool)
            }
            (Source::Plain(t), Target::F16Scaled(sh)) if t.dtype == DType::F32 => {
                let v = self.view(t);
                let x = typed::<f32>(&v);
                let mut q = Tensor::for_overwrite(DType::F16, &t.shape, pool)?;
                let s = match t.absmax {
                    // One pass: CRC and conversion per chunk, the absmax recorded at save
                    // time checked against the data on the way.
                    Some(recorded) => {
                        let (s, r) =
                            convert::scale_for(recorded).map_err(|e| conv(e.to_string()))?;
                        let (crc, bits) = convert::crc32_f32_mul_to_f16(&x, r, q.as_mut_slice()?);
                        self.check_crc(t, crc)?;
                        if bits != recorded.to_bits() {
                            return Err(Error::AbsmaxMismatch {
                                tensor: t.name.clone(),
                                shard: t.shard,
                                file: self.shards()[t.shard].file.clone(),
                                recorded,
                                actual: f32::from_bits(bits),
                            });
                        }
                        s
                    }
                    // No absmax recorded (older or foreign checkpoints, non-finite data):
                    // one pass for the CRC and the absmax, one to convert.
                    None => {
                        let (crc, absmax) = convert::crc32_and_absmax_f32(v.bytes(), &x);
                        self.check_crc(t, crc)?;
                        let absmax = absmax
                            .ok_or_else(|| conv(convert::ScaleError::NonFinite.to_string()))?;
                        let (s, r) = convert::scale_for(absmax).map_err(|e| conv(e.to_string()))?;
                        convert::f32_mul_to_f16(&x, r, q.as_mut_slice()?);
                        s
                    }
                };
                Ok(StateValue::F16Scaled {
                    q,
                    scale: Tensor::scalar_f32(s).reshaped(sh.dims()),
                })
            }
            (Source::Plain(t), target) => {
                if !t.dtype.is_float() {
                    return Err(conv(format!("the stored {} state is not floating-point and cannot be loaded as {target:?}", t.dtype)));
                }
                match (target, t.dtype) {
                    (Target::F32, DType::F32) | (Target::BF16, DType::BF16) => {
                        return Ok(StateValue::Plain(self.copy_checked(t, pool)?));
                    }
                    (Target::BF16, DType::F32) => {
                        let v = self.view(t);
                        let mut out = Tensor::for_overwrite(DType::BF16, &t.shape, pool)?;
                        let crc =
                            convert::crc32_f32_to_bf16(&typed::<f32>(&v), out.as_mut_slice()?);
                        self.check_crc(t, crc)?;
                        return Ok(StateValue::Plain(out));
                    }
                    _ => {}
                }
                let v = self.checked_view(t)?;
                convert_plain(&v, target, pool, conv)
            }
        }
    }
}

/// The loaded state: `values[i]` is state `keys[i]` = (parameter, state name); groups and
/// hyperparameters from the section, each parameter with the shape `shape(name)`.
fn assemble<'k>(
    sec: &OptimizerSection,
    keys: impl Iterator<Item = (&'k str, &'k str)>,
    values: Vec<StateValue>,
    shape: impl Fn(&str) -> Vec<u64>,
) -> OptimizerState {
    let mut state: BTreeMap<String, BTreeMap<String, StateValue>> = BTreeMap::new();
    for ((param, name), v) in keys.zip(values) {
        state
            .entry(param.to_string())
            .or_default()
            .insert(name.to_string(), v);
    }
    let groups = sec
        .groups
        .iter()
        .map(|g| ParamGroup {
            params: g
                .params
                .iter()
                .map(|n| ParamSpec::new(n.clone(), &shape(n)))
                .collect(),
            hyper: g.hyper.as_object().cloned().unwrap_or_default(),
        })
        .collect();
    OptimizerState { groups, state }
}
