//! Writes one output shard, streaming.
//!
//! The output keeps the base shard's tensors in the base's order. Tensors the merge does not
//! touch are copied file to file by the kernel (`copy_file_range`, as `cp` does: no pass
//! through this process's memory). Changed tensors are computed block of rows by block of rows
//! — decode to f32, add the LoRA update, encode — in parallel, and each block is written as
//! soon as it is ready; the input pages of a finished block are dropped from the mapping. So
//! resident memory is a few blocks plus the adapter, whatever the size of a tensor or a shard.

use std::cmp::Reverse;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use rayon::prelude::*;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

use std::sync::mpsc::{Receiver, SyncSender};

use super::tensors::{is_float, merge_rows, Delta, MappedAdapter, Plan, Raw};
use super::{io_err, MergeError, MergeOptions};

/// Output bytes computed and handed to the writer at a time.
const BLOCK_BYTES: usize = 4 << 20;
/// Computed blocks that may wait for the writer: enough for the computation to run on while
/// the writer copies a large unchanged tensor.
const QUEUE_BLOCKS: usize = 8;
/// Output bytes per parallel task.
const TASK_BYTES: usize = 256 << 10;
/// Bytes per write(2). Large writes make the page cache allocate large folios, which on a VM
/// whose free memory was handed back to the host can cost several times the copy itself
/// (measured on the 2-CPU dev VM, 1 GiB written with dd: 0.2 to 2.5 s in 1 or 4 MiB writes,
/// 0.17 to 0.19 s every time in 256 KiB writes).
const WRITE_BYTES: usize = 256 << 10;
/// Written bytes between two background flushes of a durable output.
const SYNC_EVERY: u64 = 64 << 20;
/// Consumed input bytes between two drops of their pages from the mapping.
const DROP_EVERY: usize = 32 << 20;
/// Granularity of dropping consumed input pages (a multiple of every page size in use).
const DROP_ALIGN: usize = 1 << 16;

/// What a written shard holds.
pub(crate) struct ShardOutput {
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
}

