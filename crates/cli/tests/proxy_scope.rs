//! `backstop proxy`'s defaults, over real sockets against the Python upstream: keys (and rate
//! limits) are scoped by the caller's credentials, so one caller's key never replays another
//! caller's answer; a write carrying an `Idempotency-Key` is keyed without a routes file; and
//! records written before scopes were credentials stay in the shared scope.
//!
//! Nothing is timed: each check counts answers and what the upstream executed.

#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

#[path = "support/proxy_harness.rs"]
mod proxy_harness;

use tokio::process::Command;

use self::proxy_harness::{
    Answer, BIN, Proxy, ROUTES, Upstream, call, charge, client, python_ready,
};

/// [`ROUTES`], a keyed route shared by every caller, an unsafe route, and a rate class of one
/// request a second.
fn routes() -> String {
    format!(
        r#"{ROUTES}
[[policies.route]]
match = "POST /v1/newsletter"
idempotency = "keyed"
scope = "shared"

[[policies.route]]
match = "POST /v2/unsafe"
idempotency = "unsafe"

[[policies.route]]
match = "GET /v1/limited/{{id}}"
idempotency = "safe"
rate_class = "tight"

[policies.rate_class.tight]
rate = 1
burst = 1
"#
    )
}

const BODY: &str = r#"{"amount":1999,"currency":"eur"}"#;

/// A keyed POST of [`BODY`] as the caller with `token` (none: no credentials).
async fn order(base: &str, path: &str, key: &str, token: Option<&str>) -> Answer {
    let http = client();
    let mut request = charge(&http, base, path, key, BODY);
    if let Some(token) = token {
        request = request.header("Authorization", format!("Bearer {token}"));
    }
    call(request).await
}

#[tokio::test]
async fn another_callers_key_is_their_own_and_never_replays_the_first_callers_answer() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&upstream.url])
        .routes(&routes())
        .start()
        .await;
    let scope = proxy.listening["fields"]["scope"].as_str().unwrap();
    assert!(
        scope.contains("scoped by caller, a hash of authorization"),
        "{scope}"
    );

    // Alice, then Mallory with the same key and body: two effects, each their own answer.
    let base = &proxy.base;
    let alice = order(base, "/v1/charges", "order-1", Some("alice-token")).await;
    let mallory = order(base, "/v1/charges", "order-1", Some("mallory-token")).await;
    alice.assert_status(201);
    mallory.assert_status(201);
    assert!(!mallory.replayed(), "Mallory's request is his own");
    assert_ne!(alice.json()["effect_id"], mallory.json()["effect_id"]);
    let effects = upstream.effects("order-1");
    assert_eq!(effects.len(), 2);
    assert_ne!(
        effects[0]["effect_key"], effects[1]["effect_key"],
        "two keys, two effect keys"
    );

    // Each caller's retry is replayed its own answer, and nothing more runs.
    for (token, first) in [("alice-token", &alice), ("mallory-token", &mallory)] {
        let again = order(base, "/v1/charges", "order-1", Some(token)).await;
        assert!(again.replayed(), "{token}");
        assert_eq!(again.body, first.body, "{token}");
    }
    assert_eq!(upstream.effects("order-1").len(), 2);

    // Within a scope the fingerprint check holds.
    let http = client();
    let other_body = charge(&http, base, "/v1/charges", "order-1", r#"{"amount":1}"#)
        .header("Authorization", "Bearer alice-token");
    call(other_body).await.assert_status(409);

    // Without credentials: the shared scope, one effect for every such caller.
    let first = order(base, "/v1/charges", "order-2", None).await;
    let second = order(base, "/v1/charges", "order-2", None).await;
    first.assert_status(201);
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    // A caller with credentials is not in it.
    let carol = order(base, "/v1/charges", "order-2", Some("carol-token")).await;
    assert!(!carol.replayed());
    assert_eq!(upstream.effects("order-2").len(), 2);

    // A route marked shared: one scope for all, as documented.
    let alice = order(base, "/v1/newsletter", "signup-1", Some("alice-token")).await;
    let mallory = order(base, "/v1/newsletter", "signup-1", Some("mallory-token")).await;
    alice.assert_status(201);
    assert!(mallory.replayed());
    assert_eq!(upstream.effects("signup-1").len(), 1);

    let db = std::fs::read(dir.path().join("proxy.db")).unwrap();
    assert!(
        !db.windows(11).any(|w| w == b"alice-token"),
        "only a hash of the credential is stored"
    );
}

#[tokio::test]
async fn rate_limits_count_per_caller() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&upstream.url])
        .routes(&routes())
        .start()
        .await;
    let http = client();
    let get = |token: &str| {
        http.get(format!("{}/v1/limited/1", proxy.base))
            .header("Authorization", format!("Bearer {token}"))
    };
    // Alice spends her bucket (one request a second) until she is refused...
    let mut refused = false;
    for _ in 0..100 {
        if call(get("alice-token")).await.status == 429 {
            refused = true;
            break;
        }
    }
    assert!(refused, "Alice is limited");
    // ...and Mallory's bucket is his own, full.
    call(get("mallory-token")).await.assert_status(200);
}

