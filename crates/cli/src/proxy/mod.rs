//! `backstop proxy`: the library's server stack in front of a service written in any
//! language.
//!
//! - `args`: the flags and the settings they make;
//! - `policy`: the routes file, the library's method policy table as TOML, and
//!   `--check-config`;
//! - `route_match`: a route's `match`;
//! - `scope`: whose a key is (a hash of the caller's credentials, or the shared scope);
//! - `auto`: the default class, keyed when a write carries a key;
//! - `timeout_headers`: deadlines across the hop (timeout headers in, the same form out);
//! - `forward`: the service at the bottom of the stack, sending requests upstream;
//! - `endpoints`: the upstream endpoints, balanced, each behind a breaker of its own;
//! - `routes`: the routes in effect for both stacks, and their reload on SIGHUP;
//! - `server`: the wiring (store, stack, listeners, drain).
//!
//! What the proxy promises on a keyed route: a request is forwarded at most once per
//! `Idempotency-Key` and scope (the caller, a hash of its credentials: see `scope`) while the
//! key's record lives (its `key_ttl`), and every retry with the key gets the first answer
//! replayed byte for byte; a route that names no class keys the writes that carry a key
//! (`auto`). The exceptions are the ones the upstream
//! or the route allow: an upstream answer saying the request may run again (5xx, 429, 409 with
//! `Retry-After`) marks the record failed, an answer saying the request was wrong (another
//! 4xx) releases it, and a route whose upstream deduplicates by the effect key is forwarded
//! again after a crash of the proxy, with the same effect key. "Executed once" needs an
//! upstream that honours the effect key.

mod args;
mod auto;
mod endpoints;
mod forward;
pub(crate) mod policy;
mod route_match;
mod routes;
mod scope;
mod server;
mod timeout_headers;

use std::error::Error;
use std::future::Future;
use std::process::ExitCode;

use self::args::Mode;
pub(crate) use self::args::ProxyArgs;
use self::policy::{PolicyFileError, RouteTable};
use self::scope::ScopeHeaders;

/// Runs `backstop proxy` with `args` until `shutdown` resolves, or checks a routes file.
pub(crate) async fn run(
    args: &ProxyArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<ExitCode, Box<dyn Error>> {
    let mode = args
        .mode()
        .unwrap_or_else(|error| crate::usage_error(error, "proxy"));
    match mode {
        Mode::Check(file, scope_flag) => match RouteTable::load(&file).and_then(|table| {
            let scopes = ScopeHeaders::resolve(scope_flag, table.scope_headers.as_deref())
                .map_err(|e| PolicyFileError::new(&file, e))?;
            Ok(table.explain(&scopes))
        }) {
            Ok(text) => {
                print!("{text}");
                Ok(ExitCode::SUCCESS)
            }
            Err(error) => {
                eprintln!("error: {error}");
                Ok(ExitCode::from(2))
            }
        },
        Mode::Run(settings) => {
            // Watched before anything is bound: a SIGHUP that came first would stop the proxy.
            let hangups = crate::hangups::Hangups::watch("the routes");
            server::run(*settings, hangups, shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
