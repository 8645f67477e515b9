//! retry
