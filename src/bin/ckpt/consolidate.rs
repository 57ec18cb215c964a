//! `ckpt consolidate`: assemble every global tensor whole and write a plain single-writer
//! checkpoint, plus a Hugging Face `model.safetensors.index.json` listing the model tensors
//! (format-spec/global.md §Consolidate).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::checkpoint::{ShardSource, HF_INDEX_FILE};
use ckptstore::store::Location;
use ckptstore::write::parts::new_checkpoint_id;
use ckptstore::{
    Checkpoint, CommitInfo, CommitOptions, Error, PartItem, Result, SaveOptions, TensorRef,
};

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
    /// Most tensor bytes assembled in memory at once before they are written (a larger
    /// tensor is held alone): with the largest tensor, what bounds the peak memory.
    #[arg(long, value_parser = parse_size, default_value = "128MiB")]
    memory: u64,
}

/// One tensor of DST: a whole tensor of SRC or a global assembled from its chunks.
struct Item<'c> {
    name: &'c str,
    global: bool,
    nbytes: u64,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let out = crate::util::location(&a.out)?;
    // A local source is mapped (whole tensors are written straight from the map); an
    // object-store one is read lazily, a tensor at a time, never downloaded whole.
    match crate::util::location(&a.src)? {
        Location::Local(p) => consolidate(&a, &Checkpoint::open(p)?, &out),
        #[cfg(feature = "s3")]
        Location::Remote(u) => consolidate(
            &a,
            &ckptstore::checkpoint::remote::open_lazy(&ckptstore::store::s3::Remote::new(
                &u,
                &ckptstore::store::s3::S3Config::try_from_env()?,
            )?)?,
            &out,
        ),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(Error::UnsupportedUrl {
            url: u.to_string(),
            reason: "this build has no object-store support".into(),
        }),
    }
}

