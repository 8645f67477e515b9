//! deadline
