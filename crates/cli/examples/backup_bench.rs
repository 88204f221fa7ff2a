//! Backup and restore throughput of the backup engine (`make bench`, or
//! `cargo run --release -p nestplane-cli --example backup_bench`). A scratch etcd on loopback
//! (as the management plane's: no fsync) holds one tenant's prefix with N keys (default
//! 10,000, `BACKUP_BENCH_KEYS`) of Kubernetes-like JSON objects of about 1.5 KiB, beside a
//! neighbour's. Then R times (default 3, `BACKUP_BENCH_RUNS`) it exports the prefix at one
//! revision, seals it into an archive, opens it again, and restores it under a new prefix, and
//! prints the median of each:
//!
//! - `export_keys_per_s`, `export_mib_per_s`: the paginated read at one revision, leases too;
//! - `seal_mib_per_s`, `open_mib_per_s`: gzip + ChaCha20-Poly1305 and back, with every check;
//! - `restore_keys_per_s`, `restore_mib_per_s`: writes in bounded transactions and the digest
//!   read back;
//! - `archive_bytes` and `archive_ratio` (archive / keys and values).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use nestplane_localplane::scratch::ScratchEtcd;
use nestplane_operator::backup::archive::Limits;
use nestplane_operator::backup::{archive, engine};

fn var(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A ConfigMap as JSON, about 1.5 KiB, different in each object: its data values are
/// pseudo-random text (so the archive's compression is not flattered by repetition; real
/// objects hold tokens, certificates and hashes too).
fn object(i: usize) -> String {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut text = |n: usize| -> String {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from(b"abcdefghijklmnopqrstuvwxyz0123456789-_. "[(x % 40) as usize])
            })
            .collect()
    };
    let data: String = (0..12)
        .map(|j| format!("\"key-{j}\":\"{}\",", text(70 + (i * 7 + j) % 40)))
        .collect();
    format!(
        "{{\"kind\":\"ConfigMap\",\"apiVersion\":\"v1\",\"metadata\":{{\"name\":\"cm-{i}\",\"namespace\":\"ns-{}\",\"uid\":\"{}\",\"resourceVersion\":\"{}\",\"creationTimestamp\":\"2026-11-28T01:00:00Z\",\"labels\":{{\"app\":\"bench\",\"shard\":\"{}\"}}}},\"data\":{{{}\"end\":\"{i}\"}}}}",
        i % 20,
        text(36),
        1000 + i,
        i % 16,
        data
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let keys = var("BACKUP_BENCH_KEYS", 10_000);
    let runs = var("BACKUP_BENCH_RUNS", 3).max(1);
    let (_etcd, mut c) = ScratchEtcd::start().await.unwrap_or_else(|e| panic!("{e}"));
    let prefix = "/nestplane/bench/tenant/";
    let mut bytes = 0usize;
    for chunk in (0..keys).collect::<Vec<_>>().chunks(64) {
        let ops: Vec<etcd_client::TxnOp> = chunk
            .iter()
            .map(|&i| {
                let key = format!("{prefix}configmaps/ns-{}/cm-{i}", i % 20);
                let value = object(i);
                bytes += key.len() - prefix.len() + value.len();
                etcd_client::TxnOp::put(key, value, None)
            })
            .collect();
        c.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    }
    for i in 0..1000 {
        c.put(format!("/nestplane/bench/neighbour/k/{i}"), object(i), None)
            .await
            .unwrap();
    }
    let mib = bytes as f64 / (1024.0 * 1024.0);
    let key = [3u8; archive::KEY_LEN];
    let (mut export, mut seal, mut open, mut restore) = (vec![], vec![], vec![], vec![]);
    let mut archive_bytes = 0;
    for run in 0..runs {
        let t = Instant::now();
        let snap = engine::export(&mut c, prefix, engine::PAGE, &Limits::default())
            .await
            .unwrap();
        export.push(t.elapsed().as_secs_f64());
        assert_eq!(snap.records.len(), keys);

        let t = Instant::now();
        let header = archive::header_for(
            "bench/tenant",
            "v1.20.2",
            snap.revision,
            "now",
            &snap.records,
        );
        let sealed = archive::encode(&header, &snap.records, &key).unwrap();
        seal.push(t.elapsed().as_secs_f64());
        archive_bytes = sealed.len();

        let t = Instant::now();
        let (_, records) = archive::decode(&sealed, &key, &Limits::default()).unwrap();
        open.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let into = format!("/nestplane/bench/restored-{run}/");
        let done = engine::restore(&mut c, &into, &records, &Limits::default())
            .await
            .unwrap();
        restore.push(t.elapsed().as_secs_f64());
        assert_eq!(done.written as usize, keys);
    }
    let (e, s, o, r) = (median(export), median(seal), median(open), median(restore));
    println!("keys={keys} key_and_value_mib={mib:.1} runs={runs}");
    println!(
        "export_seconds={e:.2} export_keys_per_s={:.0} export_mib_per_s={:.1}",
        keys as f64 / e,
        mib / e
    );
    println!("seal_seconds={s:.2} seal_mib_per_s={:.1}", mib / s);
    println!("open_seconds={o:.2} open_mib_per_s={:.1}", mib / o);
    println!(
        "restore_seconds={r:.2} restore_keys_per_s={:.0} restore_mib_per_s={:.1}",
        keys as f64 / r,
        mib / r
    );
    println!(
        "archive_bytes={archive_bytes} archive_ratio={:.2}",
        archive_bytes as f64 / bytes as f64
    );
}
