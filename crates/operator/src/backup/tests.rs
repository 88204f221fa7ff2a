//! The engine against a real etcd: two tenants' prefixes side by side, as on a shared
//! datastore.
#![allow(clippy::unwrap_used)]

use etcd_client::{Client, PutOptions};
use nestplane_localplane::scratch::ScratchEtcd;

use super::archive::{self, Lease, Limits, Record};
use super::engine::{self, EngineError};

async fn etcd() -> (ScratchEtcd, Client) {
    ScratchEtcd::start().await.unwrap_or_else(|e| panic!("{e}"))
}

const A: &str = "/nestplane/ns/a/";
/// Sorts right after A's keys and shares its first bytes: a prefix read that ran past the
/// tenant's would take it.
const NEIGHBOUR: &str = "/nestplane/ns/ab/";
const B: &str = "/nestplane/ns/b/";

async fn put(c: &mut Client, prefix: &str, key: &str, value: &str) {
    c.put(format!("{prefix}{key}"), value, None).await.unwrap();
}

async fn fill(c: &mut Client) {
    for i in 0..500 {
        let kind = if i % 2 == 0 { "configmaps" } else { "secrets" };
        put(
            c,
            A,
            &format!("{kind}/default/obj-{i:03}"),
            &format!("value {i}"),
        )
        .await;
    }
    let lease = c.lease_grant(600, None).await.unwrap().id();
    for i in 0..3 {
        c.put(
            format!("{A}events/default/ev-{i}"),
            format!("event {i}"),
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    }
    for i in 0..50 {
        put(c, B, &format!("configmaps/default/b-{i}"), "b").await;
        put(c, NEIGHBOUR, &format!("configmaps/default/n-{i}"), "n").await;
    }
}

/// Back up A through an archive, change A (modify, delete, add), restore: A holds exactly
/// the backup's keys and values again, its leased keys have a lease again, and B and the
/// neighbouring prefix are as they were.
#[tokio::test]
async fn a_restore_gives_back_exactly_the_backup_and_touches_no_other_prefix() {
    let (_etcd, mut c) = etcd().await;
    fill(&mut c).await;
    let others_before = (
        engine::digest_of(&mut c, B).await.unwrap(),
        engine::digest_of(&mut c, NEIGHBOUR).await.unwrap(),
    );

    // Pages of 64: the read spans eight requests at one revision.
    let snap = engine::export(&mut c, A, 64, &Limits::default())
        .await
        .unwrap();
    assert_eq!(snap.records.len(), 503);
    assert_eq!(snap.restarts, 0);
    assert!(snap.records.iter().all(|r| !r.key.starts_with(b"/")));
    let leased: Vec<&Record> = snap.records.iter().filter(|r| r.lease.is_some()).collect();
    assert_eq!(leased.len(), 3);
    assert!(
        leased
            .iter()
            .all(|r| (1..=600).contains(&r.lease.unwrap().ttl))
    );
    let header = archive::header_for("ns/a", "v1.20.2", snap.revision, "now", &snap.records);
    let key = [7u8; archive::KEY_LEN];
    let bytes = archive::encode(&header, &snap.records, &key).unwrap();
    let (_, records) = archive::decode(&bytes, &key, &Limits::default()).unwrap();
    let plain = archive::digest(records.iter().map(|r| (&r.key[..], &r.value[..])));
    assert_eq!(
        engine::digest_of(&mut c, A).await.unwrap(),
        (plain.clone(), 503)
    );

    for i in 0..100 {
        put(
            &mut c,
            A,
            &format!("configmaps/default/obj-{:03}", i * 2),
            "changed",
        )
        .await;
        c.delete(format!("{A}secrets/default/obj-{:03}", i * 2 + 1), None)
            .await
            .unwrap();
    }
    for i in 0..50 {
        put(&mut c, A, &format!("configmaps/default/new-{i}"), "new").await;
    }
    assert_ne!(engine::digest_of(&mut c, A).await.unwrap().0, plain);

    let done = engine::restore(&mut c, A, &records, &Limits::default())
        .await
        .unwrap();
    assert_eq!((done.written, done.deleted, done.leases), (503, 50, 1));
    assert!(done.transactions >= 9, "{done:?}");
    assert_eq!(
        engine::digest_of(&mut c, A).await.unwrap(),
        (plain.clone(), 503)
    );
    let ev = c
        .get(format!("{A}events/default/ev-0"), None)
        .await
        .unwrap();
    let lease = ev.kvs()[0].lease();
    assert_ne!(lease, 0, "a leased key came back without a lease");
    let ttl = c.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!((550..=600).contains(&ttl), "{ttl}");
    let others_after = (
        engine::digest_of(&mut c, B).await.unwrap(),
        engine::digest_of(&mut c, NEIGHBOUR).await.unwrap(),
    );
    assert_eq!(others_before, others_after);

    // Again: the same result, nothing deleted.
    let again = engine::restore(&mut c, A, &records, &Limits::default())
        .await
        .unwrap();
    assert_eq!((again.written, again.deleted), (503, 0));

    // Into an empty prefix: a clone, with the same digest.
    let clone = "/nestplane/other-ns/clone/";
    engine::restore(&mut c, clone, &records, &Limits::default())
        .await
        .unwrap();
    assert_eq!(
        engine::digest_of(&mut c, clone).await.unwrap(),
        (plain, 503)
    );
}

/// Every page of a read asks for the first page's revision: keys written, changed or
/// deleted after it are not seen. A revision the datastore compacted is said as such.
#[tokio::test]
async fn a_read_is_pinned_to_one_revision_and_a_compacted_one_is_named() {
    let (_etcd, mut c) = etcd().await;
    for i in 0..10 {
        put(&mut c, A, &format!("k/{i}"), "before").await;
    }
    let at = engine::read_at(&mut c, A, None, 3).await.unwrap();
    for i in 0..10 {
        put(&mut c, A, &format!("k/{i}"), "after").await;
    }
    c.delete(format!("{A}k/0"), None).await.unwrap();
    put(&mut c, A, "k/new", "after").await;

    let then = engine::read_at(&mut c, A, Some(at.revision), 3)
        .await
        .unwrap();
    assert_eq!(then.revision, at.revision);
    assert_eq!(then.keys.len(), 10);
    assert!(then.keys.iter().all(|(_, v, _)| v == b"before"));
    let now = engine::read_at(&mut c, A, None, 3).await.unwrap();
    assert_eq!(now.keys.len(), 10);
    assert!(now.keys.iter().all(|(_, v, _)| v == b"after"));

    c.compact(now.revision, None).await.unwrap();
    match engine::read_at(&mut c, A, Some(at.revision), 3).await {
        Err(EngineError::Compacted { revision }) => assert_eq!(revision, at.revision),
        other => panic!("expected Compacted, got {:?}", other.map(|r| r.revision)),
    }
    // An export whose revision is compacted before it ends starts again at the current one,
    // and says so.
    let snap = engine::export_from(&mut c, A, 3, &Limits::default(), Some(at.revision))
        .await
        .unwrap();
    assert_eq!(snap.restarts, 1);
    assert!(snap.revision >= now.revision);
    assert_eq!(snap.records.len(), 10);
    assert!(snap.records.iter().all(|r| r.value == b"after"));
}

/// An archive is input its holder controls: a key that would leave the tenant's prefix is
/// refused before anything is written, even among good ones, and so is a prefix that is not
/// a tenant's.
#[tokio::test]
async fn a_restore_with_a_hostile_key_writes_nothing() {
    let (_etcd, mut c) = etcd().await;
    fill(&mut c).await;
    let before = (
        engine::digest_of(&mut c, A).await.unwrap(),
        engine::digest_of(&mut c, NEIGHBOUR).await.unwrap(),
        engine::digest_of(&mut c, B).await.unwrap(),
    );
    // Each hostile key in its sorted place among good ones, so only the key check can refuse it.
    for bad in [
        "configmaps/default/x-5/../../../../b/x",
        "configmaps/default/x-5/./y",
        "configmaps/default/x-5//y",
    ] {
        let mut records: Vec<Record> = (0..10)
            .map(|i| Record {
                key: format!("configmaps/default/x-{i}").into_bytes(),
                value: b"x".to_vec(),
                lease: None,
            })
            .collect();
        records.push(Record {
            key: bad.as_bytes().to_vec(),
            value: b"x".to_vec(),
            lease: None,
        });
        records.sort_by(|a, b| a.key.cmp(&b.key));
        let err = engine::restore(&mut c, A, &records, &Limits::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, EngineError::Archive(archive::ArchiveError::Key { .. })),
            "{bad}: {err}"
        );
    }
    // Records that hold a key twice, or more leases than allowed.
    let good: Vec<Record> = (0..10)
        .map(|i| Record {
            key: format!("configmaps/default/y-{i}").into_bytes(),
            value: b"y".to_vec(),
            lease: Some(Lease { id: i + 1, ttl: 60 }),
        })
        .collect();
    let mut twice = good.clone();
    twice[4].key = twice[3].key.clone();
    assert!(matches!(
        engine::restore(&mut c, A, &twice, &Limits::default()).await,
        Err(EngineError::Archive(archive::ArchiveError::Records(_)))
    ));
    let few = Limits {
        leases: 5,
        ..Limits::default()
    };
    assert!(matches!(
        engine::restore(&mut c, A, &good, &few).await,
        Err(EngineError::Archive(archive::ArchiveError::TooLarge { .. }))
    ));
    assert!(
        c.leases().await.unwrap().leases().len() == 1,
        "a refused restore granted leases"
    );
    for prefix in ["", "/", "/nestplane/ns/a"] {
        assert!(matches!(
            engine::restore(&mut c, prefix, &[], &Limits::default()).await,
            Err(EngineError::Prefix(_))
        ));
    }
    let after = (
        engine::digest_of(&mut c, A).await.unwrap(),
        engine::digest_of(&mut c, NEIGHBOUR).await.unwrap(),
        engine::digest_of(&mut c, B).await.unwrap(),
    );
    assert_eq!(before, after);
}

