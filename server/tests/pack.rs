//! `shardstream pack` end to end in Rust: pack generated trees, read every shard back through the
//! manifest, the sidecars, `format::tar::index_tar` and `parse_sample` (what the daemon does), and
//! check determinism, resume after an interruption, Parquet output and every kind of bad input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use shardstream::format::{sidecar, tar};
use shardstream::index::manifest::Manifest;
use shardstream::pack::{self, BadKind, FileList, PackOptions, PackProgress, ShardFormat};

type Samples = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

/// Deterministic pseudo-random bytes (SplitMix-like), so trees are the same on every run.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn write(root: &Path, rel: &str, data: &[u8]) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

/// An ImageNet-style tree: `cNN/xxxx.jpg` + `cNN/xxxx.json` (every third sample has no json).
fn imagenet_tree(root: &Path, classes: usize, per_class: usize) -> Samples {
    let mut samples = Samples::new();
    for c in 0..classes {
        for i in 0..per_class {
            let key = format!("c{c:02}/{:05}", c * per_class + i);
            let seed = (c * 100_000 + i) as u64;
            let mut fields = BTreeMap::new();
            fields.insert("jpg".to_string(), bytes(seed, 100 + (seed as usize * 7919) % 6000));
            if i % 3 != 0 {
                fields.insert("json".to_string(), format!("{{\"i\": {i}}}").into_bytes());
            }
            for (f, d) in &fields {
                write(root, &format!("{key}.{f}"), d);
            }
            samples.insert(key, fields);
        }
    }
    samples
}

fn opts(src: &Path, dest: &Path) -> PackOptions {
    let mut o = PackOptions::new(src, dest.to_str().unwrap());
    o.threads = 4;
    o
}

/// Reads a packed WebDataset directory the way the daemon does, checking every invariant on the
/// way; returns the samples, and (key order) the list of keys per shard.
fn read_back(dest: &Path) -> (Samples, Vec<Vec<String>>) {
    let text = std::fs::read(dest.join("manifest.json")).unwrap();
    let m = Manifest::parse(&text, "manifest").unwrap();
    assert_eq!(m.shard_format, "webdataset");
    let mut samples = Samples::new();
    let mut per_shard = Vec::new();
    for s in &m.shards {
        let path = dest.join(&s.name);
        let data = std::fs::read(&path).unwrap();
        assert_eq!(data.len() as u64, s.bytes, "{}", s.name);
        assert_eq!(format!("{:08x}", crc32c::crc32c(&data)), s.crc32c, "{}", s.name);
        let ix = tar::index_tar(std::io::Cursor::new(&data), data.len() as u64).unwrap();
        let identity = format!("len={};crc32c={}", s.bytes, s.crc32c);
        let side = sidecar::read(&dest.join(s.index.as_ref().unwrap()), identity.as_bytes()).unwrap().unwrap();
        assert_eq!(side, ix, "sidecar of {} differs from a scan", s.name);
        assert_eq!(ix.num_samples() as u64, s.samples);
        let mut keys = Vec::new();
        for i in 0..ix.num_samples() {
            let r = ix.sample_range(i).unwrap();
            let buf = &data[r.start as usize..r.end as usize];
            let v = tar::parse_sample(buf).unwrap();
            let fields: BTreeMap<String, Vec<u8>> =
                v.members.iter().map(|mb| (mb.field.to_string(), buf[mb.data.clone()].to_vec())).collect();
            assert!(samples.insert(v.key.to_string(), fields).is_none(), "key {} twice", v.key);
            keys.push(v.key.to_string());
        }
        per_shard.push(keys);
    }
    assert_eq!(m.total_samples as usize, samples.len());
    (samples, per_shard)
}

