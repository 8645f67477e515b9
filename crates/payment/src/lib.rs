//! The reference payment service and the PSP simulator it charges through.
//!
//! # Layout
//! - [`service`]: the HTTP payment service (`POST /v1/payments`, `GET /v1/payments/{id}`,
//!   `/metrics`, `/healthz`, `/readyz`), its start-up and graceful shutdown.
//! - [`grpc`]: the gRPC payment service (`payment.v1.Payment`) behind the same server stack.
//! - [`intents`]: the `payment_intent` table on the shared group-commit SQLite
//!   database or on PostgreSQL.
//! - [`psp_client`]: the PSP client: effect key, child deadline, `traceparent`, the client stack.
//! - [`auth`]: bearer API keys to merchant (the library's `Tenant`).
//! - [`config`]: what `backstop serve` flags configure, validated before start.
//! - [`psp`]: the PSP simulator (a fake payment provider with its own store and dedup).
//! - [`reconcile`]: compares the PSP's charges with the intents, refunds duplicates and
//!   records what it did.
//! - [`resolver`]: settles intents left `running` by abandoned work (charged, or voided at the
//!   PSP and failed).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
pub mod grpc;
pub mod intents;
pub mod psp;
pub mod psp_client;
pub mod reconcile;
pub mod resolver;
pub mod service;
