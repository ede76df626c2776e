//! Grouping files into samples: the catalog of what will be packed, built from names alone.
//!
//! The WebDataset rule: a file's key is its path relative to SRC up to the first dot of its file
//! name, its field the rest (`n01/x.seg.png` -> key `n01/x`, field `seg.png`). With `--key-regex`
//! the key is the regex's `key` group (or its first group) and the field its `field` group (or
//! second group, or else whatever follows the match, without a leading dot). Either way a
//! member is stored as `key.field`, so a key must read back as itself: no dot in its last
//! component, no empty or `..` components, no `__metadata__` first component. Fields are
//! lower-cased, as WebDataset readers do, so `x.JPG` and `x.jpg` are the same field (a duplicate).
//!
//! Files are sorted by (key, field), byte-wise, so the members of a sample are adjacent and the
//! default order is the same on every machine and locale. Two files with the same key and field
//! are a bad input (the later one in path order is dropped). With `--label-from-dir` each sample
//! gets a `cls` field: the index of its class directory (the one directly under SRC, however deep
//! the sample lies beneath it) among all class names, sorted, as torchvision's `ImageFolder`
//! classes and numbers them.
//!
//! Memory: every path is kept once, in one string arena, with 40 bytes of bookkeeping per file.
//! That is the pack's only per-file memory (ImageNet's 1.28 M files: about 100 MB).

use std::collections::{BTreeSet, HashSet};

use regex::Regex;

use super::report::{BadInput, BadKind, Reporter};
use crate::format::tar::split_key;
use crate::plan::Rng;
use crate::plan::shuffle::derive_seed;
use crate::{Error, Result};

/// The field `--label-from-dir` writes.
pub const LABEL_FIELD: &str = "cls";

/// Domain of the pack's shuffle ("packshuf" in ASCII), so that it is not correlated with the
/// epoch plan's shuffles of the same seed.
const SHUFFLE_DOMAIN: u64 = u64::from_be_bytes(*b"packshuf");

#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    len: u32,
}

#[derive(Debug, Clone, Copy)]
struct FileRec {
    path: Span,
    /// `key.field`, the member name.
    name: Span,
    key_len: u32,
}

#[derive(Debug, Clone, Copy)]
struct SampleRec {
    first: usize,
    count: u32,
    class: Option<u32>,
}

/// Every sample to pack, in key order.
#[derive(Debug, Default)]
pub struct Catalog {
    arena: String,
    files: Vec<FileRec>,
    samples: Vec<SampleRec>,
    /// Sorted, distinct field names of all samples (`cls` included when labelling).
    pub fields: Vec<String>,
    /// Sorted class names (`--label-from-dir`); a sample's class is an index into it.
    pub classes: Vec<String>,
}

/// One member of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberRef<'a> {
    /// Path relative to SRC.
    pub path: &'a str,
    /// Member name in the shard: `key.field`.
    pub name: &'a str,
    pub field: &'a str,
}

/// One sample of the catalog.
#[derive(Debug, Clone, Copy)]
pub struct SampleRef<'a> {
    cat: &'a Catalog,
    rec: SampleRec,
}

impl<'a> SampleRef<'a> {
    pub fn key(&self) -> &'a str {
        let f = self.cat.files[self.rec.first];
        &self.cat.str(f.name)[..f.key_len as usize]
    }

    /// Members in field order.
    pub fn members(&self) -> impl ExactSizeIterator<Item = MemberRef<'a>> + 'a {
        let cat = self.cat;
        cat.files[self.rec.first..self.rec.first + self.rec.count as usize].iter().map(move |f| {
            let name = cat.str(f.name);
            MemberRef { path: cat.str(f.path), name, field: &name[f.key_len as usize + 1..] }
        })
    }

    /// Class index (`--label-from-dir`).
    pub fn class(&self) -> Option<u32> {
        self.rec.class
    }
}

/// How keys and labels are derived.
#[derive(Debug, Default, Clone, Copy)]
pub struct GroupOptions<'a> {
    pub key_regex: Option<&'a Regex>,
    pub label_from_dir: bool,
}