/// Values far larger than one page or one transaction may carry: the read halves its pages
/// (the client takes answers of at most 4 MiB) and the restore splits its writes by bytes
/// (etcd takes requests of at most 1.5 MiB), and both still give back exactly the keys.
#[tokio::test]
async fn large_values_are_read_and_written_in_pieces_the_datastore_takes() {
    let (_etcd, mut c) = etcd().await;
    let big = |i: usize| format!("{i:03}").repeat(200 * 1024 / 3);
    for i in 0..40 {
        put(&mut c, A, &format!("secrets/default/big-{i:02}"), &big(i)).await;
    }
    let snap = engine::export(&mut c, A, engine::PAGE, &Limits::default())
        .await
        .unwrap();
    assert_eq!(snap.records.len(), 40);
    let header = archive::header_for("ns/a", "v1.20.2", snap.revision, "now", &snap.records);
    assert!(header.bytes > 7 << 20, "{}", header.bytes);
    // A prefix that holds more than an archive may: the export says how much, having kept
    // no more than the limits in memory.
    for (limits, what, found) in [
        (
            Limits {
                keys: 10,
                ..Limits::default()
            },
            "keys",
            40,
        ),
        (
            Limits {
                bytes: 1 << 20,
                ..Limits::default()
            },
            "bytes",
            header.bytes,
        ),
    ] {
        match engine::export(&mut c, A, engine::PAGE, &limits).await {
            Err(EngineError::TooLargeToArchive(archive::ArchiveError::TooLarge {
                what: w,
                found: f,
                ..
            })) => assert_eq!((w, f), (what, found)),
            other => panic!("{what}: {other:?}"),
        }
    }
    for i in 0..40 {
        put(&mut c, A, &format!("secrets/default/big-{i:02}"), "small").await;
    }
    let done = engine::restore(&mut c, A, &snap.records, &Limits::default())
        .await
        .unwrap();
    assert!(done.transactions >= 8, "{done:?}");
    assert_eq!(
        engine::digest_of(&mut c, A).await.unwrap(),
        (
            archive::digest(snap.records.iter().map(|r| (&r.key[..], &r.value[..]))),
            40
        )
    );
    // A value the datastore refuses (over its 1.5 MiB request limit) fails the restore after
    // leased keys were written: the leases it granted are revoked, none is left behind.
    let before = c.leases().await.unwrap().leases().len();
    let records = vec![
        Record {
            key: b"events/default/e".to_vec(),
            value: b"e".to_vec(),
            lease: Some(Lease { id: 9, ttl: 600 }),
        },
        Record {
            key: b"secrets/default/huge".to_vec(),
            value: vec![b'h'; 2 << 20],
            lease: Some(Lease { id: 10, ttl: 600 }),
        },
    ];
    let err = engine::restore(&mut c, A, &records, &Limits::default())
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::Etcd { .. }), "{err}");
    assert_eq!(c.leases().await.unwrap().leases().len(), before);
}