impl Item<'_> {
    fn passthrough(&self) -> bool {
        self.replacement.is_none() && self.delta.is_none() && self.out == self.info.dtype
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
pub(crate) fn write_shard(
    shard: &Path,
    dest: &Path,
    plan: &Plan<'_>,
    adapter: &MappedAdapter,
    opts: &MergeOptions,
) -> Result<(ShardOutput, File), MergeError> {
    let file = File::open(shard).map_err(io_err(shard))?;
    // SAFETY: base shards are read-only inputs; nothing in this process writes to them while
    // the mapping lives.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(shard))?;
    let _ = map.advise(memmap2::Advice::Sequential);
    let (header_len, meta) =
        safetensors::SafeTensors::read_metadata(&map).map_err(st_err(shard))?;
    let data_start = 8 + header_len;

    let mut items = Vec::new();
    let mut params = 0u64;
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("listed by the header").clone();
        params += info.shape.iter().product::<usize>() as u64;
        let out = match opts.dtype {
            Some(d) if is_float(info.dtype) => d.safetensors(),
            _ => info.dtype,
        };
        let item = Item {
            replacement: plan.replacements.get(&name).copied(),
            delta: plan.deltas.get(&name),
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

    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(items.len());
    for it in &items {
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
    let data_bytes = offset as u64;
    let out_meta = Metadata::new(meta.metadata().clone(), infos).map_err(st_err(dest))?;
    let mut header = serde_json::to_vec(&out_meta).expect("metadata serializes");
    header.resize(header.len().next_multiple_of(8), b' ');

    let mut out = File::create(dest).map_err(io_err(dest))?;
    out.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&header))
        .map_err(io_err(dest))?;

    // This thread (with the rayon pool) computes; a writer thread owns the output file and
    // writes blocks, or copies runs of unchanged tensors, in order, while the next block is
    // being computed. Written blocks come back for reuse. When the output is to be durable, a
    // syncer thread flushes what is written every SYNC_EVERY bytes, so the disk works while
    // the merge computes and the last fdatasync has little left to wait for.
    let syncing = if super::durable() {
        Some(out.try_clone().map_err(io_err(dest))?)
    } else {
        None
    };
    let (out, synced, produced) = std::thread::scope(|sc| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(QUEUE_BLOCKS);
        let (back_tx, back_rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let (sync_tx, sync_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let syncer = sc.spawn(move || -> std::io::Result<()> {
            if let Some(f) = syncing {
                for () in sync_rx {
                    f.sync_data()?;
                }
            }
            Ok(())
        });
        let src_file = &file;
        let writer = sc.spawn(move || -> std::io::Result<File> {
            let mut unsynced = 0u64;
            for job in rx {
                match job {
                    Job::Bytes(b) => {
                        for piece in b.chunks(WRITE_BYTES) {
                            out.write_all(piece)?;
                        }
                        unsynced += b.len() as u64;
                        let _ = back_tx.send(b);
                    }
                    Job::Copy(off, len) => {
                        copy_range(src_file, &mut out, off, len)?;
                        unsynced += len;
                    }
                }
                if unsynced >= SYNC_EVERY {
                    // A flush already pending covers these bytes too.
                    let _ = sync_tx.try_send(());
                    unsynced = 0;
                }
            }
            Ok(out)
        });
        let (items, map) = (&items, &map);
        // The closure owns the sending end: the writer's loop ends when it returns.
        let produced = compute_pool()
            .install(move || produce(items, data_start, map, adapter, opts, &tx, &back_rx));
        let out = writer.join().expect("the writer thread does not panic");
        let synced = syncer.join().expect("the syncer thread does not panic");
        (out, synced, produced)
    });
    let out = synced.and(out);
    match (produced, out) {
        (Err(Failure::Merge(e)), _) => Err(e),
        (_, Err(e)) => Err(MergeError::Io {
            path: dest.display().to_string(),
            source: e,
        }),
        (Err(Failure::WriterGone), Ok(_)) => unreachable!("the writer only stops on an error"),
        (Ok(()), Ok(out)) => Ok((ShardOutput { params, data_bytes }, out)),
    }
}

/// Threads that compute changed tensors: one CPU fewer than the machine has (at least one),
/// because writing the output (the page-cache copy and the filesystem's bookkeeping) costs as
/// much CPU as computing it and gets a CPU of its own.
fn compute_pool() -> &'static rayon::ThreadPool {
    static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.saturating_sub(1).max(1))
            .thread_name(|i| format!("merge-compute-{i}"))
            .build()
            .expect("a thread pool starts")
    })
}

/// Work for the writer thread.
enum Job {
    /// Append these bytes.
    Bytes(Vec<u8>),
    /// Append bytes `off..off + len` of the input shard.
    Copy(u64, u64),
}

enum Failure {
    Merge(MergeError),
    /// The writer thread stopped (on an I/O error, which it reports).
    WriterGone,
}

