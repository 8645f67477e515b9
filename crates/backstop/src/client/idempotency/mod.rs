//! The client's idempotency key: one per logical call, made once, before anything is sent.
//!
//! The most expensive retry bug is the simplest: the key is generated inside the retry loop,
//! every attempt looks new to the server, and one intent is charged twice.
//! [`IdempotencyKeyService`] sits above the retry layer, so it runs once per
//! logical call: it sets the `Idempotency-Key` header (for gRPC the metadata key is the same
//! name, `idempotency-key`), and every attempt, retry and hedge below it carries that value.
//!
//! - A request that already carries a key (e.g. a payment service's effect key) keeps it.
//! - Else, when an [`IntentJournal`] is configured and the request names its [`Operation`],
//!   the key comes from the journal: stored durably before the first send, the same one again
//!   after a restart, and marked complete once the outcome is known (a success or a definitive
//!   refusal). An unknown outcome (timeout, 5xx, transport error) stays pending, to be resumed
//!   with the same key.
//! - Else a fresh UUIDv7 key.
//!
//! The key is also put in the request's extensions as an
//! [`IdempotencyKey`].

#[cfg(feature = "sqlite")]
mod journal;
mod layer;

#[cfg(feature = "sqlite")]
pub use self::journal::{IntentJournal, JournalError, MAX_OPERATION_LEN};
pub use self::layer::IdempotencyKeyLayer;

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderName, HeaderValue, Request, Response};
use tower::BoxError;
#[cfg(feature = "sqlite")]
use tower::ServiceExt;
use tower_service::Service;

#[cfg(feature = "sqlite")]
use crate::client::classify::response_status;
use crate::client::future::LayerFuture;
use crate::client::select::Selected;
use crate::idempotency::IdempotencyKey;
use crate::policy::Idempotency;
#[cfg(feature = "sqlite")]
use crate::status::RetryClass;

/// The key's header (HTTP) and metadata key (gRPC): `idempotency-key`.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response future of [`IdempotencyKeyService`]: the inner call's own future unless the
/// key comes from the journal.
pub type ResponseFuture<F, T> = LayerFuture<F, T>;

/// Names a logical operation (e.g. `"order-42/charge"`) in a request's extensions, so the
/// [`IntentJournal`] can find its key again after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Operation(Arc<str>);

impl Operation {
    /// An operation id (1 to 512 bytes; the journal refuses others).
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Self(id.into())
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Gives each logical call its idempotency key (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct IdempotencyKeyService<S> {
    inner: S,
    enabled: bool,
    #[cfg(feature = "sqlite")]
    journal: Option<IntentJournal>,
}

impl<S> IdempotencyKeyService<S> {
    /// Wraps `inner`; keys are generated, not journaled.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            enabled: true,
            #[cfg(feature = "sqlite")]
            journal: None,
        }
    }

    /// Wraps `inner` without adding keys (for methods that need none: `Safe` and `Unsafe`).
    pub fn disabled(inner: S) -> Self {
        Self {
            enabled: false,
            ..Self::new(inner)
        }
    }

    /// Whether calls get a key (the client stack turns it off for a method that needs none,
    /// keeping the journal for the methods of its table that do).
    pub(crate) fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Wraps `inner`, taking the keys of requests that name an [`Operation`] from `journal`.
    #[cfg(feature = "sqlite")]
    pub fn journaled(inner: S, journal: IntentJournal) -> Self {
        Self {
            inner,
            enabled: true,
            journal: Some(journal),
        }
    }
}

impl<S, B, ResB> Service<Request<B>> for IdempotencyKeyService<S>
where
    S: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, Response<ResB>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        // Under a client stack serving several methods, whether the call's own method is keyed.
        let enabled = match request.extensions().get::<Selected>() {
            Some(selected) => selected.0.idempotency == Idempotency::Keyed,
            None => self.enabled,
        };
        if !enabled {
            return LayerFuture::direct(self.inner.call(request));
        }
        if let Some(given) = request.headers().get(&IDEMPOTENCY_KEY) {
            if let Some(key) = given
                .to_str()
                .ok()
                .and_then(|v| IdempotencyKey::parse(v).ok())
            {
                request.extensions_mut().insert(key);
            }
            return LayerFuture::direct(self.inner.call(request));
        }
        #[cfg(feature = "sqlite")]
        if let (Some(journal), Some(op)) = (&self.journal, request.extensions().get::<Operation>())
        {
            let call = journaled(self.inner.clone(), journal.clone(), op.clone(), request);
            return LayerFuture::boxed(Box::pin(call));
        }
        let key = IdempotencyKey::generate();
        match key_header_value(&key) {
            Ok(value) => {
                request.headers_mut().insert(IDEMPOTENCY_KEY.clone(), value);
                request.extensions_mut().insert(key);
                LayerFuture::direct(self.inner.call(request))
            }
            Err(e) => LayerFuture::boxed(Box::pin(async move { Err(e.into()) })),
        }
    }
}

