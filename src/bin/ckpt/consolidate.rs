//! `ckpt consolidate`: assemble every global tensor whole and write a plain single-writer
//! checkpoint, plus a Hugging Face `model.safetensors.index.json` listing the model tensors
//! (format-spec/global.md §Consolidate).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::checkpoint::HF_INDEX_FILE;
use ckptstore::{Error, Result, SaveOptions, Tensor, TensorRef};

use crate::util::{human, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Source: any checkpoint ckptstore opens (typically a multi-rank one with global tensors).
    src: PathBuf,
    /// Destination checkpoint directory (a checkpoint there is replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// Most tensor bytes per shard.
    #[arg(long, value_parser = parse_size, default_value = "4GiB")]
    max_shard_size: u64,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let out = crate::util::location(&a.out)?;
    let ck = crate::util::open(&a.src)?;
    ck.check_optimizer_section()?;
    let optimizer = ck.manifest().and_then(|m| m.optimizer.clone());
    // Tensors the optimizer section references: optimizer state, not model weights.
    let referenced: HashSet<&str> = ck
        .manifest()
        .and_then(|m| m.optimizer.as_ref())
        .into_iter()
        .flat_map(|o| &o.params)
        .flat_map(|p| &p.state)
        .flat_map(|s| std::iter::once(s.tensor.as_str()).chain(s.scale.as_deref()))
        .collect();
    // Chunk tensors (and replicas) are not copied: their globals are written whole.
    let chunk_tensors: HashSet<&str> = ck
        .globals()
        .iter()
        .flat_map(|g| &g.chunks)
        .flat_map(|c| {
            std::iter::once(c.tensor.as_str()).chain(c.replicas.iter().map(|r| r.as_str()))
        })
        .collect();
    // Everything is read and checked before DST is touched, so that damage in SRC writes
    // nothing. The writer takes every tensor at once: the assembled globals are all held in
    // memory until the save returns (peak: the sum of their byte sizes; whole tensors are
    // borrowed from SRC's read-only maps).
    let mut assembled: Vec<(&str, Tensor)> = Vec::with_capacity(ck.globals().len());
    for g in ck.globals() {
        // The error names the damaged chunk tensor and its shard; say which global it is.
        let t = ck.read_global(&g.name).inspect_err(|_| {
            eprintln!(
                "ckpt consolidate: cannot assemble global tensor {:?} of {}",
                g.name,
                a.src.display()
            )
        })?;
        assembled.push((g.name.as_str(), t));
    }
    let mut tensors: Vec<TensorRef<'_>> = Vec::new();
    for t in ck.tensors() {
        if chunk_tensors.contains(t.name.as_str()) {
            continue;
        }
        let v = ck.tensor_verified(&t.name)?;
        tensors.push(TensorRef::new(
            t.name.as_str(),
            t.dtype,
            &t.shape,
            v.bytes(),
        ));
    }
    tensors.extend(
        assembled
            .iter()
            .map(|(n, t)| TensorRef::new(*n, t.dtype(), t.shape(), t.bytes())),
    );
    let opts = SaveOptions {
        max_shard_size: a.max_shard_size,
        metadata: ck.metadata().clone(),
        progress: None,
        ..Default::default()
    };
    let info = ckptstore::store::save_with_section(&out, &tensors, &opts, optimizer)?;
    drop(tensors);
    drop(assembled);

    // The index names the committed shards: read them back from the manifest just written.
    let dst = ckptstore::store::open(&out)?;
    let m = dst.manifest().ok_or_else(|| {
        Error::InvalidArgument(format!("{out} did not open as a ckptstore checkpoint"))
    })?;
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    for t in dst.tensors() {
        if referenced.contains(t.name.as_str()) {
            continue;
        }
        let file = m
            .shards
            .get(t.shard)
            .map(|s| s.file.clone())
            .ok_or_else(|| Error::InvalidArgument(format!("tensor {:?} names no shard", t.name)))?;
        total_size += t.offsets[1] - t.offsets[0];
        weight_map.insert(t.name.clone(), file);
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total_size},
        "weight_map": weight_map,
    });
    let mut bytes = serde_json::to_vec_pretty(&index)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode {HF_INDEX_FILE}: {e}")))?;
    bytes.push(b'\n');
    ckptstore::store::put_file(&out, HF_INDEX_FILE, &bytes)?;
    outln!(
        "consolidated {} global tensor(s) and {} whole tensor(s) into {} tensors ({}) in {} shard(s) at {} (checkpoint {}); {} lists {} model tensor(s)",
        ck.globals().len(),
        info.tensors - ck.globals().len(),
        info.tensors,
        human(info.data_bytes),
        info.shards,
        out,
        info.checkpoint_id,
        HF_INDEX_FILE,
        weight_map.len(),
    );
    Ok(ExitCode::SUCCESS)
}
