//! Reading by ranged GETs: the whole checkpoint downloaded into fresh buffers with CRCs summed
//! as the bytes land ([`open_remote`]), or read lazily over [`RemoteShard`]s
//! ([`open_lazy`]); errors about shards name the object URL (format-spec/s3.md §Open).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::{GetOptions, GetRange, ObjectStore};

use super::client::{is_not_found, is_range_not_satisfiable, remote_err};
use super::{Remote, S3Config};
use crate::checkpoint::{source, Checkpoint, Fetch, Shard, ShardSource, TensorInfo};
use crate::error::{Error, Result};
use crate::format::manifest::MANIFEST_FILE;
use crate::location::RemoteUrl;

impl Remote {
    /// Fill `jobs` from the objects they name (`objects[job.shard]`: name and the size the
    /// manifest records) with up to `download_concurrency` ranged GETs in flight, each
    /// checked against the object size; every CRC piece a job carries is summed as its
    /// bytes land ([`Fetch::write`]). Errors name the key.
    fn read_fetches(&self, objects: &[(&str, u64)], jobs: &mut [Fetch<'_>]) -> Result<()> {
        let conc = self.cfg.download_concurrency.max(1);
        self.block_on(async {
            futures::stream::iter(jobs.iter_mut().map(|j| self.read_fetch(objects, j)))
                .buffer_unordered(conc)
                .try_for_each(|()| async { Ok(()) })
                .await
        })
    }

    async fn read_fetch(&self, objects: &[(&str, u64)], j: &mut Fetch<'_>) -> Result<()> {
        let shard = j.shard();
        let range = j.range();
        let &(name, object_size) = objects.get(shard).ok_or_else(|| {
            Error::InvalidArgument(format!("fetch from shard {shard}, of {}", objects.len()))
        })?;
        let url = self.url.child(name);
        let path = self.path(name);
        let mismatch = |reason: String| Error::ShardMismatch {
            shard,
            file: url.to_string(),
            reason,
        };
        let opts = GetOptions {
            range: Some(GetRange::Bounded(range.clone())),
            ..Default::default()
        };
        let r = match self.store.get_opts(&path, opts).await {
            Ok(r) => r,
            Err(e) if is_not_found(&e) => return Err(mismatch("the object is missing".into())),
            Err(e) => {
                // A range past the end of a short object: say so in the shard's terms.
                if is_range_not_satisfiable(&e) {
                    return Err(mismatch(format!(
                        "the object is shorter than the {object_size} bytes the manifest records (truncated or replaced): {e}"
                    )));
                }
                return Err(remote_err("GET", &url, &e));
            }
        };
        if r.meta.size != object_size {
            return Err(mismatch(format!(
                "the object is {} bytes but the manifest records {object_size} (truncated or replaced)",
                r.meta.size
            )));
        }
        if r.range != range {
            return Err(mismatch(format!(
                "asked for bytes {range:?}, the server sent {:?}",
                r.range
            )));
        }
        let mut body = r.into_stream();
        // Each CRC piece is summed as soon as its last byte lands, while it is still in
        // cache and while the other GETs keep the network busy.
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| remote_err("GET", &url, &e))?;
            j.write(&chunk)
                .map_err(|_| mismatch("the server sent more bytes than asked for".into()))?;
        }
        if !j.is_complete() {
            return Err(mismatch(format!(
                "the server sent {} of the {} bytes asked for",
                j.landed(),
                range.end - range.start
            )));
        }
        Ok(())
    }

    /// The fetch size of this remote's reads: its range size (at least 64 KiB).
    fn fetch_size(&self) -> u64 {
        self.cfg.range_size.max(1 << 16) as u64
    }
}

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

/// Open the checkpoint under `url`, configured from the environment ([`open_with`]).
///
/// # Errors
/// As [`open_with`].
pub fn open(url: &RemoteUrl) -> Result<Checkpoint<Vec<u8>>> {
    open_with(url, &S3Config::try_from_env()?)
}

/// Open the checkpoint under `url`: one GET of the manifest, then every shard downloaded
/// with parallel ranged GETs into fresh buffers, then every check [`Checkpoint::open`]
/// makes (object sizes, header lengths and CRCs).
///
/// The tensor CRCs are computed during the download: each range GET sums the CRC blocks
/// it carries (and absmax bits) as their bytes land, overlapping the CRC pass with the
/// network. If every tensor passes, [`Checkpoint::data_verified`] is `true` and
/// [`Checkpoint::verify`] and checked loads do not read the bytes again. A tensor that
/// fails does not fail the open (it makes the same checks a local open makes):
/// `verify` and loads report it, naming the tensor, the block and the object URL.
///
/// # Errors
/// [`Error::NotFound`] if no manifest is committed under `url`; [`Error::ShardMismatch`]
/// naming the object URL for a missing, truncated or replaced shard object;
/// [`Error::ChecksumMismatch`] for a header from another checkpoint or damaged bytes;
/// [`Error::Remote`] naming the URL for a failed request (wrong credentials, missing
/// bucket, server down after the retries).
pub fn open_with(url: &RemoteUrl, cfg: &S3Config) -> Result<Checkpoint<Vec<u8>>> {
    let r = Remote::new(url, cfg)?;
    open_remote(&r)
}

