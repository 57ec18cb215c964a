//! Upload journal decoder (format-spec/s3.md §Uploads): `UploadJournal::decode` never
//! panics, and whatever it accepts names an engine object directly under the prefix it was
//! found in (so `gc` never aborts an upload of another key of the bucket) and survives
//! `encode`.
#![no_main]

use ckptstore::format::journal::UploadJournal;
use ckptstore::format::names::is_engine_file;
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8], prefix: &str) {
    let Some(j) = UploadJournal::decode(bytes, prefix) else {
        return;
    };
    let name = if prefix.is_empty() {
        j.key.as_str()
    } else {
        let rest = j.key.strip_prefix(prefix).expect("key outside its prefix");
        rest.strip_prefix('/').expect("key outside its prefix")
    };
    assert!(!name.contains('/') && is_engine_file(name), "{:?}", j.key);
    assert!(!j.upload_id.is_empty());
    assert_eq!(UploadJournal::decode(&j.encode(), prefix), Some(j));
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the prefix the journal was found under.
    let (prefixes, body) = match data.split_first() {
        Some((&b, rest)) => (["", "run", "run/a"][usize::from(b) % 3], rest),
        None => ("", data),
    };
    check(body, prefixes);
});
