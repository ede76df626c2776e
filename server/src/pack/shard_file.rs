//! A shard file being written, with its running length and CRC-32C: [`CrcFile`]. Two routes to
//! the disk, the same bytes either way:
//! - around the page cache ([`super::direct`]), the default for a local output: appended bytes
//!   are copied into an aligned stage and written in large direct writes;
//! - through it: appended buffers are gathered and written with one `writev` per
//!   [`GATHER_BYTES`], no copy in user space. Taken when the shard is read back right away (an S3
//!   upload from the scratch file), when asked for (`--buffered-io`), and on a file system that
//!   does not take `O_DIRECT`.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;

use super::direct::DirectOut;
use crate::{Error, Result};

/// Sample buffers gathered into one `writev`: a few hundred KB per call, so syscalls are rare,
/// and no copy into a staging buffer (each sample's buffer goes to the kernel as it is).
const GATHER_BYTES: usize = 1 << 20;
/// Most buffers in one `writev` (Linux accepts 1024).
const GATHER_BUFFERS: usize = 256;
/// Every this many bytes written, the writer asks the kernel to start writing them back
/// (`sync_file_range`, asynchronous). The shard's final fsync then waits only for the tail
/// instead of the whole 1 GiB, and dirty pages do not pile up (RocksDB's `bytes_per_sync`).
const WRITEBACK_EVERY: u64 = 32 << 20;

/// How shard files reach the disk (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteRoute {
    AroundPageCache,
    ThroughPageCache,
}

/// Through the page cache: buffers gathered for `writev`.
struct Buffered {
    file: File,
    /// Buffers appended but not yet written, and their total length.
    pending: Vec<Vec<u8>>,
    pending_bytes: usize,
    /// Bytes handed to writeback so far.
    written_back: u64,
}

enum Out {
    Buffered(Buffered),
    Direct(Box<DirectOut>),
}

/// A file being written, with its running length and CRC-32C.
pub struct CrcFile {
    out: Out,
    pub(super) path: PathBuf,
    pub(super) len: u64,
    pub(super) crc: u32,
}

impl CrcFile {
    /// Creates `path` for writing by `route`; around the page cache falls back to through it
    /// where the file system does not take `O_DIRECT` (a warning, once per pack).
    pub fn create(path: PathBuf, route: WriteRoute) -> Result<Self> {
        let err = |e| Error::io("cannot create shard", &path, e);
        let out = match route {
            WriteRoute::AroundPageCache => DirectOut::create(&path).map_err(err)?.map(|d| Out::Direct(Box::new(d))),
            WriteRoute::ThroughPageCache => None,
        };
        let out = match out {
            Some(out) => out,
            None => {
                if route == WriteRoute::AroundPageCache {
                    super::direct::note_page_cache_route(&path, "does not take O_DIRECT");
                }
                let file = File::create(&path).map_err(err)?;
                Out::Buffered(Buffered { file, pending: Vec::new(), pending_bytes: 0, written_back: 0 })
            }
        };
        Ok(Self { out, path, len: 0, crc: 0 })
    }

    /// Bytes appended so far.
    pub fn written(&self) -> u64 {
        self.len
    }

    fn io(&self, e: std::io::Error) -> Error {
        Error::io("cannot write shard", &self.path, e)
    }

    /// True when the file is written around the page cache.
    #[cfg(test)]
    pub(super) fn is_direct(&self) -> bool {
        matches!(&self.out, Out::Direct(d) if d.is_direct())
    }

