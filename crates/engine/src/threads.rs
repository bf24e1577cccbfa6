//! The process's compute threads, fixed once at start by every binary that runs the engine
//! (`mole-worker`, `mole-bench`), so a benchmark runs the threads a pod serves with.

/// candle asks for its thread count on every matmul and, unless `RAYON_NUM_THREADS` is set,
/// re-reads /proc/cpuinfo each time: a fifth of the decode time of a small model. Fix the count
/// once, before any thread starts (an explicit setting wins).
///
/// candle also runs large elementwise ops (prefill activations) on a pool of its own whose
/// threads spin 25,000 times after each op before parking, on the cores rayon's matmuls are
/// using: in a prefill-bound load test on 2 cores (scripts/load-test.sh, 64 clients), spinning
/// and waiting at its barrier were 13% of the CPU samples, and parking after 100 spins took
/// answers from 13.2-13.7/s to 14.8-15.5/s.
pub fn pin() {
    // First thing in main, before any other thread exists (set_var is not thread-safe).
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "100");
    }
}
