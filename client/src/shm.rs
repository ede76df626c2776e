//! The shared-memory transport, client side: attach to the daemon's side channel with the
//! stream's token, receive each shard's file descriptor once and map it read-only, and release
//! batches when they are no longer used. Packed streams also receive their ring segments here
//! (`shardstream_proto::ring`), checked for magic and layout version before anything in them is
//! used.
//!
//! Safety of the mappings: shards are `PROT_READ`, `MAP_SHARED` mappings of files the daemon opened
//! read-only, so this process can never write into them (nor into daemon memory). Only shards in
//! the daemon's cache are mapped: they are immutable once published and never truncated while
//! leased. A shard of a dataset read in place (a local or parallel file system) can be truncated
//! by anyone at any time, and touching a mapping past the new end of file is SIGBUS, which kills
//! the trainer: the daemon marks those shards `SHARD_MUTABLE`, and they are read with `pread`
//! instead ([`Mapping::read_at`]), so a truncation is a [`ClientError::Shard`] naming the file.
//! Unless the trainer vouches otherwise ([`map_in_place`], `SHARDSTREAM_MAP_IN_PLACE=1`): then
//! those are mapped too, zero-copy, and a truncation is the trainer's SIGBUS.
//! Ring segments are memfds whose seals are checked ([`check_ring_seals`]) before they are mapped;
//! they are mapped private (copy-on-write) and read-only, and a slot whose batch is handed out as
//! torch tensors is opened for writes, so that a tensor can be written in place without reaching
//! the daemon's memory ([`RingMapping::map`]).

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use memmap2::Mmap;
use rustix::net::{AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendFlags, SocketType};
use shardstream_proto::ring::{ARROW_DATA_OFFSET, RingError, RingHeader, SLOT_HEADER_BYTES, SLOT_MAGIC, SlotHeader};
use shardstream_proto::shm::{self as wire, Frame};

use crate::{ClientError, retained};

/// How long a batch waits for the descriptor of a shard it references (the daemon sends it
/// before the batch, so it is normally there already).
const FD_TIMEOUT: Duration = Duration::from_secs(30);

/// A shard the client received: mapped (node-cache copies), or kept open to be read
/// (`SHARD_MUTABLE` shards, read in place by the daemon too). Empty files cannot be mapped and
/// have no samples: they map to an empty slice.
#[derive(Debug)]
pub struct Mapping {
    map: Option<Mmap>,
    /// Set for a shard that must be read, not mapped.
    file: Option<std::fs::File>,
    /// A shard that is read: the length and modification time it must keep
    /// ([`Self::check_unchanged`]).
    unchanged: (u64, i64),
    /// The shard's path as this process sees it (for errors).
    pub name: String,
}

impl Mapping {
    /// A shard with no bytes to hand out (tests of what holds mappings).
    #[cfg(test)]
    pub(crate) fn unmapped(name: String) -> Self {
        Self { map: None, file: None, unchanged: (0, 0), name }
    }

    /// The mapped bytes; empty for a shard that is read ([`Self::is_mapped`] false).
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// True when the shard is mapped (its samples can be handed out without a copy).
    pub fn is_mapped(&self) -> bool {
        self.file.is_none()
    }

    /// Starts loading the cache line of the mapped byte at `offset` (a no-op for a shard that
    /// is read, or past the end). For records visited in shuffled order, each on pages of its
    /// own, the first touch is a miss to memory; issued a few records ahead, it overlaps with
    /// the work on the records before.
    pub fn prefetch(&self, offset: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(byte) = self.bytes().get(offset) {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            // SAFETY: a prefetch is a hint: it never faults and never changes memory, and the
            // pointer lies in a live mapping anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(byte).cast::<i8>()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = offset;
    }

    /// Refuses a shard that is read (not mapped) once its length or modification time are not
    /// those the daemon opened it with: rewritten in place, the bytes read at the daemon's
    /// offsets may be other samples than it indexed, or none. Called after a batch's reads and
    /// before its samples are handed out; a write moves the time before it copies a byte, so
    /// every rewrite a read saw is caught. One `fstat`; nothing to do for a mapped shard.
    pub fn check_unchanged(&self) -> Result<(), ClientError> {
        let Some(f) = &self.file else { return Ok(()) };
        let shard_error = |reason: String| ClientError::Shard { shard: self.name.clone(), offset: None, reason };
        let meta = f.metadata().map_err(|e| shard_error(format!("cannot stat it: {e}")))?;
        match wire::changed_while_read(self.unchanged, (meta.len(), wire::mtime_ns(&meta))) {
            None => Ok(()),
            Some(why) => {
                Err(shard_error(format!("{why}; open the dataset again (a new Loader) to read it as it is now")))
            }
        }
    }

    /// Reads `buf.len()` bytes at `offset` of a shard that is read: a short read means the shard
    /// was truncated since the daemon indexed it.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), ClientError> {
        use std::os::unix::fs::FileExt;
        let shard_error =
            |reason: String| ClientError::Shard { shard: self.name.clone(), offset: Some(offset), reason };
        match &self.file {
            Some(f) => f.read_exact_at(buf, offset).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => shard_error(format!(
                    "truncated while in use: cannot read {} bytes at offset {offset} (the file changed after it was indexed)",
                    buf.len()
                )),
                _ => shard_error(format!("cannot read {} bytes at offset {offset}: {e}", buf.len())),
            }),
            None => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX);
                let src = start.checked_add(buf.len()).and_then(|end| self.bytes().get(start..end));
                buf.copy_from_slice(src.ok_or_else(|| shard_error("range outside the shard".into()))?);
                Ok(())
            }
        }
    }
}

/// Distance between the reads of [`prefault`]: the kernel's default fault-around window.
const PREFAULT_STRIDE: usize = 64 * 1024;

/// Fills the page tables of a new shard mapping here, on the receiver thread, ahead of the
/// batches that use it, instead of one page fault after another on the trainer's thread while it
/// reads the samples. One read per 64 KiB: each fault maps its whole fault-around window (or
/// large folio) in one go. `MAP_POPULATE` (and `MADV_POPULATE_READ`) walk the mapping page by
/// page instead and cost twice the CPU for the same page tables (bench/PROFILES.md, section 4).
fn prefault(map: &[u8]) {
    for offset in (0..map.len()).step_by(PREFAULT_STRIDE) {
        std::hint::black_box(map[offset]);
    }
}

/// Asks for 2 MiB folios for the parts of a shard this mapping is the first to read from storage
/// (`MADV_HUGEPAGE`). The page cache keeps a file in the folios its first reader made: pages a
/// fault of this mapping reads in then sit in 2 MiB folios, each mapped by one page-table entry,
/// in this stream and every later mapping of the file; the pages `read()` brought in stay in small
/// folios, one fault per 64 KiB (bench/PROFILES.md, section 4: "Huge folios for shards read
/// first through a mapping"). Pages already cached are left as they are. A hint: a kernel
/// without transparent huge pages, or with them off, refuses or ignores it, and nothing else
/// changes, so its error is not one.
fn advise_huge_folios(map: &Mmap) {
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    #[cfg(not(target_os = "linux"))]
    let _ = map;
}

/// The path behind a received descriptor, for error messages (best effort).
fn fd_name(file: &std::fs::File, slot: u64) -> String {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| format!("in shm slot {slot}"))
}

/// The seals a ring memfd must carry before it is mapped: without `SHRINK` the daemon (or
/// anyone holding the descriptor) could shrink it under our mapping (SIGBUS); without `GROW` and
/// `SEAL` the geometry checked in its header could change afterwards.
pub const REQUIRED_RING_SEALS: rustix::fs::SealFlags =
    rustix::fs::SealFlags::SHRINK.union(rustix::fs::SealFlags::GROW).union(rustix::fs::SealFlags::SEAL);

/// Checks a ring segment's seals (`F_GET_SEALS`) before anything trusts its size.
pub fn check_ring_seals(file: &std::fs::File) -> Result<(), String> {
    check_seals(file, REQUIRED_RING_SEALS, "ring segment")
}

