//! The ring protocol over real libfabric providers (`tcp;ofi_rxm` and `shm`), daemon and client
//! on two threads with separate fabrics, metadata over a channel standing in for gRPC: every
//! batch's bytes arrive exactly once and in order, immediates match, credits are respected, a
//! stalled client stalls only the stream, a vanished client is an error and not a crash.
//!
//! Needs `libfabric.so.1` (`bash scripts/libfabric.sh`); without it each test fails saying so,
//! unless SHARDSTREAM_SKIP_RDMA=1 says this host is known not to have it.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use shardstream_fabric::credits::Ready;
use shardstream_fabric::stream::{Offer, RingReceiver, RingSender, StreamError, open_endpoint};

fn available() -> bool {
    match shardstream_fabric::library() {
        Ok(_) => true,
        Err(e) if std::env::var_os("SHARDSTREAM_SKIP_RDMA").is_some() => {
            eprintln!("SKIPPED (SHARDSTREAM_SKIP_RDMA): {e}");
            false
        }
        Err(e) => panic!("{e}"),
    }
}

fn pattern(batch: u64, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|i| (i as u64).wrapping_mul(31).wrapping_add(batch * 7) as u8).collect();
    v[..8].copy_from_slice(&batch.to_le_bytes());
    v
}

fn batch_len(batch: u64, slot_bytes: usize) -> usize {
    // Varying lengths, including a full slot and a one-byte batch.
    match batch % 5 {
        0 => slot_bytes,
        1 => 8,
        _ => 8 + (batch as usize * 4099) % (slot_bytes - 8),
    }
}

/// Runs `batches` batches through a ring of `slots` x `slot_bytes` over `provider`.
fn run(provider: &str, slots: u32, slot_bytes: usize, window: usize, batches: u64) {
    let (offer_tx, offer_rx) = mpsc::channel::<Offer>();
    let (name_tx, name_rx) = mpsc::channel::<Vec<u8>>();
    let (meta_tx, meta_rx) = mpsc::channel::<(u64, u32, usize)>();
    let prov = provider.to_owned();
    let daemon = thread::spawn(move || -> Result<usize, StreamError> {
        let offer = offer_rx.recv().expect("offer");
        let ep = open_endpoint(Some(&prov), window + offer.slots as usize + 4)?;
        let mut tx = RingSender::new(ep, &offer, window)?;
        tx.stall = Duration::from_secs(20);
        name_tx.send(tx.name()?).expect("name");
        for b in 0..batches {
            let len = batch_len(b, offer.slot_bytes as usize);
            let slot = tx.send(b, |buf| {
                buf[..len].copy_from_slice(&pattern(b, len));
                len
            })?;
            assert!(tx.credits_in_use() <= offer.slots as usize);
            meta_tx.send((b, slot, len)).expect("meta");
        }
        tx.drain()?;
        Ok(tx.peak_in_use())
    });
    let ep = open_endpoint(Some(provider), 64).expect("client endpoint");
    assert!(ep.fabric().provider().contains(provider.split(';').next().unwrap()), "{}", ep.fabric().provider());
    let mut rx: RingReceiver<usize> = RingReceiver::new(ep, slots, slot_bytes, 0).expect("ring");
    offer_tx.send(rx.offer().expect("offer")).expect("send offer");
    rx.connect(&name_rx.recv().expect("daemon name")).expect("connect");
    let mut delivered = Vec::new();
    while delivered.len() < batches as usize {
        while let Ok((b, slot, len)) = meta_rx.try_recv() {
            rx.on_meta(b, slot, len).expect("meta");
        }
        let Some(r) = rx.next(Duration::from_millis(50)).expect("next") else {
            if daemon.is_finished() && meta_rx.try_recv().is_err() && rx.held() == 0 {
                // The daemon may only have finished if everything was delivered.
                break;
            }
            continue;
        };
        let bytes = rx.bytes(&r, r.meta).expect("bytes");
        assert_eq!(bytes, &pattern(r.batch, r.meta)[..], "batch {} bytes", r.batch);
        delivered.push(r.batch);
        rx.release(r.slot, r.batch).expect("release");
    }
    let peak = daemon.join().expect("daemon thread").expect("daemon");
    assert_eq!(delivered, (0..batches).collect::<Vec<_>>(), "exactly once, in order");
    assert!(peak <= slots as usize, "peak credits {peak} > {slots}");
}

