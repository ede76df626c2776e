//! The daemon's Unix socket files (the gRPC socket and its `<sock>.shm` side channel): who may
//! connect to them, and never destroying a file that is not ours.
//!
//! - A path that already exists is replaced only when it is a *stale* socket: a socket nobody
//!   listens on (a daemon killed with SIGKILL leaves one). A regular file, a directory, a symlink
//!   or a socket some process answers on is an error naming the path; nothing is removed.
//! - A socket is created with its final mode and group from the start. It is bound inside a fresh
//!   owner-only directory next to its final path, given its group and mode there, and renamed into
//!   place (no-replace) before `listen`: nobody can reach it at a wider mode, ever. This instead of
//!   a umask around `bind`, because umask is process-wide and the daemon also runs embedded in a
//!   multithreaded Python process whose other threads create files meanwhile.
//! - An existing directory for the socket must be the daemon's user's or root's: another user who
//!   owns it (one who made `/tmp/shardstream-<job>` before the job did) could rename the socket
//!   away and put their own in its place, and trainers would take that user's data.

use std::os::fd::OwnedFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Gid, Mode};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::{Error, Result};

/// The longest path a Unix socket address holds: `sun_path` is 108 bytes with its NUL.
pub const SUN_PATH_MAX: usize = 107;

/// An error naming `path` and the limit when it is longer than `max` bytes; `why` says where the
/// limit comes from (a caller binding two sockets from one path gives the shorter).
pub fn check_len(path: &Path, max: usize, why: &str) -> Result<()> {
    let n = path.as_os_str().len();
    if n <= max {
        return Ok(());
    }
    Err(Error::invalid(format!("socket path {} is {n} bytes; it may be at most {max} ({why})", path.display())))
}

/// Who may connect to the daemon's sockets: the file mode and (optionally) the group owning them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketAccess {
    /// Permission bits of the socket files (connecting needs write permission).
    pub mode: u32,
    /// Group to own the sockets (and a socket directory the daemon creates); `None`: the daemon's.
    pub group: Option<u32>,
}

impl Default for SocketAccess {
    /// Owner only: trainers run as the daemon's user.
    fn default() -> Self {
        Self { mode: 0o600, group: None }
    }
}

impl SocketAccess {
    /// Mode of a socket directory the daemon creates: traversable by whoever may use the socket.
    pub fn dir_mode(&self) -> u32 {
        let mut m = 0o700;
        if self.mode & 0o060 != 0 {
            m |= 0o050;
        }
        if self.mode & 0o006 != 0 {
            m |= 0o005;
        }
        m
    }
}

/// Parses `--socket-mode`: octal permission bits (`660`, `0660`, `0o660`), owner read+write kept.
pub fn parse_mode(s: &str) -> std::result::Result<u32, String> {
    let digits = s.trim().trim_start_matches("0o");
    let m = u32::from_str_radix(digits, 8).map_err(|_| format!("{s:?} is not an octal mode such as 0660"))?;
    if m > 0o777 {
        return Err(format!("{s:?}: only permission bits (at most 0777) are allowed"));
    }
    if m & 0o600 != 0o600 {
        return Err(format!("{s:?}: the owner (the daemon) needs read and write permission (0600)"));
    }
    Ok(m)
}

/// Resolves `--socket-group`: a numeric gid, or a group name looked up in `/etc/group` (groups
/// only known to NSS services such as LDAP must be given by number).
pub fn parse_group(s: &str) -> std::result::Result<u32, String> {
    if let Ok(gid) = s.trim().parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").map_err(|e| format!("cannot read /etc/group: {e}"))?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            Some((f.next()?, f.nth(1)?))
        })
        .find(|(name, _)| *name == s.trim())
        .and_then(|(_, gid)| gid.parse().ok())
        .ok_or_else(|| format!("no group named {s:?} in /etc/group (give the numeric gid)"))
}

fn errno(op: &'static str, path: &Path, e: Errno) -> Error {
    Error::io(op, path, e.into())
}

/// Makes way for a new socket at `path`: nothing there, or a stale socket (removed). Anything
/// else is an error that names the path and leaves it alone. `ty`: the socket type the daemon
/// will listen with (stream for gRPC, seqpacket for the side channel).
pub fn clear_stale(path: &Path, ty: SocketType) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("cannot inspect", path, e)),
    };
    if !meta.file_type().is_socket() {
        let what = if meta.is_dir() {
            "a directory"
        } else if meta.file_type().is_symlink() {
            "a symbolic link"
        } else {
            "a file that is not a socket"
        };
        return Err(Error::Unavailable(format!(
            "{} exists and is {what}; refusing to replace it (choose another --listen path or remove it)",
            path.display()
        )));
    }
    let probe = rustix::net::socket_with(AddressFamily::UNIX, ty, SocketFlags::CLOEXEC, None)
        .map_err(|e| errno("cannot create a probe socket for", path, e))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| errno("bad socket path", path, e))?;
    match rustix::net::connect(&probe, &addr) {
        Ok(()) => Err(Error::Unavailable(format!("another daemon is already listening on {}", path.display()))),
        Err(Errno::CONNREFUSED) => {
            tracing::info!(path = %path.display(), "replacing a stale socket");
            std::fs::remove_file(path).map_err(|e| Error::io("cannot remove stale socket", path, e))
        }
        Err(e) => Err(Error::Unavailable(format!(
            "{} is a socket another program may be using ({e}); refusing to replace it",
            path.display()
        ))),
    }
}

