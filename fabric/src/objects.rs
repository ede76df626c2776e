//! Safe owners of libfabric objects: [`Fabric`] (the provider chosen by `fi_getinfo` and its
//! fabric), [`Domain`], [`CompletionQueue`], [`Endpoint`] (an RDM endpoint with its address
//! vector) and [`MemoryRegion`] (page-aligned memory this crate allocates and registers).
//!
//! Ownership mirrors libfabric's close order: a child holds an `Arc` of its parent, and closes
//! itself before that `Arc` drops. Operations in flight keep their registered buffer alive: the
//! endpoint stores an `Arc<MemoryRegion>` per operation context until that context completes, and
//! refuses to reuse a context before then. Every object requires `FI_THREAD_SAFE`, which makes
//! them `Send + Sync`.
//!
//! We ask for the strictest modes (`FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
//! FI_MR_PROV_KEY | FI_MR_ENDPOINT`, `FI_CONTEXT`, `FI_RX_CQ_DATA`) and honour whatever the
//! provider keeps, so the code paths verbs and EFA need also run on tcp and shm.

use std::cell::UnsafeCell;
use std::ffi::{CStr, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::ffi::{self, Lib};
use crate::{Error, Result, library};

fn call_err(lib: &Lib, call: &'static str, rc: isize) -> Error {
    let code = i32::try_from(-rc).unwrap_or(i32::MAX);
    Error::Call { call, code, msg: lib.strerror(code) }
}

/// Closes a fid, logging nothing: close errors at teardown have no one to go to.
///
/// # Safety
/// `fid` is an open libfabric object not closed before, and not used after.
unsafe fn close_fid(fid: *mut ffi::Fid) {
    // SAFETY: per the contract, `fid` is open; its ops table is the provider's.
    unsafe { ((*(*fid).ops).close)(fid) };
}

/// The chosen provider's `fi_info` and its open fabric.
pub struct Fabric {
    lib: &'static Lib,
    /// The list fi_getinfo returned (freed on drop).
    info_list: NonNull<ffi::Info>,
    /// The entry of that list this fabric, its domains and endpoints are opened from.
    info: NonNull<ffi::Info>,
    fabric: NonNull<ffi::FidFabric>,
    provider: String,
    mr_mode: i32,
    cq_data_size: usize,
    rx_cq_data: bool,
    /// False for shm (1.17): its `fi_cq_sread` waits by yielding and never returns on timeout,
    /// so a caller that must also watch another channel would hang.
    sread_honours_timeout: bool,
}

// SAFETY: the domain is opened with FI_THREAD_SAFE (checked in `open`), so libfabric serialises
// concurrent calls on it; `info` is only read after construction.
unsafe impl Send for Fabric {}
// SAFETY: as for Send.
unsafe impl Sync for Fabric {}

impl Fabric {
    /// The first provider offering RDM endpoints with messages and RMA writes, restricted to
    /// `provider` (e.g. `"tcp;ofi_rxm"`, `"shm"`) when given, else to [`crate::forced_provider`].
    pub fn open(provider: Option<&str>) -> Result<Arc<Fabric>> {
        Self::open_toward(provider, None)
    }

    /// As [`Self::open`], on the interface that routes to `peer` when given.
    ///
    /// fi_getinfo lists one entry per *running* interface for socket-based providers (tcp), in
    /// the provider's order (here the host's own interface before the loopback; a veth that does
    /// not report running yet, up to a second after it passes packets, is left out, so the
    /// loopback can be the only one). An endpoint bound to 127.0.0.1 tells a peer on another host
    /// to connect to 127.0.0.1: its writes are refused and a stream stalls until its credit
    /// deadline; on a host with several interfaces the first may be one the peer cannot reach.
    /// With `peer`, the entry whose source address is the one this host routes to `peer` from is
    /// used (the route is asked of the kernel by connecting a UDP socket, which sends nothing); a
    /// list with socket addresses of which none is that one is an error naming both. Providers
    /// without socket addresses (shm) take the first entry.
    pub fn open_toward(provider: Option<&str>, peer: Option<IpAddr>) -> Result<Arc<Fabric>> {
        let lib = library()?;
        let forced = provider.map(str::to_owned).or_else(crate::forced_provider);
        // SAFETY: fi_dupinfo(NULL) allocates a zeroed fi_info with all attr structs (fi_allocinfo).
        let hints = unsafe { (lib.dupinfo)(ptr::null()) };
        if hints.is_null() {
            return Err(Error::Call { call: "fi_allocinfo", code: libc::ENOMEM, msg: "out of memory".into() });
        }
        // SAFETY: `hints` and its attr pointers were just allocated by libfabric and are ours;
        // prov_name must be malloc'd because fi_freeinfo frees it.
        unsafe {
            let h = &mut *hints;
            h.caps = ffi::FI_MSG | ffi::FI_RMA;
            h.mode = ffi::FI_CONTEXT | ffi::FI_RX_CQ_DATA;
            (*h.ep_attr).type_ = ffi::FI_EP_RDM;
            (*h.domain_attr).mr_mode = ffi::FI_MR_LOCAL
                | ffi::FI_MR_VIRT_ADDR
                | ffi::FI_MR_ALLOCATED
                | ffi::FI_MR_PROV_KEY
                | ffi::FI_MR_ENDPOINT;
            (*h.domain_attr).threading = ffi::FI_THREAD_SAFE;
            // The RELEASE send must never pass the writes before it, nor a "done" marker.
            (*h.tx_attr).msg_order = ffi::FI_ORDER_SAW;
            if let Some(p) = &forced {
                let c = std::ffi::CString::new(p.as_str()).map_err(|_| Error::NoProvider {
                    provider: forced.clone(),
                    detail: "NUL in provider name".into(),
                })?;
                (*h.fabric_attr).prov_name = libc::strdup(c.as_ptr());
            }
        }
        let mut info = ptr::null_mut();
        // SAFETY: hints is a valid fi_info; `info` receives a list we free with fi_freeinfo.
        let rc = unsafe { (lib.getinfo)(ffi::API_VERSION, ptr::null(), ptr::null(), 0, hints, &mut info) };
        // SAFETY: hints came from fi_dupinfo and is not used again.
        unsafe { (lib.freeinfo)(hints) };
        let info = match NonNull::new(info) {
            Some(i) if rc == 0 => i,
            _ => {
                let detail = if rc == -ffi::FI_ENODATA || rc == 0 {
                    "fi_getinfo found none (no such provider, or no device for it)".to_owned()
                } else {
                    format!("fi_getinfo: {}", lib.strerror(-rc))
                };
                return Err(Error::NoProvider { provider: forced, detail });
            }
        };
        let info_list = info;
        let info = match choose_entry(info_list, peer) {
            Ok(i) => i,
            Err(e) => {
                // SAFETY: the list is ours and not used again.
                unsafe { (lib.freeinfo)(info_list.as_ptr()) };
                return Err(e);
            }
        };
        // SAFETY: fi_getinfo returned a valid list; we own it until drop. Its attr pointers are
        // non-null for every returned entry (fi_getinfo(3)).
        let (provider, mr_mode, cq_data_size, rx_cq_data, threading) = unsafe {
            let i = info.as_ref();
            let fa = &*i.fabric_attr;
            let name = if fa.prov_name.is_null() {
                "unknown".to_owned()
            } else {
                CStr::from_ptr(fa.prov_name).to_string_lossy().into_owned()
            };
            let da = &*i.domain_attr;
            (name, da.mr_mode, da.cq_data_size, i.mode & ffi::FI_RX_CQ_DATA != 0, da.threading)
        };
        let mut fabric = ptr::null_mut();
        // SAFETY: fabric_attr belongs to the live info list.
        let rc = unsafe { (lib.fabric)((*info.as_ptr()).fabric_attr, &mut fabric, ptr::null_mut()) };
        let Some(fabric) = NonNull::new(fabric).filter(|_| rc == 0) else {
            // SAFETY: info is ours and not used again.
            unsafe { (lib.freeinfo)(info_list.as_ptr()) };
            return Err(call_err(lib, "fi_fabric", rc as isize));
        };
        let sread_honours_timeout = !provider.split(';').any(|p| p == "shm");
        let f =
            Fabric { lib, info_list, info, fabric, provider, mr_mode, cq_data_size, rx_cq_data, sread_honours_timeout };
        if threading != ffi::FI_THREAD_SAFE {
            return Err(Error::NoProvider {
                provider: Some(f.provider.clone()),
                detail: format!("it offers threading level {threading}, not FI_THREAD_SAFE"),
            });
        }
        Ok(Arc::new(f))
    }

    /// The provider's name as libfabric reports it (`tcp;ofi_rxm`, `shm`, `efa`, ...).
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The memory-registration mode bits the provider kept.
    pub fn mr_mode(&self) -> i32 {
        self.mr_mode
    }

    /// Bytes of immediate data a write may carry (tcp/shm: 8; verbs/EFA: 4).
    pub fn cq_data_size(&self) -> usize {
        self.cq_data_size
    }

    /// Whether remote-write completions consume a posted receive (verbs): the target must keep
    /// receives posted.
    pub fn needs_rx_for_cq_data(&self) -> bool {
        self.rx_cq_data
    }

    fn info(&self) -> *mut ffi::Info {
        self.info.as_ptr()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: every domain holds an Arc of this fabric, so none is open; fabric and info are
        // ours and closed/freed once.
        unsafe {
            close_fid(&mut (*self.fabric.as_ptr()).fid);
            (self.lib.freeinfo)(self.info_list.as_ptr());
        }
    }
}

/// The entry of `list` to open (see [`Fabric::open_toward`]).
fn choose_entry(list: NonNull<ffi::Info>, peer: Option<IpAddr>) -> Result<NonNull<ffi::Info>> {
    let Some(peer) = peer else { return Ok(list) };
    let mut entries = Vec::new();
    let mut at = Some(list);
    while let Some(e) = at {
        // SAFETY: `e` is an entry of the live list fi_getinfo returned; src_addr points to
        // src_addrlen bytes when non-null (fi_getinfo(3)).
        let (next, addr) = unsafe {
            let i = e.as_ref();
            (NonNull::new(i.next), socket_ip(i.src_addr, i.src_addrlen))
        };
        entries.push((e, addr));
        at = next;
    }
    if entries.iter().all(|(_, a)| a.is_none()) {
        return Ok(list);
    }
    let source = route_source(peer)?;
    entries.iter().find(|(_, a)| *a == Some(source)).map(|(e, _)| *e).ok_or_else(|| {
        let mut offered: Vec<IpAddr> = Vec::new();
        for a in entries.iter().filter_map(|(_, a)| *a) {
            if !offered.contains(&a) {
                offered.push(a);
            }
        }
        let offered = offered.iter().map(IpAddr::to_string).collect::<Vec<_>>().join(", ");
        Error::NoInterface { peer, local: source, offered }
    })
}

/// The local address this host sends to `peer` from (the kernel's route; nothing is sent).
pub fn route_source(peer: IpAddr) -> Result<IpAddr> {
    let any: IpAddr = if peer.is_ipv4() { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    let route = || -> std::io::Result<IpAddr> {
        let s = std::net::UdpSocket::bind((any, 0))?;
        s.connect((peer, 9))?;
        Ok(s.local_addr()?.ip())
    };
    route().map_err(|source| Error::NoRoute { peer, source })
}

/// The IP address of a `sockaddr_in`/`sockaddr_in6` of `len` bytes at `addr`, if it is one.
///
/// # Safety
/// `addr` is null or points to `len` readable bytes.
pub unsafe fn socket_ip(addr: *const c_void, len: usize) -> Option<IpAddr> {
    if addr.is_null() || len < std::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: the caller guarantees `len` readable bytes; each read below is checked against
    // `len` first and is unaligned-safe.
    unsafe {
        let family = ptr::read_unaligned(addr.cast::<libc::sa_family_t>());
        match i32::from(family) {
            libc::AF_INET if len >= std::mem::size_of::<libc::sockaddr_in>() => {
                let sa = ptr::read_unaligned(addr.cast::<libc::sockaddr_in>());
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr))))
            }
            libc::AF_INET6 if len >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let sa = ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>());
                Some(IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}

