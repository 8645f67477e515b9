//! Time windows of idempotency records: which window a record goes to, and the summary that
//! lets a claim skip a window without reading it.
//!
//! A store that keeps every record in one table pays, for each write, a random place in a key
//! index as large as all live records, and for each expiry a delete at another random place
//! (BENCHMARKS.md, "How cost grows with work"). A windowed store keeps the records of each
//! **TTL class** in **windows** of creation time: a new record goes to the window of the
//! store's time, so writes touch one window's index, small enough to stay cached; a window
//! whose records have all expired is dropped whole.
//!
//! # Classes and widths
//!
//! A record's class is the first rung of [`CLASS_LADDER`] at least as long as its TTL (past the
//! last rung, whole multiples of it), so the records of a window expire within one width of
//! each other and a short-lived record never waits for a long-lived neighbour. A class's
//! window is 1/[`WINDOWS_PER_CLASS`] of it wide (1 hour for 24-hour keys, 7 hours for 7-day
//! payment keys): a class then spans about 25 live windows, so
//!
//! - the index that writes touch holds about 1/24 of the class's live records (417 thousand of
//!   10 million), which stays in memory;
//! - a claim looks into about 25 windows, nearly all of them sealed and ruled out by their
//!   summaries in memory, so their indexes are not read;
//! - records are kept at most one width (4 %) longer than their TTL before their window goes.
//!
//! Fewer, wider windows would grow the written index; more, narrower ones would multiply the
//! tables, the summaries and the statements a claim prepares, for no gain in the written
//! index's locality once it fits in memory.
//!
//! # Sealed windows and summaries
//!
//! Once the store's time has passed a window's end, no record is inserted into it any more
//! (the store's time never goes back, see [`HighWater`]): the window is **sealed**, and its
//! key set only shrinks. A `Summary` (a Bloom filter, kept in memory by each store instance)
//! built from it after it sealed answers "not here" for nearly every key that is not, and never
//! for one that is: a claim skips a sealed window its summary rules out. A window without a
//! summary is read.
//!
//! The design, with its boundary, drop and crash cases, is model-checked in
//! `protocol::windows_check`.

use std::sync::atomic::{AtomicI64, Ordering};

#[cfg(any(feature = "sqlite", feature = "postgres"))]
use fastbloom::BloomFilter;

/// The TTL classes, in milliseconds: 1 minute, 1 hour, 1 day, 7 days, 30 days, 365 days.
pub const CLASS_LADDER: [i64; 6] = [
    60_000,
    3_600_000,
    86_400_000,
    7 * 86_400_000,
    30 * 86_400_000,
    365 * 86_400_000,
];

/// How many windows a class's TTL is cut into: the width of its windows is
/// `class / WINDOWS_PER_CLASS`.
pub const WINDOWS_PER_CLASS: i64 = 24;

/// False-positive rate of a `Summary`: the share of claims for a key a sealed window does
/// not hold that still read that window's index.
pub const SUMMARY_FALSE_POSITIVES: f64 = 0.01;

/// The TTL class of a record kept `ttl_ms`: the first rung of [`CLASS_LADDER`] at least as
/// long, or past the last one, the next whole multiple of it.
pub fn class_of(ttl_ms: i64) -> i64 {
    let last = CLASS_LADDER[CLASS_LADDER.len() - 1];
    match CLASS_LADDER.iter().find(|&&rung| rung >= ttl_ms) {
        Some(&rung) => rung,
        None => (ttl_ms / last + i64::from(ttl_ms % last != 0)).saturating_mul(last),
    }
}

/// One window: the records of TTL class `class_ms` created in
/// `[index · width, (index + 1) · width)` of the store's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Window {
    /// The TTL class, milliseconds (a rung of [`CLASS_LADDER`] or a multiple of the last).
    pub class_ms: i64,
    /// Which window of the class: its start divided by its width.
    pub index: i64,
}

/// Prefix of a window table's name: `idempotency_window_{class_ms}_{index}`.
pub const TABLE_PREFIX: &str = "idempotency_window_";

impl Window {
    /// The window a record of TTL `ttl_ms` created at store time `at_ms` goes to. Times before
    /// the epoch go to window 0.
    pub fn of(ttl_ms: i64, at_ms: i64) -> Window {
        let class_ms = class_of(ttl_ms);
        Window {
            class_ms,
            index: at_ms.max(0) / width(class_ms),
        }
    }

    /// Its width, milliseconds.
    pub fn width_ms(&self) -> i64 {
        width(self.class_ms)
    }

    /// Where it starts, store time in unix ms.
    pub fn start_ms(&self) -> i64 {
        self.index.saturating_mul(self.width_ms())
    }

    /// Where it ends (exclusive): from then on nothing is inserted into it.
    pub fn end_ms(&self) -> i64 {
        self.index.saturating_add(1).saturating_mul(self.width_ms())
    }

    /// Whether it is sealed once the store's time has reached `high_water_ms`.
    pub fn sealed_at(&self, high_water_ms: i64) -> bool {
        high_water_ms >= self.end_ms()
    }

    /// The window after it, in the same class.
    pub fn next(&self) -> Window {
        Window {
            index: self.index.saturating_add(1),
            ..*self
        }
    }

    /// Its table's name: `idempotency_window_{class_ms}_{index}`.
    pub fn table_name(&self) -> String {
        format!("{TABLE_PREFIX}{}_{}", self.class_ms, self.index)
    }

