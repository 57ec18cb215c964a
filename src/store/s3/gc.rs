//! Garbage collection under a prefix: every engine object no committed manifest names.

use super::Remote;
use crate::error::{Error, Result};
use crate::format::names::is_engine_file;

/// Delete, under `url`, every engine object no committed manifest names (shards of
/// interrupted or superseded saves, temporary objects); never the manifest or objects the
/// engine did not write. Returns the names deleted.
///
/// # Errors
/// [`Error::Remote`].
pub fn gc_prefix(r: &Remote) -> Result<Vec<String>> {
    let keep: Vec<String> = match r.manifest() {
        Ok((_, m)) => m.shards.iter().map(|s| s.file.clone()).collect(),
        Err(Error::NotFound { .. }) => Vec::new(),
        Err(e) => return Err(e),
    };
    let mut deleted = Vec::new();
    for (name, _) in r.list()?.objects {
        if is_engine_file(&name) && !keep.contains(&name) {
            r.delete(&name)?;
            deleted.push(name);
        }
    }
    Ok(deleted)
}
