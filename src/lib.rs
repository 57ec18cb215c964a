#![doc = include_str!("../README.md")]
#![doc = "
## Modules, lowest floor first

Dependencies run one way: each module uses only those listed before it (tests/layers.rs
checks the `use crate::` paths of every file against this order).

1. The base: [`error`], [`location`] (paths and URLs), [`dtype`], [`view`], [`tensor`]
   (owned tensors and the buffer pool), CRCs; `sys` (private: the only `unsafe` code; public
   face [`mmap`]) and [`convert`] (kernels).
2. [`format`](mod@format): bytes on disk (shard header, manifest, part descriptor, file names,
   optimizer-section and global-tensor rules, upload journals).
3. [`store`]: where the bytes live, behind one object-shaped trait ([`store::Store`],
   [`store::Put`]): the local directory [`store::LocalStore`] over the [`store::fs`] fault
   seam, and S3 (`store::s3`, feature `s3`). It moves bytes and knows no reader or writer.
4. [`write`](mod@write) and [`checkpoint`]: whole checkpoints, written (single- and
   multi-rank) and read, over any store; neither imports the other.
5. [`optim`]: optimizer state on top of checkpoints.
6. [`manager`] (steps of a training run) and [`api`] (the verbs over a location: a path or
   an `s3://` URL, re-exported here as [`open`], [`save`], [`write_part`], [`commit`], ...).
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

// The only unsafe code (memory maps, SIMD kernels, I/O hints), and the kernels over it.
mod sys;

pub mod convert;

// Bytes on disk.
pub mod format;

// Where bytes live: local directories and object stores.
pub mod store;

// Whole checkpoints: writing and reading.
pub mod write;

pub mod checkpoint;

// Optimizer state on top of checkpoints, then steps of a training run and the verbs over
// locations.
pub mod optim;

pub mod manager;

pub mod api;

pub use api::{
    commit, commit_rendezvous, discard, open, put_file, save, save_optimizer, save_with_section,
    write_part,
};
pub use checkpoint::Storage;
pub use checkpoint::{
    Checkpoint, Fetch, Kind, Region, Shard, ShardSource, TensorInfo, VerifyReport,
};
pub use crc::crc32_parallel;
pub use dtype::DType;
pub use error::{Error, Result};
pub use location::{IntoLocation, Location};
pub use sys::mmap;
pub use sys::mmap::Map;
pub use tensor::{BufferPool, PoolStats, Tensor};
pub use view::{Element, TensorView};
pub use write::parts::{CommitOptions, Layout, Part, PartChunk, PartItem};
pub use write::{wait_for_cleanup, Cleanup, CommitInfo, SaveOptions, TensorRef};