/// A restored lease lives at least a minute and at most an hour, whatever the archive says:
/// a key about to expire is there when the restore is verified, and an archive holds no lease
/// in the datastore for longer than Kubernetes would.
#[tokio::test]
async fn restored_leases_live_between_a_minute_and_an_hour() {
    let (_etcd, mut c) = etcd().await;
    let records = vec![
        Record {
            key: b"events/default/short".to_vec(),
            value: b"s".to_vec(),
            lease: Some(Lease { id: 1, ttl: 1 }),
        },
        Record {
            key: b"events/default/long".to_vec(),
            value: b"l".to_vec(),
            lease: Some(Lease {
                id: 2,
                ttl: 100_000,
            }),
        },
    ];
    let mut records = records;
    records.sort_by(|a, b| a.key.cmp(&b.key));
    engine::restore(&mut c, A, &records, &Limits::default())
        .await
        .unwrap();
    let ttl_of = |key: &'static str| {
        let mut c = c.clone();
        async move {
            let got = c.get(format!("{A}{key}"), None).await.unwrap();
            let lease = got.kvs()[0].lease();
            c.lease_time_to_live(lease, None).await.unwrap().ttl()
        }
    };
    let short = ttl_of("events/default/short").await;
    let long = ttl_of("events/default/long").await;
    assert!((55..=60).contains(&short), "{short}");
    assert!((3550..=3600).contains(&long), "{long}");
}

