//! `ckpt verify`.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::Result;

use crate::util::{callback, human, progress};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory, .safetensors file, HF sharded directory, or s3://bucket/prefix.
    path: PathBuf,
    /// Print one JSON object: {path, ok, checksummed, tensors, bytes, error}.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let res = crate::util::open(&a.path).and_then(|ck| {
        let pb = progress(ck.data_bytes(), "verify");
        let cb = callback(&pb);
        let r = ck.verify_opts(&ckptstore::checkpoint::VerifyOptions::default().progress(&*cb));
        pb.finish_and_clear();
        r
    });
    if a.json {
        let v = match &res {
            Ok(r) => serde_json::json!({"path": a.path, "ok": true, "checksummed": r.checksummed,
                                        "tensors": r.tensors, "bytes": r.bytes, "error": null}),
            Err(e) => serde_json::json!({"path": a.path, "ok": false, "error": e.to_string()}),
        };
        outln!("{v}");
        return Ok(if res.is_ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    let r = res?;
    if r.checksummed {
        outln!(
            "ok: {} tensors, {} checked against their CRC32",
            r.tensors,
            human(r.bytes)
        );
    } else {
        outln!("ok: structure valid; this store has no checksums to check (plain safetensors / Hugging Face)");
    }
    Ok(ExitCode::SUCCESS)
}
