//! The writer's verbs over an object store (format-spec/s3.md §Save, §Multi-rank): each
//! runs the protocol of [`super::save`] / [`super::parts`] with the store's [`Remote`] as
//! its [`crate::store::Store`] (cargo feature `s3`).

use std::time::Duration;

use super::parts::{self, CommitOptions, Part, PartItem};
use super::{CommitInfo, SaveOptions, TensorRef};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::format::manifest::OptimizerSection;
use crate::location::RemoteUrl;
use crate::store::s3::{Remote, S3Config};

/// Save tensors as one committed checkpoint under `url`, configured from the environment.
///
/// # Errors
/// As [`save_with`].
pub fn save(url: &RemoteUrl, tensors: &[TensorRef<'_>], opts: &SaveOptions) -> Result<CommitInfo> {
    save_with(url, tensors, opts, None, &S3Config::try_from_env()?)
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
    save_with(url, tensors, opts, optimizer, &S3Config::try_from_env()?)
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
    super::save_impl(r, tensors, opts, optimizer)
}

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
    let r = Remote::new(url, &S3Config::try_from_env()?)?;
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
    let r = Remote::new(url, &S3Config::try_from_env()?)?;
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
    let r = Remote::new(url, &S3Config::try_from_env()?)?;
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
