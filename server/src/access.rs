//! Which datasets a connected process may open: the `allow` list of the config file, checked
//! against the peer's credentials (SO_PEERCRED of its Unix connection) for every request that
//! names a dataset (open, stream, prefetch).
//!
//! Without an `allow` list every dataset is allowed (the socket's mode and group already decide
//! who may connect). With one, a request is allowed when some rule matches the peer (its `uid`
//! and `gid`, each when given; the gid is the peer's primary group as the kernel reports it) and
//! every shard location the URL names lies under one of that rule's `roots`.
//!
//! A TCP peer has no uid or gid: it is known by the name of the bearer token it presented (the
//! token file's `NAME:TOKEN`, see [`crate::remote`]) or, on a listener without tokens, by the
//! subject CN of its client certificate (mutual TLS), which a rule's `client` key matches. A rule
//! with `client` applies to that remote client only; a rule with `uid`/`gid` to Unix peers only;
//! a rule with none of the three to every peer, local or remote (authenticated).
//!
//! Matching is careful about prefixes: paths are absolute, normalised (`.`, `..`, repeated `/`)
//! and, where they exist, resolved through symlinks, then compared component by component
//! (`/data/train` does not admit `/data/training`); brace patterns are expanded and every
//! expansion checked; S3 keys are compared segment by segment and may not contain `.`/`..`
//! segments at all.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::storage::{DatasetUrl, Pick};
use crate::{Error, Result};

/// One entry of the config file's `allow` list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    /// The peer's user id; any when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The peer's (primary) group id; any when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// A remote (TCP) client's name: the name of its bearer token; any when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// Absolute directory prefixes and `s3://bucket/prefix` prefixes this peer may read.
    pub roots: Vec<String>,
}

/// The peer of a request: uid and gid when it came over a Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
}

/// Who sent a request: a local process (its credentials) or a remote client (its token's name,
/// `None` when it was not asked for one: mutual TLS, or `--insecure` without a token file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requester {
    Local(Peer),
    Remote { client: Option<String> },
}

impl std::fmt::Display for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Requester::Local(p) => write!(f, "uid {} gid {}", p.uid, p.gid),
            Requester::Remote { client: Some(c) } => write!(f, "remote client {c:?}"),
            Requester::Remote { client: None } => write!(f, "an anonymous remote client (TCP)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Root {
    Dir(PathBuf),
    S3 { bucket: String, segments: Vec<String> },
}

#[derive(Debug, Clone)]
struct Rule {
    uid: Option<u32>,
    gid: Option<u32>,
    client: Option<String>,
    roots: Vec<Root>,
}

/// The compiled `allow` list.
#[derive(Debug, Clone)]
pub struct AllowList {
    rules: Vec<Rule>,
}

impl AllowList {
    /// Checks and compiles the rules; an error names the bad entry.
    pub fn new(rules: &[AllowRule]) -> Result<Self> {
        let mut out = Vec::with_capacity(rules.len());
        for (i, r) in rules.iter().enumerate() {
            if r.roots.is_empty() {
                return Err(Error::invalid(format!("allow[{i}]: `roots` is empty (the rule would allow nothing)")));
            }
            if r.client.is_some() && (r.uid.is_some() || r.gid.is_some()) {
                return Err(Error::invalid(format!(
                    "allow[{i}]: `client` names a remote (TCP) client and `uid`/`gid` a local one: not both in one rule"
                )));
            }
            let roots = r
                .roots
                .iter()
                .map(|s| parse_root(s).map_err(|e| Error::invalid(format!("allow[{i}].roots: {s:?}: {e}"))))
                .collect::<Result<_>>()?;
            out.push(Rule { uid: r.uid, gid: r.gid, client: r.client.clone(), roots });
        }
        Ok(Self { rules: out })
    }

