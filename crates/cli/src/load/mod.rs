//! `backstop load`: an open-loop load driver for the payment service.
//!
//! Requests start on schedule (`--rate` per second for `--duration`) whether or not earlier ones
//! have finished, so a slow server cannot slow the offered load down and hide its own latency
//! (coordinated omission). At most `--concurrency` logical requests are in flight; one scheduled
//! while that many are running is counted as `skipped`, not delayed. Each logical request is a
//! new order with its own idempotency key, driven by the chosen [`PolicyKind`]: `backstop`
//! sends it through the library's client stack ([`stack`]), `naive` through a plain loop.

mod logical;
mod policy;
mod report;
mod series;
mod stack;
mod target;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use backstop::client::Destination;
use backstop::retry::switch::DEFAULT_POLL;
use backstop::retry::{AdaptiveThrottle, Backoff, Jitter, RetryBudget, RetrySwitch};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use self::logical::Logical;
use self::policy::{Driver, PolicyKind};
use self::report::Tally;
use self::series::Series;
use self::stack::Hedge;
use self::target::Target;

/// Most logical requests one run may schedule: a typo in `--rate` or `--duration` must not
/// start a run that never ends.
const MAX_REQUESTS: u64 = 100_000_000;

/// Flags of `backstop load`.
#[derive(Debug, Clone, Args)]
pub(crate) struct LoadArgs {
    /// The service: `http://HOST:PORT` (the payment service's HTTP API) or `grpc://HOST:PORT`
    /// (its gRPC API).
    #[arg(long, value_name = "URL", value_parser = Target::parse)]
    target: Target,
    /// Logical requests started per second.
    #[arg(long, value_name = "PER_SEC", default_value_t = 100.0, value_parser = parse_rate)]
    rate: f64,
    /// How long to keep starting requests, e.g. `5s`, `1m`.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    duration: Duration,
    /// Offer the same rate for this long first, leaving it out of the summary: connections are
    /// opened and the service's slow start has passed before anything is measured (`--series`
    /// covers it too, from its first row).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_warmup)]
    warmup: Duration,
    /// Most logical requests in flight at once.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    concurrency: u32,
    /// The client behaviour: `backstop` (the library's client stack: one key, one deadline,
    /// budgeted retries, hedging, transparent retries) or `naive` (3 attempts, no budget, no
    /// jitter, a fresh key per attempt; for comparison only).
    #[arg(long, value_enum, default_value_t = PolicyKind::Backstop)]
    policy: PolicyKind,
    /// Put the stack's circuit breaker in front of the service (`backstop` policy only). Off by
    /// default: once open it stops sending, which measures the breaker instead of the service.
    #[arg(long)]
    breaker: bool,
    /// Deadline of each logical request (sent as `grpc-timeout`).
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
    timeout: Duration,
    /// Never hedge an attempt sooner than this, e.g. `100ms`, whatever the rolling p95 (a floor
    /// under the p95, unlike a gRPC `hedgingDelay`, which is the delay itself; `backstop` policy
    /// only). Unset: hedge at the p95.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    hedge_delay: Option<Duration>,
    /// Hedge every attempt still unanswered after exactly this long, e.g. `150ms` (a gRPC
    /// `hedgingDelay`, whatever the latency does; `backstop` policy only). Unset: hedge at the
    /// rolling p95 (see `--hedge-delay`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, conflicts_with = "hedge_delay")]
    fixed_hedge_delay: Option<Duration>,
    /// Take away the retry budget: retries and hedges then stop only on the attempt limit and
    /// the storm alarm (`backstop` policy only; for comparison).
    #[arg(long)]
    no_retry_budget: bool,
    /// Most attempts in flight to the service at once (`Destination::max_in_flight`; the
    /// others wait in the client, counted by `rpc_client_pending_requests`, whose peak the
    /// summary reports as `client_pending_peak`; `backstop` policy only), as an HTTP/2
    /// connection's stream limit or a fixed pool would impose.
    #[arg(long, value_name = "N")]
    max_in_flight: Option<std::num::NonZeroUsize>,
    /// Jitter the naive loop's backoff with the library's mode: `none`, `full`, `equal` or
    /// `decorrelated` (`naive` policy only; unset: its fixed 50 ms, 100 ms delays).
    #[arg(long, value_name = "MODE", value_parser = parse_jitter)]
    jitter: Option<Jitter>,
    /// First delay of the naive loop's backoff, doubled each retry (`naive` policy only).
    #[arg(long, value_name = "DURATION", default_value = "50ms", value_parser = parse_duration)]
    backoff: Duration,
    /// Reject attempts locally, before they are sent, with client-side adaptive throttling
    /// (K = 2 over 2 minutes) while the service refuses load (`backstop` policy only).
    #[arg(long)]
    throttle: bool,
    /// Switch the storm alarm off: retries and hedges then stop only on the retry budget
    /// (`backstop` policy only; for comparison).
    #[arg(long)]
    no_storm_alarm: bool,
    /// Follow the fleet's retry switch kept in this Redis (`backstop retries off|on|ratio R`;
    /// `backstop` policy only).
    #[arg(long, value_name = "URL")]
    retry_switch_redis: Option<String>,
    /// The retry switch's key.
    #[arg(long, value_name = "KEY", default_value = backstop::retry::switch::DEFAULT_KEY)]
    retry_switch_key: String,
    /// Bearer API key, when the service requires one.
    #[arg(long, value_name = "KEY", env = "BACKSTOP_API_KEY")]
    api_key: Option<String>,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Also write per-interval counts (attempts sent by kind, answers by outcome, p50/p99 of
    /// the requests that succeeded) to this CSV file: one row per second (wider for runs
    /// longer than five minutes).
    #[arg(long, value_name = "PATH")]
    series: Option<std::path::PathBuf>,
    /// Width of the series' intervals, e.g. `100ms` (at least 10 ms; widened for long runs
    /// so that a series keeps at most a few hundred rows).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_interval)]
    series_interval: Duration,
}

/// Runs the load and prints the summary.
pub(crate) async fn run(args: LoadArgs) -> Result<(), Box<dyn std::error::Error>> {
    let measured = (args.rate * args.duration.as_secs_f64()).ceil() as u64;
    if measured == 0 {
        return Err("--rate x --duration schedules no request".into());
    }
    let warmup = (args.rate * args.warmup.as_secs_f64()).ceil() as u64;
    let total = measured.saturating_add(warmup);
    if total > MAX_REQUESTS {
        return Err(format!(
            "--rate x (--warmup + --duration) schedules {total} requests; at most \
             {MAX_REQUESTS} per run"
        )
        .into());
    }
    let mut destination = destination(&args);
    // Kept for the run: dropping it stops the watch.
    let _switch_watch = match &args.retry_switch_redis {
        Some(url) => {
            let switch = RetrySwitch::new();
            let watch = switch
                .watch_redis(url, args.retry_switch_key.clone(), DEFAULT_POLL)
                .map_err(|e| format!("--retry-switch-redis {url:?}: {e}"))?;
            destination = destination.retry_switch(Some(switch));
            Some(watch)
        }
        None => None,
    };
    let naive_backoff = match args.jitter {
        // A cap past every delay 3 attempts draw: the ceilings stay base and 2 x base.
        Some(jitter) => Some(
            Backoff::new(args.backoff, args.backoff * 8, jitter, Duration::ZERO)
                .map_err(|e| format!("--backoff: {e}"))?,
        ),
        None => None,
    };
    let driver = Driver::new(
        args.policy,
        &args.target,
        args.api_key.clone(),
        args.timeout,
        destination.clone(),
        Hedge {
            floor: args.hedge_delay.unwrap_or_default(),
            fixed: args.fixed_hedge_delay,
        },
        naive_backoff,
    )?;
    // The peak of the client's pending queue (what `rpc_client_pending_requests` shows),
    // sampled every 10 ms while the load runs.
    let pending_peak = Arc::new(AtomicU64::new(0));
    let _pending_watch = destination.call_slots().cloned().map(|slots| {
        let peak = pending_peak.clone();
        AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            loop {
                tick.tick().await;
                peak.fetch_max(slots.waiting() as u64, Ordering::Relaxed);
            }
        }))
    });
    // Opened before the run: a path that cannot be written fails now, not after the load.
    let series_file = match &args.series {
        Some(path) => Some(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot write --series {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let slots = Arc::new(Semaphore::new(args.concurrency as usize));
    let live = Arc::new(LiveCounts::default());
    let progress = progress_bar(total, live.clone());
    // Unique per run, so two runs against one service never collide on an order id.
    let run_id = uuid::Uuid::now_v7().simple().to_string();

    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let start = Instant::now();
    let series = series_file.is_some().then(|| {
        let run = args.duration + args.warmup;
        Arc::new(std::sync::Mutex::new(Series::new(
            start,
            run,
            args.series_interval,
        )))
    });
    let mut tally = Tally::new();
    let mut tasks = JoinSet::new();
    for i in 0..total {
        tokio::time::sleep_until(start + interval.mul_f64(i as f64)).await;
        // Reap finished tasks as we go, so memory follows the in-flight count, not the total.
        while let Some(done) = tasks.try_join_next() {
            merge(&mut tally, done);
        }
        let counted = i >= warmup;
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if counted {
                tally.skipped();
            }
            progress.inc(1);
            continue;
        };
        let logical = Logical {
            order_id: format!("load-{run_id}-{i}"),
            amount_cents: 100 + i % 10_000,
        };
        let (driver, progress, live) = (driver.clone(), progress.clone(), live.clone());
        let series = series.clone();
        let timeout = args.timeout;
        tasks.spawn(async move {
            let mut tally = Tally::new();
            let started = Instant::now();
            driver.run(&logical, timeout, &mut tally).await;
            let ended = Instant::now();
            drop(slot);
            if let Some(series) = series
                && let (sent, Some(outcome)) = tally.last_request()
            {
                series
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .record(sent, outcome, started, ended);
            }
            live.add(&tally);
            progress.inc(1);
            // A warm-up request's tally is left out of the summary.
            if counted { tally } else { Tally::new() }
        });
    }
    while let Some(done) = tasks.join_next().await {
        merge(&mut tally, done);
    }
    let elapsed = start.elapsed().saturating_sub(args.warmup);
    progress.finish_and_clear();

    if let (Some(file), Some(series)) = (series_file, &series) {
        let series = series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = std::io::BufWriter::new(file);
        series
            .write_csv(&mut out)
            .and_then(|()| std::io::Write::flush(&mut out))
            .map_err(|e| format!("cannot write the series: {e}"))?;
    }
    let mut summary = tally.summary(elapsed, args.policy.as_str(), args.target.name());
    if args.policy == PolicyKind::Backstop {
        summary.storm_alarm(destination.spend().storm());
    }
    if destination.call_slots().is_some() {
        summary.client_pending_peak(pending_peak.load(Ordering::Relaxed));
    }
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print!("{}", summary.render());
    }
    tracing::debug!(
        logical = tally.logical_count(),
        ok = tally.ok_count(),
        "load finished"
    );
    Ok(())
}

