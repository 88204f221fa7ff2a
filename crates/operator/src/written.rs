//! Reading one's own writes over the watch caches.
//!
//! A pass reads objects from a watch cache, which takes the operator's own writes a moment
//! after the API server answered them. A pass that runs in that moment (another event of
//! the same object, a dependency, a requeue) would judge the object as it was before the
//! write: it would write the same status again, with new transition times, or create a
//! component whose reference it has just written. With 1,000 new tenants that was hundreds
//! of writes that changed nothing.
//!
//! So what the API server returned for a write is kept, together with the resource versions
//! it replaced, until the cache moves past them: a pass given an object the cache still holds
//! at one of those versions gets the written one instead. Anything else in the cache (the
//! write itself, or a later change by anyone) is newer, and is used as it is.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::Resource;

/// At most this many objects are remembered.
const MAX_ENTRIES: usize = 20_000;

/// Objects as this operator last wrote them, while the caches are behind.
#[derive(Default)]
pub struct Written {
    entries: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    /// Resource versions older than `latest`.
    stale: Vec<String>,
    latest: Arc<dyn Any + Send + Sync>,
}

fn key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref().unwrap_or_default()
    )
}

impl Written {
    /// `after` is what the API server returned for a write to `before`.
    pub fn remember<K>(&self, before: &K, after: K)
    where
        K: Resource<DynamicType = ()> + Send + Sync + 'static,
    {
        let Some(rv) = before.meta().resource_version.clone() else {
            return;
        };
        if after.meta().resource_version.as_ref() == Some(&rv) {
            return; // nothing changed
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        // An entry normally goes with the next pass of its object; one whose object was
        // deleted first stays. This bounds them (forgetting is always safe: a pass then
        // judges the cache's object, at worst writing once more).
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        let entry = entries.entry(key(before)).or_insert_with(|| Entry {
            stale: Vec::new(),
            latest: Arc::new(()),
        });
        entry.stale.push(rv);
        entry.latest = Arc::new(Arc::new(after));
    }

    /// `obj` as a cache holds it, or what this operator wrote over it if the cache is behind.
    pub fn latest<K>(&self, obj: Arc<K>) -> Arc<K>
    where
        K: Resource<DynamicType = ()> + Send + Sync + 'static,
    {
        let k = key(obj.as_ref());
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = entries.get(&k) else {
            return obj;
        };
        let behind = obj
            .meta()
            .resource_version
            .as_ref()
            .is_some_and(|rv| entry.stale.contains(rv));
        if behind && let Some(w) = entry.latest.downcast_ref::<Arc<K>>() {
            return w.clone();
        }
        // The cache has the write, or something newer: the entry is done.
        entries.remove(&k);
        obj
    }

    /// [`Written::latest`] of an owned object.
    pub fn current<K>(&self, obj: K) -> K
    where
        K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    {
        let obj = Arc::new(obj);
        let latest = self.latest(obj);
        Arc::try_unwrap(latest).unwrap_or_else(|a| (*a).clone())
    }

    /// Forget an object (deleted).
    pub fn forget<K: Resource<DynamicType = ()>>(&self, obj: &K) {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key(obj));
    }

    /// How many objects are remembered.
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn cm(rv: &str, value: &str) -> ConfigMap {
        let mut c = ConfigMap::default();
        c.metadata.name = Some("a".into());
        c.metadata.namespace = Some("ns".into());
        c.metadata.resource_version = Some(rv.into());
        c.data = Some([("k".to_string(), value.to_string())].into());
        c
    }

    fn value(c: &ConfigMap) -> &str {
        c.data.as_ref().and_then(|d| d.get("k")).map_or("", |s| s)
    }

    #[test]
    fn a_cache_behind_its_own_writes_gives_the_written_object() {
        let w = Written::default();
        let cached = cm("1", "old");
        w.remember(&cached, cm("2", "new"));
        assert_eq!(value(&w.latest(Arc::new(cached.clone()))), "new");
        // A second write before the cache took the first.
        w.remember(&cm("2", "new"), cm("3", "newer"));
        assert_eq!(value(&w.current(cached)), "newer");
        assert_eq!(value(&w.current(cm("2", "new"))), "newer");
    }

    #[test]
    fn a_cache_that_caught_up_or_moved_on_wins_and_the_entry_goes() {
        let w = Written::default();
        w.remember(&cm("1", "old"), cm("2", "new"));
        assert_eq!(value(&w.current(cm("2", "new"))), "new");
        assert!(w.is_empty());
        w.remember(&cm("1", "old"), cm("2", "new"));
        // Someone else changed it after our write.
        assert_eq!(value(&w.current(cm("5", "theirs"))), "theirs");
        assert!(w.is_empty());
        // A stale version no longer maps to anything once the entry is gone.
        assert_eq!(value(&w.current(cm("1", "old"))), "old");
    }

    #[test]
    fn a_write_that_changed_nothing_is_not_kept() {
        let w = Written::default();
        w.remember(&cm("1", "old"), cm("1", "old"));
        assert!(w.is_empty());
    }
}
