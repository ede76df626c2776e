//! Reading samples: a bounded pool of reader threads that open and read each sample's files and
//! hand the samples to the shard writer in packing order, with bounded memory.
//!
//! Readers take the next position of the packing order, read that sample and put it into a
//! reorder window; the writer takes positions strictly in order. Readers stay at most
//! [`WINDOW_SAMPLES`] positions ahead of the writer and stop taking new positions while
//! [`MAX_BUFFERED_BYTES`] are waiting (the reader of the position the writer needs next always
//! proceeds, so the window can never deadlock). Memory is therefore bounded by those two limits
//! plus one sample per reader, whatever the number of files.
//!
//! For TAR output a reader lays a sample out as it will be in the shard: it reads each file
//! straight into the sample's buffer behind the member's header (headers depend only on name and
//! size, never on the position in the shard) and pads it. The writer then only appends the buffer
//! to the shard (and runs the CRC-32C over it, at hardware speed). A member of [`STREAM_THRESHOLD`] bytes or more is not
//! read here: its open file goes to the writer, which copies it in chunks, so one 50 GB video
//! does not need 50 GB of memory.
//!
//! Every file is opened beneath SRC ([`SrcDir`]): no component of its path, symlink or not, may
//! lead out of SRC. `O_NONBLOCK` keeps a FIFO that slipped
//! into a `--files-from` list from blocking the pack; anything that is not a regular file is
//! reported.

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::sync::{Condvar, Mutex};

use super::beneath::{OpenError, SrcDir};
use super::group::{Catalog, LABEL_FIELD};
use super::report::{BadInput, BadKind, Reporter};
use super::ustar;
use crate::Error;

/// Most positions the readers may run ahead of the writer. A file that takes long to open (a
/// parallel file system's metadata server having a slow moment) holds the writer up while the
/// other readers continue; at 100k files/s, 8192 samples cover such a stall of ~80 ms.
pub const WINDOW_SAMPLES: usize = 8192;
/// Most bytes of read samples waiting for the writer: enough to keep the writer busy through a
/// stall like the one above, small next to the memory of any machine that trains models.
pub const MAX_BUFFERED_BYTES: u64 = 256 << 20;
/// Members at least this large are streamed by the writer instead of read into memory (TAR only).
/// Larger than any image or caption file; small enough that a window of them stays within memory.
pub const STREAM_THRESHOLD: u64 = 16 << 20;
/// Positions a reader takes at once. Small against the window, large enough that locking is
/// rare (at 18 KB per sample, a batch is ~150 KB of reading).
const CLAIM_BATCH: usize = 8;
/// Most results the writer takes out of the window at once: bounds what it holds outside the
/// window's byte accounting.
const DRAIN_BATCH: usize = 64;
/// Readers blocked on a full window resume when it is this empty (hysteresis: one wake-up per
/// quarter window instead of one per sample).
const LOW_WATER_SAMPLES: usize = WINDOW_SAMPLES / 4 * 3;
const LOW_WATER_BYTES: u64 = MAX_BUFFERED_BYTES / 4 * 3;
/// Parquet values are BYTE_ARRAYs with a 32-bit length.
pub const MAX_PARQUET_VALUE: u64 = i32::MAX as u64;

/// How a sample's bytes are laid out in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// As TAR members: header, payload, padding, for each member in field order.
    Tar,
    /// Payloads only, back to back (the Parquet writer copies them into columns).
    Raw,
}

/// A member the writer copies from its file (TAR layout): its payload goes at `buf[at]`, where
/// the buffer holds the member's header before and its padding after.
#[derive(Debug)]
pub struct Streamed {
    pub at: usize,
    pub file: File,
    pub len: u64,
    pub path: String,
}

