//! Manifest decoder: `manifest::decode` must never panic, and whatever it accepts must
//! survive `manifest::encode` (the writer's encoder): decode(encode(m)) == m.
//!
//! Each input is tried twice: as given (exercising the trailer and CRC checks), and with
//! its trailer replaced by a correct one, so mutations of the JSON body reach the parser
//! and the validation instead of stopping at the checksum.
#![no_main]

use ckptstore::format::manifest;
use ckptstore_fuzz::with_valid_trailer;
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8]) {
    let Ok(m) = manifest::decode(bytes) else {
        return;
    };
    let encoded = manifest::encode(&m);
    let m2 = match manifest::decode(&encoded) {
        Ok(m2) => m2,
        Err(e) => panic!(
            "re-encoded manifest does not decode: {e:?}\n{}",
            String::from_utf8_lossy(&encoded)
        ),
    };
    assert_eq!(m2, m, "manifest changed through encode/decode");
    assert_eq!(
        manifest::encode(&m2),
        encoded,
        "encode is not deterministic"
    );
}

fuzz_target!(|data: &[u8]| {
    check(data);
    check(&with_valid_trailer(data));
});
