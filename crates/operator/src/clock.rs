//! The operator's idea of "now" for renewal decisions, injectable so a test can move it past
//! half of a certificate's life. Certificates are always issued for the real time (so every
//! real peer accepts them at once); the clock only decides when they are due.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use time::OffsetDateTime;

/// A source of "now".
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> OffsetDateTime + Send + Sync>);

impl Default for Clock {
    /// The system clock.
    fn default() -> Self {
        Clock(Arc::new(OffsetDateTime::now_utc))
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Clock({})", self.now())
    }
}

impl Clock {
    /// Now.
    pub fn now(&self) -> OffsetDateTime {
        (self.0)()
    }

    /// The system clock moved by `offset` seconds (read at every call, so the caller can move
    /// it while the operator runs).
    pub fn offset(offset: Arc<AtomicI64>) -> Self {
        Clock(Arc::new(move || {
            OffsetDateTime::now_utc() + time::Duration::seconds(offset.load(Ordering::SeqCst))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_clock_moves_when_told() {
        let off = Arc::new(AtomicI64::new(0));
        let c = Clock::offset(off.clone());
        let before = c.now();
        off.store(200 * 86_400, Ordering::SeqCst);
        assert!(c.now() - before >= time::Duration::days(199));
    }
}
