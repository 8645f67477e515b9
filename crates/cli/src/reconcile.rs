//! `backstop reconcile`: compares the PSP's charges with the payment store, and repairs with
//! `--apply`. The work is the payment crate's [`backstop_payment::reconcile`]; this is flags,
//! a progress indicator and the report.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use backstop_payment::config::StoreLocation;
use backstop_payment::reconcile::{
    Finding, Fix, Kind, Ledger, OrderRef, Outcome, PspApi, ReconcileError, Reconciler, Scan, Scope,
};
use clap::Args;
use clap::error::ErrorKind;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Exit status: nothing to fix.
pub(crate) const CLEAN: u8 = 0;
/// Exit status: discrepancies found that `--apply` fixes (a dry run), or that it fixed.
pub(crate) const FIXABLE: u8 = 3;
/// Exit status: something is left to a person (a finding with no automatic fix, or a fix
/// that failed).
pub(crate) const NEEDS_A_PERSON: u8 = 4;

/// Flags of `backstop reconcile`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Exit status: 0 nothing to fix; 3 discrepancies found that --apply fixes (dry run) or fixed \
(--apply); 4 something is left to a person (an orphan charge, a missing charge, a mismatch, \
or a fix that failed); 1 the run failed; 2 bad flags.")]
pub(crate) struct ReconcileArgs {
    /// Payment store: `sqlite://PATH`, a file path, or `postgres://USER@HOST:PORT/DB`.
    #[arg(long, value_name = "URL")]
    store: String,
    /// PSP base URL, e.g. http://127.0.0.1:8090.
    #[arg(long, value_name = "URL")]
    psp: String,
    /// Start of the window: an RFC 3339 time (2026-12-01T00:00:00Z), unix milliseconds, or a
    /// duration before now (24h). Default: 24h.
    #[arg(long, value_name = "TIME", conflicts_with = "orders")]
    since: Option<String>,
    /// End of the window (exclusive), in the same forms. Default: now.
    #[arg(long, value_name = "TIME", conflicts_with = "orders")]
    until: Option<String>,
    /// These orders instead of a window: MERCHANT:ORDER_ID, comma-separated.
    #[arg(long, value_name = "MERCHANT:ORDER", value_delimiter = ',')]
    orders: Vec<String>,
    /// Refund duplicates, mark orphaned intents succeeded and record each action.
    #[arg(long, conflicts_with = "dry_run")]
    apply: bool,
    /// Print the plan and change nothing (the default).
    #[arg(long)]
    dry_run: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Name recorded with each action. Default: the OS user ($USER).
    #[arg(long, value_name = "NAME")]
    operator: Option<String>,
}

/// What the flags ask for, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    store: StoreLocation,
    psp: String,
    scope: Scope,
    apply: bool,
    json: bool,
    operator: String,
}

