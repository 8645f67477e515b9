//! A handler that crashes after its effect: the server process is killed with SIGKILL while
//! its handler hangs after the effect, and a retry with the same key goes to a fresh server
//! process on the same store (a SQLite file in a temporary directory, or a PostgreSQL schema
//! of its own). What the retry gets depends on the route's
//! [`Takeover`](backstop::policy::Takeover):
//!
//! - `Refuse` (the default): once the dead holder's lease has ended, the definite
//!   `outcome_unknown` problem; the handler never runs again (one effect), and a replay after
//!   that is the same stored answer;
//! - `Resume`: the handler runs, sees `Phases::resume()` with the recovery point it committed
//!   before the effect and the same effect key, and completes without repeating the effect;
//! - `Rerun`: the handler runs again from the start: two effects (under the same effect key, for
//!   a downstream that deduplicates by it). The policy matters.
//!
//! A retry that arrives while the dead holder's lease still runs is answered by its own
//! deadline: 409 `request_in_progress` with a `Retry-After` of the lease's remaining time when
//! its budget ends first, or the takeover's answer as soon as the lease ends when its budget
//! outlasts the lease (a retry with a 20 s budget behind a 3 s lease gets `outcome_unknown`,
//! which it could not have if it had waited out its budget).
//!
//! # The server processes
//!
//! Each server is this test binary itself, run again (`std::env::current_exe()`) with only the
//! test `child_server_process` selected and `CRASH_TAKEOVER_CHILD=1`: that test then serves
//! until it is killed, and in any other run it returns at once. No other binary has to be
//! built or found, and the child runs exactly the code under test. The child tells its port
//! by writing it to a file (written whole, then renamed), which the test polls; the effect is
//! a line appended (and synced) to a file, which the test polls too: nothing waits by sleeping
//! for a guessed time. The child's output goes to a log file, printed when it does not start.
//!
//! No assertion measures time: the first request's 3 s budget (its lease) only has to outlast
//! the moment between its effect and the kill, and each retry's outcome is asserted by its
//! kind.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::extract::{Extension, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use backstop::db::sqlite::SqliteOptions;
use backstop::idempotency::Store;
use backstop::idempotency::sqlite::{SqliteStore, SqliteWrites};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy, Takeover};
use backstop::server::idempotency::Phases;
use backstop::server::{IdempotencyLayer, ServerStack};
use http::Method;
use serde_json::{Value, json};

/// Set in a child server's environment: `child_server_process` serves instead of returning.
const CHILD: &str = "CRASH_TAKEOVER_CHILD";
/// The store: `sqlite:<path>` or `postgres:<schema>`.
const STORE: &str = "CRASH_TAKEOVER_STORE";
/// The file the effects are appended to.
const EFFECTS: &str = "CRASH_TAKEOVER_EFFECTS";
/// The file the child writes its port to once it listens.
const PORT_FILE: &str = "CRASH_TAKEOVER_PORT_FILE";
/// Set to `1`: the handler hangs after its effect.
const HANG: &str = "CRASH_TAKEOVER_HANG";

/// The routes' lease; a request's lease is the longer of this and its budget.
const LEASE: Duration = Duration::from_secs(1);
/// Clock skew bound of the child servers (one machine: small), added twice to each lease.
const SKEW: Duration = Duration::from_millis(50);
/// The budget of the request whose server is killed: its lease, about as long.
const FIRST_BUDGET: &str = "3S";

// ---------------------------------------------------------------------------------------------
// The child: a plain axum handler behind the server stack.

/// A store whose phase commits can carry no writes of the handler's own.
trait NoWrites: Store {
    fn none() -> Self::Writes<()>;
}

impl NoWrites for SqliteStore {
    fn none() -> SqliteWrites<()> {
        Box::new(|_| Ok(()))
    }
}

#[cfg(feature = "postgres")]
impl NoWrites for backstop::idempotency::postgres::PostgresStore {
    fn none() -> backstop::idempotency::postgres::PostgresWrites<()> {
        Box::new(|_| Box::pin(async { Ok(()) }))
    }
}

#[derive(Clone)]
struct ChildApp {
    effects: PathBuf,
    hang: bool,
}

/// The lines of the effects file (none when it does not exist yet).
fn effect_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|text| text.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// The effect: a line naming the effect key and the route, appended and synced.
fn perform_effect(path: &Path, effect_key: &str, route: &str) {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("open the effects file");
    writeln!(file, "{effect_key} {route}").expect("append the effect");
    file.sync_all().expect("sync the effect");
}

