//! Span export for `serve --otlp-endpoint` (feature `otel`): OTLP over HTTP/protobuf with a
//! batch span processor, through `tracing-opentelemetry`.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response, Uri};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{
    ExporterBuildError, Protocol, SpanExporter, WithExportConfig, WithHttpConfig,
};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tokio::runtime::Handle;

use crate::logging::ExtraLayer;

/// How long one export request may take (the OTLP default).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long shutting down may take to send the spans still batched.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// The installed exporter; [`Export::shutdown`] sends what is still batched.
#[derive(Debug)]
pub(crate) struct Export {
    provider: SdkTracerProvider,
}

/// Builds the exporter sending to `traces_url` (`…/v1/traces`) and the layer that hands it the
/// process's spans.
pub(crate) fn install(traces_url: &Uri) -> Result<(Export, ExtraLayer), ExporterBuildError> {
    let client = OnRuntime {
        client: HyperClient::with_default_connector(EXPORT_TIMEOUT, None),
        runtime: Handle::current(),
    };
    let exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(traces_url.to_string())
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(client)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name("backstop").build())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("backstop"));
    Ok((Export { provider }, Box::new(layer)))
}

impl Export {
    /// Sends the spans still batched and stops the exporter; a failure is logged, not fatal:
    /// the service has already stopped.
    pub(crate) async fn shutdown(self) {
        // The batch processor's thread waits for the export, which runs on this runtime: wait
        // for it off the runtime's workers.
        let provider = self.provider;
        let result =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT))
                .await;
        match result {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "span export did not finish"),
            Err(error) => tracing::warn!(%error, "span export did not finish"),
        }
    }
}

/// The hyper client, run on the service's runtime: the batch span processor exports from a
/// thread of its own, which has no runtime to drive a connection.
#[derive(Debug)]
struct OnRuntime {
    client: HyperClient,
    runtime: Handle,
}

#[async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        self.runtime
            .spawn(async move { client.send_bytes(request).await })
            .await?
    }
}
