//! A gRPC service on tonic's own server with backstop's server stack in front of it:
//! `Server::builder().layer(stack)`.
//!
//! `cargo run -p backstop --example tonic_server` serves on a free port of 127.0.0.1, calls
//! itself over a tonic channel, prints what each call got and exits:
//!
//! - `Charge` retried with the same `idempotency-key` is answered from the store (metadata
//!   `idempotent-replayed: true`): charged once;
//! - `Charge` without a key is refused with `INVALID_ARGUMENT` before the handler runs;
//! - while the gate is full, a call is refused with `UNAVAILABLE` and
//!   `grpc-retry-pushback-ms`, which gRPC clients honour before retrying.
//!
//! The service is written by hand, as tonic's code generator would write it for
//!
//! ```proto
//! service Payments {
//!   rpc Charge(ChargeRequest) returns (Receipt);
//!   rpc Settle(google.protobuf.Empty) returns (Receipt); // slow
//! }
//! ```
//!
//! so the example needs no `build.rs`; a generated `PaymentsServer` goes under the same layer.
use std::convert::Infallible;
use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use backstop::admission::Gate;
use backstop::idempotency::{IdempotencyKey, MemoryStore};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http_body::Body;
use tokio::sync::Notify;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::{BoxError, Service, service_fn};

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeRequest {
    #[prost(string, tag = "1")]
    order_id: String,
    #[prost(int64, tag = "2")]
    amount_cents: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Receipt {
    #[prost(string, tag = "1")]
    text: String,
}

const CHARGE: &str = "/demo.Payments/Charge";
const SETTLE: &str = "/demo.Payments/Settle";

#[derive(Clone, Default)]
struct Payments {
    charges: Arc<AtomicUsize>,
    // The slow `Settle` says when it has started, and waits until told to finish.
    settle_started: Arc<Notify>,
    settle_finish: Arc<Notify>,
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "demo.Payments";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

// Generic over the request body: behind the stack it is the layers' body, not tonic's.
impl<B> Service<http::Request<B>> for Payments
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let app = self.clone();
        Box::pin(async move {
            Ok(match request.uri().path() {
                CHARGE => {
                    let charge = service_fn(move |r: tonic::Request<ChargeRequest>| {
                        let app = app.clone();
                        async move { app.charge(r) }
                    });
                    let codec = ProstCodec::<Receipt, ChargeRequest>::default();
                    tonic::server::Grpc::new(codec).unary(charge, request).await
                }
                SETTLE => {
                    let settle = service_fn(move |_: tonic::Request<()>| {
                        let app = app.clone();
                        async move { app.settle().await }
                    });
                    let codec = ProstCodec::<Receipt, ()>::default();
                    tonic::server::Grpc::new(codec).unary(settle, request).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

impl Payments {
    /// Runs once per key: the idempotency layer claimed it before letting the call through.
    fn charge(
        &self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<Receipt>, Status> {
        let key = request.extensions().get::<IdempotencyKey>().cloned();
        let key = key.ok_or_else(|| Status::internal("the stack always sets the key"))?;
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        let ChargeRequest {
            order_id,
            amount_cents,
        } = request.into_inner();
        Ok(tonic::Response::new(Receipt {
            text: format!("charge #{n} for key {key}: order {order_id}, {amount_cents} cents"),
        }))
    }

    async fn settle(&self) -> Result<tonic::Response<Receipt>, Status> {
        self.settle_started.notify_one();
        self.settle_finish.notified().await;
        Ok(tonic::Response::new(Receipt {
            text: "settled".into(),
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // Charge needs an `idempotency-key` (metadata) and its answers are kept 7 days; the
    // table names it by its gRPC path, `/package.Service/Method`.
    let charge = MethodPolicy::builder("Charge", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .method(CHARGE, charge)
        .validated()?;
    let stack = ServerStack::new("payments", MemoryStore::new())
        .policies(policies)
        // One call at a time so that one slow call fills the gate; a call that takes at least
        // 100 ms is not worth admitting with less budget than that left.
        .gate(Gate::new(1, Duration::from_millis(100)));
    let payments = Payments::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = Server::builder()
        .layer(stack.into_layer())
        .add_service(payments.clone());
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    println!("serving on {addr}");

    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let client = tonic::client::Grpc::new(channel);
    let charge = |key: Option<&'static str>, timeout: Duration| {
        let mut client = client.clone();
        async move {
            let mut request = tonic::Request::new(ChargeRequest {
                order_id: "42".into(),
                amount_cents: 1999,
            });
            // Sent as `grpc-timeout`: the server's deadline layer makes it the call's deadline.
            request.set_timeout(timeout);
            if let Some(key) = key {
                request
                    .metadata_mut()
                    .insert("idempotency-key", key.parse().unwrap());
            }
            client
                .ready()
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let codec = ProstCodec::<ChargeRequest, Receipt>::default();
            client
                .unary(request, PathAndQuery::from_static(CHARGE), codec)
                .await
        }
    };
    let budget = Duration::from_secs(5);

    let first = charge(Some("order-42"), budget).await?;
    println!("first call: OK {}", first.get_ref().text);

    // The client did not hear the answer (say, a timeout) and sends the same call again.
    let retry = charge(Some("order-42"), budget).await?;
    let replayed = metadata(retry.metadata(), "idempotent-replayed");
    println!(
        "retry:      OK idempotent-replayed: {replayed} {}",
        retry.get_ref().text
    );
    check(
        retry.get_ref() == first.get_ref(),
        "the retry gets the first answer back",
    )?;
    check(
        payments.charges.load(Ordering::SeqCst) == 1,
        "charged once for two calls",
    )?;

    let keyless = charge(None, budget).await.unwrap_err();
    println!("no key:     {:?} {}", keyless.code(), keyless.message());
    check(
        keyless.code() == Code::InvalidArgument,
        "a keyed method needs a key",
    )?;

    // Fill the gate with a slow call, then knock: the second call waits only as long as its
    // 1 s budget can still cover the 100 ms a call takes, then it is told when to retry.
    let slow = {
        let mut client = client.clone();
        tokio::spawn(async move {
            client
                .ready()
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let codec = ProstCodec::<(), Receipt>::default();
            client
                .unary(
                    tonic::Request::new(()),
                    PathAndQuery::from_static(SETTLE),
                    codec,
                )
                .await
        })
    };
    payments.settle_started.notified().await;
    let refused = charge(Some("order-43"), Duration::from_secs(1))
        .await
        .unwrap_err();
    let pushback = metadata(refused.metadata(), "grpc-retry-pushback-ms");
    println!(
        "gate full:  {:?} grpc-retry-pushback-ms: {pushback}",
        refused.code()
    );
    check(
        refused.code() == Code::Unavailable && pushback != "-",
        "a full gate answers UNAVAILABLE with a pushback",
    )?;
    payments.settle_finish.notify_one();
    let settled = slow.await??;
    println!("slow call:  OK {}", settled.get_ref().text);

    println!(
        "ok: one charge for two calls, INVALID_ARGUMENT without a key, UNAVAILABLE + pushback when full"
    );
    Ok(())
}

fn metadata(metadata: &tonic::metadata::MetadataMap, name: &str) -> String {
    metadata
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

/// Fails the example (exit status 1) when what it shows did not happen.
fn check(ok: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected: {what}").into())
    }
}