/// Creates the socket's directory when it is missing, with the mode and group `access` needs.
/// An existing directory is used as it is (the operator's, kubelet's or systemd's) when it
/// belongs to this process's user or root (see the module docs).
pub fn prepare_dir(path: &Path, access: &SocketAccess) -> Result<()> {
    let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) else { return Ok(()) };
    if dir.try_exists().map_err(|e| Error::io("cannot check socket directory", dir, e))? {
        return check_owner(dir, rustix::process::geteuid().as_raw());
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create socket directory", dir, e))?;
    if let Some(gid) = access.group {
        rustix::fs::chown(dir, None, Some(Gid::from_raw(gid)))
            .map_err(|e| errno("cannot give the socket group to", dir, e))?;
    }
    rustix::fs::chmod(dir, Mode::from_raw_mode(access.dir_mode()))
        .map_err(|e| errno("cannot set the mode of socket directory", dir, e))
}

/// Refuses the existing socket directory `dir` unless user `me` or root owns it, and, when it is
/// a symlink, the link too (its owner could point it elsewhere later). Inside a user namespace
/// (Apptainer, rootless containers) root's files show as the overflow uid, which is then
/// accepted too: there the check cannot tell root from another user it does not map.
fn check_owner(dir: &Path, me: u32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let trusted = |owner: u32| owner == me || owner == 0 || Some(owner) == unmapped_owner();
    let stat = |follow: bool| {
        let m = if follow { std::fs::metadata(dir) } else { std::fs::symlink_metadata(dir) };
        m.map_err(|e| Error::io("cannot check socket directory", dir, e))
    };
    let link = stat(false)?;
    let (what, owner) = match link.file_type().is_symlink() {
        true if !trusted(link.uid()) => ("is a symlink that ", link.uid()),
        _ => ("", stat(true)?.uid()),
    };
    if what.is_empty() && trusted(owner) {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "socket directory {} {what}belongs to uid {owner}, not to this daemon's user (uid {me}) or root: its \
         owner could replace the socket with their own; listen in a directory of your own (a missing one is \
         created, mode 0700 or as --socket-mode needs)",
        dir.display()
    )))
}

/// The uid that files of users this process's user namespace does not map show as, when it runs
/// in one that does not map every uid (outside any, None).
fn unmapped_owner() -> Option<u32> {
    let map = std::fs::read_to_string("/proc/self/uid_map").ok()?;
    let whole = map.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"]);
    if whole {
        return None;
    }
    std::fs::read_to_string("/proc/sys/kernel/overflowuid").ok()?.trim().parse().ok()
}

/// Binds and listens on a Unix socket of type `ty` at `path` with `access` from the first moment
/// (see the module docs). Refuses to replace anything but a stale socket.
pub fn listen(path: &Path, ty: SocketType, access: &SocketAccess, backlog: i32) -> Result<OwnedFd> {
    check_len(path, SUN_PATH_MAX, "what a Unix socket address holds")?;
    prepare_dir(path, access)?;
    clear_stale(path, ty)?;
    let staging = staging_dir(path)?;
    let result = bind_in(&staging, path, ty, access, backlog);
    let _ = std::fs::remove_file(staging.join("s"));
    let _ = std::fs::remove_dir(&staging);
    result
}

/// A fresh owner-only directory beside `path` (same file system, so the rename is atomic).
fn staging_dir(path: &Path) -> Result<PathBuf> {
    let parent = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    for _ in 0..8 {
        // Short: the staging path must fit in sun_path (108 bytes) wherever the final one does, or nearly.
        let dir = parent.join(format!(".ss{:08x}", fastrand::u32(..)));
        match rustix::fs::mkdir(&dir, Mode::from_raw_mode(0o700)) {
            Ok(()) => return Ok(dir),
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(errno("cannot create a staging directory in", parent, e)),
        }
    }
    Err(Error::Unavailable(format!("cannot create a staging directory in {}", parent.display())))
}

