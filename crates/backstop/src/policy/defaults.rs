//! Every default of a method policy, each defined here and nowhere else, the backoff's
//! excepted.
//!
//! The client stack, the retry executor, the gRPC service-config reader and the server's
//! deadline layer all read these constants; none keeps a value of its own. A layer that needs a
//! value nobody configured takes it from here, so the value a call runs with can always be
//! looked up.
//!
//! A policy's backoff is a [`Backoff`](crate::retry::Backoff), whose defaults (base, cap,
//! floor, multiplier, jitter) are defined once beside it in [`retry`](crate::retry), as is
//! the shortest attempt worth starting
//! ([`DEFAULT_MIN_ATTEMPT`](crate::retry::DEFAULT_MIN_ATTEMPT)), a setting of the retry
//! policy alone: this module stays plain data that needs nothing of `retry`.

use std::time::Duration;

use crate::status::Code;

/// Budget of a logical request when neither its caller (an incoming deadline, a `Deadline`
/// extension, `grpc-timeout`) nor its method policy says how long it may take: the client
/// stack's deadline for such a call, the retry layer's when no deadline layer sits above it,
/// and the server's timeout for a request that arrives without `grpc-timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Attempts per logical request, first included, unless a policy says otherwise (`Safe` and
/// `Keyed` methods; an `Unsafe` method gets one).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// The most attempts a policy may allow, retries included: more would only pile load on a
/// dependency that failed four times already. A gRPC service config asking for more is read
/// as this, as gRPC itself does.
pub const MAX_ATTEMPTS_CAP: u32 = 5;

/// Codes retried unless a policy lists its own (`Safe` and `Keyed` methods; an `Unsafe`
/// method retries none): the server said "not now", nothing ran.
pub const DEFAULT_RETRYABLE: &[Code] = &[Code::Unavailable];

/// Idempotency key TTL for synchronous APIs.
pub const KEY_TTL_SYNC: Duration = Duration::from_secs(24 * 3_600);

/// Idempotency key TTL for payments.
pub const KEY_TTL_PAYMENTS: Duration = Duration::from_secs(7 * 24 * 3_600);

/// Idempotency key TTL for asynchronous jobs.
pub const KEY_TTL_ASYNC: Duration = Duration::from_secs(30 * 24 * 3_600);

/// Rate class of a method whose policy names none.
pub const DEFAULT_RATE_CLASS: &str = "default";

/// Largest answer body of a keyed method kept for replay, unless its policy or the server
/// says otherwise: 1 MiB. A larger answer is streamed to its caller as it comes and its record
/// keeps the status and headers only, so a retry learns that the request was carried out
/// (`replay_body_too_large`) instead of getting the body again.
pub const DEFAULT_MAX_REPLAY_BODY: usize = 1024 * 1024;

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// The names a default goes by, and the file (under `src/`) that defines it. A second
    /// definition of any of them, with the same value or another, is what this module exists
    /// to prevent.
    const NAMES: [(&str, &str); 17] = [
        ("DEFAULT_TIMEOUT", HERE),
        ("DEFAULT_MAX_ATTEMPTS", HERE),
        ("MAX_ATTEMPTS", HERE),
        ("MAX_ATTEMPTS_CAP", HERE),
        ("MAX_ATTEMPTS_LIMIT", HERE),
        ("DEFAULT_RETRYABLE", HERE),
        ("DEFAULT_BACKOFF_BASE", BACKOFF),
        ("DEFAULT_BACKOFF_CAP", BACKOFF),
        ("DEFAULT_BACKOFF_FLOOR", BACKOFF),
        ("DEFAULT_BACKOFF_MULTIPLIER", BACKOFF),
        ("DEFAULT_JITTER", BACKOFF),
        ("DEFAULT_MIN_ATTEMPT", RETRY_POLICY),
        ("KEY_TTL_SYNC", HERE),
        ("KEY_TTL_PAYMENTS", HERE),
        ("KEY_TTL_ASYNC", HERE),
        ("DEFAULT_RATE_CLASS", HERE),
        ("DEFAULT_MAX_REPLAY_BODY", HERE),
    ];
    const HERE: &str = "policy/defaults.rs";
    const BACKOFF: &str = "retry/backoff.rs";
    const RETRY_POLICY: &str = "retry/policy.rs";

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// Each default is a `const` in its home file and in no other source file of the crate
    /// (`admission/` excepted: its `DEFAULT_TIMEOUT` is how long a Redis round trip may take,
    /// not a request's deadline).
    #[test]
    fn each_default_is_defined_once_in_its_home() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let admission = src.join("admission");
        let mut found = Vec::new();
        for file in &files {
            if file.starts_with(&admission) {
                continue;
            }
            let text = std::fs::read_to_string(file).unwrap();
            for line in text.lines() {
                let line = line.trim_start();
                for (name, _) in NAMES {
                    let defines = ["const ", "static "].iter().any(|kw| {
                        line.split(kw)
                            .nth(1)
                            .is_some_and(|rest| rest.starts_with(&format!("{name}:")))
                    });
                    if defines && !line.starts_with("//") {
                        found.push((file.clone(), name));
                    }
                }
            }
        }
        for (name, home) in NAMES {
            let home = src.join(home);
            let places: Vec<_> = found.iter().filter(|(_, n)| *n == name).collect();
            let elsewhere: Vec<_> = places.iter().filter(|(f, _)| *f != home).collect();
            assert!(
                elsewhere.is_empty(),
                "{name} is also defined in {elsewhere:?}"
            );
        }
        // The scan sees each home's definitions (it would pass vacuously otherwise).
        for (name, home) in [
            ("DEFAULT_TIMEOUT", HERE),
            ("DEFAULT_JITTER", BACKOFF),
            ("DEFAULT_MIN_ATTEMPT", RETRY_POLICY),
        ] {
            let home = src.join(home);
            assert!(
                found.iter().any(|(f, n)| *f == home && *n == name),
                "{name}"
            );
        }
    }
}
