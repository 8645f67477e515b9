//! Retries that cannot multiply load (seed 2.3).
//!
//! A retry is worth sending only when the failure may go away, a second attempt can still
//! finish before the caller stops waiting, and its side effect is controlled. This module holds
//! the pieces that enforce that:
//!
//! - [`Backoff`]: exponential delays with jitter, a cap and a floor, so that clients that failed
//!   together do not come back together.
//! - [`RetryBudget`]: retries as a fraction of logical requests, shared by every caller of a
//!   destination, so that a failing dependency sees at most `1 + ratio` times its normal load.
//!
//! # Layout
//!
//! - `backoff`: [`Backoff`] and [`Jitter`].
//! - `budget`: [`RetryBudget`], with the reasoning behind budgets.

mod backoff;
pub mod budget;

pub use backoff::{Backoff, BackoffError, Jitter};
pub use budget::{BudgetError, RetryBudget};