    /// The window a table name names, if it is one: the exact form [`Window::table_name`]
    /// writes, with a class the ladder can produce. Anything else is not a window.
    pub fn from_table_name(name: &str) -> Option<Window> {
        let rest = name.strip_prefix(TABLE_PREFIX)?;
        let (class, index) = rest.split_once('_')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(class) || !digits(index) || class.starts_with('0') {
            return None;
        }
        let window = Window {
            class_ms: class.parse().ok()?,
            index: index.parse().ok()?,
        };
        (class_of(window.class_ms) == window.class_ms && window.table_name() == name)
            .then_some(window)
    }
}

fn width(class_ms: i64) -> i64 {
    (class_ms / WINDOWS_PER_CLASS).max(1)
}

/// The store's time for placing records: the latest time any write has carried. It never goes
/// back, so once it passes a window's end no later write is placed in that window, even when
/// a caller's clock lags or a request waited in a queue.
#[derive(Debug, Default)]
pub struct HighWater(AtomicI64);

impl HighWater {
    /// Moves it to `now_ms` if that is later; answers the store's time after the move.
    pub fn advance(&self, now_ms: i64) -> i64 {
        self.0.fetch_max(now_ms, Ordering::AcqRel).max(now_ms)
    }

    /// The store's time now.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }
}

/// The keys a sealed window held when it was summarised: a Bloom filter over `(scope, key)`.
/// "Not here" is certain; "maybe" is wrong for about [`SUMMARY_FALSE_POSITIVES`] of absent keys.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub struct Summary {
    filter: BloomFilter,
    keys: usize,
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl std::fmt::Debug for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Summary")
            .field("keys", &self.keys)
            .field("bytes", &self.bytes())
            .finish()
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl Summary {
    /// An empty summary sized for `expected` keys.
    pub fn with_capacity(expected: usize) -> Summary {
        Summary {
            filter: BloomFilter::with_false_pos(SUMMARY_FALSE_POSITIVES)
                .expected_items(expected.max(1)),
            keys: 0,
        }
    }

    /// Adds a key.
    pub fn insert(&mut self, scope: &str, key: &str) {
        self.filter.insert(&(scope, key));
        self.keys += 1;
    }

    /// Whether the window may hold `key` in `scope` (false: it certainly does not).
    pub fn may_hold(&self, scope: &str, key: &str) -> bool {
        self.filter.contains(&(scope, key))
    }

    /// How many keys went in.
    pub fn keys(&self) -> usize {
        self.keys
    }

    /// Memory the filter takes, bytes.
    pub fn bytes(&self) -> usize {
        self.filter.num_bits() / 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn classes_round_up_the_ttl() {
        assert_eq!(class_of(0), 60_000);
        assert_eq!(class_of(10), 60_000);
        assert_eq!(class_of(60_000), 60_000);
        assert_eq!(class_of(60_001), 3_600_000);
        assert_eq!(class_of(24 * 3_600_000), 86_400_000);
        assert_eq!(class_of(7 * 86_400_000), 7 * 86_400_000);
        let year = 365 * 86_400_000;
        assert_eq!(class_of(year + 1), 2 * year);
        assert_eq!(
            class_of(i64::MAX),
            (i64::MAX / year + 1).saturating_mul(year)
        );
    }

    #[test]
    fn a_day_class_has_hour_windows() {
        let w = Window::of(86_400_000, 1_700_000_000_000);
        assert_eq!(w.width_ms(), 3_600_000);
        assert!(w.start_ms() <= 1_700_000_000_000 && 1_700_000_000_000 < w.end_ms());
        assert!(!w.sealed_at(w.end_ms() - 1));
        assert!(w.sealed_at(w.end_ms()));
        assert_eq!(w.next().start_ms(), w.end_ms());
        assert_eq!(Window::of(86_400_000, -5).index, 0);
    }

    #[test]
    fn only_exact_names_are_windows() {
        for bad in [
            "idempotency_key",
            "idempotency_window_",
            "idempotency_window_60000",
            "idempotency_window_60000_",
            "idempotency_window_60000_-1",
            "idempotency_window_060000_1",
            "idempotency_window_60001_1",
            "idempotency_window_60000_01",
            "idempotency_window_60000_1_x",
            "idempotency_window_+60000_1",
        ] {
            assert_eq!(Window::from_table_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_high_water_never_goes_back() {
        let hw = HighWater::default();
        assert_eq!(hw.advance(10), 10);
        assert_eq!(hw.advance(5), 10);
        assert_eq!(hw.advance(12), 12);
        assert_eq!(hw.get(), 12);
    }

    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    #[test]
    fn a_summary_never_misses_a_key() {
        let mut summary = Summary::with_capacity(10_000);
        for i in 0..10_000 {
            summary.insert("s", &format!("k{i}"));
        }
        assert!((0..10_000).all(|i| summary.may_hold("s", &format!("k{i}"))));
        let false_positives = (0..10_000)
            .filter(|i| summary.may_hold("s", &format!("other{i}")))
            .count();
        assert!(false_positives < 300, "{false_positives}");
        // The scope is part of the key.
        let hits = (0..1_000)
            .filter(|i| summary.may_hold("t", &format!("k{i}")))
            .count();
        assert!(hits < 50, "{hits}");
    }

    proptest! {
        #[test]
        fn names_round_trip(ttl in 0i64..=i64::MAX, at in any::<i64>()) {
            let w = Window::of(ttl, at);
            prop_assert_eq!(Window::from_table_name(&w.table_name()), Some(w));
            prop_assert!(w.start_ms() <= at.max(0));
            prop_assert!(at.max(0) < w.end_ms() || w.end_ms() == i64::MAX);
        }

        #[test]
        fn parsing_never_panics(name in "idempotency_window_[0-9_+-]{0,25}") {
            if let Some(w) = Window::from_table_name(&name) {
                prop_assert_eq!(w.table_name(), name);
            }
        }
    }
}
