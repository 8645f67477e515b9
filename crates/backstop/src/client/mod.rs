//! The client stack: one logical request turned into safe attempts.
//!
//! Every mechanism is a tower layer over `http::Request<B> -> http::Response<B>`, so the same
//! stack wraps a tonic `Channel` (gRPC), a hyper-util client or any HTTP client exposed as a
//! tower service. [`ClientStack`] composes them, and runs each call by its method's
//! [`MethodPolicy`](crate::policy::MethodPolicy), found by the call's path (the full gRPC
//! method path, or an HTTP route) in the stack's
//! [`MethodPolicies`](crate::policy::MethodPolicies): one stack serves every method of a
//! channel. Outermost first:
//!
//! 0. [`SelectMethod`]: the call's method policy, looked up once; the layers below read the
//!    one it chose.
//! 1. [`idempotency`]: one idempotency key per logical call (`Keyed` methods), made once and, with
//!    an [`IntentJournal`](idempotency::IntentJournal), stored before the first send so a restarted
//!    client resumes with the same key. Outermost, so nothing below can make a second key.
//! 2. [`deadline`] ([`SetDeadline`](deadline::SetDeadline)): one deadline for the whole call.
//!    Above retry, so retries share it and can never extend it.
//! 3. [`retry`]: the [`RetryPolicy`](crate::retry::RetryPolicy) executor: eligibility from the
//!    method's policy, [`replay`] of the body, the destination's budget and
//!    [storm alarm](crate::retry::StormAlarm) (no retry or hedge while its retry ratio says
//!    it is down for everyone), its [adaptive throttle](crate::retry::AdaptiveThrottle) if
//!    set (attempts rejected locally while the server refuses load), full jitter,
//!    pushback, `grpc-previous-rpc-attempts`, and a stop reason on every stop. An attempt
//!    that could still be retried and is left unanswered past the destination's
//!    [`AttemptLimit`](retry::AttemptLimit) (half the time left, when that is more than
//!    `max(1 s, 10 x RTT_p99)`, by default) is abandoned for the next one, so an attempt
//!    stranded on a connection that went away costs half the deadline, not all of it, even
//!    without hedging.
//! 4. [`hedge`]: an extra attempt after the rolling p95 or a fixed delay, one unless the
//!    method allows more (`Safe`/`Keyed` methods only), paid from the same budget. Below retry, so a hedge is part of one attempt.
//! 5. [`deadline`] ([`AttemptTimeout`](deadline::AttemptTimeout)): each attempt (hedges too)
//!    carries `grpc-timeout` = remaining - margin, or is not sent at all.
//! 6. [`breaker`]: per destination; open means attempts fail at once (`circuit_open`). Below
//!    the attempt timeout, so an attempt refused for lack of time is not counted against the
//!    destination.
//! 7. [`transparent`]: one re-send of an attempt that provably never reached the server,
//!    without spending the method's attempts. Innermost, just above the transport, where those
//!    errors are seen.
//!
//! Below it sits the transport: [`connect`] (pooled hyper-util clients, balancing over
//! several endpoints) or a tonic channel. [`service_config`] reads gRPC service configs into the same
//! policies. Every attempt is counted (`rpc_client_attempts_total{attempt,outcome}`,
//! `rpc_client_attempt_duration_seconds`), every hedge (`rpc_client_hedges_total`) and retry
//! (`rpc_client_retries_total`), and logged as an `rpc_attempt` event. An [`AttemptObserver`]
//! set with [`ClientStackBuilder::observer`] is told the same, from the same places: each
//! physical send (first attempt, retry, hedge, transparent re-send) as it ends, and each
//! call's end with why its attempts stopped (see [`observer`]).
//!
//! A call that fails says whether its request may have reached the server ([`Error::reach`]:
//! never sent, sent with the outcome unknown, or answered), over every attempt, hedge and
//! re-send the layers made of it: what decides whether sending it again is safe.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//! use backstop::client::{ClientStack, Destination};
//! use backstop::policy::{Idempotency, MethodPolicy, KEY_TTL_PAYMENTS};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{Layer, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // A transport that fails the first attempt, recording the keys it sees.
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let transport = {
//!     let seen = seen.clone();
//!     service_fn(move |request: Request<_>| {
//!         let mut seen = seen.lock().unwrap();
//!         seen.push(request.headers()["idempotency-key"].to_str().unwrap().to_owned());
//!         let status = if seen.len() == 1 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!         async move { Ok::<_, std::io::Error>(Response::builder().status(status).body(()).unwrap()) }
//!     })
//! };
//!
//! let psp = Destination::new("psp");
//! let charge = MethodPolicy::builder("Charge", Idempotency::Keyed)
//!     .timeout(Duration::from_secs(2))
//!     .key_ttl(KEY_TTL_PAYMENTS)
//!     .build();
//! let client = ClientStack::builder(&psp, charge).build()?.layer(transport);
//!
//! let request = Request::post("http://psp/v1/charges").body(Full::new(Bytes::from("{}")))?;
//! let response = client.oneshot(request).await?;
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let seen = seen.lock().unwrap();
//! assert_eq!(seen.len(), 2);
//! assert_eq!(seen[0], seen[1], "one key for the logical call, on every attempt");
//! # Ok(())
//! # }
//! ```

mod body_error;
pub mod breaker;
mod circuit_open;
pub mod classify;
pub mod connect;
pub mod deadline;
mod error;
pub mod future;
pub mod hedge;
pub mod idempotency;
pub mod observer;
mod previous_attempts;
mod reach;
pub mod replay;
pub mod retry;
mod select;
pub mod service_config;
pub mod slots;
mod stack;
pub mod transparent;

pub use self::body_error::RequestBodyError;
pub use self::error::Error;
pub use self::observer::AttemptObserver;
pub use self::reach::Reach;
pub use self::select::SelectMethod;
pub use self::stack::{
    ClientService, ClientStack, ClientStackBuilder, Destination, HttpService, StackError,
    Throttling,
};