/// Every file under `dir` with its bytes.
fn tree_bytes(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn go(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                go(root, &p, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().to_owned(), std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    go(dir, dir, &mut out);
    out
}

#[test]
fn round_trip_through_manifest_sidecars_and_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let expected = imagenet_tree(&src, 4, 60);
    write(&src, "README", b"not a sample");
    write(&src, ".hidden/x.jpg", b"hidden");
    let dest = tmp.path().join("out");
    let mut o = opts(&src, &dest);
    o.shard_size = 64 << 10;
    let summary = pack::pack(&o, &()).unwrap();
    assert_eq!(summary.ignored, 2);
    assert_eq!(summary.bad_total(), 0);
    let (got, per_shard) = read_back(&dest);
    assert_eq!(got, expected);
    // Key order, shards within the size limit, no trace of staging.
    let keys: Vec<String> = per_shard.concat();
    assert_eq!(keys, expected.keys().cloned().collect::<Vec<_>>());
    for s in &summary.manifest.shards {
        assert!(s.bytes <= 64 << 10 || s.samples == 1, "{} is {} bytes", s.name, s.bytes);
    }
    assert!(summary.manifest.shards.len() > 5);
    assert_eq!(summary.manifest.fields, ["jpg", "json"]);
    assert!(!dest.join("_shardstream/staging").try_exists().unwrap());
    assert_eq!(summary.manifest.shards[0].name, "shard-000000.tar");
}

#[test]
fn labels_shuffle_and_samples_per_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let expected = imagenet_tree(&src, 3, 40);
    let run = |dest: &Path, seed: u64| {
        let mut o = opts(&src, dest);
        o.label_from_dir = true;
        o.shuffle = true;
        o.seed = seed;
        o.samples_per_shard = Some(25);
        pack::pack(&o, &()).unwrap();
        read_back(dest)
    };
    let (got, per_shard) = run(&tmp.path().join("a"), 1);
    assert!(per_shard.iter().all(|k| k.len() <= 25));
    assert_eq!(per_shard.iter().map(Vec::len).sum::<usize>(), 120);
    let classes: BTreeMap<String, u32> =
        serde_json::from_slice(&std::fs::read(tmp.path().join("a/classes.json")).unwrap()).unwrap();
    assert_eq!(classes, BTreeMap::from([("c00".into(), 0), ("c01".into(), 1), ("c02".into(), 2)]));
    for (key, fields) in &got {
        let mut want = expected[key].clone();
        want.insert("cls".into(), key[1..3].parse::<u32>().unwrap().to_string().into_bytes());
        assert_eq!(fields, &want, "{key}");
    }
    let order: Vec<String> = per_shard.concat();
    let sorted: Vec<String> = got.keys().cloned().collect();
    assert_ne!(order, sorted, "shuffled order is key order");
    let (_, again) = run(&tmp.path().join("b"), 1);
    assert_eq!(again.concat(), order);
    let (_, other) = run(&tmp.path().join("c"), 2);
    assert_ne!(other.concat(), order);
}

#[test]
fn output_is_byte_identical_whatever_the_thread_count_and_write_route() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    imagenet_tree(&src, 3, 50);
    // Names that need ustar prefixes and PAX records, and an upper-case extension.
    write(&src, &format!("{}/deep.jpg", "d".repeat(130)), b"deep");
    write(&src, &format!("long/{}.jpg", "n".repeat(150)), b"long");
    write(&src, "unicode/été.JPG", b"accent");
    let mut outs = Vec::new();
    // Around the page cache (the default) with 1 and 7 readers, and through it.
    for (threads, buffered_io) in [(1, false), (7, false), (3, true)] {
        let dest = tmp.path().join(format!("out{threads}"));
        let mut o = opts(&src, &dest);
        o.threads = threads;
        o.shard_size = 100 << 10;
        o.buffered_io = buffered_io;
        pack::pack(&o, &()).unwrap();
        outs.push(tree_bytes(&dest));
    }
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], outs[2]);
    let (got, _) = read_back(&tmp.path().join("out1"));
    assert_eq!(got[&format!("{}/deep", "d".repeat(130))]["jpg"], b"deep");
    assert_eq!(got[&format!("long/{}", "n".repeat(150))]["jpg"], b"long");
    assert_eq!(got["unicode/été"]["jpg"], b"accent");
}

