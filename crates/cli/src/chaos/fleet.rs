//! The children of a chaos run (`serve` instances, or `proxy` instances in front of an
//! upstream): started on loopback ports chosen by the OS, killed with SIGKILL and started
//! again on the same store, with the live addresses shared with the clients.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// How long a child may take to log its address.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a child could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FleetError {
    /// The executable could not be spawned.
    #[error("cannot start `{}`", .bin.display())]
    Spawn {
        /// The executable.
        bin: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The child exited, or stayed silent, before it logged its address.
    #[error("instance {instance} did not start (log: {})", .log.display())]
    NoAddress {
        /// Which instance.
        instance: usize,
        /// Its log file.
        log: PathBuf,
    },
    /// SIGKILL could not be sent or waited for.
    #[error("cannot kill instance {instance}")]
    Kill {
        /// Which instance.
        instance: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The HTTP base URLs of the live instances (`None` while one is down), shared with the
/// clients.
#[derive(Debug, Clone, Default)]
pub(crate) struct Addresses(Arc<RwLock<Vec<Option<String>>>>);

impl Addresses {
    /// The base URL of instance `index`, if it is up.
    pub(crate) fn get(&self, index: usize) -> Option<String> {
        self.read().get(index).cloned().flatten()
    }

    /// How many instances the fleet has.
    pub(crate) fn len(&self) -> usize {
        self.read().len()
    }

    fn set(&self, index: usize, base: Option<String>) {
        let mut all = self
            .0
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if all.len() <= index {
            all.resize(index + 1, None);
        }
        all[index] = base;
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Option<String>>> {
        // A panicking writer leaves a valid vector behind: keep reading it.
        self.0
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// How every instance is started.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    /// The `backstop` executable.
    pub(crate) bin: PathBuf,
    /// `--store` of every instance.
    pub(crate) store: String,
    /// What the instances are.
    pub(crate) role: Role,
    /// Where the instances' logs go (one file per instance, appended across restarts).
    pub(crate) log_dir: PathBuf,
}

/// What a chaos run's instances are.
#[derive(Debug, Clone)]
pub(crate) enum Role {
    /// `backstop serve` in front of the PSP at this URL.
    Serve {
        /// `--psp`.
        psp: String,
    },
    /// `backstop proxy` in front of an upstream.
    Proxy {
        /// `--upstream`.
        upstream: String,
        /// `--config`: the routes file.
        config: PathBuf,
    },
}

impl Role {
    /// The subcommand and its flags (besides `--store`).
    fn args(&self) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        match self {
            Role::Serve { psp } => {
                args.extend(
                    ["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"].map(Into::into),
                );
                args.extend(["--psp".into(), psp.into()]);
                // The run measures exactly-once, not the merchant's rate limit.
                args.extend(
                    ["--tenant-rate", "1000000", "--tenant-burst", "1000000"].map(Into::into),
                );
            }
            Role::Proxy { upstream, config } => {
                args.extend(
                    ["proxy", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"].map(Into::into),
                );
                args.extend(["--upstream".into(), upstream.into()]);
                args.extend(["--config".into(), config.into()]);
            }
        }
        args
    }

    /// The filter of the logs kept: the address line, and warnings.
    fn log_filter(&self) -> &'static str {
        match self {
            Role::Serve { .. } => "warn,backstop_payment::server=info",
            Role::Proxy { .. } => "warn,backstop_proxy::server=info",
        }
    }
}

/// The running instances.
#[derive(Debug)]
pub(crate) struct Fleet {
    launch: Launch,
    children: Vec<Option<Child>>,
    addresses: Addresses,
}

impl Fleet {
    /// Starts `instances` instances one after the other (the first one migrates the store).
    pub(crate) async fn start(launch: Launch, instances: usize) -> Result<Fleet, FleetError> {
        let mut fleet = Fleet {
            launch,
            children: Vec::new(),
            addresses: Addresses::default(),
        };
        for index in 0..instances {
            fleet.children.push(None);
            fleet.restart(index).await?;
        }
        Ok(fleet)
    }

    /// The live addresses, for the clients.
    pub(crate) fn addresses(&self) -> Addresses {
        self.addresses.clone()
    }

    /// How many instances.
    pub(crate) fn len(&self) -> usize {
        self.children.len()
    }

    /// SIGKILLs instance `index` and waits until it is gone; its address is withdrawn.
    pub(crate) async fn kill(&mut self, index: usize) -> Result<(), FleetError> {
        self.addresses.set(index, None);
        if let Some(mut child) = self.children[index].take() {
            // `Child::kill` sends SIGKILL on unix and reaps the process.
            child.kill().await.map_err(|source| FleetError::Kill {
                instance: index,
                source,
            })?;
        }
        Ok(())
    }

    /// Starts instance `index` (again), on new ports, and publishes its address once it
    /// listens.
    pub(crate) async fn restart(&mut self, index: usize) -> Result<String, FleetError> {
        let log = self.log_path(index);
        let mut child = Command::new(&self.launch.bin)
            .args(["--log-format", "json"])
            .args(self.launch.role.args())
            .args(["--store", &self.launch.store])
            .env("RUST_LOG", self.launch.role.log_filter())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| FleetError::Spawn {
                bin: self.launch.bin.clone(),
                source,
            })?;
        let no_address = || FleetError::NoAddress {
            instance: index,
            log: log.clone(),
        };
        let stderr = child.stderr.take().ok_or_else(no_address)?;
        let mut file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .await
            .map_err(|_| no_address())?;
        let mut lines = BufReader::new(stderr).lines();
        let found = tokio::time::timeout(START_TIMEOUT, async {
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = file.write_all(format!("{line}\n").as_bytes()).await;
                if let Some(addr) = listening_address(&line) {
                    return Some(addr);
                }
            }
            None
        })
        .await;
        let Ok(Some(addr)) = found else {
            let _ = child.kill().await;
            return Err(no_address());
        };
        // Keep draining the pipe into the log for the life of the child.
        tokio::spawn(async move {
            let mut rest = lines.into_inner();
            let _ = tokio::io::copy(&mut rest, &mut file).await;
        });
        let base = format!("http://{addr}");
        self.children[index] = Some(child);
        self.addresses.set(index, Some(base.clone()));
        Ok(base)
    }

    /// Kills every instance (SIGKILL: the store must survive it anyway, and nothing is in
    /// flight any more).
    pub(crate) async fn stop(mut self) {
        for index in 0..self.children.len() {
            let _ = self.kill(index).await;
        }
    }

    fn log_path(&self, index: usize) -> PathBuf {
        log_path(&self.launch.log_dir, index)
    }
}

/// The log file of instance `index`.
pub(crate) fn log_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("instance-{index}.log"))
}

/// The HTTP address in `serve`'s "payment service listening" JSON log line, or `proxy`'s
/// "proxy listening" one.
fn listening_address(line: &str) -> Option<String> {
    let json: serde_json::Value = serde_json::from_str(line).ok()?;
    let field = match json["fields"]["message"].as_str()? {
        "payment service listening" => "http",
        "proxy listening" => "listen",
        _ => return None,
    };
    json["fields"][field].as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_is_read_from_the_listening_line_only() {
        let line = r#"{"timestamp":"t","level":"INFO","fields":{"message":"payment service listening","http":"127.0.0.1:4321","grpc":"127.0.0.1:4322"}}"#;
        assert_eq!(listening_address(line).as_deref(), Some("127.0.0.1:4321"));
        assert_eq!(
            listening_address(r#"{"fields":{"message":"starting","http":"x"}}"#),
            None
        );
        assert_eq!(listening_address("not json"), None);
        let proxy = r#"{"fields":{"message":"proxy listening","listen":"127.0.0.1:8080","admin":"127.0.0.1:9901"}}"#;
        assert_eq!(listening_address(proxy).as_deref(), Some("127.0.0.1:8080"));
    }
}
