//! Checkpoints on S3-compatible object stores (cargo feature `s3`), through the Apache
//! Arrow [`object_store`] crate and a small internal tokio runtime.
//!
//! The layout is the local one with objects for files (format-spec/s3.md): under
//! `s3://bucket/prefix/`, shard objects named uniquely per checkpoint id
//! (`shard-<id>-<i>.safetensors`), then `ckpt-manifest.json`, PUT last: the commit.
//!
//! This is the store layer: it moves bytes and knows nothing of the reader or the writer
//! above it. **Save** is the engine's own commit protocol (`write`, over [`Remote`] as the
//! writer's [`Store`](super::Store); the verbs are in `write::remote`): each shard streams
//! into a multipart upload ([`ObjectPut`]; parts uploaded concurrently while the writer
//! computes every tensor's CRC32 from the same bytes), and the manifest is one PUT after
//! every shard upload has completed. An error or a dropped save aborts its multipart uploads
//! and deletes the shard objects it completed; a killed process leaves shard objects no
//! manifest names and incomplete multipart uploads, which the next save's cleanup or
//! `ckpt gc` deletes and aborts (each upload is journaled by an object naming its id:
//! format-spec/s3.md §Uploads). Multi-rank checkpoints run the local multi-rank protocol over
//! the same store. Nothing relies on conditional PUT: one writer per prefix
//! (format-spec/s3.md §Writers).
//!
//! **Open** (the reader, `checkpoint::remote`) GETs the manifest once ([`Remote::manifest`]),
//! then reads shards by parallel ranged GETs ([`Remote::read_ranges`]), whole into fresh
//! buffers or lazily through [`RemoteShard`]s.
//!
//! By job: this file configures and connects ([`S3Config`], [`Remote::new`]); `client`
//! makes the requests (listing, small GETs and PUTs, deletes, probing) and is the
//! writer's store; `upload` streams objects as multipart uploads with their journals;
//! `read` makes ranged GETs; `gc` deletes what no manifest names.
//!
//! Configuration is the usual environment ([`S3Config::from_env`]): `AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP`, plus
//! `CKPT_S3_MAX_RETRIES` and `CKPT_S3_RETRY_TIMEOUT_S` for the retry policy (transient
//! errors: connection failures, 5xx, throttling, retried with exponential backoff).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use super::RemoteUrl;
use crate::error::{Error, Result};

mod client;
mod gc;
mod read;
mod upload;

pub use client::Listing;
pub use gc::gc_prefix;
pub use read::RemoteShard;
pub use upload::ObjectPut;

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
    /// The defaults, with the policy the environment sets (endpoint and credentials are
    /// read from the `AWS_*` variables when the store is built):
    ///
    /// * `CKPT_S3_MAX_RETRIES`: retries of a failed request (an integer >= 0; `n` retries
    ///   is up to `n + 1` attempts; 0 disables retries). Default 10.
    /// * `CKPT_S3_RETRY_TIMEOUT_S`: seconds after the first attempt past which no retry
    ///   starts (a decimal >= 0; 0 disables retries). Default 180.
    /// * `CKPT_S3_REQUEST_TIMEOUT_S`: seconds one request may take, a stalled connection
    ///   included, before it fails (and is retried, as a transient error, within the two
    ///   limits above) (a decimal > 0). Default 120.
    ///
    /// What is retried: connection failures, timeouts, 5xx and throttling answers of any
    /// request, and a body cut short of a GET (`object_store` retries the rest of the
    /// body); a body cut short of another request fails it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the variable for a value that is not of its form
    /// (a negative number, a word, a fraction of retries): a typo never silently becomes
    /// the default.
    pub fn try_from_env() -> Result<Self> {
        let mut c = S3Config::default();
        if let Some(n) = env_parse("CKPT_S3_MAX_RETRIES", "an integer >= 0", |v| {
            v.parse::<usize>().ok()
        })? {
            c.max_retries = n;
        }
        if let Some(d) = env_parse(
            "CKPT_S3_RETRY_TIMEOUT_S",
            "a number of seconds >= 0",
            seconds,
        )? {
            c.retry_timeout = d;
        }
        if let Some(d) = env_parse(
            "CKPT_S3_REQUEST_TIMEOUT_S",
            "a number of seconds > 0",
            |v| seconds(v).filter(|d| !d.is_zero()),
        )? {
            c.request_timeout = d;
        }
        Ok(c)
    }

    /// [`S3Config::try_from_env`], with the defaults in place of any value it refuses.
    #[deprecated(
        note = "use try_from_env, which refuses invalid CKPT_S3_* values instead of ignoring them"
    )]
    pub fn from_env() -> Self {
        Self::try_from_env().unwrap_or_default()
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

/// The variable `name` parsed by `parse`; `None` when it is unset or empty.
fn env_parse<T>(name: &str, form: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Option<T>> {
    let Ok(v) = std::env::var(name) else {
        return Ok(None);
    };
    let v = v.trim();
    if v.is_empty() {
        return Ok(None);
    }
    parse(v).map(Some).ok_or_else(|| {
        Error::InvalidArgument(format!("{name}={v:?} is not valid: it must be {form}"))
    })
}

/// A non-negative, finite number of seconds (`"90"`, `"1.5"`).
fn seconds(v: &str) -> Option<Duration> {
    let x: f64 = v.parse().ok()?;
    (0.0..1e12).contains(&x).then(|| Duration::from_secs_f64(x))
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
}
