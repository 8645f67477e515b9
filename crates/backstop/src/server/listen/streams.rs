//! The executor of HTTP/2 streams, whose tasks the drain bound can abort.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// The executor of HTTP/2 streams: hyper runs each stream's request on a task of its own, which
/// a dropped connection would not cancel; these are kept so the drain bound can abort them.
#[derive(Clone, Default)]
pub(super) struct Streams(Arc<StreamTasks>);

#[derive(Default)]
struct StreamTasks {
    next_id: AtomicU64,
    running: Mutex<Running>,
    ended: Notify,
}

/// Stream tasks by id; a task that ended before its handle was recorded leaves its id in
/// `ended_early` instead.
#[derive(Default)]
struct Running {
    tasks: HashMap<u64, tokio::task::AbortHandle>,
    ended_early: HashSet<u64>,
}

impl StreamTasks {
    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, stream: F) {
        let id = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        let ended = StreamEnded {
            tasks: Arc::clone(&self.0),
            id,
        };
        let task = tokio::spawn(async move {
            let _ended = ended;
            stream.await;
        });
        let mut running = self.0.lock();
        if !running.ended_early.remove(&id) {
            running.tasks.insert(id, task.abort_handle());
        }
    }
}

impl Streams {
    /// Aborts every stream task and waits until each has been dropped.
    pub(super) async fn abort_all(&self) {
        for task in self.0.lock().tasks.values() {
            task.abort();
        }
        loop {
            let ended = self.0.ended.notified();
            let mut ended = std::pin::pin!(ended);
            ended.as_mut().enable();
            if self.0.lock().tasks.is_empty() {
                return;
            }
            ended.await;
        }
    }
}

/// Unregisters a stream task when it ends or is dropped.
struct StreamEnded {
    tasks: Arc<StreamTasks>,
    id: u64,
}

impl Drop for StreamEnded {
    fn drop(&mut self) {
        let mut running = self.tasks.lock();
        if running.tasks.remove(&self.id).is_none() {
            running.ended_early.insert(self.id);
        }
        if running.tasks.is_empty() {
            self.tasks.ended.notify_waiters();
        }
    }
}
