//! `ckpt ls` and `ckpt gc`: the steps under a checkpoint-manager root.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::Result;
use serde_json::json;

use crate::util::human;

#[derive(clap::Args)]
pub struct LsArgs {
    /// Manager root (holding step-NNNNNNNN/ directories).
    root: PathBuf,
    /// Print one JSON object: {root, latest, steps:[{step, path, committed, bytes}]}.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct GcArgs {
    /// Manager root (holding step-NNNNNNNN/ directories).
    root: PathBuf,
    /// Keep the newest N committed steps.
    #[arg(long)]
    keep: usize,
    /// Also keep every step that is a multiple of M.
    #[arg(long)]
    every: Option<u64>,
    /// Print one JSON object: `{deleted:[steps], in_use:[steps], interrupted_removed}`.
    #[arg(long)]
    json: bool,
}

fn manager(root: &PathBuf, retention: Retention) -> Result<CheckpointManager> {
    if !root.is_dir() {
        return Err(ckptstore::Error::NotFound {
            path: root.clone(),
            reason: "not a directory; give the root that holds step-NNNNNNNN/ directories".into(),
        });
    }
    CheckpointManager::new(root, retention)
}

pub fn ls(a: LsArgs) -> Result<ExitCode> {
    let mgr = manager(&a.root, Retention::default())?;
    let entries = mgr.list()?;
    let latest = mgr.latest()?;
    if a.json {
        let steps: Vec<_> = entries
            .iter()
            .map(|e| json!({"step": e.step, "path": e.path, "committed": e.committed, "bytes": e.bytes}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"root": a.root, "latest": latest, "steps": steps})
            )
            .unwrap_or_default()
        );
        return Ok(ExitCode::SUCCESS);
    }
    if entries.is_empty() {
        println!("no steps under {}", a.root.display());
    }
    for e in &entries {
        let mark = if Some(e.step) == latest && e.committed {
            "  <- latest"
        } else {
            ""
        };
        let state = if e.committed {
            "committed"
        } else {
            "UNCOMMITTED (interrupted save; gc removes it)"
        };
        println!(
            "{:>10}  {:>12}  {state}  {}{mark}",
            e.step,
            human(e.bytes),
            e.path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn gc(a: GcArgs) -> Result<ExitCode> {
    if a.keep == 0 {
        return Err(ckptstore::Error::InvalidArgument(
            "--keep must be at least 1".into(),
        ));
    }
    let mgr = manager(
        &a.root,
        Retention {
            keep_last: a.keep,
            keep_every: a.every,
        },
    )?;
    let r = mgr.gc()?;
    if a.json {
        println!(
            "{}",
            json!({"deleted": r.deleted, "in_use": r.in_use, "interrupted_removed": r.interrupted_removed})
        );
    } else {
        println!(
            "deleted steps {:?}; kept {:?} (held open by a reader); removed {} interrupted save(s)",
            r.deleted, r.in_use, r.interrupted_removed
        );
    }
    Ok(ExitCode::SUCCESS)
}
