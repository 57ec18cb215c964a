//! `ckpt convert`: rewrite a checkpoint in another storage dtype.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::format::manifest::Encoding;
use ckptstore::optim::{ScaleShape, StateLayout, StateValue, Target, Tensor};
use ckptstore::{DType, Error, Result, SaveOptions, TensorRef};

use crate::util::{human, parse_size};

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    #[value(name = "f16-scaled")]
    F16Scaled,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16Scaled => "f16-scaled",
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Source: a ckptstore checkpoint, safetensors file, HF directory or s3:// URL.
    src: PathBuf,
    /// Destination checkpoint directory or s3:// URL (a checkpoint there is replaced
    /// atomically).
    #[arg(long)]
    out: PathBuf,
    /// Storage dtype for floating-point optimizer state shaped like its parameter and for
    /// floating-point model tensors (f16-scaled applies to optimizer state only; model
    /// tensors are then kept as stored).
    #[arg(long, value_enum)]
    dtype: Dtype,
    /// Most tensor bytes per shard.
    #[arg(long, value_parser = parse_size, default_value = "4GiB")]
    max_shard_size: u64,
}

fn convert_model(t: &ckptstore::TensorView<'_>, to: DType) -> Result<Option<Tensor>> {
    if !t.dtype().is_float() || t.dtype() == to {
        return Ok(None);
    }
    let x: Vec<f32> = match t.dtype() {
        DType::F32 => t.as_slice::<f32>()?.to_vec(),
        DType::BF16 => t
            .as_slice::<half::bf16>()?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        DType::F16 => t
            .as_slice::<half::f16>()?
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        DType::F64 if to == DType::BF16 => {
            let b: Vec<half::bf16> = t
                .as_slice::<f64>()?
                .iter()
                .map(|&v| ckptstore::convert::f64_to_bf16(v))
                .collect();
            return Tensor::from_slice(t.shape(), &b).map(Some);
        }
        DType::F64 => t.as_slice::<f64>()?.iter().map(|&v| v as f32).collect(),
        _ => return Ok(None),
    };
    match to {
        DType::F32 => Tensor::from_slice(t.shape(), &x).map(Some),
        _ => {
            let mut b = vec![half::bf16::ZERO; x.len()];
            ckptstore::convert::f32_to_bf16(&x, &mut b);
            Tensor::from_slice(t.shape(), &b).map(Some)
        }
    }
}

pub fn run(a: Args) -> Result<ExitCode> {
    let out = crate::util::location(&a.out)?;
    let ck = crate::util::open(&a.src)?;
    if ck.manifest().is_some() {
        ck.verify()?;
    }
    let (target, model_dtype) = match a.dtype {
        Dtype::F32 => (Target::F32, Some(DType::F32)),
        Dtype::Bf16 => (Target::BF16, Some(DType::BF16)),
        Dtype::F16Scaled => (Target::F16Scaled(ScaleShape::Keep), None),
    };
    let optim = ck.manifest().and_then(|m| m.optimizer.as_ref());
    let state = match optim {
        Some(_) => Some(ck.load_optimizer(&StateLayout::with_default(target))?),
        None => None,
    };
    // Model tensors: everything the optimizer section does not reference.
    let referenced: std::collections::HashSet<&str> = optim
        .map(|o| {
            o.params
                .iter()
                .flat_map(|p| &p.state)
                .flat_map(|s| std::iter::once(s.tensor.as_str()).chain(s.scale.as_deref()))
                .collect()
        })
        .unwrap_or_default();
    let mut converted: Vec<(String, Tensor)> = Vec::new();
    let mut borrowed: Vec<TensorRef<'_>> = Vec::new();
    // Why tensors were kept as stored: reason -> count.
    let mut kept: BTreeMap<String, usize> = BTreeMap::new();
    for t in ck
        .tensors()
        .iter()
        .filter(|t| !referenced.contains(t.name.as_str()))
    {
        let v = ck.read(&t.name).view()?;
        match model_dtype
            .map(|d| convert_model(&v, d))
            .transpose()?
            .flatten()
        {
            Some(c) => converted.push((t.name.clone(), c)),
            None => {
                let why = match model_dtype {
                    None => "model tensors (f16-scaled applies to optimizer state only)".into(),
                    Some(_) if !t.dtype.is_float() => "not floating point".into(),
                    Some(d) => format!("already {d}"),
                };
                *kept.entry(why).or_default() += 1;
                borrowed.push(TensorRef::new(
                    t.name.as_str(),
                    t.dtype,
                    &t.shape,
                    v.bytes(),
                ))
            }
        }
    }
    let mut n_converted = converted.len();
    if let (Some(sec), Some(st)) = (optim, &state) {
        for p in &sec.params {
            for s in &p.state {
                let stored = ck.info(&s.tensor)?.dtype;
                let Some(loaded) = st.state.get(&p.name).and_then(|m| m.get(&s.name)) else {
                    continue;
                };
                // Stored tensors behind this state: the codes and, if scaled, the scale.
                let n = 1 + usize::from(s.scale.is_some());
                let why = match (loaded, s.encoding) {
                    (StateValue::Plain(t), Encoding::Plain) if t.dtype() != stored => None,
                    (StateValue::Plain(_), Encoding::Plain) if !stored.is_float() => {
                        Some("not floating point".to_string())
                    }
                    (StateValue::Plain(_), Encoding::Plain) if model_dtype == Some(stored) => {
                        Some(format!("already {stored}"))
                    }
                    (StateValue::Plain(_), Encoding::Plain) => {
                        Some("optimizer scalars and counters such as step (never converted)".into())
                    }
                    (StateValue::F16Scaled { .. }, Encoding::F16Scaled) => {
                        Some("already f16-scaled (codes and scales)".into())
                    }
                    _ => None,
                };
                match why {
                    None => n_converted += n,
                    Some(why) => *kept.entry(why).or_default() += n,
                }
            }
        }
    }
    let mut model = borrowed;
    model.extend(
        converted
            .iter()
            .map(|(n, c)| TensorRef::new(n.as_str(), c.dtype(), c.shape(), c.bytes())),
    );
    let opts = SaveOptions {
        max_shard_size: a.max_shard_size,
        metadata: ck.metadata().clone(),
        progress: None,
        ..Default::default()
    };
    let info = match &state {
        Some(s) => s.save(&out, &model, &opts)?,
        None => ckptstore::save(&out, &model, &opts)?,
    };
    if info.tensors == 0 && !ck.tensors().is_empty() {
        return Err(Error::InvalidArgument("nothing was written".into()));
    }
    let kept_total: usize = kept.values().sum();
    outln!(
        "wrote {} tensors ({}) into {} ({} shard(s), checkpoint {}); of the source's {}: {n_converted} converted to {}, {kept_total} kept as stored",
        info.tensors,
        human(info.data_bytes),
        out,
        info.shards,
        info.checkpoint_id,
        ck.tensors().len(),
        a.dtype.name(),
    );
    for (why, n) in &kept {
        outln!("  kept as stored: {n} {why}");
    }
    Ok(ExitCode::SUCCESS)
}
