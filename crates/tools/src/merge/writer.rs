//! Writes one output shard, streaming.
//!
//! The output keeps the base shard's tensors in the base's order. Its data section is cut into
//! tasks: copies of runs of unchanged tensors (`copy_file_range`, in the kernel, as `cp` does)
//! and blocks of rows of changed tensors (decode to f32, add the LoRA update, encode). Every
//! CPU runs tasks, a window of them at a time, and writes each block at its own offset
//! (`pwrite`) while the block is still in its cache. A file takes one write at a time, so a
//! thread that finds another writing queues its block and computes on; whoever writes drains
//! the queue. After each window the input pages it consumed are dropped from the mapping. So
//! resident memory is a window of input, a bounded queue of blocks and the adapter, whatever
//! the size of a tensor or a shard.

use std::cmp::Reverse;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use super::quantized_base::QuantBase;
use super::tensors::{merge_rows, Delta, Plan, Prepared};
use super::{io_err, MergeError, MergeOptions};
use mole_formats::peft::weights::{MappedAdapter, Raw};
use mole_formats::quant::blocks::Packed;
use mole_formats::safetensors::is_float;

/// Output bytes per task (a block of rows): small enough that the computed block is still in
/// the computing CPU's own cache when that CPU writes it. Writes of this size also keep the page
/// cache from allocating large folios, which on a VM whose free memory was handed back to the
/// host can cost several times the copy itself (measured on the 2-CPU dev VM, 1 GiB written
/// with dd: 0.2 to 2.5 s in 1 or 4 MiB writes, 0.17 to 0.19 s every time in 256 KiB writes).
const TASK_BYTES: usize = 256 << 10;
/// Bytes of unchanged tensors per copy task: small enough that no thread holds the file's
/// write lock long while the others wait to write what they computed.
const COPY_BYTES: u64 = 1 << 20;
/// Output bytes per window: the tasks of a window run in parallel, then the input pages they
/// consumed leave the mapping, so resident input stays about one window.
const WINDOW_BYTES: u64 = 32 << 20;
/// Computed blocks that may wait for the writer before the thread that computed one more waits
/// for the writer role instead of computing on.
const QUEUE_BLOCKS: usize = 16;
/// Written bytes between two background flushes of a durable output.
const SYNC_EVERY: u64 = 64 << 20;
/// Granularity of dropping consumed input pages (a multiple of every page size in use).
const DROP_ALIGN: usize = 1 << 16;

/// What a written shard holds.
pub struct ShardOutput {
    /// Parameters (elements) in the shard.
    pub params: u64,
    /// Bytes of tensor data (the index's `total_size` sums them).
    pub data_bytes: u64,
}

/// One tensor of the output shard.
struct Item<'p> {
    name: String,
    info: TensorInfo,
    out: Dtype,
    replacement: Option<&'p Raw>,
    delta: Option<&'p Delta<'p>>,
    /// A packed module of a quantized base, dequantized row by row (see `merge::quantized_base`).
    dequant: Option<&'p Packed<'p>>,
}

impl Item<'_> {
    fn passthrough(&self) -> bool {
        self.replacement.is_none()
            && self.delta.is_none()
            && self.dequant.is_none()
            && self.out == self.info.dtype
    }
}

