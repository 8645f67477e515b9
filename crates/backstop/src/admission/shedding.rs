//! Sustained overload: the share of requests a [`Gate`](super::Gate) refuses, over a sliding
//! window, held above a threshold for long enough. See [`Shedding`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Slots of the sliding window: the window slides by a tenth of its length.
const SLOTS: usize = 10;

/// When a gate counts as shedding under sustained overload.
///
/// The gate is *shedding* while, over the last [`window`](Self::window), at least
/// [`min_requests`](Self::min_requests) requests reached it and more than
/// [`threshold`](Self::threshold) of them were refused. The overload is *sustained* once the
/// gate has been shedding without a break for [`sustain`](Self::sustain). The share is
/// looked at whenever a request is admitted or refused, and whenever someone asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SheddingConfig {
    /// Length of the sliding window the refused share is measured over. Default 10 s.
    pub window: Duration,
    /// Share of the window's requests (0 to 1) above which the gate is shedding: `1` never
    /// counts as shedding. Default 0.2: one request in five refused.
    pub threshold: f64,
    /// How long shedding must last without a break to count as sustained. Default 5 s: a
    /// burst the queue absorbs or sheds within a few seconds is no reason to move clients.
    pub sustain: Duration,
    /// Fewest requests in the window for its share to count: a handful of refusals on an idle
    /// server is not an overload. Default 20.
    pub min_requests: u64,
}

impl SheddingConfig {
    /// Default [`SheddingConfig::window`].
    pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10);
    /// Default [`SheddingConfig::threshold`].
    pub const DEFAULT_THRESHOLD: f64 = 0.2;
    /// Default [`SheddingConfig::sustain`].
    pub const DEFAULT_SUSTAIN: Duration = Duration::from_secs(5);
    /// Default [`SheddingConfig::min_requests`].
    pub const DEFAULT_MIN_REQUESTS: u64 = 20;

    /// Checks the settings: a window of at least 10 ms (a tenth of it is one slot), a
    /// threshold within `[0, 1]`.
    pub fn validate(&self) -> Result<(), InvalidShedding> {
        if self.window < Duration::from_millis(10) {
            return Err(InvalidShedding::Window(self.window));
        }
        if !(0.0..=1.0).contains(&self.threshold) {
            return Err(InvalidShedding::Threshold(self.threshold));
        }
        Ok(())
    }
}

impl Default for SheddingConfig {
    fn default() -> Self {
        SheddingConfig {
            window: Self::DEFAULT_WINDOW,
            threshold: Self::DEFAULT_THRESHOLD,
            sustain: Self::DEFAULT_SUSTAIN,
            min_requests: Self::DEFAULT_MIN_REQUESTS,
        }
    }
}

/// A [`SheddingConfig`] that cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum InvalidShedding {
    /// The window is shorter than 10 ms.
    #[error("shedding window must be at least 10ms, got {0:?}")]
    Window(Duration),
    /// The threshold is not a share between 0 and 1.
    #[error("shedding threshold must be between 0 and 1, got {0}")]
    Threshold(f64),
}

/// Whether a gate sheds under sustained overload (see [`SheddingConfig`]).
///
/// A [`Gate`](super::Gate) records every request it admits or refuses into its own
/// ([`Gate::shedding`](super::Gate::shedding)); while the overload is sustained its refusals
/// ask clients not to retry, and a [listener](crate::server::listen) given the same handle
/// pushes a share of its connections to go elsewhere. Cloning shares the state.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::{Shedding, SheddingConfig};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let shedding = Shedding::new(SheddingConfig::default()).unwrap();
/// for _ in 0..60 {
///     shedding.record(false); // refused
///     shedding.record(true); // admitted
///     tokio::time::advance(Duration::from_millis(100)).await;
/// }
/// // Half refused for six seconds: more than a fifth, for more than five seconds.
/// assert!(shedding.is_sustained());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Shedding {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: SheddingConfig,
    /// Mirrors `Window::since.is_some()`, so that the common answer (not shedding) takes no
    /// lock. Only a record can start shedding; time alone can only end it.
    shedding: AtomicBool,
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    origin: Instant,
    /// `(slot number, admitted, refused)`; a slot whose number is out of the window is stale.
    slots: [(u64, u64, u64); SLOTS],
    /// Since when the gate has been shedding without a break.
    since: Option<Instant>,
}

