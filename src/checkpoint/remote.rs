//! The reader over an object store (format-spec/s3.md §Open): a checkpoint downloaded whole
//! into fresh buffers with CRCs summed as the bytes land ([`open`]), or read lazily
//! over [`RemoteShard`]s ([`open_lazy`]). The bytes move through the store's ranged GETs
//! ([`Remote::read_ranges`]); what they are checked against is decided here. Errors about
//! shards name the object URL.

use super::parts::{PartSet, PartStore};
use super::{source, Checkpoint, Fetch, Shard, ShardSource, TensorInfo};
use crate::error::{Error, Result};
use crate::format::manifest::{ShardEntry, MANIFEST_FILE};
use crate::location::RemoteUrl;
use crate::store::s3::{Remote, RemoteShard};

/// Put the object URL in place of a bare shard file name in errors about shards.
fn name_keys(e: Error, url: &RemoteUrl) -> Error {
    match e {
        Error::ShardMismatch {
            shard,
            file,
            reason,
        } if !file.contains("://") => Error::ShardMismatch {
            shard,
            file: url.child(&file).to_string(),
            reason,
        },
        Error::ChecksumMismatch {
            what,
            shard,
            file,
            expected,
            got,
        } if !file.contains("://") => Error::ChecksumMismatch {
            what,
            shard,
            file: url.child(&file).to_string(),
            expected,
            got,
        },
        Error::InvalidHeader { file, reason } if !file.contains("://") => Error::InvalidHeader {
            file: url.child(&file).to_string(),
            reason,
        },
        other => other,
    }
}

/// Open the checkpoint under the prefix of `r`: one GET of the manifest, then every shard
/// downloaded with parallel ranged GETs into fresh buffers, then every check
/// [`Checkpoint::open`] makes (object sizes, header lengths and CRCs). [`crate::open`] of an
/// `s3://` location runs it.
///
/// The tensor CRCs are computed during the download: each range GET sums the CRC blocks
/// it carries (and absmax bits) as their bytes land, overlapping the CRC pass with the
/// network. If every tensor passes, [`Checkpoint::data_verified`] is `true` and
/// [`Checkpoint::verify`] and checked loads do not read the bytes again. A tensor that
/// fails does not fail the open (it makes the same checks a local open makes):
/// `verify` and loads report it, naming the tensor, the block and the object URL.
///
/// # Errors
/// [`Error::NotFound`] if no manifest is committed under the prefix;
/// [`Error::ShardMismatch`] naming the object URL for a missing, truncated or replaced
/// shard object; [`Error::ChecksumMismatch`] for a header from another checkpoint or
/// damaged bytes; [`Error::Remote`] naming the URL for a failed request (wrong
/// credentials, missing bucket, server down after the retries).
pub fn open(r: &Remote) -> Result<Checkpoint<Vec<u8>>> {
    let (bytes, m) = r.manifest()?;
    let mut bufs: Vec<Vec<u8>> = m
        .shards
        .iter()
        .map(|s| {
            usize::try_from(s.size).map(|n| vec![0u8; n]).map_err(|_| {
                Error::InvalidArgument(format!("shard {} does not fit in memory", s.file))
            })
        })
        .collect::<Result<_>>()?;
    // Tensors by shard, in file order: every tensor is CRC-checked piece by piece as its
    // bytes land (`source::plan_summed`), so the CRC pass overlaps the download.
    let mut by_shard: Vec<Vec<(usize, &TensorInfo)>> = vec![Vec::new(); m.shards.len()];
    for (i, t) in m.tensors.iter().enumerate() {
        if let Some(v) = by_shard.get_mut(t.shard) {
            v.push((i, t));
        }
    }
    let step = r.fetch_size();
    let mut summed = true;
    let mut jobs = Vec::new();
    for (i, (buf, ts)) in bufs.iter_mut().zip(&mut by_shard).enumerate() {
        ts.sort_by_key(|(_, t)| t.offsets[0]);
        summed &= source::plan_summed_or_plain(i, 0, buf, ts, step, &mut jobs);
    }
    let objects: Vec<(&str, u64)> = m.shards.iter().map(|s| (s.file.as_str(), s.size)).collect();
    r.read_ranges(&objects, &mut jobs)
        .map_err(|e| name_keys(e, r.url()))?;
    let tensors: Vec<&TensorInfo> = m.tensors.iter().collect();
    let sums = summed
        .then(|| source::gather_sums(&tensors, step, jobs))
        .flatten();
    let mut ck =
        Checkpoint::from_manifest_bytes(&bytes, bufs).map_err(|e| name_keys(e, r.url()))?;
    if !m.parts.is_empty() {
        ck.parts = Some(PartSet::new(Box::new(RemoteParts(r.clone())), &m));
    }
    // Later errors (verify, loads) name the objects by URL.
    let mut ck = ck.with_shard_names(|f| r.url().child(f).to_string());
    if let Some((units, per)) = sums {
        // Every tensor passed: `verify` and checked loads need not read the bytes again.
        // A failure changes nothing here: open still makes only the checks a local open
        // makes, and `verify` or the load reports the damaged tensor as it would locally.
        ck.accept_unit_sums(&units, &per);
    }
    Ok(ck)
}

