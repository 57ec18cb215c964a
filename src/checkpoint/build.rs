//! Building a [`Checkpoint`] from its bytes, and the checks that make open cheap and safe:
//! the manifest decoded and validated, every shard's header parsed and compared with it
//! (native checkpoints), or the tensors of plain safetensors files and Hugging Face sharded
//! directories catalogued (foreign ones).

use std::collections::HashMap;
use std::path::PathBuf;

use super::*;

/// For each tensor of `m`: the global tensor it stores a chunk or replica of (its index in
/// `m.globals`), or [`NOT_A_CHUNK`]. Empty without globals. Every chunk and replica names a
/// manifest tensor (rule G2, checked with the manifest); a name not found is left a whole
/// tensor here and reported by the region reads that need it.
pub(crate) fn chunk_owners(m: &Manifest, by_name: &NameIndex) -> Vec<u32> {
    if m.globals.is_empty() {
        return Vec::new();
    }
    let mut of = vec![NOT_A_CHUNK; m.tensors.len()];
    for (g, entry) in m.globals.iter().enumerate() {
        // At most MAX_TENSORS (< 2^32) globals: each has a chunk.
        let g = u32::try_from(g).unwrap_or(NOT_A_CHUNK);
        for c in &entry.chunks {
            for name in std::iter::once(&c.tensor).chain(&c.replicas) {
                if let Some(i) = by_name.position(&m.tensors, name) {
                    of[i] = g;
                }
            }
        }
    }
    of
}

impl<S: ShardSource> Checkpoint<S> {
    /// Build a native checkpoint from manifest bytes and the shard files' bytes, given in
    /// the manifest's shard order. Performs every check [`Checkpoint::open`] does.
    ///
    /// # Errors
    /// As [`Checkpoint::open`]; [`Error::InvalidArgument`] if the number of shards differs
    /// from the manifest's, or for a two-level manifest (feature `parts`), whose part
    /// indexes and their shards are files this call is not given
    /// ([`Checkpoint::from_files`] takes them).
    pub fn from_parts(manifest_bytes: &[u8], shards: Vec<S>) -> Result<Self> {
        let ck = Self::from_manifest_bytes(manifest_bytes, shards)?;
        if ck.manifest().is_some_and(|m| !m.parts.is_empty()) {
            return Err(Error::InvalidArgument(
                "a two-level manifest (feature \"parts\") names part indexes that in-memory shard buffers cannot supply: open its directory or URL".into(),
            ));
        }
        Ok(ck)
    }

    /// [`Checkpoint::from_parts`] for any manifest; the caller attaches a two-level
    /// manifest's part indexes (`parts`).
    pub(crate) fn from_manifest_bytes(manifest_bytes: &[u8], shards: Vec<S>) -> Result<Self> {
        let (m, by_name) = decode_manifest(manifest_bytes, MANIFEST_FILE)?;
        if shards.len() != m.shards.len() {
            return Err(Error::InvalidArgument(format!(
                "{} shard buffers given for a manifest of {} shards",
                shards.len(),
                m.shards.len()
            )));
        }
        let shards = m
            .shards
            .iter()
            .zip(shards)
            .map(|(s, bytes)| Shard {
                file: s.file.clone(),
                bytes,
            })
            .collect();
        Self::build_native(PathBuf::new(), m, by_name, shards)
    }

    /// `by_name` indexes `m.tensors` (built by validation, which refuses a repeated name).
    pub(super) fn build_native(
        root: PathBuf,
        m: Manifest,
        by_name: NameIndex,
        shards: Vec<Shard<S>>,
    ) -> Result<Self> {
        // Cheap per-shard checks (format-spec/integrity.md §Open): exact size, the header
        // length prefix, and the CRC of the header bytes. A header whose CRC matches is the
        // one written together with this manifest, so it need not be parsed again here;
        // `verify` parses and cross-checks every header.
        m.shards
            .par_iter()
            .zip(shards.par_iter())
            .enumerate()
            .map(|(i, (entry, shard))| {
                let (len, bytes) = (shard.bytes.len(), shard.bytes.head());
                let mismatch = |reason: String| Error::ShardMismatch {
                    shard: i,
                    file: entry.file.clone(),
                    reason,
                };
                if len != entry.size {
                    return Err(mismatch(format!(
                        "the file is {len} bytes but the manifest records {} (truncated or replaced)",
                        entry.size
                    )));
                }
                // size >= 8 + header_size was validated with the manifest.
                let prefix = bytes.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok());
                if prefix.map(u64::from_le_bytes) != Some(entry.header_size) {
                    return Err(mismatch(format!(
                        "the header length prefix differs from the manifest's {}",
                        entry.header_size
                    )));
                }
                let hjson = bytes.get(8..8 + entry.header_size as usize).unwrap_or(&[]);
                let got = crc32fast::hash(hjson);
                if got != entry.header_crc32 {
                    return Err(Error::ChecksumMismatch {
                        what: "shard header".into(),
                        shard: i,
                        file: entry.file.clone(),
                        expected: entry.header_crc32,
                        got,
                    });
                }
                Ok(())
            })
            .collect::<Vec<_>>()
            // The first failure in shard order, whichever thread found it first.
            .into_iter()
            .collect::<Result<()>>()?;

