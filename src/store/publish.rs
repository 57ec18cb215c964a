//! Whole directories put in place, swapped and removed in one step (format-spec/durability.md
//! §Directories): the publish of a manager's step, and of every framework integration's
//! checkpoint directory, goes through here and through the [`Fs`] seam, so the crash
//! simulation (tests/publish_crash.rs) enumerates the same operations a real run makes.
//!
//! * [`publish_dir`][]: `staging` (a directory whose files and entries are already durable)
//!   becomes `target`. A missing target is one `rename`; an existing one is swapped with one
//!   `exchange` (`renameat2(RENAME_EXCHANGE)`), so that `target` names the old directory or
//!   the new one at every instant and after every crash, never neither; the old one is then
//!   removed. Where the file system cannot exchange, two renames through a hidden
//!   `.<name>.ckpt-old-<id>` sibling are the fallback, and [`sweep_leftovers`] puts the old
//!   directory back if a crash fell between them.
//! * [`remove_dir`][]: `target` is renamed to a hidden `.<name>.ckpt-trash-<id>` sibling, that
//!   rename is made durable, then the sibling is deleted: a crash leaves the directory
//!   whole or gone, never half-deleted under its own name.
//! * [`sweep_leftovers`][]: what a crash left in a parent directory: trash is deleted, an old
//!   directory whose target exists is deleted, one whose target is missing is restored.
//! * [`make_dir`][]: a directory and its missing parents made, their entries durable, also
//!   where other hosts make them at the same moment through a shared file system.

use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};

use super::fs::Fs;
use crate::error::{Error, Result};

/// The marker of a replaced directory kept during the two-rename fallback of
/// [`publish_dir`]: `.<name>.ckpt-old-<16 hex>`.
pub const OLD_MARK: &str = ".ckpt-old-";
/// The marker of a directory being removed by [`remove_dir`]: `.<name>.ckpt-trash-<16 hex>`.
pub const TRASH_MARK: &str = ".ckpt-trash-";

/// Make the directory `staging` visible as `target` in one step, replacing the directory
/// (or file) at `target` if there is one; then fsync the parent directory (both parents,
/// if they differ).
///
/// `staging` must be on the same file system as `target`, and its own content must already
/// be durable (a committed checkpoint is: its commit fsyncs every file and the directory).
/// The replaced directory is deleted afterwards; a failure there leaves garbage that
/// [`sweep_leftovers`] removes, never damage.
///
/// # Errors
/// [`Error::Io`] naming the operation and the path: a missing `staging`, a rename or
/// exchange refused by the system, a failed directory fsync. On an error before the
/// directory fsync, `target` still names its old directory (or nothing, if there was none).
pub fn publish_dir<F: Fs>(fs: &F, staging: &Path, target: &Path) -> Result<()> {
    let parents = parents(staging, target)?;
    match fs.rename(staging, target) {
        Ok(()) => return sync_all(fs, &parents),
        Err(e) if occupied(&e) => {}
        Err(e) => return Err(Error::io("rename", staging, e)),
    }
    match fs.exchange(staging, target) {
        Ok(()) => {
            sync_all(fs, &parents)?;
            // `staging` now holds the replaced directory (or file).
            remove_replaced(fs, staging);
            return Ok(());
        }
        Err(e) if e.kind() == ErrorKind::Unsupported => {}
        Err(e) => return Err(Error::io("exchange", target, e)),
    }
    // No atomic exchange on this file system: two renames, with the old directory under a
    // name that `sweep_leftovers` restores should a crash fall between them.
    let old = sibling(target, OLD_MARK)?;
    fs.rename(target, &old)
        .map_err(|e| Error::io("rename", target, e))?;
    if let Err(e) = fs.rename(staging, target) {
        let _ = fs.rename(&old, target);
        return Err(Error::io("rename", staging, e));
    }
    sync_all(fs, &parents)?;
    remove_replaced(fs, &old);
    Ok(())
}

/// Delete what a publish replaced: a directory (a checkpoint), or a file (a framework's own
/// checkpoint file that a checkpoint directory of the same name replaces: Lightning's
/// `last.ckpt` after a switch). A failure leaves garbage, never damage.
fn remove_replaced<F: Fs>(fs: &F, old: &Path) {
    if fs.remove_dir_all(old).is_err() {
        let _ = fs.remove(old);
    }
}

/// Remove the directory `target` and everything in it: renamed to a hidden sibling, that
/// rename made durable (parent fsync), then deleted. Returns `false` when there was
/// nothing at `target`.
///
/// # Errors
/// [`Error::Io`] when the rename or the parent's fsync fails (`target` is then still
/// whole). A failure while deleting the renamed directory is not an error: the directory
/// is already gone from `target`, and [`sweep_leftovers`] deletes the rest later.
pub fn remove_dir<F: Fs>(fs: &F, target: &Path) -> Result<bool> {
    let parent = parent(target)?;
    let trash = sibling(target, TRASH_MARK)?;
    match fs.rename(target, &trash) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io("rename", target, e)),
    }
    fs.sync_dir(parent)
        .map_err(|e| Error::io("fsync directory", parent, e))?;
    let _ = fs.remove_dir_all(&trash);
    Ok(true)
}

