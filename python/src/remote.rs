//! Checkpoint locations from Python: a `path` argument is parsed as a location first
//! (`ckptstore::Location`), so `s3://bucket/prefix` goes to the object store (the
//! `AWS_*` environment configures it) and is never taken as a local path; an unsupported
//! scheme raises `ValueError` (`UnsupportedUrl`).

use std::path::Path;

use ckptstore::optim::OptimizerStateRef;
use ckptstore::store::Location;
use ckptstore::{Checkpoint, CommitInfo, Result, SaveOptions, Storage, TensorRef};

/// A checkpoint opened by [`open_any`].
pub(crate) enum Opened {
    /// Shard bytes in memory: memory-mapped, or downloaded.
    Resident(Box<Checkpoint<Storage>>),
    /// An object-store checkpoint whose shards are fetched on read.
    Fetched(std::sync::Arc<dyn crate::reader::Reader>),
}

/// Open the checkpoint at a path or URL; with `lazy`, an object-store checkpoint's shards
/// are fetched by ranged GETs when read instead of downloaded now (local checkpoints are
/// memory-mapped either way: nothing is read at open).
pub(crate) fn open_any(path: &Path, lazy: bool) -> Result<Opened> {
    match Location::from_path(path)? {
        Location::Remote(u) if lazy => Ok(Opened::Fetched(std::sync::Arc::new(
            ckptstore::checkpoint::remote::open_lazy(&ckptstore::store::s3::Remote::new(
                &u,
                &ckptstore::store::s3::S3Config::try_from_env()?,
            )?)?,
        ))),
        loc => Ok(Opened::Resident(Box::new(ckptstore::open(&loc)?))),
    }
}

/// Save plain tensors at a path or URL.
pub(crate) fn save(path: &Path, refs: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
    ckptstore::save(path, refs, opts)
}

/// Save an optimizer state with model tensors at a path or URL.
pub(crate) fn save_optimizer(
    path: &Path,
    opt: &OptimizerStateRef<'_>,
    refs: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    opt.save(path, refs, opts)
}
