//! The coordinator's checks and merge of a multi-rank commit (format-spec/global.md §The
//! commit): the parts agree (one checkpoint id, ranks, world size), every shard they name
//! is there with the header they recorded, and their tensors and chunks merge into one
//! manifest (whole tensors offered once, globals consistent, replicas identical, no
//! overlapping chunks).

use super::*;

/// C1 on parts sorted by rank.
pub(super) fn check_parts(
    dir: &Path,
    id: &str,
    sorted: &[&Part],
    world_size: Option<u32>,
) -> Result<()> {
    if sorted.is_empty() {
        return Err(Error::InvalidArgument("no parts to commit".into()));
    }
    // Each part's own rules, part by part in parallel; the first failure in rank order is
    // the one reported.
    let checked: Vec<_> = sorted.par_iter().map(|p| p.check()).collect();
    for ((i, p), checked) in sorted.iter().enumerate().zip(checked) {
        let bad = |reason: String| Error::InvalidPart {
            part: p.file_name(),
            reason,
        };
        checked.map_err(bad)?;
        if p.checkpoint_id != id {
            return Err(bad(format!(
                "rank {} wrote it for checkpoint {}, not {id}: a part of another save is never committed",
                p.rank, p.checkpoint_id
            )));
        }
        if i > 0 && sorted[i - 1].rank == p.rank {
            return Err(bad(format!("two parts are given for rank {}", p.rank)));
        }
        if let Some(ws) = world_size {
            if p.rank >= ws {
                return Err(bad(format!(
                    "rank {} is outside the world size {ws}",
                    p.rank
                )));
            }
        }
    }
    if let Some(ws) = world_size {
        let have: HashSet<u32> = sorted.iter().map(|p| p.rank).collect();
        let missing: Vec<u32> = (0..ws).filter(|r| !have.contains(r)).collect();
        if !missing.is_empty() {
            return Err(Error::MissingParts {
                dir: dir.to_path_buf(),
                checkpoint_id: id.to_string(),
                missing,
            });
        }
    }
    Ok(())
}

/// C2: every shard file the parts list is this id's and rank's, present, of the recorded
/// size, with the recorded header length and header CRC (only the header is read).
pub(super) fn check_shards<S: Store + ?Sized>(store: &S, sorted: &[&Part]) -> Result<()> {
    let mut index = 0usize;
    for p in sorted {
        for (k, s) in p.shards.iter().enumerate() {
            let mismatch = |reason: String| Error::ShardMismatch {
                shard: index,
                file: store.describe(&s.file),
                reason: format!("rank {}'s shard {k}: {reason}", p.rank),
            };
            let want = rank_shard_file_name(&p.checkpoint_id, p.rank, k);
            if s.file != want {
                return Err(mismatch(format!("the part names it, expected {want:?}")));
            }
            // At most the header a valid entry can have: never more than the format's cap.
            let max = s.header_size.min(MAX_HEADER_SIZE).saturating_add(8);
            let (len, head) = match store.read_prefix(&s.file, max) {
                Ok(r) => r,
                // A shard that is there but cannot be read (EIO, a failing device) is an
                // I/O error with its errno, not a mismatch: the part may be sound and a
                // retried commit succeed. A missing file is a mismatch.
                Err(e @ Error::Io { .. })
                    if !matches!(&e, Error::Io { source, .. }
                        if source.kind() == std::io::ErrorKind::NotFound) =>
                {
                    return Err(e)
                }
                Err(e) => return Err(mismatch(cannot_open(e))),
            };
            if len != s.size {
                return Err(mismatch(format!(
                    "the file is {len} bytes but the part records {}",
                    s.size
                )));
            }
            let end = s
                .header_size
                .checked_add(8)
                .filter(|&e| e <= s.size && s.header_size <= MAX_HEADER_SIZE)
                .ok_or_else(|| {
                    mismatch(format!(
                        "header_size {} does not fit size {}",
                        s.header_size, s.size
                    ))
                })?;
            // `end` <= `max` and <= the file's length: `head` holds `end` bytes, unless the
            // file shrank meanwhile.
            let head = usize::try_from(end)
                .ok()
                .and_then(|e| head.get(..e))
                .ok_or_else(|| {
                    Error::io(
                        "read",
                        store.location().join(&s.file),
                        std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    )
                })?;
            let prefix = head.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok());
            if prefix.map(u64::from_le_bytes) != Some(s.header_size) {
                return Err(mismatch(format!(
                    "the header length prefix differs from the part's {}",
                    s.header_size
                )));
            }
            let got = crc32fast::hash(head.get(8..).unwrap_or(&[]));
            if got != s.header_crc32 {
                return Err(Error::ChecksumMismatch {
                    what: format!("shard header (rank {})", p.rank),
                    shard: index,
                    file: store.describe(&s.file),
                    expected: s.header_crc32,
                    got,
                });
            }
            index += 1;
        }
    }
    Ok(())
}

