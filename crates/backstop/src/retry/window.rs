//! Two counters over a sliding window of time, kept in slots: what the storm alarm and the
//! adaptive throttle measure.

use std::time::Duration;

use tokio::time::Instant;

/// Slots per window: the window slides by a tenth of its length.
const SLOTS: usize = 10;

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// Which slot-length interval since the origin these counts belong to.
    epoch: u64,
    first: u64,
    second: u64,
}

/// Counts of two kinds of events (e.g. requests and retries) over the last `window`, read
/// through tokio's clock so that paused-clock tests drive it.
#[derive(Debug, Clone)]
pub(crate) struct SlidingCounts {
    origin: Instant,
    slot_nanos: u64,
    slots: [Slot; SLOTS],
}

impl SlidingCounts {
    /// Empty counts over `window` (at least one nanosecond per slot).
    #[cfg(test)]
    pub(crate) fn new(window: Duration) -> Self {
        Self::new_at(window, Instant::now())
    }

    /// Empty counts over `window` whose slots are counted from `origin`: a simulation on a
    /// virtual clock passes its own start, so slot boundaries do not depend on the wall clock.
    pub(crate) fn new_at(window: Duration, origin: Instant) -> Self {
        let slot_nanos = u64::try_from(window.as_nanos() / SLOTS as u128)
            .unwrap_or(u64::MAX)
            .max(1);
        Self {
            origin,
            slot_nanos,
            slots: [Slot::default(); SLOTS],
        }
    }

    fn epoch(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since / u128::from(self.slot_nanos)).unwrap_or(u64::MAX)
    }

    /// Adds `first` and `second` events at `now`.
    pub(crate) fn add(&mut self, now: Instant, first: u64, second: u64) {
        let epoch = self.epoch(now);
        let slot = &mut self.slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            *slot = Slot {
                epoch,
                ..Slot::default()
            };
        }
        slot.first = slot.first.saturating_add(first);
        slot.second = slot.second.saturating_add(second);
    }

    /// Both totals over the window ending at `now`.
    pub(crate) fn totals(&self, now: Instant) -> (u64, u64) {
        let epoch = self.epoch(now);
        let oldest = epoch.saturating_sub(SLOTS as u64 - 1);
        self.slots
            .iter()
            .filter(|s| (oldest..=epoch).contains(&s.epoch) && (s.first, s.second) != (0, 0))
            .fold((0, 0), |(a, b), s| {
                (a.saturating_add(s.first), b.saturating_add(s.second))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn counts_leave_the_window_slot_by_slot() {
        let mut counts = SlidingCounts::new(Duration::from_secs(10));
        counts.add(Instant::now(), 10, 1);
        tokio::time::advance(Duration::from_secs(5)).await;
        counts.add(Instant::now(), 10, 2);
        assert_eq!(counts.totals(Instant::now()), (20, 3));
        tokio::time::advance(Duration::from_millis(5_500)).await;
        assert_eq!(
            counts.totals(Instant::now()),
            (10, 2),
            "the first slot left"
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(counts.totals(Instant::now()), (0, 0));
        // A slot reused a window later starts from zero.
        counts.add(Instant::now(), 1, 0);
        assert_eq!(counts.totals(Instant::now()), (1, 0));
    }
}