    /// Ok when `peer` (`None`: an anonymous TCP peer) may read `url`; otherwise
    /// `PermissionDenied` naming the URL.
    pub fn check(&self, peer: Option<Peer>, url: &str) -> Result<()> {
        let who = match peer {
            Some(p) => Requester::Local(p),
            None => Requester::Remote { client: None },
        };
        self.check_requester(&who, url)
    }

    /// Ok when `who` may read `url`; otherwise `PermissionDenied` naming the URL.
    pub fn check_requester(&self, who: &Requester, url: &str) -> Result<()> {
        let denied = |why: String| Error::PermissionDenied { path: url.to_owned(), reason: why };
        let locations = locations(url).map_err(|e| denied(format!("cannot check it against the allow list: {e}")))?;
        for rule in self.rules.iter().filter(|r| matches_peer(r, who)) {
            if locations.iter().all(|loc| rule.roots.iter().any(|root| under(loc, root))) {
                return Ok(());
            }
        }
        Err(denied(format!("not under any root the daemon's allow list gives to {who}")))
    }
}

impl AllowList {
    /// Ok when every local shard of `url` (by the location it really has: the daemon resolves
    /// each when it confines opens, [`crate::storage::confine`]) lies under a root of some rule
    /// for `who`; otherwise `PermissionDenied` naming the URL and the first shard outside. Pure
    /// comparisons, no file system access: it runs on every open, reused datasets included.
    pub fn check_shards(&self, who: &Requester, url: &str, shards: &[crate::index::ShardMeta]) -> Result<()> {
        let rules: Vec<&Rule> = self.rules.iter().filter(|r| matches_peer(r, who)).collect();
        for shard in shards {
            let crate::storage::ShardSource::Local(real) = &shard.source else { continue };
            let inside = |root: &Root| matches!(root, Root::Dir(r) if real.starts_with(r));
            if !rules.iter().any(|rule| rule.roots.iter().any(inside)) {
                return Err(Error::PermissionDenied {
                    path: url.to_owned(),
                    reason: format!(
                        "its shard {} lies at {}, not under any root the daemon's allow list gives to {who} \
                         (a symbolic link leads out of the roots)",
                        shard.name,
                        real.display()
                    ),
                });
            }
        }
        Ok(())
    }
}

fn matches_peer(rule: &Rule, who: &Requester) -> bool {
    match who {
        Requester::Local(p) => {
            rule.client.is_none() && rule.uid.is_none_or(|u| u == p.uid) && rule.gid.is_none_or(|g| g == p.gid)
        }
        Requester::Remote { client } => {
            rule.uid.is_none() && rule.gid.is_none() && rule.client.as_ref().is_none_or(|c| Some(c) == client.as_ref())
        }
    }
}

fn under(loc: &Root, root: &Root) -> bool {
    match (loc, root) {
        (Root::Dir(p), Root::Dir(r)) => p.starts_with(r),
        (Root::S3 { bucket: b, segments: s }, Root::S3 { bucket: rb, segments: rs }) => {
            b == rb && s.len() >= rs.len() && s[..rs.len()] == rs[..]
        }
        _ => false,
    }
}

fn parse_root(s: &str) -> std::result::Result<Root, String> {
    if let Some(rest) = s.strip_prefix("s3://") {
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err("no bucket".into());
        }
        return Ok(Root::S3 { bucket: bucket.to_owned(), segments: s3_segments(key)? });
    }
    let path = s.strip_prefix("file://").unwrap_or(s);
    if s.contains("://") && !s.starts_with("file://") {
        return Err("only absolute paths, file:// and s3:// roots are supported".into());
    }
    Ok(Root::Dir(resolve(Path::new(path))?))
}

