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
    let committed = match r.manifest() {
        Ok((_, m)) => Some(m),
        Err(Error::NotFound { .. }) => None,
        Err(e) => return Err(e),
    };
    let mut deleted = Vec::new();
    for (name, _) in r.list()?.objects {
        if is_engine_file(&name) && !committed.as_ref().is_some_and(|m| m.keeps(&name)) {
            r.delete(&name)?;
            deleted.push(name);
        }
    }
    Ok(deleted)
}