fn bind_in(staging: &Path, path: &Path, ty: SocketType, access: &SocketAccess, backlog: i32) -> Result<OwnedFd> {
    let tmp = staging.join("s");
    let fd = rustix::net::socket_with(AddressFamily::UNIX, ty, SocketFlags::CLOEXEC, None)
        .map_err(|e| errno("cannot create socket", path, e))?;
    if tmp.as_os_str().len() <= SUN_PATH_MAX {
        let addr = SocketAddrUnix::new(&tmp).map_err(|e| errno("cannot bind", path, e))?;
        rustix::net::bind(&fd, &addr).map_err(|e| errno("cannot bind", path, e))?;
    } else {
        // The staging directory's name makes this path longer than the final one, which fits:
        // bind through the directory's descriptor (`/proc/self/fd/N/s` resolves to it).
        let dir = rustix::fs::open(
            staging,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| errno("cannot open the staging directory for", path, e))?;
        let short = format!("/proc/self/fd/{}/s", std::os::fd::AsRawFd::as_raw_fd(&dir));
        let addr = SocketAddrUnix::new(short.as_str()).map_err(|e| errno("cannot bind", path, e))?;
        rustix::net::bind(&fd, &addr).map_err(|e| errno("cannot bind (through /proc/self/fd)", path, e))?;
    }
    if let Some(gid) = access.group {
        rustix::fs::chown(&tmp, None, Some(Gid::from_raw(gid)))
            .map_err(|e| errno("cannot give the socket group (is the daemon a member?) to", path, e))?;
    }
    rustix::fs::chmod(&tmp, Mode::from_raw_mode(access.mode)).map_err(|e| errno("cannot set the mode of", path, e))?;
    rustix::fs::renameat_with(rustix::fs::CWD, &tmp, rustix::fs::CWD, path, rustix::fs::RenameFlags::NOREPLACE)
        .map_err(|e| match e {
            Errno::EXIST => Error::Unavailable(format!("{} appeared while the daemon was starting", path.display())),
            e => errno("cannot move the socket into place at", path, e),
        })?;
    rustix::net::listen(&fd, backlog).map_err(|e| errno("cannot listen on", path, e))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn modes() {
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert_eq!(parse_mode("0o660"), Ok(0o660));
        assert_eq!(parse_mode("0600"), Ok(0o600));
        assert!(parse_mode("440").is_err());
        assert!(parse_mode("1777").is_err());
        assert!(parse_mode("rw").is_err());
        assert_eq!(SocketAccess { mode: 0o660, group: None }.dir_mode(), 0o750);
        assert_eq!(SocketAccess::default().dir_mode(), 0o700);
    }

    #[test]
    fn a_socket_directory_of_another_user_is_refused() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let owner = std::fs::metadata(dir.path()).unwrap().uid();
        assert!(check_owner(dir.path(), owner).is_ok());
        // The other user: anyone but the owner, and the owner anyone but root.
        let (me, theirs) = if owner == 0 {
            rustix::fs::chown(dir.path(), Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
            (0, 65534)
        } else {
            (owner + 1, owner)
        };
        let e = check_owner(dir.path(), me).unwrap_err().to_string();
        assert!(e.contains(&format!("belongs to uid {theirs}, not to this daemon's user (uid {me})")), "{e}");
        assert!(check_owner(dir.path(), theirs).is_ok());
        // Root's directories (kubelet's hostPath, an emptyDir) are used as they are.
        assert!(check_owner(Path::new("/"), me).is_ok());
        // A link the other user owns, to a directory the daemon may use: they could repoint it.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/", &link).unwrap();
        if owner == 0 {
            std::os::unix::fs::lchown(&link, Some(theirs), None).unwrap();
        }
        let e = check_owner(&link, me).unwrap_err().to_string();
        assert!(e.contains(&format!("is a symlink that belongs to uid {theirs}")), "{e}");
        assert!(check_owner(&link, theirs).is_ok());
    }

    #[test]
    fn groups() {
        assert_eq!(parse_group("0"), Ok(0));
        assert_eq!(parse_group("root"), Ok(0));
        assert!(parse_group("no-such-group-here").is_err());
    }

    #[test]
    fn socket_has_its_mode_and_foreign_files_survive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        let access = SocketAccess { mode: 0o660, group: None };
        let fd = listen(&path, SocketType::STREAM, &access, 8).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o660);
        // Live: refused, and left alone.
        assert!(clear_stale(&path, SocketType::STREAM).is_err());
        assert!(path.try_exists().unwrap());
        drop(fd);
        // Stale: removed.
        clear_stale(&path, SocketType::STREAM).unwrap();
        assert!(!path.try_exists().unwrap());
        std::fs::write(&path, b"keep").unwrap();
        let err = listen(&path, SocketType::STREAM, &access, 8).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep");
        // No staging directories left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
