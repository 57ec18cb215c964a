//! The `ckpt` binary: exit codes and messages on good and damaged input.

use std::path::Path;
use std::process::{Command, Output};

use ckptstore::{save, SaveOptions, TensorRef};

fn ckpt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn write_sample(dir: &Path, scale: f32) {
    let a: Vec<f32> = (0..300).map(|i| i as f32 * scale).collect();
    let b: Vec<i32> = (0..50).collect();
    save(
        dir,
        &[
            TensorRef::from_slice("layer.a", &[3, 100], &a),
            TensorRef::from_slice("layer.b", &[50], &b),
        ],
        &SaveOptions {
            max_shard_size: 1000,
            metadata: serde_json::json!({"step": 7}),
            ..Default::default()
        },
    )
    .unwrap();
}

#[test]
fn inspect_verify_diff_pack_on_good_input() {
    let root = tempfile::tempdir().unwrap();
    let a = root.path().join("a");
    write_sample(&a, 1.0);
    let a_s = a.to_str().unwrap();

    let o = ckpt(&["inspect", a_s]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("layer.a")
            && t.contains("F32")
            && t.contains("[3, 100]")
            && t.contains("2 tensors"),
        "{t}"
    );

    let o = ckpt(&["inspect", a_s, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kind"], "ckptstore");
    assert_eq!(v["total_tensors"], 2);
    assert_eq!(v["total_bytes"], 1400);
    assert_eq!(v["metadata"]["step"], 7);
    assert_eq!(v["tensors"][0]["name"], "layer.a");

    let o = ckpt(&["verify", a_s]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("ok: 2 tensors"));

    // pack a checkpoint into another directory; diff says they are the same.
    let b = root.path().join("b");
    let o = ckpt(&[
        "pack",
        a_s,
        "--out",
        b.to_str().unwrap(),
        "--max-shard-size",
        "1KiB",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = ckpt(&["diff", a_s, b.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));

    // A changed value is found and named.
    let c = root.path().join("c");
    write_sample(&c, 2.0);
    let o = ckpt(&["diff", a_s, c.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("layer.a") && text(&o).contains("element 1"),
        "{}",
        text(&o)
    );
}

#[test]
fn damaged_input_exits_one_naming_file_shard_and_tensor() {
    let root = tempfile::tempdir().unwrap();
    let a = root.path().join("a");
    write_sample(&a, 1.0);
    let ck = ckptstore::Checkpoint::open(&a).unwrap();
    let t = ck.info("layer.b").unwrap().clone();
    let file = ck.shards()[t.shard].file.clone();
    drop(ck);
    let p = a.join(&file);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[t.offsets[0] as usize + 3] ^= 0x10;
    std::fs::write(&p, &bytes).unwrap();
    let o = ckpt(&["verify", a.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let msg = text(&o);
    assert!(
        msg.contains("\"layer.b\"") && msg.contains(&file) && msg.contains("shard"),
        "{msg}"
    );
    assert!(!msg.contains("panicked"));
    // --json reports it too.
    let o = ckpt(&["verify", a.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ok"], false);
    // pack refuses to copy damaged bytes.
    let o = ckpt(&[
        "pack",
        a.to_str().unwrap(),
        "--out",
        root.path().join("o").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("checksum mismatch"), "{}", text(&o));
    // Truncated shard, missing path, garbage file.
    std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
    let o = ckpt(&["inspect", a.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains(&file), "{}", text(&o));
    let o = ckpt(&["verify", root.path().join("nope").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let g = root.path().join("garbage.safetensors");
    std::fs::write(&g, b"\xff\xff\xff\xff\xff\xff\xff\xffnot a header").unwrap();
    let o = ckpt(&["verify", g.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("garbage.safetensors") && !text(&o).contains("panicked"),
        "{}",
        text(&o)
    );
}

#[test]
fn usage_errors_exit_two() {
    assert_eq!(ckpt(&["verify"]).status.code(), Some(2));
    assert_eq!(ckpt(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(
        ckpt(&["pack", "x", "--out", "y", "--max-shard-size", "12XB"])
            .status
            .code(),
        Some(2)
    );
    let o = ckpt(&["--help"]);
    assert!(o.status.success());
    assert!(text(&o).contains("Example") || text(&o).contains("inspect"));
}

#[test]
fn demo_passes_its_checks() {
    let root = tempfile::tempdir().unwrap();
    let d = root.path().join("demo");
    let o = ckpt(&["demo", "--dir", d.to_str().unwrap(), "--size", "2MiB"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("all checks passed") && t.contains("GiB/s"),
        "{t}"
    );
    assert!(!t.contains("FAIL"));
    // The checkpoint it left verifies and holds an optimizer section.
    let ck = ckptstore::Checkpoint::open(&d).unwrap();
    ck.verify().unwrap();
    assert!(ck.manifest().unwrap().optimizer.is_some());
}

#[test]
fn ls_and_gc_on_a_manager_root() {
    use ckptstore::manager::{CheckpointManager, Retention};
    let root = tempfile::tempdir().unwrap();
    let mgr = CheckpointManager::new(root.path(), Retention::keep_last(10)).unwrap();
    let v = vec![1f32; 100];
    for step in [10, 20, 30] {
        mgr.save(
            step,
            &[TensorRef::from_slice("w", &[100], &v)],
            None,
            &SaveOptions::default(),
        )
        .unwrap();
    }
    std::fs::create_dir(root.path().join(".tmp-step-40-0011223344556677")).unwrap();
    let r = root.path().to_str().unwrap();
    let o = ckpt(&["ls", r, "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["latest"], 30);
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    assert_eq!(steps[3]["committed"], false);
    let o = ckpt(&["ls", r]);
    assert!(
        text(&o).contains("<- latest") && text(&o).contains("UNCOMMITTED"),
        "{}",
        text(&o)
    );
    let o = ckpt(&["gc", r, "--keep", "1", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["deleted"], serde_json::json!([10, 20]));
    assert_eq!(v["interrupted_removed"], 1);
    assert_eq!(mgr.steps().unwrap(), vec![30]);
    // Bad input: not a directory, --keep 0.
    assert_eq!(
        ckpt(&["ls", root.path().join("nope").to_str().unwrap()])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(ckpt(&["gc", r, "--keep", "0"]).status.code(), Some(1));
    assert_eq!(ckpt(&["gc", r]).status.code(), Some(2));
}

#[test]
fn convert_rewrites_state_and_weights_in_another_dtype() {
    use ckptstore::optim::{StateLayout, StateValue};
    let root = tempfile::tempdir().unwrap();
    let d = root.path().join("demo");
    assert!(
        ckpt(&["demo", "--dir", d.to_str().unwrap(), "--size", "1MiB"])
            .status
            .success()
    );
    let src = ckptstore::Checkpoint::open(&d).unwrap();
    let orig = src.load_optimizer(&StateLayout::default()).unwrap();
    for (dtype, want) in [
        ("f32", ckptstore::DType::F32),
        ("bf16", ckptstore::DType::BF16),
    ] {
        let out = root.path().join(dtype);
        let o = ckpt(&[
            "convert",
            d.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--dtype",
            dtype,
        ]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(ckpt(&["verify", out.to_str().unwrap()]).status.success());
        let ck = ckptstore::Checkpoint::open(&out).unwrap();
        assert_eq!(
            ck.read("embed.weight").view_unchecked().unwrap().dtype(),
            want
        );
        let st = ck.load_optimizer(&StateLayout::default()).unwrap();
        for (p, states) in &orig.state {
            let StateValue::Plain(t) = &st.state[p]["exp_avg"] else {
                panic!("{p}: still scaled")
            };
            assert_eq!(t.dtype(), want);
            if want == ckptstore::DType::F32 {
                assert_eq!(
                    st.state[p]["exp_avg"].to_f32().unwrap(),
                    states["exp_avg"].to_f32().unwrap()
                );
            }
            // step stays as stored.
            assert!(st.state[p]["step"].bit_eq(&states["step"]));
        }
    }
    // And back to f16-scaled from f32: the codes are the formula's.
    let f32dir = root.path().join("f32");
    let back = root.path().join("back");
    let o = ckpt(&[
        "convert",
        f32dir.to_str().unwrap(),
        "--out",
        back.to_str().unwrap(),
        "--dtype",
        "f16-scaled",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // The report says what was converted and why the rest was kept: model tensors stay
    // F32 (F16 scaling applies to optimizer state only), and so do step counters.
    // Each parameter has exp_avg, exp_avg_sq and step in the F32 copy.
    let n_state = orig.state.len();
    let n_model = ckptstore::Checkpoint::open(&f32dir)
        .unwrap()
        .tensors()
        .len()
        - 3 * n_state;
    let report = text(&o);
    assert!(
        report.contains(&format!("{} converted to f16-scaled", 2 * n_state)),
        "{report}"
    );
    assert!(
        report.contains(&format!(
            "{n_model} model tensors (f16-scaled applies to optimizer state only)"
        )),
        "{report}"
    );
    assert!(
        report.contains(&format!("{n_state} optimizer scalars and counters")),
        "{report}"
    );
    let st = ckptstore::Checkpoint::open(&back)
        .unwrap()
        .load_optimizer(&StateLayout::default())
        .unwrap();
    assert!(matches!(
        st.state["embed.weight"]["exp_avg"],
        StateValue::F16Scaled { .. }
    ));
    // Damaged source: exit 1, nothing written.
    let ck = ckptstore::Checkpoint::open(&d).unwrap();
    let t = ck.info("optim/embed.weight/exp_avg").unwrap().clone();
    let p = d.join(&ck.shards()[t.shard].file);
    drop(ck);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[t.offsets[0] as usize] ^= 1;
    std::fs::write(&p, &bytes).unwrap();
    let out = root.path().join("never");
    let o = ckpt(&[
        "convert",
        d.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--dtype",
        "f32",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("checksum mismatch"), "{}", text(&o));
    assert!(!out.join("ckpt-manifest.json").exists());
    assert_eq!(
        ckpt(&[
            "convert",
            d.to_str().unwrap(),
            "--out",
            "x",
            "--dtype",
            "f8"
        ])
        .status
        .code(),
        Some(2)
    );
}

/// Output into a closed pipe (`ckpt inspect X | head`) ends the process quietly with the
/// shell's SIGPIPE status, never a panic. The pipe's read end is closed before the process
/// starts, so every write meets it closed.
#[test]
fn a_closed_stdout_pipe_is_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let w = vec![1.0f32; 16];
    save(
        dir.path(),
        &[TensorRef::from_slice("w", &[4, 4], &w)],
        &SaveOptions::default(),
    )
    .unwrap();
    let d = dir.path().to_str().unwrap();
    for args in [
        &["inspect", d][..],
        &["inspect", d, "--json"],
        &["verify", d],
        &["ls", d],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(args)
            .stdout(writer)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(o.status.code(), Some(141), "{args:?}: {err}");
    }
}
