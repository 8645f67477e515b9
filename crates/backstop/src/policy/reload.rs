//! [`ReloadablePolicies`]: a method table replaced while it serves.

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::{InvalidPolicy, MethodPolicies};

/// A [`MethodPolicies`] that can be replaced while requests read it: policies are configuration,
/// and changing a timeout or a key TTL must not need a restart. A new table is
/// [validated](MethodPolicies::validate) before it applies; one that is refused leaves the
/// table in effect as it was.
///
/// Give it to a server stack with
/// [`ServerStack::reloadable_policies`](crate::server::ServerStack::reloadable_policies).
/// Every layer then reads the table in effect when the request arrived, for the whole of that
/// request: a reload never gives one request the timeout of one table and the keys of another.
/// What the tables may differ in: anything a policy holds. What they should not: the routes
/// the application serves, because the stack's metrics name their routes from the table it
/// was built with.
///
/// ```
/// use std::time::Duration;
/// use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy, ReloadablePolicies};
///
/// let table = |timeout| {
///     MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).timeout(timeout).build())
/// };
/// let policies = ReloadablePolicies::new(table(Duration::from_secs(5)))?;
/// policies.replace(table(Duration::from_secs(2)))?;
/// assert_eq!(policies.load().fallback_policy().timeout(), Duration::from_secs(2));
///
/// // Hedging an unsafe method is refused: the table in effect stays.
/// let bad = MethodPolicies::new(
///     MethodPolicy::builder("other", Idempotency::Unsafe).hedging(true).build(),
/// );
/// assert!(policies.replace(bad).is_err());
/// assert_eq!(policies.load().fallback_policy().timeout(), Duration::from_secs(2));
/// # Ok::<(), backstop::policy::InvalidPolicy>(())
/// ```
#[derive(Debug, Clone)]
pub struct ReloadablePolicies {
    table: Arc<ArcSwap<MethodPolicies>>,
}

impl ReloadablePolicies {
    /// `table`, validated, as the first table in effect.
    pub fn new(table: MethodPolicies) -> Result<Self, InvalidPolicy> {
        Ok(Self {
            table: Arc::new(ArcSwap::from_pointee(table.validated()?)),
        })
    }

    /// The table in effect now.
    pub fn load(&self) -> Arc<MethodPolicies> {
        self.table.load_full()
    }

    /// Puts `table` in effect for the requests that arrive from now on, once it is valid;
    /// otherwise returns why and keeps the table in effect.
    pub fn replace(&self, table: MethodPolicies) -> Result<(), InvalidPolicy> {
        self.table.store(Arc::new(table.validated()?));
        Ok(())
    }

    /// Identity of this handle's slot (shared by its clones), so a reader can tell whether a
    /// table it was handed came from here.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.table).addr()
    }
}
