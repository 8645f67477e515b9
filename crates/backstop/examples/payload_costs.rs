//! What a payload costs on the way through: its size by encoding, where compression starts to
//! pay, and the memory a large JSON answer takes once decoded.
//!
//! `cargo run -p backstop --example payload_costs` measures the chapter's three claims about
//! serialization with byte counts only (no clock), so the figures are the same on every
//! machine:
//!
//! - **size:** one charge request (order id, amount, currency, a customer and a billing
//!   address) is 2-3x larger as JSON than as protobuf: the field names travel with every
//!   message;
//! - **compression:** gzip adds 18 bytes of framing and needs repetition to win: a lookup of a
//!   few dozen bytes comes out larger, one request of a couple hundred saves a few dozen bytes
//!   for the CPU it costs both ends; from about 1 KB it pays;
//! - **memory:** a 2 MB JSON answer decoded into a `serde_json::Value` holds several times
//!   its size (one allocation per string, a map per object), on top of the 2 MB body, at the
//!   moment the caller may have 50 ms of its deadline left. A typed struct holds less, and a
//!   cap on the body (the server stack's, the replay bound) keeps it from growing at all.
//!
//! It prints a table of each and exits non-zero unless the three claims hold.
use std::io::Write;
use std::process::ExitCode;

use flate2::Compression;
use flate2::write::GzEncoder;
use prost::Message;
use serde::{Deserialize, Serialize};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

// Counts every allocation, so a decode's heap is measured, not estimated.
#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

#[derive(Clone, PartialEq, Message, Serialize)]
struct ChargeRequest {
    #[prost(string, tag = "1")]
    order_id: String,
    #[prost(int64, tag = "2")]
    amount_cents: i64,
    #[prost(string, tag = "3")]
    currency: String,
    #[prost(message, optional, tag = "4")]
    customer: Option<Customer>,
    #[prost(message, optional, tag = "5")]
    billing_address: Option<Address>,
}

#[derive(Clone, PartialEq, Message, Serialize)]
struct Customer {
    #[prost(string, tag = "1")]
    customer_id: String,
    #[prost(string, tag = "2")]
    email: String,
}

#[derive(Clone, PartialEq, Message, Serialize)]
struct Address {
    #[prost(string, tag = "1")]
    line1: String,
    #[prost(string, tag = "2")]
    city: String,
    #[prost(string, tag = "3")]
    postal_code: String,
    #[prost(string, tag = "4")]
    country: String,
}

/// One charge of a list answer, as a typed client reads it.
#[derive(Serialize, Deserialize)]
struct Charge {
    charge_id: String,
    order_id: String,
    amount_cents: i64,
    currency: String,
    status: String,
}

#[derive(Serialize, Deserialize)]
struct ChargeList {
    data: Vec<Charge>,
}

fn request(i: usize) -> ChargeRequest {
    ChargeRequest {
        order_id: format!("o-{:06}", 8812 + i),
        amount_cents: 1999,
        currency: "USD".into(),
        customer: Some(Customer {
            customer_id: format!("cus_{i:08}"),
            email: format!("buyer{i}@example.com"),
        }),
        billing_address: Some(Address {
            line1: "1 Market St".into(),
            city: "San Francisco".into(),
            postal_code: "94105".into(),
            country: "US".into(),
        }),
    }
}

fn gzip(bytes: &[u8]) -> usize {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
    encoder.write_all(bytes).expect("in memory");
    encoder.finish().expect("in memory").len()
}

/// A list answer of about `size` bytes of JSON.
fn list_answer(size: usize) -> Vec<u8> {
    let mut list = ChargeList { data: Vec::new() };
    let mut bytes = Vec::new();
    while bytes.len() < size {
        let n = list.data.len();
        list.data.extend((n..n + 1000).map(|i| Charge {
            charge_id: format!("ch_{i:010}"),
            order_id: format!("o-{i:06}"),
            amount_cents: 1999 + i64::try_from(i % 97).unwrap_or(0),
            currency: "USD".into(),
            status: "succeeded".into(),
        }));
        bytes = serde_json::to_vec(&list).expect("serializable");
    }
    bytes
}

/// Bytes allocated and not freed while `f` ran, and what it returned.
fn held<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let region = Region::new(GLOBAL);
    let value = f();
    let change = region.change();
    // A reallocation's growth is counted apart from allocations.
    let held = change.bytes_allocated as i128 - change.bytes_deallocated as i128
        + change.bytes_reallocated as i128;
    (usize::try_from(held).unwrap_or(0), value)
}

fn main() -> ExitCode {
    let mut holds = true;

    println!("size of one charge request");
    let one = request(0);
    let (json, proto) = (serde_json::to_vec(&one).expect("json"), one.encode_to_vec());
    let ratio = json.len() as f64 / proto.len() as f64;
    println!(
        "  json {} bytes, protobuf {} bytes: {ratio:.2}x",
        json.len(),
        proto.len()
    );
    holds &= (2.0..=3.5).contains(&ratio);

    println!("gzip by body size");
    let mut small_grows = false;
    let mut large_pays = false;
    let lookup = serde_json::to_vec(&serde_json::json!({"intent_id": "pi_01J9ZK"})).expect("json");
    let bodies = [("a lookup".to_owned(), lookup)]
        .into_iter()
        .chain([1, 4, 8, 64].map(|n| {
            let list = (0..n).map(request).collect::<Vec<_>>();
            let label = format!("{n} request{}", if n == 1 { "" } else { "s" });
            (label, serde_json::to_vec(&list).expect("json"))
        }));
    for (label, body) in bodies {
        let packed = gzip(&body);
        let saved = 100.0 * (1.0 - packed as f64 / body.len() as f64);
        println!(
            "  {label:>12}: {:>6} bytes -> {packed:>5} gzipped ({saved:+.0} % saved)",
            body.len()
        );
        small_grows |= packed > body.len();
        large_pays |= body.len() >= 1024 && saved >= 50.0;
    }
    holds &= small_grows && large_pays;

    println!("memory to decode a 2 MB json answer");
    let answer = list_answer(2 * 1024 * 1024);
    let mb = |bytes: usize| bytes as f64 / (1024.0 * 1024.0);
    let (value_heap, value) = held(|| serde_json::from_slice::<serde_json::Value>(&answer));
    let (typed_heap, typed) = held(|| serde_json::from_slice::<ChargeList>(&answer));
    let (Ok(value), Ok(typed)) = (value, typed) else {
        println!("  the answer does not decode");
        return ExitCode::FAILURE;
    };
    let total = |heap| mb(answer.len() + heap);
    println!(
        "  body {:.1} MB; as serde_json::Value {:.1} MB more ({:.1} MB held in all); \
         as typed structs {:.1} MB more ({:.1} MB in all), {} charges",
        mb(answer.len()),
        mb(value_heap),
        total(value_heap),
        mb(typed_heap),
        total(typed_heap),
        typed.data.len()
    );
    drop(value);
    holds &= value_heap >= 3 * answer.len() && typed_heap < value_heap;

    if holds {
        println!("the chapter's three claims hold");
        ExitCode::SUCCESS
    } else {
        println!("a claim does not hold");
        ExitCode::FAILURE
    }
}