/// Make the directory `dir` and its missing parents, each new entry durable (its parent
/// fsynced), as a save prepares its checkpoint directory; nothing when `dir` is a directory
/// already. Also where other hosts make the same directories at the same moment through a
/// shared file system, whose client caches can answer "missing" for what another host just
/// made (format-spec/durability.md, "On a shared file system").
///
/// # Errors
/// [`Error::Io`] naming the directory when it cannot be made (a file in the way, say), or
/// a parent when its fsync fails.
pub fn make_dir(dir: &Path) -> Result<()> {
    super::local::prepare_dir(dir)
}

/// Clean what an interrupted [`publish_dir`] or [`remove_dir`] left in `parent`: every
/// `.<name>.ckpt-trash-*` is deleted; a `.<name>.ckpt-old-*` is deleted when `<name>`
/// exists and renamed back to `<name>` when it does not (a crash between the fallback's
/// two renames). Returns how many leftovers were deleted or restored; a missing `parent`
/// holds none.
///
/// Run it where no publish into `parent` is in flight (at start-up, or under the caller's
/// lock): a publish caught between its two fallback renames would find its old directory
/// restored and fail with an error (no data is lost).
///
/// # Errors
/// [`Error::Io`] when `parent` cannot be listed, or a restore (rename) fails.
pub fn sweep_leftovers<F: Fs>(fs: &F, parent: &Path) -> Result<usize> {
    let names = match fs.list(parent) {
        Ok(n) => n,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(Error::io("list", parent, e)),
    };
    let mut done = 0;
    let mut restored = false;
    for name in &names {
        let path = parent.join(name);
        if leftover_of(name, TRASH_MARK).is_some() {
            done += usize::from(fs.remove_dir_all(&path).is_ok());
        } else if let Some(orig) = leftover_of(name, OLD_MARK) {
            if names.iter().any(|n| n == orig) {
                done += usize::from(fs.remove_dir_all(&path).is_ok());
            } else {
                fs.rename(&path, &parent.join(orig))
                    .map_err(|e| Error::io("rename", &path, e))?;
                restored = true;
                done += 1;
            }
        }
    }
    if restored {
        fs.sync_dir(parent)
            .map_err(|e| Error::io("fsync directory", parent, e))?;
    }
    Ok(done)
}

/// The name `name` is a leftover of: `<orig>` in `.<orig><mark><id>`.
fn leftover_of<'a>(name: &'a str, mark: &str) -> Option<&'a str> {
    let rest = name.strip_prefix('.')?;
    let at = rest.rfind(mark)?;
    let (orig, id) = (&rest[..at], &rest[at + mark.len()..]);
    let hex = id.len() == 16 && id.bytes().all(|c| c.is_ascii_hexdigit());
    (hex && !orig.is_empty()).then_some(orig)
}

/// An entry in the way of a rename of a directory (`ENOTEMPTY`, `EEXIST`, `ENOTDIR`,
/// `EISDIR`): the case an exchange handles.
fn occupied(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::DirectoryNotEmpty
            | ErrorKind::AlreadyExists
            | ErrorKind::NotADirectory
            | ErrorKind::IsADirectory
    )
}

fn parent(path: &Path) -> Result<&Path> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => Ok(p),
        Some(_) => Ok(Path::new(".")),
        None => Err(Error::io(
            "publish",
            path,
            io::Error::new(ErrorKind::InvalidInput, "a root directory has no parent"),
        )),
    }
}

/// The parent directories a publish changes: one, or two when they differ.
fn parents(staging: &Path, target: &Path) -> Result<Vec<PathBuf>> {
    let (a, b) = (parent(target)?, parent(staging)?);
    let mut out = vec![a.to_path_buf()];
    if a != b {
        out.push(b.to_path_buf());
    }
    Ok(out)
}

fn sync_all<F: Fs>(fs: &F, dirs: &[PathBuf]) -> Result<()> {
    dirs.iter().try_for_each(|d| {
        fs.sync_dir(d)
            .map_err(|e| Error::io("fsync directory", d, e))
    })
}

/// `.<name><mark><16 random hex>` beside `target`.
fn sibling(target: &Path, mark: &str) -> Result<PathBuf> {
    let name = target.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::io(
            "publish",
            target,
            io::Error::new(ErrorKind::InvalidInput, "the path has no UTF-8 file name"),
        )
    })?;
    let id = crate::format::names::random_id()?;
    Ok(parent(target)?.join(format!(".{name}{mark}{}", &id[..16])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftover_names_round_trip() {
        assert_eq!(
            leftover_of(".step-00000004.ckpt-old-0123456789abcdef", OLD_MARK),
            Some("step-00000004")
        );
        assert_eq!(
            leftover_of(".a.ckpt-old-x.ckpt-trash-0123456789abcdef", TRASH_MARK),
            Some("a.ckpt-old-x")
        );
        for not in [
            "step-4",
            ".ckpt-old-0123456789abcdef",
            ".a.ckpt-old-0123",
            ".a.ckpt-old-0123456789abcdeg",
            "a.ckpt-old-0123456789abcdef",
        ] {
            assert_eq!(leftover_of(not, OLD_MARK), None, "{not}");
        }
    }
}
