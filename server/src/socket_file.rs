//! The file a Unix socket is bound at. Binding needs the path free, and a daemon that crashed
//! leaves its socket behind, so a stale *socket* is replaced; anything else at the path (a user's
//! file, a directory, a symlink) is an error, never deleted: a mistyped `--listen` must not cost
//! anyone a file. A failure to look (EACCES, EIO) is an error too, where `Path::exists` would have
//! said "nothing there" and let the bind fail later with a less useful message.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use crate::{Error, Result};

/// Whether a socket already exists at `path` (`false`: nothing does). Anything that is not a
/// socket is an error naming what it is.
pub fn socket_exists(path: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => Ok(true),
        Ok(meta) => {
            let ft = meta.file_type();
            let what = if ft.is_dir() {
                "a directory"
            } else if ft.is_symlink() {
                "a symbolic link"
            } else if ft.is_file() {
                "a regular file"
            } else {
                "not a socket"
            };
            Err(Error::invalid(format!(
                "cannot listen on {}: the path exists and is {what}, not a socket; refusing to replace it",
                path.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("cannot inspect the socket path", path, e)),
    }
}

/// Removes the stale socket at `path`, if there is one (see [`socket_exists`]).
pub fn remove_stale_socket(path: &Path) -> Result<()> {
    if socket_exists(path)? {
        std::fs::remove_file(path).map_err(|e| Error::io("cannot remove stale socket", path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn replaces_a_socket_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("sock");
        assert!(!socket_exists(&sock).unwrap());
        remove_stale_socket(&sock).unwrap();
        drop(UnixListener::bind(&sock).unwrap());
        assert!(socket_exists(&sock).unwrap());
        remove_stale_socket(&sock).unwrap();
        assert!(!sock.try_exists().unwrap());

        let file = dir.path().join("notes.txt");
        std::fs::write(&file, b"keep me").unwrap();
        let err = remove_stale_socket(&file).unwrap_err().to_string();
        assert!(err.contains("regular file") && err.contains("notes.txt"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");

        let err = socket_exists(dir.path()).unwrap_err().to_string();
        assert!(err.contains("a directory"), "{err}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(socket_exists(&link).unwrap_err().to_string().contains("symbolic link"));
    }

    #[test]
    fn a_path_that_cannot_be_looked_at_is_an_error_not_absent() {
        // A path under a regular file: ENOTDIR, which `Path::exists` reports as "absent".
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"").unwrap();
        let err = socket_exists(&file.join("sock")).unwrap_err().to_string();
        assert!(err.contains("cannot inspect"), "{err}");
    }
}
