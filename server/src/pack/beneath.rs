//! Opening input files strictly beneath SRC.
//!
//! A `--files-from` entry is a path relative to SRC, but any directory on that path may be a
//! symlink that leads out of SRC (`SRC/a -> /etc`, or `SRC/d/up -> ../..`): checking only the
//! last component, or the textual path, would read files the packer was never given. The kernel
//! resolves the whole path here with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` from an
//! open descriptor of SRC, so no component can step out of it, and no rename racing the check can
//! move it out either.
//!
//! `RESOLVE_BENEATH` also refuses absolute symlinks, even those pointing back inside SRC (a
//! common way to link files in a tree). Such a path is resolved once in user space; if it ends
//! inside SRC, the remainder is opened beneath SRC again, so the kernel still has the last word.
//!
//! Kernels before 5.6 have no `openat2` (`ENOSYS`). There the path is walked one component at a
//! time with `O_NOFOLLOW`: symlinked directories are then refused even when they stay inside SRC
//! (stricter, never looser), and a symlink in the last component is resolved and checked as
//! above. The fallback is logged once, so an operator knows which rules applied.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Once;

use rustix::fs::{Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Times a resolution is retried when the kernel reports a concurrent rename (`EAGAIN`).
const RACE_RETRIES: u32 = 8;

/// Why a path could not be opened beneath SRC.
#[derive(Debug)]
pub enum OpenError {
    /// The path leads out of SRC; `to` is where it resolves, when that could be found.
    Outside { to: Option<PathBuf> },
    /// A directory on the path is a symlink, refused by the component walk (no `openat2`).
    SymlinkedDir,
    /// Any other failure (`NotFound`, `EACCES`, `ENOTDIR`, `ELOOP`, ...).
    Io(std::io::Error),
}

/// SRC, canonical, and a descriptor of it that every open is resolved from.
#[derive(Debug)]
pub struct SrcDir {
    path: PathBuf,
    fd: OwnedFd,
    /// Use the component walk even when `openat2` exists (tests of the fallback).
    walk_only: bool,
}

impl SrcDir {
    /// Opens `path` (canonical) as the root of all reads.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let fd = rustix::fs::open(path, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(Self { path: path.to_owned(), fd, walk_only: false })
    }

    /// As [`open`](Self::open), but always with the pre-5.6 component walk.
    #[cfg(test)]
    pub fn open_walk_only(path: &Path) -> std::io::Result<Self> {
        Ok(Self { walk_only: true, ..Self::open(path)? })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `rel` (relative, `/`-separated, no `..`) for reading without leaving SRC. A symlink
    /// in the last component is followed when its target is inside SRC.
    pub fn open_file(&self, rel: &str) -> Result<File, OpenError> {
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let first = if self.walk_only { Err(Errno::NOSYS) } else { self.openat2(Path::new(rel), flags) };
        match first {
            Ok(fd) => Ok(File::from(fd)),
            // An absolute symlink (refused by RESOLVE_BENEATH wherever it points) or an escape.
            Err(Errno::XDEV) => self.via_resolved(rel, |inside| self.openat2(inside, flags)),
            Err(Errno::NOSYS) => {
                static WARNED: Once = Once::new();
                if !self.walk_only {
                    WARNED.call_once(|| {
                        tracing::warn!(
                            "this kernel has no openat2 (Linux < 5.6): pack opens inputs one path component \
                             at a time with O_NOFOLLOW, and refuses symlinked directories even inside SRC"
                        )
                    });
                }
                match self.walk(rel, flags) {
                    Err(OpenError::Io(e)) if e.raw_os_error() == Some(libc::ELOOP) => {
                        self.via_resolved(rel, |inside| match self.walk(inside, flags) {
                            Ok(f) => Ok(f.into()),
                            Err(OpenError::Io(e)) => Err(Errno::from_io_error(&e).unwrap_or(Errno::IO)),
                            Err(_) => Err(Errno::LOOP),
                        })
                    }
                    other => other,
                }
            }
            Err(e) => Err(OpenError::Io(e.into())),
        }
    }

    fn openat2(&self, rel: &Path, flags: OFlags) -> Result<OwnedFd, Errno> {
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
        let mut tries = 0;
        loop {
            match rustix::fs::openat2(self.fd.as_fd(), rel, flags, Mode::empty(), resolve) {
                Err(Errno::AGAIN) if tries < RACE_RETRIES => tries += 1,
                other => return other,
            }
        }
    }

    /// Resolves `rel` in user space (it holds a symlink the kernel would not follow here): when
    /// it ends inside SRC, `reopen` opens the remainder (again beneath SRC); else it is refused.
    fn via_resolved(&self, rel: &str, reopen: impl Fn(&Path) -> Result<OwnedFd, Errno>) -> Result<File, OpenError> {
        let target = std::fs::canonicalize(self.path.join(rel)).map_err(OpenError::Io)?;
        match target.strip_prefix(&self.path) {
            // SRC itself (a link to it) opens as "." and is then refused as a directory.
            Ok(inside) => match reopen(if inside.as_os_str().is_empty() { Path::new(".") } else { inside }) {
                Ok(fd) => Ok(File::from(fd)),
                // Swapped for a link out of SRC since it was resolved.
                Err(Errno::XDEV) => Err(OpenError::Outside { to: None }),
                Err(e) => Err(OpenError::Io(e.into())),
            },
            Err(_) => Err(OpenError::Outside { to: Some(target) }),
        }
    }

    /// The pre-`openat2` resolution: each directory opened with `O_NOFOLLOW` from the one before.
    fn walk(&self, rel: impl AsRef<Path>, flags: OFlags) -> Result<File, OpenError> {
        let rel = rel.as_ref();
        let parts: Vec<&std::ffi::OsStr> = rel.iter().collect();
        let Some((last, dirs)) = parts.split_last() else {
            return Err(OpenError::Io(std::io::Error::from(std::io::ErrorKind::InvalidInput)));
        };
        let mut dir: Option<OwnedFd> = None;
        for name in dirs {
            let at = dir.as_ref().map_or(self.fd.as_fd(), |d| d.as_fd());
            let dflags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            match rustix::fs::openat(at, *name, dflags, Mode::empty()) {
                Ok(fd) => dir = Some(fd),
                // O_PATH|O_NOFOLLOW opens a symlink itself, which O_DIRECTORY then refuses;
                // tell a symlink from a plain file so the error says what happened.
                Err(Errno::NOTDIR | Errno::LOOP) if is_symlink(at, name) => return Err(OpenError::SymlinkedDir),
                Err(e) => return Err(OpenError::Io(e.into())),
            }
        }
        let at = dir.as_ref().map_or(self.fd.as_fd(), |d| d.as_fd());
        rustix::fs::openat(at, *last, flags | OFlags::NOFOLLOW, Mode::empty())
            .map(File::from)
            .map_err(|e| OpenError::Io(e.into()))
    }
}

fn is_symlink(at: std::os::fd::BorrowedFd<'_>, name: &std::ffi::OsStr) -> bool {
    rustix::fs::statat(at, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    fn read(dir: &SrcDir, rel: &str) -> Result<String, OpenError> {
        let mut s = String::new();
        dir.open_file(rel)?.read_to_string(&mut s).map_err(OpenError::Io)?;
        Ok(s)
    }

    #[test]
    fn stays_beneath_src_with_and_without_openat2() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let src = root.join("src");
        std::fs::create_dir_all(src.join("d/e")).unwrap();
        std::fs::create_dir_all(root.join("outside")).unwrap();
        std::fs::write(src.join("d/e/f.txt"), "inside").unwrap();
        std::fs::write(root.join("outside/x.txt"), "secret").unwrap();
        symlink(root.join("outside"), src.join("a")).unwrap(); // absolute, out
        symlink("../..", src.join("d/up")).unwrap(); // relative, out
        symlink("e", src.join("d/alias")).unwrap(); // relative, in
        symlink(src.join("d/e/f.txt"), src.join("abs.txt")).unwrap(); // absolute file link, in
        symlink(root.join("outside/x.txt"), src.join("out.txt")).unwrap(); // absolute file link, out

        for dir in [SrcDir::open(&src).unwrap(), SrcDir::open_walk_only(&src).unwrap()] {
            let walk_only = dir.walk_only;
            assert_eq!(read(&dir, "d/e/f.txt").unwrap(), "inside");
            assert_eq!(read(&dir, "abs.txt").unwrap(), "inside", "walk_only={walk_only}");
            assert!(matches!(read(&dir, "out.txt"), Err(OpenError::Outside { to: Some(_) })));
            for escape in ["a/x.txt", "d/up/outside/x.txt"] {
                match read(&dir, escape) {
                    Err(OpenError::Outside { .. }) => {}
                    Err(OpenError::SymlinkedDir) if walk_only => {}
                    other => panic!("{escape} (walk_only={walk_only}): {other:?}"),
                }
            }
            match read(&dir, "d/alias/f.txt") {
                Ok(s) if !walk_only => assert_eq!(s, "inside"),
                Err(OpenError::SymlinkedDir) if walk_only => {}
                other => panic!("d/alias/f.txt (walk_only={walk_only}): {other:?}"),
            }
            match read(&dir, "missing.txt") {
                Err(OpenError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::NotFound),
                other => panic!("{other:?}"),
            }
        }
    }
}
