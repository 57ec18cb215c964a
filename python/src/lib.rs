//! `ckptstore._ckptstore`: the native half of the `ckptstore` Python package.
//!
//! The Python package (`python/py_src/ckptstore/`) wraps this module: it maps numpy dtypes to
//! wire names, gathers arrays the writer cannot take as they are, and builds the optimizer
//! section of torch checkpoints. Everything that touches tensor bytes happens here, in the
//! Rust engine, with the interpreter detached:
//!
//! * [`save::save`] hands numpy buffers to the writer without copying them (C-contiguous arrays
//!   as they are, strided ones through `TensorRef::strided`);
//! * [`checkpoint::PyCheckpoint`] reads tensors as read-only numpy arrays **over the memory map**, each
//!   array keeping the mapping alive through its `base` object;
//! * `load_optimizer` returns freshly allocated, writable arrays that own the engine's
//!   buffers (no copy on the way to Python).

mod args;
mod checkpoint;
mod dirs;
mod dtypes;
mod errors;
mod manager;
mod optim;
mod parts;
mod reader;
mod remote;
mod save;
mod state;

use pyo3::prelude::*;

use checkpoint::{MappedCheckpoint, OwnedBuffer, PyCheckpoint};

/// The native module `ckptstore._ckptstore`.
#[pymodule]
fn _ckptstore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(save::save, m)?)?;
    m.add_function(wrap_pyfunction!(save::wait_for_cleanup, m)?)?;
    m.add_function(wrap_pyfunction!(parts::write_part, m)?)?;
    m.add_function(wrap_pyfunction!(parts::commit, m)?)?;
    m.add_function(wrap_pyfunction!(parts::new_checkpoint_id, m)?)?;
    m.add_function(wrap_pyfunction!(optim::check_optimizer_fit, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes::dtype_table, m)?)?;
    m.add_function(wrap_pyfunction!(state::state_target, m)?)?;
    m.add_function(wrap_pyfunction!(state::state_absbits, m)?)?;
    m.add_function(wrap_pyfunction!(state::convert_state, m)?)?;
    m.add_function(wrap_pyfunction!(state::round_state, m)?)?;
    m.add_function(wrap_pyfunction!(state::f16_scaled_to_f32, m)?)?;
    m.add_class::<PyCheckpoint>()?;
    m.add_class::<manager::PyCheckpointManager>()?;
    m.add_class::<manager::PyStepLease>()?;
    m.add_class::<MappedCheckpoint>()?;
    m.add_class::<OwnedBuffer>()?;
    m.add_function(wrap_pyfunction!(checkpoint::region_reader, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::publish_dir, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::remove_dir, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::sweep_leftovers, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::fsync_dir, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::make_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::write_file, m)?)?;
    m.add_function(wrap_pyfunction!(dirs::copy_files, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
