//! [`AppState`]: what serving a payment needs, whichever protocol it came in on.

use std::sync::Arc;

use backstop::clock::Clock;

use crate::intents::Intents;
use crate::psp_client::PspClient;

/// Everything the HTTP handlers, the gRPC service and the resolver share. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    pub(crate) intents: Intents,
    pub(crate) psp: PspClient,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) metrics: metrics_exporter_prometheus::PrometheusHandle,
}

impl AppState {
    /// State over the intent table, the PSP client, a wall clock (for `created_at`) and the
    /// Prometheus handle that `/metrics` renders.
    pub fn new(
        intents: Intents,
        psp: PspClient,
        clock: Arc<dyn Clock>,
        metrics: metrics_exporter_prometheus::PrometheusHandle,
    ) -> Self {
        AppState {
            intents,
            psp,
            clock,
            metrics,
        }
    }

    /// The intent table.
    pub fn intents(&self) -> &Intents {
        &self.intents
    }

    /// The PSP client.
    pub fn psp(&self) -> &PspClient {
        &self.psp
    }
}
