//! The two-level read path (feature `parts`, format-spec/global.md §The two-level
//! manifest) over hostile bytes: a root manifest, up to three part indexes and up to four
//! shards, opened with `Checkpoint::from_files` (parts load lazily, on first use) and read
//! every way a reader can: `verify`, `entries`, per global tensor `chunks`,
//! `stored_chunks`, `read_global`, `read_region` and `region_file_ranges` of a few boxes;
//! per whole tensor `tensor`, `read_tensor`, `tensor_verified`; `parts_read`. Nothing may
//! panic or hang; the cross-checks (a region equals the box of `read_global`, the halves
//! concatenate to the whole, `verify` passing means every read passes and every part was
//! read, ...) are in `ckptstore_fuzz::check_two_level`, which tests/hostile.rs replays.
//!
//! Input: see `ckptstore_fuzz::unframe_two_level` (a layout byte, a repair byte, the root,
//! the part slots, the shard slots). The files are named as the manifests name them (or,
//! by a layout bit, from a fixed table of the seeds' names), so mutations reach the parsers
//! rather than missing files; the repair bits recompute the root's and the parts' CRC
//! trailers, the shard entries and tensor CRCs, and the root's part sizes and CRCs, so
//! mutations get past the checksums into the grid and part validation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ckptstore_fuzz::check_two_level(data));
