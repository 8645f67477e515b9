//! Shared harness: a real payment service on 127.0.0.1:0 charging through a real PSP simulator
//! on 127.0.0.1:0, both in-process, with a fresh SQLite store per test.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use backstop_payment::config::{Config, DEFAULT_MERCHANT, PspTarget, StoreLocation};
use backstop_payment::psp::{self, Charge, Fault, Faults, PspConfig, PspHandle};
use backstop_payment::psp_client::psp_reference;
use backstop_payment::server::{RunningServer, Server};
use reqwest::header::HeaderMap;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use tempfile::TempDir;

pub struct Harness {
    pub psp: PspHandle,
    pub server: RunningServer,
    pub http: Client,
    pub base: String,
    pub dir: TempDir,
}

/// One answer: status, headers, raw body and the body as JSON (`Value::Null` if not JSON).
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub bytes: Vec<u8>,
    pub json: Value,
}

impl Answer {
    pub fn code(&self) -> &str {
        self.json["code"].as_str().unwrap_or("")
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub fn body(order: &str, amount: i64) -> String {
    json!({"order_id": order, "amount_cents": amount}).to_string()
}

impl Harness {
    pub async fn start() -> Harness {
        Self::start_with(|_| {}).await
    }

    /// Starts a PSP and a service configured by `tune` (applied after the test defaults).
    pub async fn start_with(tune: impl FnOnce(&mut Config)) -> Harness {
        let dir = tempfile::tempdir().expect("tempdir");
        let psp = psp::spawn(PspConfig {
            db_path: Some(dir.path().join("psp.db")),
            ..PspConfig::default()
        })
        .await
        .expect("psp starts");
        let mut config = Config::new(StoreLocation::Sqlite(dir.path().join("pay.db")));
        config.http = "127.0.0.1:0".parse().unwrap();
        config.grpc = "127.0.0.1:0".parse().unwrap();
        config.psp = PspTarget::Url(psp.url());
        // Tests keep a wide margin for the way back so a 504 built by the handler is never
        // overtaken by the request deadline on a slow disk.
        config.psp_margin_floor = Duration::from_millis(300);
        tune(&mut config);
        let server = Server::bind(config).await.expect("service starts").spawn();
        let base = server.url();
        let http = Client::builder().no_proxy().build().unwrap();
        Harness {
            psp,
            server,
            http,
            base,
            dir,
        }
    }

    /// `POST /v1/payments` with an optional key and extra headers.
    pub async fn post(&self, key: Option<&str>, body: &str, headers: &[(&str, &str)]) -> Answer {
        let mut req = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        answer(req.send().await.expect("request sent")).await
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Answer {
        let mut req = self.http.get(format!("{}{}", self.base, path));
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        answer(req.send().await.expect("request sent")).await
    }

    /// The PSP's charges for the open service's (merchant `default`) order.
    pub async fn charges(&self, order: &str) -> Vec<Charge> {
        self.merchant_charges(DEFAULT_MERCHANT, order).await
    }

    /// The PSP's charges for a merchant's order.
    pub async fn merchant_charges(&self, merchant: &str, order: &str) -> Vec<Charge> {
        self.psp
            .store()
            .list(Some(psp_reference(merchant, order)))
            .await
            .expect("psp store")
    }

    pub async fn all_charges(&self) -> u64 {
        self.psp.store().count().await.expect("psp store")
    }

    pub fn script(&self, faults: &[Fault]) {
        self.psp
            .faults()
            .script(faults.iter().copied())
            .expect("script");
    }

    pub fn latency(&self, latency: Duration) {
        self.psp
            .faults()
            .set(Faults {
                latency,
                ..Faults::default()
            })
            .expect("faults");
    }

    pub async fn intent_count(&self) -> u64 {
        self.server.intents().count().await.expect("intents")
    }

    pub async fn idempotency_rows(&self) -> u64 {
        self.server
            .intents()
            .db()
            .expect("a SQLite store")
            .read(backstop::idempotency::sqlite::count_records)
            .await
            .expect("idempotency table")
    }
}

pub async fn answer(r: reqwest::Response) -> Answer {
    let status = r.status();
    let headers = r.headers().clone();
    let bytes = r.bytes().await.expect("body").to_vec();
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer {
        status,
        headers,
        bytes,
        json,
    }
}
