//! How many tensor ops and host/device copies a step makes. Each count reads a process-wide counter
//! (candle's tensor ids, the transfer counter), so every test here holds [`alone`] while it counts
//! and no other test shares this binary.
//!
//! One test binary for these files (each a module), so the stack below them links once.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

#[path = "../common/mod.rs"]
mod common;

/// Held by every test of this binary while it counts: the counters are process-wide, so
/// tests that run at once would count each other's ops.
pub fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed while holding it poisons it; the next count is still alone.
    ALONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

mod op_count;
mod op_count_bgmv;
mod op_count_quantized;
mod op_count_sampling;
mod op_count_transfers;
