//! Opening a checkpoint from a local path: a ckptstore directory (its manifest, then every
//! shard checked and mapped), a Hugging Face sharded directory, a directory holding
//! `model.safetensors`, or a single `.safetensors` file; and the capped read of small files
//! (manifests, indexes) that every open uses.

use std::fs::File;
use std::path::Path;

use rayon::prelude::*;

use super::{decode_manifest, Checkpoint, Kind, Shard, ShardSource, HF_INDEX_FILE, SHARD_MISSING};
use crate::error::{Error, Result};
use crate::format::manifest::{check_file_name, MANIFEST_FILE};
use crate::mmap::Map;

pub(crate) fn open_map(path: &Path) -> Result<Map> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    Map::open(&file, path)
}

impl Checkpoint<Map> {
    /// Open a checkpoint: a ckptstore directory (holding `ckpt-manifest.json`), a Hugging
    /// Face sharded directory (holding `model.safetensors.index.json`), a directory holding
    /// `model.safetensors`, or a single `.safetensors` file.
    ///
    /// Reads and validates the manifest (its CRC trailer, every field, every byte range
    /// against the recorded file sizes), checks each shard file's size, header length and
    /// header CRC32 against the manifest, and maps every shard read-only. For foreign
    /// stores it parses and validates every safetensors header. Reads no tensor data: the
    /// cost is proportional to the number of tensors, not to their size. [`Checkpoint::verify`]
    /// does the deep checks: every header parsed and cross-checked, every tensor's CRC.
    ///
    /// # Errors
    /// [`Error::NotFound`] when there is no checkpoint at `path`; [`Error::InvalidManifest`],
    /// [`Error::InvalidHeader`], [`Error::ShardMismatch`], [`Error::ChecksumMismatch`],
    /// [`Error::UnsupportedVersion`], [`Error::UnsupportedFeature`] for damaged or foreign
    /// stores; [`Error::Io`] for I/O failures. Each names the file involved.
    ///
    /// # Example
    /// ```
    /// # fn main() -> ckptstore::Result<()> {
    /// use ckptstore::{save, Checkpoint, DType, SaveOptions, TensorRef};
    /// let dir = tempfile::tempdir().unwrap();
    /// let w: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
    /// save(dir.path(), &[TensorRef::from_slice("w", &[2, 2], &w)], &SaveOptions::default())?;
    /// let ckpt = Checkpoint::open(dir.path())?;
    /// assert_eq!(ckpt.read("w").view()?.as_slice::<f32>()?, &w[..]);
    /// ckpt.verify()?;
    /// # Ok(()) }
    /// ```
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = &crate::location::local_path(path.as_ref(), "Checkpoint::open")?;
        let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound {
                path: path.to_path_buf(),
                reason: "the path does not exist".into(),
            },
            _ => Error::io("stat", path, e),
        })?;
        if meta.is_file() {
            let bytes = open_map(path)?;
            return Checkpoint::from_safetensors(path.to_path_buf(), bytes);
        }
        let manifest_path = path.join(MANIFEST_FILE);
        if manifest_path.exists() {
            // A save that commits while we open may remove the shards of the manifest we
            // read (format-spec/durability.md §Readers): if a shard is missing, read the
            // manifest again and retry, a bounded number of times.
            return open_native_retrying(path, &manifest_path, |f, p, _| Map::open(&f, p));
        }
        let index = path.join(HF_INDEX_FILE);
        if index.exists() {
            return Self::open_hf(path, &index);
        }
        let single = path.join("model.safetensors");
        if single.is_file() {
            let bytes = open_map(&single)?;
            return Checkpoint::from_safetensors(single, bytes);
        }
        Err(Error::NotFound {
            path: path.to_path_buf(),
            reason: format!(
                "no {MANIFEST_FILE} (ckptstore), {HF_INDEX_FILE} (Hugging Face) or model.safetensors in the directory"
            ),
        })
    }

    fn open_hf(root: &Path, index_path: &Path) -> Result<Self> {
        let fname = HF_INDEX_FILE;
        let bytes = read_capped(index_path, crate::format::MAX_MANIFEST_SIZE)?;
        #[derive(serde::Deserialize)]
        struct Index {
            #[serde(default)]
            metadata: serde_json::Value,
            weight_map: std::collections::BTreeMap<String, String>,
        }
        let idx: Index = serde_json::from_slice(&bytes)
            .map_err(|e| Error::manifest(fname, format!("JSON: {e}")))?;
        let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
        files.sort();
        files.dedup();
        for f in &files {
            check_file_name(f).map_err(|e| Error::manifest(fname, e))?;
        }
        let shards = files
            .par_iter()
            .map(|f| {
                Ok(Shard {
                    file: f.clone(),
                    bytes: open_map(&root.join(f))?,
                })
            })
            .collect::<Vec<_>>()
            // The first failure in shard order (rayon's own would be the first in time).
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        let mut ck = Checkpoint::from_foreign(root.to_path_buf(), Kind::HfSharded, shards)?;
        // The index must name exactly the tensors the files hold, each in its file.
        if idx.weight_map.len() != ck.foreign.len() {
            return Err(Error::manifest(
                fname,
                format!(
                    "weight_map names {} tensors but the shard files hold {}",
                    idx.weight_map.len(),
                    ck.foreign.len()
                ),
            ));
        }
        for (name, file) in &idx.weight_map {
            let t = ck.info(name).map_err(|_| {
                Error::manifest(
                    fname,
                    format!("weight_map names tensor {name:?} in {file:?}, which does not hold it"),
                )
            })?;
            if ck.shards[t.shard].file != *file {
                return Err(Error::manifest(
                    fname,
                    format!(
                        "weight_map puts tensor {name:?} in {file:?} but it is in {:?}",
                        ck.shards[t.shard].file
                    ),
                ));
            }
        }
        if idx.metadata.is_object() {
            ck.metadata = idx.metadata;
        }
        Ok(ck)
    }
}