/// The destination every logical request of a `backstop` run shares, as the flags configure
/// it: no breaker unless `--breaker`, the storm alarm unless `--no-storm-alarm`, adaptive
/// throttling with `--throttle`.
fn destination(args: &LoadArgs) -> Destination {
    let mut destination = Destination::new("payment");
    if !args.breaker {
        // Once open it stops sending, which measures the breaker instead of the service.
        destination = destination.breaker(None);
    }
    if args.no_storm_alarm {
        destination = destination.storm_alarm(None);
    }
    if args.throttle {
        destination = destination.throttle(Some(AdaptiveThrottle::default()));
    }
    if args.no_retry_budget {
        destination = destination.budget(RetryBudget::unlimited());
    }
    destination.max_in_flight(args.max_in_flight)
}

/// Aborts the task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn merge(tally: &mut Tally, done: Result<Tally, tokio::task::JoinError>) {
    match done {
        Ok(t) => tally.merge(t),
        Err(e) => tracing::error!(error = %e, "a load task failed"),
    }
}

/// Counts shown on the progress bar while the load runs (the summary's own counts are merged
/// from each request's tally at the end).
#[derive(Debug, Default)]
struct LiveCounts {
    /// Logical requests that ended other than `ok`.
    errors: AtomicU64,
    /// Retries sent so far.
    retries: AtomicU64,
}

