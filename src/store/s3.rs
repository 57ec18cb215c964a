//! Checkpoints on S3-compatible object stores (cargo feature `s3`), through the Apache
//! Arrow [`object_store`] crate and a small internal tokio runtime.
//!
//! The layout is the local one with objects for files (format-spec/s3.md): under
//! `s3://bucket/prefix/`, shard objects named uniquely per checkpoint id
//! (`shard-<id>-<i>.safetensors`), then `ckpt-manifest.json`, PUT last: the commit.
//!
//! **Save** runs the engine's own commit protocol (`write`) over [`Remote`] as the writer's
//! [`Store`]: each shard streams into a multipart upload (parts uploaded concurrently
//! while the writer computes every tensor's CRC32 from the same bytes), and the manifest is
//! one PUT after every shard upload has completed. An error or a dropped save aborts its
//! multipart uploads and deletes the shard objects it completed; a killed process leaves
//! shard objects no manifest names and incomplete multipart uploads, which the next save's
//! cleanup or `ckpt gc` deletes and aborts (each upload is journaled by an object naming
//! its id: format-spec/s3.md §Uploads).
//!
//! **Multi-rank** checkpoints ([`write_part`], [`commit`], [`commit_rendezvous`]) run the
//! local multi-rank protocol over the same [`Store`].
//! Nothing relies on conditional PUT: one writer per prefix (format-spec/s3.md §Writers).
//!
//! **Open** GETs the manifest once, then downloads every shard with parallel ranged GETs
//! into fresh buffers and runs every check [`Checkpoint::open`] runs (object sizes, header
//! lengths, header CRCs), so all readers of [`Checkpoint`] work unchanged. CRCs of tensors
//! are checked where the local path checks them (loads, `verify`). [`open_lazy`] gives the
//! same reader, [`Checkpoint`], over [`RemoteShard`]s: shard headers fetched at open, tensor
//! bytes by ranged GETs when read ([`Checkpoint::read_tensor`], [`Checkpoint::read_region`]
//! fetching only the CRC blocks a region touches, [`Checkpoint::stream_tensors`]).
//!
//! Configuration is the usual environment ([`S3Config::from_env`]): `AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP`, plus
//! `CKPT_S3_MAX_RETRIES` and `CKPT_S3_RETRY_TIMEOUT_S` for the retry policy (transient
//! errors: connection failures, 5xx, throttling, retried with exponential backoff).

use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, MultipartId, ObjectStore, ObjectStoreExt,
    PutPayload, RetryConfig,
};

use super::{Put, RemoteUrl, Store};
use crate::checkpoint::{
    decode_manifest, source, Checkpoint, Fetch, Shard, ShardSource, TensorInfo,
};
use crate::error::{Error, Result};
use crate::format::manifest::{Manifest, OptimizerSection, MANIFEST_FILE};
use crate::format::MAX_MANIFEST_SIZE;
use crate::write::parts::{self, CommitOptions, Part, PartItem};
use crate::write::{self, CommitInfo, SaveOptions, TensorRef};

/// How to reach the object store and how hard to try.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// Endpoint URL (`http://127.0.0.1:9000`); `None`: `AWS_ENDPOINT_URL` or AWS itself.
    pub endpoint: Option<String>,
    /// Access key id; `None`: `AWS_ACCESS_KEY_ID`.
    pub access_key_id: Option<String>,
    /// Secret access key; `None`: `AWS_SECRET_ACCESS_KEY`.
    pub secret_access_key: Option<String>,
    /// Region; `None`: `AWS_REGION` (else `us-east-1`).
    pub region: Option<String>,
    /// Allow plain HTTP endpoints; `None`: `AWS_ALLOW_HTTP`.
    pub allow_http: Option<bool>,
    /// Retries of a failed request (transient errors only; 0 disables retries).
    pub max_retries: usize,
    /// No retry starts later than this after the first attempt.
    pub retry_timeout: Duration,
    /// The first backoff between retries (doubling up to 15 s).
    pub init_backoff: Duration,
    /// Timeout of one request.
    pub request_timeout: Duration,
    /// Size of a multipart upload part; a shard smaller than this is one PUT.
    pub part_size: usize,
    /// Parts of one shard uploaded at once.
    pub upload_concurrency: usize,
    /// Size of one ranged GET when downloading.
    pub range_size: usize,
    /// Ranged GETs in flight at once.
    pub download_concurrency: usize,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            endpoint: None,
            access_key_id: None,
            secret_access_key: None,
            region: None,
            allow_http: None,
            max_retries: 10,
            retry_timeout: Duration::from_secs(180),
            init_backoff: Duration::from_millis(100),
            request_timeout: Duration::from_secs(120),
            part_size: 16 << 20,
            upload_concurrency: 8,
            range_size: 8 << 20,
            download_concurrency: 16,
        }
    }
}

