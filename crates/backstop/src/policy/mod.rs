//! Per-method behaviour contracts, checked at start-up.
//!
//! An IDL describes the success path; it says nothing about what a failure allows. Whether a
//! method may be retried, hedged, or must carry an idempotency key is a property of the method,
//! and when it is left implicit each caller guesses, and some guess wrong: a hedged `Unsafe`
//! call charges a card twice. A [`MethodContract`] writes the answers down in one place:
//! idempotency class, default timeout, retryable codes, attempts, hedging, key TTL and rate
//! class. A service declares its [`Contracts`] once and [`Contracts::validate`] refuses an
//! unsafe combination before the first request, instead of in production.
//!
//! ```
//! use std::time::Duration;
//! use backstop::policy::{Contracts, Idempotency, MethodContract, KEY_TTL_PAYMENTS};
//! use backstop::status::Code;
//!
//! let contracts = Contracts::validated([
//!     MethodContract::builder("Charge", Idempotency::Keyed)
//!         .default_timeout(Duration::from_secs(2))
//!         .retryable([Code::Unavailable, Code::DeadlineExceeded])
//!         .hedging(true)
//!         .key_ttl(KEY_TTL_PAYMENTS)
//!         .rate_class("payments")
//!         .build(),
//!     MethodContract::builder("GetCharge", Idempotency::Safe).build(),
//! ])
//! .unwrap();
//! assert!(contracts.get("Charge").unwrap().requires_key());
//! println!("{contracts}");
//!
//! // Hedging a method without idempotency is refused at start-up.
//! let bad = Contracts::validated([
//!     MethodContract::builder("Refund", Idempotency::Unsafe).hedging(true).build(),
//! ]);
//! assert!(bad.is_err());
//! ```

use std::fmt;
use std::time::Duration;

use crate::status::{Code, RetryClass};

/// Hard cap on attempts per logical request, retries and hedges included.
pub const MAX_ATTEMPTS_CAP: u32 = 5;
/// Attempts per logical request unless a contract says otherwise.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Timeout used when a request carries no deadline, unless a contract says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// Idempotency key TTL for synchronous APIs.
pub const KEY_TTL_SYNC: Duration = Duration::from_secs(24 * 3_600);
/// Idempotency key TTL for payments.
pub const KEY_TTL_PAYMENTS: Duration = Duration::from_secs(7 * 24 * 3_600);
/// Idempotency key TTL for asynchronous jobs.
pub const KEY_TTL_ASYNC: Duration = Duration::from_secs(30 * 24 * 3_600);
/// Rate class used when a contract names none.
pub const DEFAULT_RATE_CLASS: &str = "default";

/// What repeating a call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Idempotency {
    /// No side effect (reads): repeat freely.
    Safe,
    /// A side effect made idempotent by a required idempotency key: repeat with the same key.
    Keyed,
    /// A side effect with no key: a repeat may apply it twice.
    Unsafe,
}

impl Idempotency {
    /// Lower-case name: `safe`, `keyed`, `unsafe`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Idempotency::Safe => "safe",
            Idempotency::Keyed => "keyed",
            Idempotency::Unsafe => "unsafe",
        }
    }
}

