//! The shard writer: takes read samples in packing order, decides where shards end, appends each
//! sample to the open shard, and hands every completed shard (a closed local file with its size,
//! CRC-32C and member table) to the sink thread.
//!
//! Shard boundaries are decided here and only here, in packing order, so they are the same
//! whatever the number of readers: a shard ends before the sample that would take it past
//! `--shard-size` (the TAR trailer included) or past `--samples-per-shard`. A sample is never
//! split, and a sample larger than the shard size is alone in its shard.
//!
//! Shard `k` covers the positions `first..end` of the packing order; samples in that range that
//! had bad inputs are left out and counted with it. The journal records these ranges, so a
//! resumed pack restarts exactly at the first position of the first incomplete shard.
//!
//! One writer thread is enough: for TAR it only appends buffers the readers prepared (headers,
//! payloads and padding laid out as in the shard) and runs the CRC-32C over them, a
//! memory-bandwidth job at several GB/s, well above what reading small files delivers. The fsync and rename of a
//! completed shard (or its upload to S3) run on the sink thread, overlapping with the next
//! shard.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::path::PathBuf;
use std::sync::mpsc::SyncSender;

use super::parquet::{ParquetOptions, ParquetShard};
use super::read::{Loaded, LoadedSample, Window};
use super::report::{BadInput, BadKind, Reporter};
use super::shard_file::{CrcFile, WriteRoute};
use super::{PackProgress, ShardFormat, ustar};
use crate::format::tar::{ScanAsWritten, TarError, TarIndex};
use crate::{Error, Result};

/// Chunk in which streamed (large) members are copied.
const COPY_CHUNK: usize = 1 << 20;

/// A completed shard, closed but not yet durable: the sink makes it so.
#[derive(Debug)]
pub struct FinishedShard {
    /// Shard number (its position in the manifest).
    pub number: u64,
    pub name: String,
    /// Where the writer produced it.
    pub scratch: PathBuf,
    pub file: File,
    pub bytes: u64,
    pub crc: u32,
    pub samples: u64,
    pub files: u64,
    /// Payload bytes of its samples (what the user's files held).
    pub payload: u64,
    /// Positions `first..end` of the packing order it covers.
    pub first: u64,
    pub end: u64,
    /// Bad inputs among the samples of its range.
    pub bad_inputs: u64,
    pub fields: Vec<String>,
    /// Its member table, for the sidecar (TAR only).
    pub tar_index: Option<TarIndex>,
}

impl FinishedShard {
    /// The identity a sidecar of this shard is keyed by (as `shardstream index` writes it).
    pub fn identity(&self) -> String {
        format!("len={};crc32c={:08x}", self.bytes, self.crc)
    }
}

struct TarShard {
    out: CrcFile,
    boundaries: Vec<u64>,
    copy_buf: Vec<u8>,
    /// The shard's index, built from each sample's bytes as they are appended; None once a
    /// sample could not be indexed (the shard then gets no layout and is parsed when served).
    scan: Option<Box<ScanAsWritten>>,
}

impl TarShard {
    fn new(out: CrcFile) -> Self {
        Self { out, boundaries: Vec::new(), copy_buf: Vec::new(), scan: Some(Box::default()) }
    }

    /// Indexes sample `s`, written at `start`, from its buffer and the lengths of its streams.
    /// A sample the scan cannot lay out costs the shard its layout; one every reader of the
    /// shard refuses fails the pack.
    fn scan(&mut self, start: u64, s: &LoadedSample<'_>) -> Result<()> {
        let Some(scan) = &mut self.scan else { return Ok(()) };
        let end = start + s.buf.len() as u64;
        let scanned = if s.streams.is_empty() {
            // Most samples: one piece, and no allocation per sample.
            scan.sample(start, end, &[(start, &s.buf)])
        } else {
            let mut parts = Vec::with_capacity(1 + s.streams.len());
            let (mut from, mut at) = (0, start);
            for st in &s.streams {
                parts.push((at, &s.buf[from..st.at]));
                at += (st.at - from) as u64 + st.len;
                from = st.at;
            }
            parts.push((at, &s.buf[from..]));
            scan.sample(start, at + (s.buf.len() - from) as u64, &parts)
        };
        match scanned {
            Ok(()) => Ok(()),
            // The daemon indexes the shard again wherever its sidecar is missing or stale, and
            // refuses it there: better said now, naming the sample's files.
            Err(e @ TarError::TooManyFields { .. }) => {
                Err(Error::invalid(format!("cannot pack sample {:?}: {e}", s.key)))
            }
            Err(_) => {
                self.scan = None;
                Ok(())
            }
        }
    }