impl S3Config {
    /// The defaults, with the retry policy from `CKPT_S3_MAX_RETRIES` and
    /// `CKPT_S3_RETRY_TIMEOUT_S` where set; endpoint and credentials are read from the
    /// `AWS_*` variables when the store is built.
    pub fn from_env() -> Self {
        let mut c = S3Config::default();
        if let Some(n) = env_num("CKPT_S3_MAX_RETRIES") {
            c.max_retries = n as usize;
        }
        if let Some(s) = env_num("CKPT_S3_RETRY_TIMEOUT_S") {
            c.retry_timeout = Duration::from_secs(s);
        }
        c
    }

    fn build(&self, bucket: &str) -> Result<Arc<AmazonS3>> {
        install_tls_provider();
        // The client options go first: `with_client_options` replaces them whole, including
        // the `allow_http` that `from_env` read from AWS_ALLOW_HTTP.
        let allow_http = self.allow_http.unwrap_or_else(|| {
            std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| {
                matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes")
            })
        });
        let mut b = AmazonS3Builder::from_env()
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(self.request_timeout)
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_allow_http(allow_http),
            )
            .with_bucket_name(bucket);
        if let Some(e) = &self.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(k) = &self.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(s) = &self.secret_access_key {
            b = b.with_secret_access_key(s);
        }
        if let Some(r) = &self.region {
            b = b.with_region(r);
        }
        b = b.with_retry(RetryConfig {
            backoff: BackoffConfig {
                init_backoff: self.init_backoff,
                max_backoff: Duration::from_secs(15),
                base: 2.0,
            },
            max_retries: self.max_retries,
            retry_timeout: self.retry_timeout,
        });
        let store = b.build().map_err(|e| Error::Remote {
            op: "configure",
            url: format!("s3://{bucket}"),
            reason: e.to_string(),
        })?;
        Ok(Arc::new(store))
    }
}

/// TLS through rustls with the ring provider (the `reqwest` client `object_store` builds
/// needs a process-wide provider; an application that installed one keeps its own).
fn install_tls_provider() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn env_num(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// The internal runtime: a few worker threads drive the HTTP connections; callers block.
fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("ckpt-s3")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| Error::Remote {
        op: "start the I/O runtime",
        url: String::new(),
        reason: e.clone(),
    })
}

/// A store, a prefix and the policy: what every operation needs.
#[derive(Debug, Clone)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    /// The same client, for the multipart calls that name upload ids.
    mp: Arc<AmazonS3>,
    url: RemoteUrl,
    cfg: S3Config,
    rt: &'static tokio::runtime::Runtime,
}

/// What a store's error text means, for people.
fn explain(text: String, bucket: &str) -> String {
    if text.contains("NoSuchBucket") {
        format!("the bucket {bucket:?} does not exist ({text})")
    } else if text.contains("InvalidAccessKeyId")
        || text.contains("SignatureDoesNotMatch")
        || text.contains("AccessDenied")
        || text.contains("403 Forbidden")
    {
        format!("access denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ({text})")
    } else {
        text
    }
}

/// `object_store` error of `op` on the object `url`, for people.
fn remote_err(op: &'static str, url: &RemoteUrl, e: &object_store::Error) -> Error {
    let text = match e {
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            format!("access denied: {e}")
        }
        _ => e.to_string(),
    };
    Error::Remote {
        op,
        url: url.to_string(),
        reason: explain(text, &url.bucket),
    }
}

fn is_not_found(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. }) && !e.to_string().contains("NoSuchBucket")
}

impl Remote {
    /// Connect to the store of `url` (no request is made yet).
    ///
    /// # Errors
    /// [`Error::Remote`] if the configuration is invalid.
    pub fn new(url: &RemoteUrl, cfg: &S3Config) -> Result<Remote> {
        let s3 = cfg.build(&url.bucket)?;
        Ok(Remote {
            store: Arc::clone(&s3) as Arc<dyn ObjectStore>,
            mp: s3,
            url: url.clone(),
            cfg: cfg.clone(),
            rt: runtime()?,
        })
    }