/// The IP address in an endpoint name (`fi_getname`) of a socket-based provider, if it is one.
pub fn name_ip(name: &[u8]) -> Option<IpAddr> {
    // SAFETY: the slice's bytes are readable.
    unsafe { socket_ip(name.as_ptr().cast(), name.len()) }
}

/// A domain (one NIC, or the provider's loopback) of a fabric.
pub struct Domain {
    fabric: Arc<Fabric>,
    domain: NonNull<ffi::FidDomain>,
    /// Keys for registrations when the provider lets the application pick them (no
    /// `FI_MR_PROV_KEY`): unique per domain.
    next_key: AtomicU64,
}

// SAFETY: FI_THREAD_SAFE domain (see Fabric).
unsafe impl Send for Domain {}
// SAFETY: as for Send.
unsafe impl Sync for Domain {}

impl Domain {
    pub fn open(fabric: &Arc<Fabric>) -> Result<Arc<Domain>> {
        let mut dom = ptr::null_mut();
        // SAFETY: the fabric and its info are live; the ops table is the provider's.
        let rc = unsafe {
            let f = fabric.fabric.as_ptr();
            ((*(*f).ops).domain)(f, fabric.info(), &mut dom, ptr::null_mut())
        };
        let domain =
            NonNull::new(dom).filter(|_| rc == 0).ok_or_else(|| call_err(fabric.lib, "fi_domain", rc as isize))?;
        Ok(Arc::new(Domain { fabric: fabric.clone(), domain, next_key: AtomicU64::new(1) }))
    }

    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.fabric
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: children hold Arcs of this domain, so none is open; closed once.
        unsafe { close_fid(&mut (*self.domain.as_ptr()).fid) };
    }
}