#[test]
fn tcp_rxm_delivers_every_batch_once_in_order() {
    if available() {
        run("tcp;ofi_rxm", 4, 64 << 10, 3, 60);
    }
}

#[test]
fn shm_delivers_every_batch_once_in_order() {
    if available() {
        run("shm", 4, 64 << 10, 3, 60);
    }
}

#[test]
fn single_slot_ring_serialises_the_stream() {
    if available() {
        run("tcp;ofi_rxm", 1, 4096 * 3, 2, 12);
    }
}

/// A provider that does not exist (or has no device here, like verbs and efa) is an error that
/// names it, never a silent fallback to another provider.
#[test]
fn unknown_or_absent_provider_is_a_named_error() {
    if !available() {
        return;
    }
    for p in ["no-such-provider", "verbs;ofi_rxm"] {
        let err = shardstream_fabric::Fabric::open(Some(p)).err().expect("no such provider here");
        let msg = err.to_string();
        assert!(msg.contains(&format!("{p:?}")), "{msg}");
        assert!(msg.contains("no libfabric provider"), "{msg}");
    }
}

type Meta = mpsc::Receiver<(u64, u32)>;

/// A client's ring of `slots` 4 KiB slots over `provider`, connected to a sender on a thread of
/// its own (a window of 2, stalled after `stall`) that runs `daemon`, which tells the client each
/// batch's (batch, slot) on the channel it is given, as gRPC does.
fn client_and_daemon<T: Send + 'static>(
    provider: &'static str,
    slots: u32,
    stall: Duration,
    daemon: impl FnOnce(RingSender, mpsc::Sender<(u64, u32)>) -> T + Send + 'static,
) -> (RingReceiver<()>, Meta, thread::JoinHandle<T>) {
    let mut rx: RingReceiver<()> =
        RingReceiver::new(open_endpoint(Some(provider), 64).unwrap(), slots, 4096, 0).unwrap();
    let offer = rx.offer().unwrap();
    let (name_tx, name_rx) = mpsc::channel();
    let (meta_tx, meta_rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let ep = open_endpoint(Some(provider), 16).unwrap();
        let mut tx = RingSender::new(ep, &offer, 2).unwrap();
        tx.stall = stall;
        name_tx.send(tx.name().unwrap()).unwrap();
        daemon(tx, meta_tx)
    });
    rx.connect(&name_rx.recv().unwrap()).unwrap();
    (rx, meta_rx, handle)
}

/// The client's next batch within `wait`, the metadata sent so far taken in first.
fn next_arrived(rx: &mut RingReceiver<()>, meta: &Meta, wait: Duration) -> Option<Ready<()>> {
    while let Ok((b, s)) = meta.try_recv() {
        rx.on_meta(b, s, ()).unwrap();
    }
    rx.next(wait).unwrap()
}

/// A client that holds every credit for longer than the stall time (a trainer evaluating, or
/// saving a checkpoint) and then releases them: a sender that knows the client is still there
/// waits it out with `reserve_while`, and stops as soon as it is told to.
#[test]
fn a_sender_told_the_client_is_there_waits_past_the_stall_time() {
    if !available() {
        return;
    }
    let slots = 2u32;
    let (mut rx, meta_rx, daemon) =
        client_and_daemon("tcp;ofi_rxm", slots, Duration::from_millis(300), move |mut tx, meta_tx| {
            let mut stopped = None;
            for b in 0..u64::from(slots) + 1 {
                if b == u64::from(slots) {
                    // Every credit held, and told to stop: it does, at once.
                    stopped = tx.reserve_while(b, &|| false).map(|_| ()).err();
                }
                let started = std::time::Instant::now();
                let staged = tx.reserve_while(b, &|| started.elapsed() < Duration::from_secs(20))?;
                let slot = tx.post(staged, 1)?;
                meta_tx.send((b, slot)).unwrap();
            }
            Ok::<_, StreamError>(stopped)
        });
    let mut held = Vec::new();
    while held.len() < slots as usize {
        held.extend(next_arrived(&mut rx, &meta_rx, Duration::from_millis(50)));
    }
    // Well past the stall time with every credit held; then let them go.
    thread::sleep(Duration::from_millis(1500));
    assert!(!daemon.is_finished(), "the sender gave up while the client was there");
    for r in held {
        rx.release(r.slot, r.batch).unwrap();
    }
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let mut third = None;
    while third.is_none() && std::time::Instant::now() < until {
        third = next_arrived(&mut rx, &meta_rx, Duration::from_millis(50));
    }
    assert!(third.is_some(), "the batch after the pause never came");
    assert!(matches!(daemon.join().unwrap(), Ok(Some(StreamError::Stopped))));
}

