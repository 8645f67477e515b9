//! `backstop serve --config FILE`: every flag of `serve` from a TOML file, and
//! `--print-config`, the settings in effect.
//!
//! The file's keys are the flags' long names (`max-inflight = 64`, `store = "..."`,
//! `api-key = ["acme=..."]`, `no-slow-start = true`). Precedence, highest first: a flag on the
//! command line, its environment variable (`BACKSTOP_MAX_INFLIGHT`, ...), the file, the
//! default. A key that names no flag is an error naming the key; so is a value of the wrong
//! type, or one the flag's own parser refuses (with the file and key in the message).
//!
//! The file's settings are applied by handing them to the same parser as the command line, as
//! `--key=value` for each setting that neither a flag nor a variable gave, so a setting means
//! exactly what its flag means and is checked by the same rules.
//!
//! One key is not a flag: the `[policies]` table, the service's method table (see
//! [`crate::serve_policies`]), which only the file can hold.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Read as _;
use std::path::Path;

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};
use toml::{Table, Value};

/// Largest config file read: a deployment's settings fit in far less.
const MAX_FILE: u64 = 1 << 20;

/// Flags that are not settings: they say where the settings come from or what to do with them.
const NOT_SETTINGS: [&str; 3] = ["config", "print-config", "help"];

/// Settings whose values are secrets: never printed.
const SECRETS: [&str; 1] = ["api-key"];

/// The key of the method table, the one key that is not a flag.
pub(crate) const POLICIES: &str = "policies";

/// What a config file holds: its flags' settings and its method table.
#[derive(Debug, Default)]
pub(crate) struct FileSettings {
    /// `--key=value` arguments for every setting that the command line and the environment
    /// left unset.
    pub(crate) args: Vec<OsString>,
    /// The `[policies]` table, as written.
    pub(crate) policies: Option<Value>,
}

/// The settings `file` holds (`serve` is the subcommand's definition, `matches` what the
/// command line and environment gave it).
pub(crate) fn file_args(
    file: &Path,
    serve: &Command,
    matches: &ArgMatches,
) -> Result<FileSettings, clap::Error> {
    let mut table = read(file)?;
    let policies = table.remove(POLICIES);
    if policies.as_ref().is_some_and(|p| !p.is_table()) {
        return Err(invalid(file, "`policies` is a table: [policies]"));
    }
    let mut args = Vec::new();
    for (key, value) in &table {
        let arg = serve
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()) && !NOT_SETTINGS.contains(&key.as_str()))
            .ok_or_else(|| {
                invalid(
                    file,
                    &format!(
                        "unknown key `{key}`; the keys are the flags of `backstop serve`: {}",
                        known(serve)
                    ),
                )
            })?;
        let id = arg.get_id().as_str();
        if matches!(
            matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let values = match (arg.get_action(), value) {
            (ArgAction::SetTrue, Value::Boolean(true)) => vec![format!("--{key}")],
            (ArgAction::SetTrue, Value::Boolean(false)) => Vec::new(),
            (ArgAction::SetTrue, _) => {
                return Err(invalid(file, &format!("`{key}` is true or false")));
            }
            (ArgAction::Append, Value::Array(items)) => items
                .iter()
                .map(|item| item.as_str().map(|v| format!("--{key}={v}")))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid(file, &format!("`{key}` is a list of strings")))?,
            (_, value) => vec![format!(
                "--{key}={}",
                scalar(value).ok_or_else(|| invalid(file, &format!("`{key}` takes one value")))?
            )],
        };
        // Each setting alone first, so that a value the flag refuses names the file and key.
        for value in &values {
            serve
                .clone()
                .no_binary_name(true)
                .try_get_matches_from([value])
                .map_err(|e| invalid(file, &format!("`{key}`: {}", first_line(&e.to_string()))))?;
        }
        args.extend(values.into_iter().map(OsString::from));
    }
    Ok(FileSettings { args, policies })
}

/// A config file's error, naming the file, as clap reports a flag's.
pub(crate) fn file_error(file: &Path, message: &str) -> clap::Error {
    invalid(file, message)
}

/// The file as a TOML table.
pub(crate) fn read(file: &Path) -> Result<Table, clap::Error> {
    let mut text = String::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(MAX_FILE + 1).read_to_string(&mut text))
        .map_err(|e| invalid(file, &format!("cannot read it: {e}")))?;
    if text.len() as u64 > MAX_FILE {
        return Err(invalid(file, "larger than 1 MiB"));
    }
    text.parse::<Table>()
        .map_err(|e| invalid(file, &format!("not TOML: {}", e.to_string().trim_end())))
}

/// A setting's value as its flag takes it.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Integer(i) => Some(i.to_string()),
        Value::Float(f) => Some(f.to_string()),
        _ => None,
    }
}

fn known(serve: &Command) -> String {
    serve
        .get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| !NOT_SETTINGS.contains(l))
        .collect::<Vec<_>>()
        .join(", ")
}

