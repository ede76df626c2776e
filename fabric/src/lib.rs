//! shardstream's RDMA-capable data plane over libfabric (OFI), shared by the daemon and the client.
//!
//! - [`ffi`]: the libfabric 1.17 ABI declared by hand and loaded at run time (`dlopen` of
//!   `libfabric.so.1`, `dlvsym` at pinned symbol versions). Nothing here links libfabric or needs
//!   its headers to build, so every binary runs without it and says why `rdma` is unavailable.
//! - [`objects`]: the safe wrappers (fabric, domain, completion queue, RDM endpoint, registered
//!   memory), each closed on drop, children keeping their parents alive.
//! - [`credits`]: the pure slot / credit / immediate state machine of the ring protocol.
//! - [`handoff`]: the lock a stream's progress thread shares with the stream's users.
//! - `signals`: the process's signal handlers, kept across loading libfabric (whose PSM
//!   dependency takes over SIGINT and SIGTERM).
//!
//! The protocol (design and measurements: `shared/research/rdma-transport.md`): the client
//! registers a ring, the daemon `fi_writedata`s each batch into a free slot with a 32-bit
//! immediate naming it, per-batch metadata stays on gRPC, and the client returns the slot with a
//! small `fi_send`.

pub mod credits;
pub mod ffi;
pub mod handoff;
pub mod objects;
mod signals;
pub mod stream;

use std::collections::BTreeMap;
use std::sync::OnceLock;

pub use objects::{Completion, CompletionQueue, Domain, Endpoint, Fabric, MemoryRegion, PeerAddr, RemoteRegion};
/// What a signal's disposition is now: what the crate compares before and after loading
/// libfabric, and what a test of a process's handlers reads.
pub use signals::current as signal_disposition;

