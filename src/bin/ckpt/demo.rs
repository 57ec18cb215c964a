//! `ckpt demo`: the end-to-end story on built-in synthetic data.
//!
//! A synthetic model is trained a few steps with a reference Adam that holds its moments
//! FP16-scaled (TransformerEngine FusedAdam style), saved as a sharded checkpoint, opened,
//! verified, restored twice into fresh optimizers, and checked: both restores bit-identical
//! to the live state, three resumed steps bit-identical to uninterrupted training, and the
//! shard files byte-identical before and after the loads.

#[path = "../../../tests/common/refopt.rs"]
#[allow(dead_code, clippy::all)]
mod refopt;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ckptstore::optim::{ScaleShape, StateLayout, Target};
use ckptstore::{Checkpoint, Result, SaveOptions};
use refopt::{Hyper, Kind, Model, Storage};

use crate::util::{gibps, human, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Directory for the checkpoint (default: a temporary directory, removed afterwards).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Bytes of optimizer state (the two FP16-scaled Adam moments), e.g. 1GiB, 64MiB.
    #[arg(long, value_parser = parse_size, default_value = "1GiB")]
    size: u64,
    /// Training steps before the save.
    #[arg(long, default_value_t = 2)]
    steps: u64,
}

struct Checks {
    failed: usize,
}

impl Checks {
    fn check(&mut self, what: &str, ok: bool, detail: String) {
        outln!(
            "  [{}] {what}{}",
            if ok { "ok" } else { "FAIL" },
            if ok {
                String::new()
            } else {
                format!(": {detail}")
            }
        );
        if !ok {
            self.failed += 1;
        }
    }
}

fn file_hashes(dir: &std::path::Path) -> Vec<(String, u32, u64)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let bytes = std::fs::read(e.path()).ok()?;
            Some((
                name,
                ckptstore::format::crc32_parallel(&bytes),
                bytes.len() as u64,
            ))
        })
        .collect();
    v.sort();
    v
}

