//! Round trips through the writer and the reader, compared bit for bit, with an alignment
//! assertion on every view.

use ckptstore::{save, Checkpoint, DType, SaveOptions, TensorRef};
use proptest::prelude::*;

/// A tensor description: dtype, shape, bytes (contiguous), and an optional strided layout
/// (transpose of the last two dims) to feed the writer.
#[derive(Debug, Clone)]
struct Case {
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    transposed: bool,
}

fn case() -> impl Strategy<Value = Case> {
    let dtype = prop::sample::select(DType::ALL.to_vec());
    let shape = prop_oneof![
        Just(vec![]),
        prop::collection::vec(0u64..5, 1..4),
        prop::collection::vec(1u64..40, 1..3),
    ];
    (dtype, shape, any::<bool>(), any::<u64>()).prop_map(|(dtype, shape, transposed, seed)| {
        let n = shape.iter().product::<u64>() as usize * dtype.size();
        let mut x = seed | 1;
        let bytes = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if dtype == DType::Bool {
                    (x & 1) as u8
                } else {
                    x as u8
                }
            })
            .collect();
        let transposed = transposed && shape.len() >= 2;
        Case {
            dtype,
            shape,
            bytes,
            transposed,
        }
    })
}

/// Store `c` transposed in its last two dims, and return (backing bytes, strides).
fn transposed_backing(c: &Case) -> (Vec<u8>, Vec<u64>) {
    let r = c.shape.len();
    let (rows, cols) = (c.shape[r - 2] as usize, c.shape[r - 1] as usize);
    let outer: usize = c.shape[..r - 2].iter().product::<u64>() as usize;
    let es = c.dtype.size();
    let mut back = vec![0u8; c.bytes.len()];
    for o in 0..outer {
        for i in 0..rows {
            for j in 0..cols {
                let src = ((o * rows + i) * cols + j) * es;
                let dst = ((o * cols + j) * rows + i) * es;
                back[dst..dst + es].copy_from_slice(&c.bytes[src..src + es]);
            }
        }
    }
    // Element (.., i, j) lives at o*rows*cols + j*rows + i.
    let mut strides = vec![0u64; r];
    strides[r - 1] = rows as u64;
    strides[r - 2] = 1;
    let mut acc = (rows * cols) as u64;
    for d in (0..r - 2).rev() {
        strides[d] = acc;
        acc *= c.shape[d];
    }
    (back, strides)
}

fn assert_aligned(v: &ckptstore::TensorView<'_>) {
    assert_eq!(
        v.bytes().as_ptr() as usize % v.dtype().size(),
        0,
        "tensor {} ({}) is not aligned to its element size",
        v.name(),
        v.dtype()
    );
}

fn typed_view_ok(v: &ckptstore::TensorView<'_>) {
    match v.dtype() {
        DType::F32 => assert_eq!(v.as_slice::<f32>().unwrap().len(), v.numel()),
        DType::F64 => assert_eq!(v.as_slice::<f64>().unwrap().len(), v.numel()),
        DType::F16 => assert_eq!(v.as_slice::<half::f16>().unwrap().len(), v.numel()),
        DType::BF16 => assert_eq!(v.as_slice::<half::bf16>().unwrap().len(), v.numel()),
        DType::I64 => assert_eq!(v.as_slice::<i64>().unwrap().len(), v.numel()),
        DType::I32 => assert_eq!(v.as_slice::<i32>().unwrap().len(), v.numel()),
        DType::I16 => assert_eq!(v.as_slice::<i16>().unwrap().len(), v.numel()),
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_dtype_and_shape_round_trips(cases in prop::collection::vec(case(), 0..12), max_shard in 1u64..2000) {
        let dir = tempfile::tempdir().unwrap();
        let backings: Vec<_> = cases.iter().map(|c| if c.transposed { Some(transposed_backing(c)) } else { None }).collect();
        let names: Vec<String> = (0..cases.len()).map(|i| format!("t{i}.{}", cases[i].dtype)).collect();
        let refs: Vec<TensorRef<'_>> = cases
            .iter()
            .zip(&backings)
            .zip(&names)
            .map(|((c, b), n)| match b {
                Some((back, strides)) => TensorRef::strided(n.as_str(), c.dtype, &c.shape, strides, 0, back),
                None => TensorRef::new(n.as_str(), c.dtype, &c.shape, &c.bytes),
            })
            .collect();
        let opts = SaveOptions { max_shard_size: max_shard, ..Default::default() };
        let info = save(dir.path(), &refs, &opts).unwrap();
        prop_assert_eq!(info.tensors, cases.len());
        let ck = Checkpoint::open(dir.path()).unwrap();
        prop_assert!(ck.verify().unwrap().checksummed);
        // Manifest order is the caller's order.
        let order: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
        prop_assert_eq!(order, names.iter().map(String::as_str).collect::<Vec<_>>());
        for (c, n) in cases.iter().zip(&names) {
            let v = ck.read(n).view_unchecked().unwrap();
            prop_assert_eq!(v.dtype(), c.dtype);
            prop_assert_eq!(v.shape(), &c.shape[..]);
            prop_assert_eq!(v.bytes(), &c.bytes[..]);
            assert_aligned(&v);
            typed_view_ok(&v);
            let t = ck.info(n).unwrap();
            prop_assert_eq!(t.crc32, Some(crc32fast::hash(&c.bytes)));
        }
        // Shards respect the maximum unless a single tensor exceeds it.
        for (i, _) in ck.shards().iter().enumerate() {
            let in_shard: Vec<_> = ck.tensors().iter().filter(|t| t.shard == i).collect();
            let total: u64 = in_shard.iter().map(|t| t.nbytes()).sum();
            prop_assert!(total <= max_shard || in_shard.len() == 1);
        }
        // The stock safetensors crate reads every shard unchanged.
        for s in ck.shards() {
            let st = safetensors::SafeTensors::deserialize(s.bytes.as_ref()).unwrap();
            for (name, view) in st.tensors() {
                prop_assert_eq!(view.data(), ck.read(&name).view_unchecked().unwrap().bytes());
            }
        }
    }
}

#[test]
fn zero_dim_and_empty_keep_exact_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let s = [3.5f32];
    let e: [f32; 0] = [];
    let tensors = [
        TensorRef::from_slice("scalar", &[], &s),
        TensorRef::from_slice("one", &[1], &s),
        TensorRef::from_slice("empty", &[0, 7], &e),
        TensorRef::from_slice("empty1", &[0], &e),
    ];
    save(dir.path(), &tensors, &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.read("scalar").view_unchecked().unwrap().shape(),
        &[] as &[u64]
    );
    assert_eq!(
        ck.read("scalar")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap(),
        &[3.5]
    );
    assert_eq!(ck.read("one").view_unchecked().unwrap().shape(), &[1]);
    assert_eq!(ck.read("empty").view_unchecked().unwrap().shape(), &[0, 7]);
    assert_eq!(
        ck.read("empty")
            .view_unchecked()
            .unwrap()
            .as_slice::<f32>()
            .unwrap()
            .len(),
        0
    );
    assert_eq!(ck.read("empty1").view_unchecked().unwrap().shape(), &[0]);
    ck.verify().unwrap();
}

