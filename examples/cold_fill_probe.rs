//! One-pass restore probe (issue 24): `fill_and_verify` of every tensor of a checkpoint into
//! fresh memory (and, as a control, into destinations faulted in before the clock), its page
//! cache evicted before each run (`CKPT_PROBE_HOT=1`: kept), under each read strategy, beside
//! a raw `pread` of the same files (8 MiB reused buffer); the order rotated each repetition,
//! medians and each repetition's time printed (`CKPT_PROBE_WAYS=raw,faults`: only those).
//! `cargo run --release --example cold_fill_probe -- DIR [REPS]`.
use std::io::Read;
use std::time::Instant;

use ckptstore::checkpoint::{drop_page_cache, set_read_strategy, ReadStrategy};

fn files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

fn main() -> ckptstore::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().expect("DIR"));
    let reps: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    // CKPT_PROBE_HOT=1: keep the page cache (hot fills, for profiles).
    let hot = std::env::var_os("CKPT_PROBE_HOT").is_some();
    let evict = || -> ckptstore::Result<()> {
        if !hot {
            for f in files(&dir) {
                drop_page_cache(&f)?;
            }
        }
        Ok(())
    };
    // (name, read strategy (None: a raw pread of the files), destinations faulted in
    // before the clock starts).
    let ways: [(&str, Option<ReadStrategy>, bool); 4] = [
        ("raw", None, false),
        ("faults", Some(ReadStrategy::Faults), false),
        ("willneed", Some(ReadStrategy::WillNeed), false),
        ("faults_prefaulted_dst", Some(ReadStrategy::Faults), true),
    ];
    // CKPT_PROBE_WAYS=raw,faults,...: only those ways (default: all).
    let only = std::env::var("CKPT_PROBE_WAYS").ok();
    let ways: Vec<_> = ways
        .into_iter()
        .filter(|w| only.as_ref().is_none_or(|o| o.split(',').any(|n| n == w.0)))
        .collect();
    let mut res: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
    for rep in 0..reps {
        for k in 0..ways.len() {
            let w = (rep + k) % ways.len();
            evict()?;
            let t = match ways[w].1 {
                None => {
                    let t = Instant::now();
                    let mut buf = vec![0u8; 8 << 20];
                    for f in files(&dir) {
                        let mut f = std::fs::File::open(f).unwrap();
                        while f.read(&mut buf).unwrap() > 0 {}
                    }
                    t.elapsed()
                }
                Some(s) => {
                    set_read_strategy(s);
                    let ck = ckptstore::Checkpoint::open(&dir)?;
                    let mut bufs: Vec<Vec<u8>> = ck
                        .tensors()
                        .iter()
                        .map(|t| vec![0u8; t.nbytes() as usize])
                        .collect();
                    if ways[w].2 {
                        for b in &mut bufs {
                            for i in (0..b.len()).step_by(4096) {
                                b[i] = 1;
                            }
                        }
                    }
                    let names: Vec<String> = ck.tensors().iter().map(|t| t.name.clone()).collect();
                    let fills: Vec<(&str, &mut [u8])> = names
                        .iter()
                        .map(String::as_str)
                        .zip(bufs.iter_mut().map(Vec::as_mut_slice))
                        .collect();
                    let t = Instant::now();
                    ck.read_batch().fill(fills).release_pages(true).run()?;
                    t.elapsed()
                }
            };
            res[w].push(t.as_secs_f64());
        }
    }
    // Per way: the median, and each repetition's time in repetition order (the ways of one
    // repetition ran back to back, so ratios between them pair like with like).
    for (w, r) in ways.iter().zip(&res) {
        let mut sorted = r.clone();
        sorted.sort_by(f64::total_cmp);
        let by_rep: Vec<String> = r.iter().map(|x| format!("{x:.3}")).collect();
        println!(
            "{:<22} median {:.3} s  by repetition [{}]",
            w.0,
            sorted[sorted.len() / 2],
            by_rep.join(", ")
        );
    }
    Ok(())
}
