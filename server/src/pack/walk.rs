//! Finding the input files: a parallel walk of SRC, or the lines of a `--files-from` list. Either
//! way the result is a list of paths relative to SRC, `/`-separated and UTF-8 (names only: no
//! file is opened or stat'ed here, beyond what listing a directory costs).
//!
//! The walk reads directories on several threads, because on a parallel file system each
//! directory listing is a metadata round trip and the tree is wide. It descends into real
//! directories only: a symlink to a directory is a bad input, named (following it is how a walk
//! loops, or reads a tree twice under two keys, or leaves SRC). It skips hidden entries (`.git`,
//! `.DS_Store`: not samples by the WebDataset convention) and the output directory when it lies
//! inside SRC, and reports FIFOs, sockets and devices (reading one would block or make no sense)
//! and directories holding a shardstream dataset (`_shardstream/`: an earlier pack's output,
//! whose shards, manifest and journal are not samples; SRC itself being one is an error).
//! Symlinks to files are listed; whether they stay inside SRC is checked when they are opened
//! (`read`), the same way for the walk and for `--files-from`. Telling the two kinds of symlink
//! apart costs a `stat` per symlink, none per file.
//!
//! A `--files-from` list trusts its entries as far as they go: each is made relative to SRC, and
//! an entry with a `..` component, or an absolute one outside SRC, is a bad input. It is not
//! stat'ed: skipping the metadata-heavy walk is the point of the option. Its directories may be
//! symlinks, so the text of an entry proves nothing: it is opened strictly beneath SRC
//! ([`super::beneath`]), and refused when any component leads out.

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::{Condvar, Mutex};

use super::report::{BadInput, BadKind, Reporter};
use crate::index::manifest::SIDECAR_DIR;
use crate::{Error, Result};

/// Where a `--files-from` list comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileList {
    Path(PathBuf),
    Stdin,
    /// Entries given directly (library callers and tests).
    Entries(Vec<String>),
}

/// Joins a relative directory and a name with `/`.
fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() { name.to_owned() } else { format!("{dir}/{name}") }
}

fn lossy(dir: &str, name: &OsStr) -> String {
    join(dir, &name.to_string_lossy())
}

#[derive(Default)]
struct Queue {
    dirs: Vec<String>,
    busy: usize,
    failed: Option<Error>,
}

/// Walks `src` (canonical) on up to `threads` threads; `exclude` (canonical) is not entered.
/// Returns the relative paths of regular files and symlinks, in no particular order.
pub fn walk(src: &Path, exclude: Option<&Path>, threads: usize, reporter: &Reporter) -> Result<Vec<String>> {
    // SRC itself must be listable: anything else is not a tree to pack.
    let meta = std::fs::metadata(src).map_err(|e| Error::io("cannot read source directory", src, e))?;
    if !meta.is_dir() {
        return Err(Error::invalid(format!("source {} is not a directory", src.display())));
    }
    std::fs::read_dir(src).map_err(|e| Error::io("cannot list source directory", src, e))?;

    let queue = Mutex::new(Queue { dirs: vec![String::new()], ..Queue::default() });
    let wake = Condvar::new();
    let mut found = Vec::new();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut files = Vec::new();
                    loop {
                        let dir = {
                            let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
                            loop {
                                if q.failed.is_some() {
                                    return files;
                                }
                                if let Some(d) = q.dirs.pop() {
                                    q.busy += 1;
                                    break d;
                                }
                                if q.busy == 0 {
                                    return files;
                                }
                                q = wake.wait(q).unwrap_or_else(|p| p.into_inner());
                            }
                        };
                        let mut subdirs = Vec::new();
                        let r = list_dir(src, &dir, exclude, reporter, &mut subdirs, &mut files);
                        let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
                        q.busy -= 1;
                        q.dirs.extend(subdirs);
                        if let Err(e) = r {
                            q.failed.get_or_insert(e);
                        }
                        wake.notify_all();
                    }
                })
            })
            .collect();
        for w in workers {
            match w.join() {
                Ok(files) => found.extend(files),
                Err(_) => {
                    queue.lock().unwrap_or_else(|p| p.into_inner()).failed =
                        Some(Error::Internal("a walker thread panicked".into()))
                }
            }
        }
    });
    if let Some(e) = queue.into_inner().unwrap_or_else(|p| p.into_inner()).failed {
        return Err(e);
    }
    Ok(found)
}

