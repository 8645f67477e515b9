//! Cost of a request fingerprint (SHA-256 over the method and the body's RFC 8785 form) for a
//! typical payment body, side by side:
//!
//! - `compact`: `Fingerprint::of_json`, which hashes serde_json's compact output when that
//!   already is the canonical form (integers, strings and ASCII member names, as here);
//! - `canonicalizer`: the same body through `serde_json_canonicalizer`, the path every other
//!   body takes.
//!
//! Both parse the body and hash the method, so the difference is the canonical writing alone.
//!
//! `cargo bench -p backstop --bench fingerprint`

use std::hint::black_box;
use std::io::Write;

use backstop::idempotency::Fingerprint;
use criterion::{Criterion, criterion_group, criterion_main};
use sha2::{Digest, Sha256};

const METHOD: &str = "POST /v1/payments";
const BODY: &[u8] = br#"{"order_id":"o-8812","amount_cents":1999,"currency":"EUR"}"#;

/// Feeds the canonicalizer's output into the hash, as `Fingerprint::of_json` does its own.
struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn through_canonicalizer(method: &str, body: &[u8]) -> Fingerprint {
    let value: serde_json::Value = serde_json::from_slice(body).expect("JSON body");
    let mut hasher = HashWriter(Sha256::new());
    hasher.0.update(method.as_bytes());
    hasher.0.update(b"\n");
    serde_json_canonicalizer::to_writer(&value, &mut hasher).expect("canonical form");
    Fingerprint::from_bytes(hasher.0.finalize().into())
}

fn fingerprint(c: &mut Criterion) {
    assert_eq!(
        Fingerprint::of_json(METHOD, BODY).expect("JSON body"),
        through_canonicalizer(METHOD, BODY),
        "both paths must give one fingerprint"
    );
    let mut group = c.benchmark_group("fingerprint/payment");
    group.bench_function("compact", |b| {
        b.iter(|| Fingerprint::of_json(black_box(METHOD), black_box(BODY)))
    });
    group.bench_function("canonicalizer", |b| {
        b.iter(|| through_canonicalizer(black_box(METHOD), black_box(BODY)))
    });
    group.finish();
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
