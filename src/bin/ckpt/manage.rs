//! `ckpt ls` and `ckpt gc`: the steps under a checkpoint-manager root.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::manager::{CheckpointManager, Retention};
use ckptstore::store::Location;
use ckptstore::Result;
use serde_json::json;

use crate::util::human;

#[derive(clap::Args)]
pub struct LsArgs {
    /// Manager root (holding step-NNNNNNNN/ directories), or s3://bucket/root.
    root: PathBuf,
    /// Print one JSON object: {root, latest, steps:[{step, path, committed, bytes}]}.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct GcArgs {
    /// Manager root (holding step-NNNNNNNN/ directories), or s3://bucket/root.
    root: PathBuf,
    /// Keep the newest N committed steps.
    #[arg(long)]
    keep: usize,
    /// Also keep every step that is a multiple of M.
    #[arg(long)]
    every: Option<u64>,
    /// Print one JSON object: `{deleted:[steps], in_use:[steps], interrupted_removed, swept}`.
    #[arg(long)]
    json: bool,
}

/// The manager of a local or remote root; a local root must exist (`ls` and `gc` never
/// create one).
fn manager(root: &std::path::Path, retention: Retention) -> Result<CheckpointManager> {
    let loc = crate::util::location(root)?;
    if let Location::Local(p) = &loc {
        if !p.is_dir() {
            return Err(ckptstore::Error::NotFound {
                path: p.clone(),
                reason: "not a directory; give the root that holds step-NNNNNNNN/ directories"
                    .into(),
            });
        }
    }
    CheckpointManager::new(loc, retention)
}

/// One step as `ls` prints it: (step, path or URL, committed, bytes).
type Row = (u64, String, bool, u64);

/// The steps under a local or remote root, and the latest committed one.
fn list_steps(root: &std::path::Path) -> Result<(Vec<Row>, Option<u64>)> {
    let steps = manager(root, Retention::default())?.list()?;
    let latest = steps.iter().filter(|s| s.committed).map(|s| s.step).max();
    let rows = steps
        .into_iter()
        .map(|s| (s.step, s.location.to_string(), s.committed, s.bytes))
        .collect();
    Ok((rows, latest))
}

pub fn ls(a: LsArgs) -> Result<ExitCode> {
    let (entries, latest) = list_steps(&a.root)?;
    if a.json {
        let steps: Vec<_> = entries
            .iter()
            .map(|(step, path, committed, bytes)| json!({"step": step, "path": path, "committed": committed, "bytes": bytes}))
            .collect();
        outln!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"root": a.root, "latest": latest, "steps": steps})
            )
            .unwrap_or_default()
        );
        return Ok(ExitCode::SUCCESS);
    }
    if entries.is_empty() {
        outln!("no steps under {}", a.root.display());
    }
    for (step, path, committed, bytes) in &entries {
        let mark = if Some(*step) == latest && *committed {
            "  <- latest"
        } else {
            ""
        };
        let state = if *committed {
            "committed"
        } else {
            "UNCOMMITTED (interrupted save; gc removes it)"
        };
        outln!("{step:>10}  {:>12}  {state}  {path}{mark}", human(*bytes));
    }
    Ok(ExitCode::SUCCESS)
}

pub fn gc(a: GcArgs) -> Result<ExitCode> {
    if a.keep == 0 {
        return Err(ckptstore::Error::InvalidArgument(
            "--keep must be at least 1".into(),
        ));
    }
    let retention = Retention {
        keep_last: a.keep,
        keep_every: a.every,
    };
    let r = manager(&a.root, retention)?.gc()?;
    if a.json {
        outln!(
            "{}",
            json!({"deleted": r.deleted, "in_use": r.in_use, "interrupted_removed": r.interrupted_removed, "swept": r.swept})
        );
    } else {
        outln!(
            "deleted steps {:?}; kept {:?} (held open by a reader); removed {} interrupted save(s); swept {} leftover file(s) from kept steps",
            r.deleted, r.in_use, r.interrupted_removed, r.swept
        );
    }
    Ok(ExitCode::SUCCESS)
}
