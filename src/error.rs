//! The crate's one error type.

use std::path::PathBuf;

/// Result alias used throughout ckptstore.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure ckptstore reports.
///
/// Variants carry the context a user needs to act: the file, the shard, the tensor, the
/// parameter and optimizer state, and for mismatches what was expected and what was found.
/// The enum is `#[non_exhaustive]`: match with a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O call failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("open", "read", "fsync", "rename", ...).
        op: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// No checkpoint (no manifest, no safetensors file, no index) exists at the path.
    #[error("no checkpoint at {path}: {reason}")]
    NotFound {
        /// The path that was opened.
        path: PathBuf,
        /// What was looked for.
        reason: String,
    },

    /// A safetensors shard header is malformed or inconsistent with its file.
    #[error("invalid shard header in {file}: {reason}")]
    InvalidHeader {
        /// The shard file (as named in the manifest, or the path opened).
        file: String,
        /// What is wrong, naming the tensor where one is involved.
        reason: String,
    },

    /// The checkpoint manifest (or a Hugging Face index) is malformed or inconsistent.
    #[error("invalid manifest {file}: {reason}")]
    InvalidManifest {
        /// The manifest file.
        file: String,
        /// What is wrong.
        reason: String,
    },

    /// The manifest declares a format version this reader does not know.
    #[error("{file}: unsupported format version {found} (this reader supports version {supported}); upgrade ckptstore")]
    UnsupportedVersion {
        /// The manifest file.
        file: String,
        /// The version found.
        found: u64,
        /// The newest version this build reads.
        supported: u64,
    },

    /// The manifest requires a feature this reader does not implement.
    #[error("{file}: requires feature {feature:?} that this reader does not implement; upgrade ckptstore")]
    UnsupportedFeature {
        /// The manifest file.
        file: String,
        /// The feature name.
        feature: String,
    },

    /// A shard file's size or identity does not match what the manifest recorded.
    #[error("shard {shard} ({file}): {reason}")]
    ShardMismatch {
        /// Index of the shard in the manifest.
        shard: usize,
        /// The shard file name.
        file: String,
        /// What disagrees.
        reason: String,
    },

    /// Stored bytes do not match their recorded CRC32.
    #[error("checksum mismatch in {what} (shard {shard}, file {file}): expected crc32 {expected:#010x}, got {got:#010x}")]
    ChecksumMismatch {
        /// What was checked: `tensor "NAME"`, `shard header`, or `manifest`.
        what: String,
        /// Index of the shard in the manifest (0 for the manifest itself).
        shard: usize,
        /// The file holding the bytes.
        file: String,
        /// The CRC32 recorded at save time.
        expected: u32,
        /// The CRC32 of the bytes now on disk.
        got: u32,
    },

    /// A tensor name was looked up that the checkpoint does not hold.
    #[error("no tensor named {name:?} in the checkpoint")]
    TensorNotFound {
        /// The requested name.
        name: String,
    },

    /// A tensor given to the writer, or asked of a view, is inconsistent.
    #[error("tensor {name:?}: {reason}")]
    InvalidTensor {
        /// The tensor name.
        name: String,
        /// What is wrong.
        reason: String,
    },

    /// A typed view was requested with the wrong element type or an unaligned buffer.
    #[error("tensor {name:?}: cannot view as {requested}: {reason}")]
    BadView {
        /// The tensor name.
        name: String,
        /// The requested element type.
        requested: &'static str,
        /// Why not.
        reason: String,
    },

    /// The optimizer section of a checkpoint, or an optimizer state handed to the writer,
    /// is inconsistent.
    #[error("optimizer state: parameter {param:?}, state {state:?}: {reason}")]
    InvalidOptimizerState {
        /// The parameter name ("" when the error concerns the whole section).
        param: String,
        /// The state name ("" when the error concerns the parameter or a group).
        state: String,
        /// What is wrong.
        reason: String,
    },

    /// A checkpoint's optimizer state does not fit the live optimizer or model it is
    /// restored into (the rule of format-spec/optimizer.md §Compatibility,
    /// [`crate::optim::check_compatible`]); nothing was changed.
    #[error("cannot restore optimizer state: {}{reason}", incompatible_at(.group, .param))]
    IncompatibleState {
        /// The parameter group involved, by position (`None` when the error concerns the
        /// whole optimizer: its class, the number of groups).
        group: Option<usize>,
        /// The parameter involved ("" when none is).
        param: String,
        /// What does not fit, with what the checkpoint and the live optimizer each have.
        reason: String,
    },

    /// A dtype conversion was asked that cannot be done, or would lose data.
    #[error("parameter {param:?}, state {state:?}: {reason}")]
    Conversion {
        /// The parameter name.
        param: String,
        /// The state name.
        state: String,
        /// What is wrong.
        reason: String,
    },

    /// A tensor's values disagree with the absmax its manifest records. Its CRC matched,
    /// so the data are what was written: the manifest was written by a faulty or foreign
    /// writer. The load was abandoned; nothing was changed.
    #[error("tensor {tensor:?} in shard {shard} ({file}): the manifest records absmax {recorded:e}, but the data's absmax is {actual:e}; the checkpoint's manifest is wrong: load this state as F32, or re-save the checkpoint")]
    AbsmaxMismatch {
        /// The tensor.
        tensor: String,
        /// Index of its shard.
        shard: usize,
        /// Its shard file.
        file: String,
        /// The absmax the manifest records.
        recorded: f32,
        /// The absmax of the data (infinity or NaN if the data hold one).
        actual: f32,
    },

    /// A part descriptor of a multi-rank save (format-spec/global.md §Parts) is damaged,
    /// inconsistent, or cannot be committed with the others; nothing was committed.
    #[error("part {part}: {reason}")]
    InvalidPart {
        /// The part: its file name (`part-<id>-r<rank>.json`) or what was decoded.
        part: String,
        /// What is wrong, naming the rank, shard or tensor involved.
        reason: String,
    },

    /// Two ranks' parts disagree about a tensor (format-spec/global.md §The commit, C3-C4);
    /// nothing was committed.
    #[error("tensor {name:?}: ranks {} and {}: {reason}", ranks[0], ranks[1])]
    PartConflict {
        /// The tensor (whole or global) the ranks disagree about.
        name: String,
        /// The two ranks, lower first.
        ranks: [u32; 2],
        /// What disagrees.
        reason: String,
    },

    /// Ranks of a multi-rank save have not written their parts (missing from the parts
    /// given, or still absent when the rendezvous timed out); nothing was committed.
    #[error("checkpoint {checkpoint_id} in {}: no part from rank(s) {missing:?}", dir.display())]
    MissingParts {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The checkpoint id being committed.
        checkpoint_id: String,
        /// The ranks without a part, ascending.
        missing: Vec<u32>,
    },

    /// An argument given to the API is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A checkpoint location is a URL this build cannot use (an unknown scheme, `s3://`
    /// without the `s3` feature, or a malformed URL). URLs are never taken as local paths.
    #[error("cannot use {url}: {reason}")]
    UnsupportedUrl {
        /// The location as given.
        url: String,
        /// Why not, and what is supported.
        reason: String,
    },

    /// A request to an object store failed after its retries (server unreachable, access
    /// denied, missing bucket, ...).
    #[error("{op} {url}: {reason}")]
    Remote {
        /// What was being done ("GET", "PUT", "list", ...).
        op: &'static str,
        /// The object or prefix URL (`s3://bucket/key`).
        url: String,
        /// What the store said.
        reason: String,
    },
}

/// The "group G, parameter P: " prefix of [`Error::IncompatibleState`]'s message.
fn incompatible_at(group: &Option<usize>, param: &str) -> String {
    match (group, param.is_empty()) {
        (Some(g), false) => format!("group {g}, parameter {param:?}: "),
        (Some(g), true) => format!("group {g}: "),
        (None, false) => format!("parameter {param:?}: "),
        (None, true) => String::new(),
    }
}

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn header(file: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidHeader {
            file: file.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn manifest(file: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidManifest {
            file: file.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn optim(
        param: impl Into<String>,
        state: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Error::InvalidOptimizerState {
            param: param.into(),
            state: state.into(),
            reason: reason.into(),
        }
    }
}