fn list_dir(
    src: &Path,
    dir: &str,
    exclude: Option<&Path>,
    reporter: &Reporter,
    subdirs: &mut Vec<String>,
    files: &mut Vec<String>,
) -> Result<()> {
    let full = src.join(dir);
    let entries = match std::fs::read_dir(&full) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return reporter.bad(BadInput::new(BadKind::Vanished, dir, "directory vanished during the walk"));
        }
        Err(e) => return reporter.bad(BadInput::new(BadKind::Unreadable, dir, format!("cannot list directory: {e}"))),
    };
    // Kept apart until the listing ends: a `_shardstream/` among the entries makes the whole
    // directory a dataset, whatever came before it.
    let (mut here_dirs, mut here_files) = (Vec::new(), Vec::new());
    let mut dataset = false;
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                reporter.bad(BadInput::new(BadKind::Unreadable, dir, format!("cannot list directory: {e}")))?;
                break;
            }
        };
        let os_name = entry.file_name();
        let Some(name) = os_name.to_str() else {
            reporter.bad(BadInput::new(
                BadKind::NotUtf8,
                lossy(dir, &os_name),
                "file name is not valid UTF-8 (keys must be text); rename it",
            ))?;
            continue;
        };
        let rel = join(dir, name);
        if name.starts_with('.') {
            reporter.ignored(&rel, "hidden");
            continue;
        }
        // d_type from the directory listing: no stat on file systems that fill it in.
        let ft = match entry.file_type() {
            Ok(ft) => ft,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                reporter.bad(BadInput::new(BadKind::Vanished, rel, "vanished during the walk"))?;
                continue;
            }
            Err(e) => {
                reporter.bad(BadInput::new(BadKind::Unreadable, rel, e.to_string()))?;
                continue;
            }
        };
        if ft.is_dir() {
            if exclude.is_some_and(|x| x == full.join(name)) {
                continue; // the output directory, inside SRC
            }
            dataset |= name == SIDECAR_DIR;
            here_dirs.push(rel);
        } else if ft.is_symlink() && std::fs::metadata(full.join(name)).is_ok_and(|m| m.is_dir()) {
            reporter.bad(BadInput::new(
                BadKind::NotAFile,
                rel,
                "a symlink to a directory, not followed: move or copy the directory into SRC, or list its files \
                 with --files-from",
            ))?;
        } else if ft.is_file() || ft.is_symlink() {
            here_files.push(rel);
        } else {
            reporter.bad(BadInput::new(BadKind::NotAFile, rel, "not a regular file (FIFO, socket or device)"))?;
        }
    }
    if dataset {
        if dir.is_empty() {
            return Err(Error::invalid(format!(
                "source {} holds a shardstream dataset ({SIDECAR_DIR}/): pack the files it was made from, not its \
                 shards",
                src.display()
            )));
        }
        return reporter.bad(BadInput::new(
            BadKind::Dataset,
            dir,
            format!("holds a shardstream dataset ({SIDECAR_DIR}/), an earlier pack's output most likely; not packed"),
        ));
    }
    subdirs.append(&mut here_dirs);
    files.append(&mut here_files);
    Ok(())
}