/// A completion queue that waits by blocking (`FI_WAIT_UNSPEC`, `fi_cq_sread`): busy polling
/// cost 4x on shared cores in the study, and tcp makes progress only inside these calls.
pub struct CompletionQueue {
    /// Keeps the domain open while the queue is.
    _domain: Arc<Domain>,
    cq: NonNull<ffi::FidCq>,
}

// SAFETY: FI_THREAD_SAFE domain (see Fabric).
unsafe impl Send for CompletionQueue {}
// SAFETY: as for Send.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    pub fn open(domain: &Arc<Domain>, size: usize) -> Result<Arc<CompletionQueue>> {
        let mut attr = ffi::CqAttr {
            size,
            flags: 0,
            format: ffi::FI_CQ_FORMAT_DATA,
            wait_obj: ffi::FI_WAIT_UNSPEC,
            signaling_vector: 0,
            wait_cond: 0,
            wait_set: ptr::null_mut(),
        };
        let mut cq = ptr::null_mut();
        // SAFETY: live domain; attr is a valid fi_cq_attr for the call's duration.
        let rc = unsafe {
            let d = domain.domain.as_ptr();
            ((*(*d).ops).cq_open)(d, &mut attr, &mut cq, ptr::null_mut())
        };
        let cq = NonNull::new(cq)
            .filter(|_| rc == 0)
            .ok_or_else(|| call_err(domain.fabric.lib, "fi_cq_open", rc as isize))?;
        Ok(Arc::new(CompletionQueue { _domain: domain.clone(), cq }))
    }

    /// Wakes a thread blocked in [`Endpoint::poll`] on this queue.
    pub fn signal(&self) {
        // SAFETY: live cq; fi_cq_signal has no other precondition.
        unsafe {
            let c = self.cq.as_ptr();
            ((*(*c).ops).signal)(c);
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: endpoints bound to this queue hold an Arc of it, so they are closed; once.
        unsafe { close_fid(&mut (*self.cq.as_ptr()).fid) };
    }
}

