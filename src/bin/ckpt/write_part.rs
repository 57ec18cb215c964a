//! `ckpt _write-part` (hidden, for tests): write rank RANK's part of the synthetic layout
//! of `part_layout` into DIR (a directory or an `s3://` URL), as one process of a
//! multi-rank save.

use std::path::PathBuf;
use std::process::ExitCode;

use ckptstore::store::Location;
use ckptstore::write::parts::PartItem;
use ckptstore::write_part;
use ckptstore::{Result, SaveOptions, TensorRef};

use crate::part_layout::{box_bytes, global_bytes, globals, rank_chunks, STEP};

#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory or `s3://` URL.
    dir: PathBuf,
    /// The checkpoint id (32 lowercase hex digits).
    #[arg(long)]
    id: String,
    /// This process's rank.
    #[arg(long)]
    rank: u32,
    /// The number of ranks.
    #[arg(long)]
    world: u32,
}

/// A chunk of the layout: global index, offsets, shape, bytes.
type Chunk = (usize, Vec<u64>, Vec<u64>, Vec<u8>);

pub fn run(a: Args) -> Result<ExitCode> {
    if a.world == 0 || a.world > 1024 || a.rank >= a.world {
        return Err(ckptstore::Error::InvalidArgument(format!(
            "rank {} of world {}: the layout needs 0 <= rank < world <= 1024",
            a.rank, a.world
        )));
    }
    let gs = globals(a.world);
    let datas: Vec<Chunk> = rank_chunks(a.world, a.rank)
        .into_iter()
        .map(|(g, o, s)| {
            let spec = &gs[g];
            let bytes = box_bytes(&global_bytes(spec), spec.dtype.size(), &spec.shape, &o, &s);
            (g, o, s, bytes)
        })
        .collect();
    let step = [STEP];
    let mut items: Vec<PartItem<'_>> = datas
        .iter()
        .map(|(g, o, s, bytes)| PartItem::Chunk {
            tensor: TensorRef::new(gs[*g].name, gs[*g].dtype, s, bytes),
            global_shape: gs[*g].shape.clone(),
            offsets: o.clone(),
        })
        .collect();
    if a.rank == 0 {
        items.push(PartItem::Whole(TensorRef::from_slice("step", &[], &step)));
    }
    let loc = Location::from_path(&a.dir)?;
    write_part(&loc, &a.id, a.rank, &items, &SaveOptions::default())?;
    Ok(ExitCode::SUCCESS)
}