fn st_err(path: &Path) -> impl FnOnce(safetensors::SafeTensorError) -> MergeError + '_ {
    move |e| MergeError::Safetensors {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Merges the tensors of base shard `shard` into the new file `dest`. Returns the file, written
/// but not yet synced (the caller syncs it while the next shard is computed).
pub fn write_shard(
    shard: &Path,
    dest: &Path,
    plan: &Plan<'_>,
    quant: &QuantBase<'_>,
    adapter: &MappedAdapter,
    opts: &MergeOptions,
    progress: &crate::progress::Progress,
) -> Result<(ShardOutput, File), MergeError> {
    let file = File::open(shard).map_err(io_err(shard))?;
    let map = mole_formats::safetensors::map_file(&file).map_err(io_err(shard))?;
    let _ = map.advise(memmap2::Advice::Sequential);
    let (header_len, meta) =
        safetensors::SafeTensors::read_metadata(&map).map_err(st_err(shard))?;
    let data_start = 8 + header_len;

    let (items, params) = shard_items(&meta, plan, quant, opts)?;
    let (out, out_base, data_bytes) = create_output(dest, &meta, &items)?;

    let tasks = plan_tasks(&items, data_start);
    let windows = windows(&tasks);
    // When the output is to be durable, a syncer thread flushes what is written every
    // SYNC_EVERY bytes, so the disk works while the merge computes and the last fdatasync has
    // little left to wait for.
    let syncing = if super::durable() {
        Some(out.try_clone().map_err(io_err(dest))?)
    } else {
        None
    };
    let io = |e: std::io::Error| MergeError::Io {
        path: dest.display().to_string(),
        source: e,
    };
    std::thread::scope(|sc| -> Result<(), MergeError> {
        let (sync_tx, sync_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let syncer = sc.spawn(move || -> std::io::Result<()> {
            if let Some(f) = syncing {
                for () in sync_rx {
                    f.sync_data()?;
                }
            }
            Ok(())
        });
        let mut prepared: HashMap<usize, Prepared> = HashMap::new();
        let outbox = Outbox::new(&file, &out, dest);
        let mut unsynced = 0u64;
        let mut consumed: Option<(usize, usize)> = None;
        let done = (|| -> Result<(), MergeError> {
            for window in windows {
                // The adapter tensors of the tensors this window touches, as f32 (a tensor
                // that spans windows keeps its own).
                let mut wanted: Vec<usize> = window
                    .iter()
                    .filter_map(|t| match t.piece {
                        Piece::Rows { item, .. } => Some(item),
                        Piece::Copy { .. } => None,
                    })
                    .collect();
                // Tasks of a tensor are consecutive.
                wanted.dedup();
                prepared.retain(|i, _| wanted.contains(i));
                for &i in &wanted {
                    if let Some(d) = items[i].delta {
                        prepared.entry(i).or_insert_with(|| d.prepare(adapter));
                    }
                }
                let ctx = Ctx {
                    items: &items,
                    map: &map,
                    outbox: &outbox,
                    data_start,
                    out_base,
                    adapter,
                    prepared: &prepared,
                    safe_merge: opts.safe_merge,
                };
                // The input pages the previous window consumed leave the mapping while this
                // window computes (one drop per window: each makes the kernel interrupt the
                // other threads to flush their TLBs).
                let drop = consumed.take();
                compute_pool().install(|| {
                    let ((), done) = rayon::join(
                        || drop.map_or((), |(a, b)| drop_pages(&map, a, b)),
                        || {
                            window
                                .par_iter()
                                .with_max_len(1)
                                .try_for_each(|task| ctx.run(task))
                        },
                    );
                    done
                })?;
                let span = window
                    .iter()
                    .filter_map(|t| t.mapped_input(&items, data_start));
                consumed = span.reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
                let written = window.iter().map(|t| t.len).sum::<u64>();
                progress.inc(written);
                unsynced += written;
                if unsynced >= SYNC_EVERY {
                    // A flush already pending covers these bytes too.
                    let _ = sync_tx.try_send(());
                    unsynced = 0;
                }
            }
            // Blocks still queued carry over from window to window (they hold no input
            // pages); the last ones are written here.
            outbox.flush()
        })();
        drop(sync_tx);
        let synced = syncer.join().expect("the syncer thread does not panic");
        done?;
        synced.map_err(io)
    })?;
    Ok((ShardOutput { params, data_bytes }, out))
}

/// The output's tensors, in the order they are written, and the shard's parameter count.
fn shard_items<'p>(
    meta: &Metadata,
    plan: &'p Plan<'p>,
    quant: &'p QuantBase<'p>,
    opts: &MergeOptions,
) -> Result<(Vec<Item<'p>>, u64), MergeError> {
    let mut items = Vec::new();
    let mut params = 0u64;
    for name in meta.offset_keys() {
        let mut info = meta.info(&name).expect("listed by the header").clone();
        // A touched packed module: its dense weight takes its qweight's place, the other
        // parts leave.
        let (name, dequant) = match quant.replaces.get(&name) {
            Some(dense) => {
                let p = &quant.touched[dense];
                info = TensorInfo {
                    dtype: meta
                        .info(&format!("{}.scales", dense.trim_end_matches(".weight")))
                        .map_or(Dtype::F16, |s| s.dtype),
                    shape: p.shape().to_vec(),
                    data_offsets: info.data_offsets,
                };
                (dense.clone(), Some(p))
            }
            None if quant.dropped.contains(&name) => continue,
            None => (name, None),
        };
        params += info.shape.iter().product::<usize>() as u64;
        let out = match opts.dtype {
            Some(d) if is_float(info.dtype) && !quant.kept.contains(&name) => d.safetensors(),
            _ => info.dtype,
        };
        let item = Item {
            replacement: plan.replacements.get(&name).copied(),
            delta: plan.deltas.get(&name),
            dequant,
            name,
            info,
            out,
        };
        if !item.passthrough() && !is_float(item.info.dtype) {
            return Err(MergeError::Unsupported(format!(
                "{}: cannot merge into a {:?} tensor",
                item.name, item.info.dtype
            )));
        }
        items.push(item);
    }
    // As safetensors writes them: larger alignments first, so every tensor stays aligned
    // (a no-op unless --dtype changes some sizes); otherwise the base's order.
    items.sort_by_key(|it| (Reverse(it.out), it.info.data_offsets.0));
    Ok((items, params))
}

/// Creates `dest` with the header of `items`; returns it, where its data starts and the
/// data's length.
fn create_output(
    dest: &Path,
    meta: &Metadata,
    items: &[Item<'_>],
) -> Result<(File, u64, u64), MergeError> {
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(items.len());
    for it in items {
        let len = it.info.shape.iter().product::<usize>() * it.out.bitsize() / 8;
        infos.push((
            it.name.clone(),
            TensorInfo {
                dtype: it.out,
                shape: it.info.shape.clone(),
                data_offsets: (offset, offset + len),
            },
        ));
        offset += len;
    }
    let out_meta = Metadata::new(meta.metadata().clone(), infos).map_err(st_err(dest))?;
    let mut header = serde_json::to_vec(&out_meta).expect("metadata serializes");
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut out = File::create(dest).map_err(io_err(dest))?;
    out.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&header))
        .map_err(io_err(dest))?;
    Ok((out, 8 + header.len() as u64, offset as u64))
}

