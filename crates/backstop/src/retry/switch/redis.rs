//! The switch's setting kept in one Redis key, for every process watching it.
//!
//! The key holds `off` or `ratio=R`; no key means `on`, so a setting written with an expiry
//! (`backstop retries off --for 10m`) ends by itself. Each process reads the key every
//! [`DEFAULT_POLL`] (a `GET` of a few bytes: 4 per second per process); a fleet is switched
//! within one poll and a round trip. Polling rather than pub/sub because a process that
//! connects, reconnects or missed a message still converges on the next read.
//!
//! When Redis does not answer, the switch keeps the last setting it read (logged once per
//! outage): an operator's `off` must not be undone by the outage it was set for. A value that
//! is not a setting is refused and logged, and the last setting kept.

use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::task::JoinHandle;

use super::{RetrySetting, RetrySwitch};

/// The key a fleet's processes watch unless told otherwise.
pub const DEFAULT_KEY: &str = "backstop:retry-switch";

/// How often a watching process reads the key.
pub const DEFAULT_POLL: Duration = Duration::from_millis(250);

/// Longest wait for one read, or for connecting.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The task keeping a [`RetrySwitch`] equal to a Redis key (see
/// [`RetrySwitch::watch_redis`]); it stops when this is dropped.
#[derive(Debug)]
pub struct SwitchWatch {
    task: Option<JoinHandle<()>>,
}

impl SwitchWatch {
    /// The watching task, no longer stopped by a drop: for a caller that keeps its
    /// background tasks together and aborts them at shutdown.
    pub fn into_task(mut self) -> JoinHandle<()> {
        self.task.take().expect("taken only here")
    }
}

impl Drop for SwitchWatch {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(READ_TIMEOUT))
        .set_response_timeout(Some(READ_TIMEOUT))
        .set_number_of_retries(0)
}

impl RetrySwitch {
    /// Keeps this switch equal to the Redis key `key` at `url`, read every `every` (see
    /// [`DEFAULT_KEY`] and [`DEFAULT_POLL`]), until the returned watch is dropped. Call it
    /// inside a Tokio runtime; it connects lazily, so it fails only on a URL that is not a
    /// Redis one, and a Redis that is down keeps the switch as it was.
    pub fn watch_redis(
        &self,
        url: &str,
        key: impl Into<String>,
        every: Duration,
    ) -> Result<SwitchWatch, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let mut connection = ConnectionManager::new_lazy_with_config(client, manager_config())?;
        let key: String = key.into();
        let switch = self.clone();
        let every = every.max(Duration::from_millis(10));
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // What was last logged, so an outage or a bad value is reported once.
            let mut failing = false;
            let mut refused: Option<String> = None;
            loop {
                ticks.tick().await;
                let read =
                    tokio::time::timeout(READ_TIMEOUT, connection.get::<_, Option<String>>(&key))
                        .await;
                let value = match read {
                    Ok(Ok(value)) => value,
                    Ok(Err(error)) => {
                        if !std::mem::replace(&mut failing, true) {
                            tracing::warn!(%error, key, "retry switch: Redis does not answer; the last setting holds");
                        }
                        continue;
                    }
                    Err(_) => {
                        if !std::mem::replace(&mut failing, true) {
                            tracing::warn!(
                                key,
                                "retry switch: Redis does not answer in time; the last setting holds"
                            );
                        }
                        continue;
                    }
                };
                if std::mem::replace(&mut failing, false) {
                    tracing::info!(key, "retry switch: Redis answers again");
                }
                match value.as_deref().map_or(Ok(RetrySetting::On), str::parse) {
                    Ok(setting) => {
                        refused = None;
                        switch.set(setting, "redis");
                    }
                    Err(error) => {
                        if refused.as_ref() != value.as_ref() {
                            tracing::error!(%error, key, "retry switch: refused the key's value; the last setting holds");
                            refused = value;
                        }
                    }
                }
            }
        });
        Ok(SwitchWatch { task: Some(task) })
    }
}

/// Writes `setting` to the key every watching process reads: `on` removes the key, the others
/// are stored, for `ttl` when given (then the fleet is back `on` by itself).
pub async fn write_redis(
    url: &str,
    key: &str,
    setting: RetrySetting,
    ttl: Option<Duration>,
) -> Result<(), redis::RedisError> {
    let client = redis::Client::open(url)?;
    let mut connection = ConnectionManager::new_with_config(client, manager_config()).await?;
    match (setting, ttl) {
        (RetrySetting::On, _) => connection.del::<_, ()>(key).await,
        (setting, None) => connection.set::<_, _, ()>(key, setting.to_string()).await,
        (setting, Some(ttl)) => {
            let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
            connection
                .pset_ex::<_, _, ()>(key, setting.to_string(), ms)
                .await
        }
    }
}

/// The key's value as the watching processes read it, and how long it has left (`None`: no
/// expiry, or no key). A value that is not a setting is returned as the error's text.
pub async fn read_redis(
    url: &str,
    key: &str,
) -> Result<(Result<RetrySetting, super::SettingError>, Option<Duration>), redis::RedisError> {
    let client = redis::Client::open(url)?;
    let mut connection = ConnectionManager::new_with_config(client, manager_config()).await?;
    let value: Option<String> = connection.get(key).await?;
    let ttl_ms: i64 = connection.pttl(key).await?;
    let setting = value.as_deref().map_or(Ok(RetrySetting::On), str::parse);
    let left = u64::try_from(ttl_ms).ok().map(Duration::from_millis);
    Ok((setting, left))
}
