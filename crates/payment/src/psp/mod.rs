//! PSP simulator: a fake payment service provider reached over HTTP, with its own store, its
//! own dedup on the effect key, and fault injection.
//!
//! The payment service sends each charge with its effect key (the intent id) as
//! `Idempotency-Key`. The PSP creates at most one charge per effect key, whatever the number
//! of requests, so "PSP timed out, retry with the same key" charges once.
//!
//! # HTTP contract
//!
//! | request | answers |
//! |---|---|
//! | `POST /v1/charges` | `201` + [`Charge`] when the effect key is new; `200` + the same charge and `Idempotent-Replayed: true` when it was seen with the same parameters; `409` `idempotency_key_reused` when seen with another reference, amount or currency |
//! | `POST /v1/voids` | settles the effect key in `Idempotency-Key`: `200` + [`Void`] `{"effect_key", "status": "voided"}` when it has no charge (from then on every charge with that key is refused with `410` `effect_key_voided`), or `{"effect_key", "status": "charged", "charge": {...}}` when it already charged |
//! | `GET /v1/charges?reference=R` | `200` + JSON array of the charges for `R`, newest first (at most [`store::LIST_LIMIT`]) |
//! | `GET /v1/charges` | `200` + the newest charges (at most [`store::LIST_LIMIT`]), newest first |
//! | `GET /v1/charges?created_gte=MS&created_lt=MS&limit=N&starting_after=ID` | `200` + a [`ChargePage`]: the charges created in the window (unix ms; either bound optional), oldest first, after the charge `starting_after`, at most `limit` (1 to [`listing::MAX_PAGE`], default [`listing::DEFAULT_PAGE`]); any of these parameters asks for a page, `reference` filters it too. `400` `invalid_limit`, `invalid_created`, `invalid_window`, `invalid_cursor`, `invalid_reference`, `invalid_query` (an unknown or repeated parameter) |
//! | `POST /v1/refunds` | a [`RefundRequest`] with its own `Idempotency-Key`: `201` + [`Refund`] (the charge's `amount_refunded_cents` grows by the amount); `200` + the same refund and `Idempotent-Replayed: true` for the same key, charge and amount; `409` `idempotency_key_reused` for the same key with another charge or amount; `404` `charge_not_found`; `409` `refund_exceeds_charge` when the amount is more than what is left to refund; `400` `invalid_amount`, `invalid_charge_id`, `invalid_body`, `missing_idempotency_key`, `invalid_idempotency_key`. Faults are not injected on refunds |
//! | `GET /healthz` | `200` `{"status":"ok"}` |
//! | `GET /admin/faults` | `200` + the fault settings and the scripted queue |
//! | `PUT /admin/faults` | replaces the fault settings (below); `400` `invalid_faults` if invalid |
//!
//! `POST /v1/charges` takes a JSON [`ChargeRequest`]
//! `{"reference": "order-1", "amount_cents": 1250, "currency": "USD"}` (unknown fields
//! refused) and the headers:
//! - `Idempotency-Key` (required): the effect key, 1 to 255 visible ASCII characters, bare or
//!   as a quoted Structured Field string;
//! - `grpc-timeout` (optional): the caller's remaining budget, gRPC syntax (1 to 8 digits and
//!   a unit among `H M S m u n`); recorded on the charge as `budget_ms`;
//! - `traceparent` (optional): recorded on the charge as is.
//!
//! A replay returns the charge as first recorded, including the `budget_ms` and `traceparent`
//! of the request that created it. Errors are `application/problem+json` (RFC 9457) with a
//! stable `code`: `400` `missing_idempotency_key`, `invalid_idempotency_key`,
//! `invalid_grpc_timeout`, `invalid_body`, `invalid_amount`, `invalid_reference`,
//! `invalid_currency`; `413` `body_too_large` (64 KiB); `409` `idempotency_key_reused`;
//! `410` `effect_key_voided`;
//! `500` `psp_error` (injected) or `store_error`; `503` `psp_unavailable` (injected) or
//! `shutting_down`, both with `Retry-After: 1`; `504` `deadline_exceeded`. None of these
//! charges anything.
//!
//! # Faults
//!
//! `PUT /admin/faults` takes `{"latency_ms": 0, "error_rate": 0.0, "unavailable_rate": 0.0,
//! "commit_then_timeout_rate": 0.0, "commit_then_drop_rate": 0.0, "next": ["error", ...],
//! "seed": 7}`; every field is optional and a missing one means zero, empty or "keep the RNG".
//! `next` scripts the faults of the next valid charge requests (`none`, `error`,
//! `unavailable`, `commit_then_timeout`, `commit_then_drop`); after the script, faults are
//! drawn from the rates (see [`faults`]). Per charge request, in order:
//! 1. the request is validated (a `400` consumes no fault);
//! 2. latency: the PSP waits; if the caller's deadline falls first, it answers `504` at the
//!    deadline and charges nothing;
//! 3. `error` / `unavailable`: `500` / `503` without charging;
//! 4. the charge is written (durably, for a file database);
//! 5. `commit_then_timeout`: the answer comes one second after the caller's deadline (30 s
//!    after arrival when it sent none); `commit_then_drop`: the TCP connection is closed with
//!    no response at all.
//!
//! # Example
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use backstop_payment::psp::{self, PspConfig};
//!
//! let psp = psp::spawn(PspConfig::default()).await?;
//! let url = format!("{}/v1/charges", psp.url());
//! assert!(url.starts_with("http://127.0.0.1:"));
//! psp.shutdown().await;
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

