//! Helpers shared by the commands.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Parse a size such as `4096`, `64KiB`, `512MiB`, `2GiB`, `1.5GB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 4096, 512MiB, 2GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?} (use B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    let v = n * mult as f64;
    if !(v.is_finite() && v >= 1.0 && v < u64::MAX as f64) {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(v as u64)
}

/// A byte progress bar on stderr when stderr is a terminal, else hidden.
pub fn progress(total: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

/// A callback advancing `pb`, for the library's progress hooks.
pub fn callback(pb: &ProgressBar) -> Arc<dyn Fn(u64) + Send + Sync> {
    let pb = pb.clone();
    Arc::new(move |n| pb.inc(n))
}

/// Format bytes for humans.
pub fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

/// GiB/s of `bytes` in `secs`.
pub fn gibps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / secs.max(1e-9)
}

/// `dir` if given, else a fresh temporary directory (kept alive by the returned guard).
pub fn dir_or_temp(
    dir: &Option<std::path::PathBuf>,
) -> ckptstore::Result<(std::path::PathBuf, Option<tempfile::TempDir>)> {
    match dir {
        Some(d) => Ok((d.clone(), None)),
        None => {
            let t = tempfile::tempdir().map_err(|e| ckptstore::Error::Io {
                op: "create temp dir",
                path: std::env::temp_dir(),
                source: e,
            })?;
            Ok((t.path().to_path_buf(), Some(t)))
        }
    }
}

/// A checkpoint open from a path or URL (`s3://bucket/prefix`): a URL is never a path.
pub type Ckpt = ckptstore::Checkpoint<ckptstore::Storage>;

/// Parse a PATH argument as a location ([`ckptstore::store::Location::parse`]).
pub fn location(p: &std::path::Path) -> ckptstore::Result<ckptstore::store::Location> {
    ckptstore::store::Location::from_path(p)
}

/// Open a checkpoint at a path or URL.
pub fn open(p: &std::path::Path) -> ckptstore::Result<Ckpt> {
    ckptstore::open(&location(p)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5KiB"), Ok(1536));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
    }
}
