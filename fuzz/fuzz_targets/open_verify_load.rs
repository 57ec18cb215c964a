//! The whole read path over in-memory checkpoints: `Checkpoint::from_parts`, `verify`,
//! `tensor` / `tensor_verified` on every name, and `load_optimizer` in several layouts.
//! Nothing may panic, whatever the manifest and shard bytes; a few cross-checks (verify vs
//! per-tensor CRCs, verify vs the shard headers, loaded state vs `validate`) are asserted.
//!
//! Input: see `ckptstore_fuzz::unframe` (flags byte, manifest, 1-3 shards). The flags may
//! ask for CRC and size repairs (`ckptstore_fuzz::fix_up`) so that mutated shard bytes get
//! past the checksums into the loaders and conversion kernels.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use ckptstore::optim::{ScaleShape, StateLayout, Target};
use ckptstore::{Checkpoint, DType, TensorView};
use ckptstore_fuzz::{fix_up, unframe};
use libfuzzer_sys::fuzz_target;

fn layouts() -> &'static [StateLayout] {
    static L: OnceLock<Vec<StateLayout>> = OnceLock::new();
    L.get_or_init(|| {
        vec![
            StateLayout::default(),
            StateLayout::with_default(Target::F32),
            StateLayout::with_default(Target::BF16),
            StateLayout::with_default(Target::F16Scaled(ScaleShape::Keep)),
            // Explicit entries apply even to non-float and scalar states.
            StateLayout::with_default(Target::F16Scaled(ScaleShape::Scalar))
                .state("step", Target::F32)
                .state("exp_avg", Target::F16Scaled(ScaleShape::One))
                .state("exp_avg_sq", Target::BF16)
                .state("momentum_buffer", Target::F16Scaled(ScaleShape::Scalar)),
        ]
    })
}

/// Read a view through its typed accessor (must not panic; may refuse).
fn touch(v: &TensorView<'_>) {
    let _ = match v.dtype() {
        DType::F32 => v.as_slice::<f32>().map(|s| s.len()),
        DType::F64 => v.as_slice::<f64>().map(|s| s.len()),
        DType::I64 => v.as_slice::<i64>().map(|s| s.len()),
        DType::U8 | DType::Bool => v.as_slice::<u8>().map(|s| s.len()),
        _ => Ok(v.numel()),
    };
}

fuzz_target!(|data: &[u8]| {
    let f = unframe(data);
    let manifest = fix_up(f.flags, f.manifest, &f.shards);
    let shards: Vec<Vec<u8>> = f.shards.iter().map(|s| s.to_vec()).collect();

    let Ok(ck) = Checkpoint::from_parts(&manifest, shards) else {
        return;
    };
    // `verify` checks more than the tensor CRCs (it re-parses and cross-checks the shard
    // headers, and the optimizer section), so only one direction is an invariant: after a
    // successful verify, every tensor's own CRC check passes too.
    let verified = ck.verify();
    // Lookups by name find exactly the listed tensor; a name no tensor can have is absent.
    assert!(ck.read("\0absent").view_unchecked().is_err());
    for t in ck.tensors() {
        assert_eq!(ck.info(&t.name).expect("listed tensor"), t);
        let v = ck.read(&t.name).view_unchecked().expect("listed tensor");
        assert_eq!(v.bytes().len() as u64, t.nbytes());
        assert_eq!(v.shape(), &t.shape[..]);
        touch(&v);
        let tv = ck.read(&t.name).view();
        if verified.is_ok() {
            if let Err(e) = tv {
                panic!(
                    "verify() passed but tensor_verified({:?}) fails: {e}",
                    t.name
                );
            }
        }
    }
    if let Ok(r) = &verified {
        assert!(r.checksummed);
        assert_eq!(r.tensors, ck.tensors().len());
        // Every header was parsed and cross-checked: each shard opens on its own as a plain
        // safetensors file holding exactly the tensors the manifest places there.
        for (i, bytes) in f.shards.iter().enumerate() {
            let plain = match Checkpoint::from_safetensors(
                PathBuf::from("s.safetensors"),
                bytes.to_vec(),
            ) {
                Ok(p) => p,
                Err(e) => panic!("verify() passed but shard {i} does not open as safetensors: {e}"),
            };
            let mut want: Vec<_> = ck
                .tensors()
                .iter()
                .filter(|t| t.shard == i)
                .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.offsets))
                .collect();
            let mut got: Vec<_> = plain
                .tensors()
                .iter()
                .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.offsets))
                .collect();
            want.sort();
            got.sort();
            assert_eq!(
                got, want,
                "shard {i}: header and manifest disagree after verify()"
            );
        }
    }
    for layout in layouts() {
        // A loaded state must be one the writer accepts again (OptimizerState::save
        // validates first): loading never produces an inconsistent state.
        if let Ok(st) = ck.load_optimizer(layout) {
            if let Err(e) = st.validate() {
                panic!("load_optimizer({layout:?}) returned a state that fails validate(): {e}");
            }
        }
    }
});
