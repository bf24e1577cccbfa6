//! Progress of the long-running tools (`merge`, `quantize`, `import`, `fetch`): a bar on a
//! terminal, and otherwise — a Job's log, a pipe — a structured `progress` line every few
//! seconds (`MOLE_PROGRESS_INTERVAL_SECS`, default 5) that log collectors can parse:
//! `task`, `unit`, `done`, `total`, `percent`.
//!
//! The bar is only drawn when stderr is a terminal: redrawn bars in a log file are noise, and
//! a Job's log is what a person or the operator reads back.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds between two progress lines when no terminal is attached.
fn interval() -> Duration {
    let secs = std::env::var("MOLE_PROGRESS_INTERVAL_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .unwrap_or(5.0);
    Duration::from_secs_f64(secs)
}

/// One task's progress: `done` of `total` units.
pub struct Progress {
    task: &'static str,
    unit: &'static str,
    total: u64,
    done: AtomicU64,
    bar: Option<indicatif::ProgressBar>,
    last_line: Mutex<Instant>,
    every: Duration,
}

impl Progress {
    /// Starts reporting `task` over `total` `unit`s (a bar on a terminal, lines otherwise).
    pub fn new(task: &'static str, unit: &'static str, total: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            let template = if unit == "bytes" {
                "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}"
            } else {
                "{msg} [{bar:40}] {pos}/{len} {per_sec} eta {eta}"
            };
            if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(task);
            bar
        });
        Self {
            task,
            unit,
            total,
            done: AtomicU64::new(0),
            bar,
            last_line: Mutex::new(Instant::now()),
            every: interval(),
        }
    }

    /// Sets the units done (a task that knows its position, e.g. bytes of a resumed download).
    pub fn set(&self, done: u64) {
        let before = self.done.swap(done, Ordering::Relaxed);
        match &self.bar {
            Some(bar) => bar.set_position(done),
            None => self.maybe_line(done.max(before)),
        }
    }

    /// Units done so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Adds `n` units done; logs a line when the interval has passed (no terminal).
    pub fn inc(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        match &self.bar {
            Some(bar) => bar.inc(n),
            None => self.maybe_line(done),
        }
    }

    fn maybe_line(&self, done: u64) {
        let mut last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() >= self.every {
            *last = Instant::now();
            self.line(done);
        }
    }

    fn line(&self, done: u64) {
        let percent = if self.total == 0 {
            100.0
        } else {
            (done as f64 * 1000.0 / self.total as f64).round() / 10.0
        };
        tracing::info!(
            task = self.task,
            unit = self.unit,
            done,
            total = self.total,
            percent,
            "progress"
        );
    }

    /// Ends the report: clears the bar, or logs the last line.
    pub fn finish(&self) {
        match &self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => self.line(self.done()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counted whatever the output: the bar and the lines read the same count.
    #[test]
    fn counts_what_is_done() {
        let p = Progress::new("t", "tensors", 10);
        p.inc(3);
        p.inc(4);
        assert_eq!(p.done(), 7);
        p.finish();
    }
}