impl ShardSource for RemoteShard {
    fn len(&self) -> u64 {
        self.size()
    }
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
    fn head(&self) -> &[u8] {
        RemoteShard::head(self)
    }
    fn fetch_size(&self) -> u64 {
        self.remote().fetch_size()
    }
    fn fetch(shards: &[Shard<Self>], jobs: &mut [Fetch<'_>]) -> Result<()> {
        let objects: Vec<&RemoteShard> = shards.iter().map(|s| &s.bytes).collect();
        RemoteShard::read(&objects, jobs).map_err(|e| match objects.first() {
            Some(s) => name_keys(e, s.remote().url()),
            None => e,
        })
    }
}

/// Open the checkpoint under the prefix of `remote` lazily: GET the manifest, then the header of every
/// shard (a ranged GET each), checked as [`Checkpoint::open`] checks them. Tensors are
/// fetched by ranged GETs when asked for ([`Checkpoint::read`],
/// [`Checkpoint::stream_tensors`], [`Checkpoint::verify`]),
/// CRC-checked, into fresh buffers: for checkpoints larger than memory and for reading a
/// few tensors; [`open`] downloads everything.
///
/// # Errors
/// As [`open`].
pub fn open_lazy(remote: &Remote) -> Result<Checkpoint<RemoteShard>> {
    let url = remote.url();
    let (bytes, manifest) = remote.manifest()?;
    let mut heads: Vec<Vec<u8>> = manifest
        .shards
        .iter()
        .map(|s| {
            usize::try_from(s.header_size)
                .ok()
                .and_then(|n| n.checked_add(8))
                .map(|n| vec![0u8; n])
                .ok_or_else(|| Error::manifest(MANIFEST_FILE, "a header size overflows"))
        })
        .collect::<Result<_>>()?;
    let mut jobs = Vec::new();
    for (i, buf) in heads.iter_mut().enumerate() {
        source::plan_plain(i, 0, buf, remote.fetch_size(), &mut jobs);
    }
    let objects: Vec<(&str, u64)> = manifest
        .shards
        .iter()
        .map(|s| (s.file.as_str(), s.size))
        .collect();
    remote
        .read_ranges(&objects, &mut jobs)
        .map_err(|e| name_keys(e, url))?;
    drop(jobs);
    let parts = (!manifest.parts.is_empty())
        .then(|| PartSet::new(Box::new(RemoteParts(remote.clone())), &manifest));
    let shards = RemoteShard::for_objects(
        remote.clone(),
        manifest
            .shards
            .iter()
            .zip(heads)
            .map(|(s, head)| (s.file.clone(), s.size, head))
            .collect(),
    );
    let mut ck = Checkpoint::from_manifest_bytes(&bytes, shards).map_err(|e| name_keys(e, url))?;
    ck.parts = parts;
    Ok(ck.with_shard_names(|f| url.child(f).to_string()))
}

/// The part indexes and part shards of a two-level checkpoint under a prefix: indexes
/// fetched whole with one GET, shards downloaded whole (`Vec<u8>`, for [`open`]) or
/// opened lazily by their headers ([`RemoteShard`], for [`open_lazy`]). Shards are named by
/// URL.
struct RemoteParts(Remote);

impl RemoteParts {
    /// Fetch `[0, len)` of each shard object into a buffer of that length.
    fn fetch_prefixes(&self, shards: &[ShardEntry], lens: &[u64]) -> Result<Vec<Vec<u8>>> {
        let r = &self.0;
        let mut bufs: Vec<Vec<u8>> = lens
            .iter()
            .zip(shards)
            .map(|(&n, s)| {
                usize::try_from(n).map(|n| vec![0u8; n]).map_err(|_| {
                    Error::InvalidArgument(format!("shard {} does not fit in memory", s.file))
                })
            })
            .collect::<Result<_>>()?;
        let mut jobs = Vec::new();
        for (i, buf) in bufs.iter_mut().enumerate() {
            source::plan_plain(i, 0, buf, r.fetch_size(), &mut jobs);
        }
        let objects: Vec<(&str, u64)> = shards.iter().map(|s| (s.file.as_str(), s.size)).collect();
        r.read_ranges(&objects, &mut jobs)
            .map_err(|e| name_keys(e, r.url()))?;
        drop(jobs);
        Ok(bufs)
    }
}

fn read_part_index(r: &Remote, file: &str, size: u64) -> Result<Vec<u8>> {
    r.get_small(file, size.saturating_add(1))?
        .ok_or_else(|| Error::NotFound {
            path: std::path::PathBuf::from(r.url().child(file).to_string()),
            reason: "the part index is missing".into(),
        })
}

impl PartStore<Vec<u8>> for RemoteParts {
    fn read_index(&self, file: &str, size: u64) -> Result<Vec<u8>> {
        read_part_index(&self.0, file, size)
    }
    fn open_shards(&self, shards: &[ShardEntry]) -> Result<Vec<Shard<Vec<u8>>>> {
        let lens: Vec<u64> = shards.iter().map(|s| s.size).collect();
        let bufs = self.fetch_prefixes(shards, &lens)?;
        Ok(shards
            .iter()
            .zip(bufs)
            .map(|(s, bytes)| Shard {
                file: self.0.url().child(&s.file).to_string(),
                bytes,
            })
            .collect())
    }
    fn describe(&self, file: &str) -> String {
        self.0.url().child(file).to_string()
    }
}

impl PartStore<RemoteShard> for RemoteParts {
    fn read_index(&self, file: &str, size: u64) -> Result<Vec<u8>> {
        read_part_index(&self.0, file, size)
    }
    fn open_shards(&self, shards: &[ShardEntry]) -> Result<Vec<Shard<RemoteShard>>> {
        let lens: Vec<u64> = shards
            .iter()
            .map(|s| s.header_size.saturating_add(8).min(s.size))
            .collect();
        let heads = self.fetch_prefixes(shards, &lens)?;
        let objects = RemoteShard::for_objects(
            self.0.clone(),
            shards
                .iter()
                .zip(heads)
                .map(|(s, head)| (s.file.clone(), s.size, head))
                .collect(),
        );
        Ok(shards
            .iter()
            .zip(objects)
            .map(|(s, bytes)| Shard {
                file: self.0.url().child(&s.file).to_string(),
                bytes,
            })
            .collect())
    }
    fn describe(&self, file: &str) -> String {
        self.0.url().child(file).to_string()
    }
}

impl Checkpoint<RemoteShard> {
    /// The bytes of tensor data fetched by reads so far (the manifest and the headers
    /// fetched at open are not counted).
    pub fn bytes_fetched(&self) -> u64 {
        self.shards().first().map_or(0, |s| s.bytes.fetched())
    }
}