impl fmt::Display for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The failure behaviour of one method. Build with [`MethodContract::builder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodContract {
    name: String,
    idempotency: Idempotency,
    default_timeout: Duration,
    retryable: Vec<Code>,
    max_attempts: u32,
    hedging: bool,
    key_ttl: Option<Duration>,
    rate_class: String,
}

/// Builder for [`MethodContract`]; check the result with [`Contracts::validate`].
#[derive(Debug, Clone)]
#[must_use = "call build() to get the contract"]
pub struct MethodContractBuilder {
    contract: MethodContract,
}

/// A contract set that must not go live.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// A method has an empty name.
    #[error("a method has an empty name")]
    EmptyName,
    /// Two contracts share a method name.
    #[error("method {method}: declared twice")]
    Duplicate {
        /// The method.
        method: String,
    },
    /// Hedging sends a second copy while the first may still apply its effect.
    #[error("method {method}: hedging an unsafe method would apply its effect twice")]
    HedgingUnsafe {
        /// The method.
        method: String,
    },
    /// Attempts must be between 1 and [`MAX_ATTEMPTS_CAP`].
    #[error("method {method}: max_attempts {max_attempts} is outside 1..={MAX_ATTEMPTS_CAP}")]
    MaxAttempts {
        /// The method.
        method: String,
        /// The value given.
        max_attempts: u32,
    },
    /// A keyed method needs a TTL for its keys, or the key store grows without bound.
    #[error("method {method}: keyed method without a key TTL")]
    KeyedWithoutTtl {
        /// The method.
        method: String,
    },
    /// A zero default timeout would fail every request.
    #[error("method {method}: default timeout is zero")]
    ZeroTimeout {
        /// The method.
        method: String,
    },
    /// A code whose retry class is fatal listed as retryable.
    #[error("method {method}: {code} is fatal and cannot be retried")]
    FatalCodeRetryable {
        /// The method.
        method: String,
        /// The code.
        code: Code,
    },
    /// An unsafe method retrying a code after which the effect may already have happened.
    #[error(
        "method {method}: unsafe method retries {code}, after which the effect may have happened"
    )]
    UnsafeRetry {
        /// The method.
        method: String,
        /// The code.
        code: Code,
    },
}

impl MethodContract {
    /// Starts a contract for `name` with defaults: timeout [`DEFAULT_TIMEOUT`], retryable
    /// `UNAVAILABLE` (none for `Unsafe`), [`DEFAULT_MAX_ATTEMPTS`] attempts (one for `Unsafe`),
    /// no hedging, no key TTL, rate class [`DEFAULT_RATE_CLASS`].
    pub fn builder(name: impl Into<String>, idempotency: Idempotency) -> MethodContractBuilder {
        let is_unsafe = idempotency == Idempotency::Unsafe;
        MethodContractBuilder {
            contract: MethodContract {
                name: name.into(),
                idempotency,
                default_timeout: DEFAULT_TIMEOUT,
                retryable: if is_unsafe {
                    Vec::new()
                } else {
                    vec![Code::Unavailable]
                },
                max_attempts: if is_unsafe { 1 } else { DEFAULT_MAX_ATTEMPTS },
                hedging: false,
                key_ttl: None,
                rate_class: DEFAULT_RATE_CLASS.to_owned(),
            },
        }
    }

    /// The method name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The idempotency class.
    pub fn idempotency(&self) -> Idempotency {
        self.idempotency
    }

    /// Whether requests must carry an idempotency key.
    pub fn requires_key(&self) -> bool {
        self.idempotency == Idempotency::Keyed
    }

    /// Budget for a request that arrives without a deadline.
    pub fn default_timeout(&self) -> Duration {
        self.default_timeout
    }

    /// Codes after which another attempt may be made.
    pub fn retryable(&self) -> &[Code] {
        &self.retryable
    }

    /// Whether `code` is in [`retryable`](Self::retryable).
    pub fn is_retryable(&self, code: Code) -> bool {
        self.retryable.contains(&code)
    }

    /// Most attempts per logical request, retries and hedges included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Whether hedged attempts are allowed.
    pub fn hedging(&self) -> bool {
        self.hedging
    }

    /// How long idempotency keys are kept.
    pub fn key_ttl(&self) -> Option<Duration> {
        self.key_ttl
    }

    /// The rate-limit class.
    pub fn rate_class(&self) -> &str {
        &self.rate_class
    }

    /// Checks this contract alone (see [`ContractError`]).
    pub fn validate(&self) -> Result<(), ContractError> {
        let method = || self.name.clone();
        if self.name.is_empty() {
            return Err(ContractError::EmptyName);
        }
        if !(1..=MAX_ATTEMPTS_CAP).contains(&self.max_attempts) {
            return Err(ContractError::MaxAttempts {
                method: method(),
                max_attempts: self.max_attempts,
            });
        }
        if self.default_timeout.is_zero() {
            return Err(ContractError::ZeroTimeout { method: method() });
        }
        if self.hedging && self.idempotency == Idempotency::Unsafe {
            return Err(ContractError::HedgingUnsafe { method: method() });
        }
        if self.idempotency == Idempotency::Keyed && self.key_ttl.is_none_or(|t| t.is_zero()) {
            return Err(ContractError::KeyedWithoutTtl { method: method() });
        }
        for &code in &self.retryable {
            match code.retry_class() {
                RetryClass::Fatal => {
                    return Err(ContractError::FatalCodeRetryable {
                        method: method(),
                        code,
                    });
                }
                RetryClass::Retryable | RetryClass::Timeout
                    if self.idempotency == Idempotency::Unsafe =>
                {
                    return Err(ContractError::UnsafeRetry {
                        method: method(),
                        code,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl MethodContractBuilder {
    /// Budget for requests that arrive without a deadline.
    pub fn default_timeout(mut self, timeout: Duration) -> Self {
        self.contract.default_timeout = timeout;
        self
    }

    /// Codes after which another attempt may be made (replaces the default).
    pub fn retryable(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        self.contract.retryable = codes.into_iter().collect();
        self.contract.retryable.sort();
        self.contract.retryable.dedup();
        self
    }

    /// Most attempts per logical request (1 to [`MAX_ATTEMPTS_CAP`]).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.contract.max_attempts = attempts;
        self
    }

    /// Allows hedged attempts (`Safe` and `Keyed` methods only).
    pub fn hedging(mut self, allowed: bool) -> Self {
        self.contract.hedging = allowed;
        self
    }

    /// How long idempotency keys are kept (required for `Keyed`).
    pub fn key_ttl(mut self, ttl: Duration) -> Self {
        self.contract.key_ttl = Some(ttl);
        self
    }

    /// The rate-limit class.
    pub fn rate_class(mut self, class: impl Into<String>) -> Self {
        self.contract.rate_class = class.into();
        self
    }

    /// The contract (not yet validated).
    pub fn build(self) -> MethodContract {
        self.contract
    }
}

/// The contracts of a service; `Display` prints them as a table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contracts {
    methods: Vec<MethodContract>,
}

impl Contracts {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// A set of `contracts`, validated.
    pub fn validated(
        contracts: impl IntoIterator<Item = MethodContract>,
    ) -> Result<Self, ContractError> {
        let set: Contracts = contracts.into_iter().collect();
        set.validate()?;
        Ok(set)
    }

    /// Adds a contract (checked by [`validate`](Self::validate)).
    pub fn insert(&mut self, contract: MethodContract) {
        self.methods.push(contract);
    }

    /// The contract for `method`.
    pub fn get(&self, method: &str) -> Option<&MethodContract> {
        self.methods.iter().find(|c| c.name == method)
    }

    /// All contracts, in insertion order.
    pub fn iter(&self) -> std::slice::Iter<'_, MethodContract> {
        self.methods.iter()
    }

    /// Number of contracts.
    pub fn len(&self) -> usize {
        self.methods.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.methods.is_empty()
    }

    /// Checks every contract and that no method is declared twice; the first error wins.
    pub fn validate(&self) -> Result<(), ContractError> {
        for (i, contract) in self.methods.iter().enumerate() {
            contract.validate()?;
            if self.methods[..i].iter().any(|c| c.name == contract.name) {
                return Err(ContractError::Duplicate {
                    method: contract.name.clone(),
                });
            }
        }
        Ok(())
    }
}

impl FromIterator<MethodContract> for Contracts {
    fn from_iter<I: IntoIterator<Item = MethodContract>>(iter: I) -> Self {
        Self {
            methods: iter.into_iter().collect(),
        }
    }
}

impl<'a> IntoIterator for &'a Contracts {
    type Item = &'a MethodContract;
    type IntoIter = std::slice::Iter<'a, MethodContract>;

    fn into_iter(self) -> Self::IntoIter {
        self.methods.iter()
    }
}

/// A duration the way an operator writes it: `500ms`, `2s`, `24h`, `7d`.
fn human(d: Duration) -> String {
    const UNITS: [(u64, &str); 4] = [(86_400, "d"), (3_600, "h"), (60, "min"), (1, "s")];
    if d.subsec_nanos() == 0 && !d.is_zero() {
        let secs = d.as_secs();
        for (size, unit) in UNITS {
            if secs % size == 0 {
                return format!("{}{unit}", secs / size);
            }
        }
    }
    if d.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

impl fmt::Display for Contracts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const HEADER: [&str; 8] = [
            "method",
            "idempotency",
            "timeout",
            "retryable",
            "attempts",
            "hedging",
            "key_ttl",
            "rate_class",
        ];
        let rows: Vec<[String; 8]> = self
            .methods
            .iter()
            .map(|c| {
                let retryable = if c.retryable.is_empty() {
                    "-".to_owned()
                } else {
                    c.retryable
                        .iter()
                        .map(|code| code.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                };
                [
                    c.name.clone(),
                    c.idempotency.to_string(),
                    human(c.default_timeout),
                    retryable,
                    c.max_attempts.to_string(),
                    if c.hedging { "yes" } else { "no" }.to_owned(),
                    c.key_ttl.map_or_else(|| "-".to_owned(), human),
                    c.rate_class.clone(),
                ]
            })
            .collect();
        let mut widths = HEADER.map(str::len);
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header = HEADER.map(str::to_owned);
        for row in std::iter::once(&header).chain(&rows) {
            let last = row.len() - 1;
            for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
                if i == last {
                    writeln!(f, "{cell}")?;
                } else {
                    write!(f, "{cell:<w$}  ")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(name: &str) -> MethodContractBuilder {
        MethodContract::builder(name, Idempotency::Keyed).key_ttl(KEY_TTL_SYNC)
    }

    fn err(contract: MethodContract) -> ContractError {
        Contracts::validated([contract]).unwrap_err()
    }

    #[test]
    fn defaults_are_valid() {
        for idem in [Idempotency::Safe, Idempotency::Unsafe] {
            let c = MethodContract::builder("M", idem).build();
            assert_eq!(c.validate(), Ok(()));
            assert_eq!(c.default_timeout(), DEFAULT_TIMEOUT);
            assert_eq!(c.rate_class(), "default");
            assert!(!c.hedging());
        }
        let safe = MethodContract::builder("Get", Idempotency::Safe).build();
        assert_eq!(safe.max_attempts(), DEFAULT_MAX_ATTEMPTS);
        assert!(safe.is_retryable(Code::Unavailable));
        let unsafe_ = MethodContract::builder("Post", Idempotency::Unsafe).build();
        assert_eq!(unsafe_.max_attempts(), 1);
        assert!(unsafe_.retryable().is_empty());
        assert_eq!(keyed("Charge").build().validate(), Ok(()));
    }

    #[test]
    fn hedging_an_unsafe_method_is_an_error() {
        let c = MethodContract::builder("Refund", Idempotency::Unsafe)
            .hedging(true)
            .build();
        assert_eq!(
            err(c),
            ContractError::HedgingUnsafe {
                method: "Refund".into()
            }
        );
        // Safe and keyed methods may hedge.
        assert!(
            MethodContract::builder("Get", Idempotency::Safe)
                .hedging(true)
                .build()
                .validate()
                .is_ok()
        );
        assert!(keyed("Charge").hedging(true).build().validate().is_ok());
    }

    #[test]
    fn max_attempts_must_be_one_to_five() {
        for n in [0, 6, u32::MAX] {
            let c = MethodContract::builder("Get", Idempotency::Safe)
                .max_attempts(n)
                .build();
            assert_eq!(
                err(c),
                ContractError::MaxAttempts {
                    method: "Get".into(),
                    max_attempts: n
                }
            );
        }
        for n in 1..=5 {
            let c = MethodContract::builder("Get", Idempotency::Safe)
                .max_attempts(n)
                .build();
            assert_eq!(c.validate(), Ok(()));
        }
    }

    #[test]
    fn keyed_without_ttl_is_an_error() {
        let c = MethodContract::builder("Charge", Idempotency::Keyed).build();
        assert_eq!(
            err(c),
            ContractError::KeyedWithoutTtl {
                method: "Charge".into()
            }
        );
        let zero = keyed("Charge").key_ttl(Duration::ZERO).build();
        assert!(matches!(err(zero), ContractError::KeyedWithoutTtl { .. }));
    }

    #[test]
    fn duplicate_names_are_an_error() {
        let result = Contracts::validated([
            MethodContract::builder("Get", Idempotency::Safe).build(),
            keyed("Charge").build(),
            MethodContract::builder("Get", Idempotency::Safe).build(),
        ]);
        assert_eq!(
            result,
            Err(ContractError::Duplicate {
                method: "Get".into()
            })
        );
    }

    #[test]
    fn empty_name_and_zero_timeout_are_errors() {
        assert_eq!(
            err(MethodContract::builder("", Idempotency::Safe).build()),
            ContractError::EmptyName
        );
        let c = MethodContract::builder("Get", Idempotency::Safe)
            .default_timeout(Duration::ZERO)
            .build();
        assert_eq!(
            err(c),
            ContractError::ZeroTimeout {
                method: "Get".into()
            }
        );
    }

    #[test]
    fn fatal_codes_cannot_be_retryable() {
        let c = MethodContract::builder("Get", Idempotency::Safe)
            .retryable([Code::Unavailable, Code::InvalidArgument])
            .build();
        assert_eq!(
            err(c),
            ContractError::FatalCodeRetryable {
                method: "Get".into(),
                code: Code::InvalidArgument
            }
        );
    }

    #[test]
    fn unsafe_methods_cannot_retry_after_a_possible_effect() {
        for code in [Code::Unavailable, Code::DeadlineExceeded] {
            let c = MethodContract::builder("Post", Idempotency::Unsafe)
                .retryable([code])
                .max_attempts(2)
                .build();
            assert_eq!(
                err(c),
                ContractError::UnsafeRetry {
                    method: "Post".into(),
                    code
                }
            );
        }
        // Pushback codes mean "not now": the request was refused, not run.
        let c = MethodContract::builder("Post", Idempotency::Unsafe)
            .retryable([Code::ResourceExhausted])
            .max_attempts(2)
            .build();
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn lookup_and_iteration() {
        let mut set = Contracts::new();
        assert!(set.is_empty());
        set.insert(keyed("Charge").build());
        set.insert(MethodContract::builder("GetCharge", Idempotency::Safe).build());
        assert_eq!(set.len(), 2);
        assert!(set.get("Charge").unwrap().requires_key());
        assert!(!set.get("GetCharge").unwrap().requires_key());
        assert!(set.get("Refund").is_none());
        let names: Vec<_> = set.iter().map(MethodContract::name).collect();
        assert_eq!(names, ["Charge", "GetCharge"]);
        assert_eq!((&set).into_iter().count(), 2);
    }

    #[test]
    fn retryable_codes_are_sorted_and_deduplicated() {
        let c = MethodContract::builder("Get", Idempotency::Safe)
            .retryable([Code::Unavailable, Code::Aborted, Code::Unavailable])
            .build();
        assert_eq!(c.retryable(), [Code::Aborted, Code::Unavailable]);
    }

    #[test]
    fn display_prints_a_table() {
        let set = Contracts::validated([
            keyed("Charge")
                .default_timeout(Duration::from_millis(2_500))
                .retryable([Code::Unavailable, Code::DeadlineExceeded])
                .hedging(true)
                .key_ttl(KEY_TTL_PAYMENTS)
                .rate_class("payments")
                .build(),
            MethodContract::builder("GetCharge", Idempotency::Safe).build(),
        ])
        .unwrap();
        let want = "\
method     idempotency  timeout  retryable                      attempts  hedging  key_ttl  rate_class
Charge     keyed        2500ms   DEADLINE_EXCEEDED,UNAVAILABLE  3         yes      7d       payments
GetCharge  safe         1s       UNAVAILABLE                    3         no       -        default
";
        assert_eq!(set.to_string(), want);
    }

    #[test]
    fn human_durations() {
        let cases = [
            (Duration::ZERO, "0ms"),
            (Duration::from_micros(1_500), "1500us"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(120), "2min"),
            (KEY_TTL_SYNC, "1d"),
            (Duration::from_secs(3 * 3_600), "3h"),
            (KEY_TTL_SYNC * 2, "2d"),
            (KEY_TTL_ASYNC, "30d"),
        ];
        for (d, want) in cases {
            assert_eq!(human(d), want);
        }
    }
}
