//! The shared-memory side channel: fixed-size frames on a `SOCK_SEQPACKET` Unix socket next to the
//! gRPC socket (`<socket>.shm`). It carries what gRPC cannot: file descriptors (`SCM_RIGHTS`) of the
//! shards a client maps read-only, and the client's releases of the batches it is done with.
//!
//! Every frame is one [`Frame`] of 64 bytes; a descriptor travels as ancillary data of an
//! [`KIND_SHARD_FD`] frame. Both sides check [`MAGIC`] and [`LAYOUT_VERSION`] on every frame, so a
//! client built against another layout gets an error naming both versions instead of misreading.
//!
//! ```text
//!  byte  0        4        6        8                16                24                               64
//!        ┌────────┬────────┬────────┬────────────────┬────────────────┬────────────────────────────────┐
//!        │ magic  │version │ kind   │ a (u64)        │ b (u64)        │ payload (40 bytes)             │
//!        │ u32 LE │ u16 LE │ u16 LE │                │                │                                │
//!        └────────┴────────┴────────┴────────────────┴────────────────┴────────────────────────────────┘
//!  kind   direction          a                   b                 payload
//!  HELLO  client -> daemon   flags               0                 session token (16 bytes), zeros
//!  ATTACHED daemon -> client 0                   0                 zeros
//!  SHARD_FD daemon -> client shard slot          shard length      flags (byte 0), mtime (bytes 8-15)
//!                                                                      + SCM_RIGHTS fd
//!  RELEASE client -> daemon  batch index         0                 zeros
//!  STREAM_END client->daemon first unreceived   0                 zeros
//!                            batch index (every outstanding batch from it on is released:
//!                            the client closed the stream before receiving them)
//!  ERROR  daemon -> client   error code          0                 UTF-8 message, NUL-padded
//!  RING_FD daemon -> client  ring id             segment length    zeros            + SCM_RIGHTS fd
//!  RING_RETIRE daemon->client ring id            0                 zeros
//!  SHARD_FORGET daemon->client shard slot        reason            zeros
//! ```
//!
//! RING_FD passes a packed-mode ring segment (layout in [`crate::ring`]); RING_RETIRE says no
//! batch will name that ring again (its slots are all released), so the client may unmap it once
//! its arrays are gone.
//!
//! SHARD_FD flags: [`SHARD_MUTABLE`] marks a file read in place that others may change (a
//! dataset on a local or parallel file system): a client must not map it, since a truncation
//! would kill it with SIGBUS, but read the bytes it uses with positioned reads. Without the flag
//! (node-cache copies, immutable while leased) the client maps the shard. Daemons before the flag
//! sent zeros there: a client then maps, as before. [`SHARD_ARENA`] marks a sealed memfd of a
//! decoded Parquet row group's bytes, which `binary_view` batches point into: mapped, and never
//! kept for a later stream (no later stream is sent the same segment). [`SHARD_MTIME`], with
//! [`SHARD_MUTABLE`]: payload bytes 8-15 hold the file's modification time (nanoseconds since the
//! epoch, `i64`) when the daemon opened and checked it; the client refuses the shard once its
//! length or time is not that any more, after reading a batch's samples and before handing them
//! out (a rewrite in place at the same length would otherwise read as other samples). Daemons
//! before the flag sent zeros there: a client then takes the time the file has when it arrives.
//!
//! SHARD_FORGET says no batch will name that slot again: the client drops the slot's mapping or
//! descriptor (batch views keep their own). Without it a client kept every shard of its stream
//! until the stream ended: a descriptor each (an epoch of more shards than `ulimit -n` failed),
//! page tables for every mapped byte, and the disk space of evicted node-cache copies. The reason
//! (`b`): [`FORGET_EVICTED`], the daemon unlinked the node-cache copy, so the process keeps no
//! mapping of it at all; [`FORGET_DONE`], the stream's working set moved past the shard and no
//! batch the client holds names it, so only the stream lets go (the process may keep a mapping
//! for its next stream). Sent only to a client whose HELLO carries [`HELLO_FORGETS`] (older
//! clients send zeros there and would refuse an unknown kind). A later batch that needs the shard
//! again gets it under a new slot, with a new SHARD_FD.
//!
//! A shard slot is the stream's own number for a shard (0, 1, 2, ... in the order the daemon sent
//! them, never reused); batches refer to shards by slot. Frames are native little-endian on every
//! platform.

use crate::le::{u16_at, u32_at, u64_at};

/// "SSHM" in little-endian byte order.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SSHM");
/// Bumped on any change to [`Frame`] or the meaning of a kind.
pub const LAYOUT_VERSION: u16 = 1;
pub const FRAME_BYTES: usize = 64;