/// `POST /v1/{refuse,resume,rerun}`. On `resume` it commits the recovery point `charge_sent`
/// (its data: the effect key) before the effect, and when it resumes from that point it asks
/// "the downstream" (the effects file) for the effect by its key instead of repeating it. The
/// other routes perform the effect whenever they run.
async fn handle<St: NoWrites>(
    State(app): State<ChildApp>,
    Extension(phases): Extension<Phases<St>>,
    uri: Uri,
) -> Response {
    let route = uri.path().rsplit('/').next().unwrap_or_default().to_owned();
    let effect_key = phases.effect_key();
    let resume = phases.resume().cloned();
    let point = phases.recovery_point().cloned();
    let mut repeat = true;
    if route == "resume" {
        match &point {
            Some(point) if point.phase == "charge_sent" => {
                let key = String::from_utf8_lossy(&point.data).into_owned();
                repeat = !effect_lines(&app.effects)
                    .iter()
                    .any(|line| line.starts_with(&key));
            }
            _ => {
                if let Err(error) = phases
                    .commit("charge_sent", effect_key.clone(), St::none())
                    .await
                {
                    let body = format!("phase not committed: {error}");
                    return (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
                }
            }
        }
    }
    if repeat {
        perform_effect(&app.effects, &effect_key, &route);
    }
    if app.hang {
        std::future::pending::<()>().await;
    }
    let prior = resume.map(|resume| format!("{:?}", resume.prior).to_lowercase());
    let body = json!({
        "effect_key": effect_key,
        "prior": prior,
        "point_phase": point.as_ref().map(|p| p.phase.clone()),
        "point_data": point.as_ref().map(|p| String::from_utf8_lossy(&p.data).into_owned()),
        "effect_repeated": repeat,
    });
    (StatusCode::CREATED, Json(body)).into_response()
}

fn policies() -> MethodPolicies {
    let keyed = |takeover| {
        MethodPolicy::builder("Charge", Idempotency::Keyed)
            .key_ttl(KEY_TTL_PAYMENTS)
            .takeover(takeover)
            .build()
    };
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/refuse", keyed(Takeover::Refuse))
        .route(Method::POST, "/v1/resume", keyed(Takeover::Resume))
        .route(Method::POST, "/v1/rerun", keyed(Takeover::Rerun))
        .validated()
        .unwrap()
}

async fn serve<St: NoWrites>(store: St, app: ChildApp, port_file: PathBuf) {
    let stack = ServerStack::new("crash", store.clone())
        .idempotency(IdempotencyLayer::new(store).max_clock_skew(SKEW))
        .policies(policies())
        .lease(LEASE)
        .into_layer();
    let router = Router::new()
        .route("/v1/refuse", post(handle::<St>))
        .route("/v1/resume", post(handle::<St>))
        .route("/v1/rerun", post(handle::<St>))
        .layer(stack)
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let written = port_file.with_extension("tmp");
    std::fs::write(&written, port.to_string()).unwrap();
    std::fs::rename(&written, &port_file).unwrap();
    axum::serve(listener, router).await.unwrap();
}

/// A server process of the tests (see the module docs); in any other run, nothing.
#[test]
fn child_server_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let var = |name| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let app = ChildApp {
        effects: PathBuf::from(var(EFFECTS)),
        hang: var(HANG) == "1",
    };
    let port_file = PathBuf::from(var(PORT_FILE));
    let store = var(STORE);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        if let Some(path) = store.strip_prefix("sqlite:") {
            let store = SqliteStore::open(path, SqliteOptions::default())
                .await
                .expect("open the SQLite store");
            serve(store, app, port_file).await;
        } else if let Some(schema) = store.strip_prefix("postgres:") {
            serve_postgres(schema, app, port_file).await;
        } else {
            panic!("unknown store {store}");
        }
    });
}

#[cfg(feature = "postgres")]
async fn serve_postgres(schema: &str, app: ChildApp, port_file: PathBuf) {
    use backstop::db::postgres::tokio_postgres;
    use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};

    let mut config: tokio_postgres::Config = support::services::postgres_url().parse().unwrap();
    config.options(format!("-c search_path={schema}"));
    let options = PostgresOptions {
        max_connections: 4,
        writers: 2,
        ..PostgresOptions::default()
    };
    let store = PostgresStore::connect_with(config, options)
        .await
        .expect("connect the PostgreSQL store");
    serve(store, app, port_file).await;
}