#[test]
fn oversize_samples_get_their_own_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "a.bin", &bytes(1, 1000));
    write(&src, "b.bin", &bytes(2, 50_000));
    write(&src, "c.bin", &bytes(3, 1000));
    write(&src, "d.bin", &bytes(4, 1000));
    // Large enough to be copied by the writer instead of read into memory.
    let huge = bytes(5, (17 << 20) + 3);
    write(&src, "e.bin", &huge);
    write(&src, "e.txt", b"caption");
    write(&src, "f.bin", &bytes(6, 1000));
    let dest = tmp.path().join("out");
    let mut o = opts(&src, &dest);
    o.shard_size = 10_000;
    let s = pack::pack(&o, &()).unwrap();
    let counts: Vec<u64> = s.manifest.shards.iter().map(|s| s.samples).collect();
    assert_eq!(counts, [1, 1, 2, 1, 1]);
    assert!(s.manifest.shards[1].bytes > 50_000);
    let (got, _) = read_back(&dest);
    assert_eq!(got["e"]["bin"], huge);
    assert_eq!(got["e"]["txt"], b"caption");
    assert_eq!(got["b"]["bin"], bytes(2, 50_000));
}

/// Stops the pack (as Ctrl-C or a crash would) once `after` shards are durable.
struct StopAfter {
    after: u64,
    done: AtomicU64,
}

impl PackProgress for StopAfter {
    fn shard_done(&self, _: &str, _: u64) {
        self.done.fetch_add(1, Ordering::SeqCst);
    }

    fn stop_requested(&self) -> bool {
        self.done.load(Ordering::SeqCst) >= self.after
    }
}

#[test]
fn resume_after_an_interruption_gives_identical_output() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    imagenet_tree(&src, 4, 80);
    let base = |dest: &Path| {
        let mut o = opts(&src, dest);
        o.shard_size = 40 << 10;
        o.shuffle = true;
        o.seed = 5;
        o
    };
    let clean = tmp.path().join("clean");
    pack::pack(&base(&clean), &()).unwrap();

    let dest = tmp.path().join("resumed");
    let stop = StopAfter { after: 3, done: AtomicU64::new(0) };
    let err = pack::pack(&base(&dest), &stop).unwrap_err().to_string();
    assert!(err.contains("--resume"), "{err}");
    // Nothing presented as complete: no manifest, no shard in DEST itself.
    assert!(!dest.join("manifest.json").try_exists().unwrap());
    assert!(std::fs::read_dir(&dest).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tar")));
    let staged = std::fs::read_dir(dest.join("_shardstream/staging")).unwrap().count();
    assert!(staged >= 3, "{staged} staged");
    // What a SIGKILL between a temporary file's create and its rename leaves behind.
    write(&dest, "_shardstream/.shard-000001.tar.idx.tmp.4242.7", b"");
    write(&dest, ".manifest.json.tmp.4242", b"{");

    let mut o = base(&dest);
    o.resume = true;
    o.threads = 2;
    let s = pack::pack(&o, &()).unwrap();
    assert!(s.resumed_shards >= 3, "{}", s.resumed_shards);
    assert_eq!(tree_bytes(&dest), tree_bytes(&clean));

    // A journaled shard that went missing is packed again; a second resume of a complete pack
    // changes nothing.
    let victim = s.manifest.shards[1].name.clone();
    std::fs::remove_file(dest.join(&victim)).unwrap();
    let s = pack::pack(&o, &()).unwrap();
    assert_eq!(s.resumed_shards, 1);
    assert_eq!(tree_bytes(&dest), tree_bytes(&clean));
    let s = pack::pack(&o, &()).unwrap();
    assert_eq!(s.resumed_shards as usize, s.manifest.shards.len());
    assert_eq!(s.files_read, 0);
    assert_eq!(tree_bytes(&dest), tree_bytes(&clean));
}