/// Compiles `--key-regex`, which must have a group for the key.
pub fn compile_key_regex(re: &str) -> Result<Regex> {
    let r = Regex::new(re).map_err(|e| Error::invalid(format!("--key-regex {re:?} is not a valid regex: {e}")))?;
    if r.captures_len() < 2 {
        return Err(Error::invalid(format!(
            "--key-regex {re:?} has no capture group: mark the key with (?P<key>...) (and optionally the field \
             with (?P<field>...))"
        )));
    }
    Ok(r)
}

/// (key, field) of a path by `--key-regex`; None when it does not match.
fn regex_key<'p>(re: &Regex, path: &'p str) -> Option<(&'p str, &'p str)> {
    let caps = re.captures(path)?;
    let key = caps.name("key").or_else(|| caps.get(1))?;
    // The field: the `field` group; else, for a regex without names, its second group; else
    // what follows the match.
    let named = re.capture_names().flatten().next().is_some();
    let field = caps.name("field").or_else(|| if named { None } else { caps.get(2) });
    let field = match field {
        Some(f) => f.as_str(),
        None => {
            let rest = &path[caps.get(0)?.end()..];
            rest.strip_prefix('.').unwrap_or(rest)
        }
    };
    Some((key.as_str(), field))
}

/// Why a (key, field) pair cannot be stored as the member `key.field` and read back the same.
fn key_problem(key: &str, field: &str) -> Option<&'static str> {
    if key.is_empty() {
        return Some("empty key");
    }
    if key.starts_with('/') || key.split('/').any(|c| c.is_empty() || c == "..") {
        return Some("key has an empty, absolute or '..' component");
    }
    let first = key.split('/').next().unwrap_or(key);
    if first.len() >= 4 && first.starts_with("__") && first.ends_with("__") {
        return Some("a first component __like_this__ is reserved for WebDataset metadata");
    }
    // Before the dot: a key regex whose key took the whole name (`^(.*)$`) leaves no field, and
    // its key's dot is only the symptom.
    if field.is_empty() {
        return Some(
            "empty field (the field is the (?P<field>...) group, else what follows the key's match, after a dot)",
        );
    }
    let last = key.rsplit('/').next().unwrap_or(key);
    if last.contains('.') {
        return Some("the key's last component contains a dot (it would read back as a shorter key)");
    }
    if field.contains('/') || field.contains('\0') || key.contains('\0') {
        return Some("field contains '/' or NUL");
    }
    if field.len() >= 4 && field.starts_with("__") && field.ends_with("__") {
        return Some("a field __like_this__ is reserved for WebDataset metadata (__key__, __url__)");
    }
    None
}

impl Catalog {
    fn str(&self, s: Span) -> &str {
        &self.arena[s.start..s.start + s.len as usize]
    }

    fn push(&mut self, s: &str) -> Result<Span> {
        let len =
            u32::try_from(s.len()).map_err(|_| Error::invalid(format!("path of {} bytes is too long", s.len())))?;
        let start = self.arena.len();
        self.arena.push_str(s);
        Ok(Span { start, len })
    }