/// The seals a decoded row group's segment (SHARD_ARENA) must carry before it is mapped: its
/// length fixed (`SHRINK`, `GROW`) and its bytes too (`FUTURE_WRITE`: arrays handed out over it
/// must not change under their holder), and those seals final (`SEAL`).
pub const REQUIRED_ARENA_SEALS: rustix::fs::SealFlags = REQUIRED_RING_SEALS.union(rustix::fs::SealFlags::FUTURE_WRITE);

/// Checks a decoded row group's segment's seals before it is mapped.
pub fn check_arena_seals(file: &std::fs::File) -> Result<(), String> {
    check_seals(file, REQUIRED_ARENA_SEALS, "segment")
}

/// Checks a decoded row group's segment before it is mapped: a memfd sealed as
/// [`REQUIRED_ARENA_SEALS`], or a row group the daemon kept in its node cache, a regular file
/// (not a memfd) it opened read-only. The daemon publishes such a file whole and never writes or
/// truncates it (eviction unlinks it, which leaves mappings valid): the trust a node-cache shard
/// copy gets.
pub fn check_arena(file: &std::fs::File, name: &str) -> Result<(), String> {
    let sealed = check_arena_seals(file);
    if sealed.is_ok() || name.starts_with("/memfd:") {
        return sealed;
    }
    let st = rustix::fs::fstat(file).map_err(|e| format!("cannot stat: {e}"))?;
    let regular = rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
    let flags = rustix::fs::fcntl_getfl(file).map_err(|e| format!("cannot read its flags: {e}"))?;
    let read_only = (flags & rustix::fs::OFlags::RWMODE) == rustix::fs::OFlags::RDONLY;
    if regular && read_only {
        return Ok(());
    }
    Err(format!("neither a sealed segment nor a read-only cache file (regular: {regular}, read-only: {read_only})"))
}

fn check_seals(file: &std::fs::File, required: rustix::fs::SealFlags, what: &str) -> Result<(), String> {
    let seals = rustix::fs::fcntl_get_seals(file)
        .map_err(|e| format!("cannot read the seals of a {what} (not a sealed memfd?): {e}"))?;
    if !seals.contains(required) {
        return Err(format!("{what} is not sealed as required: has {seals:?}, needs at least {required:?}"));
    }
    Ok(())
}

/// A packed-mode ring segment, mapped read-only, its header checked.
#[derive(Debug)]
pub struct RingMapping {
    /// Private (copy-on-write) and read-only, but for slots opened for writes: see
    /// [`RingMapping::map`].
    map: Mmap,
    pub header: RingHeader,
    /// `/proc/self/pagemap`, opened at the first discard ([`Self::wrote_into`]).
    pagemap: std::sync::OnceLock<Option<std::fs::File>>,
    /// Per slot: opened for writes ([`Self::open_slot`]).
    open: Vec<std::sync::atomic::AtomicBool>,
}

impl RingMapping {
    /// Maps a ring segment read-only and checks its header (magic, layout version, geometry).
    ///
    /// The mapping is private: torch cannot make a tensor read-only, so a tensor over a slot
    /// (zero copy) that the trainer writes into in place (`x.mul_(...)`) is SIGSEGV in a read-only
    /// mapping. The torch layer opens such a slot for writes ([`Self::open_slot`]); in a private
    /// mapping a write then copies the page for this process alone, the daemon's memfd never
    /// changes, and [`Self::close_slot`] drops such copies before the slot is handed back. Pages
    /// never written are the memfd's own pages, so they see what the daemon writes, as a shared
    /// mapping would. Read-only until then: a private writable mapping is charged in full to
    /// the commit limit (a node with strict overcommit would refuse large rings), so only the
    /// slots the torch layer hands out are opened, each once for the ring's life here (opening
    /// and closing each batch's slot cost two `mprotect`s and their TLB flushes a batch).
    pub fn map(file: &std::fs::File) -> Result<Self, String> {
        check_ring_seals(file)?;
        // SAFETY: a private mapping of a memfd sealed against shrinking (checked just above:
        // `F_SEAL_SHRINK` and `F_SEAL_SEAL`, so the seal cannot be lifted), so its pages stay
        // valid for as long as this mapping lives; the daemon writes only into slots this client
        // does not hold, and this process's own writes (copy-on-write) never reach the memfd.
        // Not populated: a read fault allocates the memfd's pages, and the daemon allocates a
        // slot's pages only as far as its batches reach (the rest would be allocated for
        // nothing); the pages a batch uses fault in as it is read, 64 KiB a fault.
        let map = unsafe { memmap2::MmapOptions::new().map_copy_read_only(file) }
            .map_err(|e| format!("cannot map a ring segment: {e}"))?;
        let header = RingHeader::decode(&map).map_err(|e: RingError| e.to_string())?;
        let open = (0..header.slot_count).map(|_| std::sync::atomic::AtomicBool::new(false)).collect();
        Ok(Self { map, header, pagemap: std::sync::OnceLock::new(), open })
    }

    /// Slot `k`'s byte range in the mapping, when it lies inside it.
    fn slot_bounds(&self, k: u32) -> Option<std::ops::Range<usize>> {
        self.header.slot_range(k).filter(|r| r.end <= self.map.len())
    }

    /// Sets slot `k`'s pages' protection (page-aligned: slots start and end on page boundaries).
    fn protect(&self, k: u32, flags: rustix::mm::MprotectFlags) -> std::io::Result<()> {
        let Some(range) = self.slot_bounds(k) else { return Ok(()) };
        // SAFETY: the range lies inside this mapping, which lives as long as `self`; changing its
        // protection moves no byte, and no Rust code here writes through it (writes come from
        // the trainer's tensors, into this process's private copies of the pages).
        unsafe {
            let at = self.map.as_ptr().add(range.start) as *mut std::ffi::c_void;
            rustix::mm::mprotect(at, range.end - range.start, flags)
        }
        .map_err(std::io::Error::from)
    }

    /// Lets this process write into slot `k` (a torch tensor over it may be written in place):
    /// its pages stay the memfd's until written, then are this process's own copies. Once per
    /// slot; it stays open.
    pub fn open_slot(&self, k: u32) -> std::io::Result<()> {
        let Some(open) = usize::try_from(k).ok().and_then(|i| self.open.get(i)) else { return Ok(()) };
        if open.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        self.protect(k, rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE)?;
        open.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Before slot `k`, opened with [`Self::open_slot`], goes back to the daemon: whatever this
    /// process wrote there is dropped (its private copies of the pages), so that the slot reads
    /// the daemon's bytes again. Most opened slots were only read: their pages are the memfd's,
    /// and discarding them would cost a fault per 64 KiB at the slot's next batch (13% of a
    /// packed epoch through `shardstream.torch`), so the pages are discarded only when
    /// [`Self::wrote_into`] finds a private one, or cannot tell.
    pub fn close_slot(&self, k: u32) -> std::io::Result<()> {
        let Some(range) = self.slot_bounds(k) else { return Ok(()) };
        if self.wrote_into(range.clone()) == Some(false) {
            return Ok(());
        }
        // SAFETY: MADV_DONTNEED on a private file mapping discards this process's copies of the
        // pages, which then read the file again; no reference into the range is used across this
        // call for its old contents: the slot's lease, the only thing handing out its bytes, is
        // being returned (see the caller), and the bytes read afterwards are the daemon's.
        unsafe {
            self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, range.start, range.end - range.start)
        }
    }

    /// True when a page of `range` (page-aligned offsets in the mapping) is this process's own
    /// copy: present or swapped, and not the memfd's page (`/proc/self/pagemap`: bit 63 present,
    /// 62 swapped, 61 file page or shared memory; these bits need no privilege). `None` when the
    /// pagemap cannot be read (a `/proc` hidden from the process): the caller then assumes so.
    fn wrote_into(&self, range: std::ops::Range<usize>) -> Option<bool> {
        use std::os::unix::fs::FileExt;
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE_OR_SHARED: u64 = 1 << 61;
        let page = rustix::param::page_size();
        let first = (self.map.as_ptr() as usize).checked_add(range.start)? / page;
        let pages = range.len().div_ceil(page);
        let pagemap = self.pagemap.get_or_init(|| std::fs::File::open("/proc/self/pagemap").ok()).as_ref()?;
        let mut entries = vec![0u8; pages.checked_mul(8)?];
        pagemap.read_exact_at(&mut entries, u64::try_from(first).ok()?.checked_mul(8)?).ok()?;
        Some(entries.chunks_exact(8).any(|e| {
            let e = u64::from_ne_bytes(e.try_into().unwrap_or([0; 8]));
            e & (PRESENT | SWAPPED) != 0 && e & FILE_OR_SHARED == 0
        }))
    }

