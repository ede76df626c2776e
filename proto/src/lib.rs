//! The contract between the shardstream daemon and its clients: the gRPC service and messages
//! generated from `proto/shardstream.proto`, plus the constants both sides must agree on.
//!
//! Everything here is versioned: the protobuf package carries the major version (`v1`), fields are
//! only ever added, and [`PROTOCOL_VERSION`] is sent on open so the daemon can refuse a client
//! that speaks a newer protocol than it does.

#![allow(clippy::large_enum_variant)]

/// Generated messages and service stubs of `shardstream.v1`.
pub mod v1 {
    tonic::include_proto!("shardstream.v1");
}

pub use v1::*;

pub mod keys;
mod le;
pub mod ring;
pub mod shm;
pub mod size;

/// Protocol version spoken by this build (sent in `OpenRequest.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest batch a stream takes (samples). Bigger batches than this are a unit mistake
/// (samples vs bytes); the Python client refuses them when the Loader is made.
pub const MAX_BATCH_SIZE: u32 = 1 << 20;

/// Largest gRPC message either side accepts. A batch of 256 samples of 1 MiB each is 256 MiB;
/// beyond that a client should use smaller batches or the shared-memory transport.
pub const MAX_MESSAGE_BYTES: usize = 512 << 20;

/// Field metadata key of an Arrow column the daemon sends as views (`binary_views`): a
/// `fixed_size_binary(16)` column of Arrow binary views into the batch's view segments (the
/// `ArrowBatch.view_slots`, in the order of the views' buffer indices); the value names the type
/// the column stands for ("binary" or "large_binary").
pub const ARROW_VIEW_KEY: &str = "shardstream.view";

/// Default Unix socket of a node daemon (where `connect="auto"` looks).
pub const DEFAULT_SOCKET: &str = "/run/shardstream/sock";

/// gRPC metadata keys with which a `DATA_LOSS` error names the corrupt shard and byte offset, so
/// clients can raise a structured error without parsing the message.
pub mod error_metadata {
    pub const SHARD: &str = "shardstream-shard";
    pub const OFFSET: &str = "shardstream-offset";
    pub const PATH: &str = "shardstream-path";
    /// The OS error number of a failed local read (`EISDIR`, `EIO`, ...), in decimal.
    pub const ERRNO: &str = "shardstream-errno";
}
