//! Delta segments (point in time): a tenant's changes after a backup, as a watch saw them,
//! and how a backup and its segments give the keys as they were at one revision or time.
//! Pure: values in, values out.
//!
//! A segment is an archive ([`super::archive`]: the same header, seal and limits) whose
//! header says `kind: delta`, its place in the chain (`sequence`, from 1), the revision the
//! chain stood at before it (`since`) and after it (`revision`), and whose `id` is the
//! backup's UID. Its records are its events in order, each one record keyed by its position
//! (`<revision, 20 digits>/<index, 6 digits>`, so the records stay strictly ordered) whose
//! value holds the event: `u8 op (1 put, 2 delete), i64 time seen (ms since the epoch),
//! u32 key length, key, value`. Every event's key is checked as an archive's keys are
//! ([`archive::check_key`]): a segment is input its holder controls.

use std::collections::BTreeMap;

use super::archive::{self, ArchiveError, Lease, Record};

/// A segment's name ends with this, after its backup's archive name and its sequence:
/// `<backup>.d000001.npdelta`.
pub const SEGMENT_SUFFIX: &str = ".npdelta";
/// The `kind` in a segment's header.
pub const KIND: &str = "delta";
/// The most segments one restore reads.
pub const MAX_SEGMENTS: u64 = 100_000;

/// What happened to a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Put {
        value: Vec<u8>,
        lease: Option<Lease>,
    },
    Delete,
}

/// One change, as the watch saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// The datastore revision of the change.
    pub revision: i64,
    /// When the watch saw it (ms since the epoch).
    pub seen_ms: i64,
    /// The key, relative to the tenant's prefix.
    pub key: Vec<u8>,
    pub change: Change,
}

const PUT: u8 = 1;
const DELETE: u8 = 2;

/// `events` (in revision order) as a segment's records.
pub fn to_records(events: &[Event]) -> Vec<Record> {
    events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mut v = Vec::with_capacity(13 + e.key.len());
            let (op, value, lease) = match &e.change {
                Change::Put { value, lease } => (PUT, &value[..], *lease),
                Change::Delete => (DELETE, &[][..], None),
            };
            v.push(op);
            v.extend_from_slice(&e.seen_ms.to_be_bytes());
            v.extend_from_slice(&(e.key.len() as u32).to_be_bytes());
            v.extend_from_slice(&e.key);
            v.extend_from_slice(value);
            Record {
                key: format!("{:020}/{i:06}", e.revision.max(0)).into_bytes(),
                value: v,
                lease,
            }
        })
        .collect()
}

fn bad(why: impl Into<String>) -> ArchiveError {
    ArchiveError::Records(why.into())
}

/// A segment's records (opened, and ordered by [`archive::decode`]) as its events: every
/// key checked, revisions never going back.
pub fn from_records(records: Vec<Record>) -> Result<Vec<Event>, ArchiveError> {
    let mut out = Vec::with_capacity(records.len());
    let mut last = i64::MIN;
    for r in records {
        let position = std::str::from_utf8(&r.key).map_err(|_| bad("an event's position"))?;
        let revision: i64 = position
            .split_once('/')
            .and_then(|(rev, _)| rev.parse().ok())
            .ok_or_else(|| bad(format!("an event's position {position:?}")))?;
        if revision < last {
            return Err(bad("events go back in revision"));
        }
        last = revision;
        let v = &r.value;
        if v.len() < 13 {
            return Err(bad("an event ends early"));
        }
        let op = v[0];
        let seen_ms = i64::from_be_bytes(v[1..9].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(v[9..13].try_into().expect("4 bytes")) as usize;
        let key = v
            .get(13..13 + len)
            .ok_or_else(|| bad("an event's key ends early"))?
            .to_vec();
        archive::check_key(&key)?;
        let rest = &v[13 + len..];
        let change = match op {
            PUT => Change::Put {
                value: rest.to_vec(),
                lease: r.lease,
            },
            DELETE if rest.is_empty() && r.lease.is_none() => Change::Delete,
            _ => return Err(bad("an event is neither a put nor a delete")),
        };
        out.push(Event {
            revision,
            seen_ms,
            key,
            change,
        });
    }
    Ok(out)
}

/// Where to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// Up to and including this revision.
    Revision(i64),
    /// Every change seen at or before this time (ms since the epoch).
    Time(i64),
}

