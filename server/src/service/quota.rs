//! Streams one client may hold at once (`serve --max-streams-per-client`). `--max-streams`
//! bounds the daemon's streams over all clients; without a bound per client, one client (a
//! trainer whose idle DataLoader workers never read, or a peer holding a token) can hold every
//! permit, and every other client's stream is refused. A client is what the daemon can tell
//! apart: the uid on the Unix socket; over TCP the name its token or client certificate gives it
//! (the name the `allow` list matches), else the peer's IP address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Who a stream counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum ClientKey {
    /// A local client, by the uid its socket connection carries.
    Uid(u32),
    /// A TCP client, by its token's name or its client certificate's subject CN.
    Named(String),
    /// A TCP client without a name, by its address.
    Ip(IpAddr),
    /// A connection the daemon knows nothing of (no credentials, no address): counted together.
    Unknown,
}

impl std::fmt::Display for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientKey::Uid(uid) => write!(f, "uid {uid}"),
            ClientKey::Named(name) => write!(f, "client {name:?}"),
            ClientKey::Ip(ip) => write!(f, "{ip}"),
            ClientKey::Unknown => f.write_str("an unidentified client"),
        }
    }
}

/// The streams each client holds, against the bound (none: unbounded).
#[derive(Debug, Default)]
pub(crate) struct StreamQuota {
    limit: Option<usize>,
    open: Mutex<HashMap<ClientKey, usize>>,
}

/// One stream of a client, counted until dropped.
#[derive(Debug)]
pub(crate) struct QuotaSlot {
    quota: Arc<StreamQuota>,
    key: ClientKey,
}

impl Drop for QuotaSlot {
    fn drop(&mut self) {
        let mut open = self.quota.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

impl StreamQuota {
    pub(crate) fn new(limit: Option<usize>) -> Self {
        Self { limit, open: Mutex::default() }
    }

    /// Counts one more stream of `key` (nothing is counted without a bound); `Err(bound)` when
    /// the client holds as many as it may already.
    pub(crate) fn acquire(self: &Arc<Self>, key: ClientKey) -> Result<Option<QuotaSlot>, usize> {
        let Some(limit) = self.limit else { return Ok(None) };
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(key.clone()).or_default();
        if *n >= limit {
            return Err(limit);
        }
        *n += 1;
        Ok(Some(QuotaSlot { quota: self.clone(), key }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_client_has_its_own_bound_and_a_dropped_stream_frees_its_place() {
        let quota = Arc::new(StreamQuota::new(Some(2)));
        let a1 = quota.acquire(ClientKey::Uid(1000)).unwrap();
        let _a2 = quota.acquire(ClientKey::Uid(1000)).unwrap();
        assert_eq!(quota.acquire(ClientKey::Uid(1000)).unwrap_err(), 2);
        // Another client is not held back by the first.
        let _b = quota.acquire(ClientKey::Named("team-b".into())).unwrap();
        let _c = quota.acquire(ClientKey::Ip("10.0.0.7".parse().unwrap())).unwrap();
        drop(a1);
        let _a3 = quota.acquire(ClientKey::Uid(1000)).unwrap();
        assert!(quota.acquire(ClientKey::Uid(1000)).is_err());
    }

    #[test]
    fn without_a_bound_nothing_is_counted() {
        let quota = Arc::new(StreamQuota::new(None));
        for _ in 0..10 {
            assert!(quota.acquire(ClientKey::Unknown).unwrap().is_none());
        }
        assert!(quota.open.lock().unwrap().is_empty());
    }

    #[test]
    fn the_table_forgets_a_client_whose_streams_all_ended() {
        let quota = Arc::new(StreamQuota::new(Some(4)));
        let slots: Vec<_> = (0..3).map(|_| quota.acquire(ClientKey::Uid(7)).unwrap()).collect();
        assert_eq!(quota.open.lock().unwrap().get(&ClientKey::Uid(7)), Some(&3));
        drop(slots);
        assert!(quota.open.lock().unwrap().is_empty());
    }
}