/// A sample read and ready to write.
#[derive(Debug)]
pub struct LoadedSample<'a> {
    pub key: &'a str,
    pub buf: Vec<u8>,
    /// (field, payload range in `buf`) in field order; streamed members have an empty range.
    pub members: Vec<(&'a str, Range<usize>)>,
    pub streams: Vec<Streamed>,
    /// Input files read (the label is not one).
    pub files: u64,
    /// Payload bytes (files and label).
    pub payload: u64,
}

impl LoadedSample<'_> {
    /// Bytes the sample takes in a TAR shard.
    pub fn encoded_len(&self) -> u64 {
        self.buf.len() as u64 + self.streams.iter().map(|s| s.len).sum::<u64>()
    }

    fn charge(&self) -> u64 {
        self.buf.capacity() as u64 + self.streams.len() as u64 * STREAM_THRESHOLD
    }
}

/// What a reader made of one position of the packing order.
#[derive(Debug)]
pub enum Loaded<'a> {
    Sample(LoadedSample<'a>),
    /// The sample had bad inputs (already reported) and is left out; `files` is how many files
    /// it has (for progress).
    Skipped {
        bad: u64,
        files: u64,
    },
    /// A bad input under `--strict`, or an internal failure: the pack stops here.
    Failed(Error),
}

/// What readers need to know.
pub struct ReadContext<'a> {
    /// SRC, canonical, opened.
    pub src: &'a SrcDir,
    pub catalog: &'a Catalog,
    pub order: &'a [u32],
    pub layout: Layout,
    pub reporter: &'a Reporter<'a>,
}

/// Opens `rel` beneath SRC for reading, refusing paths that leave SRC (through a symlink in any
/// component) and non-files.
pub fn open_checked(src: &SrcDir, rel: &str) -> std::result::Result<(File, u64), BadInput> {
    let classify = |e: std::io::Error, what: &str| match e.kind() {
        std::io::ErrorKind::NotFound => {
            // Invisible on a terminal: a list written with Windows line ends.
            let cr = if rel.ends_with('\r') {
                " (its name ends with a carriage return: a --files-from list with CRLF line ends? end its lines with \
                 LF)"
            } else {
                ""
            };
            let why = "not found: gone since it was listed, a dangling symlink, or never there";
            BadInput::new(BadKind::Vanished, rel, format!("{what}: {why}{cr}"))
        }
        _ => BadInput::new(BadKind::Unreadable, rel, format!("{what}: {e}")),
    };
    let file = match src.open_file(rel) {
        Ok(f) => f,
        Err(OpenError::Outside { to }) => {
            let to = to.map_or_else(|| "a path".to_owned(), |t| t.display().to_string());
            return Err(BadInput::new(
                BadKind::SymlinkOutside,
                rel,
                format!("a symlink on the path leads to {to}, outside SRC ({}); not read", src.path().display()),
            ));
        }
        Err(OpenError::SymlinkedDir) => {
            return Err(BadInput::new(
                BadKind::SymlinkOutside,
                rel,
                "a directory on the path is a symlink (not followed: this kernel has no openat2)",
            ));
        }
        Err(OpenError::Io(e)) => return Err(classify(e, "cannot open")),
    };
    let meta = file.metadata().map_err(|e| classify(e, "cannot stat"))?;
    if !meta.is_file() {
        let what =
            if meta.is_dir() { "a directory (symlinks to directories are not followed)" } else { "not a regular file" };
        return Err(BadInput::new(BadKind::NotAFile, rel, what));
    }
    Ok((file, meta.len()))
}

enum Source<'a> {
    File { path: &'a str, name: &'a str },
    Label { name: String, bytes: Vec<u8> },
}

