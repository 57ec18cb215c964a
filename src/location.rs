//! Checkpoint locations: a local path or an object-store URL (`s3://bucket/prefix`).
//!
//! The base floor of the crate (it imports only [`crate::error`]): every verb that takes a
//! checkpoint location, local or remote, parses it here, and every verb that works on local
//! files only refuses a path whose text is a URL ([`local_path`]), so that
//! `save("s3://bucket/run", ...)` never creates a local directory `s3:/bucket/run`.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

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

/// A value that names a checkpoint location: text (`&str`, `String`: parsed with
/// [`Location::parse`]), a path (`&Path`, `PathBuf`: parsed with [`Location::from_path`],
/// so a path whose text is a URL is taken as that URL), or a [`Location`].
pub trait IntoLocation {
    /// The location.
    ///
    /// # Errors
    /// [`Error::UnsupportedUrl`] as [`Location::parse`].
    fn into_location(self) -> Result<Location>;
}

impl IntoLocation for Location {
    fn into_location(self) -> Result<Location> {
        Ok(self)
    }
}

impl IntoLocation for &Location {
    fn into_location(self) -> Result<Location> {
        Ok(self.clone())
    }
}

/// Text and paths: [`Location::from_path`] (UTF-8 text as [`Location::parse`]; a path
/// whose text is a URL is that URL).
impl<T: AsRef<Path>> IntoLocation for T {
    fn into_location(self) -> Result<Location> {
        Location::from_path(self.as_ref())
    }
}

/// `path` for a verb that works on local files only (`verb` names it in the error):
/// `file:///abs` becomes `/abs`; a path whose text is any other URL is refused.
///
/// # Errors
/// [`Error::UnsupportedUrl`] for URL text, saying which verb takes URLs instead.
pub fn local_path(path: &Path, verb: &str) -> Result<PathBuf> {
    match Location::from_path(path) {
        Ok(Location::Local(p)) => Ok(p),
        Ok(Location::Remote(u)) => Err(Error::UnsupportedUrl {
            url: u.to_string(),
            reason: format!(
                "{verb} takes a local path; open, save, write or commit a URL with \
                 ckptstore::open / ckptstore::save / ckptstore::write_part / \
                 ckptstore::commit"
            ),
        }),
        Err(Error::UnsupportedUrl { url, reason }) => Err(Error::UnsupportedUrl {
            url,
            reason: format!("{verb}: {reason}"),
        }),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_verbs_refuse_urls() {
        for url in ["s3://bucket/run", "S3://b/p", "gs://b/p", "file://rel"] {
            let e = local_path(Path::new(url), "Checkpoint::open").unwrap_err();
            let Error::UnsupportedUrl { reason, .. } = &e else {
                panic!("{url}: {e:?}")
            };
            assert!(reason.contains("Checkpoint::open"), "{reason}");
        }
        assert_eq!(
            local_path(Path::new("file:///tmp/x"), "v").unwrap(),
            PathBuf::from("/tmp/x")
        );
        assert_eq!(
            local_path(Path::new("runs/a:b"), "v").unwrap(),
            PathBuf::from("runs/a:b")
        );
    }

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
