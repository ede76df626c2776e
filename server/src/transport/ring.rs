//! Packed mode, daemon side: the ring segments batches are gathered into (layout and byte diagram
//! in `shardstream_proto::ring`), and the slot state machine that keeps the daemon from writing
//! into a slot its client still reads.
//!
//! A ring is a `memfd` (no name in any file system, so nothing is left behind by a crash of either
//! side: the kernel frees it with the last descriptor and mapping), sized once and sealed against
//! shrinking, growing and any new writable mapping or `write(2)` (`F_SEAL_FUTURE_WRITE`) before its
//! descriptor leaves the daemon. The daemon keeps the one writable mapping it made before sealing;
//! a client can only ever map the segment read-only, and the segment cannot shrink under its
//! mapping (no SIGBUS).
//!
//! [`SlotTable`] does no I/O: `Free -> Filling` (the producer gathers into it) `-> Held(batch)`
//! (sent; the client reads it) `-> Free` (released, or the client is gone).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{MemfdFlags, SealFlags};
use shardstream_proto::ring::{PAGE, RingHeader, round_up};

use crate::{Error, Result};

/// Slots per ring by default, which are also the credits of a packed stream: the client's
/// read-ahead (four batches) plus the stream's queue (two), the batch being trained on, and one
/// being gathered.
pub const RING_SLOTS: u32 = 8;

/// Largest ring segment. A slot is a whole batch, so this bounds a packed batch to 512 MiB: far
/// past any sensible batch, and it keeps one stream from pinning more than 4 GiB of memory.
pub const MAX_RING_BYTES: u64 = 4 << 30;

/// What a slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// The producer is writing the batch into it.
    Filling,
    /// The client holds this batch: the daemon must not write here.
    Held(u64),
}

/// The slots of one ring (pure state machine).
#[derive(Debug, Clone)]
pub struct SlotTable {
    states: Vec<SlotState>,
    /// Where the next search for a free slot starts: slots are used round-robin, so a slot just
    /// released is the last to be rewritten.
    next: usize,
}

impl SlotTable {
    pub fn new(slots: u32) -> Self {
        Self { states: vec![SlotState::Free; slots as usize], next: 0 }
    }

    /// A free slot, now `Filling`; None when every slot is in use.
    pub fn acquire(&mut self) -> Option<u32> {
        let n = self.states.len();
        let k = (0..n).map(|i| (self.next + i) % n).find(|&k| self.states[k] == SlotState::Free)?;
        self.states[k] = SlotState::Filling;
        self.next = (k + 1) % n;
        u32::try_from(k).ok()
    }

    /// `Filling -> Held(batch)`; false (and nothing changes) from any other state.
    pub fn publish(&mut self, slot: u32, batch: u64) -> bool {
        self.transition(slot, SlotState::Filling, SlotState::Held(batch))
    }

    /// `Filling -> Free`: the batch was never sent.
    pub fn abandon(&mut self, slot: u32) -> bool {
        self.transition(slot, SlotState::Filling, SlotState::Free)
    }

    /// `Held(batch) -> Free`; false if the slot does not hold that batch.
    pub fn release(&mut self, slot: u32, batch: u64) -> bool {
        self.transition(slot, SlotState::Held(batch), SlotState::Free)
    }

    fn transition(&mut self, slot: u32, from: SlotState, to: SlotState) -> bool {
        match self.states.get_mut(slot as usize) {
            Some(s) if *s == from => {
                *s = to;
                true
            }
            _ => false,
        }
    }

    pub fn state(&self, slot: u32) -> Option<SlotState> {
        self.states.get(slot as usize).copied()
    }

    /// True when no slot is filling or held.
    pub fn is_idle(&self) -> bool {
        self.states.iter().all(|s| *s == SlotState::Free)
    }
}

/// One ring segment, mapped writable in the daemon only.
#[derive(Debug)]
pub struct Ring {
    pub header: RingHeader,
    fd: OwnedFd,
    map: memmap2::MmapRaw,
    /// The hub's count of ring bytes alive (status, metrics), decremented on drop.
    alive: Arc<AtomicU64>,
    /// The ring's share of the daemon's `--packed-budget`, given back when the ring goes.
    budget: Option<super::budget::Reservation>,
    /// Per slot, the bytes from its start whose pages are allocated (whole pages): see
    /// [`Ring::prepare`].
    populated: Box<[AtomicU64]>,
}