#[test]
fn parquet_shards_hold_keys_and_fields() {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::file::reader::FileReader;

    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let expected = imagenet_tree(&src, 2, 45);
    let dest = tmp.path().join("pq");
    let mut o = opts(&src, &dest);
    o.format = ShardFormat::Parquet;
    o.samples_per_shard = Some(40);
    o.row_group_rows = 16;
    o.compression = pack::ParquetCompression::Zstd;
    let s = pack::pack(&o, &()).unwrap();
    let m: Manifest = serde_json::from_slice(&std::fs::read(dest.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m, s.manifest);
    assert_eq!(m.shard_format, "parquet");
    assert_eq!(m.shards.iter().map(|s| s.samples).collect::<Vec<_>>(), [40, 40, 10]);
    let mut got = Samples::new();
    for sh in &m.shards {
        let path = dest.join(&sh.name);
        let data = std::fs::read(&path).unwrap();
        assert_eq!(format!("{:08x}", crc32c::crc32c(&data)), sh.crc32c);
        assert!(sh.index.is_none());
        let file = std::fs::File::open(&path).unwrap();
        let groups = parquet::file::reader::SerializedFileReader::new(file.try_clone().unwrap())
            .unwrap()
            .metadata()
            .num_row_groups();
        assert_eq!(groups, (sh.samples as usize).div_ceil(16));
        let reader = ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap();
        for batch in reader {
            let batch = batch.unwrap();
            let schema = batch.schema();
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            assert_eq!(names, ["__key__", "jpg", "json"]);
            let keys = batch.column(0).as_any().downcast_ref::<arrow_array::StringArray>().unwrap();
            for row in 0..batch.num_rows() {
                let mut fields = BTreeMap::new();
                for (c, name) in names.iter().enumerate().skip(1) {
                    let col = batch.column(c).as_any().downcast_ref::<arrow_array::BinaryArray>().unwrap();
                    if !arrow_array::Array::is_null(col, row) {
                        fields.insert(name.to_string(), col.value(row).to_vec());
                    }
                }
                got.insert(keys.value(row).to_string(), fields);
            }
        }
    }
    assert_eq!(got, expected);
    served_as_is(&dest, &expected);
}

/// The layout `pack` writes (chosen by bench/parquet_layout.py, see bench/PARQUET_LAYOUT.md), per
/// column of every row group: payload columns PLAIN (no dictionary), uncompressed, without
/// statistics; the key column with chunk statistics; an offset index (page locations) for every
/// column, so a reader can seek to the pages of some rows; data page v1.
#[test]
fn parquet_payload_columns_are_plain_uncompressed_with_an_offset_index() {
    use parquet::basic::{Compression, Encoding, PageType};
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    imagenet_tree(&src, 2, 45);
    let dest = tmp.path().join("pq");
    let mut o = opts(&src, &dest);
    o.format = ShardFormat::Parquet;
    o.row_group_rows = 16;
    pack::pack(&o, &()).unwrap();
    let m: Manifest = serde_json::from_slice(&std::fs::read(dest.join("manifest.json")).unwrap()).unwrap();
    for sh in &m.shards {
        let file = std::fs::File::open(dest.join(&sh.name)).unwrap();
        let reader = SerializedFileReader::new(file).unwrap();
        let meta = reader.metadata();
        assert!(meta.num_row_groups() > 1);
        for rg in meta.row_groups() {
            for col in rg.columns() {
                let name = col.column_path().string();
                assert_eq!(col.compression(), Compression::UNCOMPRESSED, "{name}");
                let encodings: Vec<Encoding> = col.encodings().collect();
                assert!(encodings.contains(&Encoding::PLAIN), "{name}: {encodings:?}");
                assert!(
                    !encodings.iter().any(|e| matches!(e, Encoding::PLAIN_DICTIONARY | Encoding::RLE_DICTIONARY)),
                    "{name}: {encodings:?}"
                );
                assert!(col.dictionary_page_offset().is_none(), "{name}");
                assert!(col.offset_index_offset().is_some(), "{name}: no offset index");
                assert_eq!(col.statistics().is_some(), name == "__key__", "{name}");
            }
        }
        // Every data page is a v1 page (what every reader decodes).
        for rg in 0..meta.num_row_groups() {
            let group = reader.get_row_group(rg).unwrap();
            for c in 0..group.num_columns() {
                for page in group.get_column_page_reader(c).unwrap() {
                    assert_eq!(page.unwrap().page_type(), PageType::DATA_PAGE);
                }
            }
        }
    }
}

/// The daemon serves `pack --format parquet` output as it is: the manifest's shards, the files'
/// footers, and every row's fields through the Arrow batch path.
fn served_as_is(dest: &Path, expected: &Samples) {
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    use shardstream::format::parquet::dataset::{BatchAssembler, FileReader};
    use shardstream::format::parquet::decoded::DecodedCache;
    struct Files<'a>(&'a shardstream::index::Dataset);
    impl FileReader for Files<'_> {
        fn read_bytes(&self, file: usize, offset: u64, len: usize) -> shardstream::Result<bytes::Bytes> {
            shardstream::format::parquet::dataset::read_recycled(&self.0.shard(file)?.file, len, offset)
        }
    }
    // Every footer in one bundle the manifest names, under the manifest's identities.
    let manifest =
        shardstream::index::manifest::Manifest::read_file(&dest.join(shardstream::index::manifest::MANIFEST_FILE))
            .unwrap()
            .unwrap();
    let bundle_name = manifest.footers.clone().expect("a footers bundle");
    let bundle = std::fs::read(dest.join(bundle_name)).unwrap();
    let entries = shardstream::format::parquet::footers::decode(&bundle).unwrap();
    assert_eq!(entries.len(), manifest.shards.len());
    for s in &manifest.shards {
        let identity = format!("len={};crc32c={}", s.bytes, s.crc32c);
        let table = shardstream::format::parquet::pqidx::load(entries[s.name.as_str()], identity.as_bytes()).unwrap();
        assert_eq!(table.map(|t| t.num_rows()), Some(s.samples), "{}", s.name);
    }
    let ds = shardstream::index::Dataset::open(dest.to_str().unwrap(), None).unwrap();
    assert!(ds.from_manifest);
    assert_eq!((ds.format.name(), ds.num_samples()), ("parquet", expected.len() as u64));
    assert_eq!(ds.fields, ["__key__", "jpg", "json"]);
    let pq = ds.parquet.clone().unwrap();
    let cache = std::sync::Arc::new(DecodedCache::new(64 << 20));
    let asm = BatchAssembler::new(pq.clone(), pq.projection(None).unwrap(), cache, "pack").unwrap();
    let ids: Vec<u64> = (0..ds.num_samples()).rev().collect();
    let batch = asm.batch(&ids, &Files(&ds)).unwrap();
    let (keys, jpg, json) =
        (batch.column(0).as_string::<i32>(), batch.column(1).as_binary::<i32>(), batch.column(2).as_binary::<i32>());
    for row in 0..batch.num_rows() {
        let want = &expected[keys.value(row)];
        assert_eq!(jpg.value(row), want["jpg"].as_slice());
        assert_eq!(json.is_null(row), !want.contains_key("json"));
    }
}

