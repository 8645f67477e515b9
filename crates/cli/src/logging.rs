//! Log output: JSON lines for machines, readable lines for a person at a terminal.

use std::fmt;
use std::io::IsTerminal;

use clap::ValueEnum;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// A layer installed beside the log output (the span exporter of `serve --otlp-endpoint`).
pub(crate) type ExtraLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// The environment variable that filters the logs.
const FILTER_VAR: &str = "RUST_LOG";

/// How log lines are written on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// One JSON object per line (for log collectors).
    Json,
    /// Human-readable lines (coloured on a terminal).
    Text,
}

impl LogFormat {
    /// `chosen`, else text when stderr is a terminal and JSON otherwise (a pipe or a file is
    /// read by a program).
    pub(crate) fn resolve(chosen: Option<LogFormat>, stderr_is_terminal: bool) -> LogFormat {
        chosen.unwrap_or(if stderr_is_terminal {
            LogFormat::Text
        } else {
            LogFormat::Json
        })
    }
}

/// `RUST_LOG` does not parse as a filter.
#[derive(Debug)]
pub(crate) struct InvalidFilter {
    value: String,
    reason: String,
}

impl fmt::Display for InvalidFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid {FILTER_VAR} {:?}: {} (expected e.g. `info` or `warn,backstop=debug`)",
            self.value, self.reason
        )
    }
}

impl std::error::Error for InvalidFilter {}

/// The filter `value` (the content of `RUST_LOG`) describes; `default_level` when it is unset
/// or blank. An invalid directive is an error, not silently dropped: an operator who typed
/// `RUST_LOG=debgu` should learn it at start-up rather than wonder where the logs went.
pub(crate) fn filter(value: Option<&str>, default_level: &str) -> Result<EnvFilter, InvalidFilter> {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(EnvFilter::new(default_level)),
        Some(value) => EnvFilter::builder()
            .parse(value)
            .map_err(|error| InvalidFilter {
                value: value.to_owned(),
                reason: error.to_string(),
            }),
    }
}

/// Installs the global subscriber: logs on stderr in `format` (see [`LogFormat::resolve`]),
/// and `extra` when given, filtered by `RUST_LOG` (default `default_level`).
pub(crate) fn init(
    format: Option<LogFormat>,
    default_level: &str,
    extra: Option<ExtraLayer>,
) -> Result<(), InvalidFilter> {
    let value = std::env::var(FILTER_VAR).ok();
    let filter = filter(value.as_deref(), default_level)?;
    let terminal = std::io::stderr().is_terminal();
    let output = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let subscriber = tracing_subscriber::registry().with(extra).with(filter);
    match LogFormat::resolve(format, terminal) {
        LogFormat::Json => subscriber.with(output.json()).init(),
        LogFormat::Text => subscriber.with(output.with_ansi(terminal)).init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_on_a_terminal_json_elsewhere_unless_chosen() {
        assert_eq!(LogFormat::resolve(None, true), LogFormat::Text);
        assert_eq!(LogFormat::resolve(None, false), LogFormat::Json);
        assert_eq!(
            LogFormat::resolve(Some(LogFormat::Json), true),
            LogFormat::Json
        );
        assert_eq!(
            LogFormat::resolve(Some(LogFormat::Text), false),
            LogFormat::Text
        );
    }

    #[test]
    fn an_unset_or_blank_filter_takes_the_default() {
        assert_eq!(filter(None, "warn").unwrap().to_string(), "warn");
        assert_eq!(filter(Some("  "), "info").unwrap().to_string(), "info");
        assert_eq!(
            filter(Some("warn,backstop=debug"), "info")
                .unwrap()
                .to_string(),
            "backstop=debug,warn"
        );
    }

    #[test]
    fn an_invalid_filter_is_refused_with_its_value() {
        for bad in ["backstop=loud", "[{", "info,=debug="] {
            let error = filter(Some(bad), "info").unwrap_err().to_string();
            assert!(error.starts_with("invalid RUST_LOG"), "{error}");
            assert!(error.contains(bad), "{error}");
            assert!(!error.contains('\n'), "{error}");
        }
    }
}
