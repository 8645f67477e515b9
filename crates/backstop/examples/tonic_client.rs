//! One client stack over a whole tonic `Channel`, each method retried by its own policy, the
//! policies read from a gRPC service config.
//!
//! `cargo run -p backstop --example tonic_client` starts a flaky gRPC server on a free port of
//! 127.0.0.1, calls it through the stack, prints what each call got and exits:
//!
//! - `GetBalance` is configured to retry `UNAVAILABLE`: the server fails its first two
//!   attempts, the third answers, and the caller sees only the answer;
//! - `Transfer` is not named by the config, so it is sent once and its `UNAVAILABLE` comes
//!   back to the caller: a transfer is not safe to repeat blindly.
use std::collections::HashMap;
use std::convert::Infallible;
use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use backstop::client::replay::ReplayBody;
use backstop::client::service_config::ServiceConfig;
use backstop::client::{ClientStack, Destination};
use http::uri::PathAndQuery;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::{Service, ServiceExt, service_fn};

/// Per method: `GetBalance` is retried on `UNAVAILABLE` up to 3 attempts in all, with a
/// short backoff; every method of the service gets a 2 s deadline. This is the JSON a gRPC
/// name resolver hands out, or that a team keeps next to its client.
const SERVICE_CONFIG: &str = r#"{
  "methodConfig": [
    {
      "name": [{ "service": "demo.Accounts", "method": "GetBalance" }],
      "timeout": "2s",
      "retryPolicy": {
        "maxAttempts": 3,
        "initialBackoff": "0.01s",
        "maxBackoff": "0.1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"]
      }
    }
  ],
  "retryThrottling": { "maxTokens": 10, "tokenRatio": 0.1 }
}"#;

#[derive(Clone, PartialEq, prost::Message)]
struct Account {
    #[prost(string, tag = "1")]
    id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Balance {
    #[prost(int64, tag = "1")]
    cents: i64,
}

/// A server whose every method fails its first two attempts with `UNAVAILABLE`, counting the
/// attempts it receives per method. Hand-written, as tonic's code generator would write it.
#[derive(Clone, Default)]
struct FlakyAccounts {
    attempts: Arc<Mutex<HashMap<String, usize>>>,
}

impl tonic::server::NamedService for FlakyAccounts {
    const NAME: &'static str = "demo.Accounts";
}

impl Service<http::Request<tonic::body::Body>> for FlakyAccounts {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let nth = {
            let mut attempts = self.attempts.lock().unwrap();
            let n = attempts.entry(request.uri().path().to_owned()).or_default();
            *n += 1;
            *n
        };
        Box::pin(async move {
            let answer = service_fn(move |_: tonic::Request<Account>| async move {
                if nth <= 2 {
                    Err(Status::unavailable("warming up"))
                } else {
                    Ok(tonic::Response::new(Balance { cents: 1999 }))
                }
            });
            let codec = ProstCodec::<Balance, Account>::default();
            Ok(tonic::server::Grpc::new(codec).unary(answer, request).await)
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let accounts = FlakyAccounts::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = Server::builder().add_service(accounts.clone());
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));

    // Parse and validate the config once, at start-up: a bad config fails here, not mid-call.
    let config = ServiceConfig::from_json(SERVICE_CONFIG)?;
    // Every method calling this server shares one destination: one retry budget (from
    // `retryThrottling`), one circuit breaker, one view of the server's latency.
    let destination = Destination::new("accounts").budget(config.budget()?);
    let stack = ClientStack::builder(&destination, config.policies()?).build()?;

    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    // The stack sends a body it can replay for a retry; the channel takes tonic's own body.
    let to_tonic: fn(
        http::Request<ReplayBody<tonic::body::Body>>,
    ) -> http::Request<tonic::body::Body> = |request| request.map(tonic::body::Body::new);
    // One stack over the whole channel: each call finds its policy by its gRPC path.
    let client = tonic::client::Grpc::new(stack.layer(channel.map_request(to_tonic)));

    let call = |method: &str| {
        let mut client = client.clone();
        let path = PathAndQuery::try_from(format!("/demo.Accounts/{method}"));
        async move {
            let path = path.map_err(|e| Status::internal(e.to_string()))?;
            client
                .ready()
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?;
            let request = tonic::Request::new(Account {
                id: "acct-7".into(),
            });
            let codec = ProstCodec::<Account, Balance>::default();
            client.unary(request, path, codec).await
        }
    };
    let attempts =
        |method: &str| accounts.attempts.lock().unwrap()[&format!("/demo.Accounts/{method}")];

    let balance = call("GetBalance").await?;
    println!(
        "GetBalance: OK {} cents after {} attempts (retried UNAVAILABLE)",
        balance.get_ref().cents,
        attempts("GetBalance")
    );
    check(
        attempts("GetBalance") == 3,
        "GetBalance answered on its third attempt",
    )?;

    let transfer = call("Transfer").await.unwrap_err();
    println!(
        "Transfer:   {:?} after {} attempt (not retried)",
        transfer.code(),
        attempts("Transfer")
    );
    check(
        transfer.code() == Code::Unavailable && attempts("Transfer") == 1,
        "Transfer sent once",
    )?;

    println!("ok: each method retried by its own policy over one channel");
    Ok(())
}

/// Fails the example (exit status 1) when what it shows did not happen.
fn check(ok: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected: {what}").into())
    }
}