/// Environment variable naming the libfabric to load (a path, e.g. the AWS EFA installer's
/// `/opt/amazon/efa/lib/libfabric.so.1`); default: `libfabric.so.1` from the loader's path.
pub const LIBFABRIC_ENV: &str = "SHARDSTREAM_LIBFABRIC";
/// Environment variable forcing a provider (`tcp`, `tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`, `efa`);
/// libfabric's own `FI_PROVIDER` is honoured after it.
pub const PROVIDER_ENV: &str = "SHARDSTREAM_FI_PROVIDER";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "libfabric is not available: {0} (install the libfabric1 package, or set {LIBFABRIC_ENV} to a libfabric.so.1)"
    )]
    Unavailable(String),
    #[error("no libfabric provider{} offers reliable datagram endpoints with RMA writes and messages: {detail}",
        provider.as_ref().map(|p| format!(" matching {p:?}")).unwrap_or_default())]
    NoProvider { provider: Option<String>, detail: String },
    #[error("no route from this host to {peer}: {source}")]
    NoRoute { peer: std::net::IpAddr, source: std::io::Error },
    #[error(
        "this host reaches {peer} from {local}, but libfabric offers no interface with that address (it offers \
         {offered}); is that interface up and running?"
    )]
    NoInterface { peer: std::net::IpAddr, local: std::net::IpAddr, offered: String },
    #[error("{call} failed: {msg} (error {code})")]
    Call { call: &'static str, code: i32, msg: String },
    #[error(
        "registering {bytes} bytes with libfabric failed: {msg}; registration pins memory, so the memlock limit (RLIMIT_MEMLOCK, `ulimit -l`: {limit}) must allow it"
    )]
    Register { bytes: usize, msg: String, limit: String },
    #[error("could not allocate {bytes} bytes for a registered buffer: {source}")]
    Alloc { bytes: usize, source: std::io::Error },
    #[error("operation context {0} is still in flight (or out of range)")]
    ContextBusy(usize),
    #[error("range {offset}+{len} is outside the {size}-byte {what}")]
    OutOfRange { what: &'static str, offset: u64, len: u64, size: u64 },
    #[error("immediate data {data:#x} needs more than the provider's {bytes}-byte completion data")]
    ImmediateTooWide { data: u64, bytes: usize },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

static LIB: OnceLock<Result<ffi::Lib, String>> = OnceLock::new();
static SETTINGS: OnceLock<BTreeMap<String, String>> = OnceLock::new();

/// libfabric settings both ends of a stream must share. rxm (the layer under the `tcp` and
/// `verbs` providers) sizes its packets by its buffer size: with different sizes at the two ends
/// every write stalls (measured: until the daemon's 30 s credit timeout), where the same value on
/// both ends, default or not, streams. Other rxm settings were not found to matter.
pub const MUST_AGREE: &[&str] = &["FI_OFI_RXM_BUFFER_SIZE"];

/// Core providers (the part of a provider name before any `;`) that move every byte through the
/// host's CPU and kernel, sockets or shared memory: over them rdma is no faster than the inline
/// transport (bench/INLINE.md), so `transport="auto"` does not pick it.
pub const SOFTWARE_PROVIDERS: &[&str] = &["tcp", "sockets", "udp", "shm", "sm2", "net"];

/// Environment variable of a trainer listing the core providers (comma-separated, `verbs,efa`)
/// over which `transport="auto"` picks rdma, instead of every provider but
/// [`SOFTWARE_PROVIDERS`].
pub const AUTO_PROVIDERS_ENV: &str = "SHARDSTREAM_RDMA_AUTO_PROVIDERS";

/// The core of a provider name as `fi_info` gives it (`verbs;ofi_rxm` -> `verbs`).
pub fn core_provider(provider: &str) -> &str {
    provider.split(';').next().unwrap_or("").trim()
}

/// Whether `transport="auto"` picks rdma toward a daemon that streams over `provider` (empty:
/// the daemon does not serve rdma): its core is in `allowed` (the [`AUTO_PROVIDERS_ENV`] list)
/// when that is given, else it is not a [`SOFTWARE_PROVIDERS`] one.
pub fn auto_picks(provider: &str, allowed: Option<&str>) -> bool {
    let core = core_provider(provider);
    if core.is_empty() {
        return false;
    }
    match allowed {
        Some(list) => list.split(',').map(str::trim).any(|p| p == core),
        None => !SOFTWARE_PROVIDERS.contains(&core),
    }
}

/// The process's libfabric, loaded on first use; the error says why it cannot be had.
pub fn library() -> Result<&'static ffi::Lib> {
    LIB.get_or_init(|| {
        // libfabric reads its settings from the environment once, when its providers initialise
        // (the first fi_getinfo, which follows at once): what it reads is what is kept here.
        SETTINGS.get_or_init(|| {
            MUST_AGREE.iter().filter_map(|k| Some(((*k).to_owned(), std::env::var(k).ok()?))).collect()
        });
        let path = std::env::var(LIBFABRIC_ENV).unwrap_or_else(|_| "libfabric.so.1".to_owned());
        ffi::Lib::load(&path)
    })
    .as_ref()
    .map_err(|e| Error::Unavailable(e.clone()))
}

/// The [`MUST_AGREE`] settings this process's libfabric started with (empty before it is loaded).
pub fn settings() -> BTreeMap<String, String> {
    SETTINGS.get().cloned().unwrap_or_default()
}

/// Why a peer whose settings are `peer` cannot stream with this end, whose settings are `ours`:
/// each [`MUST_AGREE`] setting that differs, with both values; None when they agree.
pub fn settings_mismatch(peer: &BTreeMap<String, String>, ours: &BTreeMap<String, String>) -> Option<String> {
    let show = |v: Option<&String>| v.map_or_else(|| "unset".to_owned(), |v| format!("{v:?}"));
    let differ: Vec<String> = MUST_AGREE
        .iter()
        .filter(|k| peer.get(**k) != ours.get(**k))
        .map(|k| format!("{k} is {} on the client and {} on the daemon", show(peer.get(*k)), show(ours.get(*k))))
        .collect();
    (!differ.is_empty()).then(|| {
        format!(
            "libfabric's settings differ between the two ends ({}); rxm needs them equal, or every write stalls: \
             set them alike for the daemon and the trainer",
            differ.join("; ")
        )
    })
}

