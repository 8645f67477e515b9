//! The reference payment service and the PSP simulator it charges through.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod psp;