/// Threads that compute and write the output: every CPU (writing costs as much CPU as
/// computing, and whichever thread is free does it).
fn compute_pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("merge-{i}"))
            .build()
            .expect("a thread pool starts")
    })
}

/// One piece of the output's data section, at byte `dst` of it.
struct Task {
    dst: u64,
    len: u64,
    piece: Piece,
}

enum Piece {
    /// Bytes at `src` of the input shard, unchanged.
    Copy { src: u64 },
    /// Rows `r0..r1` of changed tensor `items[item]`.
    Rows { item: usize, r0: usize, r1: usize },
}

impl Task {
    /// The bytes of the input mapping this task reads, if it reads the mapping.
    fn mapped_input(&self, items: &[Item<'_>], data_start: usize) -> Option<(usize, usize)> {
        let Piece::Rows { item, r0, r1 } = self.piece else {
            return None;
        };
        let it = &items[item];
        if it.replacement.is_some() || it.dequant.is_some() {
            return None;
        }
        let row = it.cols() * it.info.dtype.bitsize() / 8;
        let s = data_start + it.info.data_offsets.0;
        Some((s + r0 * row, s + r1 * row))
    }
}

impl Item<'_> {
    /// Values per row: a 2-D (or higher) tensor is rows of its first dimension; a 1-D tensor
    /// is one row.
    fn rows(&self) -> usize {
        match self.info.shape.as_slice() {
            [r, _, ..] => *r,
            _ => 1,
        }
    }

    fn cols(&self) -> usize {
        self.info.shape.iter().product::<usize>() / self.rows().max(1)
    }
}