    /// The underlying `object_store` handle (for benchmarks and tools).
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The URL of this prefix.
    pub fn url(&self) -> &RemoteUrl {
        &self.url
    }

    /// The same store under `prefix/name`.
    pub fn child(&self, name: &str) -> Remote {
        Remote {
            url: self.url.child(name),
            ..self.clone()
        }
    }

    fn path(&self, name: &str) -> ObjPath {
        ObjPath::from(self.url.key(name))
    }

    fn prefix_path(&self) -> Option<ObjPath> {
        (!self.url.prefix.is_empty()).then(|| ObjPath::from(self.url.prefix.as_str()))
    }

    /// Run a future on the internal runtime, blocking this thread.
    ///
    /// # Panics
    /// If called from inside a tokio runtime's worker (the runtime refuses nested blocking).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// The names of the objects directly under this prefix (not under deeper prefixes) and
    /// the names of the sub-prefixes, each without the trailing `/`.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn list(&self) -> Result<Listing> {
        let p = self.prefix_path();
        let r = self
            .block_on(self.store.list_with_delimiter(p.as_ref()))
            .map_err(|e| remote_err("list", &self.url, &e))?;
        let objects = r
            .objects
            .iter()
            .filter_map(|o| Some((o.location.filename()?.to_string(), o.size)))
            .collect();
        let prefixes = r
            .common_prefixes
            .iter()
            .filter_map(|p| Some(p.filename()?.to_string()))
            .collect();
        Ok(Listing { objects, prefixes })
    }

    /// GET one whole object, refusing one over `cap` bytes. `Ok(None)` if it does not exist.
    ///
    /// # Errors
    /// [`Error::Remote`]; [`Error::InvalidManifest`] if it is over the cap.
    pub fn get_small(&self, name: &str, cap: u64) -> Result<Option<Vec<u8>>> {
        let url = self.url.child(name);
        let path = self.path(name);
        self.block_on(async {
            let r = match self.store.get(&path).await {
                Ok(r) => r,
                Err(e) if is_not_found(&e) => return Ok(None),
                Err(e) => return Err(remote_err("GET", &url, &e)),
            };
            if r.meta.size > cap {
                return Err(Error::manifest(
                    url.to_string(),
                    format!(
                        "the object is {} bytes, over the {cap}-byte cap",
                        r.meta.size
                    ),
                ));
            }
            let b = r.bytes().await.map_err(|e| remote_err("GET", &url, &e))?;
            Ok(Some(b.to_vec()))
        })
    }

    /// PUT one small object in one request.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn put_small(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let path = self.path(name);
        self.block_on(self.store.put(&path, PutPayload::from(bytes)))
            .map(|_| ())
            .map_err(|e| remote_err("PUT", &self.url.child(name), &e))
    }

    /// Delete one object (a missing one is not an error).
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn delete(&self, name: &str) -> Result<()> {
        if is_upload_journal(name) {
            self.abort_journaled(name)?;
        }
        let path = self.path(name);
        match self.block_on(self.store.delete(&path)) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(remote_err("DELETE", &self.url.child(name), &e)),
        }
    }

    /// Abort the multipart upload an upload journal object `name` records (format-spec/s3.md
    /// §Uploads). An upload the store no longer knows (completed or aborted) is not an
    /// error, nor is one whose object exists (it completed); neither is a journal that is
    /// gone or unreadable (nothing to abort).
    fn abort_journaled(&self, name: &str) -> Result<()> {
        let Some(bytes) = self.get_small(name, 64 << 10)? else {
            return Ok(());
        };
        let Ok(j) = serde_json::from_slice::<UploadJournal>(&bytes) else {
            return Ok(());
        };
        let key = ObjPath::from(j.key.as_str());
        match self.block_on(self.mp.abort_multipart(&key, &j.upload_id)) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) || e.to_string().contains("NoSuchUpload") => Ok(()),
            // Some servers (s3s-fs) answer an abort of an upload they no longer have with
            // another error. Object keys are unique per checkpoint id, so an existing object
            // at the key means this upload completed (its writer stopped before deleting
            // the journal): nothing to abort.
            Err(_) if self.block_on(self.store.head(&key)).is_ok() => Ok(()),
            Err(e) => Err(Error::Remote {
                op: "abort multipart upload",
                url: format!(
                    "s3://{}/{} (upload {})",
                    self.url.bucket, j.key, j.upload_id
                ),
                reason: explain(e.to_string(), &self.url.bucket),
            }),
        }
    }

    /// One listing request under the prefix: `Ok` if the bucket exists and the credentials
    /// may list it; otherwise the error, in those words.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn probe(&self) -> Result<()> {
        let p = self.prefix_path();
        let first = self.block_on(async { self.store.list(p.as_ref()).next().await });
        match first {
            Some(Err(e @ object_store::Error::NotFound { .. })) => Err(Error::Remote {
                op: "list",
                url: format!("s3://{}", self.url.bucket),
                reason: format!("the bucket {:?} does not exist ({e})", self.url.bucket),
            }),
            Some(Err(e)) => Err(remote_err("list", &self.url, &e)),
            _ => Ok(()),
        }
    }

    /// Why there is no manifest: a missing bucket (probed with a listing) or nothing
    /// committed under the prefix.
    fn not_found(&self) -> Error {
        match self.probe() {
            Err(e) => e,
            Ok(()) => Error::NotFound {
                path: PathBuf::from(self.url.to_string()),
                reason: format!(
                    "no {MANIFEST_FILE} object under the prefix (nothing committed there)"
                ),
            },
        }
    }

    /// The committed manifest under this prefix: its bytes and decoded form.
    ///
    /// # Errors
    /// [`Error::NotFound`] if there is none; [`Error::Remote`]; the manifest errors of
    /// [`Checkpoint::open`].
    pub fn manifest(&self) -> Result<(Vec<u8>, Manifest)> {
        let bytes = match self.get_small(MANIFEST_FILE, MAX_MANIFEST_SIZE)? {
            Some(b) => b,
            None => return Err(self.not_found()),
        };
        let (m, _) = decode_manifest(&bytes, &self.url.child(MANIFEST_FILE).to_string())?;
        Ok((bytes, m))
    }

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
                let text = e.to_string();
                if text.contains("416") || text.contains("InvalidRange") || text.contains("Range") {
                    return Err(mismatch(format!(
                        "the object is shorter than the {object_size} bytes the manifest records (truncated or replaced): {text}"
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

/// The name prefix of upload journal objects: `.ckpt-tmp-upload-<32 hex>`, one per
/// multipart upload in progress (format-spec/s3.md §Uploads). A temporary-file name, so
/// every engine cleanup (`gc`, a save's start, a commit's cleanup) deletes it, through
/// [`Remote::delete`] (also [`Store::delete`]), which aborts the upload first.
const UPLOAD_JOURNAL_PREFIX: &str = ".ckpt-tmp-upload-";

fn is_upload_journal(name: &str) -> bool {
    name.starts_with(UPLOAD_JOURNAL_PREFIX)
}

/// The body of an upload journal object: the upload's key and id.
#[derive(serde::Serialize, serde::Deserialize)]
struct UploadJournal {
    key: String,
    upload_id: String,
}

/// What [`Remote::list`] found directly under a prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// Object names (the last key segment) and sizes.
    pub objects: Vec<(String, u64)>,
    /// Sub-prefix names, without the trailing `/`.
    pub prefixes: Vec<String>,
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
    open_with(url, &S3Config::from_env())
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

/// The old name of the lazy object-store reader, which is now the one reader over
/// fetched shards ([`open_lazy`]).
#[deprecated(note = "the lazy reader is Checkpoint<RemoteShard>, opened with store::s3::open_lazy")]
pub type RemoteCheckpoint = Checkpoint<RemoteShard>;

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

/// Save tensors as one committed checkpoint under `url`, configured from the environment.
///
/// # Errors
/// As [`save_with`].
pub fn save(url: &RemoteUrl, tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
    save_with(url, tensors, opts, None, &S3Config::from_env())
}

/// [`save`] with an optimizer section.
///
/// # Errors
/// As [`save_with`].
pub fn save_with_section(
    url: &RemoteUrl,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<CommitInfo> {
    save_with(url, tensors, opts, optimizer, &S3Config::from_env())
}

/// Save tensors as one committed checkpoint under `url` with the engine's commit protocol
/// (format-spec/s3.md §Save): shards streamed as multipart uploads, CRCs computed on the
/// way, the manifest PUT last. Afterwards the objects of earlier checkpoints under the
/// prefix are deleted.
///
/// # Errors
/// The input errors of [`crate::save`]; [`Error::Remote`] naming the object URL when an
/// upload fails (its cause says why: server down after retries, access denied, missing bucket).
/// After an error no new manifest is committed, this save's multipart uploads are aborted
/// and its completed shard objects deleted (best effort: a server that went away keeps
/// them until the next save or `ckpt gc`).
pub fn save_with(
    url: &RemoteUrl,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
    cfg: &S3Config,
) -> Result<CommitInfo> {
    let r = Remote::new(url, cfg)?;
    save_remote(&r, tensors, opts, optimizer)
}

/// [`save_with`] on a connected [`Remote`].
///
/// # Errors
/// As [`save_with`].
pub fn save_remote(
    r: &Remote,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<CommitInfo> {
    // One listing first: a missing bucket or bad credentials fail here, in those words,
    // before anything is uploaded (some servers create buckets on PUT).
    r.probe()?;
    write::save_impl(r, tensors, opts, optimizer)
}

// ---- multi-rank checkpoints (format-spec/s3.md §Multi-rank) ------------------------------

/// Write rank `rank`'s part of the multi-rank checkpoint `checkpoint_id` under `url`
/// (configured from the environment): [`write_part_remote`].
///
/// # Errors
/// As [`write_part_remote`].
pub fn write_part(
    url: &RemoteUrl,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    let r = Remote::new(url, &S3Config::from_env())?;
    write_part_remote(&r, checkpoint_id, rank, items, opts)
}

/// Write rank `rank`'s part of checkpoint `checkpoint_id` under the prefix of `r`
/// (format-spec/global.md §Parts, format-spec/s3.md §Multi-rank): its shards
/// `shard-<id>-r<rank>-<k>.safetensors` streamed as multipart uploads, then its part
/// descriptor `part-<id>-r<rank>.json` in one PUT. Ranks run concurrently, each with its
/// own connection; no manifest is written (the coordinator's [`commit_remote`] does that).
///
/// # Errors
/// The input errors of [`crate::write::parts::write_part`]; [`Error::InvalidArgument`] if
/// the part object of this rank and id already exists; [`Error::Remote`] naming the object
/// URL when a request fails. After an error this call's multipart uploads are aborted and
/// its completed objects deleted (best effort, as for [`save_with`]).
pub fn write_part_remote(
    r: &Remote,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    r.probe()?;
    parts::write_part_impl(r, checkpoint_id, rank, items, opts, true, || Ok(()))
}

/// Commit the parts of checkpoint `checkpoint_id` under `url` (configured from the
/// environment): [`commit_remote`].
///
/// # Errors
/// As [`commit_remote`].
pub fn commit(
    url: &RemoteUrl,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    let r = Remote::new(url, &S3Config::from_env())?;
    commit_remote(&r, checkpoint_id, parts, opts)
}

/// Commit the parts of checkpoint `checkpoint_id` under the prefix of `r` with the local
/// commit's rules (format-spec/global.md §The commit, C1-C6): check every part, read the
/// header of every shard object it lists (a HEAD and one ranged GET each: size, header
/// length, header CRC), merge, validate the merged manifest with the reader's rules, PUT
/// it last, then delete the part objects of this id and the engine objects of other ids.
///
/// **One committer per prefix** (format-spec/s3.md §Writers): nothing locks the prefix; no
/// other save or commit may run under it meanwhile, and every rank must have finished its
/// [`write_part_remote`] (the parts given are their return values, or use
/// [`commit_rendezvous_remote`], which waits for the part objects).
///
/// # Errors
/// Nothing is committed after any error (the previous manifest stays): the errors of
/// [`crate::write::parts::commit`], with [`Error::ShardMismatch`] naming the object URL of a
/// missing or wrong shard and [`Error::MissingParts`] naming the prefix URL;
/// [`Error::Remote`] naming the object URL when a request fails.
pub fn commit_remote(
    r: &Remote,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    r.probe()?;
    parts::commit_impl(r, checkpoint_id, parts, opts, || Ok(()))
}

/// Wait for the part objects of ranks `0..world_size` under `url`, then commit them
/// (configured from the environment): [`commit_rendezvous_remote`].
///
/// # Errors
/// As [`commit_rendezvous_remote`].
pub fn commit_rendezvous(
    url: &RemoteUrl,
    checkpoint_id: &str,
    world_size: u32,
    timeout: Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    let r = Remote::new(url, &S3Config::from_env())?;
    commit_rendezvous_remote(&r, checkpoint_id, world_size, timeout, opts)
}

/// The coordinator's rendezvous on an object store: list the prefix until the part objects
/// `part-<id>-r<rank>.json` of every rank `0..world_size` are there (polling; a zero
/// `timeout` looks once), GET and decode each, then [`commit_remote`] them with
/// `world_size`. A part object is PUT in one request after all its rank's shards
/// completed, so a listed part names complete shard objects.
///
/// # Errors
/// [`Error::MissingParts`] naming the prefix URL and the ranks whose part object is still
/// missing at the timeout (nothing is committed); [`Error::InvalidPart`] naming the object
/// URL of a descriptor that does not decode; otherwise as [`commit_remote`].
pub fn commit_rendezvous_remote(
    r: &Remote,
    checkpoint_id: &str,
    world_size: u32,
    timeout: Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    r.probe()?;
    let wait = parts::Rendezvous {
        world_size,
        timeout,
        poll: parts::POLL.max(Duration::from_millis(50)),
    };
    parts::commit_rendezvous_impl(r, checkpoint_id, &wait, opts, || Ok(()))
}

/// Delete, under `url`, every engine object no committed manifest names (shards of
/// interrupted or superseded saves, temporary objects); never the manifest or objects the
/// engine did not write. Returns the names deleted.
///
/// # Errors
/// [`Error::Remote`].
pub fn gc_prefix(r: &Remote) -> Result<Vec<String>> {
    let keep: Vec<String> = match r.manifest() {
        Ok((_, m)) => m.shards.iter().map(|s| s.file.clone()).collect(),
        Err(Error::NotFound { .. }) => Vec::new(),
        Err(e) => return Err(e),
    };
    let mut deleted = Vec::new();
    for (name, _) in r.list()?.objects {
        if write::is_engine_file(&name) && !keep.contains(&name) {
            r.delete(&name)?;
            deleted.push(name);
        }
    }
    Ok(deleted)
}

/// The object store as the writer's [`Store`]: the engine's commit protocol with objects
/// for files (format-spec/s3.md §Save).
///
/// * A streamed object ([`Store::put_streamed`]: a shard) goes straight to its final key:
///   the name is unique to the checkpoint id and no manifest names it yet, so nobody reads
///   it before the commit. Up to one part it is buffered and PUT by [`Put::finish`]; beyond,
///   it is a multipart upload (journaled, §Uploads) that `finish` completes.
/// * A small object ([`Store::put`]: the manifest, a part descriptor) is one PUT, which for
///   the manifest is the commit.
/// * [`Store::barrier`] does nothing: a completed PUT is durable on the server.
impl Store for Remote {
    type Put<'a> = ObjectPut<'a>;

    fn list(&self) -> Result<Vec<String>> {
        Ok(Remote::list(self)?
            .objects
            .into_iter()
            .map(|(n, _)| n)
            .collect())
    }

    fn exists(&self, name: &str) -> Result<bool> {
        match self.block_on(self.store.head(&self.path(name))) {
            Ok(_) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(remote_err("HEAD", &self.url.child(name), &e)),
        }
    }

    fn read_prefix(&self, name: &str, max: u64) -> Result<(u64, Vec<u8>)> {
        let key = self.path(name);
        let url = self.url.child(name);
        self.block_on(async {
            let meta = self
                .store
                .head(&key)
                .await
                .map_err(|e| remote_err("HEAD", &url, &e))?;
            let n = max.min(meta.size);
            let b = if n == 0 {
                Vec::new()
            } else {
                self.store
                    .get_range(&key, 0..n)
                    .await
                    .map_err(|e| remote_err("GET", &url, &e))?
                    .to_vec()
            };
            Ok((meta.size, b))
        })
    }

    fn put_streamed(&self, name: &str, _staging: &str) -> Result<ObjectPut<'_>> {
        Ok(ObjectPut {
            r: self,
            name: name.to_string(),
            key: self.path(name),
            part_size: self.cfg.part_size.max(5 << 20),
            concurrency: self.cfg.upload_concurrency.max(1),
            state: PutState::Buffer(Vec::new()),
        })
    }

    fn put(&self, name: &str, _staging: &str, bytes: &[u8]) -> Result<()> {
        self.put_small(name, bytes.to_vec())
    }

    fn barrier(&self, _context: &'static str) -> Result<()> {
        Ok(())
    }

    fn delete(&self, name: &str) -> Result<()> {
        Remote::delete(self, name)
    }

    fn location(&self) -> PathBuf {
        PathBuf::from(self.url.to_string())
    }

    fn describe(&self, name: &str) -> String {
        self.url.child(name).to_string()
    }
}

/// The error of a write request `op` on `url`: as [`remote_err`], except that a write can
/// only miss an object's *bucket*, which it then says.
fn write_err(op: &'static str, r: &Remote, url: &RemoteUrl, e: &object_store::Error) -> Error {
    if matches!(e, object_store::Error::NotFound { .. }) {
        return Error::Remote {
            op,
            url: url.to_string(),
            reason: format!("the bucket {:?} does not exist ({e})", r.url.bucket),
        };
    }
    remote_err(op, url, e)
}

/// An object being written to an object store ([`Store::put_streamed`] on a [`Remote`]):
/// buffered up to one part, then a multipart upload with parts uploaded concurrently while
/// the writer produces the next ones. [`Put::finish`] PUTs the buffer or completes the
/// upload; a drop without it aborts the upload and deletes its journal.
pub struct ObjectPut<'r> {
    r: &'r Remote,
    name: String,
    key: ObjPath,
    part_size: usize,
    concurrency: usize,
    state: PutState,
}

enum PutState {
    Buffer(Vec<u8>),
    Multipart(Upload),
    Done,
}

/// A multipart upload in progress, recorded by its journal object.
struct Upload {
    id: MultipartId,
    /// The journal object's name (under the prefix).
    journal: String,
    /// The part being filled (up to `part_size` bytes).
    buf: Vec<u8>,
    /// Index of the next part.
    next: usize,
    /// Parts uploading, oldest first (their indexes follow `done`).
    in_flight: std::collections::VecDeque<tokio::task::JoinHandle<object_store::Result<PartId>>>,
    /// Parts uploaded, in index order.
    done: Vec<PartId>,
}

/// A failed request of an upload, with what was being done, carried through [`Write`]'s
/// `io::Error` to [`Put::write_error`].
#[derive(Debug)]
struct UploadError {
    op: &'static str,
    source: object_store::Error,
}

impl std::fmt::Display for UploadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.op, self.source)
    }
}

impl std::error::Error for UploadError {}

fn upload_io(op: &'static str, source: object_store::Error) -> io::Error {
    io::Error::other(UploadError { op, source })
}

impl ObjectPut<'_> {
    fn url(&self) -> RemoteUrl {
        self.r.url.child(&self.name)
    }

    /// Start the multipart upload: create it, then PUT its journal (format-spec/s3.md
    /// §Uploads) so that an interrupted save's upload can be aborted later.
    fn start_upload(&self) -> io::Result<Upload> {
        let r = self.r;
        let id = r
            .block_on(r.mp.create_multipart(&self.key))
            .map_err(|e| upload_io("create multipart upload", e))?;
        let journal = format!("{UPLOAD_JOURNAL_PREFIX}{}", journal_suffix()?);
        let body = serde_json::to_vec(&UploadJournal {
            key: self.key.to_string(),
            upload_id: id.clone(),
        })
        .map_err(io::Error::other)?;
        if let Err(e) = r.block_on(r.store.put(&r.path(&journal), PutPayload::from(body))) {
            let _ = r.block_on(r.mp.abort_multipart(&self.key, &id));
            return Err(upload_io("PUT upload journal", e));
        }
        Ok(Upload {
            id,
            journal,
            buf: Vec::with_capacity(self.part_size),
            next: 0,
            in_flight: Default::default(),
            done: Vec::new(),
        })
    }

    /// Wait for the oldest part in flight.
    fn wait_oldest(r: &Remote, up: &mut Upload) -> io::Result<()> {
        if let Some(h) = up.in_flight.pop_front() {
            let part = r
                .block_on(h)
                .map_err(io::Error::other)?
                .map_err(|e| upload_io("upload part", e))?;
            up.done.push(part);
        }
        Ok(())
    }

    /// Hand the filled part to the runtime, with at most `concurrency` parts in flight.
    fn send_part(
        r: &Remote,
        key: &ObjPath,
        part_size: usize,
        concurrency: usize,
        up: &mut Upload,
    ) -> io::Result<()> {
        while up.in_flight.len() >= concurrency {
            Self::wait_oldest(r, up)?;
        }
        let data = std::mem::replace(&mut up.buf, Vec::with_capacity(part_size));
        let (mp, key, id, idx) = (Arc::clone(&r.mp), key.clone(), up.id.clone(), up.next);
        up.next += 1;
        up.in_flight.push_back(
            r.rt.spawn(async move { mp.put_part(&key, &id, idx, PutPayload::from(data)).await }),
        );
        Ok(())
    }

    /// Send the last part, wait for every part, complete the upload, delete its journal.
    fn complete(&self, up: &mut Upload) -> io::Result<()> {
        let r = self.r;
        if !up.buf.is_empty() || up.next == 0 {
            Self::send_part(r, &self.key, self.part_size, self.concurrency, up)?;
        }
        while !up.in_flight.is_empty() {
            Self::wait_oldest(r, up)?;
        }
        let parts = std::mem::take(&mut up.done);
        r.block_on(r.mp.complete_multipart(&self.key, &up.id, parts))
            .map_err(|e| upload_io("complete multipart upload", e))?;
        // The upload is complete: its journal goes (a journal left behind names an upload
        // the store no longer has, which `gc` takes as aborted).
        r.block_on(r.store.delete(&r.path(&up.journal)))
            .map_err(|e| upload_io("DELETE upload journal", e))
    }
}