#[cfg(not(feature = "postgres"))]
async fn serve_postgres(_schema: &str, _app: ChildApp, _port_file: PathBuf) {
    panic!("built without the postgres feature");
}

// ---------------------------------------------------------------------------------------------
// The test side.

/// Where a scenario keeps its files, and which store its servers open.
struct Setup {
    dir: tempfile::TempDir,
    store: String,
}

impl Setup {
    fn sqlite() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("sqlite:{}", dir.path().join("idem.db").display());
        Setup { dir, store }
    }

    #[cfg(feature = "postgres")]
    fn postgres(schema: &support::postgres_schema::Schema) -> Setup {
        Setup {
            dir: tempfile::tempdir().unwrap(),
            store: format!("postgres:{}", schema.name()),
        }
    }

    fn effects(&self) -> PathBuf {
        self.dir.path().join("effects")
    }

    fn effect_lines(&self) -> Vec<String> {
        effect_lines(&self.effects())
    }

    /// Starts server number `n` and waits until it listens.
    fn start(&self, n: usize, hang: bool) -> Server {
        let port_file = self.dir.path().join(format!("port-{n}"));
        let log = self.dir.path().join(format!("server-{n}.log"));
        let output = std::fs::File::create(&log).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_server_process", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CHILD, "1")
            .env(STORE, &self.store)
            .env(EFFECTS, self.effects())
            .env(PORT_FILE, &port_file)
            .env(HANG, if hang { "1" } else { "0" })
            .stdin(Stdio::null())
            .stdout(output.try_clone().unwrap())
            .stderr(output)
            .spawn()
            .unwrap();
        let mut server = Server { child, port: 0 };
        let port = poll("the server's port", || {
            if let Ok(Some(status)) = server.child.try_wait() {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("server {n} exited ({status}) before listening:\n{log}");
            }
            std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|port| port.parse().ok())
        });
        server.port = port;
        server
    }
}

/// A child server process, killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn url(&self, route: &str) -> String {
        format!("http://127.0.0.1:{}/v1/{route}", self.port)
    }

    /// SIGKILL, and wait for it to be gone.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `ready` every 10 ms until it answers, for at most a minute (a machine that slow fails