/// A tree with one bad input of each kind, and how each is named.
fn bad_tree(root: &Path, outside: &Path) -> Vec<(BadKind, String)> {
    use std::os::unix::ffi::OsStrExt;
    write(root, "good/1.jpg", b"one");
    write(root, "good/2.jpg", b"two");
    write(outside, "secret.jpg", b"secret");
    std::os::unix::fs::symlink(outside.join("secret.jpg"), root.join("good/escape.jpg")).unwrap();
    std::os::unix::fs::symlink(root.join("good/nothing"), root.join("good/dangling.jpg")).unwrap();
    std::fs::write(root.join(std::ffi::OsStr::from_bytes(b"good/bad\xffname.jpg")), b"x").unwrap();
    vec![
        (BadKind::SymlinkOutside, "good/escape.jpg".into()),
        (BadKind::Vanished, "good/dangling.jpg".into()),
        (BadKind::NotUtf8, "good/bad\u{fffd}name.jpg".into()),
    ]
}

/// Records bad inputs as reported.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<(BadKind, String)>>);

impl PackProgress for Recorder {
    fn bad_input(&self, bad: &pack::BadInput) {
        self.0.lock().unwrap().push((bad.kind, bad.path.clone()));
    }
}

#[test]
fn bad_inputs_in_a_walk_are_skipped_counted_or_fatal() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mut expected = bad_tree(&src, &tmp.path().join("outside"));
    let dest = tmp.path().join("out");
    let rec = Recorder::default();
    let s = pack::pack(&opts(&src, &dest), &rec).unwrap();
    let mut got = rec.0.into_inner().unwrap();
    got.sort();
    expected.sort();
    assert_eq!(got, expected);
    assert_eq!(s.bad_total(), 3);
    assert!(s.line().contains("skipped 3 bad inputs"), "{}", s.line());
    let (samples, _) = read_back(&dest);
    assert_eq!(samples.keys().collect::<Vec<_>>(), ["good/1", "good/2"]);

    // With --strict the first bad input is fatal and nothing is published.
    let strict_dest = tmp.path().join("strict");
    let mut o = opts(&src, &strict_dest);
    o.strict = true;
    let err = pack::pack(&o, &()).unwrap_err().to_string();
    assert!(err.contains("--strict") && expected.iter().any(|(_, p)| err.contains(p.as_str())), "{err}");
    assert!(!strict_dest.join("manifest.json").try_exists().unwrap());
}

