//! Shards: how tensors are packed into shard files (planning, format-spec/durability.md
//! §Shards) and how each shard file is written through a store (header, data in
//! checksummed chunks, write-back hints), in parallel.

use super::*;

pub(super) struct PlannedShard<'t, 'a> {
    tensors: Vec<&'t TensorRef<'a>>,
    entries: Vec<HeaderEntry>,
}

pub(super) fn plan<'t, 'a>(
    tensors: &'t [TensorRef<'a>],
    sizes: &[u64],
    max: u64,
    split: usize,
) -> Vec<PlannedShard<'t, 'a>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_size = 0u64;
    for (i, &sz) in sizes.iter().enumerate() {
        // The header's `__metadata__` entry counts towards the per-shard entry cap.
        let full = cur.len() + 1 >= MAX_TENSORS_PER_SHARD;
        if !cur.is_empty() && (full || i == split || cur_size.saturating_add(sz) > max) {
            groups.push(std::mem::take(&mut cur));
            cur_size = 0;
        }
        cur.push(i);
        cur_size = cur_size.saturating_add(sz);
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
        .into_iter()
        .map(|mut g| {
            // Larger elements first: every offset is then a multiple of its element size
            // (format-spec/shard.md §Alignment).
            g.sort_by_key(|&i| std::cmp::Reverse(tensors[i].dtype.size()));
            let mut off = 0u64;
            let entries = g
                .iter()
                .map(|&i| {
                    let t = &tensors[i];
                    let e = HeaderEntry {
                        name: t.name.to_string(),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        data_offsets: [off, off + sizes[i]],
                    };
                    off += sizes[i];
                    e
                })
                .collect();
            PlannedShard {
                tensors: g.iter().map(|&i| &tensors[i]).collect(),
                entries,
            }
        })
        .collect()
}

/// Shards planned for writing, with their header bytes (step 0 done).
pub(super) struct Planned<'t, 'a> {
    shards: Vec<PlannedShard<'t, 'a>>,
    headers: Vec<Vec<u8>>,
}

/// Step 0's plan: group `tensors` into shards and emit their headers, checked against the
/// format's limits (shard count, header size) before any file is written. No shard holds
/// both tensors before `split` and tensors from it on.
pub(super) fn plan_shards<'t, 'a>(
    id: &str,
    tensors: &'t [TensorRef<'a>],
    sizes: &[u64],
    opts: &SaveOptions,
    split: usize,
) -> Result<Planned<'t, 'a>> {
    let shards = plan(tensors, sizes, opts.max_shard_size, split);
    if shards.len() > MAX_SHARDS {
        return Err(Error::InvalidArgument(format!(
            "{} shards exceed the format's limit of {MAX_SHARDS}; raise max_shard_size",
            shards.len()
        )));
    }
    let headers: Vec<Vec<u8>> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| shard_header(id, i, s))
        .collect();
    if let Some((i, h)) = headers
        .iter()
        .enumerate()
        .find(|(_, h)| h.len() as u64 - 8 > MAX_HEADER_SIZE)
    {
        return Err(Error::InvalidArgument(format!(
            "shard {i}'s header would be {} bytes, over the format's {MAX_HEADER_SIZE}-byte cap; lower max_shard_size or shorten tensor names",
            h.len() - 8
        )));
    }
    Ok(Planned { shards, headers })
}