/// with what was waited for).
fn poll<T>(what: &str, mut ready: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A charge with `key` and `grpc-timeout: budget`.
async fn charge(url: &str, key: &str, budget: &str) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .header("grpc-timeout", budget)
        .body(r#"{"order_id":"o-1","amount_cents":100}"#)
        .send()
        .await
}

/// Sends the first charge on `route` to a server that hangs after the effect, waits for the
/// effect, and kills the server with SIGKILL: the record stays `running` under a lease of
/// about `budget`. Answers the effect key the first run used.
async fn crash_after_the_effect(setup: &Setup, route: &str, key: &str, budget: &str) -> String {
    let mut first = setup.start(1, true);
    let url = first.url(route);
    let (key_owned, budget_owned) = (key.to_owned(), budget.to_owned());
    let request = tokio::spawn(async move { charge(&url, &key_owned, &budget_owned).await });
    let effects = setup.effects();
    let line = tokio::task::spawn_blocking(move || {
        poll("the first run's effect", || {
            effect_lines(&effects).into_iter().next()
        })
    })
    .await
    .unwrap();
    first.kill();
    assert!(
        request.await.unwrap().is_err(),
        "the killed server answered nothing"
    );
    line.split(' ').next().unwrap().to_owned()
}

async fn json_of(response: reqwest::Response) -> Value {
    response.json().await.unwrap()
}

/// `Refuse`: the retry learns `outcome_unknown` when the lease ends; nothing runs again, and
/// the answer is replayed after that.
async fn refuse_answers_outcome_unknown(setup: Setup) {
    crash_after_the_effect(&setup, "refuse", "k-refuse", FIRST_BUDGET).await;
    let server = setup.start(2, false);
    // A budget far longer than the lease: answered when the lease ends, not at its deadline.
    let retry = charge(&server.url("refuse"), "k-refuse", "20S")
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    let answer = json_of(retry).await;
    assert_eq!(answer["code"], "outcome_unknown", "{answer}");
    assert_eq!(
        setup.effect_lines().len(),
        1,
        "the handler did not run again"
    );

    let replay = charge(&server.url("refuse"), "k-refuse", "20S")
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(json_of(replay).await, answer, "the same stored answer");
    assert_eq!(setup.effect_lines().len(), 1);
}

/// `Resume`: the retry's handler resumes from the recovery point committed before the effect,
/// under the same effect key, and does not repeat the effect.
async fn resume_continues_from_the_recovery_point(setup: Setup) {
    let first_key = crash_after_the_effect(&setup, "resume", "k-resume", FIRST_BUDGET).await;
    let server = setup.start(2, false);
    let retry = charge(&server.url("resume"), "k-resume", "20S")
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let answer = json_of(retry).await;
    assert_eq!(answer["prior"], "abandoned", "{answer}");
    assert_eq!(answer["point_phase"], "charge_sent", "{answer}");
    assert_eq!(answer["point_data"], first_key.as_str(), "{answer}");
    assert_eq!(answer["effect_key"], first_key.as_str(), "{answer}");
    assert_eq!(answer["effect_repeated"], false, "{answer}");
    assert_eq!(setup.effect_lines().len(), 1, "the effect was not repeated");

    let replay = charge(&server.url("resume"), "k-resume", "20S")
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(json_of(replay).await, answer);
    assert_eq!(setup.effect_lines().len(), 1);
}

/// `Rerun`: the retry runs the handler again from the start: a second effect, under the same
/// effect key.
async fn rerun_runs_again(setup: Setup) {
    let first_key = crash_after_the_effect(&setup, "rerun", "k-rerun", FIRST_BUDGET).await;
    let server = setup.start(2, false);
    let retry = charge(&server.url("rerun"), "k-rerun", "20S")
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    let answer = json_of(retry).await;
    assert_eq!(answer["prior"], "abandoned", "{answer}");
    assert_eq!(answer["effect_key"], first_key.as_str(), "{answer}");
    let lines = setup.effect_lines();
    assert_eq!(lines.len(), 2, "run again: {lines:?}");
    assert!(lines.iter().all(|line| line.starts_with(&first_key)));
}

/// A retry whose budget ends before the dead holder's lease: 409 `request_in_progress` with
/// the lease's remaining time in `Retry-After`, by its own deadline (not a 504), and nothing
/// runs.
async fn retry_behind_a_live_lease_is_told_when_it_ends(setup: Setup) {
    // A lease of about a minute: still running whatever the machine's pace.
    crash_after_the_effect(&setup, "refuse", "k-live", "60S").await;
    let server = setup.start(2, false);
    let retry = charge(&server.url("refuse"), "k-live", "1S").await.unwrap();
    assert_eq!(
        retry.status(),
        StatusCode::CONFLICT,
        "answered by its deadline"
    );
    let retry_after: u64 = retry.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // The lease's remaining time: more than the retry's own budget, at most the lease.
    assert!((2..=61).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(json_of(retry).await["code"], "request_in_progress");
    assert_eq!(setup.effect_lines().len(), 1);
}

mod sqlite {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_refuse_answers_outcome_unknown() {
        refuse_answers_outcome_unknown(Setup::sqlite()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_resume_continues_from_the_recovery_point() {
        resume_continues_from_the_recovery_point(Setup::sqlite()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_rerun_runs_again() {
        rerun_runs_again(Setup::sqlite()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_retry_behind_a_live_lease_is_told_when_it_ends() {
        retry_behind_a_live_lease_is_told_when_it_ends(Setup::sqlite()).await;
    }
}

#[cfg(feature = "postgres")]
mod support {
    pub(crate) mod postgres_schema;
    pub(crate) mod services;
}

/// Against the PostgreSQL on 127.0.0.1:5432, each scenario in a schema of its own.
#[cfg(feature = "postgres")]
mod postgres {
    use super::support::postgres_schema::Schema;
    use super::support::services;
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_refuse_answers_outcome_unknown() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("crash_takeover").await;
        refuse_answers_outcome_unknown(Setup::postgres(&schema)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_resume_continues_from_the_recovery_point() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("crash_takeover").await;
        resume_continues_from_the_recovery_point(Setup::postgres(&schema)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_rerun_runs_again() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("crash_takeover").await;
        rerun_runs_again(Setup::postgres(&schema)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_retry_behind_a_live_lease_is_told_when_it_ends() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("crash_takeover").await;
        retry_behind_a_live_lease_is_told_when_it_ends(Setup::postgres(&schema)).await;
    }
}