    /// The bytes of slot `k`.
    pub fn slot(&self, k: u32) -> Option<&[u8]> {
        self.map.get(self.header.slot_range(k)?)
    }

    /// The Arrow IPC stream an `ArrowBatch` names: `length` bytes from
    /// [`ARROW_DATA_OFFSET`] of slot `k`, after [`arrow_ipc_range`] has checked the slot.
    pub fn arrow_ipc(&self, k: u32, batch_index: u64, rows: u64, length: u64) -> Result<&[u8], RingError> {
        let slot = self.slot(k).ok_or_else(|| RingError::Slot {
            slot: k,
            reason: format!("no such slot in a ring of {} slots", self.header.slot_count),
        })?;
        let range = arrow_ipc_range(slot, k, batch_index, rows, length)?;
        // In bounds: arrow_ipc_range checked the range against this very slice.
        Ok(&slot[range])
    }
}

/// Where an `ArrowBatch`'s IPC stream lies in its slot (`slot` is the slot's bytes), checked
/// before anything trusts it: the slot header's magic, batch index, no packed field descriptors
/// (`n_fields` 0), its row count against the message's row ids and its payload length against the
/// message's `length`, and the stream inside the slot.
pub fn arrow_ipc_range(
    slot: &[u8],
    k: u32,
    batch_index: u64,
    rows: u64,
    length: u64,
) -> Result<std::ops::Range<usize>, RingError> {
    let bad = |reason: String| RingError::Slot { slot: k, reason };
    let head: &[u8; SLOT_HEADER_BYTES] = slot
        .get(..SLOT_HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| bad(format!("{} bytes, shorter than its header", slot.len())))?;
    let h = SlotHeader::decode(head);
    if h.magic != SLOT_MAGIC {
        return Err(bad(format!("bad magic {:#010x}", h.magic)));
    }
    if h.batch_index != batch_index {
        return Err(bad(format!("holds batch {}, expected batch {batch_index}", h.batch_index)));
    }
    if h.n_fields != 0 {
        return Err(bad(format!("holds {} packed fields, expected an Arrow stream", h.n_fields)));
    }
    if h.n_samples != rows {
        return Err(bad(format!("holds {} rows, the message names {rows}", h.n_samples)));
    }
    if h.payload_bytes != length {
        return Err(bad(format!("holds an Arrow stream of {} bytes, the message says {length}", h.payload_bytes)));
    }
    let end = ARROW_DATA_OFFSET.checked_add(length).filter(|&e| e <= slot.len() as u64).ok_or_else(|| {
        bad(format!(
            "an Arrow stream of {length} bytes from offset {ARROW_DATA_OFFSET} does not fit the slot of {} bytes",
            slot.len()
        ))
    })?;
    // Both ends are <= slot.len(), a usize.
    Ok(ARROW_DATA_OFFSET as usize..end as usize)
}

#[derive(Debug, Default)]
struct Slots {
    maps: Vec<Option<Arc<Mapping>>>,
    /// Slots the daemon said no batch will name again (SHARD_FORGET), with what their mapping
    /// was: a later SHARD_FORGET for an eviction names the slot again, and the process's kept
    /// mapping of it must go then.
    forgotten: HashMap<usize, std::sync::Weak<Mapping>>,
    rings: HashMap<u64, Arc<RingMapping>>,
    error: Option<String>,
    closed: bool,
}

/// What the receiver thread shares with the session's users.
#[derive(Debug)]
struct Inner {
    sock: OwnedFd,
    slots: Mutex<Slots>,
    arrived: Condvar,
}

/// One attached stream session. Dropping the last handle (the stream and every batch that leases
/// through it) shuts the side channel down: the daemon then returns every lease at once.
#[derive(Debug)]
pub struct ShmSession {
    inner: Arc<Inner>,
    pid: u32,
    /// Releases not sent yet ([`Self::release`]): at most [`RELEASES_HELD`], and none while the
    /// stream waits for a batch ([`Self::waiting`]).
    held: Mutex<Held>,
    /// Batches received with a lease or ring slot and not released yet ([`Self::unreleased`]).
    unreleased: AtomicUsize,
}

#[derive(Debug, Default)]
struct Held {
    batches: Vec<u64>,
    /// Threads waiting for a batch of this session's stream right now.
    waiting: usize,
}

/// While it lives, a thread waits for a batch: releases are sent at once, from any thread (a
/// thread that drops batches while another waits for the next must not hold back the slot the
/// daemon needs to make it).
#[derive(Debug)]
pub struct Waiting<'a>(&'a ShmSession);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.held.lock().unwrap_or_else(|p| p.into_inner()).waiting -= 1;
    }
}

/// Releases a session holds back before sending them together. Each RELEASE frame wakes the
/// daemon's session thread; with batches of a few KB (a table's rows) those wake-ups, on both
/// sides, cost more than the batch. Held back, they arrive in one burst that the thread drains in
/// one wake-up. Never while the stream waits for a batch: the daemon may be waiting for exactly
/// those slots.
pub const RELEASES_HELD: usize = 4;

impl Drop for ShmSession {
    fn drop(&mut self) {
        // Wakes the receiver thread (recvmsg returns 0), which then drops the last reference to
        // the socket. In a forked child the socket is the parent's: leave it alone. Releases
        // still held need no frame: closing the session returns every lease.
        if self.pid == std::process::id() {
            let _ = rustix::net::shutdown(&self.inner.sock, rustix::net::Shutdown::Both);
        }
    }
}

fn frame_error(e: impl std::fmt::Display) -> ClientError {
    ClientError::Shm(e.to_string())
}