/// Reads a `--files-from` list (one path per line, or NUL-separated with `nul`) and makes each
/// entry relative to SRC. `src` is SRC as given, `src_canonical` after resolving symlinks: an
/// absolute entry may start with either.
pub fn read_list(
    list: &FileList,
    nul: bool,
    src: &Path,
    src_canonical: &Path,
    reporter: &Reporter,
) -> Result<Vec<String>> {
    let raw: Vec<Vec<u8>> = match list {
        FileList::Entries(e) => e.iter().map(|s| s.as_bytes().to_vec()).collect(),
        FileList::Path(p) => split_list(&std::fs::read(p).map_err(|e| Error::io("cannot read file list", p, e))?, nul),
        FileList::Stdin => {
            let mut buf = Vec::new();
            std::io::stdin()
                .lock()
                .read_to_end(&mut buf)
                .map_err(|e| Error::io("cannot read file list", "<stdin>", e))?;
            split_list(&buf, nul)
        }
    };
    let mut out = Vec::with_capacity(raw.len());
    for entry in raw {
        match normalize_entry(&entry, src, src_canonical) {
            Ok(Some(rel)) => out.push(rel),
            Ok(None) => {}
            Err(bad) => reporter.bad(bad)?,
        }
    }
    if let Some(first) = out.first() {
        relative_to_src(first, src, src_canonical)?;
    }
    Ok(out)
}

/// Refuses a list written relative to the working directory (`find raw | shardstream pack raw
/// --files-from -`), the one mistake a list makes wholesale: each entry would be reported missing
/// under SRC and the pack would end with nothing. The first entry tells it apart: not under SRC
/// as named, but a file inside SRC when read from the working directory.
fn relative_to_src(first: &str, src: &Path, src_canonical: &Path) -> Result<()> {
    if std::fs::symlink_metadata(src_canonical.join(first)).is_ok()
        || !std::fs::canonicalize(first).is_ok_and(|p| p.starts_with(src_canonical))
    {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "--files-from entries are relative to SRC ({}): the first, {first:?}, is not there but is a path from the \
         working directory; list the files from inside SRC (`cd SRC && find . -type f | shardstream pack . \
         --files-from - ...`, or `find SRC -type f -printf '%P\\n'`)",
        src.display()
    )))
}

fn split_list(bytes: &[u8], nul: bool) -> Vec<Vec<u8>> {
    let sep = if nul { 0 } else { b'\n' };
    bytes.split(|&b| b == sep).filter(|e| !e.is_empty()).map(<[u8]>::to_vec).collect()
}