/// Where a peer's registered memory is: what the client tells the daemon about its ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Address to target for offset 0: the ring's virtual address under `FI_MR_VIRT_ADDR`, else 0.
    pub base: u64,
    pub key: u64,
    pub len: u64,
}

/// A peer's address in this endpoint's address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(ffi::FiAddr);

/// A finished operation, by the context index it was posted with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    Sent {
        op: usize,
    },
    Written {
        op: usize,
    },
    Received {
        op: usize,
        len: usize,
    },
    /// A peer wrote into our memory with immediate `data`. `consumed` is the receive this used
    /// up where the provider needs one per immediate (`FI_RX_CQ_DATA`): repost it.
    RemoteWrite {
        data: u64,
        len: usize,
        consumed: Option<usize>,
    },
    /// An operation failed (peer gone, region gone, truncation): its context is free again.
    Failed {
        op: Option<usize>,
        error: String,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Send,
    Write,
    Recv,
}

struct Pending {
    kind: OpKind,
    _buffer: Arc<MemoryRegion>,
}

/// An RDM endpoint bound to its own address vector and to a completion queue, with a fixed
/// array of operation contexts.
pub struct Endpoint {
    domain: Arc<Domain>,
    cq: Arc<CompletionQueue>,
    av: NonNull<ffi::FidAv>,
    ep: NonNull<ffi::FidEp>,
    /// `FI_CONTEXT` storage the provider owns while an operation is in flight: a boxed slice so
    /// the addresses never move.
    contexts: Box<[UnsafeCell<ffi::Context>]>,
    pending: Mutex<Vec<Option<Pending>>>,
}

// SAFETY: FI_THREAD_SAFE domain; `contexts` entries are only handed to the provider under the
// `pending` lock and for one operation at a time; Rust code never reads or writes them.
unsafe impl Send for Endpoint {}
// SAFETY: as for Send.
unsafe impl Sync for Endpoint {}

