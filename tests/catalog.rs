//! The logical catalog (issue 23, finding 3): a checkpoint written by several ranks lists
//! each global tensor once by its global name, beside the whole tensors, and never the
//! stored chunks (`w@0,0~r0`, ...), whose layout `chunks()` gives.

use ckptstore::write::parts::{self, chunk_tensor_name, CommitOptions, PartItem};
use ckptstore::{Checkpoint, Error, SaveOptions, TensorRef};

#[test]
fn the_catalog_lists_global_tensors_by_name_and_hides_their_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let id = parts::new_checkpoint_id().unwrap();
    let w: Vec<f32> = (0..8).map(|i| i as f32).collect(); // global [4, 2]
    let step = [7i64];
    let bias = [0.5f32; 3];
    let mut descriptors = Vec::new();
    for rank in 0..2u32 {
        let rows = &w[rank as usize * 4..rank as usize * 4 + 4];
        let mut items = vec![
            PartItem::Chunk {
                tensor: TensorRef::from_slice("w", &[2, 2], rows),
                global_shape: vec![4, 2],
                offsets: vec![u64::from(rank) * 2, 0],
            },
            // A replicated 0-dim global: every rank stores the same chunk.
            PartItem::Chunk {
                tensor: TensorRef::from_slice("step", &[], &step),
                global_shape: vec![],
                offsets: vec![],
            },
        ];
        if rank == 0 {
            items.push(PartItem::Whole(TensorRef::from_slice("bias", &[3], &bias)));
        }
        descriptors.push(
            ckptstore::write_part(dir.path(), &id, rank, &items, &SaveOptions::default()).unwrap(),
        );
    }
    ckptstore::commit(dir.path(), &id, &descriptors, &CommitOptions::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();

    // Stored: four chunk tensors (two of w, two replicas of step) and bias.
    assert_eq!(ck.tensors().len(), 5);
    let mut names: Vec<(&str, bool, usize, Vec<u64>)> = ck
        .catalog()
        .entries()
        .iter()
        .map(|e| (e.name, e.global, e.chunks, e.shape.to_vec()))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            ("bias", false, 1, vec![3]),
            ("step", true, 1, vec![]),
            ("w", true, 2, vec![4, 2]),
        ]
    );
    assert_eq!(ck.catalog().entry_count(), 3);
    assert!(ck.catalog().entry("w").unwrap().global);
    assert!(!ck.catalog().entry("bias").unwrap().global);
    // A chunk's stored name is not a catalog name.
    let chunk = chunk_tensor_name("w", &[0, 0], 0);
    assert!(ck.info(&chunk).is_ok(), "the chunk is stored under {chunk}");
    assert!(matches!(
        ck.catalog().entry(&chunk),
        Err(Error::TensorNotFound { .. })
    ));
    assert!(matches!(
        ck.catalog().entry("nope"),
        Err(Error::TensorNotFound { .. })
    ));
    // Read by its global name: the whole tensor, CRC-checked.
    assert_eq!(
        ck.read("w").to_tensor().unwrap().as_slice::<f32>().unwrap(),
        &w[..]
    );

    // Without globals the catalog is exactly the stored tensors, in order.
    let plain = tempfile::tempdir().unwrap();
    ckptstore::save(
        plain.path(),
        &[
            TensorRef::from_slice("b", &[3], &bias),
            TensorRef::from_slice("a", &[4, 2], &w),
        ],
        &SaveOptions::default(),
    )
    .unwrap();
    let ck = Checkpoint::open(plain.path()).unwrap();
    let got: Vec<&str> = ck.catalog().entries().iter().map(|e| e.name).collect();
    let stored: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(got, stored);
    assert_eq!(ck.catalog().entry_count(), 2);
}