impl ReconcileArgs {
    /// The plan, with `now_ms` as "now" and `user` as the default operator.
    pub(crate) fn plan(&self, now_ms: i64, user: Option<String>) -> Result<Plan, clap::Error> {
        let invalid = |e: String| clap::Error::raw(ErrorKind::InvalidValue, format!("{e}\n"));
        let store = StoreLocation::parse(&self.store).map_err(|e| invalid(e.to_string()))?;
        if !(self.psp.starts_with("http://") || self.psp.starts_with("https://")) {
            return Err(invalid(format!(
                "--psp must be an http:// URL, got {:?}",
                self.psp
            )));
        }
        let scope = if self.orders.is_empty() {
            let since = match &self.since {
                Some(t) => parse_time(t, now_ms).map_err(|e| invalid(format!("--since: {e}")))?,
                None => now_ms - 24 * 3600 * 1000,
            };
            let until = match &self.until {
                Some(t) => parse_time(t, now_ms).map_err(|e| invalid(format!("--until: {e}")))?,
                None => now_ms,
            };
            if until <= since {
                return Err(invalid("--until must be after --since".to_owned()));
            }
            Scope::Window {
                since_ms: since,
                until_ms: until,
            }
        } else {
            let orders = self
                .orders
                .iter()
                .map(|o| OrderRef::parse(o.trim()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(format!("--orders: {e}")))?;
            Scope::Orders(orders)
        };
        let operator = self
            .operator
            .clone()
            .or(user)
            .unwrap_or_else(|| "unknown".to_owned());
        if operator.is_empty() || operator.len() > 128 {
            return Err(invalid("--operator must be 1 to 128 bytes".to_owned()));
        }
        Ok(Plan {
            store,
            psp: self.psp.clone(),
            scope,
            apply: self.apply,
            json: self.json,
            operator,
        })
    }
}

/// The OS user, for the default operator.
pub(crate) fn os_user() -> Option<String> {
    ["USER", "LOGNAME", "USERNAME"]
        .into_iter()
        .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// RFC 3339, unix milliseconds, or a duration before `now_ms`.
fn parse_time(s: &str, now_ms: i64) -> Result<i64, String> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map_err(|_| format!("{s:?} is too large for unix milliseconds"));
    }
    if let Ok(at) = humantime::parse_rfc3339_weak(s) {
        return at
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .map_err(|_| format!("{s:?} is before 1970"));
    }
    match humantime::parse_duration(s) {
        Ok(ago) if ago <= Duration::from_secs(100 * 365 * 24 * 3600) => {
            Ok(now_ms - i64::try_from(ago.as_millis()).unwrap_or(i64::MAX))
        }
        _ => Err(format!(
            "{s:?} is not an RFC 3339 time, unix milliseconds, or a duration like 24h"
        )),
    }
}

/// Runs the plan; returns the exit status (see [`ReconcileArgs`]'s help).
pub(crate) async fn run(plan: Plan) -> Result<ExitCode, ReconcileError> {
    let reconciler = Reconciler::new(Ledger::open(&plan.store).await?, PspApi::new(&plan.psp)?);
    let bar = progress_bar();
    let scan = reconciler
        .scan(&plan.scope, &|p| match p.orders_total {
            Some(total) => {
                bar.set_length(total);
                bar.set_position(p.orders_done);
                bar.set_message("orders examined");
            }
            None => bar.set_message(format!("{} charges, {} intents read", p.charges, p.intents)),
        })
        .await;
    bar.finish_and_clear();
    let scan = scan?;
    let outcomes = if plan.apply {
        reconciler
            .apply(&scan.findings, &plan.operator, now_ms())
            .await
    } else {
        Vec::new()
    };
    let code = exit_code(&scan, &outcomes);
    if plan.json {
        let report = serde_json::json!({
            "mode": if plan.apply { "apply" } else { "dry_run" },
            "scope": scope_json(&plan.scope),
            "charges": scan.charges,
            "intents": scan.intents,
            "orders": scan.orders,
            "findings": scan.findings,
            "outcomes": outcomes,
            "exit_code": code,
        });
        println!("{report}");
    } else {
        print!("{}", table(&plan, &scan, &outcomes));
    }
    Ok(ExitCode::from(code))
}

fn exit_code(scan: &Scan, outcomes: &[Outcome]) -> u8 {
    let failed = outcomes.iter().any(|o| matches!(o, Outcome::Failed { .. }));
    if failed || scan.findings.iter().any(|f| f.fix.is_none()) {
        NEEDS_A_PERSON
    } else if scan.findings.is_empty() {
        CLEAN
    } else {
        FIXABLE
    }
}

/// A progress indicator on stderr, drawn only on a terminal.
fn progress_bar() -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed}] {wide_bar} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn scope_json(scope: &Scope) -> serde_json::Value {
    match scope {
        Scope::Window { since_ms, until_ms } => {
            serde_json::json!({ "since_ms": since_ms, "until_ms": until_ms })
        }
        Scope::Orders(orders) => serde_json::json!({ "orders": orders }),
    }
}

