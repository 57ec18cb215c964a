//! The only module with `unsafe`: read-only memory maps of shard files ([`mmap`]), the
//! runtime-dispatched SIMD conversion kernels ([`simd`]) and a few system calls ([`io`]:
//! write-back and cache hints, the atomic exchange of two directory entries). Every block
//! carries a `// SAFETY:` comment; the rest of the crate denies `unsafe_code`.
#![allow(unsafe_code)]

pub(crate) mod io;
pub mod mmap;
pub(crate) mod simd;
