//! The upload journal object of an object-store checkpoint (format-spec/s3.md §Uploads):
//! `PREFIX/.ckpt-tmp-upload-<32 hex>`, JSON `{"key": KEY, "upload_id": ID}`, written before
//! the first part of a multipart upload so that an interrupted save's upload can be aborted
//! later. A journal is read back only to abort the upload it names, so [`UploadJournal::decode`]
//! takes it as hostile: it names an upload only of an object the engine writes directly
//! under the prefix it was found in, never another key of the bucket.

use serde::{Deserialize, Serialize};

use super::names::{engine_file_id, TEMP_PREFIX};

/// The name prefix of upload journal objects (a temporary-object name: every engine
/// cleanup deletes it, aborting its upload first).
pub const JOURNAL_PREFIX: &str = ".ckpt-tmp-upload-";

/// The largest journal read back (a real one is about 200 bytes).
pub const MAX_JOURNAL_SIZE: u64 = 64 << 10;

/// The longest upload id accepted (S3's are about 100 characters).
const MAX_UPLOAD_ID: usize = 1024;

/// The body of an upload journal: the key of the object being uploaded and the upload's id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadJournal {
    /// The object key (`PREFIX/shard-<id>-<i>.safetensors`).
    pub key: String,
    /// The multipart upload's id.
    pub upload_id: String,
}

/// True for the name of an upload journal object.
pub fn is_journal_name(name: &str) -> bool {
    name.starts_with(JOURNAL_PREFIX)
}

impl UploadJournal {
    /// The journal's bytes.
    pub fn encode(&self) -> Vec<u8> {
        // A struct of two strings always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The journal in `bytes`, found directly under the key prefix `prefix` (empty for a
    /// bucket's root): `None` unless it is that JSON object, at most [`MAX_JOURNAL_SIZE`]
    /// bytes, its key names an object the engine writes (a shard or part descriptor, not a
    /// temporary object) directly under `prefix`, and its upload id is 1 to 1024 printable
    /// ASCII characters. Never panics.
    pub fn decode(bytes: &[u8], prefix: &str) -> Option<UploadJournal> {
        if bytes.len() as u64 > MAX_JOURNAL_SIZE {
            return None;
        }
        let j: UploadJournal = serde_json::from_slice(bytes).ok()?;
        let name = if prefix.is_empty() {
            j.key.as_str()
        } else {
            j.key.strip_prefix(prefix)?.strip_prefix('/')?
        };
        let engine_object =
            !name.starts_with(TEMP_PREFIX) && !name.contains('/') && engine_file_id(name).is_some();
        let id_ok = (1..=MAX_UPLOAD_ID).contains(&j.upload_id.len())
            && j.upload_id.bytes().all(|b| b.is_ascii_graphic());
        (engine_object && id_ok).then_some(j)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHARD: &str = "shard-0123456789abcdef0123456789abcdef-00000.safetensors";

    fn j(key: &str, id: &str) -> Vec<u8> {
        UploadJournal {
            key: key.into(),
            upload_id: id.into(),
        }
        .encode()
    }

    #[test]
    fn a_journal_names_only_engine_objects_under_its_own_prefix() {
        let ok = j(&format!("run/a/{SHARD}"), "2~abc.DEF_123");
        assert_eq!(
            UploadJournal::decode(&ok, "run/a").map(|j| j.upload_id),
            Some("2~abc.DEF_123".into())
        );
        assert!(UploadJournal::decode(&j(SHARD, "x"), "").is_some());
        for (key, id, prefix) in [
            (format!("run/b/{SHARD}"), "x", "run/a"),   // another prefix
            (format!("run/ab/{SHARD}"), "x", "run/a"),  // a sibling sharing its text
            (format!("run/a/x/{SHARD}"), "x", "run/a"), // deeper
            ("run/a/notes.txt".into(), "x", "run/a"),   // not the engine's
            (format!("run/a/{TEMP_PREFIX}{SHARD}"), "x", "run/a"),
            ("run/a/ckpt-manifest.json".into(), "x", "run/a"),
            (format!("run/a/{SHARD}"), "", "run/a"),
            (format!("run/a/{SHARD}"), "a b", "run/a"),
            (format!("run/a/{SHARD}"), &"7".repeat(1025), "run/a"),
        ] {
            assert!(
                UploadJournal::decode(&j(&key, id), prefix).is_none(),
                "{key} {id:?}"
            );
        }
        let extra = br#"{"key":"k","upload_id":"u","more":1}"#;
        assert!(UploadJournal::decode(extra, "").is_none());
        assert!(UploadJournal::decode(&vec![b' '; 70_000], "").is_none());
    }
}