#[test]
fn strided_with_offset_and_broadcast_gathers() {
    let dir = tempfile::tempdir().unwrap();
    let back: Vec<i32> = (0..20).collect();
    let bytes: &[u8] = bytemuck::cast_slice(&back);
    // Column 1 of a 4x5 matrix: elements 1, 6, 11, 16.
    let col = TensorRef::strided("col", DType::I32, &[4], &[5], 1, bytes);
    // A broadcast (stride 0) row repeated 3 times.
    let bc = TensorRef::strided("bc", DType::I32, &[3, 2], &[0, 1], 7, bytes);
    save(dir.path(), &[col, bc], &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(
        ck.read("col")
            .view_unchecked()
            .unwrap()
            .as_slice::<i32>()
            .unwrap(),
        &[1, 6, 11, 16]
    );
    assert_eq!(
        ck.read("bc")
            .view_unchecked()
            .unwrap()
            .as_slice::<i32>()
            .unwrap(),
        &[7, 8, 7, 8, 7, 8]
    );
}

#[test]
fn invalid_inputs_are_rejected_before_touching_disk() {
    let dir = tempfile::tempdir().unwrap();
    let v = [1f32, 2.0];
    let bytes: &[u8] = bytemuck::cast_slice(&v);
    let cases: Vec<(Vec<TensorRef<'_>>, &str)> = vec![
        (vec![TensorRef::from_slice("a", &[3], &v)], "needs 12 bytes"),
        (
            vec![
                TensorRef::from_slice("a", &[2], &v),
                TensorRef::from_slice("a", &[2], &v),
            ],
            "given twice",
        ),
        (
            vec![TensorRef::from_slice("", &[2], &v)],
            "empty tensor name",
        ),
        (
            vec![TensorRef::from_slice("__metadata__", &[2], &v)],
            "reserved",
        ),
        (
            vec![TensorRef::strided(
                "s",
                DType::F32,
                &[2, 2],
                &[2, 1],
                0,
                bytes,
            )],
            "reaches element",
        ),
        (
            vec![TensorRef::strided("s", DType::F32, &[2], &[1, 1], 0, bytes)],
            "strides for",
        ),
        (
            vec![TensorRef::new("s", DType::F32, &[u64::MAX, 2], bytes)],
            "overflows",
        ),
    ];
    for (t, want) in cases {
        let err = save(dir.path().join("x"), &t, &SaveOptions::default()).unwrap_err();
        assert!(err.to_string().contains(want), "{want:?} not in {err}");
        assert!(matches!(err, ckptstore::Error::InvalidTensor { .. }));
    }
    // Nothing was created.
    assert!(!dir.path().join("x").exists());
}

#[test]
fn in_memory_checkpoint_from_parts() {
    // Core types are generic over storage: rebuild a checkpoint from Vec<u8> buffers.
    let dir = tempfile::tempdir().unwrap();
    let v: Vec<f64> = (0..100).map(|i| i as f64 * 0.5).collect();
    save(
        dir.path(),
        &[TensorRef::from_slice("v", &[10, 10], &v)],
        &SaveOptions::default(),
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let manifest = std::fs::read(dir.path().join("ckpt-manifest.json")).unwrap();
    let shards: Vec<Vec<u8>> = ck
        .shards()
        .iter()
        .map(|s| std::fs::read(dir.path().join(&s.file)).unwrap())
        .collect();
    let mem = Checkpoint::from_parts(&manifest, shards).unwrap();
    assert_eq!(
        mem.read("v")
            .view_unchecked()
            .unwrap()
            .as_slice::<f64>()
            .unwrap(),
        &v[..]
    );
    mem.verify().unwrap();
}
