#![doc = include_str!("../README.md")]
#![doc = "
## Modules, lowest floor first

Dependencies run one way: each module uses only those listed before it (tests/layers.rs
checks the `use crate::` paths of every file against this order).

1. The base: errors ([`Error`]), locations (paths and URLs: [`store::Location`]), dtypes,
   views and owned tensors ([`tensor`]: [`DType`], [`TensorView`], [`Tensor`], the buffer
   pool), CRCs; `sys` (private: the only `unsafe` code; public face [`store::mmap`]) and
   [`convert`] (kernels).
2. [`format`](mod@format): bytes on disk (shard header, manifest, part descriptor, file names,
   optimizer-section and global-tensor rules, upload journals).
3. [`store`]: where the bytes live, behind one object-safe trait ([`store::Store`],
   [`store::Put`]; [`store::connect`] makes one from a location): the local directory
   [`store::LocalStore`] over the [`store::fs`] fault seam, and S3 (`store::s3`, feature
   `s3`). It moves bytes and knows no reader or writer.
4. [`write`](mod@write) and [`checkpoint`]: whole checkpoints, written (single- and
   multi-rank) and read, over any store; neither imports the other.
5. [`optim`]: optimizer state on top of checkpoints.
6. [`manager`] (steps of a training run) and the verbs over any store (a path, an `s3://`
   URL, or a store: [`store::IntoStore`]), one each: [`open`], [`save`], [`write_part`],
   [`commit`], [`discard`].
"]
#![warn(missing_docs)]

// Modules, lowest floor first: each one uses only those above it. (Blank-line groups keep
// rustfmt from sorting the floors alphabetically.) Eight are public; the base's types are
// re-exported at the root and in `tensor`, `store` and `checkpoint`.

// The base every floor uses.
mod error;

mod location;

mod dtype;

mod view;

pub mod tensor;

mod crc;

// The only unsafe code (memory maps, SIMD kernels, I/O hints), and the kernels over it. Its
// public face, the memory map, is `store::mmap`.
mod sys;
pub(crate) use sys::mmap;

pub mod convert;

// Bytes on disk.
pub mod format;

// Where bytes live: local directories and object stores.
pub mod store;

// Whole checkpoints: writing and reading.
pub mod write;

pub mod checkpoint;

// Optimizer state on top of checkpoints, then steps of a training run and the verbs over
// stores.
pub mod optim;

pub mod manager;

mod api;

pub use api::{commit, discard, open, save, write_part};
pub use checkpoint::{Checkpoint, Region, Storage, TensorInfo, VerifyReport};
pub use error::{Error, Result};
pub use tensor::{BufferPool, DType, Element, Tensor, TensorView};
pub use write::parts::{CommitOptions, Part, PartItem};
pub use write::{Cleanup, CommitInfo, SaveOptions, TensorRef};
