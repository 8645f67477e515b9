//! backstop makes an RPC's outcome knowable and its retries safe.
//!
//! An RPC framework turns arguments into bytes and back; it does not decide whether a call
//! "counted". backstop does: deadlines that shrink hop by hop, retries that cannot multiply
//! load, idempotency that turns "unknown" into "exactly one effect", and admission control that
//! says "not now" (429/503 + `Retry-After`) instead of collapsing.
//!
//! # The model
//!
//! - A **logical request** is one user intent: one idempotency key, one [`Deadline`]. An
//!   **attempt** is one physical send of it; retries and hedges are attempts.
//! - The deadline is absolute on the receiver's monotonic clock, carried on the wire as the
//!   time left (`grpc-timeout`, for HTTP too), and every hop forwards a
//!   [`child`](deadline::Deadline::child) that leaves a margin for the way back. All attempts
//!   share it: a retry never extends it. The server stack runs each handler under its
//!   request's deadline ([`Deadline::current`]) and the client stack sends what is left of it,
//!   so a handler that calls another service the natural way forwards a shrinking timeout
//!   without a line of code (`examples/two_hop.rs`).
//! - Retries are bounded by a [`RetryBudget`](retry::RetryBudget) (a ratio of logical
//!   requests), not only by a count per call, so a failing dependency sees at most
//!   `1 + ratio` times its normal load; every stop carries a reason.
//! - The server claims each key in a [`Store`](idempotency::Store) before running the handler:
//!   the same key replays the stored answer, the same key with other parameters is refused,
//!   and a failed or abandoned attempt can be taken over by exactly one retry.
//! - Overload is an answer, not a crash: a tenant over quota gets 429, a full server 503, both
//!   with `Retry-After`; never 500.
//!
//! The primitives know nothing of HTTP or gRPC; the [`server`] and [`client`] layers adapt them.
//!
//! # Where each concept lives
//!
//! | concept | primitive | client layer | server layer |
//! |---|---|---|---|
//! | deadline | [`deadline`] | `client::deadline` | `server::deadline` |
//! | retry, hedging | [`retry`] (what extra sends spend: [`retry::RetrySpend`]), [`hedge`] | `client::retry`, `client::hedge`, `client::breaker`, `client::transparent`; how far a failed call got: `client::Reach` | pushback from [`admission`] |
//! | idempotency | [`idempotency`] (stores on [`db`]) | `client::idempotency` (key, intent journal) | `server::idempotency` |
//! | concurrency limit | [`admission::Gate`] | | `server::concurrency` |
//! | quota | [`admission::KeyedTokenBucket`], `admission::redis` | | `server::rate_limit` |
//! | per-method policy | [`policy`] | `client::SelectMethod`, `client::service_config` | selected once by `server::deadline` from the table in effect, read by every layer after it |
//! | metrics, logs | [`observe`] | `client::observer` | `server::metrics` |
//!
//! The folders are by side, not by concept: `client/` and `server/` are whole features, so a
//! crate that turns one off leaves its folder and its hyper parts out, and the primitives
//! under them compile with neither. tower keeps each concept in one folder because it has one
//! side; here a concept has up to three homes, and each one's module docs link the other two.
//!
//! # Layout
//!
//! - [`deadline`]: [`Deadline`], the `grpc-timeout` codec, the per-peer
//!   [`Margin`](deadline::Margin) (2 x RTT p99 + 5 ms).
//! - [`status`]: [`Status`], one error type carrying gRPC code, HTTP status, retry class and
//!   pushback (one classification table for both protocols).
//! - [`policy`]: one [`MethodPolicy`](policy::MethodPolicy) per method (`Safe`, `Keyed`,
//!   `Unsafe`; timeout, retryable codes, attempts, backoff, hedging, key TTL, rate class),
//!   the [`MethodPolicies`](policy::MethodPolicies) table that finds a call's policy by its
//!   gRPC path or HTTP route, validated at start-up; every default in
//!   [`policy::defaults`], each defined once (the backoff's beside it, in [`retry`]).
//! - [`retry`]: [`Backoff`](retry::Backoff) with jitter, the lock-free
//!   [`RetryBudget`](retry::RetryBudget), [`RetrySpend`](retry::RetrySpend) (everything a
//!   destination's retries and hedges spend from, with the decisions), and the executor
//!   ([`RetryPolicy::execute`](retry::RetryPolicy::execute)) in which all attempts share one
//!   deadline.
//! - [`hedge`]: [`HedgePolicy`](hedge::HedgePolicy) (when a slow attempt gets a hedge, and
//!   what the hedge may spend) and the [`LatencyWindow`](hedge::LatencyWindow) its delay is
//!   read from; the layer that sends hedges is `client::hedge`.
//! - [`idempotency`]: keys, fingerprints (SHA-256 over RFC 8785 canonical JSON), the
//!   [`Store`](idempotency::Store) trait with memory, SQLite and PostgreSQL backends, the
//!   sweeper and the conformance suite every backend runs.
//! - [`db`]: the durable plumbing under the stores, the client's intent journal and an
//!   application's own tables: SQLite's group-commit writer, read pool and migrations
//!   (`db::sqlite`), PostgreSQL's pool, migrations and batching writer (`db::postgres`), each
//!   with its typed error. It depends on no other module here.
//! - [`admission`]: [`Gate`](admission::Gate) (bounded concurrency with deadline-bounded
//!   waiting), [`TokenBucket`](admission::TokenBucket) and its per-tenant keyed variant,
//!   [`RetryAfter`](admission::RetryAfter).
//! - [`observe`]: metric and log names.
//! - [`clock`]: the wall clock behind a trait; stores take `now` explicitly.
//! - [`server`]: the tower layers, composed by [`ServerStack`](server::ServerStack).
//! - [`client`]: the client layers (idempotency key, deadline, retry with replay, hedging,
//!   circuit breaker, transparent retry, connection management, gRPC service config read
//!   into method policies), composed by [`ClientStack`](client::ClientStack), which runs each
//!   call by its method's policy, for tonic channels and HTTP clients alike.
//!
//! # Feature flags
//!
//! The primitives ([`deadline`], [`status`], [`policy`], [`retry`], [`hedge`], [`admission`],
//! the [`Store`](idempotency::Store) trait and its memory store, [`observe`], [`clock`]) need no
//! feature. The rest is behind one each, so a crate takes only the drivers and the hyper parts
//! it uses:
//!
//! - `client` (default): the client layers ([`client`]), with hyper's client, HTTP/1 and
//!   HTTP/2, and tower's balancing for pooled connections.
//! - `server` (default): the server layers ([`server`]) and their listener, with hyper's server
//!   and tokio's sockets.
//! - `sqlite` (default): the SQLite idempotency store ([`idempotency::sqlite`]) on the
//!   group-commit handle of [`db::sqlite`], and the client's intent journal, on a bundled
//!   SQLite.
//! - `redis`: per-tenant token buckets shared by several instances through Redis
//!   (`admission::redis`: one atomic Lua script, the Redis server's clock, expiring keys) with
//!   an open/closed failure policy, usable by the rate limit layer.
//! - `postgres`: the PostgreSQL idempotency store (`idempotency::postgres`) on the pool and
//!   batching writer of `db::postgres`, for several instances sharing one database.
//! - `trace-context` (on with `client` or `server`): W3C `traceparent` in and out of headers
//!   ([`observe::trace_context`]) through OpenTelemetry's propagator; the client and server
//!   layers read it for the `trace_id` of their log events.
//! - `otel`: OpenTelemetry spans through `tracing-opentelemetry`. The server metrics layer's
//!   `rpc_server_request` span takes the caller's `traceparent` as its remote parent, and each
//!   client attempt runs in an `rpc_client_attempt` span whose context the attempt sends as its
//!   `traceparent`, so one trace crosses every hop. The application installs the
//!   `tracing-opentelemetry` layer and an exporter; without them the spans cost what any
//!   disabled `tracing` span costs.
//! - `axum`: `axum::response::IntoResponse` for [`Status`], the server's `Problem` and the
//!   client's `Error`, so an axum handler returns them, or uses `?` on a client call.
//! - `tonic`: `tonic::Status` from [`Status`] and the client's `Error`, for `?` in a tonic
//!   method.
//! - `conformance`: the suite every store runs (`idempotency::conformance` and the
//!   `store_conformance!` macro), for testing a store of one's own against the same cases.
//! - `prometheus`: `observe::with_duration_buckets`, which makes a `metrics-exporter-prometheus`
//!   recorder render the library's durations as histograms (its default is summaries, which
//!   cannot be added up across instances).
//!
//! The defaults are what a service using both sides and one machine's storage needs, so that
//! adding the crate is enough to start. A client-only or server-only crate turns them off
//! (`default-features = false`) and names the side it uses; the drivers for several instances
//! (`postgres`, `redis`) and the test suite are never on unless asked for.
//!
//! The store backends and the Redis limiter stay in this crate, behind features, rather than
//! in crates of their own as tower-sessions splits its stores: they share the `Store` trait's
//! claim rules, the conformance suite and the `db` plumbing, and change with them, so one
//! version to pin is simpler for a user, and a feature left off costs nothing at build time
//! (its driver is not compiled). A backend written elsewhere implements `Store` and runs the
//! same suite (`conformance`). The binary, the payment service and the storm lab, whose
//! dependencies a library user never wants, are crates of their own.
//!
//! # Layer order
//!
//! [`ServerStack`](server::ServerStack) applies, outermost first: **deadline** (read
//! `grpc-timeout` the moment the request arrives, so queueing counts against the deadline; a late
//! answer becomes 504) -> **metrics** (sees every request, the refused ones too) -> **tenant**
//! (who is calling) -> **rate limit** (429: the cheapest refusal first) -> **idempotency
//! intake** (reads a keyed request's body, and waits for a running attempt with the same key,
//! holding no capacity) -> **gate** (503: our own capacity) -> **idempotency** (last, so a
//! request refused above leaves its key unused, and only admitted requests pay for a store
//! round trip).
//!
//! # Example: the whole stack on an axum app
//!
//! ```
//! use axum::{Extension, Json, Router, routing::post};
//! use backstop::idempotency::{IdempotencyKey, MemoryStore};
//! use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
//! use backstop::server::ServerStack;
//! use http::{Method, Request, StatusCode};
//! use tower::ServiceExt;
//!
//! async fn pay(Extension(key): Extension<IdempotencyKey>) -> (StatusCode, String) {
//!     (StatusCode::CREATED, format!("charged once for {key}"))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Every method described once; the clients of the service can use the same table.
//! let pay_policy = MethodPolicy::builder("Pay", Idempotency::Keyed)
//!     .key_ttl(KEY_TTL_PAYMENTS)
//!     .build();
//! let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
//!     .route(Method::POST, "/v1/payments", pay_policy)
//!     .validated()
//!     .unwrap();
//! let stack = ServerStack::new("payments", MemoryStore::new())
//!     .policies(policies)
//!     // The route axum matched, so the table is looked up by the router's own match.
//!     .matched_path_from(|ext| ext.get::<axum::extract::MatchedPath>().map(|m| m.as_str()));
//! let app = Router::new()
//!     .route("/v1/payments", post(pay))
//!     .route_layer(stack.into_layer());
//!
//! let request = || {
//!     Request::post("/v1/payments")
//!         .header("idempotency-key", "order-42-attempt")
//!         .header("grpc-timeout", "2S")
//!         .body(axum::body::Body::from(r#"{"order_id":"42","amount_cents":1999}"#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//!
//! // The retry is answered from the store, byte for byte, without running the handler again.
//! let retry = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//!
//! // No key on a keyed route: refused before anything runs.
//! let no_key = Request::post("/v1/payments").body(axum::body::Body::from("{}")).unwrap();
//! assert_eq!(app.oneshot(no_key).await.unwrap().status(), StatusCode::BAD_REQUEST);
//! # }
//! ```
//!
//! `examples/axum_server.rs` serves the same thing on a real port. The same layer goes on
//! tonic's server (`tonic::transport::Server::builder().layer(stack.into_layer())`, as
//! `examples/tonic_server.rs` shows) or in front of a bare hyper service: the layers ask
//! nothing of the bodies beyond `http_body::Body<Data = Bytes>` (see [`server::body`]).
//! `examples/tonic_client.rs` and `examples/hyper_client.rs` show the client stack over a
//! tonic `Channel` and over a hyper-util client.
//!
//! # Example: atomic phases and recovery points
//!
//! The layer above stores the answer; the handler's own table is another transaction, and a
//! crash between the two leaves them disagreeing. A handler that writes through
//! [`Phases`](server::idempotency::Phases) commits its writes in the record's own
//! transactions (Brandur Leach's "atomic phases"): what it writes **before** its external
//! effect commits with a *recovery point*, what it writes **after** commits with the stored
//! answer. On a route whose [`Takeover`](policy::Takeover) is `Resume`, a retry that takes
//! the key over from a run that died learns the last recovery point and the key's effect key,
//! and asks the downstream for the effect instead of repeating it. On SQLite the claim and
//! the first phase share one sync, and phases of concurrent requests share the writer's group
//! commit: two durable commits per request, whatever the handler writes.
//!
//! ```
//! use axum::{Extension, Router, routing::post};
//! use backstop::db::sqlite::rusqlite::params;
//! use backstop::db::sqlite::{Db, SqliteOptions};
//! use backstop::idempotency::sqlite::SqliteStore;
//! use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy, Takeover};
//! use backstop::server::ServerStack;
//! use backstop::server::idempotency::Phases;
//! use http::{Method, Request, StatusCode};
//! use tower::ServiceExt;
//!
//! /// The downstream, deduplicating on the effect key (a PSP's idempotency key).
//! async fn charge(effect_key: &str) -> String {
//!     format!("ch_{}", &effect_key[..8])
//! }
//!
//! async fn pay(Extension(phases): Extension<Phases<SqliteStore>>) -> (StatusCode, String) {
//!     let effect_key = phases.effect_key();
//!     // Phase 1, before the effect, unless a run that died already committed it.
//!     if phases.recovery_point().is_none() {
//!         let key = effect_key.clone();
//!         let created = phases
//!             .commit("order_created", effect_key.clone(), Box::new(move |c| {
//!                 c.execute("INSERT INTO orders (effect_key, status) VALUES (?1, 'pending')",
//!                     params![key])
//!                     .map(drop)
//!             }))
//!             .await;
//!         if created.is_err() {
//!             // Nothing of the phase was written: the layer releases the key.
//!             return (StatusCode::SERVICE_UNAVAILABLE, "try again".into());
//!         }
//!     }
//!     // The effect, under a key the downstream deduplicates on: safe to send again.
//!     let charge_id = charge(&effect_key).await;
//!     // Phase 2, after the effect: committed with the stored answer, or not at all.
//!     phases.on_finish(Box::new(move |c| {
//!         c.execute("UPDATE orders SET status = 'paid' WHERE effect_key = ?1",
//!             params![effect_key])
//!             .map(drop)
//!     }));
//!     (StatusCode::CREATED, charge_id)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! # let dir = tempfile::tempdir().unwrap();
//! let db = Db::open(dir.path().join("app.db"), SqliteOptions::default()).unwrap();
//! db.migrate("orders_v1", "CREATE TABLE orders (effect_key TEXT PRIMARY KEY, status TEXT)")
//!     .await
//!     .unwrap();
//! // The application's tables and the idempotency records in one database, one writer.
//! let store = SqliteStore::new(db.clone()).await.unwrap();
//! let pay_policy = MethodPolicy::builder("Pay", Idempotency::Keyed)
//!     .key_ttl(KEY_TTL_PAYMENTS)
//!     .takeover(Takeover::Resume)
//!     .build();
//! let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
//!     .route(Method::POST, "/v1/payments", pay_policy)
//!     .validated()
//!     .unwrap();
//! let stack = ServerStack::new("payments", store)
//!     .policies(policies)
//!     .matched_path_from(|ext| ext.get::<axum::extract::MatchedPath>().map(|m| m.as_str()));
//! let app = Router::new()
//!     .route("/v1/payments", post(pay))
//!     .route_layer(stack.into_layer());
//!
//! let request = || {
//!     Request::post("/v1/payments")
//!         .header("idempotency-key", "order-42")
//!         .body(axum::body::Body::from(r#"{"order_id":"42"}"#))
//!         .unwrap()
//! };
//! assert_eq!(app.clone().oneshot(request()).await.unwrap().status(), StatusCode::CREATED);
//! // The order row and the stored answer committed together.
//! let status: String = db
//!     .read(|c| c.query_row("SELECT status FROM orders", [], |row| row.get(0)))
//!     .await
//!     .unwrap();
//! assert_eq!(status, "paid");
//! let retry = app.oneshot(request()).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]
// docs.rs builds with `--cfg docsrs` on nightly: there, items behind a feature say which one.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use deadline::Deadline;
pub use status::Status;

pub mod admission;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
pub mod clock;
pub mod db;
pub mod deadline;
pub mod hedge;
pub mod idempotency;
pub mod observe;
pub mod policy;
pub mod retry;
mod sample_window;
#[cfg(feature = "server")]
#[cfg_attr(docsrs, doc(cfg(feature = "server")))]
pub mod server;
pub mod status;

// The crate README's example runs as a doctest, so that what crates.io shows stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

// Whether the PostgreSQL and Redis some unit tests need are answering: the file the integration
// tests include, so that the check and its skip message exist once.
#[cfg(test)]
#[path = "../tests/support/services.rs"]
mod test_services;
