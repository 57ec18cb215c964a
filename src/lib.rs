#![doc = include_str!("../README.md")]
#![doc = "
## Modules, lowest floor first

Dependencies run one way: each module uses only those listed before it.

1. The base: [`error`], [`location`] (paths and URLs), [`dtype`], [`view`], [`tensor`] (owned tensors and the buffer pool).
2. [`format`](mod@format): bytes on disk (shard header, manifest, optimizer-section and global-tensor rules).
3. `sys` (private: the only `unsafe` code; public face [`mmap`]) and [`convert`] (kernels);
   the storage seam under the writer: [`store::Store`] and [`store::Put`], the local directory
   [`store::LocalStore`] over [`store::fs`] (its S3 implementation, `store::s3::Remote`,
   lives with the locations of floor 7).
4. [`write`](mod@write) and [`checkpoint`]: whole checkpoints, written (single- and multi-rank) and read.
5. [`optim`]: optimizer state on top of checkpoints.
6. [`manager`]: steps of a training run.
7. [`store`]: where checkpoints live: local paths or object-store URLs (`s3://`, feature `s3`).
"]
#![warn(missing_docs)]

// Modules, lowest floor first: each one uses only those above it. (Blank-line groups keep
// rustfmt from sorting the floors alphabetically.)

// The base every floor uses.
pub mod error;

pub mod location;

pub mod dtype;

pub mod view;

pub mod tensor;

mod crc;

// Bytes on disk.
pub mod format;

// The only unsafe code (memory maps, SIMD kernels, I/O hints), and the kernels over it.
mod sys;

pub mod convert;

// Whole checkpoints: writing and reading.
pub mod write;

pub mod checkpoint;

// Optimizer state on top of checkpoints, then steps of a training run.
pub mod optim;

pub mod manager;

// Locations: local paths and object-store URLs.
pub mod store;

pub use checkpoint::{
    Checkpoint, Fetch, Kind, Region, Shard, ShardSource, TensorInfo, VerifyReport,
};
pub use crc::crc32_parallel;
pub use dtype::DType;
pub use error::{Error, Result};
pub use location::{IntoLocation, Location};
pub use store::{open, save, save_with_section};
pub use sys::mmap;
pub use sys::mmap::Map;
pub use tensor::{BufferPool, PoolStats, Tensor};
pub use view::{Element, TensorView};
pub use write::parts::{CommitOptions, Part, PartChunk, PartItem};
pub use write::{wait_for_cleanup, Cleanup, CommitInfo, SaveOptions, TensorRef};
