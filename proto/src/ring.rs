//! The packed-mode ring: a shared-memory segment (a sealed `memfd`) per stream, written only by the
//! daemon and mapped read-only by its client. The daemon gathers a batch's fields into one free
//! **slot**, each field as one contiguous column of equal-length records, and sends the client a
//! `PackedBatch` naming the slot; the client wraps each column in an array without copying. A slot
//! stays the client's until it releases the batch (side-channel RELEASE frame, see [`crate::shm`]):
//! the daemon never writes into a slot a client holds, and there are only `slot_count` slots, so a
//! client that never releases stalls its own stream instead of growing the daemon's memory.
//!
//! The segment's file descriptor travels once per ring over the side channel (a RING_FD frame);
//! the client checks [`RING_MAGIC`] and [`RING_LAYOUT_VERSION`] in the [`RingHeader`] before it
//! trusts anything else in the segment, and checks every [`SlotHeader`] and [`FieldDesc`] against
//! the slot's bounds before it makes an array of them.
//!
//! ```text
//!  segment (slot_bytes and data_offset are multiples of 4096)
//!  0                     64                      data_offset       + slot_bytes       + 2 x slot_bytes
//!  ┌─────────────────────┬───────── zeros ───────┬─────────────────┬─────────────────┬── ...
//!  │ RingHeader          │                       │ slot 0          │ slot 1          │
//!  └─────────────────────┴───────────────────────┴─────────────────┴─────────────────┴── ...
//!
//!  RingHeader (64 bytes)
//!  0        4        6        8        12       16               24               32               40          64
//!  ┌────────┬────────┬────────┬────────┬────────┬────────────────┬────────────────┬────────────────┬───────────┐
//!  │ magic  │version │hdr len │ slots  │ flags  │ slot_bytes u64 │ data_offset u64│ ring_id u64    │ reserved  │
//!  │ "SRNG" │ u16    │ u16=64 │ u32    │ u32=0  │                │                │                │ zeros     │
//!  └────────┴────────┴────────┴────────┴────────┴────────────────┴────────────────┴────────────────┴───────────┘
//!
//!  slot k (at data_offset + k * slot_bytes)
//!  0                  64                 64 + 32 x n_fields, rounded up to 64
//!  ┌──────────────────┬──────────────────┬───────────────────────┬───────────────────────┬── ...
//!  │ SlotHeader       │ FieldDesc x n    │ column of field 0     │ column of field 1     │
//!  └──────────────────┴──────────────────┴───────────────────────┴───────────────────────┴── ...
//!
//!  SlotHeader (64 bytes)
//!  0        4        6        8                16               24                 32              64
//!  ┌────────┬────────┬────────┬────────────────┬────────────────┬──────────────────┬───────────────┐
//!  │ magic  │n_fields│reserved│ batch_index    │ n_samples u64  │ payload_bytes u64│ reserved zeros│
//!  │ "SSLT" │ u16    │ u16    │ u64            │                │ (sum of columns) │               │
//!  └────────┴────────┴────────┴────────────────┴────────────────┴──────────────────┴───────────────┘
//!
//!  FieldDesc (32 bytes), one per field of the stream header, in that order
//!  0                8                16               24             32
//!  ┌────────────────┬────────────────┬────────────────┬──────────────┐
//!  │ offset u64     │ record_bytes   │ count u64      │ reserved     │
//!  │ (from slot     │ u64            │ (= n_samples)  │ zeros        │
//!  │  start, 64-B   │                │                │              │
//!  │  aligned)      │                │                │              │
//!  └────────────────┴────────────────┴────────────────┴──────────────┘
//!  column = count records of record_bytes each, back to back: a (count, record_bytes) array.
//! ```
//!
//! All integers are little-endian. Columns start on 64-byte boundaries so that typed views
//! (`int32` tokens, `float32` features) of them are aligned.

use crate::le::{u16_at, u32_at, u64_at};