/// 32 random hex digits for a journal's name.
fn journal_suffix() -> io::Result<String> {
    write::random_id().map_err(io::Error::other)
}

/// Abort an upload (its parts in flight first), then delete its journal if the abort
/// succeeded; best effort: what fails stays for `gc`.
fn abort_upload(r: &Remote, key: &ObjPath, up: Upload) {
    for h in &up.in_flight {
        h.abort();
    }
    if r.block_on(r.mp.abort_multipart(key, &up.id)).is_ok() {
        let _ = r.block_on(r.store.delete(&r.path(&up.journal)));
    }
}

impl Write for ObjectPut<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            match &mut self.state {
                PutState::Buffer(b) => {
                    if b.len() + buf.len() <= self.part_size {
                        b.extend_from_slice(buf);
                        return Ok(buf.len());
                    }
                    // Over one part: switch to a multipart upload.
                    let first = std::mem::take(b);
                    let mut up = self.start_upload()?;
                    up.buf = first;
                    up.buf.reserve(self.part_size.saturating_sub(up.buf.len()));
                    self.state = PutState::Multipart(up);
                }
                PutState::Multipart(up) => {
                    let mut rest = buf;
                    while !rest.is_empty() {
                        let room = self.part_size.saturating_sub(up.buf.len());
                        let n = room.min(rest.len());
                        up.buf.extend_from_slice(&rest[..n]);
                        rest = &rest[n..];
                        if up.buf.len() >= self.part_size {
                            Self::send_part(
                                self.r,
                                &self.key,
                                self.part_size,
                                self.concurrency,
                                up,
                            )?;
                        }
                    }
                    return Ok(buf.len());
                }
                PutState::Done => {
                    return Err(io::Error::other(format!(
                        "{} is already complete",
                        self.name
                    )))
                }
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Put for ObjectPut<'_> {
    fn write_error(&self, e: io::Error) -> Error {
        let url = self.url();
        match e.get_ref().and_then(|i| i.downcast_ref::<UploadError>()) {
            Some(u) => write_err(u.op, self.r, &url, &u.source),
            None => Error::Remote {
                op: "write",
                url: url.to_string(),
                reason: explain(e.to_string(), &self.r.url.bucket),
            },
        }
    }

    fn sync(&mut self) -> Result<()> {
        Ok(())
    }

    fn finish(mut self) -> Result<()> {
        match std::mem::replace(&mut self.state, PutState::Done) {
            PutState::Buffer(b) => {
                let r = self.r;
                r.block_on(r.store.put(&self.key, PutPayload::from(b)))
                    .map(|_| ())
                    .map_err(|e| write_err("PUT", r, &self.url(), &e))
            }
            PutState::Multipart(mut up) => match self.complete(&mut up) {
                Ok(()) => Ok(()),
                Err(e) => {
                    abort_upload(self.r, &self.key, up);
                    Err(self.write_error(e))
                }
            },
            PutState::Done => Ok(()),
        }
    }
}

impl Drop for ObjectPut<'_> {
    fn drop(&mut self) {
        // An upload never completed: abort it so the server frees its parts.
        if let PutState::Multipart(up) = std::mem::replace(&mut self.state, PutState::Done) {
            abort_upload(self.r, &self.key, up);
        }
    }
}