/// Splits the output's data section into tasks, in output order: runs of unchanged tensors
/// that follow each other in the input become copies of at most COPY_BYTES each, changed
/// tensors become blocks of rows of about TASK_BYTES of output.
fn plan_tasks(items: &[Item<'_>], data_start: usize) -> Vec<Task> {
    let mut tasks = Vec::new();
    let mut dst = 0u64;
    let mut run: Option<(u64, u64, u64)> = None; // (src, dst, len)
    let flush = |tasks: &mut Vec<Task>, run: &mut Option<(u64, u64, u64)>| {
        if let Some((src, dst, len)) = run.take() {
            let mut off = 0;
            while off < len {
                let n = (len - off).min(COPY_BYTES);
                tasks.push(Task {
                    dst: dst + off,
                    len: n,
                    piece: Piece::Copy { src: src + off },
                });
                off += n;
            }
        }
    };
    for (i, it) in items.iter().enumerate() {
        let (s, e) = it.info.data_offsets;
        let src = (data_start + s) as u64;
        let in_len = (e - s) as u64;
        if it.passthrough() {
            match &mut run {
                Some((rs, _, rl)) if *rs + *rl == src => *rl += in_len,
                _ => {
                    flush(&mut tasks, &mut run);
                    run = Some((src, dst, in_len));
                }
            }
            dst += in_len;
            continue;
        }
        flush(&mut tasks, &mut run);
        let (rows, cols) = (it.rows(), it.cols());
        if it.info.shape.iter().product::<usize>() == 0 {
            continue;
        }
        let row_bytes = (cols * it.out.bitsize() / 8) as u64;
        let per_task = (TASK_BYTES / row_bytes as usize).max(1);
        let mut r0 = 0;
        while r0 < rows {
            let r1 = rows.min(r0 + per_task);
            tasks.push(Task {
                dst,
                len: (r1 - r0) as u64 * row_bytes,
                piece: Piece::Rows { item: i, r0, r1 },
            });
            dst += (r1 - r0) as u64 * row_bytes;
            r0 = r1;
        }
    }
    flush(&mut tasks, &mut run);
    tasks
}

/// Consecutive tasks of about WINDOW_BYTES of output each.
fn windows(tasks: &[Task]) -> Vec<&[Task]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, t) in tasks.iter().enumerate() {
        bytes += t.len;
        if bytes >= WINDOW_BYTES {
            out.push(&tasks[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < tasks.len() {
        out.push(&tasks[start..]);
    }
    out
}

/// What every task of a shard shares.
struct Ctx<'a, 'p> {
    items: &'a [Item<'p>],
    map: &'a memmap2::Mmap,
    outbox: &'a Outbox<'a>,
    data_start: usize,
    out_base: u64,
    adapter: &'a MappedAdapter,
    prepared: &'a HashMap<usize, Prepared>,
    safe_merge: bool,
}

impl Ctx<'_, '_> {
    fn run(&self, task: &Task) -> Result<(), MergeError> {
        let at = self.out_base + task.dst;
        match task.piece {
            Piece::Copy { src } => self.outbox.submit(Write::Copy {
                src,
                dst: at,
                len: task.len,
            }),
            Piece::Rows { item, r0, r1 } => {
                let it = &self.items[item];
                let cols = it.cols();
                let dequantized;
                let (src_dtype, src): (Dtype, &[u8]) = match (it.replacement, it.dequant) {
                    (Some(r), _) => {
                        let row = cols * r.dtype.bitsize() / 8;
                        (r.dtype, &self.adapter.raw_bytes(r)[r0 * row..r1 * row])
                    }
                    (None, Some(p)) => {
                        let mut w = vec![0f32; (r1 - r0) * cols];
                        p.dequantize_rows(r0, &mut w);
                        dequantized = w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
                        (Dtype::F32, &dequantized)
                    }
                    (None, None) => {
                        let (s, _) = it.info.data_offsets;
                        let row = cols * it.info.dtype.bitsize() / 8;
                        let at = self.data_start + s;
                        (it.info.dtype, &self.map[at + r0 * row..at + r1 * row])
                    }
                };
                let mut buf = self.outbox.buffer();
                buf.resize(task.len as usize, 0);
                let finite = merge_rows(
                    src_dtype,
                    src,
                    it.out,
                    &mut buf,
                    r0,
                    cols,
                    self.prepared.get(&item),
                );
                if let (Some(d), true, false) = (it.delta, self.safe_merge, finite) {
                    return Err(MergeError::NonFinite {
                        module: d.module().to_string(),
                    });
                }
                self.outbox.submit(Write::Bytes { dst: at, buf })
            }
        }
    }
}

/// A write to the output shard.
enum Write {
    /// `buf` at byte `dst`.
    Bytes { dst: u64, buf: Vec<u8> },
    /// Bytes `src..src + len` of the input shard at byte `dst`.
    Copy { src: u64, dst: u64, len: u64 },
}

/// Where computing threads hand their writes. The filesystem lets one write into a file at a
/// time; a thread that finds another writing queues its block and computes on, instead of
/// spinning on the file's lock, and whichever thread holds the writer role writes every queued
/// block, its own (still in its cache) first.
struct Outbox<'a> {
    src: &'a File,
    out: &'a File,
    path: &'a Path,
    queue: Mutex<Vec<Write>>,
    writer: Mutex<()>,
    free: Mutex<Vec<Vec<u8>>>,
}

impl<'a> Outbox<'a> {
    fn new(src: &'a File, out: &'a File, path: &'a Path) -> Self {
        Outbox {
            src,
            out,
            path,
            queue: Mutex::new(Vec::new()),
            writer: Mutex::new(()),
            free: Mutex::new(Vec::new()),
        }
    }

    /// A block buffer (a written one, when there is one).
    fn buffer(&self) -> Vec<u8> {
        lock(&self.free).pop().unwrap_or_default()
    }

    /// Queues `w`; writes the queue if no other thread is writing, or if the queue is full
    /// (then after waiting for the writer role: the bound on memory).
    fn submit(&self, w: Write) -> Result<(), MergeError> {
        let queued = {
            let mut q = lock(&self.queue);
            q.push(w);
            q.len()
        };
        let role = if queued > QUEUE_BLOCKS {
            Some(lock(&self.writer))
        } else {
            self.writer.try_lock().ok()
        };
        match role {
            Some(role) => self.drain(role),
            None => Ok(()),
        }
    }

    /// Writes everything queued (waiting for the writer role).
    fn flush(&self) -> Result<(), MergeError> {
        self.drain(lock(&self.writer))
    }

    fn drain<'s>(&'s self, mut role: MutexGuard<'s, ()>) -> Result<(), MergeError> {
        loop {
            loop {
                // Newest first: the caller's own block, still in its cache. (The queue is
                // locked only to take the block, not while writing it.)
                let next = lock(&self.queue).pop();
                match next {
                    Some(w) => self.write(w)?,
                    None => break,
                }
            }
            drop(role);
            // A block queued after the last look but before the role was given up would
            // wait for the next writer: take the role back for it if no one else did.
            if lock(&self.queue).is_empty() {
                return Ok(());
            }
            match self.writer.try_lock() {
                Ok(r) => role = r,
                Err(_) => return Ok(()),
            }
        }
    }

    fn write(&self, w: Write) -> Result<(), MergeError> {
        let (dst, done) = match w {
            Write::Bytes { dst, buf } => {
                let done = self.out.write_all_at(&buf, dst);
                lock(&self.free).push(buf);
                (dst, done)
            }
            Write::Copy { src, dst, len } => (dst, copy_at(self.src, src, self.out, dst, len)),
        };
        done.map_err(|e| MergeError::Io {
            path: format!("{} (at byte {dst})", self.path.display()),
            source: e,
        })
    }
}