/// Open the ckptstore directory `root` (its manifest at `manifest_path`) with `open_shard`
/// making each shard's source from its opened file (path, and the header size the manifest
/// records). A save that commits while we open may remove the shards of the manifest we
/// read (format-spec/durability.md §Readers): if a shard is missing, read the manifest
/// again and retry, a bounded number of times.
pub(crate) fn open_native_retrying<S: ShardSource + Send + 'static>(
    root: &Path,
    manifest_path: &Path,
    open_shard: OpenShard<S>,
) -> Result<Checkpoint<S>> {
    let mut attempts = 0;
    loop {
        match open_native(root, manifest_path, open_shard) {
            Err(Error::ShardMismatch { ref reason, .. })
                if reason == SHARD_MISSING && attempts < 3 =>
            {
                attempts += 1;
            }
            r => return r,
        }
    }
}

/// Makes a shard's source from its opened file (path, and the header size the manifest
/// records).
pub(crate) type OpenShard<S> = fn(File, &Path, u64) -> Result<S>;

fn open_native<S: ShardSource + Send + 'static>(
    root: &Path,
    manifest_path: &Path,
    open_shard: OpenShard<S>,
) -> Result<Checkpoint<S>> {
    let bytes = read_capped(manifest_path, crate::format::MAX_MANIFEST_SIZE)?;
    let (m, by_name) = decode_manifest(&bytes, MANIFEST_FILE)?;
    let shards = open_shard_files(root, &m.shards, open_shard)?;
    let parts = (!m.parts.is_empty())
        .then(|| super::parts::PartSet::new(super::parts::local(root, open_shard), &m));
    let mut ck = Checkpoint::build_native(root.to_path_buf(), m, by_name, shards)?;
    ck.parts = parts;
    Ok(ck)
}

/// Open the shard files `shards` lists in `root`, checking each is a regular file (a
/// missing one is `ShardMismatch` with [`SHARD_MISSING`]).
pub(crate) fn open_shard_files<S: ShardSource + Send>(
    root: &Path,
    shards: &[crate::format::manifest::ShardEntry],
    open_shard: OpenShard<S>,
) -> Result<Vec<Shard<S>>> {
    shards
        .par_iter()
        .enumerate()
        .map(|(i, s)| {
            let p = root.join(&s.file);
            let missing = |e: std::io::Error, op| match e.kind() {
                std::io::ErrorKind::NotFound => Error::ShardMismatch {
                    shard: i,
                    file: s.file.clone(),
                    reason: SHARD_MISSING.into(),
                },
                _ => Error::io(op, &p, e),
            };
            let lmeta = std::fs::symlink_metadata(&p).map_err(|e| missing(e, "stat"))?;
            if !lmeta.file_type().is_file() {
                return Err(Error::ShardMismatch {
                    shard: i,
                    file: s.file.clone(),
                    reason:
                        "not a regular file (ckptstore never writes links or directories as shards)"
                            .into(),
                });
            }
            let file = File::open(&p).map_err(|e| missing(e, "open"))?;
            Ok(Shard {
                file: s.file.clone(),
                bytes: open_shard(file, &p, s.header_size)?,
            })
        })
        .collect::<Vec<_>>()
        // The first failure in shard order (rayon's own would be the first in time).
        .into_iter()
        .collect::<Result<Vec<_>>>()
}

pub(crate) fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let too_big = || {
        Error::manifest(
            path.display().to_string(),
            format!("larger than the {cap}-byte cap"),
        )
    };
    // Refuse by size before reading anything; `take` still bounds a file that grows.
    let len = f.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    if len > cap {
        return Err(too_big());
    }
    let mut v = Vec::with_capacity(len as usize);
    f.take(cap + 1)
        .read_to_end(&mut v)
        .map_err(|e| Error::io("read", path, e))?;
    if v.len() as u64 > cap {
        return Err(too_big());
    }
    Ok(v)
}