    /// Counts `data`, which reaches the file, into its length and CRC-32C.
    fn account(&mut self, data: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, data);
        self.len += data.len() as u64;
    }

    /// Appends a buffer, taking it over (no copy through the page cache; one into the stage
    /// around it, after which the buffer goes back to the pool).
    pub(super) fn append_owned(&mut self, data: Vec<u8>) -> Result<()> {
        self.account(&data);
        let r = match &mut self.out {
            Out::Direct(d) => {
                let r = d.append(&data);
                super::buffers::give_back(data);
                r
            }
            Out::Buffered(b) => {
                b.pending_bytes += data.len();
                b.pending.push(data);
                if b.pending_bytes >= GATHER_BYTES || b.pending.len() >= GATHER_BUFFERS {
                    b.flush_pending(self.len)
                } else {
                    Ok(())
                }
            }
        };
        r.map_err(|e| self.io(e))
    }

    pub(super) fn append(&mut self, data: &[u8]) -> Result<()> {
        match &mut self.out {
            Out::Direct(d) => {
                let r = d.append(data);
                self.account(data);
                r.map_err(|e| self.io(e))
            }
            Out::Buffered(_) => self.append_owned(data.to_vec()),
        }
    }

    /// Cuts the file back to `len` bytes with CRC `crc` (undoing a sample that failed midway).
    pub(super) fn rollback(&mut self, len: u64, crc: u32) -> Result<()> {
        let total = self.len;
        let r = match &mut self.out {
            Out::Direct(d) => d.rollback(len),
            Out::Buffered(b) => b.rollback(total, len),
        };
        r.map_err(|e| self.io(e))?;
        self.len = len;
        self.crc = crc;
        Ok(())
    }

    /// Writes what is pending and returns the file, its length and CRC-32C.
    pub fn finish(self) -> Result<(File, u64, u32)> {
        let (len, crc) = (self.len, self.crc);
        let r = match self.out {
            Out::Direct(d) => d.finish(),
            Out::Buffered(mut b) => b.flush_pending(len).map(|()| b.file),
        };
        let file = r.map_err(|e| Error::io("cannot write shard", &self.path, e))?;
        Ok((file, len, crc))
    }
}

impl Buffered {
    /// Writes the gathered buffers; `len` is the file's length once they are written.
    fn flush_pending(&mut self, len: u64) -> std::io::Result<()> {
        let mut slices: Vec<std::io::IoSlice<'_>> = self.pending.iter().map(|b| std::io::IoSlice::new(b)).collect();
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match self.file.write_vectored(rest) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => std::io::IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.pending.drain(..).for_each(super::buffers::give_back);
        self.pending_bytes = 0;
        self.start_writeback(len);
        Ok(())
    }

    /// Starts writeback of what reached the file (`in_file` bytes) since the last call, every
    /// [`WRITEBACK_EVERY`] bytes. A hint: errors are left to the fsync that makes the shard
    /// durable.
    fn start_writeback(&mut self, in_file: u64) {
        use std::os::fd::AsRawFd;
        if in_file - self.written_back < WRITEBACK_EVERY {
            return;
        }
        let (Ok(from), Ok(len)) = (i64::try_from(self.written_back), i64::try_from(in_file - self.written_back)) else {
            return;
        };
        // SAFETY: a syscall on a descriptor we own; no memory is passed.
        unsafe { libc::sync_file_range(self.file.as_raw_fd(), from, len, libc::SYNC_FILE_RANGE_WRITE) };
        self.written_back = in_file;
    }

    /// Cuts the file (`total` bytes appended) back to `len` bytes.
    fn rollback(&mut self, total: u64, len: u64) -> std::io::Result<()> {
        self.flush_pending(total)?;
        let f = &mut self.file;
        f.set_len(len)?;
        f.seek(SeekFrom::Start(len))?;
        self.written_back = self.written_back.min(len);
        Ok(())
    }
}

impl Write for CrcFile {
    /// Unbuffered through the page cache (the Parquet writer buffers its own output); staged
    /// around it.
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.out {
            Out::Direct(d) => d.append(buf)?,
            Out::Buffered(b) => {
                if !b.pending.is_empty() {
                    b.flush_pending(self.len)?;
                }
                let n = b.file.write(buf)?;
                b.start_writeback(self.len + n as u64);
                self.account(&buf[..n]);
                return Ok(n);
            }
        }
        self.account(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.out {
            Out::Direct(_) => Ok(()),
            Out::Buffered(b) => b.flush_pending(self.len),
        }
    }
}
