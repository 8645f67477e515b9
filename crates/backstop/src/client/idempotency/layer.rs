use tower_layer::Layer;

use super::IdempotencyKeyService;
#[cfg(feature = "sqlite")]
use super::IntentJournal;

/// Applies [`IdempotencyKeyService`]: one key per logical call.
#[derive(Debug, Clone, Default)]
pub struct IdempotencyKeyLayer {
    #[cfg(feature = "sqlite")]
    journal: Option<IntentJournal>,
}

impl IdempotencyKeyLayer {
    /// Generated keys, no journal.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys of requests naming an [`Operation`](super::Operation) come from `journal`.
    #[cfg(feature = "sqlite")]
    pub fn journal(mut self, journal: IntentJournal) -> Self {
        self.journal = Some(journal);
        self
    }
}

impl<S> Layer<S> for IdempotencyKeyLayer {
    type Service = IdempotencyKeyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        #[cfg(feature = "sqlite")]
        if let Some(journal) = &self.journal {
            return IdempotencyKeyService::journaled(inner, journal.clone());
        }
        IdempotencyKeyService::new(inner)
    }
}
