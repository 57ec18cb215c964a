//! `ckpt convert`: rewrite a checkpoint in another storage dtype.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::optim::{ScaleShape, StateLayout, Target, Tensor};
use ckptstore::{Checkpoint, DType, Error, Result, SaveOptions, TensorRef};

use crate::util::{human, parse_size};

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    #[value(name = "f16-scaled")]
    F16Scaled,
}

#[derive(clap::Args)]
pub struct Args {
    /// Source: a ckptstore checkpoint, safetensors file or HF directory.
    src: PathBuf,
    /// Destination checkpoint directory (a checkpoint there is replaced atomically).
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
    let ck = Checkpoint::open(&a.src)?;
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
    for t in ck
        .tensors()
        .iter()
        .filter(|t| !referenced.contains(t.name.as_str()))
    {
        let v = ck.tensor_verified(&t.name)?;
        match model_dtype
            .map(|d| convert_model(&v, d))
            .transpose()?
            .flatten()
        {
            Some(c) => converted.push((t.name.clone(), c)),
            None => borrowed.push(TensorRef::new(
                t.name.as_str(),
                t.dtype,
                &t.shape,
                v.bytes(),
            )),
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
    };
    let info = match &state {
        Some(s) => s.save(&a.out, &model, &opts)?,
        None => ckptstore::save(&a.out, &model, &opts)?,
    };
    if info.tensors == 0 && !ck.tensors().is_empty() {
        return Err(Error::InvalidArgument("nothing was written".into()));
    }
    println!(
        "converted {} tensors ({}) into {} ({} shard(s), checkpoint {})",
        info.tensors,
        human(info.data_bytes),
        a.out.display(),
        info.shards,
        info.checkpoint_id
    );
    Ok(ExitCode::SUCCESS)
}
