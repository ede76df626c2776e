//! The rdma stream's slot, credit and immediate rules, with no I/O (property-tested below).
//!
//! The client registers a ring of `slots` equal slots; each slot is one credit. The daemon
//! ([`SenderSlots`]) writes a batch into a free slot with `fi_writedata`, whose 32-bit immediate
//! ([`Immediate`]) names the slot and the low bits of the batch index; the batch's metadata travels
//! separately on gRPC. The client ([`Arrivals`]) exposes a batch only once both halves are there
//! and agree, in batch order, and hands the slot back with a RELEASE message.
//!
//! Two channels mean two orders: the client may see a write's remote completion, use the batch and
//! release the slot before the daemon sees its own local completion of that write. So a release of
//! a slot still `Writing` that batch is legal and frees the slot when the local completion comes.

use std::collections::{BTreeMap, VecDeque};

/// Immediates are 32 bits: verbs and EFA carry no more (`cq_data_size` 4), whatever tcp offers.
pub const IMMEDIATE_BITS: u32 = 32;

/// Packs (batch, slot) into 32 bits: the slot in the low `slot_bits`, the batch index's low bits
/// above it. The receiver knows the full batch index from the metadata and checks both parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Immediate {
    slot_bits: u32,
}

impl Immediate {
    /// The layout for a ring of `slots` slots (1..=2^16: the batch part keeps >= 16 bits, so a
    /// stale immediate 65,536 batches old is the first one that could be mistaken for a new one).
    pub fn for_slots(slots: u32) -> Option<Self> {
        if slots == 0 || slots > 1 << 16 {
            return None;
        }
        let slot_bits = u32::BITS - (slots - 1).leading_zeros();
        Some(Self { slot_bits })
    }

    pub fn encode(self, batch: u64, slot: u32) -> u32 {
        let batch_part = (batch << self.slot_bits) & u64::from(u32::MAX);
        // Lossless: masked to 32 bits above; the slot fits in slot_bits by construction.
        (batch_part as u32) | slot
    }

    /// (low batch bits, slot).
    pub fn decode(self, imm: u32) -> (u32, u32) {
        let slot_mask = (1u32 << self.slot_bits).wrapping_sub(1);
        let slot = if self.slot_bits == 0 { 0 } else { imm & slot_mask };
        let batch_low = imm.checked_shr(self.slot_bits).unwrap_or(0);
        (batch_low, slot)
    }

    /// Whether `imm` is what [`Self::encode`] gives for (batch, slot).
    pub fn matches(self, imm: u32, batch: u64, slot: u32) -> bool {
        imm == self.encode(batch, slot)
    }
}

/// A slot as the daemon sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendSlot {
    Free,
    /// `fi_writedata` posted, local completion not yet seen.
    Writing(u64),
    /// The client released it before the local completion arrived.
    WritingReleased(u64),
    /// Written; the client owns it until it releases it.
    Held(u64),
}

/// The daemon's view of one client ring: which slots it may write (its credits).
#[derive(Debug, Clone)]
pub struct SenderSlots {
    slots: Vec<SendSlot>,
    next: usize,
}

impl SenderSlots {
    pub fn new(slots: u32) -> Self {
        Self { slots: vec![SendSlot::Free; slots as usize], next: 0 }
    }

    /// A free slot for `batch`, now `Writing`; None when the client holds every credit.
    /// Round-robin, so the slot released last is rewritten last.
    pub fn acquire(&mut self, batch: u64) -> Option<u32> {
        let n = self.slots.len();
        let k = (0..n).map(|i| (self.next + i) % n).find(|&k| self.slots[k] == SendSlot::Free)?;
        self.slots[k] = SendSlot::Writing(batch);
        self.next = (k + 1) % n;
        u32::try_from(k).ok()
    }

    /// The local completion of the write into `slot`. False if no write was in flight there.
    pub fn written(&mut self, slot: u32) -> bool {
        let Some(s) = self.slots.get_mut(slot as usize) else { return false };
        match *s {
            SendSlot::Writing(b) => *s = SendSlot::Held(b),
            SendSlot::WritingReleased(_) => *s = SendSlot::Free,
            _ => return false,
        }
        true
    }

    /// The write into `slot` failed or was never delivered: the slot is free again (the batch is
    /// the caller's to resend or to fail the stream with).
    pub fn failed(&mut self, slot: u32) -> bool {
        let Some(s) = self.slots.get_mut(slot as usize) else { return false };
        match *s {
            SendSlot::Writing(_) | SendSlot::WritingReleased(_) => *s = SendSlot::Free,
            _ => return false,
        }
        true
    }