#[test]
fn bad_entries_of_a_file_list() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "a/1.jpg", b"1");
    write(&src, "a/2.jpg", b"2");
    write(&src, "a/file.jpg", b"f");
    write(tmp.path(), "outside.jpg", b"o");
    let cases: Vec<(&str, BadKind)> = vec![
        ("../outside.jpg", BadKind::OutsideSrc),
        ("a/../a/1.jpg", BadKind::OutsideSrc),
        ("/etc/hostname", BadKind::OutsideSrc),
        ("a/missing.jpg", BadKind::Vanished),
        ("a/file.jpg/x.jpg", BadKind::Unreadable), // ENOTDIR: unreadable even for root
        ("a/2.jpg", BadKind::DuplicateKey),        // listed twice
        ("a", BadKind::NotAFile),
    ];
    let mut entries = vec!["a/1.jpg".to_string(), "./a/2.jpg".to_string(), format!("{}/a/file.jpg", src.display())];
    entries.extend(cases.iter().map(|(e, _)| e.to_string()));
    let dest = tmp.path().join("out");
    let mut o = opts(&src, &dest);
    o.files_from = Some(FileList::Entries(entries.clone()));
    let rec = Recorder::default();
    let s = pack::pack(&o, &rec).unwrap();
    let got: Vec<BadKind> = {
        let mut v: Vec<BadKind> = rec.0.into_inner().unwrap().into_iter().map(|(k, _)| k).collect();
        v.sort();
        v
    };
    let mut want: Vec<BadKind> = cases.iter().map(|c| c.1).filter(|k| *k != BadKind::NotAFile).collect();
    want.sort();
    // "a" names a directory: it has no field extension, so it is ignored, not a bad input.
    assert_eq!(got, want);
    assert_eq!(s.ignored, 1);
    let (samples, _) = read_back(&dest);
    assert_eq!(samples.keys().collect::<Vec<_>>(), ["a/1", "a/2", "a/file"]);

    // Each is fatal with --strict, naming the entry.
    for (i, (entry, _)) in cases[..6].iter().enumerate() {
        let dest = tmp.path().join(format!("strict{i}"));
        let mut o = opts(&src, &dest);
        o.strict = true;
        o.files_from = Some(FileList::Entries(vec!["a/2.jpg".into(), entry.to_string()]));
        let err = pack::pack(&o, &()).unwrap_err().to_string();
        let named = entry.trim_start_matches("./");
        assert!(err.contains(named) || err.contains("a/2.jpg"), "{entry}: {err}");
        assert!(!dest.join("manifest.json").try_exists().unwrap());
    }

    // A file list read from a path, NUL-separated.
    let list = tmp.path().join("list0");
    std::fs::write(&list, b"a/1.jpg\0a/2.jpg\0").unwrap();
    let dest = tmp.path().join("from-file");
    let mut o = opts(&src, &dest);
    o.files_from = Some(FileList::Path(list));
    o.null_separated = true;
    assert_eq!(pack::pack(&o, &()).unwrap().manifest.total_samples, 2);
}

