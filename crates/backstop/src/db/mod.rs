//! Durable plumbing: the database handles everything that keeps state goes through.
//!
//! The idempotency stores, the client's intent journal and an application's own tables (the
//! payment service's intents, say) all need the same few things from a database: writes that
//! are answered only once durable, batched so that one flush serves many callers; reads that
//! do not queue behind the writer; a bounded pool that recovers when the database comes back;
//! and versioned migrations. Those live here, apart from any table: this module knows nothing
//! of idempotency keys, journals or servers, and they build on it, never the other way round.
//!
//! - [`sqlite`] (feature `sqlite`, default): [`Db`](sqlite::Db), one writer thread that
//!   group-commits every caller's job into shared transactions, a pool of read connections,
//!   and [`Db::migrate`](sqlite::Db::migrate); typed [`sqlite::Error`].
//! - [`postgres`] (feature `postgres`): the bounded [`pool`](postgres::pool),
//!   [`migrate`](postgres::migrate) safe for instances starting together, the batching writer
//!   under the PostgreSQL idempotency store; typed [`postgres::Error`].
//!
//! An application that shares a handle with a store (a [`Db`](sqlite::Db) or a pool) shares
//! its batching too: its own writes ride in the same transactions.

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;