impl Shedding {
    /// A new, quiet state with `config`.
    pub fn new(config: SheddingConfig) -> Result<Self, InvalidShedding> {
        config.validate()?;
        Ok(Shedding {
            inner: Arc::new(Inner {
                config,
                shedding: AtomicBool::new(false),
                window: Mutex::new(Window {
                    origin: Instant::now(),
                    slots: [(u64::MAX, 0, 0); SLOTS],
                    since: None,
                }),
            }),
        })
    }

    /// The settings.
    pub fn config(&self) -> &SheddingConfig {
        &self.inner.config
    }

    /// Counts one request: `admitted`, or refused.
    pub fn record(&self, admitted: bool) {
        let now = Instant::now();
        let mut window = self.lock();
        let slot = self.slot(&window, now);
        let entry = &mut window.slots[(slot % SLOTS as u64) as usize];
        if entry.0 != slot {
            *entry = (slot, 0, 0);
        }
        if admitted {
            entry.1 += 1;
        } else {
            entry.2 += 1;
        }
        self.update(&mut window, now, slot);
    }

    /// Whether the gate is shedding now (the refused share is above the threshold), however
    /// briefly.
    pub fn is_shedding(&self) -> bool {
        self.since().is_some()
    }

    /// Whether the gate has been shedding for at least [`SheddingConfig::sustain`].
    pub fn is_sustained(&self) -> bool {
        self.since()
            .is_some_and(|since| since.elapsed() >= self.inner.config.sustain)
    }

    /// The share of the window's requests that were refused (0 when there were none).
    pub fn refused_share(&self) -> f64 {
        let now = Instant::now();
        let window = self.lock();
        let (admitted, refused) = self.totals(&window, self.slot(&window, now));
        share(admitted, refused)
    }

