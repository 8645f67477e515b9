//! Requests no route takes (unknown paths, unknown methods) are counted and logged like every
//! other request, under one bounded label, and refused with a problem document.

mod support;

use reqwest::{Method, StatusCode};
use support::{Harness, answer};

/// The sum of `rpc_server_requests_total` over the lines of a Prometheus scrape whose labels
/// contain every one of `labels`.
fn requests_total(scrape: &str, labels: &[&str]) -> u64 {
    scrape
        .lines()
        .filter(|l| l.starts_with("rpc_server_requests_total{"))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test]
async fn unknown_paths_and_methods_appear_in_metrics() {
    let h = Harness::start().await;
    let send = |method: Method, path: &str| {
        let request = h.http.request(method, format!("{}{path}", h.base));
        async move { answer(request.send().await.expect("sent")).await }
    };
    let not_found = send(Method::GET, "/wp-login.php?user=admin-4711").await;
    assert_eq!(not_found.status, StatusCode::NOT_FOUND);
    assert_eq!(not_found.code(), "not_found");
    let brew = send(Method::from_bytes(b"BREW").unwrap(), "/pot-4711").await;
    assert_eq!(brew.status, StatusCode::NOT_FOUND);
    let wrong_method = send(Method::PUT, "/healthz").await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(wrong_method.code(), "method_not_allowed");
    assert_eq!(
        wrong_method.header("content-type"),
        Some("application/problem+json")
    );
    // On a route the server stack sits on (only the routes, not their 405s): counted the same.
    let wrong_method_on_payments = send(Method::PUT, "/v1/payments").await;
    assert_eq!(
        wrong_method_on_payments.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(wrong_method_on_payments.code(), "method_not_allowed");

    let scrape = String::from_utf8(h.get("/metrics", &[]).await.bytes).unwrap();
    assert_eq!(
        requests_total(&scrape, &["method=\"unmatched\"", "outcome=\"fatal\""]),
        4,
        "{scrape}"
    );
    assert!(!scrape.contains("wp-login"), "never the path as a label");
    assert!(!scrape.contains("4711"), "never the path as a label");
    assert!(!scrape.contains("BREW"), "never the method as a label");
}