/// A client that stops driving its endpoint leaves the sender's queue full under tcp's manual
/// progress: here it never drives again after connecting, so the connection the first write
/// needs is never accepted. The sender waits for room as long as it is told (its gRPC stream is
/// open: a trainer evaluating), past the stall time, and stops as soon as it is told to (the
/// client left, the daemon is stopping), giving the staging buffer and the credit back.
#[test]
fn a_post_waiting_for_room_in_the_queue_waits_while_told_and_stops_when_told() {
    if !available() {
        return;
    }
    let told = Duration::from_millis(1500);
    let (rx, _meta, daemon) = client_and_daemon("tcp;ofi_rxm", 2, Duration::from_millis(300), move |mut tx, _| {
        let staged = tx.reserve_while(0, &|| true).expect("a credit to start with");
        let asked = std::cell::Cell::new(0u32);
        let started = std::time::Instant::now();
        let posted = tx.post_while(staged, 1, &|| {
            asked.set(asked.get() + 1);
            started.elapsed() < told
        });
        (posted, started.elapsed(), asked.get(), tx.credits_in_use())
    });
    let (posted, took, asked, in_use) = daemon.join().unwrap();
    drop(rx);
    assert!(matches!(posted, Err(StreamError::Stopped)), "{posted:?}");
    assert!(asked > 1, "the queue was never found full ({asked} asks)");
    assert!(took >= told && took < told + Duration::from_secs(3), "stopped after {took:?}");
    assert_eq!(in_use, 0, "the credit was not given back");
}

/// The end of a stream waits for the client to return its credits or say it has every batch;
/// a client holding its last batch keeps it waiting. A daemon shutting down does not wait for
/// that: the drain stops as soon as it is told, well before the stall time.
#[test]
fn a_drain_stops_when_told_while_the_client_holds_a_batch() {
    if !available() {
        return;
    }
    let (mut rx, meta_rx, daemon) = client_and_daemon("tcp;ofi_rxm", 2, Duration::from_secs(20), |mut tx, meta_tx| {
        let slot = tx.send(0, |b| {
            b[0] = 7;
            1
        })?;
        meta_tx.send((0, slot)).unwrap();
        let started = std::time::Instant::now();
        let drained = tx.drain_while(&|| started.elapsed() < Duration::from_secs(1));
        Ok::<_, StreamError>((drained, started.elapsed()))
    });
    let mut held = None;
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !daemon.is_finished() && std::time::Instant::now() < until {
        held = held.or(next_arrived(&mut rx, &meta_rx, Duration::from_millis(50)));
    }
    assert!(held.is_some(), "the batch never arrived");
    let (drained, took) = daemon.join().unwrap().expect("the batch was sent");
    assert!(matches!(drained, Err(StreamError::Stopped)), "{drained:?}");
    assert!(took < Duration::from_secs(5), "the drain waited {took:?}");
}