impl Endpoint {
    /// An enabled endpoint with `contexts` operation contexts (the most operations it can have
    /// in flight).
    pub fn open(domain: &Arc<Domain>, cq: &Arc<CompletionQueue>, contexts: usize) -> Result<Endpoint> {
        let lib = domain.fabric.lib;
        let mut av_attr = ffi::AvAttr {
            type_: ffi::FI_AV_TABLE,
            rx_ctx_bits: 0,
            count: 16,
            ep_per_node: 0,
            name: ptr::null(),
            map_addr: ptr::null_mut(),
            flags: 0,
        };
        let mut av = ptr::null_mut();
        // SAFETY: live domain; attr valid for the call.
        let rc = unsafe {
            let d = domain.domain.as_ptr();
            ((*(*d).ops).av_open)(d, &mut av_attr, &mut av, ptr::null_mut())
        };
        let av = NonNull::new(av).filter(|_| rc == 0).ok_or_else(|| call_err(lib, "fi_av_open", rc as isize))?;
        let mut ep = ptr::null_mut();
        // SAFETY: live domain and info.
        let rc = unsafe {
            let d = domain.domain.as_ptr();
            ((*(*d).ops).endpoint)(d, domain.fabric.info(), &mut ep, ptr::null_mut())
        };
        let Some(ep) = NonNull::new(ep).filter(|_| rc == 0) else {
            // SAFETY: av was just opened and is not used again.
            unsafe { close_fid(&mut (*av.as_ptr()).fid) };
            return Err(call_err(lib, "fi_endpoint", rc as isize));
        };
        let contexts: Box<[UnsafeCell<ffi::Context>]> =
            (0..contexts).map(|_| UnsafeCell::new(ffi::Context::default())).collect();
        let pending = Mutex::new((0..contexts.len()).map(|_| None).collect());
        // From here on Drop closes ep and av.
        let me = Endpoint { domain: domain.clone(), cq: cq.clone(), av, ep, contexts, pending };
        // SAFETY: ep, av and cq are live objects of the same domain.
        let rc = unsafe {
            let e = me.ep.as_ptr();
            let bind = (*(*e).fid.ops).bind;
            let rc = bind(&mut (*e).fid, &mut (*me.av.as_ptr()).fid, 0);
            if rc != 0 {
                rc
            } else {
                let rc = bind(&mut (*e).fid, &mut (*cq.cq.as_ptr()).fid, ffi::FI_TRANSMIT | ffi::FI_RECV);
                if rc != 0 { rc } else { ((*(*e).fid.ops).control)(&mut (*e).fid, ffi::FI_ENABLE, ptr::null_mut()) }
            }
        };
        if rc != 0 {
            return Err(call_err(lib, "binding and enabling the endpoint", rc as isize));
        }
        Ok(me)
    }

    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// The completion queue this endpoint reports to ([`CompletionQueue::signal`] wakes a
    /// thread blocked in [`Endpoint::poll`]).
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.domain.fabric
    }

    /// This endpoint's address, to hand to the peer out of band (gRPC).
    pub fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        loop {
            let mut len = buf.len();
            // SAFETY: live ep; buf has `len` writable bytes; len is updated to the needed size.
            let rc = unsafe {
                let e = self.ep.as_ptr();
                ((*(*e).cm).getname)(&mut (*e).fid, buf.as_mut_ptr().cast(), &mut len)
            };
            if rc == 0 {
                buf.truncate(len);
                return Ok(buf);
            }
            if rc == -ffi::FI_ETOOSMALL && len > buf.len() && len <= 1 << 16 {
                buf.resize(len, 0);
                continue;
            }
            return Err(call_err(self.fabric().lib, "fi_getname", rc as isize));
        }
    }

    /// Adds a peer (its [`Self::name`] bytes) to the address vector.
    pub fn insert_peer(&self, name: &[u8]) -> Result<PeerAddr> {
        let mut addr = ffi::FI_ADDR_UNSPEC;
        // SAFETY: live av; `name` is a readable address blob (the provider copies it; a blob of
        // the wrong format is rejected by the provider, and its length is bounded by what
        // getname produces: the provider reads addrlen bytes, which we guarantee exist below).
        if name.is_empty() || name.len() > 1 << 16 {
            return Err(Error::Call {
                call: "fi_av_insert",
                code: libc::EINVAL,
                msg: format!("address of {} bytes", name.len()),
            });
        }
        // The provider reads its own address length from `name`; pad so a short (hostile or
        // truncated) blob cannot make it read past our buffer.
        let mut padded = name.to_vec();
        padded.resize(name.len().max(512), 0);
        // SAFETY: as above; `padded` outlives the call.
        let rc = unsafe {
            let a = self.av.as_ptr();
            ((*(*a).ops).insert)(a, padded.as_ptr().cast(), 1, &mut addr, 0, ptr::null_mut())
        };
        if rc != 1 {
            return Err(call_err(
                self.fabric().lib,
                "fi_av_insert",
                if rc < 0 { rc as isize } else { -(libc::EINVAL as isize) },
            ));
        }
        Ok(PeerAddr(addr))
    }

    /// Claims context `op` for an operation on `buffer`, or says it is busy.
    fn claim(&self, op: usize, kind: OpKind, buffer: &Arc<MemoryRegion>) -> Result<*mut c_void> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        match pending.get_mut(op) {
            Some(slot @ None) => {
                *slot = Some(Pending { kind, _buffer: buffer.clone() });
                Ok(self.contexts[op].get().cast())
            }
            _ => Err(Error::ContextBusy(op)),
        }
    }

    fn unclaim(&self, op: usize) -> Option<Pending> {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.get_mut(op).and_then(Option::take)
    }

    /// Posts one operation; Ok(false) when the provider's queue is full (poll, then retry).
    fn post(
        &self,
        op: usize,
        kind: OpKind,
        buffer: &Arc<MemoryRegion>,
        call: &'static str,
        f: impl FnOnce(*mut ffi::FidEp, *mut c_void) -> isize,
    ) -> Result<bool> {
        let ctx = self.claim(op, kind, buffer)?;
        let rc = f(self.ep.as_ptr(), ctx);
        if rc == 0 {
            return Ok(true);
        }
        self.unclaim(op);
        if rc == -ffi::FI_EAGAIN {
            return Ok(false);
        }
        Err(call_err(self.fabric().lib, call, rc))
    }

    /// `fi_writedata`: `len` bytes of `src` at `offset` into the peer's `remote` region at
    /// `remote_offset`, with immediate `data` delivered in the peer's completion.
    #[allow(clippy::too_many_arguments)]
    pub fn write_data(
        &self,
        op: usize,
        src: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        data: u64,
        peer: PeerAddr,
        remote: RemoteRegion,
        remote_offset: u64,
    ) -> Result<bool> {
        src.check(offset, len)?;
        let end = remote_offset.checked_add(len as u64);
        if end.is_none_or(|e| e > remote.len) {
            return Err(Error::OutOfRange {
                what: "remote region",
                offset: remote_offset,
                len: len as u64,
                size: remote.len,
            });
        }
        let bytes = self.fabric().cq_data_size.min(8);
        if bytes < 8 && data >> (bytes * 8) != 0 {
            return Err(Error::ImmediateTooWide { data, bytes });
        }
        let target = remote.base.wrapping_add(remote_offset);
        self.post(op, OpKind::Write, src, "fi_writedata", |ep, ctx| {
            // SAFETY: live ep; [offset, offset+len) lies inside src's registered allocation,
            // which the pending entry keeps alive until completion; desc is src's own; ctx is
            // this op's FI_CONTEXT storage, stable and unused until completion.
            unsafe {
                ((*(*ep).rma).writedata)(
                    ep,
                    src.ptr.as_ptr().add(offset).cast(),
                    len,
                    src.desc(),
                    data,
                    peer.0,
                    target,
                    remote.key,
                    ctx,
                )
            }
        })
    }

    /// `fi_send` of `len` bytes of `src` at `offset` to `peer`.
    pub fn send(&self, op: usize, src: &Arc<MemoryRegion>, offset: usize, len: usize, peer: PeerAddr) -> Result<bool> {
        src.check(offset, len)?;
        self.post(op, OpKind::Send, src, "fi_send", |ep, ctx| {
            // SAFETY: as in write_data: range inside a buffer kept alive until completion.
            unsafe { ((*(*ep).msg).send)(ep, src.ptr.as_ptr().add(offset).cast(), len, src.desc(), peer.0, ctx) }
        })
    }

    /// `fi_recv` into `len` bytes of `dst` at `offset`, from any peer.
    pub fn recv(&self, op: usize, dst: &Arc<MemoryRegion>, offset: usize, len: usize) -> Result<bool> {
        dst.check(offset, len)?;
        self.post(op, OpKind::Recv, dst, "fi_recv", |ep, ctx| {
            // SAFETY: as in write_data; the provider writes at most `len` bytes there.
            unsafe {
                ((*(*ep).msg).recv)(ep, dst.ptr.as_ptr().add(offset).cast(), len, dst.desc(), ffi::FI_ADDR_UNSPEC, ctx)
            }
        })
    }

    fn op_of(&self, ctx: *mut c_void) -> Option<usize> {
        let base = self.contexts.as_ptr() as usize;
        let size = std::mem::size_of::<UnsafeCell<ffi::Context>>();
        let off = (ctx as usize).checked_sub(base)?;
        (off % size == 0 && off / size < self.contexts.len()).then_some(off / size)
    }

    /// Completions available now, or (with `wait`) after blocking up to `wait` for the first
    /// one. An empty vector means none arrived in time (or the queue was signalled, or a signal
    /// interrupted the wait).
    pub fn poll(&self, wait: Option<Duration>) -> Result<Vec<Completion>> {
        let lib = self.fabric().lib;
        let mut entries =
            [ffi::CqDataEntry { op_context: ptr::null_mut(), flags: 0, len: 0, buf: ptr::null_mut(), data: 0 }; 16];
        let cq = self.cq.cq.as_ptr();
        let wait = wait.filter(|w| !w.is_zero());
        if let Some(w) = wait
            && !self.fabric().sread_honours_timeout
        {
            return self.poll_spinning(w);
        }
        // SAFETY: live cq of FI_CQ_FORMAT_DATA; `entries` holds 16 such entries.
        let rc = unsafe {
            match wait {
                Some(w) => {
                    let ms = c_int::try_from(w.as_millis()).unwrap_or(c_int::MAX);
                    ((*(*cq).ops).sread)(cq, entries.as_mut_ptr().cast(), entries.len(), ptr::null(), ms)
                }
                None => ((*(*cq).ops).read)(cq, entries.as_mut_ptr().cast(), entries.len()),
            }
        };
        // EINTR: a signal (a handler the process installed, a debugger or profiler attaching)
        // interrupted the wait. Nothing arrived: callers treat it as a wake-up, as a signalled
        // queue, and wait again within their own deadline.
        if rc < 0
            && [ffi::FI_EAGAIN, libc::ETIMEDOUT as isize, libc::ECANCELED as isize, libc::EINTR as isize].contains(&-rc)
        {
            return Ok(Vec::new());
        }
        if rc == -ffi::FI_EAVAIL {
            return Ok(vec![self.read_error()?]);
        }
        if rc < 0 {
            return Err(call_err(lib, "fi_cq_read", rc));
        }
        let n = usize::try_from(rc).unwrap_or(0).min(entries.len());
        let mut out = Vec::with_capacity(n);
        for e in &entries[..n] {
            let op = self.op_of(e.op_context);
            if e.flags & ffi::FI_REMOTE_CQ_DATA != 0 {
                let consumed = op.filter(|&o| self.unclaim(o).is_some());
                out.push(Completion::RemoteWrite { data: e.data, len: e.len, consumed });
                continue;
            }
            let Some(op) = op else { continue };
            match self.unclaim(op).map(|p| p.kind) {
                Some(OpKind::Send) => out.push(Completion::Sent { op }),
                Some(OpKind::Write) => out.push(Completion::Written { op }),
                Some(OpKind::Recv) => out.push(Completion::Received { op, len: e.len }),
                None => {}
            }
        }
        Ok(out)
    }

    /// `poll` for providers whose blocking read ignores its timeout: non-blocking reads with
    /// short sleeps until something arrives or `wait` passes.
    fn poll_spinning(&self, wait: Duration) -> Result<Vec<Completion>> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            let got = self.poll(None)?;
            if !got.is_empty() || std::time::Instant::now() >= deadline {
                return Ok(got);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn read_error(&self) -> Result<Completion> {
        let lib = self.fabric().lib;
        // SAFETY: all-zero is a valid fi_cq_err_entry (pointers null, sizes 0).
        let mut err: ffi::CqErrEntry = unsafe { std::mem::zeroed() };
        let cq = self.cq.cq.as_ptr();
        // SAFETY: live cq; `err` is a valid entry with err_data_size 0 (provider-owned err_data).
        let rc = unsafe { ((*(*cq).ops).readerr)(cq, &mut err, 0) };
        if rc < 0 {
            return Err(call_err(lib, "fi_cq_readerr", rc));
        }
        let op = self.op_of(err.op_context);
        if let Some(o) = op {
            self.unclaim(o);
        }
        Ok(Completion::Failed { op, error: format!("{} (provider error {})", lib.strerror(err.err), err.prov_errno) })
    }

    /// Operations in flight.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner).iter().filter(|p| p.is_some()).count()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: ep and av are ours, closed once, ep first (it is bound to av); the provider
        // stops using every posted context and buffer when the endpoint closes, so the pending
        // buffers may drop after this.
        unsafe {
            close_fid(&mut (*self.ep.as_ptr()).fid);
            close_fid(&mut (*self.av.as_ptr()).fid);
        }
    }
}