impl LiveCounts {
    /// Adds one finished logical request's tally.
    fn add(&self, tally: &Tally) {
        let errors = tally.logical_count().saturating_sub(tally.ok_count());
        self.errors.fetch_add(errors, Ordering::Relaxed);
        self.retries
            .fetch_add(tally.retry_count(), Ordering::Relaxed);
    }
}

/// Drawn on stderr (hidden when stderr is not a terminal): elapsed time, progress, the rate of
/// finished logical requests, and the errors and retries so far.
fn progress_bar(total: u64, live: Arc<LiveCounts>) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(progress_style(live));
    bar
}

fn progress_style(live: Arc<LiveCounts>) -> ProgressStyle {
    let template = "{elapsed_precise} [{bar:40}] {pos}/{len} {per_sec} {live}";
    let style =
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    style
        .with_key(
            "live",
            move |_: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(
                    w,
                    "errors {} retries {}",
                    live.errors.load(Ordering::Relaxed),
                    live.retries.load(Ordering::Relaxed)
                );
            },
        )
        .progress_chars("=> ")
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let rate: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of requests per second"))?;
    if !rate.is_finite() || rate <= 0.0 || rate > 10_000_000.0 {
        return Err(format!("rate must be in (0, 10000000], got {s}"));
    }
    Ok(rate)
}

