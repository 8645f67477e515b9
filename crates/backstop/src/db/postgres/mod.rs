//! PostgreSQL plumbing.
pub(crate) mod batch;
pub(crate) mod migrate;

use crate::idempotency::postgres::PgError;
