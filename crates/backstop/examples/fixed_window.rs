//! A fixed window lets twice its limit through across a window boundary; a token bucket does
//! not.
//!
//! `cargo run -p backstop --example fixed_window` offers two limiters of "100 requests per
//! minute" the chapter's boundary case: 100 requests in the last second of one minute
//! (12:00:59) and 100 in the first second of the next (12:01:00), 10 ms apart. Time is given
//! to both as numbers, so the figures are the same on every machine.
//!
//! - **fixed window:** a counter per calendar minute, reset when the minute changes: both
//!   hundreds pass, 200 requests in two seconds, twice what the downstream was promised.
//! - **token bucket:** the library's [`TokenBucket`] with one token per 600 ms and a burst of
//!   100: the first hundred take the full bucket, the second gets only what two seconds
//!   earned (about 3).
//!
//! It prints both counts and exits non-zero unless the fixed window passes 200 and the bucket
//! at most 104.
use std::num::NonZeroU32;
use std::time::Duration;

use backstop::admission::{Quota, TokenBucket};

/// The limit, per minute.
const LIMIT: u32 = 100;
const MINUTE: Duration = Duration::from_secs(60);

/// The naive limiter: a count per window, reset when a new window starts.
struct FixedWindow {
    window: Duration,
    limit: u32,
    /// The current window's index and the requests counted in it.
    current: (u128, u32),
}

impl FixedWindow {
    fn allow(&mut self, now: Duration) -> bool {
        let index = now.as_nanos() / self.window.as_nanos();
        if index != self.current.0 {
            self.current = (index, 0);
        }
        if self.current.1 < self.limit {
            self.current.1 += 1;
            true
        } else {
            false
        }
    }
}

fn main() {
    // 12:00:59.00 to 12:00:59.99, then 12:01:00.00 to 12:01:00.99 (minutes from 12:00).
    let arrivals: Vec<Duration> = (0..2 * LIMIT)
        .map(|i| Duration::from_secs(59) + Duration::from_millis(10 * u64::from(i)))
        .collect();

    let mut window = FixedWindow {
        window: MINUTE,
        limit: LIMIT,
        current: (0, 0),
    };
    let fixed = arrivals.iter().filter(|&&t| window.allow(t)).count();

    let burst = NonZeroU32::new(LIMIT).expect("not zero");
    let quota = Quota::with_period(MINUTE / LIMIT, burst).expect("a quota");
    let bucket = TokenBucket::with_quota(quota);
    let nanos = |t: &Duration| u64::try_from(t.as_nanos()).expect("within u64");
    let passed = arrivals
        .iter()
        .filter(|t| bucket.check_at(nanos(t)).is_ok())
        .count();

    println!("fixed window of {LIMIT}/min: {fixed} requests passed within 2 s across the boundary");
    println!("token bucket of {LIMIT}/min (burst {LIMIT}): {passed} requests passed within 2 s");
    if fixed != 200 || passed > 104 {
        eprintln!("expected 200 through the fixed window and at most 104 through the bucket");
        std::process::exit(1);
    }
    println!("ok: the fixed window let twice its limit through; the bucket held it");
}