    /// The client's RELEASE(slot, batch). False (nothing changes) when the slot does not hold
    /// that batch: a confused or hostile client cannot free a slot being written for another.
    pub fn release(&mut self, slot: u32, batch: u64) -> bool {
        let Some(s) = self.slots.get_mut(slot as usize) else { return false };
        match *s {
            SendSlot::Held(b) if b == batch => *s = SendSlot::Free,
            SendSlot::Writing(b) if b == batch => *s = SendSlot::WritingReleased(b),
            _ => return false,
        }
        true
    }

    /// The client is gone: every slot it held is free. Writes still in flight stay `Writing`
    /// until their (error) completion; returns how many slots were freed.
    pub fn reclaim(&mut self) -> usize {
        let mut freed = 0;
        for s in &mut self.slots {
            match *s {
                SendSlot::Held(_) => {
                    *s = SendSlot::Free;
                    freed += 1;
                }
                SendSlot::Writing(b) => *s = SendSlot::WritingReleased(b),
                _ => {}
            }
        }
        freed
    }

    pub fn state(&self, slot: u32) -> Option<SendSlot> {
        self.slots.get(slot as usize).copied()
    }

    /// Slots not free (credits in use).
    pub fn in_use(&self) -> usize {
        self.slots.iter().filter(|s| **s != SendSlot::Free).count()
    }

    /// No write in flight: the ring's registration may be torn down.
    pub fn quiescent(&self) -> bool {
        !self.slots.iter().any(|s| matches!(s, SendSlot::Writing(_) | SendSlot::WritingReleased(_)))
    }
}

/// Why the client refuses what the daemon sent: the stream fails with this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("immediate {imm:#x} names slot {slot}, but the ring has {slots} slots")]
    NoSuchSlot { imm: u32, slot: u32, slots: u32 },
    #[error("slot {slot} was written while the client still holds it")]
    SlotInUse { slot: u32 },
    #[error("metadata for batch {batch} names slot {slot}, but the ring has {slots} slots")]
    MetaNoSuchSlot { batch: u64, slot: u32, slots: u32 },
    #[error("metadata for batch {batch} arrived twice or out of order (batch indices only increase)")]
    DuplicateMeta { batch: u64 },
    #[error("batch {batch}: its metadata says slot {slot} but the write into that slot carried immediate {imm:#x}")]
    Mismatch { batch: u64, slot: u32, imm: u32 },
}

/// A batch the client may now read from its ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready<M> {
    pub batch: u64,
    pub slot: u32,
    pub meta: M,
}

/// The client's join of immediates (which slot was written) with gRPC metadata (which batch it
/// is), releasing batches in the metadata's order. Batch indices only increase along a stream
/// (from `first_batch` on) but need not be consecutive: a DataLoader worker gets every n-th batch.
#[derive(Debug)]
pub struct Arrivals<M> {
    imm: Immediate,
    slots: u32,
    /// Immediate seen per slot, waiting for its metadata.
    written: BTreeMap<u32, u32>,
    /// Metadata in arrival order: (batch, slot, meta).
    meta: VecDeque<(u64, u32, M)>,
    /// Slots the client reads now (delivered, not yet released).
    held: Vec<bool>,
    /// The smallest batch index the next metadata may carry.
    next_batch: u64,
}

impl<M> Arrivals<M> {
    pub fn new(slots: u32, first_batch: u64) -> Option<Self> {
        Some(Self {
            imm: Immediate::for_slots(slots)?,
            slots,
            written: BTreeMap::new(),
            meta: VecDeque::new(),
            held: vec![false; slots as usize],
            next_batch: first_batch,
        })
    }

    pub fn immediate(&self) -> Immediate {
        self.imm
    }

    /// A remote-write completion with immediate `imm`.
    pub fn on_write(&mut self, imm: u32) -> Result<(), ProtocolError> {
        let (_, slot) = self.imm.decode(imm);
        if slot >= self.slots {
            return Err(ProtocolError::NoSuchSlot { imm, slot, slots: self.slots });
        }
        if self.held[slot as usize] || self.written.contains_key(&slot) {
            return Err(ProtocolError::SlotInUse { slot });
        }
        self.written.insert(slot, imm);
        Ok(())
    }

    /// The metadata of `batch`, which the daemon wrote into `slot`.
    pub fn on_meta(&mut self, batch: u64, slot: u32, meta: M) -> Result<(), ProtocolError> {
        if slot >= self.slots {
            return Err(ProtocolError::MetaNoSuchSlot { batch, slot, slots: self.slots });
        }
        if batch < self.next_batch {
            return Err(ProtocolError::DuplicateMeta { batch });
        }
        self.next_batch = batch + 1;
        self.meta.push_back((batch, slot, meta));
        Ok(())
    }

