//! Durable plumbing: the database handles everything that keeps state goes through.
//!
//! The idempotency stores, the client's intent journal and an application's own tables (the
//! payment service's intents, say) all need the same few things from a database: writes that
//! are answered only once durable, batched so that one flush serves many callers; reads that
//! do not queue behind the writer; a bounded pool that recovers when the database comes back;
//! and versioned migrations. Those live here, apart from any table: this module knows nothing
//! of idempotency keys, journals or servers, and they build on it, never the other way round.
//!
//! - [`sqlite`] (feature `sqlite`, default): [`Db`](sqlite::Db), one writer thread that
//!   group-commits every caller's job into shared transactions, a pool of read connections,
//!   and [`Db::migrate`](sqlite::Db::migrate); typed [`sqlite::Error`].
//! - [`postgres`] (feature `postgres`): the bounded [`pool`](postgres::pool),
//!   [`migrate`](postgres::migrate) safe for instances starting together, the batching writer
//!   under the PostgreSQL idempotency store; typed [`postgres::Error`].
//!
//! An application that shares a handle with a store (a [`Db`](sqlite::Db) or a pool) shares
//! its batching too: its own writes ride in the same transactions.

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every `.rs` file under `dir`, recursively.
    fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src/db") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// Whether `code` names the module `name` in a path (not, say, a variable `client`).
    fn names_module(code: &str, name: &str) -> bool {
        let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        code.match_indices(name).any(|(i, _)| {
            let (before, after) = (&code[..i], &code[i + name.len()..]);
            if before.ends_with(is_ident) || after.starts_with(is_ident) {
                return false;
            }
            before.trim_end().ends_with("::")
                || after.trim_start().starts_with("::")
                || code.starts_with("use ")
                || code.starts_with("pub use ")
                || code.starts_with("pub(crate) use ")
        })
    }

    #[test]
    fn module_names_are_told_from_variables() {
        assert!(names_module(
            "use crate::idempotency::Store;",
            "idempotency"
        ));
        assert!(names_module("use crate::{clock, client};", "client"));
        assert!(names_module(
            "let x = super::super::server::Gate::new();",
            "server"
        ));
        assert!(!names_module("op.run(&client).await", "client"));
        assert!(!names_module("let clients = 1;", "client"));
    }

    /// The plumbing depends on nothing of the crate that builds on it: stores, the client
    /// journal and servers use `db`, never the other way round.
    #[test]
    fn db_uses_no_module_that_builds_on_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/db");
        let mut files = Vec::new();
        sources(&dir, &mut files);
        assert!(files.len() >= 5, "{files:?}");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read source");
            for (n, line) in text.lines().enumerate() {
                let code = line.trim_start();
                // These tests, below, spell out the paths they look for.
                if file.ends_with("db/mod.rs") && code.starts_with("#[cfg(test)]") {
                    break;
                }
                if code.starts_with("//") {
                    continue;
                }
                // Whichever way the path is spelled: `crate::x`, `super::super::x`,
                // `use crate::{x, ..}`.
                let upward = ["idempotency", "client", "server"]
                    .iter()
                    .any(|name| names_module(code, name));
                assert!(!upward, "{}:{}: {line}", file.display(), n + 1);
            }
        }
    }
}
