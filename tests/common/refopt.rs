//! Reference optimizers for tests and the demo (deliberately outside the library core):
//! PyTorch-semantics SGD with momentum, Adam and AdamW over FP32 master parameters, with
//! optimizer state stored as F32, BF16 or F16-scaled (TransformerEngine FusedAdam style),
//! and a deterministic synthetic model and gradient.
#![allow(dead_code)]

use std::collections::BTreeMap;

use rayon::prelude::*;

use ckptstore::optim::{OptimizerState, ParamGroup, ParamSpec, ScaleShape, StateValue, Tensor};
use ckptstore::DType;

/// How moment tensors are stored between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    F32,
    BF16,
    F16Scaled,
    /// Moments widened to F64 (the arithmetic stays FP32).
    F64,
}

impl Storage {
    pub const ALL: [Storage; 3] = [Storage::F32, Storage::BF16, Storage::F16Scaled];

    pub fn encode(self, shape: &[u64], x: &[f32]) -> StateValue {
        match self {
            Storage::F32 => StateValue::Plain(Tensor::from_slice(shape, x).unwrap()),
            Storage::BF16 => {
                let v: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
                StateValue::Plain(Tensor::from_slice(shape, &v).unwrap())
            }
            Storage::F16Scaled => {
                StateValue::f16_scaled_from_f32(shape, x, ScaleShape::One).unwrap()
            }
            Storage::F64 => {
                let v: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                StateValue::Plain(Tensor::from_slice(shape, &v).unwrap())
            }
        }
    }

    /// The load layout a live optimizer with this storage asks for: the moment states by
    /// name (`step` stays as stored).
    pub fn layout(self) -> ckptstore::optim::StateLayout {
        let t = self.target();
        ckptstore::optim::StateLayout::default()
            .state("exp_avg", t)
            .state("exp_avg_sq", t)
            .state("momentum_buffer", t)
    }

    /// The load target that keeps this storage.
    pub fn target(self) -> ckptstore::optim::Target {
        use ckptstore::optim::Target;
        match self {
            Storage::F32 => Target::F32,
            Storage::BF16 => Target::BF16,
            Storage::F16Scaled => Target::F16Scaled(ScaleShape::Keep),
            Storage::F64 => Target::AsStored,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Sgd,
    Adam,
    AdamW,
}

/// A model: named FP32 parameters in the optimizer's groups.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub params: BTreeMap<String, (Vec<u64>, Vec<f32>)>,
}

/// A float type parameters can be held in: f32 or f64.
pub fn numel(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

/// Deterministic pseudo-random in [-1, 1).
pub fn noise(a: u64, b: u64) -> f32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_add(0x632B_E59B_D9B4_E019);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

impl Model {
    pub fn new(specs: &[(&str, &[u64])]) -> Model {
        let params = specs
            .iter()
            .enumerate()
            .map(|(k, (n, s))| {
                let v = (0..numel(s))
                    .into_par_iter()
                    .map(|i| noise(k as u64, i as u64))
                    .collect();
                (n.to_string(), (s.to_vec(), v))
            })
            .collect();
        Model { params }
    }

    /// Gradient of a quadratic loss pulling parameters towards a fixed target, plus
    /// step-dependent noise.
    pub fn grad(name: &str, step: u64, p: &[f32]) -> Vec<f32> {
        let h = name
            .bytes()
            .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(b as u64));
        p.par_iter()
            .enumerate()
            .map(|(i, &x)| 0.5 * (x - 0.25 * noise(h, i as u64)) + 0.1 * noise(h ^ step, i as u64))
            .collect()
    }
}

pub struct Hyper {
    pub kind: Kind,
    pub lr: f32,
    pub momentum: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
}

impl Hyper {
    pub fn new(kind: Kind) -> Hyper {
        Hyper {
            kind,
            lr: if kind == Kind::Sgd { 0.1 } else { 1e-3 },
            momentum: 0.9,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: if kind == Kind::AdamW { 0.01 } else { 0.0 },
        }
    }