pub mod faults;
pub mod listing;
mod server;
pub mod store;

pub use faults::{Fault, FaultControl, Faults, FaultsError};
pub use listing::{PageQuery, PageQueryError};
pub use store::{
    Charge, ChargeStatus, ChargeStore, Refund, RefundOutcome, StoreError, VoidOutcome,
};

/// Header carrying the effect key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Header set to `true` on an answer that returns an existing charge.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// Body of `POST /v1/charges`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChargeRequest {
    /// The caller's reference, 1 to 255 bytes (the payment service sends `MERCHANT:ORDER_ID`).
    pub reference: String,
    /// Amount in minor units; must be positive.
    pub amount_cents: i64,
    /// ISO 4217 code: three upper-case letters, e.g. `"USD"`.
    pub currency: String,
}

/// Body of `POST /v1/refunds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefundRequest {
    /// The charge to give money back on.
    pub charge_id: String,
    /// Amount in minor units: positive, at most what is left to refund on the charge.
    pub amount_cents: i64,
}

/// Body of a paged `GET /v1/charges` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargePage {
    /// The charges, oldest first.
    pub data: Vec<Charge>,
    /// Whether more charges follow in the window.
    pub has_more: bool,
    /// The `starting_after` of the next page (the last charge's id), when `has_more`.
    #[serde(default)]
    pub next_starting_after: Option<String>,
}

/// Body of a `POST /v1/voids` answer: how the effect key is settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Void {
    /// The effect key that was settled.
    pub effect_key: String,
    /// `"voided"` (no charge, and none will ever be made) or `"charged"`.
    pub status: VoidStatus,
    /// The charge, when `status` is `"charged"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charge: Option<Charge>,
}

/// How [`Void`] settled an effect key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VoidStatus {
    /// No charge was made under the key, and none will be.
    Voided,
    /// The key had charged (the answer carries the charge).
    Charged,
}

/// How to run a PSP simulator.
#[derive(Debug, Clone, PartialEq)]
pub struct PspConfig {
    /// Address to listen on; port 0 lets the OS choose.
    pub listen: SocketAddr,
    /// SQLite database file; `None` keeps charges in memory for the life of the process.
    pub db_path: Option<PathBuf>,
    /// Initial fault settings (changeable at run time through `PUT /admin/faults`).
    pub faults: Faults,
    /// Seed of the fault RNG, for reproducible runs.
    pub seed: Option<u64>,
}