/// Sends the writer thread the whole data section of the output shard.
fn produce(
    items: &[Item<'_>],
    data_start: usize,
    map: &memmap2::Mmap,
    adapter: &MappedAdapter,
    opts: &MergeOptions,
    tx: &SyncSender<Job>,
    back: &Receiver<Vec<u8>>,
) -> Result<(), Failure> {
    let send = |job: Job| tx.send(job).map_err(|_| Failure::WriterGone);
    // Unchanged tensors that follow each other in the input are copied in one call.
    let mut run: Option<(u64, u64)> = None;
    for it in items {
        let (s, e) = it.info.data_offsets;
        let (s, e) = (data_start + s, data_start + e);
        if it.passthrough() {
            run = match run {
                Some((start, len)) if start + len == s as u64 => {
                    Some((start, len + (e - s) as u64))
                }
                Some((start, len)) => {
                    send(Job::Copy(start, len))?;
                    Some((s as u64, (e - s) as u64))
                }
                None => Some((s as u64, (e - s) as u64)),
            };
            continue;
        }
        if let Some((start, len)) = run.take() {
            send(Job::Copy(start, len))?;
        }
        let (src_dtype, src): (Dtype, &[u8]) = match it.replacement {
            Some(r) => (r.dtype, adapter.raw_bytes(r)),
            None => (it.info.dtype, &map[s..e]),
        };
        let shape = &it.info.shape;
        let numel: usize = shape.iter().product();
        if numel == 0 {
            continue;
        }
        // A 2-D (or higher) tensor is rows of its first dimension; a 1-D tensor is one row.
        let rows = if shape.len() >= 2 { shape[0] } else { 1 };
        let cols = numel / rows;
        let (in_size, out_size) = (src_dtype.bitsize() / 8, it.out.bitsize() / 8);
        let prepared = it.delta.map(|d| d.prepare(adapter));
        let rows_per_block = (BLOCK_BYTES / (cols * out_size)).max(1);
        let rows_per_task = (TASK_BYTES / (cols * out_size)).max(1);
        let mut r0 = 0;
        let mut dropped = s;
        while r0 < rows {
            let r1 = rows.min(r0 + rows_per_block);
            let mut block = back.try_recv().unwrap_or_default();
            block.resize((r1 - r0) * cols * out_size, 0);
            let finite = block
                .par_chunks_mut(rows_per_task * cols * out_size)
                .enumerate()
                .map(|(i, dst)| {
                    let t0 = r0 + i * rows_per_task;
                    let n = dst.len() / (cols * out_size);
                    let src = &src[t0 * cols * in_size..(t0 + n) * cols * in_size];
                    merge_rows(src_dtype, src, it.out, dst, t0, cols, prepared.as_ref())
                })
                .reduce(|| true, |a, b| a && b);
            if let (Some(d), true, false) = (it.delta, opts.safe_merge, finite) {
                return Err(Failure::Merge(MergeError::NonFinite {
                    module: d.module().to_string(),
                }));
            }
            send(Job::Bytes(block))?;
            // Consumed input pages leave the mapping in large steps: each drop makes the
            // kernel interrupt the other threads to flush their TLBs.
            let consumed = s + r1 * cols * in_size;
            if it.replacement.is_none() && (consumed - dropped >= DROP_EVERY || r1 == rows) {
                drop_pages(map, dropped, consumed);
                dropped = consumed;
            }
            r0 = r1;
        }
    }
    if let Some((start, len)) = run.take() {
        send(Job::Copy(start, len))?;
    }
    Ok(())
}

/// Appends bytes `off..off + len` of `src` to `dst`; `std::io::copy` between files is
/// `copy_file_range` on Linux, an in-kernel copy like `cp`'s.
fn copy_range(src: &File, dst: &mut File, off: u64, len: u64) -> std::io::Result<()> {
    let mut s = src;
    s.seek(SeekFrom::Start(off))?;
    let n = std::io::copy(&mut s.take(len), dst)?;
    if n != len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("copied {n} of {len} bytes: the base shard is shorter than its header says"),
        ));
    }
    Ok(())
}

/// Drops the pages of `map[a..b]` (whole aligned pages inside it) from this process's
/// resident memory; they stay in the page cache.
fn drop_pages(map: &memmap2::Mmap, a: usize, b: usize) {
    // The partly consumed page at `b` is dropped with the next block.
    let start = a / DROP_ALIGN * DROP_ALIGN;
    let end = b / DROP_ALIGN * DROP_ALIGN;
    if end > start {
        // SAFETY: the mapping is a read-only shared file mapping: MADV_DONTNEED only unmaps
        // the pages, a later read faults them back in from the file, and no reference into
        // the range outlives this call's caller's use of it (the block was written).
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
    }
}