#[tokio::test]
async fn records_written_before_scopes_stay_in_the_shared_scope() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    // Every caller in one scope, as before this version.
    let old = ROUTES.replace(
        "replay_headers = [\"x-upstream\"]",
        "replay_headers = [\"x-upstream\"]\nscope_headers = []",
    );
    let mut before = Proxy::options(dir.path(), &[&upstream.url])
        .routes(&old)
        .start()
        .await;
    let scope = before.listening["fields"]["scope"].as_str().unwrap();
    assert!(scope.contains("every caller shares one scope"), "{scope}");
    let first = order(&before.base, "/v1/charges", "legacy-1", Some("alice-token")).await;
    first.assert_status(201);
    before.kill9().await;
    assert_eq!(
        scopes_of(&dir.path().join("proxy.db"), "legacy-1"),
        ["default"],
        "the scope every record had before this version"
    );

    // The same store under the default: the record stays in the shared scope until it
    // expires, where a request without credentials finds it...
    let after = Proxy::options(dir.path(), &[&upstream.url]).start().await;
    let anonymous = order(&after.base, "/v1/charges", "legacy-1", None).await;
    assert!(anonymous.replayed());
    assert_eq!(anonymous.body, first.body);
    assert_eq!(upstream.effects("legacy-1").len(), 1);
    // ...and a caller with credentials gets a record of its own, as the README says.
    let alice = order(&after.base, "/v1/charges", "legacy-1", Some("alice-token")).await;
    alice.assert_status(201);
    assert!(!alice.replayed());
    assert_eq!(upstream.effects("legacy-1").len(), 2);
}

/// The scopes `key` has a record under in the SQLite store at `db` (in whichever of its
/// tables holds records).
fn scopes_of(db: &std::path::Path, key: &str) -> Vec<String> {
    let db = rusqlite::Connection::open(db).unwrap();
    let tables: Vec<String> = db
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut scopes = Vec::new();
    for table in tables {
        let Ok(mut select) = db.prepare(&format!("SELECT scope FROM {table} WHERE key = ?1"))
        else {
            continue;
        };
        let found = select
            .query_map([key], |row| row.get::<_, String>(0))
            .unwrap();
        scopes.extend(found.map(Result::unwrap));
    }
    scopes
}

#[tokio::test]
async fn without_a_routes_file_a_post_with_a_key_is_keyed_and_the_rest_passes_through() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let mut command = Command::new(BIN);
    command
        .args(["proxy", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--upstream", &upstream.url])
        .arg("--store")
        .arg(dir.path().join("proxy.db"));
    let proxy = Proxy::spawn(command).await;
    let unrouted = proxy.listening["fields"]["unrouted"].as_str().unwrap();
    assert!(
        unrouted.contains("a POST or PATCH carrying an Idempotency-Key is keyed"),
        "{unrouted}"
    );
    let http = client();

    // The same key twice: executed once, the second a replay.
    let first = call(charge(&http, &proxy.base, "/v2/orders", "k-1", BODY)).await;
    let second = call(charge(&http, &proxy.base, "/v2/orders", "k-1", BODY)).await;
    first.assert_status(201);
    assert!(!first.replayed());
    assert!(second.replayed());
    assert_eq!(second.body, first.body);
    assert_eq!(upstream.effects("k-1").len(), 1);
    assert_eq!(upstream.received("k-1").len(), 1);

    // No key: forwarded as it came, each time.
    for _ in 0..2 {
        let post = call(http.post(format!("{}/v2/unkeyed", proxy.base)).body(BODY)).await;
        post.assert_status(201);
        assert!(!post.replayed());
    }
    assert_eq!(upstream.received_at("/v2/unkeyed"), 2);
    // A read with a key is a read: passed through.
    for _ in 0..2 {
        let get = http
            .get(format!("{}/v2/orders/1", proxy.base))
            .header("Idempotency-Key", "k-get");
        call(get).await.assert_status(200);
    }
    assert_eq!(upstream.received("k-get").len(), 2);
}

#[tokio::test]
async fn a_route_marked_unsafe_forwards_a_key_as_it_came() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&upstream.url])
        .routes(&routes())
        .start()
        .await;
    for _ in 0..2 {
        let post = order(&proxy.base, "/v2/unsafe", "u-1", Some("alice-token")).await;
        post.assert_status(201);
        assert!(!post.replayed());
    }
    assert_eq!(upstream.effects("u-1").len(), 2);
    // A path no route names is auto: keyed.
    for _ in 0..2 {
        order(&proxy.base, "/v2/other", "o-1", Some("alice-token")).await;
    }
    assert_eq!(upstream.effects("o-1").len(), 1);
}

#[tokio::test]
async fn check_config_says_how_keys_are_scoped_and_what_is_keyed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routes.toml");
    std::fs::write(&file, routes()).unwrap();
    let check = |extra: &[&str]| {
        let mut command = Command::new(BIN);
        command.args(["proxy", "--check-config"]).arg(&file);
        command.args(extra);
        command.output()
    };
    let out = check(&[]).await.unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "scope: keys and rate limits are scoped by caller, a hash of authorization",
        "scope shared: every caller's keys and rate limits in one scope",
        "unsafe: passed through, sent once, an Idempotency-Key forwarded as it came",
        "auto: a POST or PATCH carrying an Idempotency-Key is keyed",
    ] {
        assert!(text.contains(want), "{want} missing from:\n{text}");
    }
    let out = check(&["--scope-header", "X-Api-Key"]).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("a hash of x-api-key"), "{text}");

    // One setting, said in one place.
    let both = dir.path().join("both.toml");
    std::fs::write(&both, "[proxy]\nscope_headers = [\"cookie\"]\n").unwrap();
    let out = Command::new(BIN)
        .args(["proxy", "--check-config"])
        .arg(&both)
        .args(["--scope-header", "X-Api-Key"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(error.contains("give one"), "{error}");
}
