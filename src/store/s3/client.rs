//! The requests of an object-store prefix ([`Remote`]): listing, small GETs and PUTs,
//! deletes, probing, the committed manifest, and the writer's [`Store`] over them; errors
//! said for people.

use std::path::PathBuf;

use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::upload::{is_upload_journal, ObjectPut};
use super::Remote;
use crate::error::{Error, Result};
use crate::format::manifest::decode_checked as decode_manifest;
use crate::format::manifest::{Manifest, MANIFEST_FILE};
use crate::format::MAX_MANIFEST_SIZE;
use crate::location::RemoteUrl;
use crate::store::{Access, Held, Put, Store};

/// What a store's error text means, for people.
pub(super) fn explain(text: String, bucket: &str) -> String {
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
pub(super) fn remote_err(op: &'static str, url: &RemoteUrl, e: &object_store::Error) -> Error {
    let text = match e {
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            format!("access denied: {e}")
        }
        _ => e.to_string(),
    };
    // The causes, which the outer message often hides (a timeout, a reset connection).
    let mut text = text;
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text = format!("{text}: {c_text}");
        }
        cause = c.source();
    }
    Error::Remote {
        op,
        url: url.to_string(),
        reason: explain(text, &url.bucket),
    }
}

/// Whether the store refused a ranged GET because the range lies past the object's end
/// (HTTP 416, S3's `InvalidRange`): a short object, said in the shard's terms by the reader.
///
/// Decided from the status line and error code the server sent, found in the causes, never
/// from the whole message: that also holds the URL, the elapsed time and the object's name,
/// whose digits may spell `416` (a stalled GET that timed out after `1.000416932s` was once
/// reported as a short object).
pub(super) fn is_range_not_satisfiable(e: &object_store::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        // A transport failure (timeout, reset, refused) carries no status.
        if c.downcast_ref::<object_store::client::HttpError>()
            .is_some()
        {
            return false;
        }
        let text = c.to_string();
        if text.contains("status code: 416 ") || text.contains("<Code>InvalidRange</Code>") {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Whether `e` is a request whose answer was cut after its status line: a reset
/// connection, a truncated or stalled body of a LIST, CreateMultipartUpload or other
/// response that `object_store` parses (its client error holds the transport error itself,
/// [`object_store::client::HttpError`]). `object_store` retries such bodies for object GETs
/// only; a failed request, retried by `object_store` already, holds its retry error there
/// instead.
pub(super) fn is_cut_answer(e: &object_store::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|c| c.source())
        .is_some_and(|c| {
            c.downcast_ref::<object_store::client::HttpError>()
                .is_some()
        })
}

impl Remote {
    /// Run the idempotent request `op` again while its answer is cut ([`is_cut_answer`]),
    /// within the configured budget (`max_retries`, `retry_timeout`, the backoff doubling
    /// from `init_backoff` up to 15 s), as `object_store` does for the requests themselves.
    pub(super) async fn retrying_cut<T, F, Fut>(&self, mut op: F) -> object_store::Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = object_store::Result<T>>,
    {
        let start = std::time::Instant::now();
        let mut backoff = self.cfg.init_backoff;
        let mut retries = 0;
        loop {
            match op().await {
                Err(e)
                    if is_cut_answer(&e)
                        && retries < self.cfg.max_retries
                        && start.elapsed() < self.cfg.retry_timeout =>
                {
                    retries += 1;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(15));
                }
                r => return r,
            }
        }
    }
}

pub(super) fn is_not_found(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. }) && !e.to_string().contains("NoSuchBucket")
}

impl Remote {
    /// The names of the objects directly under this prefix (not under deeper prefixes) and
    /// the names of the sub-prefixes, each without the trailing `/`.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn list(&self) -> Result<Listing> {
        let p = self.prefix_path();
        let r = self
            .block_on(self.retrying_cut(|| self.store.list_with_delimiter(p.as_ref())))
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