/// Reads the sample at `sample` (an index into the catalog).
pub fn load_sample<'a>(ctx: &ReadContext<'a>, sample: u32) -> Loaded<'a> {
    let Some(s) = ctx.catalog.sample(sample as usize) else {
        return Loaded::Failed(Error::Internal(format!("sample {sample} is not in the catalog")));
    };
    let key = s.key();
    let mut sources: Vec<(&'a str, Source<'a>)> =
        s.members().map(|m| (m.field, Source::File { path: m.path, name: m.name })).collect();
    if let Some(class) = s.class() {
        let at = sources.partition_point(|(f, _)| *f < LABEL_FIELD);
        let label = Source::Label { name: format!("{key}.{LABEL_FIELD}"), bytes: class.to_string().into_bytes() };
        sources.insert(at, (LABEL_FIELD, label));
    }

    let mut buf = super::buffers::take();
    let mut members = Vec::with_capacity(sources.len());
    let mut streams = Vec::new();
    let (mut bad, mut files, mut payload) = (0u64, 0u64, 0u64);
    for (field, source) in sources {
        match source {
            Source::Label { name, bytes } => {
                if ctx.layout == Layout::Tar {
                    ustar::write_header(&mut buf, &name, bytes.len() as u64);
                }
                let start = buf.len();
                buf.extend_from_slice(&bytes);
                members.push((field, start..buf.len()));
                payload += bytes.len() as u64;
                if ctx.layout == Layout::Tar {
                    buf.resize(buf.len() + ustar::padding(bytes.len() as u64), 0);
                }
            }
            Source::File { path, name } => {
                let (file, len) = match open_checked(ctx.src, path) {
                    Ok(f) => f,
                    Err(b) => {
                        if let Err(e) = ctx.reporter.bad(b) {
                            return Loaded::Failed(e);
                        }
                        bad += 1;
                        continue;
                    }
                };
                if ctx.layout == Layout::Raw && len > MAX_PARQUET_VALUE {
                    let b = BadInput::new(
                        BadKind::TooLarge,
                        path,
                        format!("{len} bytes: Parquet values are limited to {MAX_PARQUET_VALUE} bytes"),
                    );
                    if let Err(e) = ctx.reporter.bad(b) {
                        return Loaded::Failed(e);
                    }
                    bad += 1;
                    continue;
                }
                files += 1;
                if bad > 0 {
                    continue; // the sample is dropped anyway; keep checking its other files
                }
                let hdr_at = buf.len();
                if ctx.layout == Layout::Tar {
                    if len >= STREAM_THRESHOLD {
                        ustar::write_header(&mut buf, name, len);
                        streams.push(Streamed { at: buf.len(), file, len, path: path.to_owned() });
                        members.push((field, buf.len()..buf.len()));
                        buf.resize(buf.len() + ustar::padding(len), 0);
                        payload += len;
                        continue;
                    }
                    buf.resize(hdr_at + ustar::header_len(name, len), 0);
                }
                let start = buf.len();
                // One `pread` into the buffer's spare room, no zero fill first, that also tells a
                // file that changed length since it was stat'ed.
                let n = match usize::try_from(len)
                    .map_err(std::io::Error::other)
                    .and_then(|len| crate::storage::local::pread_append_stated(&file, &mut buf, len))
                {
                    Ok(n) => n,
                    Err(e) => {
                        if let Err(e) =
                            ctx.reporter.bad(BadInput::new(BadKind::Unreadable, path, format!("read failed: {e}")))
                        {
                            return Loaded::Failed(e);
                        }
                        bad += 1;
                        continue;
                    }
                };
                // A file that changed length since it was opened (still being written, or cut)
                // is no whole file: left out, as a streamed one is (`writer::copy_member`).
                if n as u64 != len {
                    let b = match n as u64 > len {
                        true => super::writer::grew(path, len),
                        false => super::writer::shrank(path, len, n as u64),
                    };
                    if let Err(e) = ctx.reporter.bad(b) {
                        return Loaded::Failed(e);
                    }
                    bad += 1;
                    continue;
                }
                if ctx.layout == Layout::Tar {
                    let mut hdr = Vec::with_capacity(ustar::BLOCK);
                    ustar::write_header(&mut hdr, name, n as u64);
                    buf[hdr_at..start].copy_from_slice(&hdr);
                }
                members.push((field, start..start + n));
                payload += n as u64;
                if ctx.layout == Layout::Tar {
                    buf.resize(buf.len() + ustar::padding(n as u64), 0);
                }
            }
        }
    }
    if bad > 0 {
        let members = s.members().len() as u64;
        ctx.reporter.left_out(key, members.saturating_sub(bad));
        return Loaded::Skipped { bad, files: members };
    }
    Loaded::Sample(LoadedSample { key, buf, members, streams, files, payload })
}