#[test]
fn duplicate_keys_from_a_key_regex() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "x/img_1_rgb.png", b"rgb");
    write(&src, "x/img_1_mask.png", b"mask");
    write(&src, "y/img_1_rgb.png", b"other");
    let dest = tmp.path().join("out");
    let mut o = opts(&src, &dest);
    // The directory is dropped from the key: x/img_1 and y/img_1 collide.
    o.key_regex = Some(r"^[^/]+/(?P<key>img_\d+)_(?P<field>\w+\.png)$".into());
    let rec = Recorder::default();
    let s = pack::pack(&o, &rec).unwrap();
    assert_eq!(rec.0.into_inner().unwrap(), [(BadKind::DuplicateKey, "y/img_1_rgb.png".to_string())]);
    let (samples, _) = read_back(&dest);
    assert_eq!(samples["img_1"]["rgb.png"], b"rgb");
    assert_eq!(samples["img_1"]["mask.png"], b"mask");
    assert_eq!(s.manifest.total_samples, 1);
}

#[test]
fn dest_holding_another_dataset_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    imagenet_tree(&src, 2, 5);
    let dest = tmp.path().join("out");
    pack::pack(&opts(&src, &dest), &()).unwrap();
    // The same pack again is fine (and changes nothing).
    let before = tree_bytes(&dest);
    pack::pack(&opts(&src, &dest), &()).unwrap();
    assert_eq!(tree_bytes(&dest), before);
    // Other options or other input: a different dataset.
    let mut o = opts(&src, &dest);
    o.shuffle = true;
    let err = pack::pack(&o, &()).unwrap_err().to_string();
    assert!(err.contains("different dataset") && err.contains(dest.to_str().unwrap()), "{err}");
    write(&src, "c09/new.jpg", b"new");
    let err = pack::pack(&opts(&src, &dest), &()).unwrap_err().to_string();
    assert!(err.contains("different dataset"), "{err}");
    assert_eq!(tree_bytes(&dest), before);
    // Two packs into one directory at once: the second is refused while the first holds it.
    let busy = std::fs::File::open(&dest).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&busy), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let err = pack::pack(&opts(&src, &dest), &()).unwrap_err().to_string();
    assert!(err.contains("another pack"), "{err}");
    drop(busy);
    // A directory of shards written by something else.
    let foreign = tmp.path().join("foreign");
    write(&foreign, "train-000000.tar", b"whatever");
    let err = pack::pack(&opts(&src, &foreign), &()).unwrap_err().to_string();
    assert!(err.contains("train-000000.tar") && err.contains("already holds"), "{err}");
}

