//! `grpc.health.v1.Health` and server reflection on the gRPC port of a live service, through
//! tonic-health's and tonic-reflection's generated clients: served beside the server stack (no
//! bearer key, not counted as payment traffic), `NOT_SERVING` from the moment draining starts.

mod support;

use std::num::NonZeroU32;

use backstop_payment::config::{ApiKey, Config, PspTarget, StoreLocation};
use backstop_payment::grpc::health::PAYMENT_SERVICE;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use backstop_payment::psp::{self, PspConfig};
use backstop_payment::server::Server;
use futures_util::stream;
use support::Harness;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A channel to `addr` (the generated clients of tonic-health and tonic-reflection are built
/// without tonic's transport, so without `connect`).
async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("gRPC channel connects")
}

async fn health_client(addr: std::net::SocketAddr) -> HealthClient<Channel> {
    HealthClient::new(channel(addr).await)
}

fn request(service: &str) -> HealthCheckRequest {
    HealthCheckRequest {
        service: service.to_owned(),
    }
}

/// A service that takes only a bearer key, with a merchant quota of one request per second.
async fn start_closed() -> Harness {
    Harness::start_with(|c| {
        c.api_keys = vec![ApiKey::parse("acme=key-acme-0001").unwrap()];
        c.tenant_rate = NonZeroU32::new(1).unwrap();
        c.tenant_burst = NonZeroU32::new(1).unwrap();
    })
    .await
}

#[tokio::test]
async fn check_answers_serving_without_a_key_and_not_found_for_unknown_services() {
    let h = start_closed().await;
    let mut health = health_client(h.server.grpc_addr()).await;
    // More checks than the quota allows: probes are never rate-limited either.
    for _ in 0..5 {
        for service in ["", PAYMENT_SERVICE] {
            let answer = health
                .check(request(service))
                .await
                .unwrap_or_else(|s| panic!("Check({service:?}): {s:?}"))
                .into_inner();
            assert_eq!(answer.status(), ServingStatus::Serving, "{service:?}");
        }
    }
    let unknown = health.check(request("no.such.Service")).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");

    // The payment service on the same port still wants the key.
    let mut payments = PaymentClient::connect(format!("http://{}", h.server.grpc_addr()))
        .await
        .unwrap();
    let refused = payments
        .get_charge(backstop_payment::grpc::proto::GetChargeRequest {
            intent_id: "pi_none".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    // Neither counted nor logged as payment traffic: the metrics name only the refused call.
    let metrics = h.get("/metrics", &[]).await;
    let text = String::from_utf8_lossy(&metrics.bytes);
    assert!(
        text.lines()
            .any(|l| l.starts_with("rpc_server_requests_total") && l.contains("GetCharge")),
        "{text}"
    );
    assert!(!text.contains("grpc.health"), "{text}");
    assert!(!text.contains("unmatched"), "{text}");
}

#[tokio::test]
async fn watch_opened_before_the_drain_sees_not_serving_then_ends() {
    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig {
        db_path: Some(dir.path().join("psp.db")),
        ..PspConfig::default()
    })
    .await
    .expect("psp starts");
    let mut config = Config::new(StoreLocation::Sqlite(dir.path().join("pay.db")));
    config.http = "127.0.0.1:0".parse().unwrap();
    config.grpc = "127.0.0.1:0".parse().unwrap();
    config.psp = PspTarget::Url(psp.url());
    let server = Server::bind(config).await.expect("service starts");
    let addr = server.grpc_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));

    let mut health = health_client(addr).await;
    let mut watches = Vec::new();
    for service in ["", PAYMENT_SERVICE] {
        let mut watch = health.watch(request(service)).await.unwrap().into_inner();
        let first = watch.message().await.unwrap().expect("the current status");
        assert_eq!(first.status(), ServingStatus::Serving, "{service:?}");
        watches.push((service, watch));
    }

    stop.send(()).unwrap();
    for (service, mut watch) in watches {
        let next = watch.message().await.unwrap().expect("the drain's status");
        assert_eq!(next.status(), ServingStatus::NotServing, "{service:?}");
        // The stream ends, so it does not hold the drain open.
        assert!(watch.message().await.unwrap().is_none(), "{service:?}");
    }
    running.await.unwrap().expect("the server stops cleanly");
}

mod reflection {
    use super::*;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};
    use tonic_reflection::pb::v1alpha;

    async fn ask(h: &Harness, message: MessageRequest) -> ServerReflectionResponse {
        let mut client = ServerReflectionClient::new(channel(h.server.grpc_addr()).await);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(message),
        };
        let mut answers = client
            .server_reflection_info(stream::iter([request]))
            .await
            .expect("reflection answers without a key")
            .into_inner();
        answers.message().await.unwrap().expect("one answer")
    }

    #[tokio::test]
    async fn lists_payment_and_health_and_resolves_charge() {
        let h = start_closed().await;
        let answer = ask(&h, MessageRequest::ListServices(String::new())).await;
        let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
            panic!("not a service list: {answer:?}");
        };
        let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        for expected in [
            "payment.v1.Payment",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
        ] {
            assert!(names.contains(&expected), "{expected} not in {names:?}");
        }

        let answer = ask(
            &h,
            MessageRequest::FileContainingSymbol("payment.v1.Payment.Charge".into()),
        )
        .await;
        let Some(MessageResponse::FileDescriptorResponse(files)) = answer.message_response else {
            panic!("no file for payment.v1.Payment.Charge: {answer:?}");
        };
        assert!(
            files
                .file_descriptor_proto
                .iter()
                .any(|file| file.windows(24).any(|w| w == b"payment/v1/payment.proto")),
            "{files:?}"
        );
    }

    #[tokio::test]
    async fn v1alpha_lists_the_same_services() {
        let h = start_closed().await;
        let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(
            channel(h.server.grpc_addr()).await,
        );
        let request = v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(
                v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
            ),
        };
        let answer = client
            .server_reflection_info(stream::iter([request]))
            .await
            .unwrap()
            .into_inner()
            .message()
            .await
            .unwrap()
            .expect("one answer");
        let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
            answer.message_response
        else {
            panic!("not a service list: {answer:?}");
        };
        let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"payment.v1.Payment"), "{names:?}");
        assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    }
}