struct WindowState<'a> {
    /// Next position a reader will take.
    next: usize,
    /// Next position the writer will take; `slots[0]` is its slot.
    consumed: usize,
    slots: VecDeque<Option<Loaded<'a>>>,
    buffered: u64,
    stopped: bool,
    waiting_readers: usize,
    writer_waiting: bool,
}

/// The reorder window between readers and the writer, over positions `start..end` of the order.
pub struct Window<'a> {
    state: Mutex<WindowState<'a>>,
    readers: Condvar,
    writer: Condvar,
    end: usize,
}

impl<'a> Window<'a> {
    pub fn new(start: usize, end: usize) -> Self {
        Self {
            state: Mutex::new(WindowState {
                next: start,
                consumed: start,
                slots: VecDeque::new(),
                buffered: 0,
                stopped: false,
                waiting_readers: 0,
                writer_waiting: false,
            }),
            readers: Condvar::new(),
            writer: Condvar::new(),
            end,
        }
    }

    /// Ends the window early (the writer failed or was stopped): readers finish their current
    /// sample and exit.
    pub fn stop(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        self.readers.notify_all();
        self.writer.notify_all();
    }

    /// A reader's loop: take positions and load them until the order is exhausted or stopped.
    /// Positions are taken `CLAIM_BATCH` at a time and handed over together: one lock per
    /// batch, not two per sample.
    pub fn run_reader(&self, ctx: &ReadContext<'a>) {
        let mut batch = Vec::with_capacity(CLAIM_BATCH);
        loop {
            let first = {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if st.stopped || st.next >= self.end {
                        return;
                    }
                    let ahead = st.next - st.consumed;
                    let over_budget = st.buffered >= MAX_BUFFERED_BYTES && st.next != st.consumed;
                    if ahead < WINDOW_SAMPLES && !over_budget {
                        break;
                    }
                    st.waiting_readers += 1;
                    st = self.readers.wait(st).unwrap_or_else(|p| p.into_inner());
                    st.waiting_readers -= 1;
                }
                let n = CLAIM_BATCH.min(self.end - st.next).min(WINDOW_SAMPLES - (st.next - st.consumed)).max(1);
                st.next += n;
                st.next - n..st.next
            };
            for pos in first.clone() {
                let loaded = match ctx.order.get(pos) {
                    None => Loaded::Failed(Error::Internal(format!("position {pos} outside the order"))),
                    Some(&sample) => {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load_sample(ctx, sample)))
                            .unwrap_or_else(|_| {
                                Loaded::Failed(Error::Internal(format!("reader panicked on sample {sample}")))
                            })
                    }
                };
                batch.push(loaded);
            }
            self.put(first.start, &mut batch);
        }
    }

    /// Deposits the results of consecutive positions from `first` (draining `batch`).
    fn put(&self, first: usize, batch: &mut Vec<Loaded<'a>>) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let base = first - st.consumed;
        for (idx, loaded) in (base..).zip(batch.drain(..)) {
            if let Loaded::Sample(s) = &loaded {
                st.buffered += s.charge();
            }
            while st.slots.len() <= idx {
                st.slots.push_back(None);
            }
            st.slots[idx] = Some(loaded);
        }
        let front = base == 0;
        if front && st.writer_waiting {
            self.writer.notify_one();
        }
    }

    /// The writer's side: moves the results of the next positions, in order, into `out` (at
    /// least one, at most `DRAIN_BATCH`), waiting for them if needed. False at the end of the
    /// order (or when stopped).
    fn take_ready(&self, out: &mut VecDeque<Loaded<'a>>) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if st.consumed >= self.end || st.stopped {
                return false;
            }
            let mut taken = 0;
            while taken < DRAIN_BATCH && matches!(st.slots.front(), Some(Some(_))) {
                let Some(Some(loaded)) = st.slots.pop_front() else { break };
                st.consumed += 1;
                if let Loaded::Sample(s) = &loaded {
                    st.buffered -= s.charge();
                }
                out.push_back(loaded);
                taken += 1;
            }
            if taken > 0 {
                // Readers blocked on a full window are woken in a batch, once a quarter of it is
                // free again, not once per sample.
                let ahead = st.next - st.consumed;
                if st.waiting_readers > 0 && ahead <= LOW_WATER_SAMPLES && st.buffered <= LOW_WATER_BYTES {
                    self.readers.notify_all();
                }
                return true;
            }
            st.writer_waiting = true;
            st = self.writer.wait(st).unwrap_or_else(|p| p.into_inner());
            st.writer_waiting = false;
        }
    }

    /// The positions' results in order, for the writer.
    pub fn ordered(&self) -> Ordered<'_, 'a> {
        Ordered { window: self, ready: VecDeque::with_capacity(DRAIN_BATCH) }
    }
}

