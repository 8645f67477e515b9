//! Code generated from `proto/payment/v1/payment.proto` (package `payment.v1`).
#![allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]

tonic::include_proto!("payment.v1");