/// A client that takes batches but never releases them holds exactly its credits; the daemon
/// reports it stalled after its timeout instead of writing over held slots.
#[test]
fn stalled_client_stalls_only_its_stream() {
    if !available() {
        return;
    }
    for provider in ["tcp;ofi_rxm", "shm"] {
        let slots = 3u32;
        let (mut rx, meta_rx, daemon) =
            client_and_daemon(provider, slots, Duration::from_millis(1500), |mut tx, meta_tx| {
                let mut sent = 0u64;
                let err = loop {
                    match tx.send(sent, |b| {
                        b[0] = sent as u8;
                        1
                    }) {
                        Ok(slot) => {
                            meta_tx.send((sent, slot)).unwrap();
                            sent += 1;
                        }
                        Err(e) => break e,
                    }
                };
                (sent, err, tx.credits_in_use())
            });
        let mut got = 0;
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while !daemon.is_finished() && std::time::Instant::now() < until {
            if next_arrived(&mut rx, &meta_rx, Duration::from_millis(50)).is_some() {
                got += 1; // held, never released
            }
        }
        let (sent, err, in_use) = daemon.join().unwrap();
        assert_eq!(sent, u64::from(slots), "{provider}: wrote more batches than credits");
        assert!(matches!(err, StreamError::Stalled(_)), "{provider}: {err}");
        assert_eq!(in_use, slots as usize);
        assert_eq!(got, slots);
    }
}

const CHILD_ENV: &str = "SHARDSTREAM_FABRIC_TEST_CHILD";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Not a test on its own: the client process `killed_client_is_an_error_not_a_crash` starts
/// (this binary re-run with CHILD_ENV set). It registers a ring, prints its offer and drives
/// progress until killed, or, once a line arrives on its stdin, stops calling into libfabric,
/// prints `IDLE` and waits to be killed there (see the test for why shm needs that).
#[test]
fn child_process_client_entry() {
    let Ok(provider) = std::env::var(CHILD_ENV) else { return };
    let mut rx: RingReceiver<()> = RingReceiver::new(open_endpoint(Some(&provider), 64).unwrap(), 4, 8192, 0).unwrap();
    let o = rx.offer().unwrap();
    println!("OFFER {} {} {} {} {} {}", hex(&o.name), o.ring.base, o.ring.key, o.ring.len, o.slots, o.slot_bytes);
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    let idle = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = idle.clone();
    thread::spawn(move || {
        let mut line = String::new();
        if std::io::stdin().read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    });
    // Drive progress (tcp's is manual); batches are never released.
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < until && !idle.load(std::sync::atomic::Ordering::SeqCst) {
        let _ = rx.next(Duration::from_millis(100));
    }
    println!("IDLE");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(until.saturating_duration_since(std::time::Instant::now()));
}