/// Iterator over the window's results in order (see [`Window::ordered`]).
pub struct Ordered<'w, 'a> {
    window: &'w Window<'a>,
    ready: VecDeque<Loaded<'a>>,
}

impl<'a> Iterator for Ordered<'_, 'a> {
    type Item = Loaded<'a>;

    fn next(&mut self) -> Option<Loaded<'a>> {
        if self.ready.is_empty() && !self.window.take_ready(&mut self.ready) {
            return None;
        }
        self.ready.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::group::GroupOptions;

    fn tree(files: &[(&str, &[u8])]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (p, data) in files {
            let p = dir.path().join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, data).unwrap();
        }
        dir
    }

    #[test]
    fn file_reads_append_what_the_file_holds_up_to_its_stated_length() {
        use crate::storage::local::pread_append;
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let dir = tree(&[("f.bin", &data)]);
        let file = File::open(dir.path().join("f.bin")).unwrap();
        let read = |len: usize, buf: &mut Vec<u8>| pread_append(&file, buf, len, 0).unwrap();

        // As stated, after bytes already in the buffer, into a buffer that must grow first.
        let mut buf = Vec::with_capacity(16);
        buf.extend_from_slice(b"hdr");
        assert_eq!(read(data.len(), &mut buf), data.len());
        assert_eq!(&buf[..3], b"hdr");
        assert_eq!(&buf[3..], &data[..]);

        // The file grew since it was stat'ed: only the stated bytes, even with room for more.
        let mut buf = Vec::with_capacity(1 << 20);
        buf.push(9);
        assert_eq!(read(1000, &mut buf), 1000);
        assert_eq!(buf.len(), 1001);
        assert_eq!(&buf[1..], &data[..1000]);

        // The file shrank: what it holds.
        let mut buf = Vec::new();
        assert_eq!(read(data.len() + 5000, &mut buf), data.len());
        assert_eq!(buf, data);

        // Nothing to read.
        let mut buf = b"x".to_vec();
        assert_eq!(read(0, &mut buf), 0);
        assert_eq!(buf, b"x");

        // As stat'ed, the whole file; one byte more tells a file that grew, fewer one that shrank.
        let stated = |len: usize| {
            let mut buf = Vec::new();
            let n = crate::storage::local::pread_append_stated(&file, &mut buf, len).unwrap();
            assert_eq!(&buf[..], &data[..n]);
            n
        };
        assert_eq!(stated(data.len()), data.len());
        assert_eq!(stated(1000), 1001);
        assert_eq!(stated(data.len() + 5000), data.len());
        assert_eq!(stated(0), 1);
    }

    #[test]
    fn delivers_every_position_in_order() {
        let files: Vec<(String, Vec<u8>)> =
            (0..300).map(|i| (format!("d{}/{i:04}.bin", i % 7), vec![i as u8; i * 37])).collect();
        let refs: Vec<(&str, &[u8])> = files.iter().map(|(p, d)| (p.as_str(), d.as_slice())).collect();
        let dir = tree(&refs);
        let src = dir.path().canonicalize().unwrap();
        let reporter = Reporter::new(false, &());
        let cat =
            Catalog::build(files.iter().map(|f| f.0.clone()).collect(), GroupOptions::default(), &reporter).unwrap();
        let order = cat.order(true, 3);
        for layout in [Layout::Tar, Layout::Raw] {
            let root = SrcDir::open(&src).unwrap();
            let ctx = ReadContext { src: &root, catalog: &cat, order: &order, layout, reporter: &reporter };
            let window = Window::new(10, order.len());
            let mut got = Vec::new();
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| window.run_reader(&ctx));
                }
                for l in window.ordered() {
                    let Loaded::Sample(smp) = l else { panic!("unexpected {l:?}") };
                    got.push(smp);
                }
            });
            assert_eq!(got.len(), order.len() - 10);
            for (i, smp) in got.iter().enumerate() {
                let expect = cat.sample(order[i + 10] as usize).unwrap();
                assert_eq!(smp.key, expect.key());
                let want = std::fs::read(src.join(expect.members().next().unwrap().path)).unwrap();
                assert_eq!(&smp.buf[smp.members[0].1.clone()], &want[..]);
                if layout == Layout::Tar {
                    assert_eq!(smp.buf.len() % 512, 0);
                }
            }
        }
    }

    #[test]
    fn symlinks_and_missing_files() {
        let dir = tree(&[("src/a.jpg", b"a"), ("outside.jpg", b"o")]);
        let src = dir.path().join("src").canonicalize().unwrap();
        std::os::unix::fs::symlink(src.join("a.jpg"), src.join("in.jpg")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside.jpg"), src.join("out.jpg")).unwrap();
        std::os::unix::fs::symlink(src.join("nothing"), src.join("dangling.jpg")).unwrap();
        std::os::unix::fs::symlink(&src, src.join("loop.jpg")).unwrap();
        let src = SrcDir::open(&src).unwrap();
        assert_eq!(open_checked(&src, "in.jpg").unwrap().1, 1);
        assert_eq!(open_checked(&src, "out.jpg").unwrap_err().kind, BadKind::SymlinkOutside);
        assert_eq!(open_checked(&src, "dangling.jpg").unwrap_err().kind, BadKind::Vanished);
        assert_eq!(open_checked(&src, "loop.jpg").unwrap_err().kind, BadKind::NotAFile);
        assert_eq!(open_checked(&src, "gone.jpg").unwrap_err().kind, BadKind::Vanished);
    }

    #[test]
    fn large_members_are_streamed() {
        let big = vec![5u8; STREAM_THRESHOLD as usize + 3];
        let dir = tree(&[("k.bin", &big), ("k.txt", b"small")]);
        let src = dir.path().canonicalize().unwrap();
        let reporter = Reporter::new(false, &());
        let cat = Catalog::build(vec!["k.bin".into(), "k.txt".into()], GroupOptions::default(), &reporter).unwrap();
        let root = SrcDir::open(&src).unwrap();
        let ctx = ReadContext { src: &root, catalog: &cat, order: &[0], layout: Layout::Tar, reporter: &reporter };
        let Loaded::Sample(s) = load_sample(&ctx, 0) else { panic!() };
        assert_eq!(s.streams.len(), 1);
        assert_eq!(s.encoded_len(), 512 + big.len() as u64 + 509 + 512 + 512);
    }
}
