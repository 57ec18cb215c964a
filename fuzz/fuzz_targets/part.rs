//! Part descriptor decoder (format-spec/global.md §Parts): `Part::from_bytes` must never
//! panic, and whatever it accepts must survive `to_bytes` (the check is
//! `ckptstore_fuzz::check_part`, which tests/hostile.rs replays on the saved regressions).
//!
//! Each input is tried as given and with a correct CRC trailer, so that mutations of the
//! JSON body reach the parser and the consistency checks.
#![no_main]

use ckptstore_fuzz::{check_part, with_valid_trailer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    check_part(data);
    check_part(&with_valid_trailer(data));
});
