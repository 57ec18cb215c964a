//! `ckpt pack`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::{Error, Result, SaveOptions, TensorRef};

use crate::util::{callback, human, parse_size, progress};

#[derive(clap::Args)]
pub struct Args {
    /// safetensors files, HF sharded directories or ckptstore checkpoints.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output checkpoint directory (created if missing; a checkpoint there is replaced
    /// atomically) or s3://bucket/prefix.
    #[arg(long)]
    out: PathBuf,
    /// Most tensor bytes per shard (e.g. 2GiB, 512MiB).
    #[arg(long, value_parser = parse_size, default_value = "4GiB")]
    max_shard_size: u64,
}

pub fn run(a: Args) -> Result<ExitCode> {
    // A URL is never a local path: parse --out before reading anything.
    let out = crate::util::location(&a.out)?;
    let cks = a
        .inputs
        .iter()
        .map(|p| crate::util::open(p))
        .collect::<Result<Vec<_>>>()?;
    for ck in &cks {
        ck.check_optimizer_section()?;
    }
    // An optimizer section is carried over from the one input that has it.
    let mut sections = cks
        .iter()
        .zip(&a.inputs)
        .filter_map(|(c, p)| Some((c.manifest()?.optimizer.clone()?, p)));
    let optimizer = sections.next();
    if let Some((_, second)) = sections.next() {
        return Err(Error::InvalidArgument(format!(
            "{} and {} both hold optimizer state; pack them separately",
            optimizer
                .as_ref()
                .map(|(_, p)| p.display().to_string())
                .unwrap_or_default(),
            second.display()
        )));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut tensors = Vec::new();
    let mut meta = serde_json::Map::new();
    for (i, ck) in cks.iter().enumerate() {
        if let Some(o) = ck.metadata().as_object() {
            meta.extend(o.clone());
        }
        for t in ck.tensors() {
            if let Some(j) = seen.insert(&t.name, i) {
                return Err(Error::InvalidArgument(format!(
                    "tensor {:?} is in both {} and {}",
                    t.name,
                    a.inputs[j].display(),
                    a.inputs[i].display()
                )));
            }
            let v = ck.read(&t.name).view()?;
            tensors.push(TensorRef::new(
                t.name.as_str(),
                t.dtype,
                &t.shape,
                v.bytes(),
            ));
        }
    }
    let total: u64 = cks.iter().map(|c| c.data_bytes()).sum();
    let pb = progress(total, "pack");
    let opts = SaveOptions {
        max_shard_size: a.max_shard_size,
        metadata: meta.into(),
        progress: Some(callback(&pb)),
        optimizer: optimizer.map(|(s, _)| s),
        ..Default::default()
    };
    let info = ckptstore::save(&out, &tensors, &opts)?;
    pb.finish_and_clear();
    outln!(
        "packed {} tensors ({}) into {} shard(s) at {} (checkpoint {})",
        info.tensors,
        human(info.data_bytes),
        info.shards,
        out,
        info.checkpoint_id
    );
    Ok(ExitCode::SUCCESS)
}
