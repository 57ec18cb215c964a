//! Save and load of a checkpoint on an S3 server, each beside a raw `object_store` baseline
//! measured in the same run against the same server with the same part / range size and
//! concurrency:
//!
//! * save (`api::s3::save_with`: multipart upload, CRCs on the way, manifest PUT last)
//!   vs a raw multipart PUT of the same bytes (`WriteMultipart`);
//! * open (`api::s3::open_with`: manifest GET, parallel ranged GETs into fresh buffers,
//!   every CRC block summed as it lands, the open checks) and open + verify (the CRC-checked
//!   load: `verify` after the open, which reads nothing again when `crc_fused` is true) vs raw
//!   parallel ranged GETs of the same bytes (`get_range`, into the buffers `object_store`
//!   returns), timed round-robin; and, for context, beside the same GETs each copied into
//!   one fresh buffer of the object's size (`raw_get_fresh`: the copy and the page faults of
//!   fresh memory that any load into new memory pays).
//!
//! The server comes from the environment (`AWS_ENDPOINT_URL`, ...); scripts/s3-bench.sh
//! starts s3s-fs (and uses a Garage cluster where one runs) and calls this.
//!
//! ```sh
//! cargo run --release --example s3_bench -- s3://bench/run [SIZE_MIB] [REPS]
//! ```

use std::time::Instant;

use ckptstore::store::s3::{Remote, S3Config};
use ckptstore::store::Location;
use ckptstore::{SaveOptions, TensorRef};
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, WriteMultipart};

