//! The query of the paged charge listing (`GET /v1/charges?created_gte=..&limit=..`), parsed
//! from the query string's pairs with a specific error for each mistake.

/// Largest page a listing returns.
pub const MAX_PAGE: u32 = 500;
/// Page size when the query gives no `limit`.
pub const DEFAULT_PAGE: u32 = 100;

/// The parameters that ask for a page (any one of them does); `reference` alone keeps the
/// plain, newest-first listing.
const PAGE_PARAMS: [&str; 4] = ["created_gte", "created_lt", "limit", "starting_after"];

/// One page of the listing: charges created in `[created_gte, created_lt)` (unix ms), oldest
/// first, after the charge `starting_after`, at most `limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageQuery {
    /// Only the charges with this reference.
    pub reference: Option<String>,
    /// Created at or after this time, unix epoch milliseconds.
    pub created_gte: Option<i64>,
    /// Created before this time, unix epoch milliseconds.
    pub created_lt: Option<i64>,
    /// Page size, 1 to [`MAX_PAGE`].
    pub limit: u32,
    /// The last charge id of the previous page.
    pub starting_after: Option<String>,
}

impl Default for PageQuery {
    /// Every charge, a page of [`DEFAULT_PAGE`] at a time.
    fn default() -> Self {
        PageQuery {
            reference: None,
            created_gte: None,
            created_lt: None,
            limit: DEFAULT_PAGE,
            starting_after: None,
        }
    }
}

/// What a listing query asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listing {
    /// The newest charges, newest first (only those with `reference` when given).
    Plain {
        /// Only the charges with this reference.
        reference: Option<String>,
    },
    /// One page in creation order.
    Page(PageQuery),
}

/// Why a listing query was refused; each maps to its own problem code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageQueryError {
    /// A parameter the listing does not know.
    #[error("unknown query parameter {0:?}")]
    UnknownParameter(String),
    /// A parameter given twice.
    #[error("query parameter {0:?} given more than once")]
    Repeated(String),
    /// `limit` is not an integer from 1 to [`MAX_PAGE`].
    #[error("limit must be an integer from 1 to {MAX_PAGE}, got {0:?}")]
    Limit(String),
    /// `created_gte` or `created_lt` is not a unix time in milliseconds.
    #[error("{param} must be a unix time in milliseconds, got {value:?}")]
    Time {
        /// Which parameter.
        param: &'static str,
        /// What it was.
        value: String,
    },
    /// `created_lt` is not after `created_gte`.
    #[error("created_lt ({lt}) must be after created_gte ({gte})")]
    EmptyWindow {
        /// The window's start.
        gte: i64,
        /// The window's end.
        lt: i64,
    },
    /// `starting_after` is not a charge id.
    #[error("starting_after must be a charge id (ch_...), got {0:?}")]
    Cursor(String),
    /// `reference` is empty or longer than 255 bytes.
    #[error("reference must be 1 to 255 bytes")]
    Reference,
}

impl PageQueryError {
    /// The stable problem code the PSP answers with.
    pub fn code(&self) -> &'static str {
        match self {
            PageQueryError::UnknownParameter(_) | PageQueryError::Repeated(_) => "invalid_query",
            PageQueryError::Limit(_) => "invalid_limit",
            PageQueryError::Time { .. } => "invalid_created",
            PageQueryError::EmptyWindow { .. } => "invalid_window",
            PageQueryError::Cursor(_) => "invalid_cursor",
            PageQueryError::Reference => "invalid_reference",
        }
    }
}

impl PageQuery {
    /// Parses the decoded pairs of a listing's query string: [`Listing::Plain`] when none of
    /// the page parameters is present.
    pub fn parse(pairs: &[(String, String)]) -> Result<Listing, PageQueryError> {
        let mut query = PageQuery::default();
        let mut seen: Vec<&str> = Vec::new();
        for (name, value) in pairs {
            let known = ["reference"]
                .into_iter()
                .chain(PAGE_PARAMS)
                .find(|known| known == name)
                .ok_or_else(|| PageQueryError::UnknownParameter(truncated(name)))?;
            if seen.contains(&known) {
                return Err(PageQueryError::Repeated(known.to_owned()));
            }
            seen.push(known);
            match known {
                "reference" => {
                    if value.is_empty() || value.len() > 255 {
                        return Err(PageQueryError::Reference);
                    }
                    query.reference = Some(value.clone());
                }
                "created_gte" => query.created_gte = Some(parse_time("created_gte", value)?),
                "created_lt" => query.created_lt = Some(parse_time("created_lt", value)?),
                "limit" => {
                    query.limit = value
                        .parse::<u32>()
                        .ok()
                        .filter(|limit| (1..=MAX_PAGE).contains(limit))
                        .ok_or_else(|| PageQueryError::Limit(truncated(value)))?;
                }
                _ => {
                    let cursor = value.strip_prefix("ch_").filter(|rest| {
                        !rest.is_empty()
                            && rest.len() <= 64
                            && rest.bytes().all(|b| b.is_ascii_alphanumeric())
                    });
                    if cursor.is_none() {
                        return Err(PageQueryError::Cursor(truncated(value)));
                    }
                    query.starting_after = Some(value.clone());
                }
            }
        }
        if let (Some(gte), Some(lt)) = (query.created_gte, query.created_lt) {
            if lt <= gte {
                return Err(PageQueryError::EmptyWindow { gte, lt });
            }
        }
        if !seen.iter().any(|name| PAGE_PARAMS.contains(name)) {
            return Ok(Listing::Plain {
                reference: query.reference,
            });
        }
        Ok(Listing::Page(query))
    }
}