/// One list entry as a path relative to SRC; `Ok(None)` for an entry naming SRC itself.
pub fn normalize_entry(entry: &[u8], src: &Path, src_canonical: &Path) -> Result<Option<String>, BadInput> {
    let Ok(text) = std::str::from_utf8(entry) else {
        return Err(BadInput::new(
            BadKind::NotUtf8,
            String::from_utf8_lossy(entry),
            "listed path is not valid UTF-8 (keys must be text)",
        ));
    };
    let path = Path::new(text);
    let rel = if path.is_absolute() {
        match path.strip_prefix(src).or_else(|_| path.strip_prefix(src_canonical)) {
            Ok(r) => r,
            Err(_) => {
                return Err(BadInput::new(
                    BadKind::OutsideSrc,
                    text,
                    format!("absolute path is not inside SRC ({})", src.display()),
                ));
            }
        }
    } else {
        path
    };
    let mut parts = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(p) => parts.push(p.to_str().unwrap_or_default()),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(BadInput::new(
                    BadKind::OutsideSrc,
                    text,
                    "'..' components are not allowed in --files-from",
                ));
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(BadInput::new(BadKind::OutsideSrc, text, "not a path inside SRC"));
            }
        }
    }
    Ok((!parts.is_empty()).then(|| parts.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"x").unwrap();
    }

    #[test]
    fn walks_files_skips_hidden_and_output() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        for p in ["a/1.jpg", "a/1.json", "b/c/2.jpg", ".git/config", "a/.DS_Store", "top.txt", "out/shard-000000.tar"] {
            touch(&root.join(p));
        }
        std::os::unix::fs::symlink(root.join("a/1.jpg"), root.join("link.jpg")).unwrap();
        let reporter = Reporter::new(false, &());
        for threads in [1, 4] {
            let mut got = walk(&root, Some(&root.join("out")), threads, &reporter).unwrap();
            got.sort();
            assert_eq!(got, ["a/1.jpg", "a/1.json", "b/c/2.jpg", "link.jpg", "top.txt"]);
        }
        assert_eq!(reporter.ignored_count(), 4);
        assert!(walk(&root.join("nope"), None, 2, &reporter).is_err());
        assert!(walk(&root.join("top.txt"), None, 2, &reporter).is_err());
    }

    #[test]
    fn reports_fifos_and_non_utf8_names() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        touch(&root.join("ok.jpg"));
        std::fs::write(root.join(OsStr::from_bytes(b"bad\xff.jpg")), b"x").unwrap();
        let fifo = std::ffi::CString::new(root.join("pipe.jpg").as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let reporter = Reporter::new(false, &());
        assert_eq!(walk(&root, None, 2, &reporter).unwrap(), ["ok.jpg"]);
        let counts = reporter.counts();
        assert_eq!(counts.get(&BadKind::NotUtf8), Some(&1));
        assert_eq!(counts.get(&BadKind::NotAFile), Some(&1));
        let strict = Reporter::new(true, &());
        assert!(walk(&root, None, 2, &strict).is_err());
    }

    #[test]
    fn leaves_out_datasets_inside_src_and_reports_symlinked_directories() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        // An earlier pack's output (or any indexed dataset) inside SRC: its shards, manifest and
        // sidecars are not samples of this pack.
        for p in ["cat/1.jpg", "wds/shard-000000.tar", "wds/manifest.json", "wds/_shardstream/pack-journal.jsonl"] {
            touch(&root.join(p));
        }
        std::fs::create_dir_all(root.join("elsewhere/dog")).unwrap();
        touch(&root.join("elsewhere/dog/2.jpg"));
        std::os::unix::fs::symlink(root.join("elsewhere/dog"), root.join("dog")).unwrap();
        std::os::unix::fs::symlink(root.join("nothing"), root.join("dangling.jpg")).unwrap();
        let reporter = Reporter::new(false, &());
        let mut got = walk(&root, None, 2, &reporter).unwrap();
        got.sort();
        // A dangling symlink is listed: opening it reports it (vanished), as for any file.
        assert_eq!(got, ["cat/1.jpg", "dangling.jpg", "elsewhere/dog/2.jpg"]);
        let counts = reporter.counts();
        assert_eq!(counts.get(&BadKind::NotAFile), Some(&1), "{counts:?}"); // dog -> a directory
        assert_eq!(counts.get(&BadKind::Dataset), Some(&1), "{counts:?}"); // wds
        assert!(walk(&root, None, 2, &Reporter::new(true, &())).is_err());
        // SRC that is itself a dataset is refused outright.
        let err = walk(&root.join("wds"), None, 2, &Reporter::new(false, &())).unwrap_err().to_string();
        assert!(err.contains("_shardstream"), "{err}");
    }

    #[test]
    fn normalizes_list_entries() {
        let src = Path::new("/data/src");
        let canon = Path::new("/mnt/real/src");
        let n = |e: &str| normalize_entry(e.as_bytes(), src, canon);
        assert_eq!(n("a/b.jpg").unwrap().unwrap(), "a/b.jpg");
        assert_eq!(n("./a//./b.jpg").unwrap().unwrap(), "a/b.jpg");
        assert_eq!(n("/data/src/a/b.jpg").unwrap().unwrap(), "a/b.jpg");
        assert_eq!(n("/mnt/real/src/c.jpg").unwrap().unwrap(), "c.jpg");
        assert_eq!(n(".").unwrap(), None);
        assert_eq!(n("a/../b.jpg").unwrap_err().kind, BadKind::OutsideSrc);
        assert_eq!(n("/etc/passwd").unwrap_err().kind, BadKind::OutsideSrc);
        assert_eq!(normalize_entry(b"x\xff.jpg", src, canon).unwrap_err().kind, BadKind::NotUtf8);
        assert_eq!(split_list(b"a\n\nb\n", false), [b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(split_list(b"a\nb\0c\0", true), [b"a\nb".to_vec(), b"c".to_vec()]);
    }
}