pub const KIND_HELLO: u16 = 1;
pub const KIND_ATTACHED: u16 = 2;
pub const KIND_SHARD_FD: u16 = 3;
pub const KIND_RELEASE: u16 = 4;
pub const KIND_ERROR: u16 = 5;
pub const KIND_STREAM_END: u16 = 6;
pub const KIND_RING_FD: u16 = 7;
pub const KIND_RING_RETIRE: u16 = 8;
pub const KIND_SHARD_FORGET: u16 = 9;

/// HELLO flag (`a`): the client understands SHARD_FORGET.
pub const HELLO_FORGETS: u64 = 1;

/// SHARD_FORGET reasons (`b`).
pub const FORGET_EVICTED: u64 = 0;
pub const FORGET_DONE: u64 = 1;

/// SHARD_FD flag (payload byte 0): the shard may change under the reader; read, do not map.
pub const SHARD_MUTABLE: u8 = 1;
/// SHARD_FD flag (payload byte 0): a sealed segment of a decoded row group's bytes the daemon
/// made (`binary_view` Arrow streams); map it, and keep no mapping of it past its SHARD_FORGET.
pub const SHARD_ARENA: u8 = 2;
/// SHARD_FD flag (payload byte 0), with [`SHARD_MUTABLE`]: payload bytes 8-15 are the shard's
/// modification time as the daemon opened it (see the module docs).
pub const SHARD_MTIME: u8 = 4;

/// A file's modification time in nanoseconds since the epoch: what [`SHARD_MTIME`] carries, and
/// what the daemon and the client compare a shard read in place against (one definition, so the
/// daemon's record and the client's `fstat` agree to the nanosecond).
pub fn mtime_ns(meta: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    meta.mtime().saturating_mul(1_000_000_000).saturating_add(meta.mtime_nsec())
}

/// Why a shard read in place is refused after a batch's reads, when its (length, modification
/// time) `now` are not those it was `opened` with; None while unchanged. The daemon and the
/// client (for the shards it reads itself) say it alike.
pub fn changed_while_read(opened: (u64, i64), now: (u64, i64)) -> Option<String> {
    if now == opened {
        return None;
    }
    let what = if now.0 == opened.0 {
        format!("its modification time moved, from {} ns to {} ns since the epoch", opened.1, now.1)
    } else {
        format!("it is {} bytes, {} when opened", now.0, opened.0)
    };
    Some(format!(
        "changed while a stream read it ({what}): rewritten in place, so what was read may not be the samples \
         it was indexed with"
    ))
}

/// Error codes of ERROR frames.
pub const ERR_UNKNOWN_SESSION: u64 = 1;
pub const ERR_LAYOUT_VERSION: u64 = 2;
pub const ERR_NOT_HELD: u64 = 3;
pub const ERR_MALFORMED: u64 = 4;

/// One side-channel frame.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub magic: u32,
    pub version: u16,
    pub kind: u16,
    pub a: u64,
    pub b: u64,
    pub payload: [u8; 40],
}

const _: () = assert!(std::mem::size_of::<Frame>() == FRAME_BYTES);
const _: () = assert!(std::mem::align_of::<Frame>() == 8);

/// Why a received frame cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("side-channel frame of {0} bytes, expected {FRAME_BYTES}")]
    Size(usize),
    #[error("side-channel frame has bad magic {0:#010x}")]
    Magic(u32),
    #[error("shared-memory layout version {theirs} is not supported (this side speaks version {LAYOUT_VERSION})")]
    Version { theirs: u16 },
}

impl Frame {
    pub fn new(kind: u16, a: u64, b: u64) -> Self {
        Self { magic: MAGIC, version: LAYOUT_VERSION, kind, a, b, payload: [0; 40] }
    }

    /// This build's HELLO: the session token, and the flags of what it understands.
    pub fn hello(token: &[u8; 16]) -> Self {
        let mut f = Self::new(KIND_HELLO, HELLO_FORGETS, 0);
        f.payload[..16].copy_from_slice(token);
        f
    }

    pub fn error(code: u64, msg: &str) -> Self {
        let mut f = Self::new(KIND_ERROR, code, 0);
        // Cut at a char boundary so the message stays valid UTF-8.
        let mut end = msg.len().min(f.payload.len());
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        f.payload[..end].copy_from_slice(&msg.as_bytes()[..end]);
        f
    }

    /// A SHARD_FD frame for `slot`, `len` bytes long; `in_place`: the modification time of a
    /// file read in place ([`SHARD_MUTABLE`], [`SHARD_MTIME`]), None for one the client maps.
    pub fn shard_fd(slot: u64, len: u64, in_place: Option<i64>) -> Self {
        let mut f = Self::new(KIND_SHARD_FD, slot, len);
        if let Some(mtime_ns) = in_place {
            f.payload[0] |= SHARD_MUTABLE | SHARD_MTIME;
            f.payload[8..16].copy_from_slice(&mtime_ns.to_le_bytes());
        }
        f
    }

