//! `backstop proxy`: the library's server stack in front of a service written in any
//! language.
//!
//! A reverse proxy for an HTTP/1.1 or h2c upstream: keyed routes forwarded at most once per
//! `Idempotency-Key`, their answers replayed byte for byte from an embedded SQLite (or a shared
//! PostgreSQL) store; the caller's deadline carried across the hop; a bounded fair queue that
//! answers 503 with `Retry-After` under overload; Prometheus metrics on an admin port. The
//! `backstop` binary runs it as `backstop proxy`; a program of one's own embeds it with the
//! same flags ([`ProxyArgs`]) and [`run`]:
//!
//! ```no_run
//! use backstop_proxy::ProxyArgs;
//! use clap::Parser;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     proxy: ProxyArgs,
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
//!     let cli = Cli::parse_from(["my-proxy", "--upstream", "http://127.0.0.1:3000"]);
//!     let shutdown = async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     };
//!     match backstop_proxy::run(&cli.proxy, shutdown).await {
//!         Ok(code) => Ok(code),
//!         Err(backstop_proxy::Error::Usage(error)) => error.exit(),
//!         Err(error) => Err(error.into()),
//!     }
//! }
//! ```
//!
//! [`run`] installs the process's global metrics recorder and watches SIGHUP (a reload of the
//! routes file), as the binary's proxy does.
//!
//! # Layout
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
//! - `server`: the wiring (store, stack, listeners, drain);
//! - [`byte_size`], [`hangups`], [`error_chain`]: sizes as an operator writes them, SIGHUP
//!   watched, an error on one line; the `backstop` binary's other commands use them too.
//!
//! # Promises
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

#![deny(missing_docs)]

mod args;
mod auto;
pub mod byte_size;
mod endpoints;
mod error;
pub mod error_chain;
mod forward;
pub mod hangups;
pub mod policy;
mod route_match;
mod routes;
mod scope;
mod server;
mod timeout_headers;

use std::future::Future;
use std::process::ExitCode;

use self::args::Mode;
pub use self::args::ProxyArgs;
pub use self::error::Error;
use self::policy::{PolicyFileError, RouteTable};
use self::scope::ScopeHeaders;

/// Runs `backstop proxy` with `args` until `shutdown` resolves, or checks a routes file
/// (`--check-config`: the report on stdout, exit status 2 when the file is refused).
pub async fn run(
    args: &ProxyArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<ExitCode, Error> {
    let mode = args.mode().map_err(Error::Usage)?;
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
            server::run(*settings, hangups, shutdown)
                .await
                .map_err(|error| Error::Serve(Box::new(error)))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