    /// Groups relative paths into samples.
    pub fn build(mut paths: Vec<String>, opts: GroupOptions<'_>, reporter: &Reporter) -> Result<Self> {
        // The keys of samples with a file found bad before grouping (not a regular file, a name
        // not UTF-8, read lossily here) or here (a field that cannot be stored): left out whole,
        // as read errors leave theirs (report.rs), never packed without that field.
        let key_of = |path: &'_ str| match opts.key_regex {
            None => split_key(path).map(|(k, _)| k.to_owned()),
            Some(re) => regex_key(re, path).map(|(k, _)| k.to_owned()),
        };
        let mut bad_keys: HashSet<String> = reporter.bad_paths().iter().filter_map(|p| key_of(p)).collect();
        let mut cat = Catalog::default();
        cat.arena.reserve(paths.iter().map(String::len).sum());
        cat.files.reserve(paths.len());
        // Path order first, so that "the later one" of two duplicates is well defined.
        paths.sort_unstable();
        for path in &paths {
            let pair = match opts.key_regex {
                None => split_key(path),
                Some(re) => regex_key(re, path),
            };
            let Some((key, field)) = pair else {
                let name = path.rsplit('/').next().unwrap_or(path);
                let why = match opts.key_regex {
                    Some(_) => "does not match --key-regex",
                    None if name.starts_with('.') => "hidden",
                    None if !name.contains('.') || name.ends_with('.') => "no field extension",
                    None => "WebDataset metadata name",
                };
                reporter.ignored(path, why);
                continue;
            };
            if let Some(problem) = key_problem(key, field) {
                reporter.bad(BadInput::new(
                    BadKind::BadKey,
                    path.as_str(),
                    format!("key {key:?}, field {field:?}: {problem}"),
                ))?;
                // A `__key__`-like metadata name is no field the sample's readers expect: the
                // sample goes without it, as before. Any other field would be missing.
                if !(field.starts_with("__") && field.ends_with("__")) {
                    bad_keys.insert(key.to_owned());
                }
                continue;
            }
            // Fields are lower-cased, as every WebDataset reader does (`x.JPG` is field `jpg`).
            let lower = field.to_lowercase();
            let path_span = cat.push(path)?;
            let key_len = key.len() as u32;
            let name_span = if opts.key_regex.is_none() && lower == field {
                path_span // the member name is the path itself
            } else {
                cat.push(&format!("{key}.{lower}"))?
            };
            cat.files.push(FileRec { path: path_span, name: name_span, key_len });
        }
        drop(paths);

        // (key, field) order; ties (duplicates) keep path order, as the sort is stable.
        let mut files = std::mem::take(&mut cat.files);
        files.sort_by(|a, b| {
            let (na, nb) = (cat.str(a.name), cat.str(b.name));
            let (ka, kb) = (&na[..a.key_len as usize], &nb[..b.key_len as usize]);
            ka.cmp(kb).then_with(|| na[a.key_len as usize..].cmp(&nb[b.key_len as usize..]))
        });
        let mut kept: Vec<FileRec> = Vec::with_capacity(files.len());
        for f in files {
            if let Some(prev) = kept.last()
                && cat.str(prev.name) == cat.str(f.name)
            {
                let detail = format!("same key and field as {}; this one is skipped", cat.str(prev.path));
                reporter.bad(BadInput::new(BadKind::DuplicateKey, cat.str(f.path), detail))?;
                continue;
            }
            if opts.label_from_dir && &cat.str(f.name)[f.key_len as usize + 1..] == LABEL_FIELD {
                reporter.bad(BadInput::new(
                    BadKind::DuplicateKey,
                    cat.str(f.path),
                    "--label-from-dir writes the cls field; this file would be a second one and is skipped",
                ))?;
                continue;
            }
            kept.push(f);
        }
        cat.files = kept;

        let mut fields = BTreeSet::new();
        let mut i = 0;
        while i < cat.files.len() {
            let f = cat.files[i];
            let key = &cat.str(f.name)[..f.key_len as usize];
            let mut j = i + 1;
            while j < cat.files.len() && &cat.str(cat.files[j].name)[..cat.files[j].key_len as usize] == key {
                j += 1;
            }
            if bad_keys.contains(key) {
                reporter.left_out(key, (j - i) as u64);
                i = j;
                continue;
            }
            for g in &cat.files[i..j] {
                let field = &cat.str(g.name)[g.key_len as usize + 1..];
                if !fields.contains(field) {
                    fields.insert(field.to_owned());
                }
            }
            let count =
                u32::try_from(j - i).map_err(|_| Error::invalid(format!("sample {key:?} has too many files")))?;
            cat.samples.push(SampleRec { first: i, count, class: None });
            i = j;
        }