    /// The oldest batch whose metadata and write are both in, now held by the client.
    pub fn next_ready(&mut self) -> Result<Option<Ready<M>>, ProtocolError> {
        let Some(&(batch, slot, _)) = self.meta.front() else { return Ok(None) };
        let Some(&imm) = self.written.get(&slot) else { return Ok(None) };
        if !self.imm.matches(imm, batch, slot) {
            return Err(ProtocolError::Mismatch { batch, slot, imm });
        }
        self.written.remove(&slot);
        let Some((batch, slot, meta)) = self.meta.pop_front() else { return Ok(None) };
        self.held[slot as usize] = true;
        Ok(Some(Ready { batch, slot, meta }))
    }

    /// The client is done with `slot`: true if it held it (then send RELEASE to the daemon).
    pub fn release(&mut self, slot: u32) -> bool {
        match self.held.get_mut(slot as usize) {
            Some(h) if *h => {
                *h = false;
                true
            }
            _ => false,
        }
    }

    pub fn held(&self) -> usize {
        self.held.iter().filter(|h| **h).count()
    }

    /// The smallest batch index the next metadata may carry.
    pub fn next_batch(&self) -> u64 {
        self.next_batch
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn immediate_layout() {
        let imm = Immediate::for_slots(8).unwrap();
        assert_eq!(imm.encode(0, 0), 0);
        assert_eq!(imm.encode(1, 7), (1 << 3) | 7);
        assert_eq!(imm.decode(imm.encode(5, 3)), (5, 3));
        assert!(Immediate::for_slots(0).is_none());
        assert!(Immediate::for_slots((1 << 16) + 1).is_none());
        let one = Immediate::for_slots(1).unwrap();
        assert_eq!(one.decode(one.encode(9, 0)), (9, 0));
    }

    #[test]
    fn early_release_frees_the_slot_on_local_completion() {
        let mut s = SenderSlots::new(2);
        let a = s.acquire(10).unwrap();
        assert!(s.release(a, 10));
        assert_eq!(s.state(a), Some(SendSlot::WritingReleased(10)));
        assert!(s.written(a));
        assert_eq!(s.state(a), Some(SendSlot::Free));
        assert!(s.quiescent());
    }

    #[test]
    fn a_stalled_client_holds_only_its_credits() {
        let mut s = SenderSlots::new(3);
        for b in 0..3 {
            let slot = s.acquire(b).unwrap();
            assert!(s.written(slot));
        }
        assert_eq!(s.acquire(3), None);
        assert!(!s.release(0, 1), "slot 0 holds batch 0, not 1");
        assert_eq!(s.reclaim(), 3);
        assert_eq!(s.in_use(), 0);
    }

    #[test]
    fn arrivals_reject_protocol_violations() {
        let mut a: Arrivals<()> = Arrivals::new(3, 0).unwrap();
        let imm = a.immediate();
        assert!(matches!(a.on_write(imm.encode(0, 0) | 3), Err(ProtocolError::NoSuchSlot { slot: 3, .. })));
        a.on_write(imm.encode(0, 1)).unwrap();
        assert_eq!(a.on_write(imm.encode(1, 1)), Err(ProtocolError::SlotInUse { slot: 1 }));
        a.on_meta(0, 1, ()).unwrap();
        assert_eq!(a.on_meta(0, 1, ()), Err(ProtocolError::DuplicateMeta { batch: 0 }));
        assert_eq!(a.next_ready().unwrap().map(|r| (r.batch, r.slot)), Some((0, 1)));
        assert_eq!(a.on_write(imm.encode(1, 1)), Err(ProtocolError::SlotInUse { slot: 1 }));
        assert!(a.release(1));
        assert!(!a.release(1));
        a.on_write(imm.encode(2, 1)).unwrap();
        a.on_meta(1, 1, ()).unwrap();
        assert!(matches!(a.next_ready(), Err(ProtocolError::Mismatch { batch: 1, .. })));
    }

    #[test]
    fn strided_batches_of_a_dataloader_worker_are_delivered() {
        let mut a: Arrivals<()> = Arrivals::new(2, 1).unwrap();
        let imm = a.immediate();
        for (batch, slot) in [(1u64, 0u32), (3, 1), (5, 0)] {
            a.on_meta(batch, slot, ()).unwrap();
            a.on_write(imm.encode(batch, slot)).unwrap();
            let r = a.next_ready().unwrap().unwrap();
            assert_eq!((r.batch, r.slot), (batch, slot));
            assert!(a.release(slot));
        }
        assert_eq!(a.on_meta(4, 1, ()), Err(ProtocolError::DuplicateMeta { batch: 4 }));
    }

    proptest! {
        #[test]
        fn immediate_round_trips(slots in 1u32..=65_536, batch in any::<u64>(), slot_seed in any::<u32>()) {
            let imm = Immediate::for_slots(slots).unwrap();
            let slot = slot_seed % slots;
            let (low, s) = imm.decode(imm.encode(batch, slot));
            prop_assert_eq!(s, slot);
            let bits = 32 - (u32::BITS - (slots - 1).leading_zeros());
            let mask = if bits == 32 { u64::from(u32::MAX) } else { (1u64 << bits) - 1 };
            prop_assert_eq!(u64::from(low), batch & mask);
            // Two batches closer than 2^16 apart never share an immediate for the same slot.
            prop_assert!(!imm.matches(imm.encode(batch, slot), batch.wrapping_add(1), slot));
        }

        /// The whole protocol, daemon and client, under every interleaving of its four events:
        /// the daemon writes when it has a credit, local completions, remote completions and gRPC
        /// metadata arrive in independent orders, the client releases whatever it holds. Every
        /// batch is delivered exactly once, in order; no slot is written while held; credits in
        /// use never exceed the ring.
        #[test]
        fn every_batch_once_in_order_under_any_interleaving(
            slots in 1u32..6,
            batches in 0u64..40,
            choices in proptest::collection::vec(0u8..5, 0..600),
        ) {
            let mut tx = SenderSlots::new(slots);
            let mut rx: Arrivals<u64> = Arrivals::new(slots, 0).unwrap();
            let imm = rx.immediate();
            let mut next_send = 0u64;
            let mut local = Vec::new(); // (slot) local completions pending
            let mut remote = Vec::new(); // immediates in flight
            let mut metas = Vec::new(); // (batch, slot)
            let mut releases = Vec::new(); // (slot, batch) in flight back
            let mut held = Vec::new(); // (slot, batch) the client holds
            let mut delivered = Vec::new();
            let mut step = |c: u8, tx: &mut SenderSlots, rx: &mut Arrivals<u64>| -> Result<(), TestCaseError> {
                match c {
                    0 if next_send < batches => {
                        if let Some(slot) = tx.acquire(next_send) {
                            local.push(slot);
                            remote.push(imm.encode(next_send, slot));
                            metas.push((next_send, slot));
                            next_send += 1;
                        }
                    }
                    1 if !local.is_empty() => {
                        let slot = local.remove(0);
                        prop_assert!(tx.written(slot));
                    }
                    2 if !remote.is_empty() => {
                        let i = remote.remove(0);
                        rx.on_write(i).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                    3 if !metas.is_empty() => {
                        let (b, s) = metas.remove(0);
                        rx.on_meta(b, s, b).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    }
                    4 => {
                        if let Some((slot, batch)) = releases.pop() {
                            prop_assert!(tx.release(slot, batch));
                        } else if !held.is_empty() {
                            let (slot, batch) = held.remove(0);
                            prop_assert!(rx.release(slot));
                            releases.push((slot, batch));
                        }
                    }
                    _ => {}
                }
                while let Some(r) = rx.next_ready().map_err(|e| TestCaseError::fail(e.to_string()))? {
                    prop_assert_eq!(r.meta, r.batch);
                    held.push((r.slot, r.batch));
                    delivered.push(r.batch);
                }
                prop_assert!(tx.in_use() <= slots as usize);
                prop_assert!(rx.held() <= slots as usize);
                Ok(())
            };
            for c in choices {
                step(c, &mut tx, &mut rx)?;
            }
            // Drain: everything still in flight arrives, the client releases everything.
            for _ in 0..(batches as usize + 4) * 12 {
                for c in 0..5 {
                    step(c, &mut tx, &mut rx)?;
                }
            }
            prop_assert_eq!(delivered, (0..batches).collect::<Vec<_>>());
            prop_assert!(tx.quiescent());
            prop_assert_eq!(tx.in_use(), 0);
        }

        /// Whatever a client sends back, the daemon never frees a slot being written for another
        /// batch, and never gives out a slot not free.
        #[test]
        fn sender_never_reuses_a_busy_slot(ops in proptest::collection::vec((0u8..5, 0u32..6, 0u64..8), 0..120)) {
            let mut tx = SenderSlots::new(4);
            let mut next = 0u64;
            for (op, slot, batch) in ops {
                let before = tx.state(slot);
                let snapshot: Vec<_> = (0..4).map(|i| tx.state(i)).collect();
                match op {
                    0 => {
                        if let Some(s) = tx.acquire(next) {
                            prop_assert_eq!(snapshot[s as usize], Some(SendSlot::Free));
                            next += 1;
                        }
                    }
                    1 => { tx.written(slot); }
                    2 => { tx.failed(slot); }
                    3 => {
                        let ok = tx.release(slot, batch);
                        let legal = matches!(before, Some(SendSlot::Held(b)) | Some(SendSlot::Writing(b)) if b == batch);
                        prop_assert_eq!(ok, legal);
                    }
                    _ => { tx.reclaim(); }
                }
                prop_assert!(tx.in_use() <= 4);
            }
        }
    }
}
