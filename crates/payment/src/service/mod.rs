//! The HTTP payment service.
//!
//! # Layout
//! - [`request`]: the `POST /v1/payments` body, validated with one problem code per mistake.
//! - [`trace`]: W3C `traceparent` read, generated and propagated.

pub mod request;
pub mod trace;