/// "SRNG" in little-endian byte order: the first 4 bytes of a ring segment.
pub const RING_MAGIC: u32 = u32::from_le_bytes(*b"SRNG");
/// "SSLT": the first 4 bytes of a written slot.
pub const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"SSLT");
/// Bumped on any change to the structs below or to how a slot is laid out.
pub const RING_LAYOUT_VERSION: u16 = 1;
pub const RING_HEADER_BYTES: usize = 64;
pub const SLOT_HEADER_BYTES: usize = 64;
pub const FIELD_DESC_BYTES: usize = 32;
/// Slots start on page boundaries: a client maps the whole segment once, and each slot's pages are
/// only ever written by the daemon while the client does not hold it.
pub const PAGE: u64 = 4096;
/// Column alignment within a slot (a cache line; enough for any numeric dtype).
pub const COLUMN_ALIGN: u64 = 64;
/// Alignment of the buffers in the Arrow IPC streams the daemon writes (from the stream's start),
/// Arrow's recommended one; a client opens a stream where it starts at a multiple of it, so every
/// buffer is aligned in memory too.
pub const IPC_ALIGN: usize = 64;
/// Where an `ArrowBatch`'s IPC stream starts in its slot: after the slot header (whose
/// `n_fields` is 0, `n_samples` the row count and `payload_bytes` the stream's length), so the
/// stream and every Arrow buffer in it are 64-byte aligned.
pub const ARROW_DATA_OFFSET: u64 = SLOT_HEADER_BYTES as u64;

/// The segment's first 64 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingHeader {
    pub magic: u32,
    pub version: u16,
    pub header_bytes: u16,
    pub slot_count: u32,
    pub flags: u32,
    pub slot_bytes: u64,
    pub data_offset: u64,
    pub ring_id: u64,
    pub reserved: [u8; 24],
}

/// The first 64 bytes of a slot the daemon has written.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotHeader {
    pub magic: u32,
    pub n_fields: u16,
    pub reserved0: u16,
    pub batch_index: u64,
    pub n_samples: u64,
    pub payload_bytes: u64,
    pub reserved: [u8; 32],
}

/// Where one field's column lies in its slot.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldDesc {
    pub offset: u64,
    pub record_bytes: u64,
    pub count: u64,
    pub reserved: u64,
}

const _: () = assert!(std::mem::size_of::<RingHeader>() == RING_HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<SlotHeader>() == SLOT_HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<FieldDesc>() == FIELD_DESC_BYTES);
const _: () = assert!(RING_HEADER_BYTES as u64 <= PAGE && PAGE.is_multiple_of(COLUMN_ALIGN));

/// Why a ring or slot cannot be used. Every variant is a daemon bug or a foreign segment; a
/// client reports it and never reads past it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error("ring segment of {0} bytes is too small for its header")]
    Short(usize),
    #[error("ring segment has bad magic {0:#010x}")]
    Magic(u32),
    #[error(
        "shared-memory ring layout version {theirs} is not supported (this side speaks ring layout \
         version {RING_LAYOUT_VERSION})"
    )]
    Version { theirs: u16 },
    #[error("ring geometry does not fit its segment: {0}")]
    Geometry(String),
    #[error("slot {slot}: {reason}")]
    Slot { slot: u32, reason: String },
}

/// Rounds `n` up to a multiple of `to` (a power of two); None on overflow.
pub fn round_up(n: u64, to: u64) -> Option<u64> {
    Some(n.checked_add(to - 1)? & !(to - 1))
}

impl RingHeader {
    pub fn new(ring_id: u64, slot_count: u32, slot_bytes: u64) -> Self {
        Self {
            magic: RING_MAGIC,
            version: RING_LAYOUT_VERSION,
            header_bytes: RING_HEADER_BYTES as u16,
            slot_count,
            flags: 0,
            slot_bytes,
            data_offset: PAGE,
            ring_id,
            reserved: [0; 24],
        }
    }

    /// Bytes of a segment with this geometry; None on overflow.
    pub fn segment_bytes(&self) -> Option<u64> {
        self.slot_bytes.checked_mul(u64::from(self.slot_count))?.checked_add(self.data_offset)
    }

