//! Helpers shared by the integration tests.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Writes `bytes` into the FIFO `fifo` once a reader has it open — the way tests hold an
/// adapter load mid-read and release it. The open is non-blocking and retried while
/// `reader_alive()` and for 20 s at most, so a reader that failed early cannot hang a test.
pub fn feed_fifo(fifo: &Path, bytes: &[u8], reader_alive: impl Fn() -> bool) {
    const O_NONBLOCK: i32 = 0o4000;
    let t = Instant::now();
    let mut w = loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(O_NONBLOCK)
            .open(fifo)
        {
            Ok(w) => break w,
            Err(_) if reader_alive() && t.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(err) => panic!("nothing opened {} for reading: {err}", fifo.display()),
        }
    };
    std::io::Write::write_all(&mut w, bytes).unwrap();
}