/// Why a shard could not be read, in C2's words: "cannot open PATH: CAUSE".
pub(super) fn cannot_open(e: Error) -> String {
    match e {
        Error::Io { path, source, .. } => format!("cannot open {}: {source}", path.display()),
        Error::Remote { url, reason, .. } => format!("cannot open {url}: {reason}"),
        other => format!("cannot open: {other}"),
    }
}

/// C3, C4: the merged manifest of parts sorted by rank.
pub(super) fn merge(id: &str, sorted: &[&Part], metadata: &serde_json::Value) -> Result<Manifest> {
    let mut shards = Vec::new();
    let mut tensors: Vec<TensorInfo> = Vec::new();
    // Every stored tensor name, with the rank that stores it; whole tensors separately.
    let mut owner: HashMap<String, u32> = HashMap::new();
    let mut wholes: HashMap<String, u32> = HashMap::new();
    let mut globals: Vec<GlobalEntry> = Vec::new();
    // Per global: its index in `globals` and the rank that first declared it.
    let mut global_ix: HashMap<String, (usize, u32)> = HashMap::new();
    // Per (global index, offsets): the chunk's index and the rank of its primary copy.
    let mut chunk_ix: HashMap<(usize, Vec<u64>), (usize, u32)> = HashMap::new();
    let mut crc_of: HashMap<String, Option<u32>> = HashMap::new();
    for p in sorted {
        let base = shards.len();
        shards.extend(p.shards.iter().cloned());
        let chunk_names: HashSet<&str> = p.chunks.iter().map(|c| c.tensor.as_str()).collect();
        for t in &p.tensors {
            if let Some(&other) = owner.get(&t.name) {
                let reason = if chunk_names.contains(t.name.as_str()) {
                    "both ranks store a tensor of this name"
                } else {
                    "both ranks offer this whole tensor; to replicate a tensor, offer it from each rank as one chunk covering the whole tensor"
                };
                return Err(Error::PartConflict {
                    name: t.name.clone(),
                    ranks: [other, p.rank],
                    reason: reason.into(),
                });
            }
            owner.insert(t.name.clone(), p.rank);
            if !chunk_names.contains(t.name.as_str()) {
                wholes.insert(t.name.clone(), p.rank);
            }
            crc_of.insert(t.name.clone(), t.crc32);
            let mut t = t.clone();
            t.shard = base
                .checked_add(t.shard)
                .ok_or_else(|| Error::InvalidArgument("shard indexes overflow".into()))?;
            tensors.push(t);
        }
        for c in &p.chunks {
            let gi = match global_ix.get(&c.global) {
                Some(&(gi, first)) => {
                    let g = &globals[gi];
                    if g.dtype != c.dtype || g.global_shape != c.global_shape {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [first, p.rank],
                            reason: format!(
                                "rank {first} declares the global tensor {} {:?}, rank {} {} {:?}",
                                g.dtype, g.global_shape, p.rank, c.dtype, c.global_shape
                            ),
                        });
                    }
                    gi
                }
                None => {
                    globals.push(GlobalEntry {
                        name: c.global.clone(),
                        dtype: c.dtype,
                        global_shape: c.global_shape.clone(),
                        chunks: Vec::new(),
                        grid: None,
                    });
                    global_ix.insert(c.global.clone(), (globals.len() - 1, p.rank));
                    globals.len() - 1
                }
            };
            match chunk_ix.get(&(gi, c.offsets.clone())) {
                Some(&(ci, prank)) => {
                    let ch = &mut globals[gi].chunks[ci];
                    if ch.shape != c.shape {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [prank, p.rank],
                            reason: format!(
                                "chunks at offsets {:?} overlap: rank {prank}'s has shape {:?}, rank {}'s {:?}",
                                c.offsets, ch.shape, p.rank, c.shape
                            ),
                        });
                    }
                    let (a, b) = (crc_of.get(&ch.tensor), crc_of.get(&c.tensor));
                    if a != b || a.is_none_or(Option::is_none) {
                        return Err(Error::PartConflict {
                            name: c.global.clone(),
                            ranks: [prank, p.rank],
                            reason: format!(
                                "both write the chunk at offsets {:?} (shape {:?}) but the copies differ: CRC32 {} vs {}",
                                c.offsets,
                                c.shape,
                                crc_text(a),
                                crc_text(b)
                            ),
                        });
                    }
                    ch.replicas.push(c.tensor.clone());
                }
                None => {
                    let g = &mut globals[gi];
                    g.chunks.push(ChunkEntry {
                        offsets: c.offsets.clone(),
                        shape: c.shape.clone(),
                        tensor: c.tensor.clone(),
                        replicas: Vec::new(),
                    });
                    chunk_ix.insert((gi, c.offsets.clone()), (g.chunks.len() - 1, p.rank));
                }
            }
        }
    }
    for g in &globals {
        if let Some(&r) = wholes.get(&g.name) {
            let first = global_ix.get(&g.name).map_or(r, |&(_, f)| f);
            return Err(Error::PartConflict {
                name: g.name.clone(),
                ranks: [r.min(first), r.max(first)],
                reason: format!(
                    "rank {r} offers a whole tensor of this name, rank {first} chunks of a global tensor"
                ),
            });
        }
    }
    Ok(Manifest {
        format: manifest::FORMAT_NAME.into(),
        version: manifest::VERSION,
        features: if globals.is_empty() {
            vec![]
        } else {
            vec!["global".into()]
        },
        checkpoint_id: id.to_string(),
        shards,
        tensors,
        metadata: metadata.clone(),
        optimizer: None,
        globals,
        parts: Vec::new(),
        grids: Vec::new(),
    })
}

