//! `ckpt`: inspect, verify, pack, diff and demo ckptstore checkpoints.
#![deny(unsafe_code)]

/// `println!` that never panics: a closed pipe (`ckpt inspect X | head`) ends the process
/// quietly with the shell's SIGPIPE status (141), other write errors with status 1.
macro_rules! outln {
    () => { $crate::write_stdout(format_args!("\n")) };
    ($($t:tt)*) => { $crate::write_stdout(format_args!("{}\n", format_args!($($t)*))) };
}

mod bench;
mod consolidate;
mod convert;
mod demo;
mod diff;
mod inspect;
mod manage;
mod pack;
mod part_layout;
mod util;
mod verify;
mod write_part;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Inspect, verify and write ckptstore checkpoints.
///
/// PATH arguments may be a ckptstore checkpoint directory, a single .safetensors file, or a
/// Hugging Face sharded directory (model.safetensors.index.json).
///
/// Exit status: 0 success, 1 a check failed or the input is damaged, 2 usage error.
#[derive(Parser)]
#[command(name = "ckpt", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List tensors (dtype, shape, bytes, shard), totals and metadata.
    ///
    /// Example: ckpt inspect runs/step-1000 --json
    Inspect(inspect::Args),
    /// Check structure and every tensor's CRC32; exit 1 naming the file, shard and tensor
    /// of the first problem.
    ///
    /// Example: ckpt verify runs/step-1000
    Verify(verify::Args),
    /// Write safetensors files or HF sharded directories as one committed ckptstore
    /// checkpoint (atomically replacing one in --out).
    ///
    /// Example: ckpt pack model-00001-of-00002.safetensors model-00002-of-00002.safetensors --out ckpt/ --max-shard-size 2GiB
    Pack(pack::Args),
    /// Compare two checkpoints: names, dtypes, shapes and bytes. Exit 1 at the first
    /// difference.
    ///
    /// Example: ckpt diff runs/step-1000 runs/step-2000
    Diff(diff::Args),
    /// The end-to-end demo on built-in synthetic data: train, save, restore twice, check
    /// bit-exact resume and an unchanged source, and print throughputs.
    ///
    /// Example: ckpt demo --size 256MiB
    Demo(demo::Args),
    /// List the steps under a checkpoint-manager root: committed or not, sizes, latest.
    ///
    /// Example: ckpt ls runs/ --json
    Ls(manage::LsArgs),
    /// Apply retention by hand under a manager root: keep the newest N committed steps
    /// (and every M-th); never deletes a step a reader holds open or files it did not create.
    ///
    /// Example: ckpt gc runs/ --keep 3 --every 1000
    Gc(manage::GcArgs),
    /// Rewrite a checkpoint (tensors and optimizer state) in another storage dtype, with the
    /// same atomic, checksummed guarantees.
    ///
    /// Example: ckpt convert runs/step-00001000 --out bf16/ --dtype bf16
    Convert(convert::Args),
    /// Assemble every global tensor of a (multi-rank) checkpoint whole and write a plain
    /// checkpoint plus a Hugging Face model.safetensors.index.json of the model tensors.
    ///
    /// Example: ckpt consolidate runs/step-1000 --out hf/ --max-shard-size 2GiB
    Consolidate(consolidate::Args),
    /// Measure save, open, verify and load (F16-scaled, BF16, F32) on a synthetic FP32
    /// checkpoint, each beside a baseline measured in the same run (raw write+fsync,
    /// crc32fast, the plain conversion kernels, memcpy).
    ///
    /// Example: ckpt bench --size 1GiB --tensors 64 --json
    Bench(bench::Args),
    /// Test-only: write one rank's part of a synthetic multi-rank checkpoint.
    #[command(name = "_write-part", hide = true)]
    WritePart(write_part::Args),
}

/// Write to stdout; see [`outln!`].
pub(crate) fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("error: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Inspect(a) => inspect::run(a),
        Cmd::Verify(a) => verify::run(a),
        Cmd::Pack(a) => pack::run(a),
        Cmd::Diff(a) => diff::run(a),
        Cmd::Demo(a) => demo::run(a),
        Cmd::Ls(a) => manage::ls(a),
        Cmd::Gc(a) => manage::gc(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Consolidate(a) => consolidate::run(a),
        Cmd::WritePart(a) => write_part::run(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            // Display already includes the OS error for I/O failures.
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