impl Default for PspConfig {
    /// `127.0.0.1:0`, in memory, no faults, random seed.
    fn default() -> Self {
        PspConfig {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            db_path: None,
            faults: Faults::default(),
            seed: None,
        }
    }
}

/// Why the PSP could not start.
#[derive(Debug, thiserror::Error)]
pub enum PspError {
    /// The fault settings are invalid.
    #[error("invalid PSP fault settings")]
    Faults(#[from] FaultsError),
    /// The store could not be opened or migrated.
    #[error("cannot open the PSP store")]
    Store(#[from] StoreError),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The bound socket has no readable local address.
    #[error("cannot read the PSP's bound address")]
    LocalAddr(#[source] std::io::Error),
}

/// A PSP running in the background, started by [`spawn`]. Dropping the handle shuts the PSP
/// down too; [`PspHandle::shutdown`] also waits for it to finish.
#[derive(Debug)]
pub struct PspHandle {
    addr: SocketAddr,
    store: ChargeStore,
    faults: FaultControl,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl PspHandle {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, e.g. `http://127.0.0.1:40123` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its store, for direct inspection.
    pub fn store(&self) -> &ChargeStore {
        &self.store
    }

    /// Its fault settings, the same state `PUT /admin/faults` changes.
    pub fn faults(&self) -> &FaultControl {
        &self.faults
    }

    /// Stops accepting, lets in-flight requests finish (held requests are cut: their caller
    /// sees the connection close), and waits until the server has stopped.
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        if let Err(error) = self.task.await {
            if error.is_panic() {
                std::panic::resume_unwind(error.into_panic());
            }
        }
    }
}

struct Prepared {
    listener: TcpListener,
    addr: SocketAddr,
    store: ChargeStore,
    faults: FaultControl,
}

async fn prepare(config: PspConfig) -> Result<Prepared, PspError> {
    let faults = FaultControl::new(config.faults, config.seed)?;
    let db_path = config.db_path;
    let store = ChargeStore::open(db_path.as_deref()).await?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| PspError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(PspError::LocalAddr)?;
    tracing::info!(%addr, "psp listening");
    Ok(Prepared {
        listener,
        addr,
        store,
        faults,
    })
}

fn start(prepared: Prepared, stop: impl Future<Output = ()>) -> impl Future<Output = ()> {
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let state = server::AppState {
        store: prepared.store,
        faults: prepared.faults,
        shutdown: shutdown_rx,
    };
    server::run(prepared.listener, state, shutdown_tx, stop)
}

/// Runs a PSP on `config.listen` until `shutdown` resolves, then drains in-flight requests
/// (bounded) and returns. Used by `backstop psp`.
pub async fn serve(config: PspConfig, shutdown: impl Future<Output = ()>) -> Result<(), PspError> {
    let prepared = prepare(config).await?;
    start(prepared, shutdown).await;
    tracing::info!("psp stopped");
    Ok(())
}

/// Starts a PSP in the background and returns once it accepts connections. Give
/// `listen: 127.0.0.1:0` (the [`PspConfig::default`]) for an OS-chosen port; the handle tells
/// which. Used to embed a PSP in `backstop serve` and in tests.
pub async fn spawn(config: PspConfig) -> Result<PspHandle, PspError> {
    let prepared = prepare(config).await?;
    let addr = prepared.addr;
    let store = prepared.store.clone();
    let faults = prepared.faults.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    // A dropped handle drops `stop`, which also resolves `stopped`.
    let task = tokio::spawn(start(prepared, async move {
        let _ = stopped.await;
    }));
    Ok(PspHandle {
        addr,
        store,
        faults,
        stop,
        task,
    })
}
