//! The preparation stage: a fixed pool of threads with a bounded queue that does a request's
//! CPU work before the engine takes it — parsing its body, rendering the chat template,
//! tokenizing, decoding and preprocessing its images, compiling its grammar — so that the
//! async runtime only moves bytes and answers the probes at once whatever requests arrive.
//!
//! Tokio's blocking pool is no bound (it grows to 512 threads, each holding a request's body
//! and its copies), and work on the runtime's own threads stalls every connection, the probes
//! included. Here `limits.prepareThreads` threads take jobs from a queue of
//! `limits.maxPrepareQueue`: a job that finds it full is answered 429 `prepare_busy` with
//! `Retry-After` at once, one whose deadline passed while it waited is answered 504
//! `request_timeout` without running, and one whose caller went away is dropped unrun.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use axum::http::StatusCode;

use super::ApiError;

/// A job: runs on a preparation thread, sends its own answer.
type Job = Box<dyn FnOnce() + Send>;

/// The pool (see the module's doc). Dropping it ends its threads once their jobs are done.
pub struct Prepare {
    tx: SyncSender<Job>,
    /// Jobs queued and not yet started (the `mole_prepare_queued` gauge).
    queued: Arc<AtomicUsize>,
    threads: usize,
}

impl Prepare {
    /// `threads` threads (0: one per core) over a queue of `queue` jobs.
    pub fn new(threads: usize, queue: usize) -> Self {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        let (tx, rx) = sync_channel::<Job>(queue.max(1));
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("mole-prepare-{i}"))
                .spawn(move || work(&rx));
            if let Err(e) = spawned {
                tracing::error!(error = %e, "a preparation thread did not start");
            }
        }
        Self {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            threads,
        }
    }

    /// The pool's threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Jobs waiting for a thread now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Runs `f` on a preparation thread and waits for its answer: 429 `prepare_busy` when the
    /// queue is full, 504 `request_timeout` when `deadline` passed before a thread took it,
    /// 500 `internal_error` if it panicked (the thread lives on). Dropping the returned future
    /// (the client went away) drops the job unrun if it has not started.
    pub async fn run<T: Send + 'static>(
        &self,
        deadline: Instant,
        f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let (done, answer) = tokio::sync::oneshot::channel();
        let queued = self.queued.clone();
        // The job runs in the request's span: what it starts (the engine's sequences) is
        // traced under the request.
        let span = tracing::Span::current();
        let job: Job = Box::new(move || {
            queued.fetch_sub(1, Ordering::Relaxed);
            if done.is_closed() {
                return;
            }
            let _in = span.enter();
            let r = if Instant::now() >= deadline {
                Err(timed_out())
            } else {
                std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
                    Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "internal_error",
                        "preparing the request failed",
                    ))
                })
            };
            let _ = done.send(r);
        });
        self.queued.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.queued.fetch_sub(1, Ordering::Relaxed);
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "prepare_busy",
                    "the preparation queue is full (limits.maxPrepareQueue); retry shortly",
                )
                .with_retry_after(1));
            }
            Err(TrySendError::Disconnected(_)) => {
                self.queued.fetch_sub(1, Ordering::Relaxed);
                return Err(shutting_down());
            }
        }
        answer.await.unwrap_or_else(|_| Err(shutting_down()))
    }
}

/// How much a preparation thread yields the CPU to the others (`nice` 10): when the cores are
/// busy the async runtime (the probes, the streams) and the engine thread run first, and new
/// requests are prepared with what is left, as a scheduler favours running requests over
/// waiting ones.
const NICE: libc::c_int = 10;

/// A preparation thread: takes jobs until the pool is dropped.
fn work(rx: &Mutex<Receiver<Job>>) {
    // SAFETY: setpriority reads no memory of ours; on Linux PRIO_PROCESS with who 0 sets the
    // calling thread's nice value (threads have their own). A failure leaves it at 0.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICE) };
    loop {
        // The lock is held while waiting: one idle thread waits on the queue, the others on
        // the lock, and each job goes to exactly one.
        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
        match job {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}

/// The answer when the pool's threads are gone (the server is stopping).
fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "shutting_down",
        "the server is shutting down",
    )
}

/// The answer to a request whose deadline passed before its preparation started.
fn timed_out() -> ApiError {
    ApiError::new(
        StatusCode::GATEWAY_TIMEOUT,
        "request_timeout",
        "the request waited past limits.requestTimeoutSeconds for preparation",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Jobs run on the pool's threads; a full queue is refused at once with 429, a job past
    /// its deadline is answered 504 unrun, a panic is a 500 and the thread lives on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_queue_is_bounded_and_jobs_answer() {
        let p = Arc::new(Prepare::new(1, 1));
        let later = || Instant::now() + Duration::from_secs(60);
        let name = p
            .run(later(), || {
                Ok(std::thread::current().name().map(String::from))
            })
            .await
            .unwrap();
        assert_eq!(name.as_deref(), Some("mole-prepare-0"));
        // One job holds the thread until released, one waits in the queue: the third is
        // refused.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = Mutex::new(held);
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let p1 = p.clone();
        let first = tokio::spawn(async move {
            p1.run(later(), move || {
                let _ = started_tx.send(());
                let _ = held.lock().unwrap().recv();
                Ok(1)
            })
            .await
        });
        started.await.unwrap();
        let p2 = p.clone();
        let second = tokio::spawn(async move { p2.run(later(), || Ok(2)).await });
        while p.queued() == 0 {
            tokio::task::yield_now().await;
        }
        let third = p.run(later(), || Ok(3)).await.unwrap_err();
        assert_eq!((third.status.as_u16(), third.code), (429, "prepare_busy"));
        assert_eq!(third.retry_after, Some(1));
        release.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap(), 1);
        assert_eq!(second.await.unwrap().unwrap(), 2);
        let late = p
            .run(Instant::now() - Duration::from_millis(1), || Ok(4))
            .await
            .unwrap_err();
        assert_eq!((late.status.as_u16(), late.code), (504, "request_timeout"));
        let panicked = p
            .run(later(), || -> Result<(), ApiError> { panic!("boom") })
            .await
            .unwrap_err();
        assert_eq!(panicked.code, "internal_error");
        assert_eq!(p.run(later(), || Ok(5)).await.unwrap(), 5);
    }
}
