//! `StateValue::convert` and `state_absbits`: the conversion the loaders apply, for values
//! not read from a checkpoint by this crate (a rank's shard of a sharded state; the Python
//! bindings' every path). Bit-identical to `Checkpoint::load_optimizer` of the same values;
//! a state split into shards and converted with the folded absmax equals the whole
//! converted; the refusals name the parameter and the state.

use ckptstore::optim::{
    round_state, state_absbits, OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateLayout,
    StateValue, Target, Tensor,
};
use ckptstore::{Checkpoint, DType, Error, SaveOptions, TensorView};
use proptest::prelude::*;

fn view<'a>(shape: &'a [u64], x: &'a [f32]) -> TensorView<'a> {
    TensorView::new("x", DType::F32, shape, bytemuck::cast_slice(x))
}

/// What `load_optimizer` gives for the plain F32 state `x` of parameter `p` in `target`.
fn loaded(x: &[f32], target: Target) -> StateValue {
    let dir = tempfile::tempdir().unwrap();
    let n = x.len() as u64;
    let mut opt = OptimizerState::new(vec![ParamGroup {
        params: vec![ParamSpec::new("p", &[n])],
        hyper: Default::default(),
    }]);
    opt.state.insert(
        "p".into(),
        [(
            "exp_avg".to_string(),
            StateValue::Plain(Tensor::from_slice(&[n], x).unwrap()),
        )]
        .into(),
    );
    opt.save(dir.path(), &[], &SaveOptions::default()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mut st = ck
        .load_optimizer(&StateLayout::with_default(target))
        .unwrap();
    st.state.get_mut("p").unwrap().remove("exp_avg").unwrap()
}

fn conversion_reason(r: ckptstore::Result<StateValue>) -> String {
    match r {
        Err(Error::Conversion {
            param,
            state,
            reason,
        }) => {
            assert_eq!((param.as_str(), state.as_str()), ("w", "exp_avg"));
            reason
        }
        other => panic!("expected a conversion error, got {other:?}"),
    }
}

const TARGETS: [Target; 5] = [
    Target::AsStored,
    Target::F32,
    Target::BF16,
    Target::F16Scaled(ScaleShape::Keep),
    Target::F16Scaled(ScaleShape::Scalar),
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The same values give the same bits through `convert` as through a checkpoint.
    #[test]
    fn convert_is_bit_identical_to_load_optimizer(
        x in prop::collection::vec(-1.0e30f32..1.0e30, 1..300),
        t in 0usize..TARGETS.len(),
    ) {
        let shape = [x.len() as u64];
        let got = StateValue::convert("w", "exp_avg", &view(&shape, &x), TARGETS[t], None).unwrap();
        let want = loaded(&x, TARGETS[t]);
        prop_assert!(got.bit_eq(&want), "{:?}: {got:?} vs {want:?}", TARGETS[t]);
    }

    /// A state cut into shards, each converted with the absmax folded from every shard's
    /// `state_absbits`, gives the codes and the scale of the whole converted at once.
    #[test]
    fn shards_with_the_folded_absmax_equal_the_whole(
        x in prop::collection::vec(-1.0e4f32..1.0e4, 2..400),
        cuts in prop::collection::vec(0usize..400, 0..4),
    ) {
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % x.len()).collect();
        cuts.push(0);
        cuts.push(x.len());
        cuts.sort_unstable();
        cuts.dedup();
        let shards: Vec<&[f32]> = cuts.windows(2).map(|w| &x[w[0]..w[1]]).collect();
        let bits = shards
            .iter()
            .map(|s| state_absbits("w", "exp_avg", &view(&[s.len() as u64], s)).unwrap())
            .max()
            .unwrap();
        let whole_shape = [x.len() as u64];
        let StateValue::F16Scaled { q, scale } = StateValue::convert(
            "w", "exp_avg", &view(&whole_shape, &x), Target::F16Scaled(ScaleShape::One), None,
        ).unwrap() else { panic!("not scaled") };
        let mut codes = Vec::new();
        for s in &shards {
            let shape = [s.len() as u64];
            let StateValue::F16Scaled { q: qs, scale: ss } = StateValue::convert(
                "w", "exp_avg", &view(&shape, s), Target::F16Scaled(ScaleShape::One),
                Some(f32::from_bits(bits)),
            ).unwrap() else { panic!("not scaled") };
            prop_assert!(ss.bit_eq(&scale));
            codes.extend_from_slice(qs.bytes());
        }
        prop_assert_eq!(codes.as_slice(), q.bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// `round_state` (one fused pass into the caller's buffer) gives exactly the FP32 values
    /// of `convert` read back (`to_f32`), for every target, the absmax the values' own or a
    /// larger one given (another shard's); long inputs cross the kernels' blocks.
    #[test]
    fn round_state_is_convert_read_back(
        x in prop::collection::vec(-1.0e6f32..1.0e6, 0..3000),
        t in 0usize..TARGETS.len(),
        larger in prop::option::of(1.0f32..4.0),
    ) {
        let shape = [x.len() as u64];
        let own = f32::from_bits(state_absbits("w", "exp_avg", &view(&shape, &x)).unwrap());
        let absmax = larger.map(|k| own * k + 1.0);
        let want = StateValue::convert("w", "exp_avg", &view(&shape, &x), TARGETS[t], absmax)
            .unwrap()
            .to_f32()
            .unwrap();
        let mut got = vec![f32::NAN; x.len()];
        round_state("w", "exp_avg", &x, TARGETS[t], absmax, &mut got).unwrap();
        prop_assert_eq!(bytemuck::cast_slice::<f32, u32>(&got), bytemuck::cast_slice::<f32, u32>(&want));
    }
}

#[test]
fn round_state_refuses_what_convert_refuses() {
    let f16 = Target::F16Scaled(ScaleShape::Keep);
    let mut out = [0f32; 3];
    let refused = |x: &[f32], a: Option<f32>| {
        let mut o = [0f32; 3];
        match round_state("w", "exp_avg", x, f16, a, &mut o) {
            Err(Error::Conversion { reason, .. }) => reason,
            other => panic!("{other:?}"),
        }
    };
    assert!(refused(&[1.0e-36, 0.0, -2.0e-37], None).contains("too small for FP16 scaling"));
    assert!(
        refused(&[1.0e-36, 0.0, -2.0e-37], Some(1.0e-36)).contains("too small for FP16 scaling")
    );
    assert!(refused(&[1.0, f32::NAN, 0.0], None).contains("infinity or NaN"));
    assert!(refused(&[1.0, f32::INFINITY, 0.0], Some(2.0)).contains("infinity or NaN"));
    assert!(refused(&[1.0, -3.0, 0.0], Some(2.0)).contains("below the values' own"));
    assert!(matches!(
        round_state("w", "exp_avg", &[1.0; 2], f16, None, &mut out),
        Err(Error::InvalidArgument(_))
    ));
}

/// The motivating underflow: an Adam moment whose absmax is 1e-36 cannot be FP16-scaled
/// (1/scale overflows FP32, every code would be inf); the engine refuses it, naming the
/// state, whether the absmax is the values' own or given.
#[test]
fn a_tiny_moment_is_refused_not_turned_into_inf() {
    let x = [1.0e-36f32, -5.0e-37, 0.0];
    let shape = [3u64];
    let f16 = Target::F16Scaled(ScaleShape::Keep);
    let own = conversion_reason(StateValue::convert(
        "w",
        "exp_avg",
        &view(&shape, &x),
        f16,
        None,
    ));
    assert!(own.contains("too small for FP16 scaling"), "{own}");
    let bits = state_absbits("w", "exp_avg", &view(&shape, &x)).unwrap();
    assert_eq!(f32::from_bits(bits), 1.0e-36);
    let given = conversion_reason(StateValue::convert(
        "w",
        "exp_avg",
        &view(&shape, &x),
        f16,
        Some(f32::from_bits(bits)),
    ));
    assert_eq!(given, own);
    // BF16 keeps them.
    let StateValue::Plain(b) =
        StateValue::convert("w", "exp_avg", &view(&shape, &x), Target::BF16, None).unwrap()
    else {
        panic!("not plain")
    };
    assert_eq!(b.dtype(), DType::BF16);
}

#[test]
fn non_finite_values_a_low_or_non_finite_absmax_and_integers_are_refused() {
    let shape = [3u64];
    let f16 = Target::F16Scaled(ScaleShape::Keep);
    let inf = [1.0f32, f32::INFINITY, 2.0];
    let bits = state_absbits("w", "exp_avg", &view(&shape, &inf)).unwrap();
    assert!(bits >= ckptstore::convert::NON_FINITE_BITS);
    let r = conversion_reason(StateValue::convert(
        "w",
        "exp_avg",
        &view(&shape, &inf),
        f16,
        None,
    ));
    assert!(r.contains("infinity or NaN"), "{r}");

    let x = [1.0f32, -3.0, 2.0];
    for a in [f32::NAN, f32::INFINITY] {
        let r = conversion_reason(StateValue::convert(
            "w",
            "exp_avg",
            &view(&shape, &x),
            f16,
            Some(a),
        ));
        assert!(r.contains("infinity or NaN"), "{a}: {r}");
    }
    for a in [2.9f32, -3.0, -0.0] {
        let r = conversion_reason(StateValue::convert(
            "w",
            "exp_avg",
            &view(&shape, &x),
            f16,
            Some(a),
        ));
        assert!(r.contains("below the values' own"), "{a}: {r}");
    }
    // A larger absmax (another shard's) is taken as it is.
    let StateValue::F16Scaled { scale, .. } =
        StateValue::convert("w", "exp_avg", &view(&shape, &x), f16, Some(32752.0)).unwrap()
    else {
        panic!("not scaled")
    };
    assert_eq!(scale.as_slice::<f32>().unwrap(), &[1.0]);

    let ints = [1i64, 2, 3];
    let iv = TensorView::new("x", DType::I64, &shape, bytemuck::cast_slice(&ints));
    let r = conversion_reason(StateValue::convert("w", "exp_avg", &iv, Target::BF16, None));
    assert!(r.contains("not floating-point"), "{r}");
    assert!(matches!(
        state_absbits("w", "exp_avg", &iv),
        Err(Error::Conversion { .. })
    ));
    // As stored: a copy, whatever the dtype.
    let StateValue::Plain(c) =
        StateValue::convert("w", "exp_avg", &iv, Target::AsStored, None).unwrap()
    else {
        panic!("not plain")
    };
    assert_eq!(c.bytes(), iv.bytes());
}

/// The rule every loader resolves targets with: explicit entries as given, the default
/// only for floating-point states shaped like their parameter and never for counters.
#[test]
fn the_target_rule() {
    let bf = Target::BF16;
    let l = StateLayout::with_default(bf)
        .state("exp_avg_sq", Target::F32)
        .param_state("w", "exp_avg", Target::AsStored);
    assert_eq!(l.target("v", "exp_avg", true, &[4], &[4]), bf);
    assert_eq!(l.target("v", "exp_avg", true, &[1], &[4]), Target::AsStored);
    assert_eq!(
        l.target("v", "exp_avg", false, &[4], &[4]),
        Target::AsStored
    );
    assert_eq!(l.target("v", "step", true, &[], &[]), Target::AsStored);
    assert_eq!(l.target("v", "exp_avg_sq", false, &[1], &[4]), Target::F32);
    assert_eq!(l.target("w", "exp_avg", true, &[4], &[4]), Target::AsStored);
    assert_eq!(
        l.counter("mom").target("v", "mom", true, &[4], &[4]),
        Target::AsStored
    );
}