/// [`open_with`] on a connected [`Remote`].
///
/// # Errors
/// As [`open_with`].
pub fn open_remote(r: &Remote) -> Result<Checkpoint<Vec<u8>>> {
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
    r.read_fetches(&objects, &mut jobs)
        .map_err(|e| name_keys(e, &r.url))?;
    let tensors: Vec<&TensorInfo> = m.tensors.iter().collect();
    let sums = summed
        .then(|| source::gather_sums(&tensors, step, jobs))
        .flatten();
    let ck = Checkpoint::from_parts(&bytes, bufs).map_err(|e| name_keys(e, &r.url))?;
    // Later errors (verify, loads) name the objects by URL.
    let mut ck = ck.with_shard_names(|f| r.url.child(f).to_string());
    if let Some((units, per)) = sums {
        // Every tensor passed: `verify` and checked loads need not read the bytes again.
        // A failure changes nothing here: open still makes only the checks a local open
        // makes, and `verify` or the load reports the damaged tensor as it would locally.
        ck.accept_unit_sums(&units, &per);
    }
    Ok(ck)
}

/// One shard object of a checkpoint on an object store, read by ranged GETs when asked
/// for (the lazy reader's [`ShardSource`]): its header was fetched and checked at open;
/// its tensor bytes are fetched into the caller's fresh buffers, CRC-checked as they land.
#[derive(Debug)]
pub struct RemoteShard {
    shared: Arc<LazyRemote>,
    /// The object's name under the prefix.
    name: String,
    /// Its size, as the manifest records it (every GET checks it).
    size: u64,
    /// The 8-byte header length and the header JSON.
    head: Vec<u8>,
}

/// What the shards of one lazily read checkpoint share.
#[derive(Debug)]
struct LazyRemote {
    remote: Remote,
    /// Tensor bytes fetched so far (not the headers fetched at open).
    fetched: AtomicU64,
}

impl ShardSource for RemoteShard {
    fn len(&self) -> u64 {
        self.size
    }
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
    fn head(&self) -> &[u8] {
        &self.head
    }
    fn fetch_size(&self) -> u64 {
        self.shared.remote.fetch_size()
    }
    fn fetch(shards: &[Shard<Self>], jobs: &mut [Fetch<'_>]) -> Result<()> {
        let Some(first) = shards.first() else {
            return match jobs.first() {
                Some(j) => Err(Error::InvalidArgument(format!(
                    "fetch from shard {} of a checkpoint without shards",
                    j.shard()
                ))),
                None => Ok(()),
            };
        };
        let lazy = &first.bytes.shared;
        let objects: Vec<(&str, u64)> = shards
            .iter()
            .map(|s| (s.bytes.name.as_str(), s.bytes.size))
            .collect();
        let n: u64 = jobs.iter().map(|j| j.range().end - j.range().start).sum();
        lazy.fetched.fetch_add(n, Ordering::Relaxed);
        lazy.remote
            .read_fetches(&objects, jobs)
            .map_err(|e| name_keys(e, &lazy.remote.url))
    }
}

/// Open the checkpoint under `url` lazily: GET the manifest, then the header of every
/// shard (a ranged GET each), checked as [`Checkpoint::open`] checks them. Tensors are
/// fetched by ranged GETs when asked for ([`Checkpoint::read_tensor`],
/// [`Checkpoint::read_region`], [`Checkpoint::stream_tensors`], [`Checkpoint::verify`]),
/// CRC-checked, into fresh buffers: for checkpoints larger than memory and for reading a
/// few tensors; [`open`] downloads everything.
///
/// # Errors
/// As [`open_with`].
pub fn open_lazy(url: &RemoteUrl, cfg: &S3Config) -> Result<Checkpoint<RemoteShard>> {
    let remote = Remote::new(url, cfg)?;
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
        .read_fetches(&objects, &mut jobs)
        .map_err(|e| name_keys(e, url))?;
    drop(jobs);
    let shared = Arc::new(LazyRemote {
        remote,
        fetched: AtomicU64::new(0),
    });
    let shards = manifest
        .shards
        .iter()
        .zip(heads)
        .map(|(s, head)| RemoteShard {
            shared: Arc::clone(&shared),
            name: s.file.clone(),
            size: s.size,
            head,
        })
        .collect();
    let ck = Checkpoint::from_parts(&bytes, shards).map_err(|e| name_keys(e, url))?;
    Ok(ck.with_shard_names(|f| url.child(f).to_string()))
}

impl Checkpoint<RemoteShard> {
    /// The bytes of tensor data fetched by reads so far (the manifest and the headers
    /// fetched at open are not counted).
    pub fn bytes_fetched(&self) -> u64 {
        self.shards()
            .first()
            .map_or(0, |s| s.bytes.shared.fetched.load(Ordering::Relaxed))
    }
}