fn parse_jitter(s: &str) -> Result<Jitter, String> {
    match s {
        "none" => Ok(Jitter::None),
        "full" => Ok(Jitter::Full),
        "equal" => Ok(Jitter::Equal),
        "decorrelated" => Ok(Jitter::Decorrelated),
        _ => Err(format!(
            "{s:?} is not a jitter mode: none, full, equal or decorrelated"
        )),
    }
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(10) {
        return Err(format!("{s} is shorter than 10ms"));
    }
    Ok(d)
}

fn parse_warmup(s: &str) -> Result<Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if d.is_zero() => Ok(d),
        _ => parse_duration(s),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 5s or 1m: {e}"))?;
    if d.is_zero() {
        return Err("the duration must be positive".to_owned());
    }
    if d > Duration::from_secs(24 * 3600) {
        return Err(format!("{s} is longer than a day"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A terminal that keeps what is drawn on it.
    #[derive(Debug, Default, Clone)]
    struct Screen(Arc<std::sync::Mutex<String>>);

    impl indicatif::TermLike for Screen {
        fn width(&self) -> u16 {
            160
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.0.lock().unwrap().push_str(s);
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_progress_bar_shows_rate_errors_and_retries() {
        let live = Arc::new(LiveCounts::default());
        let screen = Screen::default();
        let bar = ProgressBar::with_draw_target(
            Some(10),
            indicatif::ProgressDrawTarget::term_like(Box::new(screen.clone())),
        );
        bar.set_style(progress_style(live.clone()));
        live.errors.fetch_add(3, Ordering::Relaxed);
        live.retries.fetch_add(7, Ordering::Relaxed);
        bar.inc(4);
        bar.force_draw();
        let drawn = screen.0.lock().unwrap().clone();
        assert!(drawn.contains("4/10"), "{drawn:?}");
        assert!(drawn.contains("/s"), "the rate: {drawn:?}");
        assert!(drawn.contains("errors 3 retries 7"), "{drawn:?}");
    }

    #[test]
    fn rates_and_durations_are_checked() {
        assert_eq!(parse_rate("250"), Ok(250.0));
        for bad in ["0", "-1", "NaN", "inf", "x", "1e12"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["0s", "5", "2 days", "-1s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_interval("100ms"), Ok(Duration::from_millis(100)));
        assert!(parse_interval("5ms").is_err());
        assert_eq!(parse_jitter("equal"), Ok(Jitter::Equal));
        assert!(parse_jitter("some").is_err());
        assert_eq!(parse_warmup("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_warmup("2s"), Ok(Duration::from_secs(2)));
        for bad in ["5", "2 days", "-1s"] {
            assert!(parse_warmup(bad).is_err(), "{bad}");
        }
    }
}