/// The provider the environment forces, if any (`SHARDSTREAM_FI_PROVIDER`, then `FI_PROVIDER`).
pub fn forced_provider() -> Option<String> {
    [PROVIDER_ENV, "FI_PROVIDER"].iter().filter_map(|k| std::env::var(k).ok()).find(|v| !v.trim().is_empty())
}

/// The library's version as "major.minor", for status output.
pub fn library_version() -> Result<String> {
    let lib = library()?;
    // SAFETY: fi_version takes no arguments and only returns a constant.
    let v = unsafe { (lib.version)() };
    Ok(format!("{}.{}", v >> 16, v & 0xffff))
}

/// Loads libfabric and lets it initialise its providers, without opening anything: what makes
/// the first stream of a process slow (Debian's 1.17 spends ~0.2 s in `libinfinipath`'s load-time
/// clock calibration and ~0.1 s in the first `fi_getinfo`, the verbs provider reading
/// `/proc/kallsyms`). Done in a parent before it forks DataLoader workers, each worker inherits
/// the loaded library and its provider list and opens its own objects in ~2 ms. No thread and no
/// libfabric object exists afterwards, so forking stays safe.
pub fn warm_up() -> Result<()> {
    let lib = library()?;
    let mut info = std::ptr::null_mut();
    // SAFETY: no hints (NULL is allowed: every provider answers); `info` receives a list that is
    // freed below and not used otherwise.
    let rc =
        unsafe { (lib.getinfo)(ffi::API_VERSION, std::ptr::null(), std::ptr::null(), 0, std::ptr::null(), &mut info) };
    if !info.is_null() {
        // SAFETY: `info` came from fi_getinfo and is freed once.
        unsafe { (lib.freeinfo)(info) };
    }
    if rc != 0 && rc != -ffi::FI_ENODATA {
        return Err(Error::Call { call: "fi_getinfo", code: -rc, msg: lib.strerror(-rc) });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn auto_picks_rdma_over_hardware_providers_or_the_ones_listed() {
        for p in ["verbs;ofi_rxm", "efa", "psm3", "cxi", "opx"] {
            assert!(auto_picks(p, None), "{p}");
        }
        for p in ["", "tcp", "tcp;ofi_rxm", "shm", "sockets", " udp ;ofi_rxd"] {
            assert!(!auto_picks(p, None), "{p:?}");
        }
        assert!(auto_picks("tcp;ofi_rxm", Some("tcp")));
        assert!(auto_picks("efa", Some("verbs, efa")));
        assert!(!auto_picks("verbs;ofi_rxm", Some("efa")));
        assert!(!auto_picks("", Some("")), "a daemon without rdma is never picked");
    }

    #[test]
    fn settings_agree_when_equal_or_both_unset() {
        assert_eq!(settings_mismatch(&map(&[]), &map(&[])), None);
        let set = map(&[("FI_OFI_RXM_BUFFER_SIZE", "4096")]);
        assert_eq!(settings_mismatch(&set, &set), None);
        // Settings outside MUST_AGREE are not compared.
        assert_eq!(settings_mismatch(&map(&[("FI_OFI_RXM_CM_PROGRESS_INTERVAL", "1")]), &map(&[])), None);
    }

    #[test]
    fn a_difference_names_the_setting_and_both_values() {
        let why = settings_mismatch(&map(&[("FI_OFI_RXM_BUFFER_SIZE", "4096")]), &map(&[])).unwrap_or_default();
        assert!(why.contains("FI_OFI_RXM_BUFFER_SIZE is \"4096\" on the client and unset on the daemon"), "{why}");
        let why = settings_mismatch(&map(&[]), &map(&[("FI_OFI_RXM_BUFFER_SIZE", "8192")])).unwrap_or_default();
        assert!(why.contains("unset on the client and \"8192\" on the daemon"), "{why}");
    }
}
