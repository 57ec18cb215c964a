#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// Modules, lowest floor first: each one uses only those above it in this list
// (`error`, `dtype`, `view`, `tensor`, `crc` and `convert` are the base every floor uses).
pub mod checkpoint;
pub mod convert;
mod crc;
pub mod dtype;
pub mod error;
pub mod format;
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