    /// A SHARD_FD frame's shard read in place ([`SHARD_MUTABLE`]), with its modification time
    /// when the frame gives it ([`SHARD_MTIME`]); None for a shard the client maps.
    pub fn shard_in_place(&self) -> Option<Option<i64>> {
        self.shard_mutable().then(|| self.shard_mtime())
    }

    /// The modification time a SHARD_FD frame gives its mutable shard ([`SHARD_MTIME`]).
    pub fn shard_mtime(&self) -> Option<i64> {
        (self.shard_mutable() && self.payload[0] & SHARD_MTIME != 0)
            .then(|| i64::from_le_bytes(self.payload[8..16].try_into().unwrap_or_default()))
    }

    /// A SHARD_FD frame of a decoded row group's segment ([`SHARD_ARENA`]).
    pub fn arena_fd(slot: u64, len: u64) -> Self {
        let mut f = Self::new(KIND_SHARD_FD, slot, len);
        f.payload[0] |= SHARD_ARENA;
        f
    }

    /// True when a SHARD_FD frame marks its segment [`SHARD_ARENA`].
    pub fn shard_arena(&self) -> bool {
        self.payload[0] & SHARD_ARENA != 0
    }

    /// True when a SHARD_FD frame marks its shard [`SHARD_MUTABLE`].
    pub fn shard_mutable(&self) -> bool {
        self.payload[0] & SHARD_MUTABLE != 0
    }

    pub fn token(&self) -> [u8; 16] {
        let mut t = [0u8; 16];
        t.copy_from_slice(&self.payload[..16]);
        t
    }

    pub fn message(&self) -> String {
        let end = self.payload.iter().position(|&b| b == 0).unwrap_or(self.payload.len());
        String::from_utf8_lossy(&self.payload[..end]).into_owned()
    }

    pub fn encode(&self) -> [u8; FRAME_BYTES] {
        let mut out = [0u8; FRAME_BYTES];
        out[0..4].copy_from_slice(&self.magic.to_le_bytes());
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&self.kind.to_le_bytes());
        out[8..16].copy_from_slice(&self.a.to_le_bytes());
        out[16..24].copy_from_slice(&self.b.to_le_bytes());
        out[24..64].copy_from_slice(&self.payload);
        out
    }

    /// Decodes and checks magic and layout version.
    pub fn decode(bytes: &[u8]) -> Result<Self, FrameError> {
        let b: &[u8; FRAME_BYTES] = bytes.try_into().map_err(|_| FrameError::Size(bytes.len()))?;
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        let version = u16_at(b, 4);
        if version != LAYOUT_VERSION {
            return Err(FrameError::Version { theirs: version });
        }
        let mut payload = [0u8; 40];
        payload.copy_from_slice(&b[24..64]);
        Ok(Self { magic, version, kind: u16_at(b, 6), a: u64_at(b, 8), b: u64_at(b, 16), payload })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_checks_version() {
        let f = Frame::hello(&[7; 16]);
        let bytes = f.encode();
        assert_eq!(&bytes[0..4], b"SSHM");
        assert_eq!(Frame::decode(&bytes).unwrap(), f);
        assert_eq!(Frame::decode(&bytes).unwrap().token(), [7; 16]);
        let mut other = bytes;
        other[4] = 9;
        let err = Frame::decode(&other).unwrap_err().to_string();
        assert!(err.contains("version 9") && err.contains(&format!("version {LAYOUT_VERSION}")), "{err}");
        assert_eq!(Frame::decode(&bytes[..10]), Err(FrameError::Size(10)));
        let mut bad = bytes;
        bad[0] = b'X';
        assert!(matches!(Frame::decode(&bad), Err(FrameError::Magic(_))));
        for in_place in [None, Some(-1), Some(1_733_000_000_123_456_789)] {
            let f = Frame::decode(&Frame::shard_fd(3, 99, in_place).encode()).unwrap();
            assert_eq!((f.kind, f.a, f.b, f.shard_mutable()), (KIND_SHARD_FD, 3, 99, in_place.is_some()));
            assert_eq!(f.shard_mtime(), in_place);
        }
        // A daemon before SHARD_MTIME: mutable, and no time given (not a time of 0).
        let mut old = Frame::new(KIND_SHARD_FD, 3, 99);
        old.payload[0] = SHARD_MUTABLE;
        assert_eq!((old.shard_mutable(), old.shard_mtime()), (true, None));
        let e = Frame::error(ERR_NOT_HELD, &"é".repeat(40));
        assert!(e.message().chars().all(|c| c == 'é'));
    }
}
