//! The copies between host and device that a tensor-path step makes, counted.
//!
//! On a GPU every upload is a synchronizing copy through the driver and every download waits
//! for the step to finish, so a step makes exactly one of each: its inputs packed into one
//! buffer ([`upload`], from [`super::step`]) and its tokens (or, on the host path, its logits)
//! read back once ([`download_rows`] / [`download`]). clippy.toml keeps candle's own
//! constructors and readers out of `model/` and `lora/` so that nothing else slips in; the
//! counters below are what `tests/op_count/op_count_transfers.rs` holds to one per step.

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Device, Tensor, WithDType};

/// Integers an f32 holds exactly: every index a step uploads (they travel as f32, see
/// [`super::step`]) is below it.
pub(super) const EXACT_F32: usize = 1 << 24;

static UPLOADS: AtomicUsize = AtomicUsize::new(0);
static DOWNLOADS: AtomicUsize = AtomicUsize::new(0);

/// Host→device and device→host copies made through this module since the process started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Transfers {
    /// Step inputs uploaded ([`upload`]).
    pub uploads: usize,
    /// Step results read back ([`download`], [`download_rows`]).
    pub downloads: usize,
}

impl Transfers {
    /// The counts now, process-wide.
    pub fn now() -> Self {
        Self {
            uploads: UPLOADS.load(Ordering::Relaxed),
            downloads: DOWNLOADS.load(Ordering::Relaxed),
        }
    }

    /// What was counted between `earlier` and `self`.
    pub fn since(self, earlier: Transfers) -> Transfers {
        Transfers {
            uploads: self.uploads - earlier.uploads,
            downloads: self.downloads - earlier.downloads,
        }
    }
}

/// The transfers made while `f` runs (process-wide: meaningful while nothing else copies).
pub fn transfers_made<T>(f: impl FnOnce() -> T) -> (T, Transfers) {
    let before = Transfers::now();
    let out = f();
    (out, Transfers::now().since(before))
}

/// Uploads `data` as one `[len]` tensor: a step's inputs, counted.
#[allow(clippy::disallowed_methods)] // the one upload of a step
pub fn upload<T: WithDType>(data: Vec<T>, device: &Device) -> candle_core::Result<Tensor> {
    UPLOADS.fetch_add(1, Ordering::Relaxed);
    let len = data.len();
    Tensor::from_vec(data, len, device)
}

/// Reads a step's `[rows]` result back: one copy, counted.
#[allow(clippy::disallowed_methods)] // the one download of a step
pub fn download<T: WithDType>(t: &Tensor) -> candle_core::Result<Vec<T>> {
    DOWNLOADS.fetch_add(1, Ordering::Relaxed);
    t.to_vec1()
}

/// Reads a step's `[rows, n]` result back: one copy, counted.
#[allow(clippy::disallowed_methods)] // the one download of a step
pub fn download_rows<T: WithDType>(t: &Tensor) -> candle_core::Result<Vec<Vec<T>>> {
    DOWNLOADS.fetch_add(1, Ordering::Relaxed);
    t.to_vec2()
}