pub fn run(a: Args) -> Result<ExitCode> {
    let (base, _tmp) = crate::util::dir_or_temp(&a.dir)?;
    let dir = if a.dir.is_some() {
        base
    } else {
        base.join("ckpt")
    };
    // Elements: two FP16 moments per element = 4 bytes of optimizer state each.
    let elems = (a.size / 4).max(64);
    let big = elems * 3 / 4;
    let rows = 1024u64.min(big.max(1));
    let (r0, c0) = (rows, (big / rows).max(1));
    let rest = elems.saturating_sub(r0 * c0).max(16);
    let small = rest / 8;
    let specs: Vec<(String, Vec<u64>)> = vec![
        ("embed.weight".into(), vec![r0, c0]),
        ("layer0.weight".into(), vec![small.max(1)]),
        ("layer1.weight".into(), vec![4, (small / 4).max(1)]),
        ("layer1.bias".into(), vec![(small * 4).max(1)]),
        ("norm.scale".into(), vec![]),
        ("empty.weight".into(), vec![0, 8]),
    ];
    let spec_refs: Vec<(&str, &[u64])> = specs
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let mut model = Model::new(&spec_refs);
    let h = Hyper::new(Kind::Adam);
    let storage = Storage::F16Scaled;
    let mut opt = refopt::optimizer_for(&model, &h, 2);
    let n_elems: u64 = model.params.values().map(|(_, v)| v.len() as u64).sum();
    outln!(
        "ckpt demo: {} parameters, {n_elems} elements; Adam with FP16-scaled moments ({} of optimizer state)",
        specs.len(),
        human(n_elems * 4)
    );
    let t = Instant::now();
    for s in 1..=a.steps {
        refopt::step(&mut model, &mut opt, &h, storage, s);
    }
    outln!(
        "trained {} steps in {:.2} s",
        a.steps,
        t.elapsed().as_secs_f64()
    );

    let mut checks = Checks { failed: 0 };
    // Save.
    let opts = SaveOptions {
        max_shard_size: (a.size / 3).max(1 << 20),
        metadata: serde_json::json!({"demo": true, "step": a.steps}),
        progress: None,
        ..Default::default()
    };
    let t = Instant::now();
    let info = opt.save(&dir, &refopt::model_refs(&model), &opts)?;
    let save_s = t.elapsed().as_secs_f64();
    let bytes = info.data_bytes;
    outln!(
        "saved {} in {} shards to {} ({} tensors)",
        human(bytes),
        info.shards,
        dir.display(),
        info.tensors
    );

    let before = file_hashes(&dir);
    let t = Instant::now();
    let ck = Checkpoint::open(&dir)?;
    let open_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let rep = ck.verify()?;
    let verify_s = t.elapsed().as_secs_f64();
    checks.check(
        "verify: every tensor's CRC32 matches",
        rep.checksummed && rep.tensors == info.tensors,
        format!("{rep:?}"),
    );

    // Restore twice into fresh optimizers.
    let layout = StateLayout::default()
        .state("exp_avg", Target::F16Scaled(ScaleShape::Keep))
        .state("exp_avg_sq", Target::F16Scaled(ScaleShape::Keep));
    let mut loads = Vec::new();
    let mut load_s = f64::MAX;
    for _ in 0..2 {
        let mut fresh = refopt::optimizer_for(&model, &h, 2);
        let t = Instant::now();
        fresh.restore_from(&ck, &layout)?;
        load_s = load_s.min(t.elapsed().as_secs_f64());
        loads.push(fresh);
    }
    let state_bytes: u64 = ck
        .manifest()
        .and_then(|m| m.optimizer.as_ref())
        .map(|o| {
            o.params
                .iter()
                .flat_map(|p| &p.state)
                .map(|s| ck.info(&s.tensor).map(|t| t.nbytes()).unwrap_or(0))
                .sum()
        })
        .unwrap_or(0);
    let r1 = refopt::state_bit_eq(&loads[0], &loads[1]);
    checks.check(
        "two restores are bit-identical",
        r1.is_ok(),
        format!("{r1:?}"),
    );
    let r2 = refopt::state_bit_eq(&loads[0], &opt);
    checks.check(
        "restored state is bit-identical to the live state",
        r2.is_ok(),
        format!("{r2:?}"),
    );
    let restored_model = refopt::model_from(&ck, &model);
    checks.check(
        "restored parameters are bit-identical",
        restored_model == model,
        String::new(),
    );

    // Resume: three more steps both ways.
    let (mut m1, mut o1) = (model.clone(), opt);
    let (mut m2, mut o2) = (restored_model, loads.swap_remove(0));
    for s in a.steps + 1..=a.steps + 3 {
        refopt::step(&mut m1, &mut o1, &h, storage, s);
        refopt::step(&mut m2, &mut o2, &h, storage, s);
    }
    let r3 = refopt::state_bit_eq(&o1, &o2);
    checks.check(
        "three resumed steps match uninterrupted training bit for bit (parameters and state)",
        m1 == m2 && r3.is_ok(),
        format!("{r3:?}"),
    );
    drop(ck);
    let after = file_hashes(&dir);
    checks.check(
        "checkpoint files byte-identical before and after both loads",
        before == after,
        String::new(),
    );

    // memcpy baseline over the same number of bytes as the state load.
    let src = vec![1u8; state_bytes.max(1) as usize];
    let mut dst = vec![0u8; src.len()];
    let t = Instant::now();
    ckptstore::convert::copy_bytes(&src, &mut dst);
    let memcpy_s = t.elapsed().as_secs_f64();
    let mc = gibps(state_bytes, memcpy_s);

    outln!("\nthroughput (this machine, this run):");
    outln!(
        "  save     {:>7.2} GiB/s  ({} incl. fsync)",
        gibps(bytes, save_s),
        human(bytes)
    );
    outln!(
        "  open     {:>7.2} ms     ({} tensors, no data read)",
        open_s * 1e3,
        info.tensors
    );
    outln!("  verify   {:>7.2} GiB/s", gibps(bytes, verify_s));
    outln!(
        "  load     {:>7.2} GiB/s  (optimizer state into fresh FP16-scaled buffers, CRC checked; {:.2}x memcpy)",
        gibps(state_bytes, load_s),
        gibps(state_bytes, load_s) / mc
    );
    outln!(
        "  memcpy   {:>7.2} GiB/s  (parallel, fresh destination)",
        mc
    );
    if a.dir.is_none() {
        outln!("(checkpoint in a temporary directory, removed; use --dir to keep it)");
    }
    if checks.failed > 0 {
        outln!("\n{} check(s) FAILED", checks.failed);
        return Ok(ExitCode::from(1));
    }
    outln!("\nall checks passed");
    Ok(ExitCode::SUCCESS)
}
