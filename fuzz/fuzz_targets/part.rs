//! Part descriptor decoder (format-spec/global.md §Parts): `Part::from_bytes` must never
//! panic, and whatever it accepts must survive `to_bytes`: from_bytes(to_bytes(p)) == p.
//!
//! Each input is tried as given and with a correct CRC trailer, so that mutations of the
//! JSON body reach the parser and the consistency checks.
#![no_main]

use ckptstore::write::parts::Part;
use ckptstore_fuzz::with_valid_trailer;
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8]) {
    let Ok(p) = Part::from_bytes(bytes) else {
        return;
    };
    let encoded = p.to_bytes();
    let p2 = match Part::from_bytes(&encoded) {
        Ok(p2) => p2,
        Err(e) => panic!(
            "re-encoded part does not decode: {e:?}\n{}",
            String::from_utf8_lossy(&encoded)
        ),
    };
    // The decoded fields, not the recorded size and CRC of the bytes each was decoded from
    // (an input with an unknown key re-encodes shorter).
    let fields = |p: &Part| {
        (
            p.checkpoint_id.clone(),
            p.rank,
            p.shards.clone(),
            p.tensors.clone(),
            p.chunks.clone(),
        )
    };
    assert_eq!(fields(&p2), fields(&p), "part changed through to_bytes/from_bytes");
    assert_eq!(p2.to_bytes(), encoded, "to_bytes is not deterministic");
}

fuzz_target!(|data: &[u8]| {
    check(data);
    check(&with_valid_trailer(data));
});
