//! Resume equivalence: train k steps, save across several shards, restore into a fresh
//! optimizer, run three more steps, and compare with uninterrupted training bit for bit,
//! for every state storage x parameter layout x optimizer.

#[path = "common/refopt.rs"]
mod refopt;

use ckptstore::{Checkpoint, DType, SaveOptions, TensorRef};
use refopt::{Hyper, Kind, Model, Storage};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    Scalar,
    OneD,
    TwoD,
    NonContiguous,
    ManySmall,
    OneLarge,
}

const LAYOUTS: [Layout; 6] = [
    Layout::Scalar,
    Layout::OneD,
    Layout::TwoD,
    Layout::NonContiguous,
    Layout::ManySmall,
    Layout::OneLarge,
];

fn model_for(layout: Layout) -> Model {
    match layout {
        Layout::Scalar => Model::new(&[("s", &[])]),
        Layout::OneD => Model::new(&[("v", &[1000])]),
        Layout::TwoD => Model::new(&[("m", &[32, 48])]),
        Layout::NonContiguous => Model::new(&[("t", &[24, 40])]),
        Layout::ManySmall => {
            let names: Vec<String> = (0..200).map(|i| format!("layer{i:03}.w")).collect();
            let specs: Vec<(&str, &[u64])> = names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), if i % 2 == 0 { &[3][..] } else { &[2, 2][..] }))
                .collect();
            Model::new(&specs)
        }
        Layout::OneLarge => Model::new(&[("big", &[1 << 18])]),
    }
}

/// Save the model's parameters; the non-contiguous layout keeps its parameter as the
/// transpose of a column-major backing buffer and hands the writer a strided view.
fn save(
    model: &Model,
    opt: &ckptstore::optim::OptimizerState,
    layout: Layout,
    dir: &std::path::Path,
) -> usize {
    let total: u64 = model
        .params
        .values()
        .map(|(_, v)| v.len() as u64 * 12)
        .sum();
    let opts = SaveOptions {
        max_shard_size: (total / 4).max(1),
        ..Default::default()
    };
    let backing: Vec<f32>;
    let refs: Vec<TensorRef<'_>> = if layout == Layout::NonContiguous {
        let (shape, v) = &model.params["t"];
        let (r, c) = (shape[0] as usize, shape[1] as usize);
        backing = (0..r * c).map(|k| v[(k % r) * c + k / r]).collect();
        vec![TensorRef::strided(
            "t",
            DType::F32,
            shape,
            &[1, r as u64],
            0,
            bytemuck::cast_slice(&backing),
        )]
    } else {
        refopt::model_refs(model)
    };
    opt.save(dir, &refs, &opts).unwrap().shards
}

fn run(kind: Kind, storage: Storage, layout: Layout) {
    let h = Hyper::new(kind);
    let mut model = model_for(layout);
    let mut opt = refopt::optimizer_for(&model, &h, 1 + (layout as usize % 2));
    let k = 3;
    for s in 1..=k {
        refopt::step(&mut model, &mut opt, &h, storage, s);
    }
    let dir = tempfile::tempdir().unwrap();
    let shards = save(&model, &opt, layout, dir.path());
    assert!(
        shards >= 2,
        "{kind:?} {storage:?} {layout:?}: only {shards} shard"
    );

    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut restored = refopt::optimizer_for(&model, &h, 1 + (layout as usize % 2));
    restored.restore_from(&ck, &storage.layout()).unwrap();
    let mut rmodel = refopt::model_from(&ck, &model);
    assert_eq!(rmodel, model, "parameters after restore");
    refopt::state_bit_eq(&restored, &opt).unwrap();

    for s in k + 1..=k + 3 {
        refopt::step(&mut model, &mut opt, &h, storage, s);
        refopt::step(&mut rmodel, &mut restored, &h, storage, s);
    }
    assert_eq!(
        rmodel, model,
        "{kind:?} {storage:?} {layout:?}: parameters diverged"
    );
    refopt::state_bit_eq(&restored, &opt)
        .unwrap_or_else(|e| panic!("{kind:?} {storage:?} {layout:?}: {e}"));
}

#[test]
fn resume_is_bit_exact_for_every_storage_layout_and_optimizer() {
    let mut n = 0;
    for kind in [Kind::Adam, Kind::Sgd] {
        for storage in Storage::ALL {
            for layout in LAYOUTS {
                run(kind, storage, layout);
                n += 1;
            }
        }
    }
    eprintln!("{n} resume combinations bit-exact");
    assert_eq!(n, 36);
}
