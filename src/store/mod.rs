//! Where a checkpoint lives: a local path or an object-store URL (`s3://bucket/prefix`).
//!
//! Every entry point that takes a checkpoint location as text ([`open`], [`save`], the CLI,
//! the Python bindings) parses it with [`Location::parse`] first: a string of the form
//! `scheme://...` is never taken as a local path. `s3://` is served by [`s3`] (cargo
//! feature `s3`, on by default); `file:///abs/path` is a local path; any other scheme, or
//! `s3://` in a build without the feature, is [`Error::UnsupportedUrl`].
//!
//! Local checkpoints open with read-only memory maps exactly as [`Checkpoint::open`] does;
//! remote ones are downloaded into fresh buffers ([`Storage::Owned`]), so every reader of
//! [`Checkpoint`] (views, `verify`, conversions, optimizer loads, region reads) works on
//! both. The object layout is in format-spec/s3.md.

use std::path::{Path, PathBuf};

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::format::manifest::OptimizerSection;
use crate::mmap::Map;
use crate::write::parts::{CommitOptions, Part, PartItem};
use crate::write::{CommitInfo, SaveOptions, TensorRef};

#[cfg(feature = "s3")]
pub mod s3;
#[cfg(feature = "s3")]
pub mod s3_manager;

/// The shard bytes of a checkpoint opened through [`open`]: a read-only map of a local
/// file, or a buffer downloaded from an object store.
#[derive(Debug)]
pub enum Storage {
    /// A local shard file, mapped read-only.
    Mapped(Map),
    /// A shard downloaded into memory (there is nothing to map).
    Owned(Vec<u8>),
}

impl crate::mmap::ReleasePages for Storage {
    fn release_pages(&self, offset: usize, len: usize) {
        if let Storage::Mapped(m) = self {
            m.release(offset, len);
        }
    }
}

impl AsRef<[u8]> for Storage {
    fn as_ref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m.as_ref(),
            Storage::Owned(v) => v,
        }
    }
}

/// An object-store URL: `scheme://bucket/prefix` (the prefix without leading or trailing
/// slashes; empty for the bucket's root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    /// The scheme, lower case (`s3`).
    pub scheme: String,
    /// The bucket.
    pub bucket: String,
    /// The key prefix of the checkpoint (or manager root) inside the bucket.
    pub prefix: String,
}

impl RemoteUrl {
    /// The URL of `name` under this prefix (`s3://bucket/prefix/name`).
    pub fn child(&self, name: &str) -> RemoteUrl {
        let prefix = if self.prefix.is_empty() {
            name.trim_matches('/').to_string()
        } else {
            format!("{}/{}", self.prefix, name.trim_matches('/'))
        };
        RemoteUrl {
            prefix,
            ..self.clone()
        }
    }

    /// The object key of `name` under this prefix.
    pub fn key(&self, name: &str) -> String {
        self.child(name).prefix
    }
}

impl std::fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "{}://{}", self.scheme, self.bucket)
        } else {
            write!(f, "{}://{}/{}", self.scheme, self.bucket, self.prefix)
        }
    }
}

/// A parsed checkpoint location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A local file or directory.
    Local(PathBuf),
    /// An object-store prefix.
    Remote(RemoteUrl),
}

/// `s` starts with `scheme://`, where a scheme is a letter followed by letters, digits, `+`,
/// `-` or `.` (RFC 3986 §3.1). Returns the scheme and the rest.
fn split_scheme(s: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = s.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some((scheme, rest))
}

impl Location {
    /// Parse a checkpoint location: `s3://bucket/prefix`, `file:///abs/path`, or a local path
    /// (anything without a `scheme://` prefix).
    ///
    /// # Errors
    /// [`Error::UnsupportedUrl`] for any other scheme, for `s3://` in a build without the
    /// `s3` feature, and for an `s3://` URL without a bucket or with empty, `.` or `..`
    /// segments in its prefix.
    pub fn parse(s: &str) -> Result<Location> {
        let Some((scheme, rest)) = split_scheme(s) else {
            return Ok(Location::Local(PathBuf::from(s)));
        };
        let unsupported = |reason: String| Error::UnsupportedUrl {
            url: s.to_string(),
            reason,
        };
        match scheme.to_ascii_lowercase().as_str() {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(unsupported(
                        "a file:// URL needs an absolute path (file:///dir/ckpt)".into(),
                    ));
                }
                Ok(Location::Local(PathBuf::from(rest)))
            }
            "s3" => {
                if !cfg!(feature = "s3") {
                    return Err(unsupported(
                        "this build of ckptstore has no object-store support (cargo feature `s3`)"
                            .into(),
                    ));
                }
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(unsupported("no bucket (expected s3://bucket/prefix)".into()));
                }
                let prefix = prefix.trim_end_matches('/');
                if !prefix.is_empty()
                    && prefix
                        .split('/')
                        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
                {
                    return Err(unsupported(
                        "the prefix has an empty, `.` or `..` segment".into(),
                    ));
                }
                Ok(Location::Remote(RemoteUrl {
                    scheme: "s3".into(),
                    bucket: bucket.to_string(),
                    prefix: prefix.to_string(),
                }))
            }
            other => Err(unsupported(format!(
                "the scheme {other:?} is not supported (supported: s3://bucket/prefix, file:///path, or a local path)"
            ))),
        }
    }

    /// Parse a location given as a path (a CLI argument, say): a path whose text is a URL
    /// is parsed as one.
    ///
    /// # Errors
    /// As [`Location::parse`]; [`Error::UnsupportedUrl`] for a non-UTF-8 path that starts
    /// like a URL.
    pub fn from_path(p: &Path) -> Result<Location> {
        match p.to_str() {
            Some(s) => Location::parse(s),
            None => Ok(Location::Local(p.to_path_buf())),
        }
    }

    /// The local path, or [`Error::UnsupportedUrl`] naming `what` for a remote location.
    ///
    /// # Errors
    /// [`Error::UnsupportedUrl`] for a remote location.
    pub fn local(&self, what: &str) -> Result<&Path> {
        match self {
            Location::Local(p) => Ok(p),
            Location::Remote(u) => Err(Error::UnsupportedUrl {
                url: u.to_string(),
                reason: format!("{what} needs a local path"),
            }),
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Remote(u) => write!(f, "{u}"),
        }
    }
}

