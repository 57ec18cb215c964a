//! Streamed objects ([`ObjectPut`]): buffered up to one part, then multipart uploads with
//! parts in flight while the writer produces the next ones, each journaled by an object
//! under the prefix so that an interrupted upload can be aborted later
//! (format-spec/s3.md §Uploads).

use std::io::{self, Write};
use std::sync::Arc;

use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use object_store::{MultipartId, ObjectStoreExt, PutPayload};

use super::client::{explain, is_not_found, write_err};
use super::Remote;
use crate::error::{Error, Result};
use crate::format::journal::{UploadJournal, JOURNAL_PREFIX, MAX_JOURNAL_SIZE};
use crate::location::RemoteUrl;
use crate::store::Put;
#[cfg(doc)]
use crate::store::Store;

pub(super) use crate::format::journal::is_journal_name as is_upload_journal;

impl Remote {
    /// Abort the multipart upload an upload journal object `name` records (format-spec/s3.md
    /// §Uploads). An upload the store no longer knows (completed or aborted) is not an
    /// error, nor is one whose object exists (it completed); neither is a journal that is
    /// gone, unreadable, or names an object that is not this prefix's (nothing of ours to
    /// abort: [`UploadJournal::decode`]).
    pub(super) fn abort_journaled(&self, name: &str) -> Result<()> {
        let Some(bytes) = self.get_small(name, MAX_JOURNAL_SIZE)? else {
            return Ok(());
        };
        // A journal that is not one of ours names no upload we may abort.
        let Some(j) = UploadJournal::decode(&bytes, &self.url.prefix) else {
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
    /// Bytes handed to parts so far.
    sent: u64,
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

impl<'r> ObjectPut<'r> {
    /// A put of object `name` under the prefix of `r`: nothing is sent before a part is
    /// full or the put is finished.
    pub(super) fn new(r: &'r Remote, name: &str) -> Self {
        ObjectPut {
            r,
            name: name.to_string(),
            key: r.path(name),
            part_size: r.cfg.part_size.max(5 << 20),
            concurrency: r.cfg.upload_concurrency.max(1),
            state: PutState::Buffer(Vec::new()),
        }
    }

    fn url(&self) -> RemoteUrl {
        self.r.url.child(&self.name)
    }

    /// Start the multipart upload: create it, then PUT its journal (format-spec/s3.md
    /// §Uploads) so that an interrupted save's upload can be aborted later.
    fn start_upload(&self) -> io::Result<Upload> {
        let r = self.r;
        // A retried create whose first answer was lost leaves that upload empty and
        // unjournaled: no parts, no bytes stored (bucket lifecycle rules end those).
        let id = r
            .block_on(r.retrying_cut(|| r.mp.create_multipart(&self.key)))
            .map_err(|e| upload_io("create multipart upload", e))?;
        let journal = format!("{JOURNAL_PREFIX}{}", journal_suffix()?);
        let body = UploadJournal {
            key: self.key.to_string(),
            upload_id: id.clone(),
        }
        .encode();
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
            sent: 0,
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
        up.sent += data.len() as u64;
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
        if let Err(e) = r.block_on(r.mp.complete_multipart(&self.key, &up.id, parts)) {
            // The server may have completed the upload and lost its answer (a retry of
            // the completion then finds the upload gone): an object of exactly the bytes
            // sent under the key is this upload's result, since one writer owns the
            // prefix and the key is unique to this checkpoint (format-spec/s3.md).
            let landed = r
                .block_on(r.store.head(&self.key))
                .is_ok_and(|meta| meta.size == up.sent);
            if !landed {
                return Err(upload_io("complete multipart upload", e));
            }
        }
        // The upload is complete: its journal goes, best effort (a journal left behind
        // names an upload the store no longer has, which `gc` takes as done): the object
        // is published whatever this answer says.
        let _ = r.block_on(r.store.delete(&r.path(&up.journal)));
        Ok(())
    }
}

/// 32 random hex digits for a journal's name.
fn journal_suffix() -> io::Result<String> {
    crate::format::names::random_id().map_err(io::Error::other)
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

    fn finish(mut self: Box<Self>) -> Result<()> {
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
