//! Whether the PostgreSQL and the Redis some tests need are answering, decided once per test
//! process. A test that needs one starts with
//!
//! ```ignore
//! if !services::postgres() {
//!     return;
//! }
//! ```
//!
//! When the server does not answer, such tests pass without running and the process says so
//! once on stderr: which server, where, and how to get it (`scripts/test` installs and starts
//! both). With `BACKSTOP_REQUIRE_SERVICES=1` (`.ci/run` sets it) a missing server fails them
//! instead.
//!
//! The servers are `BACKSTOP_TEST_POSTGRES` (default `postgres://postgres@127.0.0.1:5432/test`,
//! trust auth) and `BACKSTOP_TEST_REDIS` (default `redis://127.0.0.1:6379`).
//!
//! Only `std`: the library's unit tests and the tests of every crate include this file with
//! `#[path]`, next to `postgres_schema.rs` where that is included too.
// Each including test uses part of it.
#![allow(dead_code)]

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::Duration;

/// Set to `1`, a missing server fails the tests that need it instead of skipping them.
pub(crate) const REQUIRE_SERVICES: &str = "BACKSTOP_REQUIRE_SERVICES";

/// How long a probe may take to connect, and then to get its answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A server some tests need.
#[derive(Debug)]
pub(crate) struct Service {
    pub(crate) name: &'static str,
    /// The environment variable holding its URL.
    pub(crate) url_var: &'static str,
    pub(crate) default_url: &'static str,
    pub(crate) default_port: u16,
    /// What the tests expect of it beyond answering.
    setup: &'static str,
    /// Sends the protocol's first message on a fresh connection; true when the reply is this
    /// server's.
    speaks: fn(&mut TcpStream) -> io::Result<bool>,
}

pub(crate) const POSTGRES: Service = Service {
    name: "PostgreSQL",
    url_var: "BACKSTOP_TEST_POSTGRES",
    default_url: "postgres://postgres@127.0.0.1:5432/test",
    default_port: 5432,
    setup: "trust auth for user postgres, a database `test`",
    speaks: speaks_postgres,
};

pub(crate) const REDIS: Service = Service {
    name: "Redis",
    url_var: "BACKSTOP_TEST_REDIS",
    default_url: "redis://127.0.0.1:6379",
    default_port: 6379,
    setup: "no password",
    speaks: speaks_redis,
};

/// The PostgreSQL the tests use.
pub(crate) fn postgres_url() -> String {
    POSTGRES.url()
}

/// The Redis the tests use.
pub(crate) fn redis_url() -> String {
    REDIS.url()
}

/// Whether the tests that need PostgreSQL can run (see the module docs).
pub(crate) fn postgres() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| POSTGRES.ready())
}

/// Whether the tests that need Redis can run (see the module docs).
pub(crate) fn redis() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| REDIS.ready())
}

impl Service {
    pub(crate) fn url(&self) -> String {
        std::env::var(self.url_var).unwrap_or_else(|_| self.default_url.to_owned())
    }

    /// Whether the server answers at its URL; when it does not, fails if services are required,
    /// else says on stderr that the tests needing it are skipped.
    fn ready(&self) -> bool {
        let required = std::env::var(REQUIRE_SERVICES).is_ok_and(|v| v == "1");
        match self.check(&self.url(), required) {
            Ok(()) => true,
            Err(skipped) => {
                // Straight to the process's stderr: the test harness captures `eprintln!` of
                // tests that pass, and a skip must be seen.
                let _ = writeln!(io::stderr(), "{skipped}");
                false
            }
        }
    }

    /// Ok when the server answers at `url`. Otherwise panics when `required`, else returns
    /// the line that reports the skip: which server, where, why, and how to get one.
    pub(crate) fn check(&self, url: &str, required: bool) -> Result<(), String> {
        let Err(why) = self.answers(url) else {
            return Ok(());
        };
        let (name, var) = (self.name, self.url_var);
        assert!(
            !required,
            "{REQUIRE_SERVICES}=1 but {name} does not answer ({var}): {why}"
        );
        Err(format!(
            "!!! SKIPPED the tests that need {name} ({var}): {why}. scripts/test installs \
             (on Debian) and starts it; or set {var} to a server ({setup}).",
            setup = self.setup,
        ))
    }

    /// Ok when this server answers at `url`'s address; otherwise why not, naming the address
    /// (never the whole URL, which may hold a password). A URL without a TCP address in it (a
    /// key=value string, a Unix socket) is left to the tests to try.
    pub(crate) fn answers(&self, url: &str) -> Result<(), String> {
        let Some(address) = tcp_address(url, self.default_port) else {
            return Ok(());
        };
        let targets = address
            .to_socket_addrs()
            .map_err(|e| format!("{address}: {e}"))?;
        let mut last = format!("{address} resolves to no address");
        for target in targets {
            match TcpStream::connect_timeout(&target, PROBE_TIMEOUT) {
                Ok(mut stream) => {
                    stream.set_read_timeout(Some(PROBE_TIMEOUT)).ok();
                    stream.set_write_timeout(Some(PROBE_TIMEOUT)).ok();
                    return match (self.speaks)(&mut stream) {
                        Ok(true) => Ok(()),
                        Ok(false) => Err(format!("{target} answers, but not as {}", self.name)),
                        Err(e) => Err(format!("{target}: {e}")),
                    };
                }
                Err(e) => last = format!("{target}: {e}"),
            }
        }
        Err(last)
    }
}

/// `host:port` of a `scheme://[user[:password]@]host[:port][/path][?query]` URL, with
/// `default_port` when it names none; None for any other form.
pub(crate) fn tcp_address(url: &str, default_port: u16) -> Option<String> {
    let (_, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    // An empty host, or a percent-encoded path (`%2Fvar%2Frun%2Fpostgresql`), is a socket.
    if host_port.is_empty() || host_port.starts_with('%') {
        return None;
    }
    // `[::1]:5432` or `[::1]`: the port is after the bracket.
    let port_part = host_port.rfind(']').map_or(host_port, |i| &host_port[i..]);
    if port_part.contains(':') {
        Some(host_port.to_owned())
    } else {
        Some(format!("{host_port}:{default_port}"))
    }
}

/// An `SSLRequest`: every PostgreSQL server answers it with one byte, `S` or `N`, before any
/// authentication (and logs nothing when the client then leaves).
fn speaks_postgres(stream: &mut TcpStream) -> io::Result<bool> {
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    stream.write_all(&SSL_REQUEST)?;
    let mut reply = [0u8; 1];
    stream.read_exact(&mut reply)?;
    Ok(matches!(&reply, b"S" | b"N"))
}

/// An inline `PING`: `+PONG`, or an error (`-NOAUTH ...`) from a Redis that wants a password.
fn speaks_redis(stream: &mut TcpStream) -> io::Result<bool> {
    stream.write_all(b"PING\r\n")?;
    let mut reply = [0u8; 1];
    stream.read_exact(&mut reply)?;
    Ok(matches!(&reply, b"+" | b"-"))
}
