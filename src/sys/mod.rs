//! The only module with `unsafe`: read-only memory maps of shard files ([`mmap`]) and the
//! runtime-dispatched SIMD conversion kernel ([`simd`]). Every block carries a `// SAFETY:`
//! comment; the rest of the crate denies `unsafe_code`.
#![allow(unsafe_code)]

pub mod mmap;
pub(crate) mod simd;
