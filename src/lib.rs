#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod checkpoint;
mod crc;
pub mod dtype;
pub mod error;
pub mod format;
pub mod manager;
mod sys;
pub mod view;
pub mod write;

pub use checkpoint::{Checkpoint, Kind, Shard, TensorInfo, VerifyReport};
pub use crc::crc32_parallel;
pub use dtype::DType;
pub use error::{Error, Result};
pub use sys::mmap;
pub use sys::mmap::Map;
pub use view::{Element, TensorView};
pub use write::{save, save_with_section, CommitInfo, SaveOptions, TensorRef};
pub mod convert;
pub mod optim;