/// Key segments of an S3 prefix; `.`/`..` segments and empty ones (`//`, or a key starting with
/// `/`) are refused: S3 takes them literally, so `datasets//imagenet/` is another prefix than
/// `datasets/imagenet/`, and a reader of this list would not tell them apart. One trailing `/`
/// (a prefix) is fine.
fn s3_segments(key: &str) -> std::result::Result<Vec<String>, String> {
    let mut out = Vec::new();
    if key.is_empty() {
        return Ok(out);
    }
    for seg in key.strip_suffix('/').unwrap_or(key).split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return Err(format!("the key {key:?} contains an empty, '.' or '..' segment ({seg:?})"));
        }
        out.push(seg.to_owned());
    }
    Ok(out)
}

/// An absolute path as the kernel walks it: each existing component's symlinks are followed
/// before the `..` after it is taken (`root/link/..` is the parent of the link's target, not
/// `root`), so a link inside a root that points outside it does not pass, however it is reached.
/// Components past the last existing one are taken lexically: nothing can link through them yet.
fn resolve(path: &Path) -> std::result::Result<PathBuf, String> {
    if !path.is_absolute() {
        return Err(format!("{} is not an absolute path", path.display()));
    }
    let mut real = PathBuf::from("/");
    // `real` exists and has no symlink in it.
    let mut exists = true;
    let canonical = |p: &Path| match std::fs::canonicalize(p) {
        Ok(r) => Ok(Some(r)),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => Ok(None),
        Err(e) => Err(format!("cannot resolve {}: {e}", p.display())),
    };
    for c in path.components() {
        match c {
            Component::Normal(n) => {
                real.push(n);
                if exists {
                    match canonical(&real)? {
                        Some(r) => real = r,
                        // A link to nothing yet: where it leads once its target appears is unknown.
                        None if real.symlink_metadata().is_ok_and(|m| m.is_symlink()) => {
                            return Err(format!("{} is a symbolic link to a path that does not exist", real.display()));
                        }
                        None => exists = false,
                    }
                }
            }
            Component::ParentDir => {
                real.pop();
                // Back over the missing part: what remains may exist (and hold links) again.
                if !exists && let Some(r) = canonical(&real)? {
                    real = r;
                    exists = true;
                }
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(real)
}

/// Where the entry `name` of the resolved directory `dir` leads: itself, or, for a symbolic link,
/// its target resolved ([`resolve`]).
fn name_in(dir: &Path, name: &str) -> std::result::Result<PathBuf, String> {
    let path = dir.join(name);
    // `.`, `..` or a path: walked whole, as the kernel would.
    if matches!(name, "" | "." | "..") || name.contains('/') {
        return resolve(&path);
    }
    match path.symlink_metadata() {
        Ok(m) if m.is_symlink() => resolve(&path),
        _ => Ok(path),
    }
}

/// Every shard location (or the dataset directory / prefix) a URL names.
fn locations(url: &str) -> Result<Vec<Root>> {
    match DatasetUrl::parse(url)? {
        DatasetUrl::Local { dir, pick } => {
            let real = resolve(&dir).map_err(Error::InvalidArgument)?;
            match pick {
                Pick::All | Pick::Every | Pick::Glob(_) => Ok(vec![Root::Dir(real)]),
                // A name holds no `/`: its directory is resolved once, and only a name that is a
                // link is resolved on its own (a million names are a million `lstat`s, not a
                // million walks of the whole path).
                Pick::Names(names) => {
                    names.iter().map(|n| name_in(&real, n).map(Root::Dir).map_err(Error::InvalidArgument)).collect()
                }
            }
        }
        DatasetUrl::S3 { bucket, prefix, pick } => {
            let keys = match pick {
                Pick::All | Pick::Every | Pick::Glob(_) => vec![prefix],
                Pick::Names(names) => names.iter().map(|n| format!("{prefix}{n}")).collect(),
            };
            keys.iter()
                .map(|k| {
                    s3_segments(k)
                        .map(|segments| Root::S3 { bucket: bucket.clone(), segments })
                        .map_err(Error::InvalidArgument)
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(rules: &[(Option<u32>, Option<u32>, &[&str])]) -> AllowList {
        let rules: Vec<_> = rules
            .iter()
            .map(|(uid, gid, roots)| AllowRule {
                uid: *uid,
                gid: *gid,
                client: None,
                roots: roots.iter().map(|s| s.to_string()).collect(),
            })
            .collect();
        AllowList::new(&rules).unwrap()
    }

    const ALICE: Option<Peer> = Some(Peer { uid: 1000, gid: 1000 });
    const BOB: Option<Peer> = Some(Peer { uid: 1001, gid: 100 });

    #[test]
    fn paths_match_by_component_and_cannot_escape() {
        let l = list(&[(None, None, &["/nonexistent-root/data/train", "s3://bucket/datasets/imagenet"])]);
        for ok in [
            "/nonexistent-root/data/train",
            "/nonexistent-root/data/train/",
            "/nonexistent-root/data/train/a/train-{000..009}.tar",
            "file:///nonexistent-root/data/train/x",
            "/nonexistent-root/data/./train//x",
            "s3://bucket/datasets/imagenet/",
            "s3://bucket/datasets/imagenet/train-{0..3}.tar",
        ] {
            l.check(ALICE, ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "/nonexistent-root/data/training",
            "/nonexistent-root/data/train/../secret",
            "/nonexistent-root/data/train/{a,../../secret}",
            "/nonexistent-root/data",
            "relative/train",
            "s3://bucket/datasets/imagenet-private/",
            "s3://bucket/datasets/imagenet/../other/",
            "s3://other-bucket/datasets/imagenet/",
            "s3://bucket/datasets/",
            // S3 takes `//` literally: these are other keys than the root's.
            "s3://bucket//datasets/imagenet/",
            "s3://bucket/datasets//imagenet/",
        ] {
            let e = l.check(ALICE, bad).unwrap_err();
            assert!(matches!(&e, Error::PermissionDenied { path, .. } if path == bad), "{bad}: {e:?}");
        }
    }

    #[test]
    fn rules_apply_per_peer() {
        let l = list(&[(Some(1000), None, &["/a"]), (None, Some(100), &["/b"])]);
        assert!(l.check(ALICE, "/a/x").is_ok());
        assert!(l.check(ALICE, "/b/x").is_err());
        assert!(l.check(BOB, "/b/x").is_ok());
        assert!(l.check(BOB, "/a/x").is_err());
        assert!(l.check(None, "/a/x").is_err(), "TCP peers match only rules without uid/gid");
    }

    #[test]
    fn symlink_out_of_a_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let l = list(&[(None, None, &[root.to_str().unwrap()])]);
        assert!(l.check(ALICE, root.to_str().unwrap()).is_ok());
        assert!(l.check(ALICE, root.join("link").to_str().unwrap()).is_err());
    }

    #[test]
    fn parent_of_a_symlink_is_the_target_s_parent() {
        // The kernel follows `link` before `..`: root/link/../secret is outside/secret.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        for d in [root.join("sub"), outside.join("inner"), outside.join("secret")] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::os::unix::fs::symlink(outside.join("inner"), root.join("link")).unwrap();
        std::os::unix::fs::symlink(root.join("sub"), root.join("inside")).unwrap();
        let l = list(&[(None, None, &[root.to_str().unwrap()])]);
        let at = |rel: &str| format!("{}/{rel}", root.display());
        assert!(l.check(ALICE, &at("link/../secret")).is_err());
        assert!(l.check(ALICE, &at("link/../../outside/secret")).is_err());
        // Links that stay inside, and `..` over real directories, are still allowed.
        assert!(l.check(ALICE, &at("inside/../sub")).is_ok());
        assert!(l.check(ALICE, &at("sub/../sub/new")).is_ok());
        // A link to nothing may lead anywhere once its target is made.
        std::os::unix::fs::symlink(outside.join("later"), root.join("dangling")).unwrap();
        assert!(l.check(ALICE, &at("dangling")).is_err());
    }

    #[test]
    fn a_patterns_names_are_checked_where_they_lead() {
        let root = tempfile::tempdir().expect("temp dir");
        let (ds, out) = (root.path().join("r/ds"), root.path().join("out"));
        std::fs::create_dir_all(&ds).expect("dataset dir");
        std::fs::create_dir_all(&out).expect("outside dir");
        std::fs::write(out.join("s.tar"), b"x").expect("outside file");
        std::os::unix::fs::symlink(out.join("s.tar"), ds.join("b.tar")).expect("link out");
        let allowed = root.path().join("r");
        let l = AllowList::new(&[AllowRule {
            uid: None,
            gid: None,
            client: None,
            roots: vec![allowed.display().to_string()],
        }])
        .expect("rules");
        let who = Requester::Local(Peer { uid: 1, gid: 1 });
        let at = |p: &str| format!("{}/{p}", ds.display());
        l.check_requester(&who, &at("{a,c}.tar")).expect("plain names inside");
        assert!(l.check_requester(&who, &at("{a,b}.tar")).is_err(), "a name linked out of the root");
        // A name `..` is the root's parent, however the pattern is parsed.
        assert!(l.check_requester(&who, &format!("{}/{{..,a}}", allowed.display())).is_err());
    }

    #[test]
    fn bad_rules_are_named() {
        let e = AllowList::new(&[AllowRule { uid: None, gid: None, client: None, roots: vec!["data".into()] }])
            .unwrap_err();
        assert!(e.to_string().contains("allow[0].roots"), "{e}");
        let e = AllowList::new(&[AllowRule { uid: None, gid: None, client: None, roots: vec![] }]).unwrap_err();
        assert!(e.to_string().contains("allow[0]"), "{e}");
    }

    fn remote(name: &str) -> Requester {
        Requester::Remote { client: Some(name.to_owned()) }
    }

    /// Remote clients are matched by their token's name; they never match uid/gid rules, and a
    /// local process never matches a `client` rule.
    #[test]
    fn remote_clients_match_by_name() {
        let rule = |uid: Option<u32>, client: Option<&str>, root: &str| AllowRule {
            uid,
            gid: None,
            client: client.map(str::to_owned),
            roots: vec![root.to_owned()],
        };
        let l = AllowList::new(&[
            rule(None, Some("trainer-a"), "/nonexistent-root/a"),
            rule(None, Some("trainer-b"), "s3://bucket/b"),
            rule(Some(1000), None, "/nonexistent-root/local"),
        ])
        .unwrap();
        assert!(l.check_requester(&remote("trainer-a"), "/nonexistent-root/a/train-{0..3}.tar").is_ok());
        assert!(l.check_requester(&remote("trainer-b"), "s3://bucket/b/x/").is_ok());
        for (who, url) in [
            (remote("trainer-a"), "s3://bucket/b/x/"),
            (remote("trainer-b"), "/nonexistent-root/a"),
            (remote("trainer-a"), "/nonexistent-root/a/{x,../../local}"),
            (remote("trainer-a"), "/nonexistent-root/a/{..,x}"),
            (remote("trainer-a"), "/nonexistent-root/local"),
            (remote("trainer-c"), "/nonexistent-root/a"),
            (Requester::Remote { client: None }, "/nonexistent-root/a"),
            (Requester::Local(Peer { uid: 1000, gid: 1 }), "/nonexistent-root/a"),
        ] {
            let e = l.check_requester(&who, url).unwrap_err();
            assert!(matches!(&e, Error::PermissionDenied { path, .. } if path == url), "{who} {url}: {e:?}");
        }
        assert!(l.check(Some(Peer { uid: 1000, gid: 1 }), "/nonexistent-root/local/x").is_ok());
        let both = AllowList::new(&[AllowRule {
            uid: Some(1),
            gid: None,
            client: Some("x".into()),
            roots: vec!["/a".into()],
        }]);
        assert!(both.unwrap_err().to_string().contains("not both"));
    }
}
