//! The one reader over fetched shards (issue 23): the same checkpoint read through
//! resident bytes (`Checkpoint<Vec<u8>>`) and through a source that only serves ranged
//! fetches (`ckptstore_fuzz::Fetched`, what the lazy object-store reader is) must give the
//! same answers for any manifest and shard bytes: both open or both refuse (with the same
//! message); `read_tensor` of every tensor, `read_global` of every global, a region of
//! each, `stream_tensors` and `verify` return the same bytes or the same error. Nothing
//! may panic.
//!
//! Input: as `open_verify_load` (`ckptstore_fuzz::unframe`); the flags' high bits pick
//! the fetched source's write-chunk size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ckptstore_fuzz::check_fetched_like_resident(data));
