//! Confined opens of local shards, for a daemon with an `allow` list ([`crate::access`]).
//!
//! The allow list checks the location a URL names, but the daemon reads what the listing finds
//! there: a shard that is a symbolic link, a `key=value` partition directory that is one, or a
//! manifest entry through a linked directory can lead anywhere the daemon may read. Anyone who
//! may write inside a root could then read every file the daemon can. So, once [`confine`] is
//! called:
//! - a local shard is known by its real location ([`real_location`], every link followed when
//!   the dataset is listed), which the allow list checks for each requester before the dataset
//!   is read or described;
//! - each open of a shard ([`check_opened`]) asks the kernel where the descriptor it got leads
//!   (`/proc/self/fd/N`), after the open: a directory swapped for a link between the check and the
//!   open (or during it) is refused, not followed. Asking after the open works on every kernel,
//!   where `openat2(RESOLVE_NO_SYMLINKS)` needs Linux 5.6.
//!
//! Links that stay inside the roots keep working: the real location is what must lie inside.
//! Without an allow list nothing changes: paths are opened as they are named.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::{Error, Result};

/// Set once, when the daemon starts with an allow list; never cleared.
static CONFINED: AtomicBool = AtomicBool::new(false);

/// From now on, local shards are known by their real location and opened only there.
pub fn confine() {
    CONFINED.store(true, Ordering::Release);
}

pub fn confined() -> bool {
    CONFINED.load(Ordering::Acquire)
}

/// Where a shard's path leads, every symbolic link followed, when opens are confined; the path
/// as it is otherwise. A link to nothing is a missing shard, named by its path.
pub fn real_location(path: PathBuf) -> Result<PathBuf> {
    if confined() { resolved(path) } else { Ok(path) }
}

fn resolved(path: PathBuf) -> Result<PathBuf> {
    std::fs::canonicalize(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound { what: "shard", path: path.display().to_string() },
        _ => Error::io("cannot resolve shard", &path, e),
    })
}

/// When opens are confined: refuses `file`, opened from `path` (a real location), unless the
/// kernel says the descriptor is that file at that path, with no link taken on the way.
pub fn check_opened(file: &File, path: &Path) -> Result<()> {
    if confined() { opened_at(file, path) } else { Ok(()) }
}

pub(super) fn opened_at(file: &File, path: &Path) -> Result<()> {
    let fd = format!("/proc/self/fd/{}", file.as_raw_fd());
    let opened = std::fs::read_link(&fd).map_err(|e| {
        Error::io("cannot tell where an opened shard lies (the allow list needs /proc/self/fd)", path, e)
    })?;
    if opened != path {
        return Err(Error::PermissionDenied {
            path: path.display().to_string(),
            reason: format!(
                "it was checked against the allow list at this location, and opening it now leads to {} \
                 (a directory on its path was replaced by a link since)",
                opened.display()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_swapped_for_a_link_after_it_was_resolved_is_refused() {
        let root = tempfile::tempdir().expect("temp dir");
        let (inside, outside) = (root.path().join("inside"), root.path().join("outside"));
        for d in [&inside, &outside] {
            std::fs::create_dir(d).expect("dir");
            std::fs::write(d.join("s.tar"), b"x").expect("shard");
        }
        std::os::unix::fs::symlink(root.path().join("inside/s.tar"), root.path().join("link.tar")).expect("link");
        // The process-wide switch stays off here: other tests of this binary open through links.
        // A link is known by where it leads.
        let real = resolved(root.path().join("link.tar")).expect("resolved");
        assert_eq!(real, std::fs::canonicalize(inside.join("s.tar")).expect("canonical"));
        let missing = resolved(root.path().join("none.tar")).expect_err("missing").to_string();
        assert!(missing.contains("none.tar"), "{missing}");
        opened_at(&File::open(&real).expect("open"), &real).expect("where it was checked");
        // The directory becomes a link to elsewhere: the same path now opens another file.
        std::fs::rename(&inside, root.path().join("moved")).expect("move away");
        std::os::unix::fs::symlink(&outside, &inside).expect("swap in a link");
        let err = opened_at(&File::open(&real).expect("open"), &real).expect_err("swapped").to_string();
        assert!(err.contains("replaced by a link") && err.contains("outside"), "{err}");
    }
}