    pub fn to_json(&self) -> serde_json::Map<String, serde_json::Value> {
        let v = serde_json::json!({
            "kind": format!("{:?}", self.kind), "lr": self.lr, "momentum": self.momentum,
            "betas": [self.betas.0, self.betas.1], "eps": self.eps, "weight_decay": self.weight_decay,
        });
        v.as_object().cloned().unwrap()
    }
}

/// Build an optimizer with `ngroups` groups (parameters split round-robin by name order).
pub fn optimizer_for(model: &Model, h: &Hyper, ngroups: usize) -> OptimizerState {
    let mut groups: Vec<ParamGroup> = (0..ngroups)
        .map(|_| ParamGroup {
            params: vec![],
            hyper: h.to_json(),
        })
        .collect();
    for (i, (n, (s, _))) in model.params.iter().enumerate() {
        groups[i % ngroups]
            .params
            .push(ParamSpec::new(n.clone(), s));
    }
    OptimizerState::new(groups)
}

/// One optimizer step over every parameter, PyTorch semantics, state stored as `storage`.
pub fn step(
    model: &mut Model,
    opt: &mut OptimizerState,
    h: &Hyper,
    storage: Storage,
    global_step: u64,
) {
    for (name, (shape, p)) in model.params.iter_mut() {
        let g = Model::grad(name, global_step, p);
        let st = opt.state.entry(name.clone()).or_default();
        match h.kind {
            Kind::Sgd => {
                let buf: Vec<f32> = match st.get("momentum_buffer") {
                    None => g.clone(),
                    Some(b) => b
                        .to_f32()
                        .unwrap()
                        .iter()
                        .zip(&g)
                        .map(|(&b, &g)| h.momentum * b + g)
                        .collect(),
                };
                p.par_iter_mut().zip(&buf).for_each(|(x, b)| *x -= h.lr * b);
                st.insert("momentum_buffer".into(), storage.encode(shape, &buf));
            }
            Kind::Adam | Kind::AdamW => {
                let t = match st.get("step") {
                    Some(s) => s.to_f32().unwrap()[0] + 1.0,
                    None => 1.0,
                };
                let n = p.len();
                let mut m = st
                    .get("exp_avg")
                    .map(|v| v.to_f32().unwrap())
                    .unwrap_or(vec![0.0; n]);
                let mut v = st
                    .get("exp_avg_sq")
                    .map(|v| v.to_f32().unwrap())
                    .unwrap_or(vec![0.0; n]);
                let (b1, b2) = h.betas;
                let bc1 = 1.0 - b1.powf(t);
                let bc2 = 1.0 - b2.powf(t);
                // Element-wise, so the parallel split cannot change a single bit.
                p.par_iter_mut()
                    .zip(&mut m)
                    .zip(&mut v)
                    .zip(&g)
                    .for_each(|(((p, m), v), &g)| {
                        let mut gi = g;
                        if h.kind == Kind::Adam && h.weight_decay != 0.0 {
                            gi += h.weight_decay * *p;
                        }
                        if h.kind == Kind::AdamW {
                            *p *= 1.0 - h.lr * h.weight_decay;
                        }
                        *m = b1 * *m + (1.0 - b1) * gi;
                        *v = b2 * *v + (1.0 - b2) * gi * gi;
                        let denom = (*v / bc2).sqrt() + h.eps;
                        *p -= h.lr * (*m / bc1) / denom;
                    });
                st.insert("step".into(), StateValue::Plain(Tensor::scalar_f32(t)));
                st.insert("exp_avg".into(), storage.encode(shape, &m));
                st.insert("exp_avg_sq".into(), storage.encode(shape, &v));
            }
        }
    }
}

/// True if two optimizer states are bit-identical (groups, hyperparameters, every tensor).
pub fn state_bit_eq(a: &OptimizerState, b: &OptimizerState) -> Result<(), String> {
    if a.groups != b.groups {
        return Err("groups differ".into());
    }
    let ka: Vec<_> = a.state.keys().collect();
    let kb: Vec<_> = b.state.keys().collect();
    if ka != kb {
        return Err(format!("parameters with state differ: {ka:?} vs {kb:?}"));
    }
    for (p, sa) in &a.state {
        let sb = &b.state[p];
        if sa.keys().collect::<Vec<_>>() != sb.keys().collect::<Vec<_>>() {
            return Err(format!("{p}: state names differ"));
        }
        for (n, va) in sa {
            if !va.bit_eq(&sb[n]) {
                return Err(format!("{p}/{n}: values differ"));
            }
        }
    }
    Ok(())
}

/// Model parameters as tensor refs for saving.
pub fn model_refs(model: &Model) -> Vec<ckptstore::TensorRef<'_>> {
    model
        .params
        .iter()
        .map(|(n, (s, v))| ckptstore::TensorRef::from_slice(n.as_str(), s, v))
        .collect()
}

/// Read model parameters back from a checkpoint (CRC-checked), as a fresh model.
pub fn model_from<B: ckptstore::checkpoint::ShardSource>(
    ck: &ckptstore::Checkpoint<B>,
    like: &Model,
) -> Model {
    let params = like
        .params
        .iter()
        .map(|(n, (s, _))| {
            let v = ck.read(n).view().unwrap();
            assert_eq!(v.dtype(), DType::F32);
            assert_eq!(v.shape(), &s[..]);
            (
                n.clone(),
                (s.clone(), v.as_slice::<f32>().unwrap().to_vec()),
            )
        })
        .collect();
    Model { params }
}