    /// Byte range of slot `k` in the segment (checked against the geometry by [`Self::decode`]).
    pub fn slot_range(&self, k: u32) -> Option<std::ops::Range<usize>> {
        if k >= self.slot_count {
            return None;
        }
        let start = self.data_offset.checked_add(self.slot_bytes.checked_mul(u64::from(k))?)?;
        let end = start.checked_add(self.slot_bytes)?;
        Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    pub fn encode(&self) -> [u8; RING_HEADER_BYTES] {
        let mut out = [0u8; RING_HEADER_BYTES];
        out[0..4].copy_from_slice(&self.magic.to_le_bytes());
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&self.header_bytes.to_le_bytes());
        out[8..12].copy_from_slice(&self.slot_count.to_le_bytes());
        out[12..16].copy_from_slice(&self.flags.to_le_bytes());
        out[16..24].copy_from_slice(&self.slot_bytes.to_le_bytes());
        out[24..32].copy_from_slice(&self.data_offset.to_le_bytes());
        out[32..40].copy_from_slice(&self.ring_id.to_le_bytes());
        out[40..64].copy_from_slice(&self.reserved);
        out
    }

    /// Decodes the header at the start of `segment` and checks magic, version, and that the
    /// slots it describes lie inside the segment.
    pub fn decode(segment: &[u8]) -> Result<Self, RingError> {
        let b = segment.get(..RING_HEADER_BYTES).ok_or(RingError::Short(segment.len()))?;
        let magic = u32_at(b, 0);
        if magic != RING_MAGIC {
            return Err(RingError::Magic(magic));
        }
        let version = u16_at(b, 4);
        if version != RING_LAYOUT_VERSION {
            return Err(RingError::Version { theirs: version });
        }
        let mut reserved = [0u8; 24];
        reserved.copy_from_slice(&b[40..64]);
        let h = Self {
            magic,
            version,
            header_bytes: u16_at(b, 6),
            slot_count: u32_at(b, 8),
            flags: u32_at(b, 12),
            slot_bytes: u64_at(b, 16),
            data_offset: u64_at(b, 24),
            ring_id: u64_at(b, 32),
            reserved,
        };
        let geometry = |why: String| Err(RingError::Geometry(why));
        if usize::from(h.header_bytes) != RING_HEADER_BYTES {
            return geometry(format!("header of {} bytes", h.header_bytes));
        }
        if h.slot_count == 0 || h.slot_bytes < SLOT_HEADER_BYTES as u64 || !h.slot_bytes.is_multiple_of(PAGE) {
            return geometry(format!("{} slots of {} bytes", h.slot_count, h.slot_bytes));
        }
        if h.data_offset < RING_HEADER_BYTES as u64 || !h.data_offset.is_multiple_of(PAGE) {
            return geometry(format!("data offset {}", h.data_offset));
        }
        match h.segment_bytes() {
            Some(n) if n <= segment.len() as u64 => Ok(h),
            n => geometry(format!("{n:?} bytes needed, segment has {}", segment.len())),
        }
    }
}

impl SlotHeader {
    pub fn new(n_fields: u16, batch_index: u64, n_samples: u64, payload_bytes: u64) -> Self {
        Self { magic: SLOT_MAGIC, n_fields, reserved0: 0, batch_index, n_samples, payload_bytes, reserved: [0; 32] }
    }

    /// Where the first column may start: after the header and the field descriptors.
    pub fn columns_start(n_fields: usize) -> Option<u64> {
        let descs = u64::try_from(n_fields).ok()?.checked_mul(FIELD_DESC_BYTES as u64)?;
        round_up(descs.checked_add(SLOT_HEADER_BYTES as u64)?, COLUMN_ALIGN)
    }