/// `key` as the `idempotency-key` value, marked sensitive: HTTP/2 sends it as a never-indexed
/// literal, since a key is used by one logical call only and indexing it would just evict the
/// peer's useful HPACK entries (and keys are not for intermediaries' tables anyway).
fn key_header_value(key: &IdempotencyKey) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
    let mut value = HeaderValue::from_str(&key.header_value())?;
    value.set_sensitive(true);
    Ok(value)
}

/// A call whose key comes from the journal: stored before the first send, marked complete once
/// the outcome is known.
#[cfg(feature = "sqlite")]
async fn journaled<S, B, ResB>(
    inner: S,
    journal: IntentJournal,
    op: Operation,
    mut request: Request<B>,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    let key = journal.begin(op.as_str()).await?;
    let value = key_header_value(&key)?;
    request.headers_mut().insert(IDEMPOTENCY_KEY.clone(), value);
    request.extensions_mut().insert(key.clone());
    let result = inner.oneshot(request).await.map_err(Into::into);
    if let Ok(response) = &result {
        let known = response_status(response).is_none_or(|s| s.retry_class() == RetryClass::Fatal);
        if known {
            if let Err(e) = journal.complete(op.as_str()).await {
                // The operation stays pending; resuming it sends the same key and the server
                // replays its stored answer.
                tracing::warn!(error = %e, idempotency_key = key.as_str(), "intent journal complete failed");
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_test::mock;

    #[tokio::test]
    async fn one_key_per_logical_call_and_a_given_key_is_kept() {
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = IdempotencyKeyService::new(svc);
        handle.allow(3);
        let mut keys = Vec::new();
        for _ in 0..2 {
            let call = tokio::spawn(svc.ready().await.unwrap().call(Request::new(())));
            let (sent, send) = handle.next_request().await.unwrap();
            let header = sent.headers()[&IDEMPOTENCY_KEY]
                .to_str()
                .unwrap()
                .to_owned();
            let ext = sent.extensions().get::<IdempotencyKey>().unwrap();
            assert_eq!(ext.as_str(), header);
            assert!(
                sent.headers()[&IDEMPOTENCY_KEY].is_sensitive(),
                "a one-call key must not be HPACK-indexed"
            );
            keys.push(header);
            send.send_response(Response::new(()));
            call.await.unwrap().unwrap();
        }
        assert_ne!(keys[0], keys[1], "each logical call has its own key");

        let given = Request::builder()
            .header("idempotency-key", "pi_123")
            .body(())
            .unwrap();
        let call = tokio::spawn(svc.ready().await.unwrap().call(given));
        let (sent, send) = handle.next_request().await.unwrap();
        assert_eq!(sent.headers()[&IDEMPOTENCY_KEY], "pi_123");
        send.send_response(Response::new(()));
        call.await.unwrap().unwrap();
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn journaled_operations_resume_with_their_key_until_the_outcome_is_known() {
        let dir = tempfile::tempdir().unwrap();
        let journal = IntentJournal::open(dir.path().join("j.db")).await.unwrap();
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = IdempotencyKeyService::journaled(svc, journal.clone());
        handle.allow(3);
        let request = || {
            let mut r = Request::new(());
            r.extensions_mut().insert(Operation::new("order-7/charge"));
            r
        };

        // The key is stored before the send; a 504 leaves the outcome unknown.
        let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
        let (sent, send) = handle.next_request().await.unwrap();
        let first = sent.headers()[&IDEMPOTENCY_KEY]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(journal.is_pending("order-7/charge").await.unwrap());
        send.send_response(Response::builder().status(504).body(()).unwrap());
        call.await.unwrap().unwrap();
        assert!(journal.is_pending("order-7/charge").await.unwrap());

        // Resumed (as after a restart): the same key; a success completes it.
        let call = tokio::spawn(svc.ready().await.unwrap().call(request()));
        let (sent, send) = handle.next_request().await.unwrap();
        assert_eq!(sent.headers()[&IDEMPOTENCY_KEY], first.as_str());
        send.send_response(Response::new(()));
        call.await.unwrap().unwrap();
        assert!(!journal.is_pending("order-7/charge").await.unwrap());
    }
}