impl ShmSession {
    /// Connects to `socket`, presents `token`, and starts receiving descriptors on a thread.
    pub fn attach(socket: &Path, token: &[u8]) -> Result<Arc<Self>, ClientError> {
        let token: [u8; 16] = token.try_into().map_err(|_| frame_error("stream header carries no valid shm token"))?;
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| frame_error(format!("cannot create a socket: {e}")))?;
        let addr =
            rustix::net::SocketAddrUnix::new(socket).map_err(|e| frame_error(format!("bad socket path: {e}")))?;
        let gone = ClientError::Disconnected;
        rustix::net::connect(&sock, &addr)
            .map_err(|e| gone(format!("cannot connect to the shm side channel {}: {e}", socket.display())))?;
        send(&sock, &Frame::hello(&token)).map_err(|e| gone(format!("cannot attach to the shm side channel: {e}")))?;
        let (first, _) = recv(&sock).map_err(|e| gone(format!("cannot attach to the shm side channel: {e}")))?;
        let first = first.ok_or_else(|| gone("the daemon closed the shm side channel while attaching".into()))?;
        match Frame::decode(&first) {
            Ok(f) if f.kind == wire::KIND_ATTACHED => {}
            Ok(f) if f.kind == wire::KIND_ERROR => {
                return Err(frame_error(format!("daemon refused attach: {}", f.message())));
            }
            Ok(f) => return Err(frame_error(format!("unexpected frame kind {} while attaching", f.kind))),
            Err(e) => return Err(frame_error(e)),
        }
        // Before this stream's shards arrive: mappings kept of files that are gone let go of
        // their disk space now, and the ones this stream finds are still valid.
        retained::prune();
        let inner = Arc::new(Inner { sock, slots: Mutex::default(), arrived: Condvar::new() });
        let reader = inner.clone();
        std::thread::Builder::new()
            .name("shardstream-shm".into())
            .spawn(move || reader.receive_loop())
            .map_err(|e| frame_error(format!("cannot start the shm receiver thread: {e}")))?;
        Ok(Arc::new(Self { inner, pid: std::process::id(), held: Mutex::default(), unreleased: AtomicUsize::new(0) }))
    }

    /// The mapping of `slot`, waiting briefly for its descriptor if it is still in flight.
    pub fn mapping(&self, slot: u32) -> Result<Arc<Mapping>, ClientError> {
        self.inner.mapping(slot)
    }

    /// The ring segment `id` of a packed stream, waiting briefly for its descriptor.
    pub fn ring(&self, id: u64) -> Result<Arc<RingMapping>, ClientError> {
        self.inner.ring(id)
    }

    /// Opens slot `slot` of ring `id` for writes ([`RingMapping::open_slot`]): its batch is handed
    /// out as torch tensors, which may be written in place.
    pub fn open_slot(&self, ring: &RingMapping, id: u64, slot: u32) -> Result<(), ClientError> {
        ring.open_slot(slot).map_err(|e| {
            ClientError::Shm(format!(
                "cannot open slot {slot} of ring {id} for writes (a tensor written in place): {e}"
            ))
        })
    }

    /// Closes a slot [`Self::open_slot`] opened, dropping what this process wrote there, before
    /// it goes back ([`RingMapping::close_slot`]). Should the kernel refuse (a locked mapping:
    /// `mlockall`), the ring is taken out of use and the stream fails on its next batch in it,
    /// naming why: the slot's next batches would otherwise show what this process wrote.
    pub fn close_slot(&self, ring: &RingMapping, id: u64, slot: u32) {
        if let Err(e) = ring.close_slot(slot) {
            let mut s = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
            s.rings.remove(&id);
            s.error.get_or_insert(format!(
                "cannot drop what this process wrote into slot {slot} of ring {id} (a tensor written in place): {e}"
            ));
            drop(s);
            self.inner.arrived.notify_all();
        }
    }

    /// Tells the daemon this batch's shards or slot are no longer used: at once, or with the
    /// next few ([`RELEASES_HELD`]), and at once while a thread waits for a batch. Never blocks
    /// for long: a frame is 64 bytes and the daemon reads them as they come.
    pub fn release(&self, batch: u64) {
        // Saturating: a batch released that was never counted (a test's made-up index) must not
        // wrap the count.
        let _ = self.unreleased.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if self.pid != std::process::id() {
            return;
        }
        let send = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            held.batches.push(batch);
            (held.waiting > 0 || held.batches.len() >= RELEASES_HELD).then(|| std::mem::take(&mut held.batches))
        };
        if let Some(batches) = send {
            self.send_releases(&batches);
        }
    }

    /// A batch holding a lease or ring slot arrived: counted until [`Self::release`]d.
    pub fn received_leased(&self) {
        self.unreleased.fetch_add(1, Ordering::AcqRel);
    }

    /// Batches that arrived with a lease or ring slot and are not released yet: those the
    /// process still refers to, and those queued for it.
    pub fn unreleased(&self) -> usize {
        self.unreleased.load(Ordering::Acquire)
    }

    /// The fewest slots of the packed or Arrow rings the stream has announced so far: each
    /// unreleased batch of one holds a slot of it, whatever credits are left.
    pub fn ring_slots(&self) -> Option<u32> {
        let s = self.inner.slots.lock().unwrap_or_else(|p| p.into_inner());
        s.rings.values().map(|r| r.header.slot_count).min()
    }

    /// Tells the daemon now, with any releases held back.
    pub fn release_now(&self, batch: u64) {
        self.release(batch);
        self.flush_releases();
    }

    /// Marks a wait for the stream's next batch until the guard is dropped, sending the
    /// releases held back first: the daemon may need their slots to make that batch.
    pub fn waiting(&self) -> Waiting<'_> {
        let batches = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            held.waiting += 1;
            std::mem::take(&mut held.batches)
        };
        if self.pid == std::process::id() {
            self.send_releases(&batches);
        }
        Waiting(self)
    }

    /// Sends the releases held back.
    pub fn flush_releases(&self) {
        if self.pid != std::process::id() {
            return;
        }
        let batches = std::mem::take(&mut self.held.lock().unwrap_or_else(|p| p.into_inner()).batches);
        self.send_releases(&batches);
    }

    fn send_releases(&self, batches: &[u64]) {
        for &batch in batches {
            let _ = send(&self.inner.sock, &Frame::new(wire::KIND_RELEASE, batch, 0));
        }
    }

    /// The stream is closed: batches from `first_unreceived` on will never be used.
    pub fn stream_end(&self, first_unreceived: u64) {
        if self.pid == std::process::id() {
            self.flush_releases();
            let _ = send(&self.inner.sock, &Frame::new(wire::KIND_STREAM_END, first_unreceived, 0));
        }
    }

    /// Sends a raw frame (for tests of the daemon's checks).
    pub fn send_raw(&self, frame: &Frame) -> std::io::Result<()> {
        send(&self.inner.sock, frame)
    }

    /// The first error the daemon reported on the side channel, if any.
    pub fn error(&self) -> Option<String> {
        self.inner.slots.lock().unwrap_or_else(|p| p.into_inner()).error.clone()
    }
}

impl Inner {
    fn receive_loop(&self) {
        loop {
            let (bytes, fds) = match recv(&self.sock) {
                Ok((Some(b), fds)) => (b, fds),
                Ok((None, _)) | Err(_) => break,
            };
            let outcome = match Frame::decode(&bytes) {
                Ok(f) if f.kind == wire::KIND_SHARD_FD => {
                    self.adopt(f.a, f.b, f.shard_in_place(), f.shard_arena(), fds)
                }
                Ok(f) if f.kind == wire::KIND_RING_FD => self.adopt_ring(f.a, f.b, fds),
                Ok(f) if f.kind == wire::KIND_SHARD_FORGET => {
                    self.forget(f.a, f.b == wire::FORGET_EVICTED);
                    Ok(())
                }
                Ok(f) if f.kind == wire::KIND_RING_RETIRE => {
                    // Arrays over it keep their own reference; only the table lets go.
                    self.slots.lock().unwrap_or_else(|p| p.into_inner()).rings.remove(&f.a);
                    Ok(())
                }
                Ok(f) if f.kind == wire::KIND_ERROR => Err(format!("daemon: {}", f.message())),
                Ok(f) => Err(format!("unexpected frame kind {}", f.kind)),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = outcome {
                let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
                s.error.get_or_insert(e);
                drop(s);
                self.arrived.notify_all();
            }
        }
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.arrived.notify_all();
    }

    /// `in_place`: a shard read in place (`SHARD_MUTABLE`), and the modification time the daemon
    /// opened it with (`SHARD_MTIME`; None from a daemon before it: the file's time now).
    fn adopt(
        &self,
        slot: u64,
        len: u64,
        in_place: Option<Option<i64>>,
        arena: bool,
        mut fds: Vec<OwnedFd>,
    ) -> Result<(), String> {
        let fd = fds.pop().ok_or("SHARD_FD frame without a descriptor")?;
        let file = std::fs::File::from(fd);
        let name = fd_name(&file, slot);
        let meta = file.metadata().map_err(|e| format!("cannot stat shard {name}: {e}"))?;
        let actual = meta.len();
        if actual != len {
            return Err(format!("shard {name} is {actual} bytes, the daemon announced {len}"));
        }
        let map = if len == 0 {
            Arc::new(Mapping { map: None, file: None, unchanged: (0, 0), name })
        } else if let Some(mtime) = in_place.filter(|_| !map_in_place()) {
            let unchanged = (len, mtime.unwrap_or_else(|| wire::mtime_ns(&meta)));
            Arc::new(Mapping { map: None, file: Some(file), unchanged, name })
        } else if arena {
            // A decoded row group's sealed segment: no later stream is sent it again, so it is
            // not kept ([`retained`]).
            check_arena(&file, &name).map_err(|e| format!("decoded row group {name}: {e}"))?;
            // SAFETY: a read-only shared mapping of a memfd sealed against shrinking and writing,
            // or of a node-cache file the daemon never writes or truncates (checked above): its
            // bytes and length never change while mapped.
            let map = unsafe { memmap2::MmapOptions::new().map(&file) };
            let map = map.map_err(|e| format!("cannot map decoded row group {name}: {e}"))?;
            // Here, on the side channel's thread, rather than page by page under the trainer's
            // first reads of the batch: a new process's first epoch faulted every page of every
            // row group in its consumer (or in the check of the views, which reads each value's
            // first bytes).
            prefault(&map);
            Arc::new(Mapping { map: Some(map), file: None, unchanged: (0, 0), name })
        } else {
            // Mapped once per process while unchanged: a later stream finds it kept.
            retained::mapping(&file, &meta, |file| {
                // SAFETY: a read-only shared mapping of a file opened read-only by the daemon;
                // its length does not change while mapped: a node-cache copy is never truncated
                // (it is unlinked, at most, and stays whole while mapped), and a shard read in
                // place is mapped only when the trainer vouched that it does not change
                // (`map_in_place`; see the module docs).
                let map = unsafe { memmap2::MmapOptions::new().map(file) };
                let map = map.map_err(|e| format!("cannot map shard {name}: {e}"))?;
                advise_huge_folios(&map);
                prefault(&map);
                Ok(Mapping { map: Some(map), file: None, unchanged: (0, 0), name })
            })?
        };
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = new_slot_index(slot, s.maps.len())?;
        if s.maps.len() <= slot {
            s.maps.resize(slot + 1, None);
        }
        s.maps[slot] = Some(map);
        drop(s);
        self.arrived.notify_all();
        Ok(())
    }

    fn adopt_ring(&self, id: u64, len: u64, mut fds: Vec<OwnedFd>) -> Result<(), String> {
        let fd = fds.pop().ok_or("RING_FD frame without a descriptor")?;
        let file = std::fs::File::from(fd);
        let ring = RingMapping::map(&file).map_err(|e| format!("ring {id}: {e}"))?;
        if ring.header.ring_id != id || ring.map.len() as u64 != len {
            return Err(format!(
                "ring {id} of {len} bytes announced, segment says ring {} of {} bytes",
                ring.header.ring_id,
                ring.map.len()
            ));
        }
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).rings.insert(id, Arc::new(ring));
        self.arrived.notify_all();
        Ok(())
    }