impl Point {
    fn includes(&self, e: &Event) -> bool {
        match *self {
            Point::Revision(r) => e.revision <= r,
            Point::Time(t) => e.seen_ms <= t,
        }
    }
}

/// A backup's keys, changed by its events one segment at a time up to a point (so that a
/// long chain is never held in memory whole).
#[derive(Debug)]
pub struct Replay {
    keys: BTreeMap<Vec<u8>, Record>,
    base_revision: i64,
    point: Point,
    /// The revision the keys stand at.
    pub revision: i64,
    /// An event past the point was seen: nothing later applies.
    pub passed: bool,
}

impl Replay {
    /// From `base` (a backup's records) at `base_revision`.
    pub fn new(base: Vec<Record>, base_revision: i64, point: Point) -> Replay {
        Replay {
            keys: base.into_iter().map(|r| (r.key.clone(), r)).collect(),
            base_revision,
            point,
            revision: base_revision,
            passed: false,
        }
    }

    /// Apply `events` (in order, after those fed before) up to the point.
    pub fn feed(&mut self, events: impl IntoIterator<Item = Event>) {
        for e in events {
            if self.passed {
                return;
            }
            if e.revision <= self.base_revision {
                continue;
            }
            if !self.point.includes(&e) {
                self.passed = true;
                return;
            }
            self.revision = e.revision;
            match e.change {
                Change::Put { value, lease } => {
                    self.keys.insert(
                        e.key.clone(),
                        Record {
                            key: e.key,
                            value,
                            lease,
                        },
                    );
                }
                Change::Delete => {
                    self.keys.remove(&e.key);
                }
            }
        }
    }

    /// The keys (sorted) and the revision they stand at.
    pub fn finish(self) -> (Vec<Record>, i64) {
        (self.keys.into_values().collect(), self.revision)
    }
}

/// The keys of a backup (`base`, sorted as an archive holds them) after its events up to
/// `point`, sorted again; and the revision they stand at (the base's when no event applies).
pub fn apply(
    base: Vec<Record>,
    base_revision: i64,
    events: impl IntoIterator<Item = Event>,
    point: Point,
) -> (Vec<Record>, i64) {
    let mut r = Replay::new(base, base_revision, point);
    r.feed(events);
    r.finish()
}

/// Why `events` of a segment whose header says revisions `since`..`revision` are not all
/// within them.
pub fn check_events(events: &[Event], since: i64, revision: i64) -> Result<(), String> {
    match events
        .iter()
        .find(|e| e.revision <= since || e.revision > revision)
    {
        Some(e) => Err(format!(
            "an event of revision {} is outside the segment's revisions {since}..{revision}",
            e.revision
        )),
        None => Ok(()),
    }
}