impl Ring {
    /// Creates, maps, writes the header of, and seals a ring of `slot_count` slots of
    /// `slot_bytes` (a multiple of the page size).
    pub fn create(ring_id: u64, slot_count: u32, slot_bytes: u64, alive: Arc<AtomicU64>) -> Result<Self> {
        let header = RingHeader::new(ring_id, slot_count, slot_bytes);
        let bytes = header
            .segment_bytes()
            .filter(|&b| b <= MAX_RING_BYTES && slot_bytes.is_multiple_of(PAGE))
            .ok_or_else(|| Error::Internal(format!("ring of {slot_count} x {slot_bytes} bytes is not allowed")))?;
        let fail =
            |what: &str, e: std::io::Error| Error::Unavailable(format!("cannot {what} a shared-memory ring: {e}"));
        // The name only shows in /proc/<pid>/maps and fdinfo, to tell whose segment it is.
        let fd = rustix::fs::memfd_create(
            format!("shardstream-ring-{}", std::process::id()),
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| fail("create", e.into()))?;
        rustix::fs::ftruncate(&fd, bytes).map_err(|e| fail("size", e.into()))?;
        let file = std::fs::File::from(fd);
        // Not populated: a slot's pages are allocated when a batch first needs them (`prepare`).
        let map = memmap2::MmapOptions::new().map_raw(&file).map_err(|e| fail("map", e))?;
        let fd = OwnedFd::from(file);
        let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&fd, seals).map_err(|e| fail("seal", e.into()))?;
        let populated = (0..slot_count).map(|_| AtomicU64::new(0)).collect();
        let ring = Self { header, fd, map, alive, budget: None, populated };
        let head = header.encode();
        // SAFETY: the ring is new, so no slot is handed out and nobody else maps it yet.
        unsafe { ring.bytes_mut(0..head.len()) }.copy_from_slice(&head);
        crate::metrics::ring_bytes(ring.alive.fetch_add(bytes, Ordering::Relaxed) + bytes);
        Ok(ring)
    }

    /// The ring, charged to `reservation` of the packed budget for as long as it lives.
    pub fn charged(mut self, reservation: super::budget::Reservation) -> Self {
        self.budget = Some(reservation);
        self
    }

    pub fn id(&self) -> u64 {
        self.header.ring_id
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes of the whole segment (header page and slots).
    pub fn segment_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Allocates the pages of the first `need` bytes of `slot` that no earlier batch used, in one
    /// call (`MADV_POPULATE_WRITE`) rather than a fault per page while the batch is written.
    /// Allocating a whole ring when it was made cost 7-8.5 ms for 16 MiB (~2 us a page) before
    /// its first batch, and the pages of slots larger than the batches they carry (a ring's slots
    /// at least double when a batch outgrows them) were never used. A kernel without
    /// `MADV_POPULATE_WRITE` (before 5.14) refuses it; the pages then fault in as they are
    /// written, which is only slower.
    pub fn prepare(&self, slot: u32, need: u64) {
        let (Some(range), Some(done)) = (self.header.slot_range(slot), self.populated.get(slot as usize)) else {
            return;
        };
        let want = round_up(need.min(self.header.slot_bytes), PAGE).unwrap_or(self.header.slot_bytes);
        let have = done.load(Ordering::Relaxed);
        if have >= want {
            return;
        }
        let (Ok(from), Ok(len)) = (usize::try_from(have), usize::try_from(want - have)) else { return };
        let _ = self.map.advise_range(memmap2::Advice::PopulateWrite, range.start + from, len);
        done.fetch_max(want, Ordering::Relaxed);
    }

    /// The bytes of slot `slot`, to gather a batch into.
    ///
    /// # Safety
    /// The caller must hold `slot` in the `Filling` state of this ring's [`SlotTable`], which makes
    /// it the only writer of those bytes; no `&[u8]` of them exists in the daemon (the client's
    /// read-only mapping is another process's memory).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, slot: u32) -> Option<&mut [u8]> {
        let range = self.header.slot_range(slot)?;
        // SAFETY: per this function's contract; the range lies inside the mapping, as
        // `segment_bytes` sized it.
        Some(unsafe { self.bytes_mut(range) })
    }

    /// # Safety
    /// `range` lies inside the mapping and no other reference to those bytes exists in this
    /// process while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, range: std::ops::Range<usize>) -> &mut [u8] {
        debug_assert!(range.end <= self.map.len() && range.start <= range.end);
        // SAFETY: per this function's contract; MmapRaw's pointer is valid for its length and
        // the mapping is writable (made before the seals).
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(range.start), range.end - range.start) }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        let len = self.segment_bytes();
        crate::metrics::ring_bytes(self.alive.fetch_sub(len, Ordering::Relaxed).saturating_sub(len));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn ring_is_sealed_read_only_for_everyone_else() {
        let alive = Arc::new(AtomicU64::new(0));
        let ring = Ring::create(1, 2, PAGE, alive.clone()).unwrap();
        assert_eq!(alive.load(Ordering::Relaxed), 3 * PAGE);
        // SAFETY: test code owns the new ring and no slot table hands out slot 1.
        let slot = unsafe { ring.slot_mut(1) }.unwrap();
        slot[..4].copy_from_slice(b"data");
        // What a client gets: the descriptor. It can map it read-only and see the header and data…
        let file = std::fs::File::from(ring.fd().try_clone_to_owned().unwrap());
        // SAFETY: a read-only mapping of a sealed memfd, which cannot shrink.
        let ro = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        assert_eq!(RingHeader::decode(&ro).unwrap(), ring.header);
        assert_eq!(&ro[2 * PAGE as usize..2 * PAGE as usize + 4], b"data");
        // …but never write: no writable mapping, no write(2), no resize.
        // SAFETY: expected to fail; had it succeeded, the mapping would only be dropped.
        assert!(unsafe { memmap2::MmapMut::map_mut(&file) }.is_err());
        assert!(rustix::io::pwrite(&file, b"x", 0).is_err());
        assert!(rustix::fs::ftruncate(&file, 0).is_err());
        drop(ro);
        drop(ring);
        assert_eq!(alive.load(Ordering::Relaxed), 0);
    }

    /// Where the memfd's next allocated page at or after `at` starts (its length when none).
    fn next_data(ring: &Ring, at: u64) -> u64 {
        match rustix::fs::seek(ring.fd(), rustix::fs::SeekFrom::Data(at)) {
            Ok(pos) => pos,
            Err(rustix::io::Errno::NXIO) => ring.segment_bytes(),
            Err(e) => panic!("SEEK_DATA: {e}"),
        }
    }

    #[test]
    fn a_slot_s_pages_are_allocated_when_a_batch_first_needs_them() {
        let ring = Ring::create(1, 2, 8 * PAGE, Arc::new(AtomicU64::new(0))).unwrap();
        let slot1 = ring.header.slot_range(1).unwrap().start as u64;
        assert_eq!(next_data(&ring, PAGE), ring.segment_bytes(), "only the header page at first");
        ring.prepare(1, 2 * PAGE + 1);
        assert_eq!(next_data(&ring, PAGE), slot1, "slot 0 untouched");
        // Three pages (the need rounded up), not the slot's eight.
        assert_eq!(next_data(&ring, slot1 + 3 * PAGE), ring.segment_bytes());
        assert_eq!(ring.populated[1].load(Ordering::Relaxed), 3 * PAGE);
        ring.prepare(1, PAGE);
        assert_eq!(ring.populated[1].load(Ordering::Relaxed), 3 * PAGE, "never shrinks");
        ring.prepare(1, 100 * PAGE);
        assert_eq!(ring.populated[1].load(Ordering::Relaxed), 8 * PAGE, "bounded by the slot");
        ring.prepare(7, PAGE); // no such slot: nothing happens
    }

    #[derive(Debug, Clone)]
    enum Op {
        Acquire,
        Publish(u32, u64),
        Abandon(u32),
        Release(u32, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Acquire),
            (0u32..5, 0u64..4).prop_map(|(s, b)| Op::Publish(s, b)),
            (0u32..5).prop_map(Op::Abandon),
            (0u32..5, 0u64..4).prop_map(|(s, b)| Op::Release(s, b)),
        ]
    }

    proptest! {
        /// Against a model: a slot is handed out only when free, a forged or repeated release
        /// changes nothing, and acquire fails only when every slot is taken.
        #[test]
        fn slot_table_never_hands_out_a_slot_in_use(ops in proptest::collection::vec(op(), 0..80)) {
            let mut t = SlotTable::new(4);
            let mut model = [SlotState::Free; 4];
            for op in ops {
                match op {
                    Op::Acquire => match t.acquire() {
                        Some(k) => {
                            prop_assert_eq!(model[k as usize], SlotState::Free);
                            model[k as usize] = SlotState::Filling;
                        }
                        None => prop_assert!(model.iter().all(|s| *s != SlotState::Free)),
                    },
                    Op::Publish(k, b) => {
                        let ok = model.get(k as usize) == Some(&SlotState::Filling);
                        prop_assert_eq!(t.publish(k, b), ok);
                        if ok { model[k as usize] = SlotState::Held(b); }
                    }
                    Op::Abandon(k) => {
                        let ok = model.get(k as usize) == Some(&SlotState::Filling);
                        prop_assert_eq!(t.abandon(k), ok);
                        if ok { model[k as usize] = SlotState::Free; }
                    }
                    Op::Release(k, b) => {
                        let ok = model.get(k as usize) == Some(&SlotState::Held(b));
                        prop_assert_eq!(t.release(k, b), ok);
                        if ok { model[k as usize] = SlotState::Free; }
                    }
                }
                for (k, s) in model.iter().enumerate() {
                    prop_assert_eq!(t.state(k as u32), Some(*s));
                }
                prop_assert_eq!(t.is_idle(), model.iter().all(|s| *s == SlotState::Free));
            }
        }
    }
}