    /// SHARD_FORGET: no batch will name the slot again. The session drops its mapping or
    /// descriptor (batch views keep their own). When the daemon `evicted` the node-cache copy
    /// (unlinked it), the process keeps no mapping of it either ([`retained`]), so the file's
    /// disk space is freed once no view holds it any more; otherwise a kept mapping stays for
    /// the process's next stream.
    fn forget(&self, slot: u64, evicted: bool) {
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let Some(i) = usize::try_from(slot).ok().filter(|&i| i < s.maps.len()) else { return };
        let gone = match s.maps[i].take() {
            Some(map) => {
                s.forgotten.insert(i, Arc::downgrade(&map));
                Some(map)
            }
            // Forgotten before as done: its mapping lives on only if the process kept it.
            None => s.forgotten.get(&i).and_then(std::sync::Weak::upgrade),
        };
        drop(s);
        if let Some(map) = gone.filter(|_| evicted) {
            retained::forget(&map);
        }
    }

    fn ring(&self, id: u64) -> Result<Arc<RingMapping>, ClientError> {
        self.wait_for(|s| s.rings.get(&id).cloned(), || format!("ring {id}"))
    }

    fn mapping(&self, slot: u32) -> Result<Arc<Mapping>, ClientError> {
        let i = slot as usize;
        let find = |s: &Slots| match s.forgotten.contains_key(&i) {
            true => Some(Err(frame_error(format!(
                "a batch names shard slot {slot}, which the daemon said it would not name again (SHARD_FORGET)"
            )))),
            false => s.maps.get(i).cloned().flatten().map(Ok),
        };
        self.wait_for(find, || format!("shard slot {slot}"))?
    }

