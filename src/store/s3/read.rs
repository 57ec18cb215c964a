//! Ranged GETs: many [`RangeSink`]s filled in parallel from the objects they name, each
//! checked against the object's recorded size, and [`RemoteShard`], one shard object as the
//! lazy reader sees it (format-spec/s3.md §Open). What the bytes are for (CRC pieces summed as
//! they land, the checkpoint built over them) is the reader's: `checkpoint::remote`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::{GetOptions, GetRange, ObjectStore};

use super::client::{is_not_found, is_range_not_satisfiable, remote_err};
use super::Remote;
use crate::error::{Error, Result};
use crate::store::ranged::RangeSink;

impl Remote {
    /// Fill `jobs` from the objects they name (`objects[job.object()]`: name and the size
    /// the manifest records) with up to `download_concurrency` ranged GETs in flight, each
    /// checked against the object size; each job's bytes are written into it in order as
    /// they land ([`RangeSink::write`]). Errors about an object name its URL.
    ///
    /// # Errors
    /// [`Error::ShardMismatch`] (the object missing, shorter or longer than recorded, a
    /// wrong range sent); [`Error::Remote`] for a failed request.
    pub fn read_ranges<J: RangeSink>(&self, objects: &[(&str, u64)], jobs: &mut [J]) -> Result<()> {
        let conc = self.cfg.download_concurrency.max(1);
        self.block_on(async {
            futures::stream::iter(jobs.iter_mut().map(|j| self.read_fetch(objects, j)))
                .buffer_unordered(conc)
                .try_for_each(|()| async { Ok(()) })
                .await
        })
    }

    async fn read_fetch<J: RangeSink>(&self, objects: &[(&str, u64)], j: &mut J) -> Result<()> {
        let shard = j.object();
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
    pub fn fetch_size(&self) -> u64 {
        self.cfg.range_size.max(1 << 16) as u64
    }
}

/// One shard object of a checkpoint on an object store, as the lazy reader reads it: its
/// name, its recorded size and the header bytes fetched at open; tensor bytes are read by
/// ranged GETs when asked for ([`RemoteShard::read`]). The reader's `ShardSource` for it is
/// in `checkpoint::remote`.
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

impl RemoteShard {
    /// The shard objects `(name, size, head)` of one checkpoint under `remote`, sharing the
    /// connection and one fetched-bytes counter.
    pub fn for_objects(remote: Remote, objects: Vec<(String, u64, Vec<u8>)>) -> Vec<RemoteShard> {
        let shared = Arc::new(LazyRemote {
            remote,
            fetched: AtomicU64::new(0),
        });
        objects
            .into_iter()
            .map(|(name, size, head)| RemoteShard {
                shared: Arc::clone(&shared),
                name,
                size,
                head,
            })
            .collect()
    }

    /// The object's name under the prefix.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The object's size as the manifest records it.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The header bytes fetched at open (the 8-byte length and the JSON).
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// The connection the shard is read through.
    pub fn remote(&self) -> &Remote {
        &self.shared.remote
    }

    /// Fill `jobs` from `shards` (one checkpoint's, sharing one connection: `jobs` index
    /// into `shards`) by ranged GETs, counting the bytes asked for.
    ///
    /// # Errors
    /// As [`Remote::read_ranges`]; [`Error::InvalidArgument`] for jobs without shards.
    pub fn read<J: RangeSink>(shards: &[&RemoteShard], jobs: &mut [J]) -> Result<()> {
        let Some(first) = shards.first() else {
            return match jobs.first() {
                Some(j) => Err(Error::InvalidArgument(format!(
                    "fetch from shard {} of a checkpoint without shards",
                    j.object()
                ))),
                None => Ok(()),
            };
        };
        let objects: Vec<(&str, u64)> = shards.iter().map(|s| (s.name.as_str(), s.size)).collect();
        let n: u64 = jobs.iter().map(|j| j.range().end - j.range().start).sum();
        first.shared.fetched.fetch_add(n, Ordering::Relaxed);
        first.shared.remote.read_ranges(&objects, jobs)
    }

    /// Tensor bytes fetched so far through the shards of this one's checkpoint (not the
    /// headers fetched at open).
    pub fn fetched(&self) -> u64 {
        self.shared.fetched.load(Ordering::Relaxed)
    }
}
