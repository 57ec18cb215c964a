//! `ckpt diff`.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::Result;

use crate::util::Ckpt;

#[derive(clap::Args)]
pub struct Args {
    /// First checkpoint (path or s3:// URL).
    a: PathBuf,
    /// Second checkpoint (path or s3:// URL).
    b: PathBuf,
    /// Print one JSON object: {same, difference}.
    #[arg(long)]
    json: bool,
}

/// The first difference between two checkpoints, in name order, or `None`.
fn first_difference(a: &Ckpt, b: &Ckpt) -> Option<String> {
    let mut an: Vec<&str> = a.tensors().iter().map(|t| t.name.as_str()).collect();
    let mut bn: Vec<&str> = b.tensors().iter().map(|t| t.name.as_str()).collect();
    an.sort_unstable();
    bn.sort_unstable();
    for n in &an {
        if bn.binary_search(n).is_err() {
            return Some(format!("tensor {n:?} is only in A"));
        }
    }
    for n in &bn {
        if an.binary_search(n).is_err() {
            return Some(format!("tensor {n:?} is only in B"));
        }
    }
    for n in an {
        let (Ok(x), Ok(y)) = (a.read(n).view_unchecked(), b.read(n).view_unchecked()) else {
            continue;
        };
        if x.dtype() != y.dtype() {
            return Some(format!(
                "tensor {n:?}: dtype {} vs {}",
                x.dtype(),
                y.dtype()
            ));
        }
        if x.shape() != y.shape() {
            return Some(format!(
                "tensor {n:?}: shape {:?} vs {:?}",
                x.shape(),
                y.shape()
            ));
        }
        if x.bytes() != y.bytes() {
            let at = x
                .bytes()
                .iter()
                .zip(y.bytes())
                .position(|(p, q)| p != q)
                .unwrap_or(0);
            return Some(format!(
                "tensor {n:?}: bytes differ, first at byte {at} (element {})",
                at / x.dtype().size()
            ));
        }
    }
    None
}

pub fn run(a: Args) -> Result<ExitCode> {
    let ca = crate::util::open(&a.a)?;
    let cb = crate::util::open(&a.b)?;
    let d = first_difference(&ca, &cb);
    if a.json {
        outln!(
            "{}",
            serde_json::json!({"same": d.is_none(), "difference": d})
        );
    } else {
        match &d {
            None => outln!(
                "same: {} tensors, identical names, dtypes, shapes and bytes",
                ca.tensors().len()
            ),
            Some(s) => outln!("differ: {s}"),
        }
    }
    Ok(if d.is_none() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