    /// Appends a sample; Ok(false) when one of its streamed files failed (reported, rolled back).
    fn add(&mut self, s: &mut LoadedSample<'_>, reporter: &Reporter) -> Result<bool> {
        let (start, start_crc) = (self.out.len, self.out.crc);
        if s.streams.is_empty() {
            self.scan(start, s)?;
            self.out.append_owned(std::mem::take(&mut s.buf))?;
            self.boundaries.push(start);
            return Ok(true);
        }
        let mut prev = 0;
        for st in &mut s.streams {
            self.out.append(&s.buf[prev..st.at])?;
            prev = st.at;
            if let Err(bad) = copy_member(&mut self.out, st, &mut self.copy_buf)? {
                self.out.rollback(start, start_crc)?;
                reporter.bad(bad)?;
                return Ok(false);
            }
        }
        self.out.append(&s.buf[prev..])?;
        self.scan(start, s)?;
        self.boundaries.push(start);
        Ok(true)
    }

    fn finish(mut self) -> Result<(File, u64, u32, TarIndex)> {
        if !self.boundaries.is_empty() {
            self.boundaries.push(self.out.len);
        }
        self.out.append(&ustar::TRAILER)?;
        let (file, len, crc) = self.out.finish()?;
        // The scan must find the samples where the writer put them, or the shard gets no layout.
        let layout =
            self.scan.map(|s| s.finish()).filter(|ix| ix.boundaries == self.boundaries).and_then(|ix| ix.layout);
        Ok((
            file,
            len,
            crc,
            TarIndex { boundaries: self.boundaries, fields: Vec::new(), layout, split_keys: Default::default() },
        ))
    }
}

/// Copies a streamed member; the inner Err is a bad input (the file changed under us). The last
/// read asks for a byte past the member's stated end, so a file that grew since it was stat'ed
/// (still being written: its first bytes are a cut file) is told by the reads the copy makes
/// anyway, not by one more.
fn copy_member(out: &mut CrcFile, st: &mut super::read::Streamed, chunk: &mut Vec<u8>) -> Result<Result<(), BadInput>> {
    chunk.resize(COPY_CHUNK + 1, 0);
    let mut left = st.len;
    while left > 0 {
        // Whole chunks until the last, which asks for one byte more.
        let want = if left > COPY_CHUNK as u64 { COPY_CHUNK } else { left as usize + 1 };
        let n = match st.file.read(&mut chunk[..want]) {
            Ok(0) => {
                return Ok(Err(shrank(st.path.as_str(), st.len, st.len - left)));
            }
            Ok(n) if n as u64 > left => return Ok(Err(grew(st.path.as_str(), st.len))),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Ok(Err(BadInput::new(BadKind::Unreadable, st.path.as_str(), format!("read failed: {e}"))));
            }
        };
        out.append(&chunk[..n])?;
        left -= n as u64;
    }
    Ok(Ok(()))
}

/// The bad input of a file longer than it was when stat'ed.
pub(super) fn grew(path: &str, len: u64) -> BadInput {
    BadInput::new(
        BadKind::Unreadable,
        path,
        format!("grew past {len} bytes while being packed (still being written? pack it once it is whole)"),
    )
}

/// The bad input of a file shorter than it was when stat'ed.
pub(super) fn shrank(path: &str, len: u64, now: u64) -> BadInput {
    BadInput::new(BadKind::Unreadable, path, format!("shrank from {len} to {now} bytes while being packed"))
}

enum Shard<'a> {
    Tar(TarShard),
    Parquet(Box<ParquetShard<'a>>),
}

struct OpenShard<'a> {
    number: u64,
    name: String,
    scratch: PathBuf,
    shard: Shard<'a>,
    first: u64,
    samples: u64,
    files: u64,
    payload: u64,
    /// Bytes the shard holds so far (TAR: exact; Parquet: payload and keys, an estimate).
    bytes: u64,
    fields: BTreeSet<String>,
}

/// How shards are cut and named.
pub struct WriterConfig<'a> {
    pub format: ShardFormat,
    pub shard_size: u64,
    pub samples_per_shard: Option<u64>,
    pub prefix: &'a str,
    pub parquet: ParquetOptions<'a>,
    /// How shard files reach the disk.
    pub route: WriteRoute,
}

impl WriterConfig<'_> {
    pub fn shard_name(&self, number: u64) -> String {
        format!("{}-{number:06}.{}", self.prefix, self.format.extension())
    }
}

/// What one writer run did.
#[derive(Debug, Default)]
pub struct WriterStats {
    pub samples: u64,
    pub files: u64,
    pub payload: u64,
    pub shards: u64,
}

impl<'a> OpenShard<'a> {
    fn full_for(&self, s: &LoadedSample<'_>, cfg: &WriterConfig<'_>) -> bool {
        if self.samples == 0 {
            return false;
        }
        if cfg.samples_per_shard.is_some_and(|n| self.samples >= n) {
            return true;
        }
        let next = match self.shard {
            Shard::Tar(_) => s.encoded_len() + ustar::TRAILER.len() as u64,
            Shard::Parquet(_) => s.payload + s.key.len() as u64,
        };
        self.bytes.saturating_add(next) > cfg.shard_size
    }
}

