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
