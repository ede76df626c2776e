//! Writing a shard around the page cache (`O_DIRECT`): appended bytes are copied into an aligned
//! staging buffer, which goes to the device in large aligned writes.
//!
//! Why: a packed shard is written once, then made durable, and not read again by the pack. Through
//! the page cache, every byte is first copied into freshly allocated page-cache memory (the
//! dearest part of a pack after another large write on a VM that hands free memory back to its
//! host: bench/PROFILES.md section 2), then written back by the fsync, and the pack of a large tree
//! fills the page cache with shards, evicting what the machine had cached. Around it, the copy into
//! the staging buffer is the only one, into memory reused for every write.
//!
//! The file is opened with `O_DIRECT`; a file system that refuses it at open (`EINVAL`) gets a
//! plain file instead, and one that refuses a direct write has `O_DIRECT` cleared and the write
//! redone: the bytes are the same either way, only the route differs ([`DirectOut::is_direct`]),
//! and either case is a warning, once per pack (`pack` shows warnings by default).
//! Writes are whole multiples of [`ALIGN`] at offsets that are, from a buffer that is: what any
//! Linux file system and device accepts (logical blocks are 512 or 4096 bytes). The tail is padded
//! to [`ALIGN`] and the file cut back to its length when it is finished.

use std::fs::{File, OpenOptions};
use std::io::{Error, ErrorKind, Result};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

/// Alignment of every direct write: its buffer address, file offset and length.
pub const ALIGN: usize = 4096;
/// Stage size: each direct write is this large (the last one of a file excepted).
pub const STAGE: usize = 8 << 20;
/// Stages per file: one being filled while the others are written by the file's writer thread,
/// so the pack's writer copies while the device writes.
const STAGES: usize = 3;

/// An aligned buffer of [`STAGE`] bytes: `raw` is over-allocated by [`ALIGN`] so that
/// `raw[at..at + STAGE]` is aligned.
struct Stage {
    raw: Vec<u8>,
    at: usize,
}

/// Stages of finished files, for the next: a pack of many small shards would otherwise touch
/// fresh memory for every shard's stages (a page fault per 4 KiB, dear where the page cache's
/// fresh memory was: module docs).
static POOL: std::sync::Mutex<Vec<Stage>> = std::sync::Mutex::new(Vec::new());

impl Stage {
    /// A stage from the pool, or a new one.
    fn take() -> Self {
        if let Some(s) = POOL.lock().ok().and_then(|mut p| p.pop()) {
            return s;
        }
        let raw = vec![0u8; STAGE + ALIGN];
        let at = raw.as_ptr().align_offset(ALIGN);
        Self { raw, at }
    }

    /// Returns stages to the pool, which keeps those of two files at most.
    fn give_back(stages: impl IntoIterator<Item = Stage>) {
        if let Ok(mut p) = POOL.lock() {
            for s in stages {
                if p.len() < 2 * STAGES {
                    p.push(s);
                }
            }
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        &mut self.raw[self.at..self.at + STAGE]
    }
}

/// A write for the file's writer thread: `len` bytes of `stage` at `offset`.
struct Job {
    stage: Stage,
    offset: u64,
    len: usize,
}

/// What the writer thread hands back: the stage, and whether its write went direct.
type Done = (Stage, Result<bool>);

/// A file written sequentially around the page cache (see the module docs).
pub struct DirectOut {
    file: File,
    /// The stage being filled, and how many of its bytes are.
    stage: Stage,
    staged: usize,
    /// Stages free to be filled next.
    free: Vec<Stage>,
    /// Bytes handed to the writer thread (written or in flight): a multiple of [`ALIGN`].
    flushed: u64,
    in_flight: usize,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    direct: bool,
    /// For the warning when the file system refuses a direct write.
    path: std::path::PathBuf,
}

impl DirectOut {
    /// Creates (truncates) `path` for writing around the page cache; Ok(None) when its file
    /// system does not take `O_DIRECT`.
    pub fn create(path: &Path) -> Result<Option<Self>> {
        // Readable too: a rollback into written bytes reads their last block back.
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        let file = match opened {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
            Err(e) => return Err(e),
        };
        let theirs = file.try_clone()?;
        let (jobs, their_jobs) = channel::<Job>();
        let (their_done, done) = channel::<Done>();
        let thread = std::thread::Builder::new().name("pack-direct".into()).spawn(move || {
            for job in their_jobs {
                let r = write_direct(&theirs, &job.stage.raw[job.stage.at..job.stage.at + job.len], job.offset);
                if their_done.send((job.stage, r)).is_err() {
                    break;
                }
            }
        })?;
        let free = (1..STAGES).map(|_| Stage::take()).collect();
        Ok(Some(Self {
            file,
            stage: Stage::take(),
            staged: 0,
            free,
            flushed: 0,
            in_flight: 0,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            direct: true,
            path: path.to_owned(),
        }))
    }

