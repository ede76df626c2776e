//! Raw ring-write measurement: the daemon side `fi_writedata`s FRAMES frames into the client's
//! registered ring (window writes in flight, blocking completion waits), the client joins each
//! immediate with its metadata, checks the frame's first and last 8 bytes and returns the slot.
//! A TCP socket stands in for gRPC (addresses, then one 16-byte metadata record per frame).
//!
//! ```text
//! ringwrite server PROVIDER PORT FRAMES WINDOW [FRAME_BYTES]   # the daemon side; prints JSON
//! ringwrite client PROVIDER HOST PORT [SLOTS]                  # the trainer side; prints JSON
//! ```
//! Used by bench/rdma_bench.py against iperf3 in the same run.

use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shardstream_fabric::RemoteRegion;
use shardstream_fabric::stream::{Offer, RingReceiver, RingSender, open_endpoint};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn cpu_seconds() -> f64 {
    // SAFETY: all-zero is a valid rusage; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn write_blob(s: &mut TcpStream, b: &[u8]) -> Res<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)?;
    Ok(())
}

fn read_blob(s: &mut impl Read) -> Res<Vec<u8>> {
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n) as usize;
    if n > 1 << 20 {
        return Err("oversized blob".into());
    }
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

fn server(provider: &str, port: u16, frames: u64, window: usize, frame: usize) -> Res<()> {
    let listener = TcpListener::bind(("0.0.0.0", port))?;
    let (mut oob, _) = listener.accept()?;
    oob.set_nodelay(true)?;
    let name = read_blob(&mut oob)?;
    let o = read_blob(&mut oob)?;
    let offer = Offer {
        name,
        ring: RemoteRegion { base: u64_at(&o, 0), key: u64_at(&o, 8), len: u64_at(&o, 16) },
        slots: u64_at(&o, 24) as u32,
        slot_bytes: u64_at(&o, 32),
        provider: provider.to_owned(),
    };
    if (frame as u64) > offer.slot_bytes {
        return Err(format!("frame {frame} > slot {}", offer.slot_bytes).into());
    }
    let ep = open_endpoint(Some(provider), window + offer.slots as usize + 4)?;
    let mut tx = RingSender::new(ep, &offer, window)?;
    write_blob(&mut oob, &tx.name()?)?;
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let mut meta = Vec::with_capacity(16 * 64);
    for b in 0..frames {
        let slot = tx.send(b, |buf| {
            buf[..8].copy_from_slice(&b.to_le_bytes());
            buf[frame - 8..frame].copy_from_slice(&b.to_le_bytes());
            frame
        })?;
        meta.extend_from_slice(&b.to_le_bytes());
        meta.extend_from_slice(&u64::from(slot).to_le_bytes());
        // Metadata in small groups, as a gRPC stream would coalesce them.
        if meta.len() >= 16 * 4 || b + 1 == frames {
            oob.write_all(&meta)?;
            meta.clear();
        }
    }
    tx.drain()?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let bytes = frames as f64 * frame as f64;
    println!(
        "{{\"side\":\"server\",\"provider\":\"{}\",\"frames\":{frames},\"frame_bytes\":{frame},\"window\":{window},\"seconds\":{secs:.6},\"gbps\":{:.4},\"cpu_s\":{cpu:.4},\"cpu_s_per_gb\":{:.4},\"peak_credits\":{}}}",
        tx.provider(),
        bytes / secs / 1e9,
        cpu / (bytes / 1e9),
        tx.peak_in_use()
    );
    Ok(())
}

fn client(provider: &str, host: &str, port: u16, slots: u32) -> Res<()> {
    let mut oob = TcpStream::connect((host, port))?;
    oob.set_nodelay(true)?;
    let ep = open_endpoint(Some(provider), 64)?;
    let mut rx: RingReceiver<()> = RingReceiver::new(ep, slots, 1 << 20, 0)?;
    let offer = rx.offer()?;
    write_blob(&mut oob, &offer.name)?;
    let mut o = Vec::new();
    for v in [offer.ring.base, offer.ring.key, offer.ring.len, u64::from(offer.slots), offer.slot_bytes] {
        o.extend_from_slice(&v.to_le_bytes());
    }
    write_blob(&mut oob, &o)?;
    rx.connect(&read_blob(&mut oob)?)?;
    let (meta_tx, meta_rx) = mpsc::channel();
    let reader = oob.try_clone()?;
    std::thread::spawn(move || {
        let mut r = BufReader::new(reader);
        let mut rec = [0u8; 16];
        while r.read_exact(&mut rec).is_ok() {
            if meta_tx.send((u64_at(&rec, 0), u64_at(&rec, 8) as u32)).is_err() {
                break;
            }
        }
    });
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let mut got = 0u64;
    let mut bad = 0u64;
    let mut bytes = 0u64;
    let mut idle = Instant::now();
    loop {
        let mut closed = false;
        loop {
            match meta_rx.try_recv() {
                Ok((b, s)) => rx.on_meta(b, s, ())?,
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        match rx.next(Duration::from_millis(5))? {
            Some(r) => {
                let len = offer.slot_bytes as usize;
                let data = rx.bytes(&r, len)?;
                if u64_at(data, 0) != r.batch {
                    bad += 1;
                }
                bytes += len as u64;
                got += 1;
                rx.release(r.slot, r.batch)?;
                idle = Instant::now();
            }
            None if closed && rx.held() == 0 => break,
            None if idle.elapsed() > Duration::from_secs(30) => return Err("no data for 30 s".into()),
            None => {}
        }
    }
    // Let the last RELEASE sends complete before the endpoint closes.
    let _ = rx.next(Duration::from_millis(50));
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    println!(
        "{{\"side\":\"client\",\"provider\":\"{}\",\"frames\":{got},\"bad\":{bad},\"seconds\":{secs:.6},\"cpu_s\":{cpu:.4},\"cpu_s_per_gb\":{:.4}}}",
        rx.provider(),
        cpu / (bytes.max(1) as f64 / 1e9)
    );
    if bad > 0 {
        return Err(format!("{bad} frames carried the wrong batch").into());
    }
    Ok(())
}

fn main() -> Res<()> {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize| a.get(i).map(String::as_str).ok_or("usage: see the module docs");
    match arg(1)? {
        "server" => server(
            arg(2)?,
            arg(3)?.parse()?,
            arg(4)?.parse()?,
            arg(5)?.parse()?,
            a.get(6).map(|s| s.parse()).transpose()?.unwrap_or(1 << 20),
        ),
        "client" => client(arg(2)?, arg(3)?, arg(4)?.parse()?, a.get(5).map(|s| s.parse()).transpose()?.unwrap_or(16)),
        _ => {
            Err("usage: ringwrite server PROVIDER PORT FRAMES WINDOW [FRAME_BYTES] | client PROVIDER HOST PORT [SLOTS]"
                .into())
        }
    }
}
