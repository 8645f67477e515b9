//! Idempotency: turn "unknown" into "exactly one effect".
//!
//! A retry is safe only if the server can tell it is the same logical request. Two things tell
//! it: the **key** (identity: "same intent?", [`IdempotencyKey`]) and the **fingerprint**
//! (content: "same parameters?", [`Fingerprint`]). The [`Store`] keeps `(scope, key,
//! fingerprint)` under a unique constraint, the last gate that an application-level "check then
//! insert" cannot be, and decides every request with one [`Store::claim`]:
//!
//! | record | claim answers |
//! |---|---|
//! | none | [`Claim::Claimed`]: run it |
//! | other fingerprint | [`Claim::Conflict`] with the original's first 8 hex digits (409) |
//! | `succeeded` | [`Claim::Replay`]: the stored status, headers and body, byte for byte |
//! | `running`, lease live | [`Claim::InProgress`] with `retry_after` = time left on the lease (409 + Retry-After) |
//! | `failed`, or `running` with an ended lease | takeover by one conditional update: exactly one of N concurrent claims wins, the others get `InProgress` |
//!
//! The lease (5 s by default) is what keeps a crashed runner from pinning a key in `running`
//! forever; its end, `lease_until`, doubles as a fencing token so a runner that lost its lease
//! cannot write a result over its successor's. A takeover must assume the predecessor may have
//! performed the downstream effect: downstream calls carry their own (effect) key.
//!
//! Records expire after a TTL (24 h for synchronous APIs, 7 days for payments); the
//! [`Sweeper`] deletes expired ones and never a running record whose lease is live.
//!
//! # Where it lives
//!
//! This module holds the primitives: keys, fingerprints, the [`Store`] trait and its backends
//! (their durable plumbing is in [`db`](crate::db)). The client makes one key per logical call
//! and, with an intent journal, stores it before the first send
//! ([`client::idempotency`](crate::client::idempotency)); the server claims it before the
//! handler runs and replays the answer ([`server::idempotency`](crate::server::idempotency)).
//! Which methods are keyed, and for how long their keys live, is their
//! [`MethodPolicy`](crate::policy::MethodPolicy).
//!
//! ```
//! use std::time::Duration;
//! use backstop::idempotency::{Claim, ClaimRequest, Fingerprint, IdempotencyKey, MemoryStore, Store, StoredResponse};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let claim = |body: &'static str, now_ms| -> Result<ClaimRequest, Box<dyn std::error::Error>> {
//!     Ok(ClaimRequest {
//!         scope: "merchant-1".into(),
//!         key: IdempotencyKey::parse("\"2f1c0f57-order-42\"")?,
//!         fingerprint: Fingerprint::of_json("POST /v1/payments", body.as_bytes())?,
//!         lease: Duration::from_secs(5),
//!         ttl: Duration::from_secs(7 * 24 * 3600),
//!         now_ms,
//!     })
//! };
//!
//! // First attempt: ours to run.
//! let Claim::Claimed(lease) = store.claim(claim(r#"{"amount_cents":100}"#, 1_000)?).await? else {
//!     unreachable!()
//! };
//! // A concurrent retry while it runs: come back when the lease ends.
//! assert_eq!(
//!     store.claim(claim(r#"{"amount_cents":100}"#, 2_000)?).await?,
//!     Claim::InProgress { retry_after: Duration::from_millis(4_000) }
//! );
//! let created = StoredResponse { status: 201, headers: vec![], body: r#"{"id":"pi_1"}"#.into() };
//! store.complete(&lease, created.clone(), 2_500).await?;
//!
//! // A retry after the outcome was lost on the way: the same answer, byte for byte.
//! assert_eq!(store.claim(claim(r#"{ "amount_cents": 100 }"#, 9_000)?).await?, Claim::Replay(created));
//! // The same key with other parameters is refused.
//! assert!(matches!(
//!     store.claim(claim(r#"{"amount_cents":1000}"#, 9_000)?).await?,
//!     Claim::Conflict { .. }
//! ));
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`key`] holds [`IdempotencyKey`] (1-255 visible ASCII; bare or Structured Field string;
//!   UUIDv7 generation).
//! - [`fingerprint`] holds [`Fingerprint`] (SHA-256 of method + "\n" + RFC 8785 JSON).
//! - [`store`] holds the [`Store`] trait and its types: [`Claim`], [`Lease`], [`Record`],
//!   [`StoreError`].
//! - [`memory`] holds [`MemoryStore`].
//! - `sqlite` (feature `sqlite`, default) holds `SqliteStore` on the group-commit handle
//!   `db::sqlite::Db`, which the application shares for its own tables.
//! - `postgres` (feature `postgres`) holds `PostgresStore` on a bounded pool, its calls run by
//!   the batching writer of `db::postgres` (shared transactions for concurrent calls), for
//!   several instances sharing one database; its SQL is in `postgres/sql.rs`.
//!
//! The database plumbing itself (writers, pools, migrations, their errors) is in
//! [`db`](crate::db), which knows nothing of idempotency.
//! - `protocol` holds the rules every store decides by (claim, fence, sweep, lease length),
//!   model-checked with crashes, lease expiry and clock skew.
//! - [`sweeper`] holds [`Sweeper`], the TTL reaper task.
//! - `window` (with a windowed backend) holds the time windows records are kept in: TTL
//!   classes, widths, table names, and the summaries that let a claim skip a sealed window.
//! - `conformance` (feature `conformance`) holds the suite every backend runs
//!   (`backstop::store_conformance!`).

#[cfg(any(test, feature = "conformance"))]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
pub mod fingerprint;
pub mod key;
pub mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
pub(crate) mod protocol;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod store;
pub mod sweeper;
#[cfg(feature = "sqlite")]
pub mod window;

pub use fingerprint::{Fingerprint, FingerprintError};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use memory::MemoryStore;
pub use store::{
    BODY_WITHHELD, BoxError, Claim, ClaimRequest, Ending, Lease, PriorRun, Record, RecordStatus,
    RecoveryPoint, Resume, Store, StoreError, StoredResponse,
};
pub use sweeper::Sweeper;