    /// Bytes appended so far (written and staged).
    pub fn appended(&self) -> u64 {
        self.flushed + self.staged as u64
    }

    /// False once the file system refused a direct write and the file went through the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    pub fn append(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let staged = self.staged;
            let n = data.len().min(STAGE - staged);
            self.stage.bytes()[staged..staged + n].copy_from_slice(&data[..n]);
            self.staged += n;
            data = &data[n..];
            if self.staged == STAGE {
                self.send_stage(STAGE)?;
            }
        }
        Ok(())
    }

    /// Hands the current stage (its first `len` bytes, a multiple of [`ALIGN`]; `len` >= the
    /// bytes staged) to the writer thread and takes a free one, waiting for one if need be.
    fn send_stage(&mut self, len: usize) -> Result<()> {
        let next = match self.free.pop() {
            Some(s) => s,
            None => self.wait_one()?,
        };
        let stage = std::mem::replace(&mut self.stage, next);
        let jobs = self.jobs.as_ref().ok_or_else(|| Error::other("the direct writer was stopped"))?;
        jobs.send(Job { stage, offset: self.flushed, len })
            .map_err(|_| Error::other("the direct writer thread stopped"))?;
        self.in_flight += 1;
        self.flushed += len as u64;
        self.staged = 0;
        Ok(())
    }

    /// Waits for the oldest write in flight; returns its stage.
    fn wait_one(&mut self) -> Result<Stage> {
        let (stage, r) = self.done.recv().map_err(|_| Error::other("the direct writer thread stopped"))?;
        self.in_flight -= 1;
        if !r? && self.direct {
            self.direct = false;
            note_page_cache_route(&self.path, "refused a direct write");
        }
        Ok(stage)
    }

    /// Waits until every write handed over is done.
    fn wait_all(&mut self) -> Result<()> {
        while self.in_flight > 0 {
            let stage = self.wait_one()?;
            self.free.push(stage);
        }
        Ok(())
    }

    /// Cuts what was appended back to `len` bytes.
    pub fn rollback(&mut self, len: u64) -> Result<()> {
        if len >= self.flushed {
            self.staged = self.staged.min((len - self.flushed) as usize);
            return Ok(());
        }
        // The cut lies in written bytes: the block holding it comes back into the stage, so the
        // next write starts at an aligned offset again.
        self.wait_all()?;
        let block = len - len % ALIGN as u64;
        let at = |what: &str, e: Error| Error::new(e.kind(), format!("{what} at offset {block}: {e}"));
        self.file.read_exact_at(&mut self.stage.bytes()[..ALIGN], block).map_err(|e| at("reading back", e))?;
        self.flushed = block;
        self.staged = (len - block) as usize;
        self.file.set_len(block).map_err(|e| at("cutting", e))
    }

    /// Writes what is staged (padded to [`ALIGN`]), cuts the file to its length and returns it.
    pub fn finish(mut self) -> Result<File> {
        let len = self.appended();
        let padded = self.staged.next_multiple_of(ALIGN);
        let staged = self.staged;
        self.stage.bytes()[staged..padded].fill(0);
        if padded > 0 {
            self.send_stage(padded)?;
        }
        self.wait_all()?;
        self.file.set_len(len)?;
        self.file.try_clone()
    }
}