    pub fn encode(&self) -> [u8; SLOT_HEADER_BYTES] {
        let mut out = [0u8; SLOT_HEADER_BYTES];
        out[0..4].copy_from_slice(&self.magic.to_le_bytes());
        out[4..6].copy_from_slice(&self.n_fields.to_le_bytes());
        out[6..8].copy_from_slice(&self.reserved0.to_le_bytes());
        out[8..16].copy_from_slice(&self.batch_index.to_le_bytes());
        out[16..24].copy_from_slice(&self.n_samples.to_le_bytes());
        out[24..32].copy_from_slice(&self.payload_bytes.to_le_bytes());
        out[32..64].copy_from_slice(&self.reserved);
        out
    }

    pub fn decode(b: &[u8; SLOT_HEADER_BYTES]) -> Self {
        let mut reserved = [0u8; 32];
        reserved.copy_from_slice(&b[32..64]);
        Self {
            magic: u32_at(b, 0),
            n_fields: u16_at(b, 4),
            reserved0: u16_at(b, 6),
            batch_index: u64_at(b, 8),
            n_samples: u64_at(b, 16),
            payload_bytes: u64_at(b, 24),
            reserved,
        }
    }
}

impl FieldDesc {
    pub fn encode(&self) -> [u8; FIELD_DESC_BYTES] {
        let mut out = [0u8; FIELD_DESC_BYTES];
        out[0..8].copy_from_slice(&self.offset.to_le_bytes());
        out[8..16].copy_from_slice(&self.record_bytes.to_le_bytes());
        out[16..24].copy_from_slice(&self.count.to_le_bytes());
        out[24..32].copy_from_slice(&self.reserved.to_le_bytes());
        out
    }

    pub fn decode(b: &[u8; FIELD_DESC_BYTES]) -> Self {
        Self { offset: u64_at(b, 0), record_bytes: u64_at(b, 8), count: u64_at(b, 16), reserved: u64_at(b, 24) }
    }

    /// Byte range of the column within its slot; None if it overflows.
    pub fn column(&self) -> Option<std::ops::Range<u64>> {
        let len = self.record_bytes.checked_mul(self.count)?;
        Some(self.offset..self.offset.checked_add(len)?)
    }
}

/// A slot's contents, checked: what a client may turn into arrays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotView {
    pub header: SlotHeader,
    pub fields: Vec<FieldDesc>,
}

