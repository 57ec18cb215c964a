//! `ckpt inspect`.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::checkpoint::Kind;
use ckptstore::Result;
use serde_json::json;

use crate::util::human;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory, .safetensors file, HF sharded directory, or s3://bucket/prefix.
    path: PathBuf,
    /// Print one JSON object: {path, kind, checkpoint_id, shards:[{file,size}],
    /// tensors:[{name,dtype,shape,bytes,shard,file,crc32}], total_tensors, total_bytes,
    /// metadata, optimizer, globals:[{name,dtype,global_shape,chunks:[{offsets,shape,
    /// tensor,shard,file,crc32,replicas}]}]}.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let ck = crate::util::open(&a.path)?;
    let kind = match ck.kind() {
        Kind::Native => "ckptstore",
        Kind::Safetensors => "safetensors",
        Kind::HfSharded => "hf-sharded",
        _ => "unknown",
    };
    // A two-level checkpoint's chunk tensors are in its parts (all read here).
    let mut total: u64 = ck.data_bytes();
    if ck.catalog().two_level() {
        for g in ck.catalog().globals() {
            total += ck
                .catalog()
                .stored_chunks(&g.name)?
                .iter()
                .map(|c| c.tensor.nbytes())
                .sum::<u64>();
        }
    }
    if a.json {
        let tensors: Vec<_> = ck
            .tensors()
            .iter()
            .map(|t| {
                json!({"name": t.name, "dtype": t.dtype.name(), "shape": t.shape, "bytes": t.nbytes(),
                       "shard": t.shard, "file": ck.shards()[t.shard].file, "crc32": t.crc32})
            })
            .collect();
        let shards: Vec<_> = ck
            .shards()
            .iter()
            .map(|s| json!({"file": s.file, "size": s.bytes.as_ref().len()}))
            .collect();
        let globals: Vec<_> = ck
            .catalog()
            .globals()
            .iter()
            .map(|g| {
                let chunks: Vec<_> = grouped_chunks(&ck, &g.name)?
                    .into_iter()
                    .map(|(c, replicas)| {
                        json!({"offsets": c.region.offsets, "shape": c.region.shape,
                               "tensor": c.tensor.name,
                               "shard": ck.shards().iter().position(|s| s.file == c.file),
                               "file": c.file, "crc32": c.tensor.crc32, "replicas": replicas})
                    })
                    .collect();
                Ok(
                    json!({"name": g.name, "dtype": g.dtype.name(), "global_shape": g.global_shape,
                       "chunks": chunks}),
                )
            })
            .collect::<ckptstore::Result<_>>()?;
        let parts: Vec<_> = ck
            .manifest()
            .map(|m| &m.parts[..])
            .unwrap_or(&[])
            .iter()
            .map(|p| json!({"file": p.file, "size": p.size, "crc32": p.crc32}))
            .collect();
        let out = json!({
            "path": a.path, "kind": kind,
            "checkpoint_id": ck.manifest().map(|m| m.checkpoint_id.clone()),
            "shards": shards, "tensors": tensors,
            "total_tensors": ck.tensors().len(), "total_bytes": total,
            "metadata": ck.metadata(),
            "optimizer": ck.manifest().and_then(|m| m.optimizer.as_ref()),
            "globals": globals,
            "two_level": ck.catalog().two_level(), "parts": parts,
        });
        outln!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{} ({kind})", a.path.display());
    if let Some(m) = ck.manifest() {
        outln!("checkpoint id: {}", m.checkpoint_id);
    }
    let w = ck
        .tensors()
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .clamp(4, 60);
    outln!(
        "{:<w$}  {:<5}  {:<20}  {:>12}  shard",
        "name",
        "dtype",
        "shape",
        "bytes"
    );
    for t in ck.tensors() {
        outln!(
            "{:<w$}  {:<5}  {:<20}  {:>12}  {}",
            t.name.escape_debug().to_string(),
            t.dtype.name(),
            format!("{:?}", t.shape),
            t.nbytes(),
            ck.shards()[t.shard].file
        );
    }
    outln!(
        "{} tensors, {} in {} shard file(s)",
        ck.tensors().len(),
        human(total),
        ck.shards().len()
    );
    if !ck.catalog().globals().is_empty() {
        if let Some(m) = ck.manifest().filter(|m| !m.parts.is_empty()) {
            outln!(
                "two-level: {} part index(es), {} in all",
                m.parts.len(),
                human(m.parts.iter().map(|p| p.size).sum())
            );
            outln!("global tensors (stored as chunk tensors in the parts' shards):");
        } else {
            outln!("global tensors (stored as the chunk tensors above):");
        }
        for g in ck.catalog().globals() {
            let chunks = grouped_chunks(&ck, &g.name)?;
            let replicas: usize = chunks.iter().map(|(_, r)| r.len()).sum();
            outln!(
                "  {}  {}  {:?}  {} chunk(s){}",
                g.name.escape_debug(),
                g.dtype.name(),
                g.global_shape,
                chunks.len(),
                if replicas > 0 {
                    format!(", {replicas} replica(s)")
                } else {
                    String::new()
                }
            );
            for (c, _) in &chunks {
                outln!(
                    "    offsets {:?} shape {:?}: {}",
                    c.region.offsets,
                    c.region.shape,
                    c.tensor.name.escape_debug()
                );
            }
        }
    }
    let meta = ck.metadata();
    if meta.as_object().is_some_and(|o| !o.is_empty()) {
        outln!("metadata: {meta}");
    }
    if let Some(o) = ck.manifest().and_then(|m| m.optimizer.as_ref()) {
        let with_state = o.params.iter().filter(|p| !p.state.is_empty()).count();
        outln!(
            "optimizer: {} group(s), {} parameter(s), {with_state} with state",
            o.groups.len(),
            o.params.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The chunks of global `name`, each with the names of its replicas (copies of the same
/// box), in stored order.
fn grouped_chunks<'a, S: ckptstore::checkpoint::ShardSource>(
    ck: &'a ckptstore::Checkpoint<S>,
    name: &str,
) -> ckptstore::Result<Vec<(ckptstore::checkpoint::StoredChunk<'a>, Vec<String>)>> {
    let all = ck.catalog().stored_chunks(name)?;
    let mut out: Vec<(ckptstore::checkpoint::StoredChunk<'a>, Vec<String>)> = all
        .iter()
        .filter(|c| !c.replica)
        .map(|c| (c.clone(), Vec::new()))
        .collect();
    for r in all.iter().filter(|c| c.replica) {
        if let Some(p) = out.iter_mut().find(|(c, _)| c.region == r.region) {
            p.1.push(r.tensor.name.clone());
        }
    }
    Ok(out)
}
