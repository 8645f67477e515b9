//! The reference payment service and the PSP simulator it charges through.
//!
//! # Layout
//! - [`server`]: start-up and graceful shutdown; both APIs behind one server stack.
//! - [`service`]: the payment logic and the HTTP API (`POST /v1/payments`,
//!   `GET /v1/payments/{id}`, `/metrics`, `/healthz`, `/readyz`).
//! - [`grpc`]: the gRPC API (`payment.v1.Payment`) over the same payment logic.
//! - [`state`]: [`AppState`](state::AppState), what both APIs and the resolver share.
//! - [`trace`]: W3C `traceparent`, read from callers and propagated to the PSP.
//! - [`intents`]: the `payment_intent` table on the shared group-commit SQLite
//!   database or on PostgreSQL.
//! - [`psp_client`]: the PSP client: effect key, child deadline, `traceparent`, the client stack.
//! - [`auth`]: bearer API keys to merchant (the library's `Tenant`).
//! - [`config`]: what `backstop serve` flags configure, validated before start.
//! - [`policies`]: the service's method table: its entries, its default, the rules a table
//!   from a config file is held to.
//! - [`psp`]: the PSP simulator (a fake payment provider with its own store and dedup).
//! - [`reconcile`]: compares the PSP's charges with the intents, refunds duplicates and
//!   records what it did.
//! - [`resolver`]: settles intents left `running` by abandoned work (charged, or voided at the
//!   PSP and failed).
//!
//! Dependencies run one way: [`server`] builds on [`grpc`] and [`service`], [`grpc`] on
//! [`service`], and both on [`state`]; [`server`] reads [`config`], which builds on
//! [`policies`] and imports no server.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
pub mod grpc;
pub mod intents;
pub mod policies;
pub mod psp;
pub mod psp_client;
pub mod reconcile;
pub mod resolver;
pub mod server;
pub mod service;
pub mod state;
pub mod trace;
