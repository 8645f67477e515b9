//! SQLite backend (feature `sqlite`): the group-commit handle [`Db`].
//!
//! [`Db`] is shared: the idempotency store and the application (e.g. the payment service's own
//! tables) write through the same writer thread, so their commits are batched together.

mod group_commit;

pub use group_commit::{Db, DbError, DbStats, SqliteOptions, Synchronous};
