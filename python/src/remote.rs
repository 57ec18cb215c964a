//! Checkpoint locations from Python: a `path` argument is parsed as a location first
//! (`ckptstore::store::Location`), so `s3://bucket/prefix` goes to the object store (the
//! `AWS_*` environment configures it) and is never taken as a local path; an unsupported
//! scheme raises `ValueError` (`UnsupportedUrl`).

use std::path::Path;

use ckptstore::optim::OptimizerStateRef;
use ckptstore::store::{self, Location, Storage};
use ckptstore::{Checkpoint, CommitInfo, Result, SaveOptions, TensorRef};

/// Open the checkpoint at a path or URL: local ones memory-mapped, remote ones downloaded.
pub(crate) fn open(path: &Path) -> Result<Checkpoint<Storage>> {
    store::open(&Location::from_path(path)?)
}

/// Save plain tensors at a path or URL.
pub(crate) fn save(path: &Path, refs: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
    store::save_with_section(&Location::from_path(path)?, refs, opts, None)
}

/// Save an optimizer state with model tensors at a path or URL.
pub(crate) fn save_optimizer(
    path: &Path,
    opt: &OptimizerStateRef<'_>,
    refs: &[TensorRef<'_>],
    opts: &SaveOptions,
) -> Result<CommitInfo> {
    store::save_optimizer(&Location::from_path(path)?, opt, refs, opts)
}