    fn since(&self) -> Option<Instant> {
        if !self.inner.shedding.load(Ordering::Acquire) {
            return None;
        }
        let now = Instant::now();
        let mut window = self.lock();
        let slot = self.slot(&window, now);
        self.update(&mut window, now, slot);
        window.since
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        // Every update leaves the counts consistent: a poisoned lock is still usable.
        self.inner
            .window
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn slot_len(&self) -> Duration {
        self.inner.config.window / SLOTS as u32
    }

    fn slot(&self, window: &Window, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(window.origin);
        u64::try_from(elapsed.as_nanos() / self.slot_len().as_nanos().max(1)).unwrap_or(u64::MAX)
    }

    /// Admitted and refused requests in the window ending with `slot`.
    fn totals(&self, window: &Window, slot: u64) -> (u64, u64) {
        let first = slot.saturating_sub(SLOTS as u64 - 1);
        window
            .slots
            .iter()
            .filter(|(n, _, _)| (first..=slot).contains(n))
            .fold((0, 0), |(a, r), (_, admitted, refused)| {
                (a + admitted, r + refused)
            })
    }

    fn update(&self, window: &mut Window, now: Instant, slot: u64) {
        let config = &self.inner.config;
        let (admitted, refused) = self.totals(window, slot);
        let shedding = admitted + refused >= config.min_requests.max(1)
            && share(admitted, refused) > config.threshold;
        match (shedding, window.since) {
            (true, None) => window.since = Some(now),
            (false, Some(_)) => window.since = None,
            _ => {}
        }
        self.inner
            .shedding
            .store(window.since.is_some(), Ordering::Release);
    }
}

fn share(admitted: u64, refused: u64) -> f64 {
    let total = admitted + refused;
    if total == 0 {
        0.0
    } else {
        refused as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn shedding() -> Shedding {
        Shedding::new(SheddingConfig::default()).unwrap()
    }

    /// Every 100 ms for `for_`: ten requests, the last `refused` of them refused.
    async fn load(s: &Shedding, refused: usize, for_: Duration) {
        let steps = for_.as_millis() / 100;
        for _ in 0..steps {
            for i in 0..10 {
                s.record(i < 10 - refused);
            }
            tokio::time::advance(100 * MS).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn sustained_only_after_shedding_for_the_whole_sustain_time() {
        let s = shedding();
        load(&s, 5, Duration::from_millis(4_900)).await;
        assert!(s.is_shedding());
        assert!(!s.is_sustained(), "4.9 s of shedding is not 5 s");
        load(&s, 5, Duration::from_millis(200)).await;
        assert!(s.is_sustained());
        assert!((s.refused_share() - 0.5).abs() < 1e-9);
    }

    #[tokio::test(start_paused = true)]
    async fn a_share_at_or_below_the_threshold_is_not_shedding() {
        let s = shedding();
        load(&s, 2, Duration::from_secs(30)).await;
        assert!(
            !s.is_shedding() && !s.is_sustained(),
            "20 % is the threshold"
        );
        load(&s, 3, Duration::from_secs(1)).await;
        assert!(s.is_shedding());
    }

    #[tokio::test(start_paused = true)]
    async fn a_break_restarts_the_count() {
        let s = shedding();
        load(&s, 10, Duration::from_secs(4)).await;
        // Served well long enough for the window to forget the refusals.
        load(&s, 0, Duration::from_secs(11)).await;
        assert!(!s.is_shedding());
        load(&s, 10, Duration::from_secs(4)).await;
        assert!(s.is_shedding());
        assert!(
            !s.is_sustained(),
            "8 s of shedding in all, but 4 s since the break"
        );
        load(&s, 10, Duration::from_secs(6)).await;
        assert!(s.is_sustained());
    }

    #[tokio::test(start_paused = true)]
    async fn overload_ages_out_of_the_window_without_traffic() {
        let s = shedding();
        load(&s, 10, Duration::from_secs(6)).await;
        assert!(s.is_sustained());
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(!s.is_sustained() && !s.is_shedding());
        assert_eq!(s.refused_share(), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn few_requests_are_no_overload() {
        let s = shedding();
        for _ in 0..19 {
            s.record(false);
        }
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(!s.is_shedding());
        s.record(false);
        assert!(s.is_shedding(), "the twentieth request in the window");
    }

    #[tokio::test(start_paused = true)]
    async fn zero_sustain_is_sustained_at_once_and_threshold_one_never() {
        let config = SheddingConfig {
            sustain: Duration::ZERO,
            min_requests: 1,
            ..SheddingConfig::default()
        };
        let s = Shedding::new(config).unwrap();
        s.record(false);
        assert!(s.is_sustained());
        let never = Shedding::new(SheddingConfig {
            threshold: 1.0,
            ..config
        })
        .unwrap();
        never.record(false);
        assert!(!never.is_shedding());
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = |c: SheddingConfig| Shedding::new(c).unwrap_err();
        let d = SheddingConfig::default();
        assert_eq!(
            bad(SheddingConfig { window: MS, ..d }),
            InvalidShedding::Window(MS)
        );
        assert!(matches!(
            bad(SheddingConfig {
                threshold: 1.5,
                ..d
            }),
            InvalidShedding::Threshold(_)
        ));
        assert!(matches!(
            bad(SheddingConfig {
                threshold: f64::NAN,
                ..d
            }),
            InvalidShedding::Threshold(_)
        ));
        assert!(
            bad(SheddingConfig {
                threshold: -0.1,
                ..d
            })
            .to_string()
            .contains("between 0 and 1")
        );
    }
}