/// Removes the shared-memory regions libfabric's shm provider made for process `pid`
/// (`/dev/shm/PID:EP:N`), which a SIGKILLed process cannot remove itself. Left behind, they
/// filled /dev/shm by 16 MiB a run, and a later child that got the same pid could not enable its
/// endpoint ("Device or resource busy": this test failed so once).
fn remove_shm_regions_of(pid: u32) {
    let prefix = format!("{pid}:");
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The client process is SIGKILLed while its daemon streams to it: the daemon's writes fail (or
/// find no credit) with an error within its stall timeout, never crash or hang.
///
/// Over tcp the client dies wherever it is, usually inside libfabric's progress. Over shm it is
/// killed only once it has stopped calling into libfabric: libfabric 1.17's shm provider guards
/// each peer's command queue with a spin lock in the shared region, and a process killed while
/// holding its own leaves every writer to it spinning for ever inside `fi_writedata` (seen once
/// here). No timeout of ours can interrupt that call; the shm provider serves tests only (same
/// host trainers use the memfd ring), as README.md says.
#[test]
fn killed_client_is_an_error_not_a_crash() {
    if !available() {
        return;
    }
    use std::io::BufRead;
    for provider in ["tcp;ofi_rxm", "shm"] {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_process_client_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, provider)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut child_stdin = child.stdin.take().unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        // libtest may print the test's name on the same line first.
        let line =
            lines.find_map(|l| l.ok().and_then(|l| l.find("OFFER ").map(|i| l[i..].to_owned()))).expect("child offer");
        let f: Vec<&str> = line.split_whitespace().collect();
        let offer = Offer {
            name: unhex(f[1]),
            ring: shardstream_fabric::RemoteRegion {
                base: f[2].parse().unwrap(),
                key: f[3].parse().unwrap(),
                len: f[4].parse().unwrap(),
            },
            slots: f[5].parse().unwrap(),
            slot_bytes: f[6].parse().unwrap(),
            provider: provider.into(),
        };
        let ep = open_endpoint(Some(provider), 16).unwrap();
        let mut tx = RingSender::new(ep, &offer, 2).unwrap();
        tx.stall = Duration::from_secs(3);
        // Two batches reach the live client, then it dies.
        for b in 0..2 {
            tx.send(b, |buf| {
                buf[0] = 1;
                1
            })
            .unwrap_or_else(|e| panic!("{provider}: write to a live client: {e}"));
        }
        tx.flush().unwrap();
        if provider == "shm" {
            use std::io::Write;
            writeln!(child_stdin).unwrap();
            assert!(lines.any(|l| l.is_ok_and(|l| l.contains("IDLE"))), "{provider}: the child never went idle");
        }
        let child_pid = child.id();
        child.kill().unwrap();
        child.wait().unwrap();
        if provider == "shm" {
            remove_shm_regions_of(child_pid);
        }
        let started = std::time::Instant::now();
        let mut result = Ok(0);
        for b in 2..12 {
            result = tx.send(b, |buf| {
                buf[0] = 1;
                1
            });
            if result.is_err() {
                break;
            }
        }
        let err =
            result.and_then(|_| tx.drain().map(|_| 0)).expect_err("writes into a killed client cannot all succeed");
        assert!(
            matches!(err, StreamError::PeerFailed(_) | StreamError::Stalled(_)),
            "{provider}: unexpected error kind: {err}"
        );
        assert!(started.elapsed() < Duration::from_secs(20), "{provider}: took {:?}", started.elapsed());
        eprintln!("{provider}: killed client -> {err}");
    }
}

/// Batches read in place (`RingReceiver::lend`): a lent slot is never rewritten while its view
/// lives, dropping the view returns its credit, and FINISHED lets the daemon's drain end while
/// the client still holds its last batches.
#[test]
fn lent_views_hold_their_slots_and_finished_ends_the_drain() {
    if !available() {
        return;
    }
    let provider = "tcp;ofi_rxm";
    let (slots, slot_bytes, batches) = (2u32, 8192usize, 6u64);
    let mut rx: RingReceiver<()> =
        RingReceiver::new(open_endpoint(Some(provider), 64).unwrap(), slots, slot_bytes, 0).unwrap();
    let offer = rx.offer().unwrap();
    let (name_tx, name_rx) = mpsc::channel();
    let (meta_tx, meta_rx) = mpsc::channel();
    let daemon = thread::spawn(move || -> Result<Duration, StreamError> {
        let ep = open_endpoint(Some(provider), 16)?;
        let mut tx = RingSender::new(ep, &offer, 2)?;
        tx.stall = Duration::from_secs(20);
        name_tx.send(tx.name()?).unwrap();
        for b in 0..batches {
            let slot = tx.send(b, |buf| {
                buf.copy_from_slice(&pattern(b, buf.len()));
                buf.len()
            })?;
            meta_tx.send((b, slot)).unwrap();
        }
        let t = std::time::Instant::now();
        tx.drain()?;
        Ok(t.elapsed())
    });
    rx.connect(&name_rx.recv().unwrap()).unwrap();
    // Takes the next batch as a lent view, driving the endpoint meanwhile.
    let take = |rx: &mut RingReceiver<()>| {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            while let Ok((b, s)) = meta_rx.try_recv() {
                rx.on_meta(b, s, ()).unwrap();
            }
            if let Some(r) = rx.next(Duration::from_millis(50)).unwrap() {
                return Some((r.batch, rx.lend(r, slot_bytes).unwrap()));
            }
            if std::time::Instant::now() > until {
                return None;
            }
        }
    };
    let (b0, v0) = take(&mut rx).expect("batch 0");
    let (b1, v1) = take(&mut rx).expect("batch 1");
    assert_eq!((b0, b1), (0, 1));
    // Both slots lent: the daemon has no credit, so batch 2 cannot come.
    let blocked = std::time::Instant::now();
    while blocked.elapsed() < Duration::from_millis(600) {
        rx.progress(Duration::from_millis(50)).unwrap();
    }
    assert!(rx.next(Duration::ZERO).unwrap().is_none() && meta_rx.try_recv().is_err(), "wrote into a lent slot");
    assert_eq!(v0.as_slice(), &pattern(0, slot_bytes)[..]);
    drop(v0);
    // Its credit goes back, batch 2 lands in its slot, batch 1's view is untouched.
    let (b2, v2) = take(&mut rx).expect("batch 2 after batch 0's view was dropped");
    assert_eq!(b2, 2);
    assert_eq!(v2.as_slice(), &pattern(2, slot_bytes)[..]);
    assert_eq!(v1.as_slice(), &pattern(1, slot_bytes)[..], "a held slot was rewritten");
    drop((v1, v2));
    let mut held = Vec::new();
    for want in 3..batches {
        let (b, v) = take(&mut rx).expect("later batch");
        assert_eq!(b, want);
        assert_eq!(v.as_slice(), &pattern(b, slot_bytes)[..]);
        held.push(v);
        if held.len() == 2 {
            // Keep only the newest two: the ring has two slots.
            held.remove(0);
        }
    }
    // The client holds its last batch: without FINISHED the drain would wait its 20 s stall.
    rx.finish().unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !daemon.is_finished() && std::time::Instant::now() < until {
        rx.progress(Duration::from_millis(20)).unwrap();
    }
    let drained = daemon.join().unwrap().expect("daemon");
    assert!(drained < Duration::from_secs(5), "drain took {drained:?}");
    // Still readable after the stream ended; dropping it sends nothing more.
    assert_eq!(held[0].as_slice(), &pattern(batches - 1, slot_bytes)[..]);
    drop(held);
    rx.progress(Duration::from_millis(10)).unwrap();
}

