//! One watch per kind for the whole operator.
//!
//! Several controllers follow the same kind: a `NestedControlPlane` change matters to the
//! control plane controller, to the four component controllers (versions, pauses), to the
//! datastore controller and to PostCreateConfigs; a `NestedEtcd` change to its own
//! controller, to its control plane, to its datastore and to the API server waiting for it.
//! Each of them watching for itself would make the management API server send every event of
//! a kind once per watcher, and the operator decode it as often (with 1,000 tenants, the
//! control planes alone were eight watches).
//!
//! A [`Shared`] watch is one watch and one cache: every event is decoded once, put in the
//! cache first, and then handed to each subscriber, so a controller woken by it reads a cache
//! that already has it. Deleted objects are handed on too (unlike kube's own shared
//! reflector, which only hands on applied ones): a control plane must hear that one of its
//! components is gone.

use std::sync::{Arc, OnceLock};

use futures::channel::mpsc;
use futures::{FutureExt, SinkExt, Stream, StreamExt};
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;

use crate::context::Context;

/// How many events a subscriber may be behind before the watch waits for it.
const BUFFER: usize = 256;

/// One watch of `K`: its cache and the subscribers that hear of every change.
pub struct Shared<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    kind: &'static str,
    writer: reflector::store::Writer<K>,
    reader: Store<K>,
    subscribers: Vec<mpsc::Sender<Arc<K>>>,
}

impl<K> Shared<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    /// A watch of `kind` (the name its failures are reported under), not started yet.
    pub fn new(kind: &'static str) -> Self {
        let (reader, writer) = reflector::store();
        Shared {
            kind,
            writer,
            reader,
            subscribers: Vec::new(),
        }
    }

    /// The cache (filled once [`Shared::run`] runs).
    pub fn store(&self) -> Store<K> {
        self.reader.clone()
    }

    /// The cache, also put into `slot` (where passes look for it).
    pub fn store_into(&self, slot: &OnceLock<Store<K>>) -> Store<K> {
        // Set once per run; a slot already set holds a cache of the same watch.
        let _ = slot.set(self.reader.clone());
        self.reader.clone()
    }

    /// Every object applied or deleted from now on, after the cache has it; and when the
    /// watch starts or restarts (a relist), every object listed, once the cache has them all.
    pub fn subscribe(&mut self) -> impl Stream<Item = Arc<K>> + Send + 'static + use<K> {
        let (tx, rx) = mpsc::channel(BUFFER);
        self.subscribers.push(tx);
        rx
    }

    /// Watch with `config` until `shutdown`, each object passed through `slim` before it is
    /// cached (managed fields are always dropped: no pass reads them, and they are the largest
    /// part of an applied object). A failed watch is logged, counted and fails `/readyz`, and
    /// is retried with backoff; an expired one relists ([`crate::context::Metrics::watch_error`]).
    pub fn run(
        self,
        ctx: &Arc<Context>,
        api: Api<K>,
        config: watcher::Config,
        slim: fn(&mut K),
        shutdown: &CancellationToken,
    ) -> futures::future::BoxFuture<'static, ()> {
        let Shared {
            kind,
            writer,
            reader,
            mut subscribers,
        } = self;
        let ctx = ctx.clone();
        let events = reflector::reflector(
            writer,
            watcher(api, config)
                .default_backoff()
                .modify(move |o: &mut K| {
                    o.meta_mut().managed_fields = None;
                    slim(o);
                }),
        )
        .take_until(shutdown.clone().cancelled_owned());
        async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                let objects = match event {
                    Ok(watcher::Event::Apply(o)) => vec![Arc::new(o)],
                    Ok(watcher::Event::Delete(o)) => {
                        // What was kept about a deleted object goes with it.
                        ctx.pacing.forget(&crate::context::object_key(&o));
                        ctx.written.forget(&o);
                        vec![Arc::new(o)]
                    }
                    // A (re)list fills the cache only when it is complete: what it listed is
                    // handed on then, from the cache. Handed on one by one, a controller would
                    // look for an object the cache does not have yet, and drop it.
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
                    Ok(watcher::Event::InitDone) => reader.state(),
                    Err(e) => {
                        ctx.metrics.watch_error(&ctx.health, kind, &e);
                        continue;
                    }
                };
                for obj in objects {
                    for tx in &mut subscribers {
                        // A subscriber that ended (its controller stopped) no longer hears:
                        // its send fails, and nothing else is to be done about it.
                        let _ = tx.send(obj.clone()).await;
                    }
                }
            }
        }
        // On the heap: a watch's state is large, and the operator joins many of them.
        .boxed()
    }
}

/// A slimming that keeps the object as it is.
pub fn whole<K>(_: &mut K) {}