    /// One listing request under the prefix: `Ok` if the bucket exists and the credentials
    /// may list it; otherwise the error, in those words.
    ///
    /// # Errors
    /// [`Error::Remote`].
    pub fn probe(&self) -> Result<()> {
        let p = self.prefix_path();
        let first = self.block_on(
            self.retrying_cut(|| async { self.store.list(p.as_ref()).next().await.transpose() }),
        );
        match first {
            Err(e @ object_store::Error::NotFound { .. }) => Err(Error::Remote {
                op: "list",
                url: format!("s3://{}", self.url.bucket),
                reason: format!("the bucket {:?} does not exist ({e})", self.url.bucket),
            }),
            Err(e) => Err(remote_err("list", &self.url, &e)),
            Ok(_) => Ok(()),
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
    /// [`Error::NotFound`] if there is none; [`Error::Remote`]; the manifest's own errors
    /// ([`Error::InvalidManifest`], [`Error::ChecksumMismatch`], [`Error::UnsupportedVersion`],
    /// [`Error::UnsupportedFeature`]) naming its URL.
    pub fn manifest(&self) -> Result<(Vec<u8>, Manifest)> {
        let bytes = match self.get_small(MANIFEST_FILE, MAX_MANIFEST_SIZE)? {
            Some(b) => b,
            None => return Err(self.not_found()),
        };
        let (m, _) = decode_manifest(&bytes, &self.url.child(MANIFEST_FILE).to_string())?;
        Ok((bytes, m))
    }
}

/// What [`Remote::list`] found directly under a prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// Object names (the last key segment) and sizes.
    pub objects: Vec<(String, u64)>,
    /// Sub-prefix names, without the trailing `/`.
    pub prefixes: Vec<String>,
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
            let meta = self.store.head(&key).await.map_err(|e| {
                if is_not_found(&e) {
                    Error::NotFound {
                        path: PathBuf::from(url.to_string()),
                        reason: "no such object".into(),
                    }
                } else {
                    remote_err("HEAD", &url, &e)
                }
            })?;
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

    fn put_streamed(&self, name: &str, _staging: &str) -> Result<Box<dyn Put + '_>> {
        Ok(Box::new(ObjectPut::new(self, name)))
    }

    /// One listing: a missing bucket or bad credentials fail here, in those words, before
    /// anything is uploaded (some servers create buckets on PUT). Nothing locks a prefix
    /// (one writer per prefix: format-spec/s3.md §Writers).
    fn begin(&self, _access: Access) -> Result<Held> {
        self.probe()?;
        Ok(Held::default())
    }

    fn remote(&self) -> Option<&Remote> {
        Some(self)
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
pub(super) fn write_err(
    op: &'static str,
    r: &Remote,
    url: &RemoteUrl,
    e: &object_store::Error,
) -> Error {
    if matches!(e, object_store::Error::NotFound { .. }) {
        return Error::Remote {
            op,
            url: url.to_string(),
            reason: format!("the bucket {:?} does not exist ({e})", r.url.bucket),
        };
    }
    remote_err(op, url, e)
}

#[cfg(test)]
mod tests {
    use super::is_range_not_satisfiable;
    use object_store::client::{HttpError, HttpErrorKind};

    /// An error shaped like object_store's retry error: its text holds the whole story,
    /// its source the reason.
    #[derive(Debug)]
    struct Outer(String, Option<Box<dyn std::error::Error + Send + Sync>>);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    fn generic(e: Outer) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: Box::new(e),
        }
    }

    #[test]
    fn a_timeout_whose_text_holds_416_is_not_a_short_object() {
        // The message a clean-clone CI run once misread: `416` in the elapsed time.
        let timeout = HttpError::new(HttpErrorKind::Timeout, std::io::Error::other("timed out"));
        let e = generic(Outer(
            "Error performing GET http://127.0.0.1:41679/bkt/Range/shard-416.safetensors \
             in 1.000416932s - HTTP error: error sending request"
                .into(),
            Some(Box::new(timeout)),
        ));
        assert!(!is_range_not_satisfiable(&e));
    }

    #[test]
    fn a_416_status_or_invalid_range_code_is_a_short_object() {
        for text in [
            "Error performing GET http://h/b/k in 3ms - Server returned non-2xx status code: \
             416 Range Not Satisfiable: ",
            "Error performing GET http://h/b/k in 3ms - Server returned error response: \
             <Error><Code>InvalidRange</Code></Error>",
        ] {
            assert!(
                is_range_not_satisfiable(&generic(Outer(text.into(), None))),
                "{text}"
            );
        }
        let other = "Error performing GET http://h/b/k in 3ms - Server returned non-2xx status \
                     code: 500 Internal Server Error: ";
        assert!(!is_range_not_satisfiable(&generic(Outer(
            other.into(),
            None
        ))));
    }
}