/// An endpoint opened toward a peer is on the interface this host routes to that peer from, not
/// on whichever interface libfabric lists first (here the host's own interface is listed before
/// the loopback, so toward 127.0.0.1 the first entry would be wrong). shm has no interfaces: the
/// peer changes nothing there.
#[test]
fn an_endpoint_toward_a_peer_is_on_the_routed_interface() {
    if !available() {
        return;
    }
    let ip_of = |ep: &shardstream_fabric::Endpoint| {
        shardstream_fabric::objects::name_ip(&ep.name().expect("endpoint name")).expect("a socket address")
    };
    let loopback = std::net::IpAddr::from(std::net::Ipv4Addr::LOCALHOST);
    let ep = shardstream_fabric::stream::open_endpoint_toward(Some("tcp"), 16, Some(loopback)).unwrap();
    assert_eq!(ip_of(&ep), loopback);
    // Toward an address outside this host, when it has a route to one.
    let outside = std::net::IpAddr::from(std::net::Ipv4Addr::new(192, 0, 2, 200));
    if let Ok(source) = shardstream_fabric::objects::route_source(outside) {
        let ep = shardstream_fabric::stream::open_endpoint_toward(Some("tcp"), 16, Some(outside)).unwrap();
        assert_eq!(ip_of(&ep), source);
    }
    assert!(shardstream_fabric::stream::open_endpoint_toward(Some("shm"), 16, Some(loopback)).is_ok());
}