fn main() -> ckptstore::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = match Location::parse(args.get(1).map_or("s3://bench/run", |s| s.as_str()))? {
        Location::Remote(u) => u,
        Location::Local(p) => panic!("give an s3:// URL, not {}", p.display()),
    };
    let mib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let cfg = S3Config::try_from_env()?;
    let bytes = mib << 20;

    // 16 F32 tensors, deterministic data; one shard (the default 4 GiB shard size).
    let n = 16;
    let per = bytes / n / 4;
    let data: Vec<Vec<f32>> = (0..n)
        .map(|i| {
            (0..per)
                .map(|j| ((i * per + j) % 1009) as f32 * 0.5)
                .collect()
        })
        .collect();
    let names: Vec<String> = (0..n).map(|i| format!("layer{i}.w")).collect();
    let tensors: Vec<TensorRef<'_>> = data
        .iter()
        .zip(&names)
        .map(|(d, name)| TensorRef::from_slice(name.as_str(), &[per as u64], d))
        .collect();
    let total = (n * per * 4) as f64;
    let gib = |s: f64| total / s / f64::from(1u32 << 30);

    let r = Remote::new(&url, &cfg)?;
    let store = r.store().clone();
    let raw_key = ObjPath::from(url.key("raw-baseline.bin"));
    let flat: Vec<u8> = data
        .iter()
        .flat_map(|d| bytemuck::cast_slice::<f32, u8>(d).iter().copied())
        .collect();

    // Raw multipart PUT of the same bytes, same part size and concurrency, 8 MiB writes.
    let raw_put_once = || {
        r.block_on(async {
            let up = store.put_multipart(&raw_key).await.expect("create upload");
            let mut w = WriteMultipart::new_with_chunk_size(up, cfg.part_size);
            for c in flat.chunks(8 << 20) {
                w.wait_for_capacity(cfg.upload_concurrency)
                    .await
                    .expect("part");
                w.write(c);
            }
            w.finish().await.expect("complete");
        })
    };
    // Saves alternate with the raw PUTs (the order swapped from one round to the next), so
    // that drift on a shared machine touches both alike; the best round of each is reported.
    let (mut raw_put, mut save) = (f64::INFINITY, f64::INFINITY);
    for round in 0..reps {
        for k in 0..2 {
            let t0 = Instant::now();
            if (round + k) % 2 == 0 {
                raw_put_once();
                raw_put = raw_put.min(t0.elapsed().as_secs_f64());
            } else {
                Remote::new(&url, &cfg)
                    .and_then(|r| ckptstore::save(&r, &tensors, &SaveOptions::default()))?;
                save = save.min(t0.elapsed().as_secs_f64());
            }
        }
    }

    // Raw parallel ranged GETs of the same bytes, same range size and concurrency.
    let size = flat.len() as u64;
    let step = cfg.range_size as u64;
    let raw_get_once = || {
        r.block_on(async {
            let ranges: Vec<_> = (0..size.div_ceil(step))
                .map(|i| i * step..((i + 1) * step).min(size))
                .collect();
            futures::stream::iter(ranges)
                .map(|rg| {
                    let store = store.clone();
                    let key = raw_key.clone();
                    async move { store.get_range(&key, rg).await.expect("get").len() }
                })
                .buffer_unordered(cfg.download_concurrency)
                .fold(0usize, |a, n| async move { a + n })
                .await
        })
    };
    // A second, informative baseline: the same GETs, each body copied into its place in one
    // fresh buffer of the object's size (what any load into new memory pays on top of the
    // GETs: the copy and the page faults of fresh memory). The clock stops before the free.
    let raw_get_fresh_once = || {
        let mut buf = vec![0u8; flat.len()];
        r.block_on(async {
            let jobs = buf.chunks_mut(cfg.range_size).enumerate().map(|(i, dst)| {
                let store = store.clone();
                let key = raw_key.clone();
                let at = i as u64 * step;
                async move {
                    let b = store
                        .get_range(&key, at..at + dst.len() as u64)
                        .await
                        .expect("get");
                    dst.copy_from_slice(&b);
                }
            });
            futures::stream::iter(jobs)
                .buffer_unordered(cfg.download_concurrency)
                .collect::<Vec<()>>()
                .await;
        });
        buf
    };
    // Loads are timed round-robin (raw, raw into a fresh buffer, open, open + verify in each
    // round, the order rotated from one round to the next), so that drift on a shared
    // machine and the order touch all alike; the best round of each is reported.
    let mut t = [f64::INFINITY; 4];
    let mut fused = true;
    for round in 0..reps {
        for k in 0..4 {
            let which = (round + k) % 4;
            let t0 = Instant::now();
            match which {
                0 => assert_eq!(raw_get_once() as u64, size),
                3 => {
                    let buf = raw_get_fresh_once();
                    t[3] = t[3].min(t0.elapsed().as_secs_f64());
                    assert!(buf == flat);
                    continue;
                }
                1 => {
                    let ck = Remote::new(&url, &cfg)
                        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
                        .expect("open");
                    t[1] = t[1].min(t0.elapsed().as_secs_f64());
                    assert_eq!(ck.data_bytes(), size);
                    fused &= ck.data_verified();
                    continue;
                }
                _ => {
                    let ck = Remote::new(&url, &cfg)
                        .and_then(|r| ckptstore::checkpoint::remote::open(&r))
                        .expect("open");
                    ck.verify().expect("verify");
                    // Stop the clock before the buffers are freed, as for the open.
                    t[2] = t[2].min(t0.elapsed().as_secs_f64());
                    continue;
                }
            }
            t[which] = t[which].min(t0.elapsed().as_secs_f64());
        }
    }
    let [raw_get, open, open_verify, raw_fresh] = t;
    let _ = r.delete("raw-baseline.bin");

    println!(
        "{{\"url\": \"{url}\", \"bytes\": {size}, \"reps\": {reps}, \
         \"raw_multipart_put_gibps\": {:.3}, \"save_gibps\": {:.3}, \"save_ratio\": {:.3}, \
         \"raw_ranged_get_gibps\": {:.3}, \"open_gibps\": {:.3}, \"open_ratio\": {:.3}, \
         \"open_verify_gibps\": {:.3}, \"open_verify_ratio\": {:.3}, \"crc_fused\": {fused}, \
         \"raw_get_fresh_gibps\": {:.3}, \"open_verify_vs_raw_fresh_ratio\": {:.3}}}",
        gib(raw_put),
        gib(save),
        raw_put / save,
        gib(raw_get),
        gib(open),
        raw_get / open,
        gib(open_verify),
        raw_get / open_verify,
        gib(raw_fresh),
        raw_fresh / open_verify,
    );
    Ok(())
}