        if opts.label_from_dir {
            cat.assign_classes(reporter)?;
            fields.insert(LABEL_FIELD.to_owned());
        }
        cat.fields = fields.into_iter().collect();
        Ok(cat)
    }

    /// The directory directly under SRC that holds the sample's first file, however deep: the
    /// class `ImageFolder` gives it (`dog/2021/x.jpg` is a `dog`). Its parent directory would
    /// make `cat/2020` and `dog/2020` one class.
    fn class_name(&self, s: &SampleRec) -> Option<&str> {
        let path = self.str(self.files[s.first].path);
        path.split_once('/').map(|(top, _)| top)
    }

    fn assign_classes(&mut self, reporter: &Reporter) -> Result<()> {
        let mut kept = Vec::with_capacity(self.samples.len());
        let mut class_of = Vec::with_capacity(self.samples.len());
        for s in &self.samples {
            match self.class_name(s) {
                Some(c) => {
                    kept.push(*s);
                    class_of.push(c.to_owned());
                }
                None => reporter.bad(BadInput::new(
                    BadKind::BadKey,
                    self.str(self.files[s.first].path),
                    "--label-from-dir needs every sample inside a class directory; this one is at the top of SRC",
                ))?,
            }
        }
        let mut names = class_of.clone();
        names.sort_unstable();
        names.dedup();
        for (s, c) in kept.iter_mut().zip(&class_of) {
            s.class = names.binary_search(c).ok().map(|i| i as u32);
        }
        self.classes = names;
        self.samples = kept;
        Ok(())
    }

    pub fn num_samples(&self) -> usize {
        self.samples.len()
    }

    pub fn num_files(&self) -> usize {
        self.samples.iter().map(|s| s.count as usize).sum()
    }

    pub fn sample(&self, i: usize) -> Option<SampleRef<'_>> {
        Some(SampleRef { cat: self, rec: *self.samples.get(i)? })
    }

    /// The packing order: key order, or a seeded permutation of it with `shuffle`.
    pub fn order(&self, shuffle: bool, seed: u64) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.samples.len() as u32).collect();
        if shuffle {
            Rng::new(derive_seed(SHUFFLE_DOMAIN, &[seed])).shuffle(&mut order);
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn metadata_names_as_fields_are_refused() {
        // A member x.__key__ would be read back as the sample's key by webdataset (which then
        // finds the key twice), by shardstream's loader (the batch's "__key__" replaced by its
        // bytes) and in a Parquet shard (two columns named __key__).
        let r = Reporter::new(false, &());
        let cat =
            Catalog::build(paths(&["a/x.jpg", "a/x.__key__", "a/y.jpg", "a/y.__URL__"]), GroupOptions::default(), &r)
                .unwrap();
        assert_eq!(r.counts().get(&BadKind::BadKey), Some(&2));
        assert!(cat.fields.iter().all(|f| !f.starts_with("__")), "{:?}", cat.fields);
        assert_eq!(cat.num_samples(), 2, "metadata names are skipped, their samples packed");
        assert_eq!(key_problem("a/x", "__key__"), key_problem("a/x", "__url__"));
        assert!(key_problem("a/x", "__key__").is_some());
        assert!(key_problem("a/x", "_x_").is_none());
    }

    #[test]
    fn a_sample_with_a_file_found_bad_before_grouping_is_left_out_whole() {
        let r = Reporter::new(false, &());
        // Reported by the walk: a FIFO and a name not UTF-8 (read lossily) beside readable files.
        r.bad(BadInput::new(BadKind::NotAFile, "c/s1.txt", "not a regular file (FIFO, socket or device)")).unwrap();
        r.bad(BadInput::new(BadKind::NotUtf8, "c/s3.\u{fffd}", "file name is not valid UTF-8")).unwrap();
        let all = paths(&["c/s1.jpg", "c/s2.jpg", "c/s2.txt", "c/s3.jpg", "c/s4.jpg", "c/s4.txt"]);
        let cat = Catalog::build(all, GroupOptions::default(), &r).unwrap();
        let keys: Vec<String> = listing(&cat).into_iter().map(|(k, _, _)| k).collect();
        assert_eq!(keys, ["c/s2", "c/s4"]);
        assert_eq!(r.left_out_counts(), (2, 2), "two samples, one other file each");
        // A field that cannot be stored leaves its sample out too (a key regex leaving it empty).
        let re = regex::Regex::new(r"^(?P<key>[^.]+)\.?(?P<field>[a-z]*)$").unwrap();
        let r = Reporter::new(false, &());
        let opts = GroupOptions { key_regex: Some(&re), label_from_dir: false };
        let cat = Catalog::build(paths(&["a.jpg", "a", "b.jpg"]), opts, &r).unwrap();
        assert_eq!(listing(&cat).into_iter().map(|(k, _, _)| k).collect::<Vec<_>>(), ["b"]);
        assert_eq!(r.left_out_counts(), (1, 1));
    }

    /// (key, [(field, path)], class) of every sample.
    type Listing = Vec<(String, Vec<(String, String)>, Option<u32>)>;

    fn listing(cat: &Catalog) -> Listing {
        (0..cat.num_samples())
            .map(|i| {
                let s = cat.sample(i).unwrap();
                (s.key().to_owned(), s.members().map(|m| (m.field.to_owned(), m.path.to_owned())).collect(), s.class())
            })
            .collect()
    }

    #[test]
    fn webdataset_grouping_in_key_order() {
        let r = Reporter::new(false, &());
        let cat = Catalog::build(
            paths(&["a/x.json", "a/x-1.jpg", "a/x.jpg", "v1.2/y.seg.png", "README", "a/.hidden", "a/x.", "top.cls"]),
            GroupOptions::default(),
            &r,
        )
        .unwrap();
        assert_eq!(
            listing(&cat),
            vec![
                ("a/x".into(), vec![("jpg".into(), "a/x.jpg".into()), ("json".into(), "a/x.json".into())], None),
                ("a/x-1".into(), vec![("jpg".into(), "a/x-1.jpg".into())], None),
                ("top".into(), vec![("cls".into(), "top.cls".into())], None),
                ("v1.2/y".into(), vec![("seg.png".into(), "v1.2/y.seg.png".into())], None),
            ]
        );
        assert_eq!(cat.fields, ["cls", "jpg", "json", "seg.png"]);
        assert_eq!(cat.num_files(), 5);
        assert_eq!(r.ignored_count(), 3);
        let m = cat.sample(0).unwrap().members().next().unwrap();
        assert_eq!(m.name, "a/x.jpg");
    }

    #[test]
    fn fields_are_lower_cased_like_readers_do() {
        let r = Reporter::new(false, &());
        let cat = Catalog::build(
            paths(&["a/x.JPG", "a/x.jpg", "a/y.Seg.PNG", "__meta__/z.txt"]),
            GroupOptions::default(),
            &r,
        )
        .unwrap();
        let l = listing(&cat);
        assert_eq!(l[0].1, vec![("jpg".into(), "a/x.JPG".into())]);
        assert_eq!(l[1].1, vec![("seg.png".into(), "a/y.Seg.PNG".into())]);
        assert_eq!(cat.sample(1).unwrap().members().next().unwrap().name, "a/y.seg.png");
        assert_eq!(r.counts().get(&BadKind::DuplicateKey), Some(&1)); // a/x.jpg
        assert_eq!(r.ignored_count(), 1); // __meta__/z.txt
    }

    #[test]
    fn labels_from_directories() {
        let r = Reporter::new(false, &());
        let opts = GroupOptions { key_regex: None, label_from_dir: true };
        let cat =
            Catalog::build(paths(&["dog/1.jpg", "cat/2.jpg", "cat/3.jpg", "cat/3.cls", "x.jpg"]), opts, &r).unwrap();
        assert_eq!(cat.classes, ["cat", "dog"]);
        let l = listing(&cat);
        assert_eq!(
            l.iter().map(|s| (s.0.as_str(), s.2)).collect::<Vec<_>>(),
            [("cat/2", Some(0)), ("cat/3", Some(0)), ("dog/1", Some(1))]
        );
        // Deeper trees keep the class directly under SRC, as ImageFolder does: the year
        // directories are not classes, and `dog` is one class however its files are filed.
        let r2 = Reporter::new(false, &());
        let nested = Catalog::build(paths(&["cat/2020/a.jpg", "dog/2020/b.jpg", "dog/2021/c.jpg"]), opts, &r2).unwrap();
        assert_eq!(nested.classes, ["cat", "dog"]);
        assert_eq!(
            listing(&nested).iter().map(|s| (s.0.as_str(), s.2)).collect::<Vec<_>>(),
            [("cat/2020/a", Some(0)), ("dog/2020/b", Some(1)), ("dog/2021/c", Some(1))]
        );
        assert_eq!(cat.fields, ["cls", "jpg"]);
        let counts = r.counts();
        assert_eq!(counts.get(&BadKind::DuplicateKey), Some(&1)); // cat/3.cls
        assert_eq!(counts.get(&BadKind::BadKey), Some(&1)); // x.jpg has no class directory
    }

    #[test]
    fn key_regex_and_duplicates() {
        let re = compile_key_regex(r"^(?P<key>.*/img_\d+)_(?P<field>\w+\.png)$").unwrap();
        let r = Reporter::new(false, &());
        let opts = GroupOptions { key_regex: Some(&re), label_from_dir: false };
        let cat = Catalog::build(paths(&["d/img_1_rgb.png", "d/img_1_mask.png", "d/notes.txt"]), opts, &r).unwrap();
        let l = listing(&cat);
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].0, "d/img_1");
        assert_eq!(
            l[0].1,
            vec![("mask.png".into(), "d/img_1_mask.png".into()), ("rgb.png".into(), "d/img_1_rgb.png".into())]
        );
        assert_eq!(cat.sample(0).unwrap().members().next().unwrap().name, "d/img_1.mask.png");
        assert_eq!(r.ignored_count(), 1);

        // Without a field group the field is what follows the match.
        let re = compile_key_regex(r"^([^_]+)_").unwrap();
        let cat = Catalog::build(
            paths(&["a_1.jpg", "a_2.jpg", "b_1.jpg"]),
            GroupOptions { key_regex: Some(&re), label_from_dir: false },
            &r,
        )
        .unwrap();
        let l = listing(&cat);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].1, vec![("1.jpg".into(), "a_1.jpg".into()), ("2.jpg".into(), "a_2.jpg".into())]);

        // Two files mapping to one (key, field): the later path is dropped and reported.
        let re = compile_key_regex(r"^(?P<key>\w+)\.(?P<field>\w+)(\.bak)?$").unwrap();
        let r = Reporter::new(false, &());
        let cat = Catalog::build(
            paths(&["a.jpg", "a.jpg.bak"]),
            GroupOptions { key_regex: Some(&re), label_from_dir: false },
            &r,
        )
        .unwrap();
        assert_eq!(listing(&cat)[0].1, vec![("jpg".into(), "a.jpg".into())]);
        assert_eq!(r.counts().get(&BadKind::DuplicateKey), Some(&1));
        let strict = Reporter::new(true, &());
        assert!(
            Catalog::build(
                paths(&["a.jpg", "a.jpg.bak"]),
                GroupOptions { key_regex: Some(&re), label_from_dir: false },
                &strict
            )
            .is_err()
        );

        // A key that would not read back is refused.
        let re = compile_key_regex(r"^(.*)$").unwrap();
        let r = Reporter::new(false, &());
        let cat =
            Catalog::build(paths(&["a.b"]), GroupOptions { key_regex: Some(&re), label_from_dir: false }, &r).unwrap();
        assert_eq!(cat.num_samples(), 0);
        assert_eq!(r.counts().get(&BadKind::BadKey), Some(&1));
        assert!(compile_key_regex("no groups").is_err());
        assert!(compile_key_regex("(").is_err());
    }

    #[test]
    fn shuffle_is_a_seeded_permutation() {
        let r = Reporter::new(false, &());
        let names: Vec<String> = (0..500).map(|i| format!("{i:04}.jpg")).collect();
        let cat = Catalog::build(names, GroupOptions::default(), &r).unwrap();
        assert_eq!(cat.order(false, 0), (0..500).collect::<Vec<u32>>());
        let a = cat.order(true, 7);
        assert_eq!(a, cat.order(true, 7));
        assert_ne!(a, cat.order(true, 8));
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..500).collect::<Vec<u32>>());
    }
}
