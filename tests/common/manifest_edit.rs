//! Rewriting a checkpoint's manifest in tests: hostile but self-consistent manifests.

use std::path::Path;

/// Rewrite the manifest through `edit`, recomputing its CRC trailer (a consistent but
/// hostile manifest).
pub fn rewrite_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("ckpt-manifest.json");
    let bytes = std::fs::read(&p).unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    v.as_object_mut().unwrap().remove("manifest_crc32");
    edit(&mut v);
    // Encoded from the JSON value itself (so edits the Manifest type would refuse survive),
    // with the trailer of format-spec/manifest.md §Trailer.
    let mut body = serde_json::to_vec(&v).unwrap();
    body.pop();
    std::fs::write(&p, ckptstore::format::manifest::append_trailer(body)).unwrap();
}