impl Drop for DirectOut {
    fn drop(&mut self) {
        // Closing the queue ends the thread once the writes in it are done.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let stage = std::mem::replace(&mut self.stage, Stage { raw: Vec::new(), at: 0 });
        let in_flight = self.done.try_iter().map(|(s, _)| s);
        Stage::give_back(self.free.drain(..).chain(in_flight).chain([stage]));
    }
}

/// Warns, once per process, that shards go through the page cache where they were to go around
/// it: the file system of `path` `why`. A warning, as `pack` shows warnings by default: the
/// bytes are the same, but the page cache fills with shards.
pub(super) fn note_page_cache_route(path: &Path, why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!("the file system of {} {why}: shards are written through the page cache", path.display());
    });
}

/// Writes all of `buf` at `offset`; Ok(false) when the file system refused the direct write and
/// it went through the page cache (`O_DIRECT` is then cleared on the file for good).
fn write_direct(file: &File, mut buf: &[u8], mut offset: u64) -> Result<bool> {
    let mut direct = true;
    while !buf.is_empty() {
        match file.write_at(buf, offset) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && direct => {
                let flags = rustix::fs::fcntl_getfl(file)?;
                rustix::fs::fcntl_setfl(file, flags - rustix::fs::OFlags::DIRECT)?;
                direct = false;
            }
            // The caller names the file; the offset is only known here.
            Err(e) => return Err(Error::new(e.kind(), format!("at offset {offset}: {e}"))),
        }
    }
    Ok(direct)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// Appends of odd sizes across stage boundaries, rollbacks into written and staged bytes,
    /// and an unaligned end: the file holds exactly what a plain writer would have left.
    #[test]
    fn same_bytes_as_a_plain_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard");
        // This test is of the direct route: a file system that refuses O_DIRECT fails it.
        let Some(mut out) = DirectOut::create(&path).unwrap() else {
            panic!("O_DIRECT refused at open on {}: run the tests on a disk file system", dir.path().display())
        };
        let mut model = Vec::new();
        let add = |out: &mut DirectOut, model: &mut Vec<u8>, data: Vec<u8>| {
            out.append(&data).unwrap();
            model.extend_from_slice(&data);
            assert_eq!(out.appended(), model.len() as u64);
        };
        add(&mut out, &mut model, pattern(1000, 1));
        add(&mut out, &mut model, pattern(STAGE + 12_345, 2));
        // Into written bytes (mid-block), then into staged bytes.
        let cut = STAGE as u64 - 700;
        out.rollback(cut).unwrap();
        model.truncate(cut as usize);
        add(&mut out, &mut model, pattern(3 * STAGE + 5, 3));
        let cut = out.appended() - 3;
        out.rollback(cut).unwrap();
        model.truncate(cut as usize);
        add(&mut out, &mut model, pattern(777, 4));
        let direct = out.is_direct();
        out.finish().unwrap();
        assert!(direct, "the file system took O_DIRECT at open but refused its writes");
        assert_eq!(std::fs::read(&path).unwrap(), model);
    }

    /// A write the file system refuses directly (here: a misaligned one, which every file
    /// system with O_DIRECT refuses) clears O_DIRECT and goes through the page cache.
    #[test]
    fn a_refused_direct_write_goes_through_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("refused");
        let file = OpenOptions::new().write(true).create(true).custom_flags(libc::O_DIRECT).open(&path).unwrap();
        let data = pattern(1000, 9);
        assert!(!write_direct(&file, &data, 0).unwrap(), "a misaligned direct write was taken");
        let flags = rustix::fs::fcntl_getfl(&file).unwrap();
        assert!(!flags.contains(rustix::fs::OFlags::DIRECT));
        drop(file);
        assert_eq!(std::fs::read(&path).unwrap(), data);
    }

    #[test]
    fn an_empty_file_stays_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty");
        let out =
            DirectOut::create(&path).unwrap().expect("O_DIRECT refused at open: run the tests on a disk file system");
        out.finish().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }
}
