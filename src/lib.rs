#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// Modules, lowest floor first: each one uses only those above it in this list. `error`,
// `dtype`, `view`, `tensor` and `crc` are the base; then `format` (bytes on disk), `sys`
// (the only unsafe code), `convert` (kernels over `sys`), `write` and `checkpoint` (whole
// checkpoints), `optim` (optimizer state on top of checkpoints), `manager`.
pub mod error;
pub mod dtype;
pub mod view;
pub mod tensor;
mod crc;
pub mod format;
mod sys;
pub mod convert;
pub mod write;
pub mod checkpoint;
pub mod optim;
pub mod manager;
pub mod optim;
mod sys;
pub mod tensor;
pub mod view;
pub mod write;

pub use checkpoint::{Checkpoint, Kind, Region, Shard, TensorInfo, VerifyReport};
pub use crc::crc32_parallel;
pub use dtype::DType;
pub use error::{Error, Result};
pub use sys::mmap;
pub use sys::mmap::Map;
pub use tensor::{BufferPool, PoolStats, Tensor};
pub use view::{Element, TensorView};
pub use write::parts::{CommitOptions, Part, PartChunk, PartItem};
pub use write::{save, save_with_section, CommitInfo, SaveOptions, TensorRef};
