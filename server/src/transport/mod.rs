//! How a batch's bytes reach the consumer: [`inline`] (the bytes travel inside the gRPC messages;
//! works over any connection) or [`shm`] (clients on this host map the shards and receive only
//! descriptors; with `collate="stack"`, [`packed`] gathers each batch into a slot of a per-stream
//! [`ring`] instead). The stream's first message names the transport chosen.

pub mod arrow;
pub mod budget;
pub mod inline;
pub mod packed;
pub mod rdma;
pub mod ring;
pub mod ring_pool;
pub mod shm;

use shardstream_proto::Transport;

use crate::{Error, Result};

/// Picks the transport for a stream: shared memory when the client asks for it or for "auto" and
/// sits on this host (it came over the Unix socket, which has a side channel); inline otherwise.
/// An explicit "shm" that cannot be had is an error, never a silent fallback.
pub fn negotiate(requested: i32, same_host: bool) -> Result<Transport> {
    match Transport::try_from(requested) {
        Ok(Transport::Inline) => Ok(Transport::Inline),
        Ok(Transport::Auto) => Ok(if same_host { Transport::Shm } else { Transport::Inline }),
        Ok(Transport::Shm) if same_host => Ok(Transport::Shm),
        Ok(Transport::Shm) => Err(Error::invalid(
            "transport \"shm\" needs a client on the daemon's host connected over its Unix socket; \
             use transport=\"inline\" or \"auto\" over TCP",
        )),
        // rdma is negotiated by the service (it needs the client's offer and the daemon's hub).
        Ok(Transport::Rdma) => Ok(Transport::Rdma),
        Err(_) => Err(Error::invalid(format!("unknown transport {requested}"))),
    }
}