/// Steps 1-2: write the planned shards (rayon-parallel) and publish each as
/// `shard_name(index)` (locally: temporary file, fsync, rename), then the store's barrier
/// (locally: fsync the directory). Returns the shard entries and the tensors' manifest
/// entries in the caller's order (`shard` indexes into the returned shards). Every shard
/// published is recorded in `created`.
pub(super) fn write_shards<S: Store + ?Sized>(
    store: &S,
    created: &Created<'_, S>,
    tensors: &[TensorRef<'_>],
    planned: &Planned<'_, '_>,
    opts: &SaveOptions,
    shard_name: &(dyn Fn(usize) -> String + Sync),
) -> Result<(Vec<ShardEntry>, Vec<TensorInfo>)> {
    // 1. Write shards to temporary files, fsync, rename to their final names.
    let written: Vec<(ShardEntry, Vec<TensorSums>)> = planned
        .shards
        .par_iter()
        .enumerate()
        .map(|(i, s)| write_shard(store, created, shard_name(i), s, &planned.headers[i], opts))
        .collect::<Result<_>>()?;
    // 2. Make the renames durable before the manifest can reference them.
    store.barrier("fsync directory (before commit; the old checkpoint stays)")?;
    let mut entries = Vec::with_capacity(written.len());
    let mut by_name: BTreeMap<&str, TensorInfo> = BTreeMap::new();
    for (si, (s, (entry, crcs))) in planned.shards.iter().zip(written).enumerate() {
        let ds = 8 + entry.header_size;
        for (e, (crc, absmax, blocks)) in s.entries.iter().zip(crcs) {
            by_name.insert(
                e.name.as_str(),
                TensorInfo {
                    name: e.name.clone(),
                    shard: si,
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    offsets: [ds + e.data_offsets[0], ds + e.data_offsets[1]],
                    crc32: Some(crc),
                    absmax,
                    blocks: blocks.map(|crc32| BlockCrcs {
                        size: opts.block_size,
                        crc32,
                    }),
                },
            );
        }
        entries.push(entry);
    }
    // Manifest tensors in the caller's order.
    let mut infos = Vec::with_capacity(tensors.len());
    for t in tensors {
        if let Some(e) = by_name.remove(t.name.as_ref()) {
            infos.push(e);
        }
    }
    Ok((entries, infos))
}

/// What the writer learns about each tensor as its bytes pass through: the CRC32 and,
/// for F32 tensors with finite values, the absmax.
pub(super) type TensorSums = (u32, Option<f32>, Option<Vec<u32>>);

/// The header bytes of planned shard `index` (format-spec/shard.md §Layout).
pub(super) fn shard_header(id: &str, index: usize, s: &PlannedShard<'_, '_>) -> Vec<u8> {
    let meta: BTreeMap<String, String> = [
        (META_CHECKPOINT_ID.to_string(), id.to_string()),
        ("ckptstore.shard".to_string(), index.to_string()),
    ]
    .into();
    header::emit(&s.entries, &meta)
}

/// Step 1 for one planned shard: write it (header, then each tensor's bytes, summing CRCs
/// on the way) and publish it as `name`.
pub(super) fn write_shard<S: Store + ?Sized>(
    store: &S,
    created: &Created<'_, S>,
    name: String,
    s: &PlannedShard<'_, '_>,
    head: &[u8],
    opts: &SaveOptions,
) -> Result<(ShardEntry, Vec<TensorSums>)> {
    let header_size = head.len() as u64 - 8;
    let header_crc32 = crc32fast::hash(&head[8..]);
    let mut f = store.put_streamed(&name, &format!("{TEMP_PREFIX}{name}"))?;
    f.append(head)?;
    let mut size = head.len() as u64;
    let mut written_back = 0u64;
    let mut crcs = Vec::with_capacity(s.tensors.len());
    for t in &s.tensors {
        let mut h = crate::crc::BlockHasher::new(opts.block_size);
        // The absmax of F32 tensors rides along with the CRC while the chunk is in cache
        // (format-spec/manifest.md §Tensors); a chunk boundary inside an element would
        // skip that element, so chunks are whole elements (CHUNK is a multiple of 8).
        let f32_tensor = t.dtype == DType::F32;
        let mut absbits = 0u32;
        let written = t.for_each_chunk(&mut |chunk| {
            h.update(chunk);
            if f32_tensor {
                absbits = absbits.max(crate::convert::absbits_le_bytes(chunk));
            }
            f.write_all(chunk)?;
            size += chunk.len() as u64;
            // Let the device work while the next chunks are checksummed and copied, in
            // large requests; the sync below still makes it all durable
            // (format-spec/durability.md §Operations).
            if size - written_back >= WRITEBACK_BYTES {
                f.start_writeback(written_back, size - written_back);
                written_back = size;
            }
            if let Some(p) = &opts.progress {
                p(chunk.len() as u64);
            }
            Ok(())
        });
        written.map_err(|e| f.write_error(e))?;
        let absmax = if f32_tensor {
            crate::convert::absmax_from_bits(absbits)
        } else {
            None
        };
        let (crc, blocks) = h.finish();
        crcs.push((crc, absmax, blocks));
    }
    f.finish()?;
    created.published(&name);
    Ok((
        ShardEntry {
            file: name,
            size,
            header_size,
            header_crc32,
        },
        crcs,
    ))
}