/// Why segment `sequence`'s header does not continue the chain of backup `id` that stood at
/// revision `since`.
pub fn check_link(h: &archive::Header, id: &str, sequence: u64, since: i64) -> Result<(), String> {
    if h.kind != KIND {
        return Err(format!("segment {sequence} is not a delta segment"));
    }
    if h.id.is_empty() || h.id != id {
        return Err(format!("segment {sequence} belongs to another backup"));
    }
    if h.sequence != sequence || h.since != since || h.revision < since {
        return Err(format!(
            "segment {sequence} does not follow the one before it (it says sequence {}, revisions {}..{}; the chain stands at {since})",
            h.sequence, h.since, h.revision
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn put(revision: i64, seen_ms: i64, key: &str, value: &str) -> Event {
        Event {
            revision,
            seen_ms,
            key: key.as_bytes().to_vec(),
            change: Change::Put {
                value: value.as_bytes().to_vec(),
                lease: None,
            },
        }
    }

    fn del(revision: i64, seen_ms: i64, key: &str) -> Event {
        Event {
            revision,
            seen_ms,
            key: key.as_bytes().to_vec(),
            change: Change::Delete,
        }
    }

    fn rec(key: &str, value: &str) -> Record {
        Record {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            lease: None,
        }
    }

    #[test]
    fn events_go_through_a_sealed_segment_unchanged() {
        let mut events = vec![
            put(11, 1_000, "configmaps/default/a", "1"),
            put(11, 1_000, "configmaps/default/b", "x"),
            del(12, 2_000, "configmaps/default/a"),
            put(13, 3_000, "configmaps/default/a", ""),
        ];
        events[1].change = Change::Put {
            value: b"x".to_vec(),
            lease: Some(Lease { id: 7, ttl: 3600 }),
        };
        let records = to_records(&events);
        archive::check_records(&records, &archive::Limits::default()).unwrap();
        let key = [9u8; 32];
        let mut header = archive::header_for("ns/a", "v1.20.2", 13, "now", &records);
        header.kind = KIND.into();
        header.sequence = 1;
        header.since = 10;
        let sealed = archive::encode(&header, &records, &key).unwrap();
        let (h, opened) = archive::decode(&sealed, &key, &archive::Limits::default()).unwrap();
        assert_eq!(h.kind, KIND);
        assert_eq!(from_records(opened).unwrap(), events);
    }

    #[test]
    fn a_backup_and_its_events_give_the_keys_at_a_revision_or_a_time() {
        let base = vec![rec("a", "0"), rec("b", "0")];
        let events = vec![
            put(9, 500, "a", "old"), // before the backup's revision: already in it
            put(11, 1_000, "a", "1"),
            put(12, 2_000, "c", "1"),
            del(13, 3_000, "b"),
            put(14, 4_000, "a", "2"),
        ];
        let at = |p| apply(base.clone(), 10, events.clone(), p);
        assert_eq!(at(Point::Revision(10)), (base.clone(), 10));
        assert_eq!(
            at(Point::Revision(13)),
            (vec![rec("a", "1"), rec("c", "1")], 13)
        );
        assert_eq!(
            at(Point::Time(2_500)),
            (vec![rec("a", "1"), rec("b", "0"), rec("c", "1")], 12)
        );
        assert_eq!(
            at(Point::Time(i64::MAX)),
            (vec![rec("a", "2"), rec("c", "1")], 14)
        );
    }

    #[test]
    fn a_hostile_segment_is_refused() {
        for key in ["../beta/registry/x", "/registry/x", "a//b", ""] {
            let records = to_records(&[put(11, 0, key, "1")]);
            assert!(from_records(records).is_err(), "{key:?}");
        }
        // An event that says delete and carries a value, one that ends early, one going back.
        let mut r = to_records(&[del(11, 0, "a")]);
        r[0].value.push(1);
        assert!(from_records(r).is_err());
        let mut r = to_records(&[put(11, 0, "a", "1")]);
        r[0].value.truncate(10);
        assert!(from_records(r).is_err());
        let mut r = to_records(&[put(12, 0, "a", "1"), put(11, 0, "b", "1")]);
        r.sort_by(|x, y| x.key.cmp(&y.key));
        r.swap(0, 1);
        assert!(from_records(r).is_err());
        // The chain: another backup's segment, or one out of place.
        let mut h = archive::header_for("ns/a", "v", 20, "now", &[]);
        h.kind = KIND.into();
        h.id = "uid-1".into();
        h.sequence = 2;
        h.since = 15;
        assert!(check_link(&h, "uid-1", 2, 15).is_ok());
        assert!(check_link(&h, "uid-2", 2, 15).is_err());
        assert!(check_link(&h, "uid-1", 3, 15).is_err());
        assert!(check_link(&h, "uid-1", 2, 14).is_err());
        h.kind = String::new();
        assert!(check_link(&h, "uid-1", 2, 15).is_err());
        // Events outside the segment's revisions.
        let events =
            from_records(to_records(&[put(16, 0, "a", "1"), put(21, 0, "b", "1")])).unwrap();
        assert!(check_events(&events[..1], 15, 20).is_ok());
        assert!(check_events(&events, 15, 20).is_err());
        assert!(check_events(&events[..1], 16, 20).is_err());
    }
}
