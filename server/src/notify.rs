//! systemd's readiness protocol (`sd_notify`) without libsystemd: one datagram per state change
//! to the Unix socket named by `$NOTIFY_SOCKET` (a path, or `@name` for an abstract socket).
//! `serve` sends `READY=1` once it accepts connections and `STOPPING=1` when a shutdown begins, so
//! a `Type=notify` unit orders its dependents after the socket really exists.
//!
//! Without `$NOTIFY_SOCKET` every call does nothing. A failed send is logged, never fatal: the
//! daemon serves either way, and systemd will notice the missing READY by its own timeout.

use rustix::net::{AddressFamily, SendFlags, SocketAddrUnix, SocketFlags, SocketType};

/// Sends `state` (e.g. `"READY=1"`) to `$NOTIFY_SOCKET`, if set.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else { return };
    if let Err(e) = send(target.as_encoded_bytes(), state) {
        tracing::warn!(socket = %target.to_string_lossy(), state, error = %e, "sd_notify failed");
    }
}

fn send(target: &[u8], state: &str) -> std::io::Result<()> {
    let addr = match target.strip_prefix(b"@") {
        Some(name) => SocketAddrUnix::new_abstract_name(name)?,
        None => SocketAddrUnix::new(target)?,
    };
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::DGRAM, SocketFlags::CLOEXEC, None)?;
    rustix::net::sendto(&fd, state.as_bytes(), SendFlags::NOSIGNAL, &addr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str().as_encoded_bytes(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    #[test]
    fn missing_socket_is_an_error_not_a_panic() {
        assert!(send(b"/nonexistent/notify", "READY=1").is_err());
    }
}