#[test]
fn refusals_with_clear_messages() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write(&src, "a.jpg", b"a");
    // S3 output goes through pack_with and a connection (end to end in tests/test_pack.py).
    let err = pack::pack(&PackOptions::new(&src, "s3://bucket/prefix/"), &()).unwrap_err().to_string();
    assert!(err.contains("s3://bucket/prefix/: S3 output needs an S3 connection"), "{err}");
    let err = pack::pack(&opts(&tmp.path().join("nope"), &tmp.path().join("o")), &()).unwrap_err().to_string();
    assert!(err.contains("nope"), "{err}");
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = pack::pack(&opts(&empty, &tmp.path().join("o2")), &()).unwrap_err().to_string();
    assert!(err.contains("nothing to pack"), "{err}");
    let mut o = opts(&src, &tmp.path().join("o3"));
    o.prefix = "../evil".into();
    assert!(pack::pack(&o, &()).is_err());
    let err = pack::pack(&opts(&src, &src), &()).unwrap_err().to_string();
    assert!(err.contains("is the source directory"), "{err}");
    // The output inside the source is not packed into itself.
    let inner = src.join("shards");
    let s = pack::pack(&opts(&src, &inner), &()).unwrap();
    assert_eq!(s.manifest.total_samples, 1);
    let s = pack::pack(&opts(&src, &inner), &()).unwrap();
    assert_eq!(s.manifest.total_samples, 1);
}

/// A journal whose fingerprint matches but whose last record says it ends past the packing order
/// (a corrupted digit, a hand edit) must not steer the resume outside the order: the record is
/// not trusted, its shard is packed again, and the output is the clean one.
#[test]
fn a_journal_record_past_the_end_of_the_order_is_not_trusted() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    imagenet_tree(&src, 3, 20);
    let clean = tmp.path().join("clean");
    let mut o = opts(&src, &clean);
    o.shard_size = 40 << 10;
    pack::pack(&o, &()).unwrap();

    let dest = tmp.path().join("dest");
    let mut o = opts(&src, &dest);
    o.shard_size = 40 << 10;
    o.resume = true;
    let s = pack::pack(&o, &()).unwrap();
    assert!(s.manifest.shards.len() >= 2, "{}", s.manifest.shards.len());
    let journal = dest.join("_shardstream/pack-journal.jsonl");
    let text = std::fs::read_to_string(&journal).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let last = lines.last_mut().unwrap();
    let mut rec: serde_json::Value = serde_json::from_str(last).unwrap();
    rec["end"] = serde_json::json!(1_000_000_000_000u64);
    rec["files"] = serde_json::json!(u64::MAX);
    *last = rec.to_string();
    std::fs::write(&journal, lines.join("\n") + "\n").unwrap();

    let s = pack::pack(&o, &()).unwrap();
    assert_eq!(s.resumed_shards as usize, s.manifest.shards.len() - 1);
    assert_eq!(tree_bytes(&dest), tree_bytes(&clean));
}

#[test]
fn a_sample_of_more_fields_than_a_shard_may_have_fails_the_pack_naming_it() {
    // A thousand frames of a clip named `clip.0000.jpg` ..: one sample (the key ends at the first
    // dot) of a field per frame. Packed, every reader re-indexing the shard refuses it.
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let fields = shardstream::format::tar::MAX_SHARD_FIELDS;
    for f in 0..fields {
        write(&src, &format!("clip.{f:04}.jpg"), b"x");
    }
    let dest = tmp.path().join("out");
    pack::pack(&opts(&src, &dest), &()).unwrap();
    assert_eq!(read_back(&dest).0["clip"].len(), fields);
    write(&src, &format!("clip.{fields:04}.jpg"), b"x");
    let again = tmp.path().join("again");
    let e = pack::pack(&opts(&src, &again), &()).unwrap_err().to_string();
    assert!(e.contains("sample \"clip\"") && e.contains("'clip.1024.jpg'"), "{e}");
}