/// Open a checkpoint at a path or URL ([`Location::parse`]): local ones as
/// [`Checkpoint::open`] does (memory maps), remote ones with [`s3::open`].
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`Checkpoint::open`] or [`s3::open`].
pub fn open(location: &str) -> Result<Checkpoint<Storage>> {
    open_location(&Location::parse(location)?)
}

/// [`open`] on a parsed location.
///
/// # Errors
/// As [`open`].
pub fn open_location(location: &Location) -> Result<Checkpoint<Storage>> {
    match location {
        Location::Local(p) => Ok(Checkpoint::open(p)?.map_storage(Storage::Mapped)),
        #[cfg(feature = "s3")]
        Location::Remote(u) => Ok(s3::open(u)?.map_storage(Storage::Owned)),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(Error::UnsupportedUrl {
            url: u.to_string(),
            reason: "this build of ckptstore has no object-store support".into(),
        }),
    }
}

/// Save tensors as one committed checkpoint at a path or URL: [`crate::save`] locally,
/// [`s3::save`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of [`crate::save`] or [`s3::save`].
pub fn save(location: &str, tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
    save_with_section(location, tensors, opts, None)
}

/// [`save`] with an optimizer section (see [`crate::save_with_section`]).
///
/// # Errors
/// As [`save`].
pub fn save_with_section(
    location: &str,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<CommitInfo> {
    save_location(&Location::parse(location)?, tensors, opts, optimizer)
}

/// [`save_with_section`] on a parsed location.
///
/// # Errors
/// As [`save`].
pub fn save_location(
    location: &Location,
    tensors: &[TensorRef<'_>],
    opts: &SaveOptions,
    optimizer: Option<OptimizerSection>,
) -> Result<CommitInfo> {
    match location {
        Location::Local(p) => crate::write::save_with_section(p, tensors, opts, optimizer),
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::save_with_section(u, tensors, opts, optimizer),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(Error::UnsupportedUrl {
            url: u.to_string(),
            reason: "this build of ckptstore has no object-store support".into(),
        }),
    }
}

/// Save an optimizer state with `model` tensors beside it at a location (as
/// [`crate::optim::OptimizerState::save`] does locally).
///
/// # Errors
/// As [`crate::optim::OptimizerState::save`] and [`save`].
pub fn save_optimizer(
    location: &Location,
    state: &crate::optim::OptimizerStateRef<'_>,
    model: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    let (tensors, section) = state.to_parts(model)?;
    save_location(location, &tensors, opts, Some(section))
}

/// Write rank `rank`'s part of the multi-rank checkpoint `checkpoint_id` at a path or URL:
/// [`crate::write::parts::write_part`] locally, [`s3::write_part`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of those functions.
pub fn write_part(
    location: &str,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    write_part_location(
        &Location::parse(location)?,
        checkpoint_id,
        rank,
        items,
        opts,
    )
}

/// [`write_part`] on a parsed location.
///
/// # Errors
/// As [`write_part`].
pub fn write_part_location(
    location: &Location,
    checkpoint_id: &str,
    rank: u32,
    items: &[PartItem<'_>],
    opts: &SaveOptions,
) -> Result<Part> {
    match location {
        Location::Local(p) => crate::write::parts::write_part(p, checkpoint_id, rank, items, opts),
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::write_part(u, checkpoint_id, rank, items, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(u)),
    }
}

/// Commit the parts of a multi-rank checkpoint at a path or URL (the manifest last):
/// [`crate::write::parts::commit`] locally, [`s3::commit`] on an object store (one
/// committer per prefix: format-spec/s3.md §Writers).
///
/// # Errors
/// [`Error::UnsupportedUrl`]; the errors of those functions (nothing is committed).
pub fn commit(
    location: &str,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    commit_location(&Location::parse(location)?, checkpoint_id, parts, opts)
}

/// [`commit`] on a parsed location.
///
/// # Errors
/// As [`commit`].
pub fn commit_location(
    location: &Location,
    checkpoint_id: &str,
    parts: &[Part],
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    match location {
        Location::Local(p) => crate::write::parts::commit(p, checkpoint_id, parts, opts),
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::commit(u, checkpoint_id, parts, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(u)),
    }
}

/// Wait (at most `timeout`) for the parts of ranks `0..world_size` at a path or URL, then
/// commit them: [`crate::write::parts::commit_rendezvous`] locally,
/// [`s3::commit_rendezvous`] on an object store.
///
/// # Errors
/// [`Error::UnsupportedUrl`]; [`Error::MissingParts`] naming the ranks still missing at the
/// timeout; the errors of those functions (nothing is committed).
pub fn commit_rendezvous(
    location: &str,
    checkpoint_id: &str,
    world_size: u32,
    timeout: std::time::Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    commit_rendezvous_location(
        &Location::parse(location)?,
        checkpoint_id,
        world_size,
        timeout,
        opts,
    )
}

/// [`commit_rendezvous`] on a parsed location.
///
/// # Errors
/// As [`commit_rendezvous`].
pub fn commit_rendezvous_location(
    location: &Location,
    checkpoint_id: &str,
    world_size: u32,
    timeout: std::time::Duration,
    opts: &CommitOptions,
) -> Result<CommitInfo> {
    match location {
        Location::Local(p) => {
            crate::write::parts::commit_rendezvous(p, checkpoint_id, world_size, timeout, opts)
        }
        #[cfg(feature = "s3")]
        Location::Remote(u) => s3::commit_rendezvous(u, checkpoint_id, world_size, timeout, opts),
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(no_s3(u)),
    }
}

#[cfg(not(feature = "s3"))]
fn no_s3(u: &RemoteUrl) -> Error {
    Error::UnsupportedUrl {
        url: u.to_string(),
        reason: "this build of ckptstore has no object-store support".into(),
    }
}

/// Write one small file `name` beside a checkpoint (an index, say) durably: a local
/// temporary file, fsync, rename, directory fsync; on an object store, one PUT.
///
/// # Errors
/// [`Error::Io`] / [`Error::Remote`] naming the file or object.
pub fn put_file(location: &Location, name: &str, bytes: &[u8]) -> Result<()> {
    match location {
        Location::Local(dir) => {
            use std::io::Write;
            let tmp = dir.join(format!("{}{name}", crate::write::TEMP_PREFIX));
            let target = dir.join(name);
            let r = (|| {
                let mut f =
                    std::fs::File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
                f.write_all(bytes)
                    .map_err(|e| Error::io("write", &tmp, e))?;
                f.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
                drop(f);
                std::fs::rename(&tmp, &target).map_err(|e| Error::io("rename", &target, e))?;
                std::fs::File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| Error::io("fsync", dir, e))
            })();
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r
        }
        #[cfg(feature = "s3")]
        Location::Remote(u) => {
            s3::Remote::new(u, &s3::S3Config::from_env())?.put_small(name, bytes.to_vec())
        }
        #[cfg(not(feature = "s3"))]
        Location::Remote(u) => Err(Error::UnsupportedUrl {
            url: u.to_string(),
            reason: "this build of ckptstore has no object-store support".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_never_paths() {
        assert_eq!(
            Location::parse("runs/ckpt").unwrap(),
            Location::Local("runs/ckpt".into())
        );
        assert_eq!(
            Location::parse("file:///tmp/x").unwrap(),
            Location::Local("/tmp/x".into())
        );
        assert!(matches!(
            Location::parse("gs://b/p"),
            Err(Error::UnsupportedUrl { .. })
        ));
        assert!(matches!(
            Location::parse("file://rel"),
            Err(Error::UnsupportedUrl { .. })
        ));
        // A colon without `//` is a path (e.g. `a:b`).
        assert_eq!(
            Location::parse("a:b").unwrap(),
            Location::Local("a:b".into())
        );
        if cfg!(feature = "s3") {
            let Location::Remote(u) = Location::parse("s3://bkt/run/one/").unwrap() else {
                panic!("not remote")
            };
            assert_eq!((u.bucket.as_str(), u.prefix.as_str()), ("bkt", "run/one"));
            assert_eq!(u.to_string(), "s3://bkt/run/one");
            assert_eq!(u.key("ckpt-manifest.json"), "run/one/ckpt-manifest.json");
            assert!(Location::parse("s3:///p").is_err());
            assert!(Location::parse("s3://b/a//c").is_err());
            assert!(Location::parse("s3://b/a/../c").is_err());
        } else {
            assert!(Location::parse("s3://b/p").is_err());
        }
    }
}