fn money(cents: i64, currency: &str) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    let cents = cents.unsigned_abs();
    format!("{sign}{}.{:02} {currency}", cents / 100, cents % 100)
}

fn action(finding: &Finding) -> String {
    match &finding.fix {
        None => "left to a person".to_owned(),
        Some(Fix::Refund {
            amount_cents,
            release_intent,
            ..
        }) => {
            let mut text = if *amount_cents > 0 {
                format!("refund {}", money(*amount_cents, &finding.currency))
            } else {
                "already refunded".to_owned()
            };
            if let Some(intent) = release_intent {
                text.push_str(&format!(", mark {intent} failed"));
            }
            text
        }
        Some(Fix::MarkSucceeded { .. }) => "mark succeeded".to_owned(),
    }
}

/// The human report: scope, what was read, one line per finding, the outcome of each fix and
/// a summary line.
fn table(plan: &Plan, scan: &Scan, outcomes: &[Outcome]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let scope = match &plan.scope {
        Scope::Window { since_ms, until_ms } => {
            let at = |ms: &i64| {
                u64::try_from(*ms)
                    .ok()
                    .and_then(|ms| UNIX_EPOCH.checked_add(Duration::from_millis(ms)))
                    .map(|t| humantime::format_rfc3339_millis(t).to_string())
                    .unwrap_or_else(|| ms.to_string())
            };
            format!("window {} .. {}", at(since_ms), at(until_ms))
        }
        Scope::Orders(orders) => format!("{} orders", orders.len()),
    };
    let mode = if plan.apply { "apply" } else { "dry run" };
    let _ = writeln!(
        out,
        "reconcile ({mode}): {scope}; read {} charges, {} intents; examined {} orders",
        scan.charges, scan.intents, scan.orders
    );
    if scan.findings.is_empty() {
        let _ = writeln!(out, "nothing to fix");
        return out;
    }
    let rows: Vec<[String; 6]> = scan
        .findings
        .iter()
        .map(|f| {
            [
                f.kind.as_str().to_owned(),
                format!("{}:{}", f.merchant_id, f.order_id),
                f.intent_id.clone().unwrap_or_else(|| "-".into()),
                f.charge_id.clone().unwrap_or_else(|| "-".into()),
                money(f.amount_cents, &f.currency),
                action(f),
            ]
        })
        .collect();
    let header = ["KIND", "ORDER", "INTENT", "CHARGE", "AMOUNT", "ACTION"].map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    for outcome in outcomes {
        let _ = match outcome {
            Outcome::Applied { record, recorded } => writeln!(
                out,
                "applied: {} {}{}{}",
                record.kind.as_str(),
                record.charge_id,
                record
                    .refund_id
                    .as_ref()
                    .map(|r| format!(" refund {r}"))
                    .unwrap_or_default(),
                if *recorded { "" } else { " (recorded before)" }
            ),
            Outcome::Skipped { charge_id } => {
                writeln!(out, "skipped: {charge_id} (settled meanwhile)")
            }
            Outcome::Failed { charge_id, error } => writeln!(out, "failed: {charge_id}: {error}"),
        };
    }
    let mut counts: std::collections::BTreeMap<Kind, usize> = Default::default();
    for f in &scan.findings {
        *counts.entry(f.kind).or_default() += 1;
    }
    let counts: Vec<String> = counts
        .iter()
        .map(|(kind, n)| format!("{} {n}", kind.as_str()))
        .collect();
    let fixable = scan.findings.iter().filter(|f| f.fix.is_some()).count();
    let _ = writeln!(
        out,
        "summary: {}; {fixable} fixable{}, {} left to a person",
        counts.join(", "),
        if plan.apply { "" } else { " with --apply" },
        scan.findings.len() - fixable
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        args: ReconcileArgs,
    }

    const NOW: i64 = 1_800_000_000_000;

    fn parse(args: &[&str]) -> Result<Plan, clap::Error> {
        let mut argv = vec![
            "reconcile",
            "--store",
            "b.db",
            "--psp",
            "http://127.0.0.1:1",
        ];
        argv.extend_from_slice(args);
        T::try_parse_from(argv)?
            .args
            .plan(NOW, Some("alice".into()))
    }

    #[test]
    fn defaults_are_a_dry_run_of_the_last_day() {
        let plan = parse(&[]).unwrap();
        assert!(!plan.apply);
        assert_eq!(plan.operator, "alice");
        assert_eq!(
            plan.scope,
            Scope::Window {
                since_ms: NOW - 86_400_000,
                until_ms: NOW
            }
        );
    }

    #[test]
    fn times_in_three_forms() {
        assert_eq!(parse_time("1000", NOW), Ok(1000));
        assert_eq!(parse_time("1h", NOW), Ok(NOW - 3_600_000));
        assert_eq!(parse_time("1970-01-01T00:00:01Z", NOW), Ok(1000));
        assert!(parse_time("yesterday", NOW).is_err());
        assert!(parse_time("", NOW).is_err());
        assert!(parse_time("99999999999999999999", NOW).is_err());
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(parse(&["--since", "5", "--until", "5"]).is_err());
        assert!(parse(&["--since", "soon"]).is_err());
        assert!(parse(&["--orders", "nocolon"]).is_err());
        assert!(parse(&["--orders", "m:o", "--since", "1h"]).is_err());
        assert!(parse(&["--apply", "--dry-run"]).is_err());
        assert!(parse(&["--operator", ""]).is_err());
        let plan = parse(&["--orders", "m:o1,m:o2", "--apply", "--operator", "bob"]).unwrap();
        assert!(plan.apply);
        assert_eq!(plan.operator, "bob");
        assert!(matches!(plan.scope, Scope::Orders(ref o) if o.len() == 2));
        let mut argv = vec!["reconcile", "--store", "x://y", "--psp", "http://h"];
        argv.push("--json");
        assert!(
            T::try_parse_from(argv)
                .unwrap()
                .args
                .plan(NOW, None)
                .is_err()
        );
    }

    fn finding(kind: Kind, fix: Option<Fix>) -> Finding {
        Finding {
            kind,
            merchant_id: "m".into(),
            order_id: "o".into(),
            intent_id: None,
            charge_id: Some("ch_1".into()),
            amount_cents: 100,
            currency: "USD".into(),
            detail: String::new(),
            fix,
        }
    }

    #[test]
    fn exit_status_says_whether_a_person_is_needed() {
        let scan = |findings| Scan {
            charges: 1,
            intents: 1,
            orders: 1,
            findings,
        };
        let refund = Some(Fix::Refund {
            charge_id: "ch_1".into(),
            amount_cents: 100,
            idempotency_key: "k".into(),
            release_intent: None,
        });
        assert_eq!(exit_code(&scan(vec![]), &[]), CLEAN);
        let fixable = scan(vec![finding(Kind::DuplicateCharge, refund.clone())]);
        assert_eq!(exit_code(&fixable, &[]), FIXABLE);
        let failed = Outcome::Failed {
            charge_id: "ch_1".into(),
            error: "psp down".into(),
        };
        assert_eq!(exit_code(&fixable, &[failed]), NEEDS_A_PERSON);
        let manual = scan(vec![
            finding(Kind::DuplicateCharge, refund),
            finding(Kind::OrphanCharge, None),
        ]);
        assert_eq!(exit_code(&manual, &[]), NEEDS_A_PERSON);
        let plan = parse(&[]).unwrap();
        let text = table(&plan, &manual, &[]);
        assert!(text.contains("orphan_charge"), "{text}");
        assert!(text.contains("left to a person"), "{text}");
        assert!(
            text.contains("1 fixable with --apply, 1 left to a person"),
            "{text}"
        );
    }

    #[test]
    fn money_has_two_decimals() {
        assert_eq!(money(1250, "USD"), "12.50 USD");
        assert_eq!(money(5, "EUR"), "0.05 EUR");
    }
}