/// Writes shards from the window's samples until it is exhausted; completed shards go to `done`.
/// `start` is the first position of the order this run packs, `first_shard` its shard number.
// Nine arguments, each owned by a different part of `pack` (window, sink, reporter, progress): a
// struct bundling them would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn write_shards<'a>(
    cfg: &WriterConfig<'a>,
    window: &Window<'a>,
    start: u64,
    end: u64,
    first_shard: u64,
    scratch: &dyn Fn(&str) -> PathBuf,
    done: SyncSender<FinishedShard>,
    reporter: &Reporter,
    progress: &dyn PackProgress,
) -> Result<WriterStats> {
    let mut stats = WriterStats::default();
    let mut open: Option<OpenShard<'a>> = None;
    let mut next_number = first_shard;
    let mut range_start = start;
    let mut pending_bad = 0u64;
    let mut pos = start;
    let close = |sh: OpenShard<'a>, end: u64, bad: u64| -> Result<FinishedShard> {
        let fields: Vec<String> = sh.fields.into_iter().collect();
        let (file, bytes, crc, tar_index) = match sh.shard {
            Shard::Tar(t) => {
                let (file, len, crc, mut ix) = t.finish()?;
                ix.fields = fields.clone();
                (file, len, crc, Some(ix))
            }
            Shard::Parquet(p) => {
                let (file, len, crc) = p.finish()?;
                (file, len, crc, None)
            }
        };
        Ok(FinishedShard {
            number: sh.number,
            name: sh.name,
            scratch: sh.scratch,
            file,
            bytes,
            crc,
            samples: sh.samples,
            files: sh.files,
            payload: sh.payload,
            first: sh.first,
            end,
            bad_inputs: bad,
            fields,
            tar_index,
        })
    };
    let send =
        |f: FinishedShard| done.send(f).map_err(|_| Error::Internal("the shard sink stopped before the writer".into()));
    for loaded in window.ordered() {
        let this = pos;
        pos += 1;
        if progress.stop_requested() {
            return Err(Error::Unavailable(format!("pack interrupted at position {this}; rerun with --resume")));
        }
        let mut s = match loaded {
            Loaded::Failed(e) => return Err(e),
            Loaded::Skipped { bad, files } => {
                pending_bad += bad;
                progress.sample_written(files, 0);
                continue;
            }
            Loaded::Sample(s) => s,
        };
        if let Some(sh) = &open
            && sh.full_for(&s, cfg)
        {
            let sh = open.take().ok_or_else(|| Error::Internal("open shard vanished".into()))?;
            send(close(sh, this, pending_bad)?)?;
            stats.shards += 1;
            pending_bad = 0;
            range_start = this;
        }
        let sh = match &mut open {
            Some(sh) => sh,
            None => {
                let name = cfg.shard_name(next_number);
                let path = scratch(&name);
                let out = CrcFile::create(path.clone(), cfg.route)?;
                let shard = match cfg.format {
                    ShardFormat::Webdataset => Shard::Tar(TarShard::new(out)),
                    ShardFormat::Parquet => Shard::Parquet(Box::new(ParquetShard::new(out, &cfg.parquet)?)),
                };
                next_number += 1;
                open.insert(OpenShard {
                    number: next_number - 1,
                    name,
                    scratch: path,
                    shard,
                    first: range_start,
                    samples: 0,
                    files: 0,
                    payload: 0,
                    bytes: 0,
                    fields: BTreeSet::new(),
                })
            }
        };
        let added = match &mut sh.shard {
            Shard::Tar(t) => t.add(&mut s, reporter)?,
            Shard::Parquet(p) => {
                p.add(&s)?;
                true
            }
        };
        if !added {
            pending_bad += 1;
            progress.sample_written(s.files, 0);
            continue;
        }
        sh.samples += 1;
        sh.files += s.files;
        sh.payload += s.payload;
        sh.bytes = match &sh.shard {
            Shard::Tar(t) => t.out.written(),
            Shard::Parquet(_) => sh.bytes + s.payload + s.key.len() as u64,
        };
        for (field, _) in &s.members {
            if !sh.fields.contains(*field) {
                sh.fields.insert((*field).to_owned());
            }
        }
        stats.samples += 1;
        stats.files += s.files;
        stats.payload += s.payload;
        progress.sample_written(s.files, s.payload);
    }
    if pos != end {
        return Err(Error::Unavailable("pack stopped before the last sample".into()));
    }
    // Without an open shard, every sample since `start` was bad: no shard covers them, so a
    // resumed run reads them again.
    if let Some(sh) = open {
        send(close(sh, end, pending_bad)?)?;
        stats.shards += 1;
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::path::Path;

    use super::*;
    use crate::format::tar::{index_tar, parse_sample};
    use crate::pack::read::Streamed;

    fn sample<'a>(key: &'a str, payload: &[u8]) -> LoadedSample<'a> {
        let mut buf = Vec::new();
        ustar::write_header(&mut buf, &format!("{key}.bin"), payload.len() as u64);
        let start = buf.len();
        buf.extend_from_slice(payload);
        buf.resize(buf.len() + ustar::padding(payload.len() as u64), 0);
        LoadedSample {
            key,
            buf,
            members: vec![("bin", start..start + payload.len())],
            streams: Vec::new(),
            files: 1,
            payload: payload.len() as u64,
        }
    }

    /// A sample whose payload is copied from `file`, claiming `len` bytes.
    fn streamed<'a>(key: &'a str, file: &Path, len: u64) -> LoadedSample<'a> {
        let mut buf = Vec::new();
        ustar::write_header(&mut buf, &format!("{key}.bin"), len);
        let at = buf.len();
        buf.resize(at + ustar::padding(len), 0);
        let streams = vec![Streamed { at, file: File::open(file).unwrap(), len, path: file.display().to_string() }];
        LoadedSample { key, buf, members: vec![("bin", at..at)], streams, files: 1, payload: len }
    }

    #[test]
    fn streamed_members_and_rollback_of_a_file_that_shrank() {
        streamed_members_and_rollback(WriteRoute::ThroughPageCache);
    }

    /// The same around the page cache: the rollback cuts into bytes already written directly.
    #[test]
    fn streamed_members_and_rollback_around_the_page_cache() {
        streamed_members_and_rollback(WriteRoute::AroundPageCache);
    }

    fn streamed_members_and_rollback(route: WriteRoute) {
        let dir = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..3 * COPY_CHUNK + 17).map(|i| (i % 251) as u8).collect();
        let big_path = dir.path().join("big");
        std::fs::write(&big_path, &big).unwrap();
        let out = CrcFile::create(dir.path().join("shard.tar"), route).unwrap();
        let mut shard = TarShard::new(out);
        let reporter = Reporter::new(false, &());
        assert!(shard.add(&mut sample("a", b"first"), &reporter).unwrap());
        assert!(shard.add(&mut streamed("b", &big_path, big.len() as u64), &reporter).unwrap());
        // Claims more bytes than the file holds: rolled back, reported, the shard stays valid.
        assert!(!shard.add(&mut streamed("c", &big_path, big.len() as u64 + 4096), &reporter).unwrap());
        assert_eq!(reporter.counts().get(&BadKind::Unreadable), Some(&1));
        // Claims fewer (the file grew since it was stat'ed: still being written): its first bytes
        // would be a cut file, so it is left out too, whether the claim ends inside a chunk or on
        // a chunk's end.
        for claim in [big.len() as u64 - 1, 2 * COPY_CHUNK as u64] {
            assert!(!shard.add(&mut streamed("c", &big_path, claim), &reporter).unwrap(), "{claim}");
        }
        assert_eq!(reporter.counts().get(&BadKind::Unreadable), Some(&3));
        assert!(shard.add(&mut sample("d", b"last"), &reporter).unwrap());
        // Around the page cache means around it: not the fallback of a file system without O_DIRECT.
        assert_eq!(shard.out.is_direct(), route == WriteRoute::AroundPageCache, "route {route:?} not taken");
        let (_, len, crc, ix) = shard.finish().unwrap();
        let bytes = std::fs::read(dir.path().join("shard.tar")).unwrap();
        assert_eq!((bytes.len() as u64, crc32c::crc32c(&bytes)), (len, crc));
        let scanned = index_tar(Cursor::new(&bytes), len).unwrap();
        assert_eq!(scanned.boundaries, ix.boundaries);
        // The layout a served shard is sliced by comes with it, the same as a scan finds.
        assert!(ix.layout.is_some());
        assert_eq!(scanned.layout, ix.layout);
        let keys: Vec<String> = (0..scanned.num_samples())
            .map(|i| {
                let r = scanned.sample_range(i).unwrap();
                let buf = &bytes[r.start as usize..r.end as usize];
                let v = parse_sample(buf).unwrap();
                if v.key == "b" {
                    assert_eq!(&buf[v.members[0].data.clone()], &big[..]);
                }
                v.key.to_string()
            })
            .collect();
        assert_eq!(keys, ["a", "b", "d"]);
        let strict = Reporter::new(true, &());
        let out = CrcFile::create(dir.path().join("strict.tar"), route).unwrap();
        let mut shard = TarShard::new(out);
        assert!(shard.add(&mut streamed("c", &big_path, big.len() as u64 + 1), &strict).is_err());
    }
}