fn first_line(s: &str) -> &str {
    s.trim_start_matches("error: ")
        .lines()
        .next()
        .unwrap_or_default()
}

fn invalid(file: &Path, message: &str) -> clap::Error {
    clap::Error::raw(
        ErrorKind::InvalidValue,
        format!("config file {}: {message}\n", file.display()),
    )
}

/// The settings in effect as a config file (TOML), each with where it came from: the command
/// line, an environment variable, the file (`from_file`: the keys taken from it) or the
/// default, and the method table in effect (`policies`: the file's table as written, else
/// the service's own, shown as comments). Secrets are left out (the merchants of
/// `extra_merchants` and of the `api-key` flags are named, their keys never); passwords in
/// URLs are masked.
pub(crate) fn print(
    serve: &Command,
    matches: &ArgMatches,
    from_file: &BTreeSet<String>,
    merchants: &[String],
    policies: (Option<&Value>, &backstop::policy::MethodPolicies),
) -> String {
    let mut out = String::from("# backstop serve: the settings in effect\n");
    for arg in serve.get_arguments() {
        let Some(key) = arg.get_long() else { continue };
        if NOT_SETTINGS.contains(&key) {
            continue;
        }
        let id = arg.get_id().as_str();
        let source = if from_file.contains(key) {
            "config file".to_owned()
        } else {
            match matches.value_source(id) {
                Some(ValueSource::CommandLine) => "command line".to_owned(),
                Some(ValueSource::EnvVariable) => format!(
                    "environment ({})",
                    arg.get_env()
                        .map(|e| e.to_string_lossy())
                        .unwrap_or_default()
                ),
                Some(ValueSource::DefaultValue) => "default".to_owned(),
                _ => "unset".to_owned(),
            }
        };
        let raw: Vec<String> = matches
            .get_raw(id)
            .map(|values| values.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        if SECRETS.contains(&key) {
            let _ = writeln!(out, "# {key}: not shown ({} given; {source})", raw.len());
            continue;
        }
        let line = match arg.get_action() {
            ArgAction::SetTrue => format!("{key} = {}", matches.get_flag(id)),
            ArgAction::Append => format!(
                "{key} = [{}]",
                raw.iter()
                    .map(|v| quoted(&mask(v)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => match raw.first() {
                None => format!("# {key} ="),
                Some(v) if v.parse::<i64>().is_ok() => format!("{key} = {v}"),
                Some(v) => format!("{key} = {}", quoted(&mask(v))),
            },
        };
        let _ = writeln!(out, "{line:<48} # {source}");
    }
    if !merchants.is_empty() {
        let _ = writeln!(
            out,
            "# merchants with API keys (from every source): {}",
            merchants.join(", ")
        );
    }
    let (written, table) = policies;
    let _ = writeln!(out, "\n# the method table in effect:");
    for line in table.to_string().lines() {
        let _ = writeln!(out, "#   {line}");
    }
    if let Some(Value::Table(section)) = written {
        let mut file = Table::new();
        file.insert(POLICIES.to_owned(), Value::Table(section.clone()));
        let _ = writeln!(out, "# from the config file:");
        out.push_str(&toml::to_string(&file).unwrap_or_default());
    }
    out
}

fn quoted(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// `s` with the password of a URL's user info, and any `password=` parameter, masked.
fn mask(s: &str) -> String {
    let mut out = s.to_owned();
    if let Some((scheme, rest)) = s.split_once("://") {
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        if let Some((creds, host)) = rest[..authority_end].rsplit_once('@') {
            let user = creds.split(':').next().unwrap_or_default();
            let masked = if creds.contains(':') {
                format!("{user}:***")
            } else {
                user.to_owned()
            };
            out = format!("{scheme}://{masked}@{host}{}", &rest[authority_end..]);
        }
    }
    // `password=` in a query or a key-value connection string.
    let mut masked = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find("password=") {
        let value_start = at + "password=".len();
        masked.push_str(&rest[..value_start]);
        masked.push_str("***");
        let tail = &rest[value_start..];
        rest = &tail[tail.find(['&', ' ']).unwrap_or(tail.len())..];
    }
    masked.push_str(rest);
    masked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked_and_the_rest_kept() {
        assert_eq!(
            mask("postgres://app:s3cret@db:5432/pay?options=-c%20search_path%3Dx"),
            "postgres://app:***@db:5432/pay?options=-c%20search_path%3Dx"
        );
        assert_eq!(mask("postgres://app@db/pay"), "postgres://app@db/pay");
        assert_eq!(
            mask("redis://:pw@127.0.0.1:6379/0"),
            "redis://:***@127.0.0.1:6379/0"
        );
        assert_eq!(
            mask("postgres://db/pay?user=a&password=pw&sslmode=disable"),
            "postgres://db/pay?user=a&password=***&sslmode=disable"
        );
        assert_eq!(mask("backstop.db"), "backstop.db");
        assert_eq!(mask("x@y"), "x@y");
    }
}