/// Globals of up to this many chunks are searched pair by pair for an overlap to report.
const MAX_OVERLAP_SEARCH: usize = 4096;

/// Two chunks of one global of `m` that overlap, as the conflict of the ranks that wrote
/// them (the first pair found; globals of more than [`MAX_OVERLAP_SEARCH`] chunks are not
/// searched).
pub(super) fn overlapping_ranks(m: &Manifest, sorted: &[&Part]) -> Option<Error> {
    let rank_of: HashMap<&str, u32> = sorted
        .iter()
        .flat_map(|p| p.chunks.iter().map(|c| (c.tensor.as_str(), p.rank)))
        .collect();
    let meets = |a: &ChunkEntry, b: &ChunkEntry| {
        (0..a.offsets.len()).all(|d| {
            let (ao, bo) = (a.offsets[d], b.offsets[d]);
            let (ae, be) = (
                ao.saturating_add(a.shape.get(d).copied().unwrap_or(0)),
                bo.saturating_add(b.shape.get(d).copied().unwrap_or(0)),
            );
            ao < be && bo < ae
        })
    };
    for g in m
        .globals
        .iter()
        .filter(|g| g.chunks.len() <= MAX_OVERLAP_SEARCH)
    {
        for (i, a) in g.chunks.iter().enumerate() {
            for b in &g.chunks[i + 1..] {
                if a.offsets.len() == b.offsets.len() && meets(a, b) {
                    let ra = rank_of.get(a.tensor.as_str()).copied()?;
                    let rb = rank_of.get(b.tensor.as_str()).copied()?;
                    return Some(Error::PartConflict {
                        name: g.name.clone(),
                        ranks: [ra.min(rb), ra.max(rb)],
                        reason: format!(
                            "chunks overlap: rank {ra}'s at offsets {:?} shape {:?}, rank {rb}'s at offsets {:?} shape {:?}",
                            a.offsets, a.shape, b.offsets, b.shape
                        ),
                    });
                }
            }
        }
    }
    None
}

pub(super) fn crc_text(c: Option<&Option<u32>>) -> String {
    match c {
        Some(Some(v)) => format!("{v:08x}"),
        _ => "(none)".into(),
    }
}
