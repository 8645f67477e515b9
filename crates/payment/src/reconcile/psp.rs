//! The PSP's side of reconciliation over HTTP: the paged charge listing and refunds.

use std::time::Duration;

use crate::psp::listing::MAX_PAGE;
use crate::psp::{Charge, ChargePage, IDEMPOTENCY_KEY, PageQuery, Refund, RefundRequest};

use super::ReconcileError;

/// Bound on each request to the PSP: reconciliation is not on a client's clock, but a PSP that
/// stopped answering must not hang it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of the PSP's listing and refund endpoints.
#[derive(Debug, Clone)]
pub struct PspApi {
    http: reqwest::Client,
    base: String,
}

impl PspApi {
    /// A client of the PSP at `base` (`http://host:port`, no trailing slash needed).
    pub fn new(base: &str) -> Result<PspApi, ReconcileError> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ReconcileError::PspUrl(base.chars().take(64).collect()));
        }
        let http = reqwest::Client::builder()
            // The PSP is reached directly; a proxy from the environment must not reroute refunds.
            .no_proxy()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(ReconcileError::Http)?;
        Ok(PspApi {
            http,
            base: base.trim_end_matches('/').to_owned(),
        })
    }

    /// One page of the listing.
    pub async fn page(&self, query: &PageQuery) -> Result<ChargePage, ReconcileError> {
        let mut params: Vec<(&str, String)> = vec![("limit", query.limit.to_string())];
        if let Some(reference) = &query.reference {
            params.push(("reference", reference.clone()));
        }
        if let Some(gte) = query.created_gte {
            params.push(("created_gte", gte.to_string()));
        }
        if let Some(lt) = query.created_lt {
            params.push(("created_lt", lt.to_string()));
        }
        if let Some(after) = &query.starting_after {
            params.push(("starting_after", after.clone()));
        }
        let response = self
            .http
            .get(format!("{}/v1/charges", self.base))
            .query(&params)
            .send()
            .await
            .map_err(ReconcileError::Http)?;
        answer(response, "list charges").await
    }

    /// Every charge for `reference`, whatever its time, oldest first.
    pub async fn charges_for(&self, reference: &str) -> Result<Vec<Charge>, ReconcileError> {
        let mut query = PageQuery {
            reference: Some(reference.to_owned()),
            limit: MAX_PAGE,
            ..PageQuery::default()
        };
        let mut charges = Vec::new();
        loop {
            let page = self.page(&query).await?;
            charges.extend(page.data);
            match page.next_starting_after {
                Some(next) if page.has_more => query.starting_after = Some(next),
                _ => return Ok(charges),
            }
        }
    }

    /// Refunds `amount_cents` of `charge_id` under `idempotency_key` (a replay answers the
    /// refund made the first time).
    pub async fn refund(
        &self,
        idempotency_key: &str,
        charge_id: &str,
        amount_cents: i64,
    ) -> Result<Refund, ReconcileError> {
        let response = self
            .http
            .post(format!("{}/v1/refunds", self.base))
            .header(IDEMPOTENCY_KEY, idempotency_key)
            .json(&RefundRequest {
                charge_id: charge_id.to_owned(),
                amount_cents,
            })
            .send()
            .await
            .map_err(ReconcileError::Http)?;
        answer(response, "refund").await
    }
}

/// The JSON body of a success, or the PSP's problem as an error.
async fn answer<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
    what: &'static str,
) -> Result<T, ReconcileError> {
    let status = response.status();
    if status.is_success() {
        return response.json().await.map_err(ReconcileError::Http);
    }
    let problem: serde_json::Value = response.json().await.unwrap_or_default();
    let text = |field: &str| {
        problem[field]
            .as_str()
            .unwrap_or_default()
            .chars()
            .take(200)
            .collect::<String>()
    };
    Err(ReconcileError::Psp {
        what,
        status: status.as_u16(),
        code: text("code"),
        detail: text("detail"),
    })
}