    /// Waits for what `find` looks up to arrive on the side channel.
    fn wait_for<T>(&self, find: impl Fn(&Slots) -> Option<T>, what: impl Fn() -> String) -> Result<T, ClientError> {
        let deadline = Instant::now() + FD_TIMEOUT;
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(found) = find(&s) {
                return Ok(found);
            }
            if let Some(e) = &s.error {
                return Err(frame_error(e));
            }
            if s.closed {
                // EOF (or a socket error) on the side channel: the daemon is gone.
                return Err(ClientError::Disconnected(format!(
                    "the shm side channel closed before {} arrived",
                    what()
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(frame_error(format!("{} did not arrive within {} s", what(), FD_TIMEOUT.as_secs())));
            }
            s = self.arrived.wait_timeout(s, deadline - now).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

/// The table index of a shard slot the daemon announces. The daemon numbers a session's slots in
/// the order it sends their descriptors on this one socket, so a slot is at most one past those
/// already known; a larger one is a malformed frame, not a reason to grow the table to its size
/// (a slot of 2^40 would have asked for 8 TiB).
fn new_slot_index(slot: u64, known: usize) -> Result<usize, String> {
    usize::try_from(slot)
        .ok()
        .filter(|&s| s <= known)
        .ok_or_else(|| format!("the daemon announced shard slot {slot}, but only {known} slots before it"))
}

fn send(sock: &impl AsFd, frame: &Frame) -> std::io::Result<()> {
    let bytes = frame.encode();
    // A send blocks while the daemon's side is full, and a signal handler (Python's have no
    // SA_RESTART) interrupts it before anything is sent: send it again.
    loop {
        match rustix::net::send(sock, &bytes, SendFlags::NOSIGNAL) {
            Err(rustix::io::Errno::INTR) => continue,
            other => return other.map(drop).map_err(Into::into),
        }
    }
}

fn recv(sock: &impl AsFd) -> std::io::Result<(Option<Vec<u8>>, Vec<OwnedFd>)> {
    let mut buf = [0u8; wire::FRAME_BYTES + 1];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let r = loop {
        match rustix::net::recvmsg(sock, &mut [IoSliceMut::new(&mut buf)], &mut anc, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other?,
        }
    };
    let mut fds = Vec::new();
    for msg in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    if r.bytes == 0 {
        return Ok((None, fds));
    }
    Ok((Some(buf[..r.bytes].to_vec()), fds))
}

/// `SHARDSTREAM_MAP_IN_PLACE=1` in the trainer's environment: the trainer vouches that the shards
/// of datasets read in place never change while it trains (a read-only snapshot, a dataset nobody
/// rewrites), so they are mapped like node-cache copies, zero-copy, instead of read into a buffer
/// per batch. The price of being wrong is the one the safe default avoids: a shard truncated while
/// mapped kills the process with SIGBUS. Read once per process (DataLoader workers inherit it).
fn map_in_place() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SHARDSTREAM_MAP_IN_PLACE").is_some_and(|v| v == "1"))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use shardstream_proto::ring::{PAGE, RING_LAYOUT_VERSION};

    use super::*;

    extern "C" fn ignore_signal(_: libc::c_int) {}

    /// A release sent while the daemon's side of the socket is full blocks; a Python signal
    /// handler (installed without SA_RESTART) or a stop and continue then interrupts it. The
    /// release must still go: one dropped holds its batch's slot for the rest of the stream.
    #[test]
    fn a_frame_send_interrupted_by_a_signal_is_sent() {
        // SAFETY: a handler that does nothing, installed without SA_RESTART; SIGUSR2 is sent to
        // the sending thread only.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()), 0);
        }
        let (client, daemon) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let frame = Frame::new(wire::KIND_RELEASE, 1, 0);
        let mut queued = 0;
        while rustix::net::send(&client, &frame.encode(), SendFlags::DONTWAIT | SendFlags::NOSIGNAL).is_ok() {
            queued += 1;
        }
        let (id_tx, id_rx) = std::sync::mpsc::channel();
        let sender = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            id_tx.send(unsafe { libc::pthread_self() }).unwrap();
            send(&client, &frame).map(|()| client)
        });
        let id = id_rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the sender is blocked in its send until the frames below are read.
        assert_eq!(unsafe { libc::pthread_kill(id, libc::SIGUSR2) }, 0);
        std::thread::sleep(Duration::from_millis(100));
        let mut buf = [0u8; wire::FRAME_BYTES];
        for _ in 0..queued {
            rustix::net::recv(&daemon, &mut buf, RecvFlags::empty()).unwrap();
        }
        // Room again: the interrupted send is the one left to arrive.
        let got = sender.join().unwrap();
        assert!(got.is_ok(), "{got:?}");
        let last = rustix::net::recv(&daemon, &mut buf, RecvFlags::DONTWAIT).map(|(n, _)| n);
        assert_eq!(last.ok(), Some(wire::FRAME_BYTES));
    }

    fn segment(header: [u8; 64]) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&header).unwrap();
        f.set_len(PAGE * 3).unwrap();
        f
    }

    /// A ring segment as the daemon makes one: a sealed memfd.
    fn sealed(header: [u8; 64], seals: rustix::fs::SealFlags) -> std::fs::File {
        let fd = rustix::fs::memfd_create("test-ring", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(&header).unwrap();
        f.set_len(PAGE * 3).unwrap();
        rustix::fs::fcntl_add_seals(&f, seals).unwrap();
        f
    }

    fn all_seals() -> rustix::fs::SealFlags {
        use rustix::fs::SealFlags;
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL
    }

    #[test]
    fn mapping_a_ring_allocates_none_of_its_pages() {
        let file = sealed(RingHeader::new(0, 2, PAGE).encode(), all_seals());
        let ring = RingMapping::map(&file).unwrap();
        assert_eq!(ring.slot(1).map(<[u8]>::len), Some(PAGE as usize));
        // Past the header page the memfd is still one hole.
        assert_eq!(rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(PAGE)), Err(rustix::io::Errno::NXIO));
    }

    /// The permissions of the mapping holding `addr` (`r--p`, `rw-p`, ...).
    fn perms(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let (range, perms) = (f.next().unwrap(), f.next().unwrap());
            let (lo, hi) = range.split_once('-').unwrap();
            if (usize::from_str_radix(lo, 16).unwrap()..usize::from_str_radix(hi, 16).unwrap()).contains(&addr) {
                return perms.to_owned();
            }
        }
        panic!("{addr:#x} is not mapped")
    }

    #[test]
    fn a_write_into_an_open_slot_stays_in_this_process_until_it_is_closed() {
        use rustix::fs::SealFlags;
        use std::os::unix::fs::FileExt;
        let file = sealed(RingHeader::new(0, 2, PAGE).encode(), SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL);
        let ring = RingMapping::map(&file).unwrap();
        let (slot0, slot1) = (ring.header.slot_range(0).unwrap(), ring.header.slot_range(1).unwrap());
        let base = ring.map.as_ptr() as usize;
        // The daemon's write shows through a page this process never wrote.
        file.write_at(b"one", slot1.start as u64).unwrap();
        assert_eq!(&ring.slot(1).unwrap()[..3], b"one");
        assert_eq!(perms(base + slot1.start), "r--p");
        ring.open_slot(1).unwrap();
        assert_eq!((perms(base + slot1.start), perms(base + slot0.start)), ("rw-p".into(), "r--p".into()));
        // A tensor written in place: the page is this process's copy; the memfd is untouched.
        // SAFETY: slot 1 is open for writes and nothing here holds a reference into it.
        unsafe { ((base + slot1.start) as *mut u8).copy_from_nonoverlapping(b"mine".as_ptr(), 4) };
        let mut daemon_sees = [0u8; 4];
        file.read_exact_at(&mut daemon_sees, slot1.start as u64).unwrap();
        assert_eq!(&daemon_sees[..3], b"one");
        // The copy hides the daemon's next batch in the slot until the slot is closed.
        file.write_at(b"two!", slot1.start as u64).unwrap();
        assert_eq!(&ring.slot(1).unwrap()[..4], b"mine");
        assert_eq!(ring.wrote_into(slot1.clone()), Some(true));
        assert_eq!(ring.wrote_into(slot0), Some(false), "slot 0 was only read");
        ring.close_slot(1).unwrap();
        assert_eq!(perms(base + slot1.start), "rw-p", "opened once for the ring's life");
        assert_eq!(&ring.slot(1).unwrap()[..4], b"two!");
        assert_eq!(ring.wrote_into(slot1), Some(false));
        // A slot opened but only read keeps its pages: no fault when it is read again.
        minor_faults(); // its own allocation warmed up
        let faults = minor_faults();
        ring.open_slot(1).unwrap();
        ring.close_slot(1).unwrap();
        assert_eq!(&ring.slot(1).unwrap()[..4], b"two!");
        assert_eq!(minor_faults(), faults, "a slot only read was discarded");
        // Out of range: nothing to do.
        ring.open_slot(2).unwrap();
        ring.close_slot(2).unwrap();
    }

    #[test]
    fn ring_seals_are_checked_before_mapping() {
        use rustix::fs::SealFlags;
        let good = RingHeader::new(0, 2, PAGE);
        assert_eq!(RingMapping::map(&sealed(good.encode(), all_seals())).unwrap().header, good);
        // Each required seal missing in turn: refused, naming what is missing.
        for missing in [SealFlags::SHRINK, SealFlags::GROW, SealFlags::SEAL] {
            let err = RingMapping::map(&sealed(good.encode(), all_seals() - missing)).unwrap_err();
            assert!(err.contains("not sealed"), "{missing:?}: {err}");
        }
        // A plain file cannot carry seals at all.
        let err = RingMapping::map(&segment(good.encode())).unwrap_err();
        assert!(err.contains("seal"), "{err}");
    }

    #[test]
    fn an_arena_is_a_sealed_memfd_or_a_read_only_cache_file() {
        use rustix::fs::SealFlags;
        let name = |f: &std::fs::File| fd_name(f, 0);
        let memfd = sealed([0; 64], all_seals());
        assert_eq!(check_arena(&memfd, &name(&memfd)), Ok(()));
        // A memfd missing a seal is refused: a memfd never passes as a cache file.
        let open = sealed([0; 64], all_seals() - SealFlags::FUTURE_WRITE);
        assert!(check_arena(&open, &name(&open)).unwrap_err().contains("not sealed"));
        // A kept row group: a regular file the daemon opened read-only.
        let mut kept = tempfile::NamedTempFile::new().unwrap();
        kept.write_all(b"ARROW1").unwrap();
        let read_only = std::fs::File::open(kept.path()).unwrap();
        assert_eq!(check_arena(&read_only, &name(&read_only)), Ok(()));
        // The same file open for writing is not: its bytes could change under the views.
        let writable = kept.reopen().unwrap();
        let err = check_arena(&writable, &name(&writable)).unwrap_err();
        assert!(err.contains("read-only: false"), "{err}");
    }

    #[test]
    fn a_shard_read_in_place_reports_truncation_as_a_shard_error() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        let file = f.reopen().unwrap();
        let m = Mapping { map: None, file: Some(file), unchanged: (0, 0), name: f.path().display().to_string() };
        let mut buf = [0u8; 100];
        m.read_at(&mut buf, 1000).unwrap();
        assert_eq!(buf, [7u8; 100]);
        f.as_file().set_len(1050).unwrap();
        match m.read_at(&mut buf, 1000) {
            Err(ClientError::Shard { shard, offset, reason }) => {
                assert_eq!(shard, f.path().display().to_string());
                assert_eq!(offset, Some(1000));
                assert!(reason.contains("truncated"), "{reason}");
            }
            other => panic!("expected a shard error, got {other:?}"),
        }
    }

    #[test]
    fn a_shard_read_in_place_and_rewritten_at_its_length_is_refused_after_the_read() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        let meta = f.as_file().metadata().unwrap();
        let m = Mapping {
            map: None,
            file: Some(f.reopen().unwrap()),
            unchanged: (4096, wire::mtime_ns(&meta)),
            name: f.path().display().to_string(),
        };
        let mut buf = [0u8; 100];
        m.read_at(&mut buf, 1000).unwrap();
        m.check_unchanged().unwrap();
        // Rewritten in place at the same length: every read still succeeds, with other bytes.
        // The time is set apart from the first write's, which a coarse clock might repeat.
        use std::io::Seek;
        f.as_file_mut().rewind().unwrap();
        f.write_all(&[9u8; 4096]).unwrap();
        let later = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(2_000_000_000);
        f.as_file().set_modified(later).unwrap();
        m.read_at(&mut buf, 1000).unwrap();
        assert_eq!(buf, [9u8; 100], "the read sees the new bytes: only the check can tell");
        match m.check_unchanged() {
            Err(ClientError::Shard { shard, offset: None, reason }) => {
                assert_eq!(shard, f.path().display().to_string());
                assert!(reason.contains("changed while a stream read it") && reason.contains("time moved"), "{reason}");
            }
            other => panic!("expected a shard error, got {other:?}"),
        }
        // A mapped shard (a node-cache copy, immutable) has nothing to check.
        Mapping::unmapped("copy".into()).check_unchanged().unwrap();
    }

    /// Minor page faults of the calling thread so far (`/proc/thread-self/stat`, field 10).
    fn minor_faults() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        after_name.split(' ').nth(7).unwrap().parse().unwrap()
    }

    /// Faults taken reading one byte of every page of `map`.
    fn faults_reading_every_page(map: &[u8]) -> u64 {
        let before = minor_faults();
        for offset in (0..map.len()).step_by(4096) {
            std::hint::black_box(map[offset]);
        }
        minor_faults() - before
    }

    #[test]
    fn prefault_maps_every_page_of_a_shard() {
        // 8 MiB and a partial page: many fault-around windows and a short last one. Written a
        // page at a time, so that the page cache holds it in small folios (one large write can
        // leave folios of up to 2 MiB, each mapped by a single fault with or without prefault).
        let mut f = tempfile::tempfile().unwrap();
        for chunk in vec![5u8; (8 << 20) + 100].chunks(4096) {
            f.write_all(chunk).unwrap();
        }
        let map = |prefaulted: bool| {
            // SAFETY: a private temporary file nobody else truncates.
            let map = unsafe { memmap2::MmapOptions::new().map(&f) }.unwrap();
            if prefaulted {
                prefault(&map);
            }
            map
        };
        let pages = ((8 << 20) + 100) / 4096 + 1;
        let cold = faults_reading_every_page(&map(false));
        let warm = faults_reading_every_page(&map(true));
        assert!(cold >= 8, "{cold} faults reading a fresh mapping of {pages} pages: the measure is broken");
        // Left after `prefault`: pages its one read per 64 KiB did not map, which would be most
        // of them on a kernel whose fault-around window (`fault_around_bytes`) is smaller.
        assert!(warm * 8 <= cold, "{warm} faults after prefault, {cold} without, for {pages} pages");
        // The bytes are the file's, the last partial page included.
        let m = map(true);
        assert_eq!((m[0], m[m.len() - 1], m.len()), (5, 5, (8 << 20) + 100));
        prefault(&[]);
    }

    #[test]
    fn a_forgotten_slot_lets_go_of_its_mapping_and_is_never_looked_up_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("copy.tar");
        std::fs::write(&path, vec![4u8; 8192]).unwrap();
        let fd = || vec![OwnedFd::from(std::fs::File::open(&path).unwrap())];
        let inner = unattached();
        inner.adopt(0, 8192, None, false, fd()).unwrap();
        let held = inner.mapping(0).unwrap(); // a batch view still holding it
        inner.forget(0, true);
        let err = inner.mapping(0).unwrap_err().to_string();
        assert!(err.contains("shard slot 0") && err.contains("SHARD_FORGET"), "{err}");
        assert_eq!(held.bytes()[0], 4, "views keep their mapping");
        assert_eq!(Arc::strong_count(&held), 1, "neither the session nor the process keeps it");
        // The next slot is unaffected, and the same file sent again is mapped anew.
        inner.adopt(1, 8192, None, false, fd()).unwrap();
        assert!(!Arc::ptr_eq(&held, &inner.mapping(1).unwrap()));
        inner.forget(7, true); // unknown: ignored

        // Done with (not evicted): the session lets go, the process keeps the mapping.
        inner.forget(1, false);
        assert!(inner.mapping(1).is_err());
        let again = unattached();
        again.adopt(0, 8192, None, false, fd()).unwrap();
        let kept = again.mapping(0).unwrap();
        assert_eq!(Arc::strong_count(&kept), 3, "the session's, the kept table's, this");
        // Then evicted: named by its old slot, the kept mapping goes too.
        inner.forget(1, true);
        assert_eq!(Arc::strong_count(&kept), 2, "the other session's and this");
    }

    /// The `VmFlags` of this process's mapping that starts at `addr`.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((start, _)) = range.split_once('-')
                && let Ok(start) = usize::from_str_radix(start, 16)
            {
                inside = start == addr;
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_owned();
            }
        }
        panic!("no mapping at {addr:#x} in /proc/self/smaps");
    }

    #[test]
    fn a_mapped_shard_asks_for_huge_folios() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, vec![3u8; 4 << 20]).unwrap();
        let inner = unattached();
        inner.adopt(0, 4 << 20, None, false, vec![OwnedFd::from(std::fs::File::open(&path).unwrap())]).unwrap();
        let m = inner.mapping(0).unwrap();
        // `hg`: MADV_HUGEPAGE is set on the mapping (whether the kernel then makes 2 MiB folios
        // depends on its THP setting and the file system; bench/map_cost.py measures that).
        // A kernel built without transparent huge pages refuses the hint, and the mapping works.
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").try_exists().unwrap();
        let flags = vm_flags(m.bytes().as_ptr() as usize);
        assert_eq!(flags.split(' ').any(|f| f == "hg"), thp, "VmFlags: {flags}");
        assert_eq!(m.bytes()[(4 << 20) - 1], 3);
    }

    #[test]
    fn prefetch_is_a_no_op_past_the_end_and_for_a_shard_that_is_read() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[1u8; 4096]).unwrap();
        // SAFETY: a temporary file nobody else truncates.
        let map = unsafe { memmap2::MmapOptions::new().map(f.as_file()) }.unwrap();
        let mapped = Mapping { map: Some(map), file: None, unchanged: (0, 0), name: "mapped".into() };
        let read = Mapping { map: None, file: Some(f.reopen().unwrap()), unchanged: (0, 0), name: "read".into() };
        for offset in [0, 4095, 4096, usize::MAX] {
            mapped.prefetch(offset);
            read.prefetch(offset);
        }
        assert_eq!(mapped.bytes()[4095], 1);
    }

    /// A daemon's end of the side channel for one session: attached, then read by the test.
    fn attached_session() -> (Arc<ShmSession>, OwnedFd, tempfile::TempDir) {
        use rustix::net::{SocketAddrUnix, SocketFlags};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shm");
        let listener =
            rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
        rustix::net::bind(&listener, &SocketAddrUnix::new(&path).unwrap()).unwrap();
        rustix::net::listen(&listener, 1).unwrap();
        let daemon = std::thread::spawn(move || {
            let conn = rustix::net::accept_with(&listener, SocketFlags::CLOEXEC).unwrap();
            let hello = Frame::decode(&recv(&conn).unwrap().0.unwrap()).unwrap();
            assert_eq!(hello.kind, wire::KIND_HELLO);
            send(&conn, &Frame::new(wire::KIND_ATTACHED, 0, 0)).unwrap();
            conn
        });
        let session = ShmSession::attach(&path, &[1; 16]).unwrap();
        (session, daemon.join().unwrap(), dir)
    }

    /// The batches of the RELEASE frames the daemon's end can read now, without waiting.
    fn releases_sent(conn: &OwnedFd) -> Vec<u64> {
        let mut out = Vec::new();
        let mut buf = [0u8; wire::FRAME_BYTES];
        while let Ok(n) = rustix::net::recv(conn, &mut buf, RecvFlags::DONTWAIT) {
            let f = Frame::decode(&buf[..n.0]).unwrap();
            assert_eq!(f.kind, wire::KIND_RELEASE);
            out.push(f.a);
        }
        out
    }

    #[test]
    fn releases_are_held_back_until_a_few_or_a_wait_and_never_during_one() {
        let (session, daemon, _dir) = attached_session();
        for b in 0..RELEASES_HELD as u64 - 1 {
            session.release(b);
        }
        assert_eq!(releases_sent(&daemon), Vec::<u64>::new(), "held back");
        session.release(99);
        let mut want: Vec<u64> = (0..RELEASES_HELD as u64 - 1).collect();
        want.push(99);
        assert_eq!(releases_sent(&daemon), want, "sent together once there are RELEASES_HELD");

        session.release(100);
        let waiting = session.waiting();
        assert_eq!(releases_sent(&daemon), vec![100], "a wait sends what was held back");
        session.release(101);
        assert_eq!(releases_sent(&daemon), vec![101], "during a wait, at once");
        drop(waiting);
        session.release(102);
        assert_eq!(releases_sent(&daemon), Vec::<u64>::new(), "held back again after it");
        session.flush_releases();
        assert_eq!(releases_sent(&daemon), vec![102]);
        session.release(103);
        session.stream_end(104);
        assert_eq!(releases_sent_then_end(&daemon), (vec![103], 104), "the stream's end sends them first");
    }

    /// Like [`releases_sent`], up to the STREAM_END frame, whose batch index it returns too.
    fn releases_sent_then_end(conn: &OwnedFd) -> (Vec<u64>, u64) {
        let mut out = Vec::new();
        let mut buf = [0u8; wire::FRAME_BYTES];
        loop {
            let n = rustix::net::recv(conn, &mut buf, RecvFlags::DONTWAIT).unwrap().0;
            let f = Frame::decode(&buf[..n]).unwrap();
            match f.kind {
                wire::KIND_RELEASE => out.push(f.a),
                wire::KIND_STREAM_END => return (out, f.a),
                k => panic!("unexpected frame kind {k}"),
            }
        }
    }

    /// Found reviewing the side-channel readers for the fuzz targets: a SHARD_FD frame's slot
    /// number sized the client's slot table, unchecked.
    #[test]
    fn a_shard_slot_past_the_next_one_is_refused_without_growing_the_table() {
        let inner = Inner {
            sock: OwnedFd::from(tempfile::tempfile().unwrap()),
            slots: Mutex::default(),
            arrived: Condvar::new(),
        };
        let shard = || {
            let mut f = tempfile::tempfile().unwrap();
            f.write_all(b"abc").unwrap();
            vec![OwnedFd::from(f)]
        };
        let err = inner.adopt(1 << 40, 3, None, false, shard()).unwrap_err();
        assert!(err.contains("slot 1099511627776") && err.contains("only 0 slots"), "{err}");
        inner.adopt(0, 3, None, false, shard()).unwrap();
        inner.adopt(1, 3, None, false, shard()).unwrap();
        inner.adopt(1, 3, None, false, shard()).unwrap();
        assert!(inner.adopt(3, 3, None, false, shard()).is_err());
        assert!(inner.adopt(u64::MAX, 3, None, false, shard()).is_err());
        assert_eq!(inner.slots.lock().unwrap().maps.len(), 2);
        assert_eq!(inner.mapping(1).unwrap().bytes(), b"abc");
    }

    /// The receiving end of a session, without a socket: what [`Inner::adopt`] needs.
    fn unattached() -> Inner {
        let sock = OwnedFd::from(tempfile::tempfile().unwrap());
        Inner { sock, slots: Mutex::default(), arrived: Condvar::new() }
    }

    #[test]
    fn a_later_stream_uses_the_mapping_an_earlier_one_made_of_an_unchanged_shard() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.tar");
        std::fs::write(&path, vec![7u8; 3 << 16]).unwrap();
        let fd = || vec![OwnedFd::from(std::fs::File::open(&path).unwrap())];
        let adopted = |fds| {
            let inner = unattached();
            inner.adopt(0, 3 << 16, None, false, fds).unwrap();
            inner.mapping(0).unwrap()
        };
        let first = adopted(fd());
        let second = adopted(fd());
        assert!(Arc::ptr_eq(&first, &second), "the second stream maps the shard again");
        drop((first, second));
        let kept = adopted(fd());
        assert_eq!(kept.bytes()[5], 7, "kept after its streams let go of it");

        // Rewritten in place (same inode, same size): its times changed, so it is mapped anew.
        std::thread::sleep(Duration::from_millis(10));
        std::fs::write(&path, vec![9u8; 3 << 16]).unwrap();
        let rewritten = adopted(fd());
        assert!(!Arc::ptr_eq(&kept, &rewritten));
        assert_eq!(rewritten.bytes()[5], 9);

        // A file with no name (unlinked) is mapped, never kept.
        let unnamed = || {
            let mut f = tempfile::tempfile().unwrap();
            f.write_all(&[1u8; 4096]).unwrap();
            f
        };
        let f = unnamed();
        let a = {
            let inner = unattached();
            inner.adopt(0, 4096, None, false, vec![OwnedFd::from(f.try_clone().unwrap())]).unwrap();
            inner.mapping(0).unwrap()
        };
        let inner = unattached();
        inner.adopt(0, 4096, None, false, vec![OwnedFd::from(f)]).unwrap();
        assert!(!Arc::ptr_eq(&a, &inner.mapping(0).unwrap()));
    }

    #[test]
    fn an_arrow_slot_is_checked_before_its_stream_is_trusted() {
        let mut slot = vec![0u8; PAGE as usize];
        let payload = b"arrow ipc bytes";
        slot[..64].copy_from_slice(&SlotHeader::new(0, 7, 3, payload.len() as u64).encode());
        slot[64..64 + payload.len()].copy_from_slice(payload);
        let r = arrow_ipc_range(&slot, 2, 7, 3, payload.len() as u64).unwrap();
        assert_eq!(&slot[r], payload);
        let err = |s: &[u8], batch, rows, len| arrow_ipc_range(s, 2, batch, rows, len).unwrap_err().to_string();
        assert!(err(&slot, 8, 3, 15).contains("expected batch 8"));
        assert!(err(&slot, 7, 4, 15).contains("3 rows, the message names 4"));
        assert!(err(&slot, 7, 3, 16).contains("says 16"));
        assert!(err(&slot[..10], 7, 3, 15).contains("shorter than its header"));
        // A length the header agrees with but the slot cannot hold, or that overflows.
        for huge in [PAGE, u64::MAX] {
            let mut s = slot.clone();
            s[..64].copy_from_slice(&SlotHeader::new(0, 7, 3, huge).encode());
            assert!(err(&s, 7, 3, huge).contains("does not fit"), "{huge}");
        }
        let mut packed = slot.clone();
        packed[..64].copy_from_slice(&SlotHeader::new(1, 7, 3, 15).encode());
        assert!(err(&packed, 7, 3, 15).contains("packed fields"));
        let mut foreign = slot;
        foreign[0] = b'X';
        assert!(err(&foreign, 7, 3, 15).contains("bad magic"));
    }

    #[test]
    fn a_ring_of_another_layout_version_is_refused_naming_both() {
        let good = RingHeader::new(0, 2, PAGE);
        assert_eq!(RingMapping::map(&sealed(good.encode(), all_seals())).unwrap().header, good);
        let mut other = good.encode();
        other[4..6].copy_from_slice(&(RING_LAYOUT_VERSION + 1).to_le_bytes());
        let err = RingMapping::map(&sealed(other, all_seals())).unwrap_err();
        assert!(
            err.contains(&format!("version {}", RING_LAYOUT_VERSION + 1))
                && err.contains(&format!("version {RING_LAYOUT_VERSION}")),
            "{err}"
        );
        // A header whose slots run past the segment is refused too.
        let too_big = RingHeader::new(0, 9, PAGE).encode();
        assert!(RingMapping::map(&sealed(too_big, all_seals())).unwrap_err().contains("does not fit"));
    }
}