/// A read without a revision pins the first page's: while a writer rewrites every key in
/// one transaction after another, a read of one key per page still sees one generation.
#[tokio::test]
async fn an_export_sees_one_generation_while_a_writer_changes_every_key() {
    let (_etcd, mut c) = etcd().await;
    let write_generation = |mut c: Client, g: usize| async move {
        let ops: Vec<etcd_client::TxnOp> = (0..100)
            .map(|i| etcd_client::TxnOp::put(format!("{A}k/{i:03}"), format!("gen-{g}"), None))
            .collect();
        c.txn(etcd_client::Txn::new().and_then(ops)).await.unwrap();
    };
    write_generation(c.clone(), 0).await;
    let writer = {
        let c = c.clone();
        tokio::spawn(async move {
            for g in 1.. {
                write_generation(c.clone(), g).await;
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        })
    };
    let snap = engine::export(&mut c, A, 1, &Limits::default())
        .await
        .unwrap();
    let after = engine::read_at(&mut c, A, None, engine::PAGE)
        .await
        .unwrap();
    writer.abort();
    assert_eq!(snap.records.len(), 100);
    let first = &snap.records[0].value;
    assert!(snap.records.iter().all(|r| &r.value == first));
    // The writer did move on while the pages were read (else the test proves nothing).
    assert!(
        after.revision > snap.revision + 1,
        "{} {}",
        after.revision,
        snap.revision
    );
}