/// Page-aligned memory allocated by this crate and registered with a domain (and bound to an
/// endpoint where the provider needs `FI_MR_ENDPOINT`).
pub struct MemoryRegion {
    domain: Arc<Domain>,
    ptr: NonNull<u8>,
    len: usize,
    mr: NonNull<ffi::FidMr>,
}

// SAFETY: FI_THREAD_SAFE domain; the memory is only accessed through raw pointers by the
// provider and through the `unsafe` accessors below, whose callers own the ranges they touch.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for Send.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// `len` bytes (rounded up to pages, zeroed) registered for `access` (`FI_SEND | FI_RECV`,
    /// `FI_WRITE`, `FI_REMOTE_WRITE`, ...).
    pub fn new(ep: &Endpoint, len: usize, access: u64) -> Result<Arc<MemoryRegion>> {
        let domain = ep.domain.clone();
        let lib = domain.fabric.lib;
        let page = 4096usize;
        let len = len.max(1).div_ceil(page) * page;
        // SAFETY: anonymous private mapping; no address hint; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Alloc { bytes: len, source: std::io::Error::last_os_error() });
        }
        let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
            return Err(Error::Alloc { bytes: len, source: std::io::Error::other("mmap returned null") });
        };
        let unmap = || {
            // SAFETY: the mapping made above, not yet shared with anyone.
            unsafe { libc::munmap(p, len) };
        };
        let key = domain.next_key.fetch_add(1, Ordering::Relaxed);
        let mut mr = ptr::null_mut();
        // SAFETY: live domain; [p, p+len) is our mapping, which outlives the registration
        // (Drop closes the mr before unmapping).
        let rc = unsafe {
            let d = domain.domain.as_ptr();
            ((*(*d).mr).reg)(&mut (*d).fid, p, len, access, 0, key, 0, &mut mr, ptr::null_mut())
        };
        let Some(mr) = NonNull::new(mr).filter(|_| rc == 0) else {
            unmap();
            return Err(Error::Register { bytes: len, msg: lib.strerror(-rc), limit: memlock_limit() });
        };
        let region = MemoryRegion { domain, ptr, len, mr };
        if region.domain.fabric.mr_mode & ffi::FI_MR_ENDPOINT != 0 {
            // SAFETY: live mr and ep of the same domain.
            let rc = unsafe {
                let m = mr.as_ptr();
                let rc = ((*(*m).fid.ops).bind)(&mut (*m).fid, &mut (*ep.ep.as_ptr()).fid, 0);
                if rc != 0 { rc } else { ((*(*m).fid.ops).control)(&mut (*m).fid, ffi::FI_ENABLE, ptr::null_mut()) }
            };
            if rc != 0 {
                return Err(call_err(lib, "fi_mr_bind/fi_mr_enable", rc as isize));
            }
        }
        Ok(Arc::new(region))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The key a peer needs to write here.
    pub fn key(&self) -> u64 {
        // SAFETY: live mr; `key` is set by the provider at registration and never changes.
        unsafe { (*self.mr.as_ptr()).key }
    }

    /// What a peer needs to write into this region.
    pub fn remote(&self) -> RemoteRegion {
        let base = if self.domain.fabric.mr_mode & ffi::FI_MR_VIRT_ADDR != 0 { self.ptr.as_ptr() as u64 } else { 0 };
        RemoteRegion { base, key: self.key(), len: self.len as u64 }
    }

    fn desc(&self) -> *mut c_void {
        // SAFETY: live mr; mem_desc is set at registration.
        unsafe { (*self.mr.as_ptr()).mem_desc }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::OutOfRange {
                what: "registered buffer",
                offset: offset as u64,
                len: len as u64,
                size: self.len as u64,
            });
        }
        Ok(())
    }

    /// The bytes at `offset..offset+len`.
    ///
    /// # Safety
    /// No operation that writes this range (a local receive, a peer's RMA write) may be in
    /// flight while the slice lives: the protocol (the credit state machine) must own the range.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> Result<&[u8]> {
        self.check(offset, len)?;
        // SAFETY: in bounds of our mapping; no concurrent writer per the contract.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// The bytes at `offset..offset+len`, writable.
    ///
    /// # Safety
    /// No operation on this range may be in flight, and no other slice of it may be alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> Result<&mut [u8]> {
        self.check(offset, len)?;
        // SAFETY: in bounds; exclusive per the contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) })
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: no operation uses the region (each in-flight one holds an Arc of it); mr closed
        // once, then the mapping it covered is unmapped.
        unsafe {
            close_fid(&mut (*self.mr.as_ptr()).fid);
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The soft memlock limit, for the registration error.
fn memlock_limit() -> String {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return "unknown".into();
    }
    if r.rlim_cur == libc::RLIM_INFINITY { "unlimited".into() } else { format!("{} KiB", r.rlim_cur / 1024) }
}