/// Stream SRC into DST: the tensors go in groups of at most `--memory` bytes (a larger
/// tensor alone), each group assembled and CRC-checked, written as one part of a
/// single-committer multi-part save, and released (its buffers freed, the mapped source
/// pages it read released) before the next; the parts are committed once at the end. A
/// failure discards the parts written, and DST keeps what it held.
fn consolidate<S: ShardSource>(a: &Args, ck: &Checkpoint<S>, out: &Location) -> Result<ExitCode> {
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
        .catalog()
        .globals()
        .iter()
        .flat_map(|g| &g.chunks)
        .flat_map(|c| {
            std::iter::once(c.tensor.as_str()).chain(c.replicas.iter().map(|r| r.as_str()))
        })
        .collect();
    let mut items: Vec<Item<'_>> = ck
        .tensors()
        .iter()
        .filter(|t| !chunk_tensors.contains(t.name.as_str()))
        .map(|t| Item {
            name: &t.name,
            global: false,
            nbytes: t.nbytes(),
        })
        .collect();
    for g in ck.catalog().globals() {
        let nbytes = g
            .global_shape
            .iter()
            .try_fold(g.dtype.size() as u64, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                ckptstore::Error::InvalidArgument(format!("global tensor {:?} overflows", g.name))
            })?;
        items.push(Item {
            name: &g.name,
            global: true,
            nbytes,
        });
    }
    let mut groups: Vec<Vec<&Item<'_>>> = vec![Vec::new()];
    let mut held = 0u64;
    for it in &items {
        if held > 0 && held.saturating_add(it.nbytes) > a.memory {
            groups.push(Vec::new());
            held = 0;
        }
        held = held.saturating_add(it.nbytes);
        if let Some(g) = groups.last_mut() {
            g.push(it);
        }
    }
    let opts = SaveOptions {
        max_shard_size: a.max_shard_size,
        progress: None,
        ..Default::default()
    };
    let id = new_checkpoint_id()?;
    let written = || -> Result<CommitInfo> {
        let mut parts = Vec::with_capacity(groups.len());
        let mut pool: Vec<Vec<u8>> = Vec::new();
        for (rank, group) in groups.iter().enumerate() {
            let rank = u32::try_from(rank)
                .map_err(|_| Error::InvalidArgument("too many tensors to consolidate".into()))?;
            // Buffers are reused from group to group: after the first, tensors are read
            // into memory that is already faulted in.
            let mut tensors = Vec::with_capacity(group.len());
            for it in group {
                let (dtype, shape) = ck.catalog().shape_of(it.name)?;
                let mut buf = take_buffer(&mut pool, it.nbytes);
                // Every chunk (or the whole tensor) is CRC-checked before a byte is copied;
                // the error names the damaged chunk tensor and its shard: say which one.
                let zeros = vec![0; shape.len()];
                ck.read(it.name)
                    .region(&zeros, shape)
                    .into(&mut buf)
                    .inspect_err(|_| {
                        eprintln!(
                            "ckpt consolidate: cannot read {} tensor {:?} of {}",
                            if it.global { "global" } else { "whole" },
                            it.name,
                            a.src.display()
                        )
                    })?;
                ck.release_pages(it.name)?;
                tensors.push((it.name, dtype, shape, buf));
            }
            let refs: Vec<PartItem<'_>> = tensors
                .iter()
                .map(|(n, d, shape, b)| PartItem::Whole(TensorRef::new(*n, *d, shape, b)))
                .collect();
            parts.push(ckptstore::write_part(out, &id, rank, &refs, &opts)?);
            drop(refs);
            pool.extend(tensors.into_iter().map(|t| t.3));
        }
        let copts = CommitOptions {
            world_size: Some(u32::try_from(parts.len()).unwrap_or(u32::MAX)),
            metadata: ck.metadata().clone(),
            optimizer: optimizer.clone(),
            ..Default::default()
        };
        ckptstore::commit(out, &id, &parts, &copts)
    };
    let info = match written() {
        Ok(info) => info,
        Err(e) => {
            // Nothing was committed: take this consolidation's parts away (best effort; the
            // next save or commit into DST removes what stays).
            let _ = ckptstore::discard(out, &id);
            return Err(e);
        }
    };

    // The index names the committed shards: read them back from the manifest just written
    // (opened lazily: an object-store DST is not downloaded again).
    let (weight_map, total_size) = match out {
        Location::Local(p) => weight_map(&Checkpoint::open(p)?, out, &referenced)?,
        #[cfg(feature = "s3")]
        Location::Remote(u) => weight_map(
            &ckptstore::checkpoint::remote::open_lazy(&ckptstore::store::s3::Remote::new(
                u,
                &ckptstore::store::s3::S3Config::try_from_env()?,
            )?)?,
            out,
            &referenced,
        )?,
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => {
            return Err(Error::UnsupportedUrl {
                url: u.to_string(),
                reason: "this build has no object-store support".into(),
            })
        }
    };
    let index = serde_json::json!({
        "metadata": {"total_size": total_size},
        "weight_map": weight_map,
    });
    let mut bytes = serde_json::to_vec_pretty(&index)
        .map_err(|e| Error::InvalidArgument(format!("cannot encode {HF_INDEX_FILE}: {e}")))?;
    bytes.push(b'\n');
    ckptstore::store::connect(out)?.put_file(HF_INDEX_FILE, &bytes)?;
    outln!(
        "consolidated {} global tensor(s) and {} whole tensor(s) into {} tensors ({}) in {} shard(s) at {} (checkpoint {}); {} lists {} model tensor(s){}",
        ck.catalog().globals().len(),
        info.tensors - ck.catalog().globals().len(),
        info.tensors,
        human(info.data_bytes),
        info.shards,
        out,
        info.checkpoint_id,
        HF_INDEX_FILE,
        weight_map.len(),
        peak_rss().map_or(String::new(), |b| format!("; peak resident memory {}", human(b))),
    );
    Ok(ExitCode::SUCCESS)
}

/// A buffer of exactly `n` bytes, reusing the smallest pooled one that holds `n` (its old
/// bytes are overwritten by the read; only growth is zero-filled).
fn take_buffer(pool: &mut Vec<Vec<u8>>, n: u64) -> Vec<u8> {
    let n = usize::try_from(n).unwrap_or(usize::MAX);
    let pick = pool
        .iter()
        .enumerate()
        .filter(|(_, b)| b.capacity() >= n)
        .min_by_key(|(_, b)| b.capacity())
        .map(|(i, _)| i);
    let mut b = match pick {
        Some(i) => pool.swap_remove(i),
        None => pool.pop().unwrap_or_default(),
    };
    b.resize(n, 0);
    b
}

/// The Hugging Face index of the committed DST: every model tensor (those the optimizer
/// section does not reference) by the shard file holding it, and their total byte size.
fn weight_map<S>(
    dst: &Checkpoint<S>,
    out: &Location,
    referenced: &HashSet<&str>,
) -> Result<(BTreeMap<String, String>, u64)> {
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
    Ok((weight_map, total_size))
}

/// This process's peak resident memory (`VmHWM`), where the system says (Linux).
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}