/// A batch gathered straight into the staging buffer (`reserve`, fill without the sender, `post`):
/// a cancelled reservation gives its buffer and credit back unwritten, one too long for the slot
/// is refused and gives both back too, and the batches posted arrive intact, in order, in the
/// one-slot ring, each credit reused.
#[test]
fn reserved_buffers_are_posted_or_given_back() {
    if !available() {
        return;
    }
    let provider = "tcp;ofi_rxm";
    let (slots, slot_bytes) = (1u32, 8192usize);
    let mut rx: RingReceiver<usize> =
        RingReceiver::new(open_endpoint(Some(provider), 64).unwrap(), slots, slot_bytes, 0).unwrap();
    let offer = rx.offer().unwrap();
    let (name_tx, name_rx) = mpsc::channel();
    let (meta_tx, meta_rx) = mpsc::channel();
    let daemon = thread::spawn(move || -> Result<(), StreamError> {
        let ep = open_endpoint(Some(provider), 16)?;
        let mut tx = RingSender::new(ep, &offer, 1)?;
        tx.stall = Duration::from_secs(2);
        name_tx.send(tx.name()?).unwrap();
        // One slot, one staging buffer: each give-back must free both, or the next reserve stalls.
        let mut staged = tx.reserve(0)?;
        staged.buffer().fill(0xEE);
        tx.cancel(staged);
        let staged = tx.reserve(0)?;
        let too_long = tx.post(staged, slot_bytes + 1).expect_err("longer than a slot");
        assert!(matches!(too_long, StreamError::TooLarge { .. }), "{too_long}");
        for b in 0..3u64 {
            let mut staged = tx.reserve(b)?;
            let len = 100 + b as usize * 1000;
            assert_eq!(staged.buffer().len(), slot_bytes);
            staged.buffer()[..len].copy_from_slice(&pattern(b, len));
            let slot = staged.slot();
            assert_eq!(tx.post(staged, len)?, slot);
            meta_tx.send((b, slot, len)).unwrap();
        }
        tx.drain()
    });
    rx.connect(&name_rx.recv().unwrap()).unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let mut delivered = Vec::new();
    while delivered.len() < 3 && std::time::Instant::now() < until {
        while let Ok((b, s, len)) = meta_rx.try_recv() {
            rx.on_meta(b, s, len).unwrap();
        }
        if let Some(r) = rx.next(Duration::from_millis(50)).unwrap() {
            assert_eq!(rx.bytes(&r, r.meta).unwrap(), &pattern(r.batch, r.meta)[..], "batch {}", r.batch);
            delivered.push(r.batch);
            rx.release(r.slot, r.batch).unwrap();
        }
    }
    assert_eq!(delivered, vec![0, 1, 2]);
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !daemon.is_finished() && std::time::Instant::now() < until {
        rx.progress(Duration::from_millis(20)).unwrap();
    }
    daemon.join().unwrap().expect("daemon");
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// A thread waiting for completions may be interrupted by a signal: a handler the process (or a
/// trainer's library) installed, or a debugger or profiler attaching (`gdb`, `py-spy dump`).
/// The wait then returns early with nothing, as a signalled queue does; it used to fail with
/// "fi_cq_read failed: Interrupted system call", ending the stream on both sides.
#[test]
fn a_wait_interrupted_by_a_signal_is_not_an_error() {
    if !available() {
        return;
    }
    // SAFETY: a handler that does nothing, installed without SA_RESTART so that the blocked
    // `epoll_wait` under `fi_cq_sread` returns EINTR; SIGUSR2 is sent to the waiting thread only.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()), 0);
    }
    let (id_tx, id_rx) = mpsc::channel();
    let waiter = thread::spawn(move || {
        let ep = open_endpoint(Some("tcp;ofi_rxm"), 16).unwrap();
        // SAFETY: pthread_self has no preconditions.
        id_tx.send(unsafe { libc::pthread_self() }).unwrap();
        let start = std::time::Instant::now();
        let mut results = Vec::new();
        while start.elapsed() < Duration::from_secs(1) {
            results.push(ep.poll(Some(Duration::from_millis(200))).map(|c| c.len()).map_err(|e| e.to_string()));
        }
        results
    });
    let id = id_rx.recv().unwrap();
    for _ in 0..5 {
        thread::sleep(Duration::from_millis(90));
        // SAFETY: the thread is alive until it has returned its results, which the join below
        // waits for; it cannot have ended before 1 s.
        unsafe { libc::pthread_kill(id, libc::SIGUSR2) };
    }
    let results = waiter.join().unwrap();
    assert!(results.iter().all(|r| r == &Ok(0)), "{results:?}");
}