fn parse_time(param: &'static str, value: &str) -> Result<i64, PageQueryError> {
    // Digits only: no sign, no spaces, no `+`; negative times are not charge times.
    if value.is_empty() || value.len() > 15 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(PageQueryError::Time {
            param,
            value: truncated(value),
        });
    }
    value.parse().map_err(|_| PageQueryError::Time {
        param,
        value: truncated(value),
    })
}

/// At most 64 characters of what the caller sent, for the error message.
fn truncated(value: &str) -> String {
    value.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn parse(list: &[(&str, &str)]) -> Result<Option<PageQuery>, PageQueryError> {
        PageQuery::parse(&pairs(list)).map(|listing| match listing {
            Listing::Page(query) => Some(query),
            Listing::Plain { .. } => None,
        })
    }

    #[test]
    fn no_page_parameter_is_the_plain_listing() {
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(
            PageQuery::parse(&pairs(&[("reference", "m:o")])),
            Ok(Listing::Plain {
                reference: Some("m:o".into())
            })
        );
    }

    #[test]
    fn a_full_page_query() {
        let query = parse(&[
            ("created_gte", "1000"),
            ("created_lt", "2000"),
            ("limit", "7"),
            ("starting_after", "ch_0190abc"),
            ("reference", "m:o"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            query,
            PageQuery {
                reference: Some("m:o".into()),
                created_gte: Some(1000),
                created_lt: Some(2000),
                limit: 7,
                starting_after: Some("ch_0190abc".into()),
            }
        );
        assert_eq!(parse(&[("limit", "500")]).unwrap().unwrap().limit, MAX_PAGE);
        assert_eq!(
            parse(&[("created_gte", "0")]).unwrap().unwrap().limit,
            DEFAULT_PAGE
        );
    }

    #[test]
    fn each_mistake_has_its_code() {
        let code = |list: &[(&str, &str)]| parse(list).unwrap_err().code();
        assert_eq!(code(&[("colour", "red")]), "invalid_query");
        assert_eq!(code(&[("limit", "1"), ("limit", "2")]), "invalid_query");
        for limit in ["0", "501", "-1", "", "ten", "1.5", "99999999999"] {
            assert_eq!(code(&[("limit", limit)]), "invalid_limit", "{limit:?}");
        }
        for time in ["-5", "", "1e3", " 1", "+1", "9999999999999999"] {
            assert_eq!(
                code(&[("created_gte", time)]),
                "invalid_created",
                "{time:?}"
            );
        }
        assert_eq!(
            code(&[("created_gte", "5"), ("created_lt", "5")]),
            "invalid_window"
        );
        for cursor in ["", "ch_", "re_1", "ch_a-b", "x"] {
            assert_eq!(
                code(&[("starting_after", cursor)]),
                "invalid_cursor",
                "{cursor:?}"
            );
        }
        assert_eq!(
            code(&[("reference", ""), ("limit", "1")]),
            "invalid_reference"
        );
    }

    proptest! {
        /// Any pairs at all: an answer, never a panic; a page's limit is always in range and
        /// its window never empty.
        #[test]
        fn arbitrary_pairs_never_panic(
            list in proptest::collection::vec(
                (prop_oneof![
                    Just("limit".to_owned()),
                    Just("created_gte".to_owned()),
                    Just("created_lt".to_owned()),
                    Just("starting_after".to_owned()),
                    Just("reference".to_owned()),
                    ".{0,8}",
                ], ".{0,24}"),
                0..6,
            )
        ) {
            if let Ok(Listing::Page(query)) = PageQuery::parse(&list) {
                prop_assert!((1..=MAX_PAGE).contains(&query.limit));
                if let (Some(gte), Some(lt)) = (query.created_gte, query.created_lt) {
                    prop_assert!(gte < lt);
                }
            }
        }

        /// Well-formed values round-trip.
        #[test]
        fn valid_queries_round_trip(
            gte in 0i64..1_000_000_000_000_000,
            span in 1i64..1_000_000,
            limit in 1u32..=MAX_PAGE,
            cursor in "[a-z0-9]{1,32}",
        ) {
            let lt = gte + span;
            let list = vec![
                ("created_gte".to_owned(), gte.to_string()),
                ("created_lt".to_owned(), lt.to_string()),
                ("limit".to_owned(), limit.to_string()),
                ("starting_after".to_owned(), format!("ch_{cursor}")),
            ];
            let Ok(Listing::Page(query)) = PageQuery::parse(&list) else {
                panic!("not a page");
            };
            prop_assert_eq!(query.created_gte, Some(gte));
            prop_assert_eq!(query.created_lt, Some(lt));
            prop_assert_eq!(query.limit, limit);
            prop_assert_eq!(query.starting_after, Some(format!("ch_{cursor}")));
        }
    }
}