/// Locks `m`; a thread that panicked while holding it cannot have left the queues in a state
/// worse than incomplete, and the panic itself fails the merge.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Copies bytes `src_off..src_off + len` of `src` to `dst_off` of `dst`: in the kernel with
/// `copy_file_range` (as `cp` does, no pass through this process's memory), or through a
/// buffer where the filesystems cannot.
fn copy_at(src: &File, src_off: u64, dst: &File, dst_off: u64, len: u64) -> std::io::Result<()> {
    let short = |n: u64| {
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("copied {n} of {len} bytes: the base shard is shorter than its header says"),
        )
    };
    let mut done = 0u64;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        while done < len {
            let (mut si, mut di) = ((src_off + done) as i64, (dst_off + done) as i64);
            // SAFETY: both descriptors are open for the call; the offsets are this call's own.
            let n = unsafe {
                libc::copy_file_range(
                    src.as_raw_fd(),
                    &mut si,
                    dst.as_raw_fd(),
                    &mut di,
                    (len - done) as usize,
                    0,
                )
            };
            match n {
                0 => return Err(short(done)),
                n if n > 0 => done += n as u64,
                _ => {
                    let e = std::io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EINTR) => {}
                        Some(
                            libc::EXDEV
                            | libc::EINVAL
                            | libc::ENOSYS
                            | libc::EOPNOTSUPP
                            | libc::EPERM,
                        ) => break,
                        _ => return Err(e),
                    }
                }
            }
        }
    }
    let mut buf = vec![0u8; (len - done).min(TASK_BYTES as u64) as usize];
    while done < len {
        let want = buf.len().min((len - done) as usize);
        let n = src.read_at(&mut buf[..want], src_off + done)?;
        if n == 0 {
            return Err(short(done));
        }
        dst.write_all_at(&buf[..n], dst_off + done)?;
        done += n as u64;
    }
    Ok(())
}

