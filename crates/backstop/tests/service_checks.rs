//! The check every crate's tests run before they use PostgreSQL or Redis
//! (`support/services.rs`): what counts as the server answering, and what happens when it does
//! not, skipped or (when required) failed.

mod support {
    pub(crate) mod services;
}

use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread::JoinHandle;

use support::services::{POSTGRES, REDIS, tcp_address};

/// A URL on which nothing listens: port 1 on loopback is never a test server.
const NOTHING_PG: &str = "postgres://postgres@127.0.0.1:1/test";
const NOTHING_REDIS: &str = "redis://127.0.0.1:1";

/// A one-connection server on a free loopback port: reads `expect.len()` bytes, checks them,
/// answers `reply` and closes. Returns its port and the thread to join.
fn fake_server(expect: &'static [u8], reply: &'static [u8]) -> (u16, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut got = vec![0u8; expect.len()];
        socket.read_exact(&mut got).unwrap();
        assert_eq!(got, expect, "the probe's first message");
        socket.write_all(reply).unwrap();
    });
    (port, server)
}

const SSL_REQUEST: &[u8] = &[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

#[test]
fn addresses_come_from_the_url_with_the_default_port() {
    assert_eq!(
        tcp_address("postgres://postgres@127.0.0.1:5432/test", 5432).as_deref(),
        Some("127.0.0.1:5432")
    );
    assert_eq!(
        tcp_address("postgresql://u:p@db.internal/test?options=-c%20x", 5432).as_deref(),
        Some("db.internal:5432")
    );
    assert_eq!(
        tcp_address("redis://127.0.0.1", 6379).as_deref(),
        Some("127.0.0.1:6379")
    );
    assert_eq!(
        tcp_address("redis://:secret@[::1]:6380/0", 6379).as_deref(),
        Some("[::1]:6380")
    );
    assert_eq!(
        tcp_address("postgres://postgres@[::1]/test", 5432).as_deref(),
        Some("[::1]:5432")
    );
    // Unix sockets and key=value strings have no TCP address: the tests try them as they are.
    assert_eq!(
        tcp_address("postgres://postgres@%2Fvar%2Frun%2Fpostgresql/test", 5432),
        None
    );
    assert_eq!(tcp_address("host=127.0.0.1 user=postgres", 5432), None);
}

#[test]
fn nothing_listening_skips_with_where_and_how_to_get_one() {
    let skipped = POSTGRES.check(NOTHING_PG, false).unwrap_err();
    assert!(skipped.starts_with("!!! SKIPPED the tests that need PostgreSQL"));
    for part in ["127.0.0.1:1", "BACKSTOP_TEST_POSTGRES", "scripts/test"] {
        assert!(skipped.contains(part), "{part} in {skipped}");
    }
    assert!(!skipped.contains('\n'), "one line: {skipped}");

    let skipped = REDIS.check(NOTHING_REDIS, false).unwrap_err();
    assert!(skipped.starts_with("!!! SKIPPED the tests that need Redis"));
    for part in ["127.0.0.1:1", "BACKSTOP_TEST_REDIS", "scripts/test"] {
        assert!(skipped.contains(part), "{part} in {skipped}");
    }
}

#[test]
fn the_skip_line_shows_no_password() {
    let skipped = POSTGRES
        .check("postgres://postgres:hunter2@127.0.0.1:1/test", false)
        .unwrap_err();
    assert!(!skipped.contains("hunter2"), "{skipped}");
}

#[test]
#[should_panic(expected = "BACKSTOP_REQUIRE_SERVICES=1 but PostgreSQL does not answer")]
fn nothing_listening_fails_when_services_are_required() {
    let _ = POSTGRES.check(NOTHING_PG, true);
}

#[test]
#[should_panic(expected = "BACKSTOP_REQUIRE_SERVICES=1 but Redis does not answer")]
fn no_redis_fails_when_services_are_required() {
    let _ = REDIS.check(NOTHING_REDIS, true);
}

#[test]
fn a_postgres_answer_to_the_ssl_request_is_postgres() {
    for reply in [&b"N"[..], &b"S"[..]] {
        let (port, server) = fake_server(SSL_REQUEST, reply);
        let url = format!("postgres://postgres@127.0.0.1:{port}/test");
        assert_eq!(POSTGRES.answers(&url), Ok(()));
        server.join().unwrap();
    }
}

#[test]
fn another_server_on_the_port_is_not_postgres() {
    // What an HTTP server might send back first.
    let (port, server) = fake_server(SSL_REQUEST, b"HTTP/1.1 400 Bad Request\r\n\r\n");
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let why = POSTGRES.answers(&url).unwrap_err();
    assert!(why.contains("not as PostgreSQL"), "{why}");
    server.join().unwrap();
}

#[test]
fn a_redis_answer_to_ping_is_redis() {
    for reply in [
        &b"+PONG\r\n"[..],
        &b"-NOAUTH Authentication required.\r\n"[..],
    ] {
        let (port, server) = fake_server(b"PING\r\n", reply);
        assert_eq!(REDIS.answers(&format!("redis://127.0.0.1:{port}")), Ok(()));
        server.join().unwrap();
    }
}

#[test]
fn a_server_that_closes_without_answering_is_not_redis() {
    let (port, server) = fake_server(b"PING\r\n", b"");
    let why = REDIS
        .answers(&format!("redis://127.0.0.1:{port}"))
        .unwrap_err();
    assert!(why.contains(&format!("127.0.0.1:{port}")), "{why}");
    server.join().unwrap();
}