#[cfg(test)]
mod address_tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    use super::{name_ip, route_source};

    /// The bytes of a `sockaddr_in`/`sockaddr_in6` for `a`, as tcp's `fi_getname` gives them.
    fn sockaddr(a: SocketAddr) -> Vec<u8> {
        match a {
            SocketAddr::V4(v4) => {
                // SAFETY: an all-zero sockaddr_in is valid; its fields are set below.
                let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
                sa.sin_family = libc::AF_INET as libc::sa_family_t;
                sa.sin_port = v4.port().to_be();
                sa.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
                // SAFETY: sa is a plain C struct of that many bytes.
                unsafe { std::slice::from_raw_parts((&raw const sa).cast::<u8>(), size_of_val(&sa)) }.to_vec()
            }
            SocketAddr::V6(v6) => {
                // SAFETY: as above.
                let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
                sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sa.sin6_port = v6.port().to_be();
                sa.sin6_addr.s6_addr = v6.ip().octets();
                // SAFETY: as above.
                unsafe { std::slice::from_raw_parts((&raw const sa).cast::<u8>(), size_of_val(&sa)) }.to_vec()
            }
        }
    }

    #[test]
    fn endpoint_names_give_their_ip_and_anything_else_none() {
        let v4: SocketAddr = "10.231.0.2:44043".parse().unwrap();
        assert_eq!(name_ip(&sockaddr(v4)), Some(IpAddr::V4(Ipv4Addr::new(10, 231, 0, 2))));
        let v6: SocketAddr = "[fd00::2]:7".parse().unwrap();
        assert_eq!(name_ip(&sockaddr(v6)), Some("fd00::2".parse::<Ipv6Addr>().unwrap().into()));
        // Truncated, empty, or another family (an shm name is a string): no address.
        assert_eq!(name_ip(&sockaddr(v4)[..8]), None);
        assert_eq!(name_ip(&[]), None);
        assert_eq!(name_ip(b"fi_shm://1234"), None);
    }

    #[test]
    fn the_route_to_the_loopback_starts_on_the_loopback() {
        assert_eq!(route_source(Ipv4Addr::LOCALHOST.into()).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
}