/// Drops the pages of `map[a..b]` (whole aligned pages inside it) from this process's
/// resident memory; they stay in the page cache.
fn drop_pages(map: &memmap2::Mmap, a: usize, b: usize) {
    // The partly consumed page at `b` is dropped with the next window.
    let start = a / DROP_ALIGN * DROP_ALIGN;
    let end = b / DROP_ALIGN * DROP_ALIGN;
    if end > start {
        // SAFETY: the mapping is a read-only shared file mapping: MADV_DONTNEED only unmaps
        // the pages, and a read of them, then or later (another thread may be reading a page
        // at the edge), faults the same bytes back in from the file; nothing writes to it.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(name: &str, dtype: Dtype, shape: Vec<usize>, at: usize, changed: bool) -> Item<'_> {
        let len = shape.iter().product::<usize>() * dtype.bitsize() / 8;
        Item {
            name: name.into(),
            info: TensorInfo {
                dtype,
                shape,
                data_offsets: (at, at + len),
            },
            // A changed tensor here is one whose dtype the output changes: the plan needs no
            // adapter to mark it.
            out: if changed { Dtype::F32 } else { dtype },
            replacement: None,
            delta: None,
            dequant: None,
        }
    }

    #[test]
    fn tasks_tile_the_output_in_order_and_windows_partition_them() {
        let big = 3 * COPY_BYTES as usize / 2;
        let items = vec![
            item("a", Dtype::BF16, vec![big / 2], 0, false),
            item("b", Dtype::BF16, vec![16], big, false),
            item("c", Dtype::BF16, vec![1000, 700], big + 32, true),
            item("d", Dtype::BF16, vec![0, 8], big + 32 + 1_400_000, true),
            item("e", Dtype::BF16, vec![5], big + 32 + 1_400_000, false),
        ];
        let tasks = plan_tasks(&items, 100);
        let mut at = 0;
        for t in &tasks {
            assert_eq!(t.dst, at, "no gap, no overlap");
            at += t.len;
            match t.piece {
                Piece::Copy { src } => {
                    assert!(t.len <= COPY_BYTES);
                    // Output and input offsets of unchanged bytes line up before the first
                    // changed tensor (same sizes up to there).
                    if t.dst < big as u64 + 32 {
                        assert_eq!(src, 100 + t.dst);
                    }
                }
                Piece::Rows { item, r0, r1 } => {
                    assert_eq!(item, 2);
                    assert_eq!(t.len, ((r1 - r0) * 700 * 4) as u64);
                    assert!(t.len as usize <= TASK_BYTES);
                }
            }
        }
        // a and b coalesce into one run, cut at COPY_BYTES; c is 1000 rows of 2800 output
        // bytes; d is empty; e is one more copy.
        let copies = tasks
            .iter()
            .filter(|t| matches!(t.piece, Piece::Copy { .. }))
            .count();
        assert_eq!(copies, 3);
        assert_eq!(at, (big + 32 + 1000 * 700 * 4 + 10) as u64);
        let w = windows(&tasks);
        assert_eq!(w.iter().map(|w| w.len()).sum::<usize>(), tasks.len());
        assert!(w.iter().all(|w| !w.is_empty()));
    }

    #[test]
    fn copy_at_copies_between_offsets_and_refuses_a_short_source() {
        let dir = tempfile::tempdir().unwrap();
        let src_path = dir.path().join("src");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&src_path, &data).unwrap();
        let src = File::open(&src_path).unwrap();
        let dst = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("dst"))
            .unwrap();
        copy_at(&src, 1000, &dst, 7, 250_000).unwrap();
        let out = std::fs::read(dir.path().join("dst")).unwrap();
        assert_eq!(out.len(), 250_007);
        assert_eq!(&out[7..], &data[1000..251_000]);
        let e = copy_at(&src, 200_000, &dst, 0, 200_000).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
    }
}