/// Reads and checks slot `slot` (its bytes are `b`) for the batch `batch_index` of a stream with
/// `n_fields` fields: magic, batch index, field count, and every column inside the slot, after
/// the descriptors, with `n_samples` records.
pub fn read_slot(b: &[u8], slot: u32, batch_index: u64, n_fields: usize) -> Result<SlotView, RingError> {
    let bad = |reason: String| RingError::Slot { slot, reason };
    let head: &[u8; SLOT_HEADER_BYTES] = b
        .get(..SLOT_HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| bad(format!("{} bytes, shorter than its header", b.len())))?;
    let header = SlotHeader::decode(head);
    if header.magic != SLOT_MAGIC {
        return Err(bad(format!("bad magic {:#010x}", header.magic)));
    }
    if header.batch_index != batch_index {
        return Err(bad(format!("holds batch {}, expected batch {batch_index}", header.batch_index)));
    }
    if usize::from(header.n_fields) != n_fields {
        return Err(bad(format!("holds {} fields, the stream has {n_fields}", header.n_fields)));
    }
    let first = SlotHeader::columns_start(n_fields).ok_or_else(|| bad("too many fields".into()))?;
    let mut fields = Vec::with_capacity(n_fields);
    for i in 0..n_fields {
        let at = SLOT_HEADER_BYTES + i * FIELD_DESC_BYTES;
        let raw: &[u8; FIELD_DESC_BYTES] = b
            .get(at..at + FIELD_DESC_BYTES)
            .and_then(|d| d.try_into().ok())
            .ok_or_else(|| bad(format!("field {i}'s descriptor lies outside the slot")))?;
        let d = FieldDesc::decode(raw);
        if d.count != header.n_samples {
            return Err(bad(format!("field {i} has {} records for {} samples", d.count, header.n_samples)));
        }
        match d.column() {
            Some(c) if c.start >= first && c.end <= b.len() as u64 && c.start.is_multiple_of(COLUMN_ALIGN) => {}
            _ => {
                return Err(bad(format!(
                    "field {i}'s column ({} records of {} bytes at {}) does not fit the slot of {} bytes",
                    d.count,
                    d.record_bytes,
                    d.offset,
                    b.len()
                )));
            }
        }
        fields.push(d);
    }
    Ok(SlotView { header, fields })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(h: &RingHeader) -> Vec<u8> {
        let mut seg = vec![0u8; h.segment_bytes().unwrap() as usize];
        seg[..RING_HEADER_BYTES].copy_from_slice(&h.encode());
        seg
    }

    #[test]
    fn ring_header_round_trips_and_checks() {
        let h = RingHeader::new(3, 4, 2 * PAGE);
        let bytes = h.encode();
        assert_eq!(&bytes[0..4], b"SRNG");
        let seg = segment(&h);
        assert_eq!(RingHeader::decode(&seg).unwrap(), h);
        assert_eq!(h.slot_range(1), Some(4096 + 8192..4096 + 16384));
        assert_eq!(h.slot_range(4), None);
        let mut other = seg.clone();
        other[4] = 7;
        let err = RingHeader::decode(&other).unwrap_err().to_string();
        assert!(err.contains("version 7") && err.contains(&format!("version {RING_LAYOUT_VERSION}")), "{err}");
        assert!(matches!(RingHeader::decode(&seg[..PAGE as usize + 10]), Err(RingError::Geometry(_))));
        assert_eq!(RingHeader::decode(&seg[..10]), Err(RingError::Short(10)));
        let mut bad = seg;
        bad[0] = b'X';
        assert!(matches!(RingHeader::decode(&bad), Err(RingError::Magic(_))));
    }

    #[test]
    fn slot_round_trips_and_refuses_forged_columns() {
        let n = 5u64;
        let mut slot = vec![0u8; PAGE as usize];
        let first = SlotHeader::columns_start(2).unwrap();
        assert_eq!(first, 128);
        let descs = [
            FieldDesc { offset: first, record_bytes: 16, count: n, reserved: 0 },
            FieldDesc { offset: first + 128, record_bytes: 4, count: n, reserved: 0 },
        ];
        slot[..64].copy_from_slice(&SlotHeader::new(2, 9, n, 100).encode());
        for (i, d) in descs.iter().enumerate() {
            slot[64 + 32 * i..96 + 32 * i].copy_from_slice(&d.encode());
        }
        let view = read_slot(&slot, 0, 9, 2).unwrap();
        assert_eq!(view.fields, descs);
        assert_eq!(view.header.payload_bytes, 100);
        assert!(read_slot(&slot, 0, 8, 2).unwrap_err().to_string().contains("expected batch 8"));
        assert!(read_slot(&slot, 0, 9, 3).is_err());
        // A column that runs past the slot, overlaps the descriptors, or overflows is refused.
        for forged in [
            FieldDesc { offset: first, record_bytes: 1 << 20, count: n, reserved: 0 },
            FieldDesc { offset: 0, record_bytes: 1, count: n, reserved: 0 },
            FieldDesc { offset: first, record_bytes: u64::MAX, count: n, reserved: 0 },
            FieldDesc { offset: u64::MAX - 1, record_bytes: 1, count: n, reserved: 0 },
        ] {
            let mut s = slot.clone();
            s[64..96].copy_from_slice(&forged.encode());
            let err = read_slot(&s, 3, 9, 2).unwrap_err();
            assert!(matches!(err, RingError::Slot { slot: 3, .. }), "{err}");
        }
    }

    #[test]
    fn round_up_overflows_to_none() {
        assert_eq!(round_up(1, PAGE), Some(PAGE));
        assert_eq!(round_up(PAGE, PAGE), Some(PAGE));
        assert_eq!(round_up(u64::MAX, PAGE), None);
    }
}
