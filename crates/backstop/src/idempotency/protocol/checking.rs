//! What the model checks of this module share: run a model to the end, or until a property
//! has a counterexample, and assert its properties.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::hash::Hash;

use stateright::{Checker, Expectation, HasDiscoveries, Model, Representative};

/// Every reachable state, up to symmetry.
pub(super) fn check<M>(model: M) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Representative + Clone + PartialEq + Hash + Debug + Send + Sync,
    M::Action: Clone + PartialEq + Debug + Send + Sync,
{
    model.checker().symmetry().spawn_dfs().join()
}

/// Checks until `property` has a discovery (or the space is exhausted).
pub(super) fn find<M>(model: M, property: &'static str) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + PartialEq + Hash + Debug + Send + Sync,
    M::Action: Clone + PartialEq + Debug + Send + Sync,
{
    model
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join()
}

/// [`Checker::assert_properties`], but for the properties in `waived`, which the model's
/// configuration does not promise; and the model must have explored more than a toy space.
pub(super) fn assert_properties_but<M>(checker: &impl Checker<M>, waived: &[&str])
where
    M: Model,
    M::State: Clone + PartialEq + Hash + Debug,
    M::Action: Clone + PartialEq + Debug,
{
    for p in checker.model().properties() {
        match p.expectation {
            _ if waived.contains(&p.name) => {}
            Expectation::Always | Expectation::Eventually => checker.assert_no_discovery(p.name),
            Expectation::Sometimes => {
                checker.assert_any_discovery(p.name);
            }
        }
    }
    eprintln!("{} states", checker.unique_state_count());
    assert!(
        checker.unique_state_count() > 1_000,
        "the model explored too little"
    );
}