        let mut counts = vec![0usize; shards.len()];
        for t in &m.tensors {
            counts[t.shard] += 1; // shard indexes were validated with the manifest
        }
        if let Some(i) = counts.iter().position(|&c| c == 0) {
            return Err(Error::ShardMismatch {
                shard: i,
                file: m.shards[i].file.clone(),
                reason: "the manifest places no tensor in this shard".into(),
            });
        }
        Ok(Checkpoint {
            root,
            kind: Kind::Native,
            shards,
            foreign: Vec::new(),
            by_name,
            metadata: m.metadata.clone(),
            chunk_of: std::sync::OnceLock::new(),
            globals: m
                .globals
                .iter()
                .enumerate()
                .map(|(i, g)| (g.name.clone(), i))
                .collect(),
            manifest: Some(m),
            data_verified: false,
            parts: None,
        })
    }

    /// Parse every shard header and check that it describes exactly the tensors the
    /// manifest places in that shard, with the same dtype, shape and offsets, and carries
    /// this checkpoint's id (format-spec/integrity.md §Verify).
    pub(super) fn check_headers(&self) -> Result<()> {
        let Some(m) = &self.manifest else {
            return Ok(());
        };
        let found: Vec<Result<()>> = self.shards.par_iter().enumerate().map(|(i, shard)| {
            let file = &shard.file;
            let mismatch = |reason: String| Error::ShardMismatch { shard: i, file: file.clone(), reason };
            let h = header::parse_head(shard.bytes.head(), shard.bytes.len())
                .map_err(|r| Error::header(file, r))?;
            match h.metadata.get(META_CHECKPOINT_ID) {
                Some(id) if *id == m.checkpoint_id => {}
                other => {
                    return Err(mismatch(format!(
                        "the shard belongs to checkpoint {other:?}, not {:?} (a shard from another checkpoint?)",
                        m.checkpoint_id
                    )))
                }
            }
            let mine: HashMap<&str, &TensorInfo> =
                self.tensors().iter().filter(|t| t.shard == i).map(|t| (t.name.as_str(), t)).collect();
            if mine.len() != h.tensors.len() {
                return Err(mismatch(format!(
                    "the shard header lists {} tensors but the manifest places {} here",
                    h.tensors.len(),
                    mine.len()
                )));
            }
            let ds = h.data_start();
            for he in &h.tensors {
                let t = mine.get(he.name.as_str()).ok_or_else(|| {
                    mismatch(format!("the header lists tensor {:?}, which the manifest does not place here", he.name))
                })?;
                let abs = [he.data_offsets[0] + ds, he.data_offsets[1] + ds];
                if he.dtype != t.dtype || he.shape != t.shape || abs != t.offsets {
                    return Err(mismatch(format!(
                        "tensor {:?}: header says {} {:?} at {:?}, manifest says {} {:?} at {:?}",
                        t.name, he.dtype, he.shape, abs, t.dtype, t.shape, t.offsets
                    )));
                }
            }
            Ok(())
        }).collect();
        // The first failure in shard order.
        found.into_iter().collect()
    }

    /// Open one safetensors file held in `bytes` (read-only, no checksums).
    ///
    /// # Errors
    /// [`Error::InvalidHeader`] if the header is malformed.
    pub fn from_safetensors(path: PathBuf, bytes: S) -> Result<Self> {
        let file = path.display().to_string();
        let mut ck = Self::from_foreign(path, Kind::Safetensors, vec![Shard { file, bytes }])?;
        ck.root = ck.root.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(ck)
    }

    pub(super) fn from_foreign(root: PathBuf, kind: Kind, shards: Vec<Shard<S>>) -> Result<Self> {
        let headers = shards
            .par_iter()
            .map(|s| {
                header::parse_head(s.bytes.head(), s.bytes.len())
                    .map_err(|r| Error::header(&s.file, r))
            })
            .collect::<Vec<_>>()
            // The first failure in shard order (rayon's own would be the first in time).
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        let mut tensors = Vec::new();
        let mut metadata = serde_json::Map::new();
        for (i, h) in headers.into_iter().enumerate() {
            let ds = h.data_start();
            for (k, v) in h.metadata {
                metadata.insert(k, serde_json::Value::String(v));
            }
            for e in h.tensors {
                tensors.push(TensorInfo {
                    name: e.name,
                    dtype: e.dtype,
                    shape: e.shape,
                    shard: i,
                    offsets: [e.data_offsets[0] + ds, e.data_offsets[1] + ds],
                    crc32: None,
                    absmax: None,
                    blocks: None,
                });
            }
        }
        let by_name = NameIndex::build(&tensors).map_err(|i| {
            let t = &tensors[i];
            Error::header(
                &shards[t.shard].file,
                format!("tensor {:?} is also held by another shard file", t.name),
            )
        })?;
        Ok(Checkpoint {
            root,
            kind,
            shards,
            foreign: tensors,
            by_name,
            metadata: metadata.into(),
            manifest: None,
            globals: HashMap::new(),
            chunk_of: std::sync::OnceLock::new(),
            data_verified: false,
            parts: None,
        })
    }
}
