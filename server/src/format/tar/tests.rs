//! Tests of TAR indexing and sample parsing, against archives written by the `tar` crate and
//! by hand (every header style, extension record and damage the parser must survive).
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::io::{Cursor, Read, Seek, SeekFrom};

use proptest::prelude::*;

use super::header::*;
use super::naming::*;
use super::*;

#[test]
fn largest_sample_is_the_first_of_the_largest() {
    let index = |b: &[u64]| TarIndex {
        boundaries: b.to_vec(),
        fields: Vec::new(),
        layout: None,
        split_keys: Default::default(),
    };
    assert_eq!(index(&[]).largest_sample(), None);
    assert_eq!(index(&[512]).largest_sample(), None);
    assert_eq!(index(&[0, 1024, 3072, 4096, 6144]).largest_sample(), Some((1, 2048)));
}

/// How a test member's header is written.
#[derive(Clone, Copy, Debug)]
enum Style {
    /// POSIX ustar: long paths split into `prefix`, GNU long names beyond that.
    Ustar,
    /// GNU: long names as `L` records.
    Gnu,
    /// v7 (no magic), long names as `L` records.
    Old,
    /// The path in a PAX `x` header; the header's own name is a decoy.
    Pax,
}

const STYLES: [Style; 4] = [Style::Ustar, Style::Gnu, Style::Old, Style::Pax];

fn header(style: Style) -> tar::Header {
    let mut h = match style {
        Style::Ustar | Style::Pax => tar::Header::new_ustar(),
        Style::Gnu => tar::Header::new_gnu(),
        Style::Old => tar::Header::new_old(),
    };
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h
}

fn add_file(b: &mut tar::Builder<Vec<u8>>, style: Style, path: &str, data: &[u8]) {
    let mut h = header(style);
    h.set_size(data.len() as u64);
    if let Style::Pax = style {
        b.append_pax_extensions([("path", path.as_bytes())]).unwrap();
        h.set_path("decoy.bin").unwrap();
        h.set_cksum();
        b.append(&h, data).unwrap();
    } else {
        b.append_data(&mut h, path, data).unwrap();
    }
}

fn add_dir(b: &mut tar::Builder<Vec<u8>>, path: &str) {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_mode(0o755);
    h.set_size(0);
    b.append_data(&mut h, path, &[][..]).unwrap();
}

fn add_symlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    b.append_link(&mut h, path, target).unwrap();
}

fn archive(members: &[(&str, &[u8])], style: Style) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in members {
        add_file(&mut b, style, path, data);
    }
    b.into_inner().unwrap()
}

/// A header block for `path` claiming `size` bytes, checksum set.
fn raw_header(path: &str, size: u64, kind: tar::EntryType) -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.set_path(path).unwrap();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_entry_type(kind);
    h.set_cksum();
    h.as_bytes().to_vec()
}

fn pad(bytes: &mut Vec<u8>) {
    bytes.resize(bytes.len().div_ceil(512) * 512, 0);
}

fn end_marker(bytes: &mut Vec<u8>) {
    pad(bytes);
    bytes.extend_from_slice(&[0; 1024]);
}

/// Indexes `bytes` both ways the daemon does (from a file, from a mapping), which must agree.
fn index(bytes: &[u8]) -> Result<TarIndex, TarError> {
    let from_reader = index_tar(Cursor::new(bytes), bytes.len() as u64);
    let from_memory = index_tar_bytes(bytes);
    assert_eq!(format!("{from_reader:?}"), format!("{from_memory:?}"), "indexing from memory disagrees");
    if let Ok(ix) = &from_reader {
        assert_eq!(format!("{ix:?}"), format!("{:?}", index_as_written(bytes, ix)), "indexing as written disagrees");
    }
    from_reader
}

/// Indexes `bytes` as `shardstream pack` does while writing: sample by sample (the samples `ix`
/// found), each payload cut out as if it were streamed from a file, so only headers are seen.
fn index_as_written(bytes: &[u8], ix: &TarIndex) -> TarIndex {
    let mut scan = ScanAsWritten::default();
    for i in 0..ix.num_samples() {
        let r = ix.sample_range(i).unwrap();
        let (start, end) = (r.start as usize, r.end as usize);
        let view = parse_sample(&bytes[start..end]).unwrap();
        let mut parts = Vec::new();
        let mut from = start;
        for m in &view.members {
            let (data_start, data_end) = (start + m.data.start, start + m.data.end);
            parts.push((from as u64, &bytes[from..data_start]));
            from = data_end;
        }
        parts.push((from as u64, &bytes[from..end]));
        scan.sample(r.start, r.end, &parts).unwrap();
    }
    scan.finish()
}

type Parsed = Vec<(String, Vec<(String, Vec<u8>)>)>;

/// Indexes `bytes` and parses every sample range, as the daemon does.
fn samples_of(bytes: &[u8]) -> Result<Parsed, TarError> {
    let ix = index(bytes)?;
    (0..ix.num_samples())
        .map(|i| {
            let r = ix.sample_range(i).unwrap();
            let buf = &bytes[r.start as usize..r.end as usize];
            let v = parse_sample(buf).map_err(|e| e.with_base(r.start))?;
            let members = v.members.iter().map(|m| (m.field.to_string(), buf[m.data.clone()].to_vec())).collect();
            Ok((v.key.to_string(), members))
        })
        .collect()
}

fn sample(key: &str, members: &[(&str, &[u8])]) -> (String, Vec<(String, Vec<u8>)>) {
    (key.to_owned(), members.iter().map(|(f, d)| (f.to_string(), d.to_vec())).collect())
}

#[test]
fn split_key_follows_webdataset() {
    let cases: &[(&str, Option<(&str, &str)>)] = &[
        ("dir/sub/abc.seg.png", Some(("dir/sub/abc", "seg.png"))),
        ("abc.jpg", Some(("abc", "jpg"))),
        ("v1.2/x.y/abc.tar.gz", Some(("v1.2/x.y/abc", "tar.gz"))),
        ("./abc.jpg", Some(("./abc", "jpg"))),
        ("__init__.py", Some(("__init__", "py"))),
        ("README", None),
        ("v1.2/README", None),
        (".hidden.jpg", None),
        ("dir/.hidden", None),
        ("abc.", None),
        ("dir.d/", None),
        ("", None),
        ("__meta__", None),
        ("__meta__/abc.json", None),
        ("données/é.txt", Some(("données/é", "txt"))),
    ];
    for (path, want) in cases {
        assert_eq!(split_key(path), *want, "{path}");
    }
    assert_eq!(normalize_field(Cow::Borrowed("JPG")), "jpg");
    assert!(matches!(normalize_field(Cow::Borrowed("seg.png")), Cow::Borrowed(_)));
    assert_eq!(normalize_field(Cow::Borrowed("ÉTÉ")), "été");
}

#[test]
fn groups_members_into_samples_and_skips_the_rest() {
    for style in STYLES {
        let mut b = tar::Builder::new(Vec::new());
        add_dir(&mut b, "a.d/");
        add_file(&mut b, style, "a.d/x1.jpg", b"JPG1");
        add_file(&mut b, style, "a.d/x1.cls", b"3");
        add_file(&mut b, style, "README", b"no dot: skipped");
        add_symlink(&mut b, "a.d/x1.lnk.jpg", "x1.jpg");
        add_file(&mut b, style, "a.d/x1.seg.png", b"PNG");
        add_file(&mut b, style, "v1.2/x2.JPG", b"");
        add_file(&mut b, style, "v1.2/.hidden.txt", b"hidden");
        add_file(&mut b, style, "__meta__/x3.json", b"meta");
        add_file(&mut b, style, "x3.json", b"{}");
        add_dir(&mut b, "trailing.d/");
        let bytes = b.into_inner().unwrap();
        let got = samples_of(&bytes).unwrap();
        assert_eq!(
            got,
            vec![
                sample("a.d/x1", &[("jpg", b"JPG1"), ("cls", b"3"), ("seg.png", b"PNG")]),
                sample("v1.2/x2", &[("jpg", b"")]),
                sample("x3", &[("json", b"{}")]),
            ],
            "{style:?}"
        );
        let ix = index(&bytes).unwrap();
        assert_eq!(ix.fields, ["cls", "jpg", "json", "seg.png"]);
        // The leading directory is in no sample; the trailing one neither.
        assert_eq!(ix.boundaries[0], 512, "{style:?}");
        let last_end = *ix.boundaries.last().unwrap();
        assert_eq!(last_end, bytes.len() as u64 - 1024 - 512, "{style:?}");
        assert!(ix.heap_bytes() >= 4 * 8 + 4 * size_of::<String>());
    }
}

#[test]
fn gnu_long_names_and_long_link_names() {
    let dir = "d".repeat(150);
    let long = format!("{dir}/deep.name.txt");
    let mut b = tar::Builder::new(Vec::new());
    add_file(&mut b, Style::Gnu, &long, b"long");
    add_symlink(&mut b, &format!("{dir}/link.txt"), &"t".repeat(200));
    add_file(&mut b, Style::Gnu, &format!("{dir}/deep.cls"), b"7");
    let bytes = b.into_inner().unwrap();
    assert_eq!(bytes[156], b'L', "the tar crate wrote a GNU long name");
    assert_eq!(
        samples_of(&bytes).unwrap(),
        vec![sample(&format!("{dir}/deep"), &[("name.txt", b"long"), ("cls", b"7")])]
    );
    // Long names are borrowed from the buffer too.
    let ix = index(&bytes).unwrap();
    let r = ix.sample_range(0).unwrap();
    let view = parse_sample(&bytes[r.start as usize..r.end as usize]).unwrap();
    assert!(matches!(view.key, Cow::Borrowed(_)));
}

#[test]
fn ustar_prefix_is_joined_to_the_name() {
    let path = format!("{}/{}/abc.jpg", "p".repeat(80), "q".repeat(60));
    let bytes = archive(&[(&path, b"x")], Style::Ustar);
    assert_ne!(bytes[345], 0, "the tar crate split the path into prefix and name");
    assert_eq!(samples_of(&bytes).unwrap(), vec![sample(&path[..path.len() - 4], &[("jpg", b"x")])]);
}

#[test]
fn pax_paths_and_sizes_override_the_header() {
    let mut b = tar::Builder::new(Vec::new());
    let long = format!("top/{}.txt", "p".repeat(300));
    add_file(&mut b, Style::Pax, &long, b"hello");
    add_file(&mut b, Style::Pax, "données/é.txt", b"utf8");
    // Two PAX headers: the path of the first survives a second without one.
    b.append_pax_extensions([("path", &b"two/x.a"[..])]).unwrap();
    b.append_pax_extensions([("mtime", &b"1.5"[..])]).unwrap();
    let mut h = header(Style::Ustar);
    h.set_path("decoy.bin").unwrap();
    h.set_size(1);
    h.set_cksum();
    b.append(&h, &b"1"[..]).unwrap();
    // ... and a later path wins over an earlier one.
    b.append_pax_extensions([("path", &b"two/y.a"[..])]).unwrap();
    b.append_pax_extensions([("path", &b"three/z.b"[..])]).unwrap();
    b.append(&h, &b"2"[..]).unwrap();
    // A Solaris 'X' header is a PAX header too.
    let mut x = raw_header("solaris", 18, tar::EntryType::new(b'X'));
    x.extend_from_slice(b"18 path=sol/s.txt\n");
    pad(&mut x);
    b.get_mut().extend_from_slice(&x);
    add_file(&mut b, Style::Ustar, "decoy.bin", b"sol");
    // The PAX size wins over the header's (0 here: the tar crate copies what it is given).
    b.append_pax_extensions([("size", &b"5"[..]), ("path", &b"sized.bin"[..])]).unwrap();
    let mut h0 = header(Style::Ustar);
    h0.set_path("decoy.bin").unwrap();
    h0.set_size(0);
    h0.set_cksum();
    b.append(&h0, &b"12345"[..]).unwrap();
    let bytes = b.into_inner().unwrap();
    assert_eq!(
        samples_of(&bytes).unwrap(),
        vec![
            sample(&long[..long.len() - 4], &[("txt", b"hello")]),
            sample("données/é", &[("txt", b"utf8")]),
            sample("two/x", &[("a", b"1")]),
            sample("three/z", &[("b", b"2")]),
            sample("sol/s", &[("txt", b"sol")]),
            sample("sized", &[("bin", b"12345")]),
        ]
    );
}

#[test]
fn pax_sparse_members_are_refused_by_name() {
    // A sparse member's stored bytes are a map and the data blocks, not the file: skipping it
    // lost the field (or the sample) without a word.
    let mut b = tar::Builder::new(Vec::new());
    add_file(&mut b, Style::Ustar, "plain.bin", b"data");
    b.append_pax_extensions([("GNU.sparse.major", &b"1"[..]), ("GNU.sparse.minor", &b"0"[..])]).unwrap();
    add_file(&mut b, Style::Ustar, "sparse.bin", b"map and data");
    let bytes = b.into_inner().unwrap();
    match index(&bytes) {
        Err(e @ TarError::Sparse { offset: 2048, .. }) => assert!(e.to_string().contains("'sparse.bin'"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn sparse_members_without_a_sample_name_are_skipped() {
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([("GNU.sparse.major", &b"1"[..]), ("GNU.sparse.minor", &b"0"[..])]).unwrap();
    add_file(&mut b, Style::Ustar, "README", b"map and data");
    add_file(&mut b, Style::Ustar, "plain.bin", b"data");
    let bytes = b.into_inner().unwrap();
    assert_eq!(samples_of(&bytes).unwrap(), vec![sample("plain", &[("bin", b"data")])]);
}

#[test]
fn gnu_sparse_members_are_refused_after_their_extension_blocks_are_checked() {
    let mut h = tar::Header::new_gnu();
    h.set_path("sparse.bin").unwrap();
    h.set_entry_type(tar::EntryType::GNUSparse);
    h.set_size(600);
    h.as_mut_bytes()[GNU_IS_EXTENDED] = 1;
    h.set_cksum();
    let mut bytes = h.as_bytes().to_vec();
    let mut extension = [0u8; 512];
    extension[GNU_EXTENSION_IS_EXTENDED] = 1;
    bytes.extend_from_slice(&extension);
    bytes.extend_from_slice(&[0; 512]); // the last extension block
    bytes.extend_from_slice(&[b'S'; 600]);
    pad(&mut bytes);
    let mut b = tar::Builder::new(bytes);
    add_file(&mut b, Style::Gnu, "ok.txt", b"ok");
    let bytes = b.into_inner().unwrap();
    assert!(matches!(index(&bytes), Err(TarError::Sparse { offset: 0, .. })), "{:?}", index(&bytes));
    assert!(matches!(index(&bytes[..1000]), Err(TarError::Truncated { offset: 512, .. })));
}

/// Appends a one-byte member named `name` as stored (bytes that need not be UTF-8): in a PAX
/// `path` record over a header naming `decoy`, or in the header's own name field.
fn add_raw_name(b: &mut tar::Builder<Vec<u8>>, style: Style, name: &[u8], decoy: &str) {
    let mut h = header(style);
    h.set_size(1);
    if let Style::Pax = style {
        b.append_pax_extensions([("path", name)]).unwrap();
        h.set_path(decoy).unwrap();
    } else {
        // The name field lies at the same place in every header style.
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
    }
    h.set_cksum();
    b.append(&h, &b"x"[..]).unwrap();
}

#[test]
fn member_names_that_are_not_utf8_are_refused_not_merged() {
    // Decoded lossily, b"caf\xe9" and b"caf\xe8" were one key: two samples served as one.
    for style in STYLES {
        let mut b = tar::Builder::new(Vec::new());
        add_file(&mut b, style, "ok.txt", b"ok");
        add_raw_name(&mut b, style, b"dir/caf\xe9.jpg", "decoy.bin");
        let bytes = b.into_inner().unwrap();
        match index(&bytes) {
            Err(e @ TarError::NotUtf8Name { .. }) => {
                assert!(e.to_string().contains(r"'dir/caf\xe9.jpg'"), "{style:?}: {e}");
            }
            other => panic!("{style:?}: {other:?}"),
        }
        match parse_sample(&bytes[1024..]) {
            Err(TarError::NotUtf8Name { .. }) => {}
            other => panic!("{style:?}: parse_sample gave {other:?}"),
        }
    }
}

#[test]
fn a_name_that_is_no_sample_member_is_skipped_whatever_its_bytes() {
    // A member without an extension names no field: the index skipped it, but parsing the
    // sample's bytes refused its non-UTF-8 name, so a shard indexed fine and failed at serve time
    // (found by libFuzzer's tar_index target). Both now skip it.
    for style in STYLES {
        let mut b = tar::Builder::new(Vec::new());
        add_file(&mut b, style, "k.txt", b"ok");
        add_raw_name(&mut b, style, b"dir/README\xe9", "decoy");
        // A member of the same sample after it: the stray member lies inside the sample's range.
        add_file(&mut b, style, "k.json", b"{}");
        let bytes = b.into_inner().unwrap();
        let ix = index(&bytes).unwrap_or_else(|e| panic!("{style:?}: {e}"));
        assert_eq!(ix.num_samples(), 1, "{style:?}");
        let range = ix.sample_range(0).unwrap();
        let view = parse_sample(&bytes[range.start as usize..range.end as usize])
            .unwrap_or_else(|e| panic!("{style:?}: parse_sample refused what the index took: {e}"));
        assert_eq!((view.key.as_ref(), view.members.len()), ("k", 2), "{style:?}");
    }
}

#[test]
fn v7_headers_old_regular_type_and_signed_checksums() {
    let mut bytes = Vec::new();
    // Typeflag '\0' (old regular file), v7 header without magic.
    let mut h = tar::Header::new_old();
    h.set_path("old.txt").unwrap();
    h.set_size(3);
    h.as_mut_bytes()[156] = 0;
    h.set_cksum();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(b"old");
    pad(&mut bytes);
    // An old regular file whose name ends in '/' is a directory.
    let mut d = tar::Header::new_old();
    d.as_mut_bytes()[..6].copy_from_slice(b"x.dir/");
    d.as_mut_bytes()[156] = 0;
    d.set_cksum();
    bytes.extend_from_slice(d.as_bytes());
    // A checksum computed with signed bytes, as some old tars did.
    let mut s = tar::Header::new_gnu();
    s.set_path("é.jpg").unwrap();
    s.set_size(2);
    s.set_entry_type(tar::EntryType::Regular);
    let block = s.as_mut_bytes();
    block[148..156].fill(b' ');
    let signed: i64 = block.iter().map(|&b| i64::from(b as i8)).sum();
    block[148..156].copy_from_slice(format!("{signed:06o}\0 ").as_bytes());
    bytes.extend_from_slice(block);
    bytes.extend_from_slice(b"jp");
    end_marker(&mut bytes);
    assert_eq!(samples_of(&bytes).unwrap(), vec![sample("old", &[("txt", b"old")]), sample("é", &[("jpg", b"jp")])]);
}

#[test]
fn base256_sizes() {
    let mut bytes = raw_header("b.bin", 0, tar::EntryType::Regular);
    bytes[124..136].copy_from_slice(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]);
    let mut h = tar::Header::from_byte_slice(&bytes).clone();
    h.set_cksum();
    let mut bytes = h.as_bytes().to_vec();
    bytes.extend_from_slice(b"abc");
    end_marker(&mut bytes);
    assert_eq!(samples_of(&bytes).unwrap(), vec![sample("b", &[("bin", b"abc")])]);

    assert_eq!(parse_number(b"0000644\0", 0, "x").unwrap(), 0o644);
    assert_eq!(parse_number(b"   12 \0", 0, "x").unwrap(), 0o12);
    assert_eq!(parse_number(b"\0\0\0", 0, "x").unwrap(), 0);
    assert_eq!(parse_number(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0], 0, "x").unwrap(), 0x1000);
    assert!(parse_number(b"12x4\0", 0, "x").is_err());
    assert!(parse_number(b"1 2\0", 0, "x").is_err());
    assert!(parse_number(&[0xC0, 0, 0, 0], 0, "x").is_err(), "negative");
    assert!(parse_number(&[0xBF; 12], 0, "x").is_err(), "overflow");
    assert!(parse_number(b"7777777777777777777777777", 0, "x").is_err(), "overflow");
}

#[test]
fn sizes_beyond_the_shard_are_errors_not_allocations() {
    // 10 GiB in base-256 (written so by the tar crate) and in a PAX record.
    let mut bytes = raw_header("big.bin", 10 << 30, tar::EntryType::Regular);
    assert_eq!(bytes[124] & 0x80, 0x80);
    end_marker(&mut bytes);
    let err = index(&bytes).unwrap_err();
    assert_eq!(err.to_string(), "member 'big.bin' at offset 0 claims 10737418240 bytes but the shard ends at 1536");

    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([("size", &b"18446744073709551615"[..])]).unwrap();
    add_file(&mut b, Style::Ustar, "huge.bin", b"");
    let bytes = b.into_inner().unwrap();
    assert!(matches!(index(&bytes), Err(TarError::PastEnd { offset: 1024, size: u64::MAX, .. })));

    // A GNU long name record claiming 8 GiB is refused before anything is read.
    let mut bytes = raw_header("././@LongLink", 8 << 30, tar::EntryType::GNULongName);
    end_marker(&mut bytes);
    let err = index(&bytes).unwrap_err();
    assert!(matches!(err, TarError::TooLong { offset: 0, limit: MAX_NAME_BYTES, .. }), "{err}");
    let mut bytes = raw_header("pax", MAX_PAX_BYTES + 1, tar::EntryType::XHeader);
    end_marker(&mut bytes);
    assert!(matches!(index(&bytes), Err(TarError::TooLong { .. })));
    // Within the cap but past the end of the shard.
    let mut bytes = raw_header("././@LongLink", 4000, tar::EntryType::GNULongName);
    end_marker(&mut bytes);
    let err = index(&bytes).unwrap_err();
    assert!(matches!(err, TarError::PastEnd { offset: 0, size: 4000, .. }), "{err}");
    assert!(err.to_string().contains("LongLink'"), "{err}");
}

#[test]
fn member_larger_than_the_shard() {
    let mut bytes = raw_header("x/abc.jpg", 5_000_000, tar::EntryType::Regular);
    bytes.extend_from_slice(&[7; 1000]);
    end_marker(&mut bytes);
    let err = index(&bytes).unwrap_err();
    assert_eq!(err.to_string(), "member 'x/abc.jpg' at offset 0 claims 5000000 bytes but the shard ends at 2560");
    // The same member seen by parse_sample, at shard offset 10240.
    let err = parse_sample(&bytes).unwrap_err().with_base(10240);
    assert_eq!(
        err.to_string(),
        "member 'x/abc.jpg' at offset 10240 claims 5000000 bytes but the sample's byte range ends at 12800"
    );
}

#[test]
fn prefetch_takes_any_sample_number() {
    // The packed gather prefetches a few records ahead of the one it copies, and the number it
    // passes may lie past the shard's last sample (or anywhere, from a bad id): a hint, never a
    // panic.
    let bytes = archive(&[("a.cls", b"1"), ("a.jpg", b"xy"), ("b.cls", b"2"), ("b.jpg", b"z")], Style::Ustar);
    let ix = index(&bytes).unwrap();
    assert!(ix.layout.is_some(), "the archive should have a layout");
    let before = ix.clone();
    for i in [0, 1, 2, 3, usize::MAX / 2, usize::MAX] {
        ix.prefetch(i);
        crate::format::ShardTable::Tar(ix.clone()).prefetch(i as u64);
    }
    crate::format::ShardTable::Tar(ix.clone()).prefetch(u64::MAX);
    assert_eq!(ix, before);
    assert_eq!(ix.sample_range(1), before.sample_range(1));
}

#[test]
fn empty_archives() {
    let empty = archive(&[], Style::Gnu);
    for bytes in [&empty[..], &[0; 512], &[0; 700]] {
        let ix = index(bytes).unwrap();
        assert_eq!((ix.num_samples(), ix.boundaries.len(), ix.sample_range(0)), (0, 0, None));
    }
    // A 0-byte file is no archive (an empty TAR is at least its end blocks): most likely a copy
    // that never got its bytes, which tarfile and webdataset refuse too.
    let err = index(&[]).unwrap_err().to_string();
    assert!(err.contains("empty") && err.contains("0 bytes"), "{err}");
    let mut b = tar::Builder::new(Vec::new());
    add_dir(&mut b, "only/");
    add_file(&mut b, Style::Ustar, "only/README", b"x");
    let bytes = b.into_inner().unwrap();
    assert_eq!(index(&bytes).unwrap(), TarIndex::default());
    assert_eq!(
        TarIndex { boundaries: vec![512], fields: vec![], layout: None, split_keys: Default::default() }.num_samples(),
        0
    );
    let ix = TarIndex { boundaries: vec![0, 1024, 512], fields: vec![], layout: None, split_keys: Default::default() };
    assert!(!ix.fits_shard(4096) && TarIndex::default().fits_shard(0));
    assert!(index(&bytes).unwrap().fits_shard(bytes.len() as u64));
}

#[test]
fn lenient_ends() {
    let bytes = archive(&[("k1.jpg", &[7; 3000]), ("k2.jpg", &[8; 3000])], Style::Ustar);
    let all = samples_of(&bytes).unwrap();
    assert_eq!(all.len(), 2);
    // No end-of-archive marker: EOF at a block boundary.
    assert_eq!(samples_of(&bytes[..7168]).unwrap(), all);
    // One zero block followed by EOF.
    assert_eq!(samples_of(&bytes[..7680]).unwrap(), all);
    // Cut at a header boundary: the members before it.
    assert_eq!(samples_of(&bytes[..3584]).unwrap(), all[..1]);
}

#[test]
fn truncated_archives() {
    // k1: header 0, data 512..3512; k2: header 3584, data 4096..7096.
    let bytes = archive(&[("k1.jpg", &[7; 3000]), ("k2.jpg", &[8; 3000])], Style::Ustar);
    let err = index(&bytes[..4196]).unwrap_err();
    assert_eq!(err.to_string(), "member 'k2.jpg' at offset 3584 claims 3000 bytes but the shard ends at 4196");
    // Data complete, padding missing: cut all the same.
    let err = index(&bytes[..7096]).unwrap_err();
    assert_eq!(err.to_string(), "truncated archive at offset 7096: the data ends inside the padding after a payload");
    let r = index(&bytes).unwrap().sample_range(1).unwrap();
    assert!(matches!(parse_sample(&bytes[r.start as usize..7096]), Err(TarError::Truncated { offset: 3512, .. })));
    let err = index(&bytes[..3684]).unwrap_err();
    assert!(matches!(err, TarError::Truncated { offset: 3584, .. }), "{err}");
    assert_eq!(err.to_string(), "truncated archive at offset 3584: the data ends inside a header");
    // The listing says more bytes than the reader has.
    let err = index_tar(Cursor::new(&bytes[..4000]), bytes.len() as u64).unwrap_err();
    assert!(matches!(err, TarError::Truncated { offset: 3584, .. }), "{err}");
    // Extension headers with no member after them.
    let mut b = tar::Builder::new(Vec::new());
    add_file(&mut b, Style::Ustar, "a.txt", b"a");
    b.append_pax_extensions([("path", &b"b.txt"[..])]).unwrap();
    let bytes = b.into_inner().unwrap();
    assert!(matches!(index(&bytes), Err(TarError::Truncated { offset: 1024, .. })));
    assert!(matches!(index(&bytes[..2048]), Err(TarError::Truncated { offset: 1024, .. })));
}

#[test]
fn corrupt_headers() {
    let bytes = archive(&[("k1.jpg", &[7; 3000]), ("k2.jpg", &[8; 3000])], Style::Gnu);
    let mut bad = bytes.clone();
    bad[3584 + 10] ^= 0x55;
    let err = index(&bad).unwrap_err();
    assert!(matches!(err, TarError::BadChecksum { offset: 3584 }), "{err}");
    assert_eq!(err.to_string(), "bad header checksum at offset 3584: the archive is corrupt");
    assert_eq!(err.with_base(100).offset(), Some(3684));
    // In the first header: not a TAR at all.
    let mut bad = bytes.clone();
    bad[0] ^= 0x55;
    assert!(matches!(index(&bad), Err(TarError::NotTar { offset: 0, .. })));
    // ... but inside a sample it is a bad checksum.
    assert!(matches!(parse_sample(&bad), Err(TarError::BadChecksum { offset: 0 })));
    // A size field that is not a number.
    let mut h = tar::Header::from_byte_slice(&bytes[3584..4096]).clone();
    h.as_mut_bytes()[124..136].copy_from_slice(b"0000000x000\0");
    h.set_cksum();
    let mut bad = bytes.clone();
    bad[3584..4096].copy_from_slice(h.as_bytes());
    let err = index(&bad).unwrap_err();
    assert_eq!(err.to_string(), "malformed size field in the header at offset 3584");
}

#[test]
fn malformed_pax_records() {
    for (record, reason) in [
        (&b"zz path=a\n"[..], "record length is not a decimal number"),
        (b"path=a\n", "record without a length"),
        (b"99 path=a\n", "record runs past the end of the header"),
        (b"8 path=a\n", "record does not end with a newline where its length says"),
        (b"7 =abc\n", "record without a key"),
        (b"11 size=-1\n", "size is not a decimal number"),
    ] {
        let mut bytes = raw_header("pax", record.len() as u64, tar::EntryType::XHeader);
        bytes.extend_from_slice(record);
        pad(&mut bytes);
        bytes.extend(raw_header("a.txt", 0, tar::EntryType::Regular));
        end_marker(&mut bytes);
        let err = index(&bytes).unwrap_err();
        assert!(matches!(err, TarError::BadPax { offset: 512, reason: r } if r == reason), "{err}");
    }
}

#[test]
fn garbage_is_not_a_tar() {
    let garbage = b"definitely not a tar file".repeat(50);
    for bytes in [&garbage[..], &garbage[..10]] {
        let err = index(bytes).unwrap_err();
        assert!(matches!(err, TarError::NotTar { offset: 0, .. }), "{err}");
        assert!(err.to_string().starts_with("not a TAR file"), "{err}");
    }
}

#[test]
fn duplicate_fields_are_errors() {
    let bytes = archive(&[("a.jpg", b"1"), ("a.JPG", b"2")], Style::Ustar);
    let err = index(&bytes).unwrap_err();
    assert_eq!(err.to_string(), "sample 'a' has a second 'jpg' member at offset 1024");
    assert!(matches!(parse_sample(&bytes), Err(TarError::DuplicateField { offset: 1024, .. })));
    // The same field in the next sample is fine.
    let bytes = archive(&[("a.jpg", b"1"), ("b.jpg", b"2"), ("a.jpg", b"3")], Style::Ustar);
    assert_eq!(index(&bytes).unwrap().num_samples(), 3);
}

#[test]
fn parse_sample_checks_its_range() {
    let bytes = archive(&[("a.jpg", b"1"), ("b.jpg", b"2")], Style::Ustar);
    let err = parse_sample(&bytes).unwrap_err();
    assert_eq!(
        err.to_string(),
        "member 'b.jpg' at offset 1024 does not belong to sample 'a' whose byte range it is in"
    );
    assert_eq!(err.with_base(4096).offset(), Some(5120));
    assert!(matches!(parse_sample(&[]), Err(TarError::NoMembers { offset: 0 })));
    let mut b = tar::Builder::new(Vec::new());
    add_dir(&mut b, "d/");
    let bytes = b.into_inner().unwrap();
    assert!(matches!(parse_sample(&bytes[..512]), Err(TarError::NoMembers { .. })));
    // A range that starts mid-payload.
    let bytes = archive(&[("a.jpg", &[1; 1000])], Style::Ustar);
    assert!(matches!(parse_sample(&bytes[512..]), Err(TarError::BadChecksum { offset: 0 })));
    assert!(parse_sample(&bytes[..700]).is_err());
}

#[test]
fn parse_sample_borrows_names_and_payloads() {
    let bytes = archive(&[("dir/k.jpg", b"JPEG"), ("dir/k.seg.png", b"PNG!")], Style::Ustar);
    let ix = index(&bytes).unwrap();
    let r = ix.sample_range(0).unwrap();
    let buf = &bytes[r.start as usize..r.end as usize];
    let view = parse_sample(buf).unwrap();
    assert!(matches!(view.key, Cow::Borrowed("dir/k")));
    assert!(view.members.iter().all(|m| matches!(m.field, Cow::Borrowed(_))));
    assert_eq!(view.members[0].data, 512..516);
    assert_eq!(&buf[view.members[1].data.clone()], b"PNG!");
}

/// Counts bytes read, to show that indexing skips payloads.
struct Counting<R> {
    inner: R,
    read: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

impl<R: Seek> Seek for Counting<R> {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(pos)
    }
}

#[test]
fn indexing_reads_only_headers() {
    let big = vec![1u8; 1 << 20];
    let mut b = tar::Builder::new(Vec::new());
    for i in 0..8 {
        add_file(&mut b, Style::Gnu, &format!("s{i}.bin"), &big);
        add_file(&mut b, Style::Pax, &format!("s{i}.txt"), &big[..5000]);
    }
    add_file(&mut b, Style::Gnu, &format!("{}/s8.bin", "x".repeat(200)), &big);
    let bytes = b.into_inner().unwrap();
    let mut r = Counting { inner: Cursor::new(&bytes), read: 0 };
    let ix = index_tar(&mut r, bytes.len() as u64).unwrap();
    assert_eq!(ix.num_samples(), 9);
    // 17 member headers, 8 PAX headers and their records, 1 long name header and record, the
    // end marker: 26 members' worth of at most 2 blocks each.
    assert!(r.read <= 26 * 2 * 512, "read {} bytes of a {} byte shard", r.read, bytes.len());
    // A BufReader gives the same index.
    let buffered = index_tar(std::io::BufReader::new(Cursor::new(&bytes)), bytes.len() as u64).unwrap();
    assert_eq!(buffered, ix);
}

/// A member of a generated archive: a sample member, or something to skip.
#[derive(Clone, Debug)]
enum Gen {
    File { path: String, data: Vec<u8>, style: Style },
    Dir,
    NoDot,
    Link,
}

fn build(members: &[Gen]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for m in members {
        match m {
            Gen::File { path, data, style } => add_file(&mut b, *style, path, data),
            Gen::Dir => add_dir(&mut b, "some.dir/"),
            Gen::NoDot => add_file(&mut b, Style::Gnu, "dir.d/NODOT", b"skipped"),
            Gen::Link => add_symlink(&mut b, "l.jpg", "target.jpg"),
        }
    }
    b.into_inner().unwrap()
}

type GenSample = (String, String, Vec<(String, usize, Style)>, Vec<Gen>);

fn samples_strategy() -> impl Strategy<Value = Vec<GenSample>> {
    let field = prop::sample::select(vec!["jpg", "JPG", "cls", "seg.png", "json", "tar.gz", "x"]);
    let skipped = prop::sample::select(vec![Gen::Dir, Gen::NoDot, Gen::Link]);
    let style = prop::sample::select(STYLES.to_vec());
    prop::collection::vec(
        (
            // Directories with dots; some long enough to need a prefix or a long name.
            prop_oneof!["", "[a-z][a-z.]{0,6}/", "[a-z]{90,130}/[a-z][a-z.]{0,19}/"],
            "[a-z0-9_-]{1,12}",
            prop::collection::vec((field.prop_map(str::to_owned), prop_oneof![0usize..3, 0usize..1500], style), 1..5),
            prop::collection::vec(skipped, 0..2),
        ),
        0..12,
    )
}

/// The members of generated samples, and what reading them must give.
fn generate(samples: Vec<GenSample>) -> (Vec<Gen>, Parsed, BTreeSet<String>) {
    let mut members = Vec::new();
    let mut expected: Parsed = Vec::new();
    let mut fields = BTreeSet::new();
    for (i, (dir, stem, sample_fields, skipped)) in samples.into_iter().enumerate() {
        let key = format!("{dir}{stem}_{i}"); // consecutive samples never share a key
        let mut exp: Vec<(String, Vec<u8>)> = Vec::new();
        for (field, len, style) in sample_fields {
            let lower = field.to_lowercase();
            if exp.iter().any(|(f, _)| *f == lower) {
                continue;
            }
            let data: Vec<u8> = (0..len).map(|j| (j * 7 + i) as u8).collect();
            exp.push((lower.clone(), data.clone()));
            fields.insert(lower);
            members.push(Gen::File { path: format!("{key}.{field}"), data, style });
        }
        members.extend(skipped);
        expected.push((key, exp));
    }
    (members, expected, fields)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_archives_round_trip(samples in samples_strategy()) {
        let (members, expected, fields) = generate(samples);
        let bytes = build(&members);
        let ix = index(&bytes).unwrap();
        prop_assert_eq!(ix.fields.iter().cloned().collect::<BTreeSet<_>>(), fields);
        prop_assert_eq!(ix.boundaries.windows(2).filter(|w| w[0] < w[1]).count(), ix.num_samples());
        prop_assert_eq!(samples_of(&bytes).unwrap(), expected);
        // The layout recorded while indexing says what parsing each sample says.
        let layout = ix.layout.as_ref();
        // Only a key split over a ustar `prefix` (a path over 100 bytes) cannot be recorded.
        let split = members.iter().any(|m| matches!(m, Gen::File { style: Style::Ustar, path, .. } if path.len() > 100));
        prop_assert!(layout.is_some() || split || ix.num_samples() == 0, "no layout");
        if let Some(layout) = layout {
            prop_assert!(ix.fits_shard(bytes.len() as u64));
            for i in 0..ix.num_samples() {
                let r = ix.sample_range(i).unwrap();
                let buf = &bytes[r.start as usize..r.end as usize];
                let view = parse_sample(buf).unwrap();
                prop_assert_eq!(&buf[layout.key(i).unwrap()], view.key.as_bytes());
                for (f, name) in ix.fields.iter().enumerate() {
                    let want = view.members.iter().find(|m| m.field == name.as_str()).map(|m| m.data.clone());
                    prop_assert_eq!(layout.field(i, f).unwrap(), want);
                }
            }
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..3000), claimed in 0u64..10_000) {
        let _ = index(&bytes);
        let _ = index_tar(Cursor::new(&bytes), claimed);
        let _ = parse_sample(&bytes);
    }

    #[test]
    fn damaged_archives_never_panic(
        samples in samples_strategy(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..8),
        extra_len in 0u64..5000,
    ) {
        let (members, _, _) = generate(samples);
        let mut bytes = build(&members);
        for (at, x) in flips {
            let at = at.index(bytes.len());
            bytes[at] ^= x;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let _ = index(&bytes);
        for claimed in [bytes.len() as u64, bytes.len() as u64 + extra_len] {
            if let Ok(ix) = index_tar(Cursor::new(&bytes), claimed) {
                for i in 0..ix.num_samples() {
                    let r = ix.sample_range(i).unwrap();
                    prop_assert!(r.start <= r.end && r.end <= claimed);
                    if let Some(buf) = bytes.get(r.start as usize..r.end as usize)
                        && let Ok(view) = parse_sample(buf)
                    {
                        for m in &view.members {
                            prop_assert!(m.data.end <= buf.len());
                        }
                    }
                }
            }
        }
        let _ = parse_sample(&bytes);
    }
}

#[test]
fn a_shard_of_more_distinct_fields_than_a_shard_may_have_is_refused_naming_the_member() {
    // Members `s.f0000` .. of one sample: each its own field.
    let names: Vec<String> = (0..=MAX_SHARD_FIELDS).map(|f| format!("s.f{f:04}")).collect();
    let members: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b""[..])).collect();
    let most = archive(&members[..MAX_SHARD_FIELDS], Style::Gnu);
    assert_eq!(index(&most).unwrap().fields.len(), MAX_SHARD_FIELDS);
    let too_many = archive(&members, Style::Gnu);
    let e = index(&too_many).unwrap_err();
    assert!(matches!(&e, TarError::TooManyFields { name, .. } if name == "s.f1024"), "{e:?}");
    assert_eq!(e.offset(), Some(512 * MAX_SHARD_FIELDS as u64));
}

#[test]
fn a_shard_whose_layout_would_be_mostly_empty_slots_has_none_and_parses_per_sample() {
    // One sample of 600 fields, then 2,000 samples of one: a layout would hold 2,001 x 1,202
    // slots for 4,601 locations.
    let mut names: Vec<String> = (0..600).map(|f| format!("wide.f{f:03}")).collect();
    names.extend((0..2000).map(|i| format!("n{i:04}.f000")));
    let members: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"x"[..])).collect();
    let bytes = archive(&members, Style::Gnu);
    let ix = index(&bytes).unwrap();
    assert_eq!((ix.num_samples(), ix.fields.len()), (2001, 600));
    assert!(ix.layout.is_none());
    let parsed = samples_of(&bytes).unwrap();
    assert_eq!(parsed[0].1.len(), 600);
    assert_eq!(parsed[2000], ("n1999".into(), vec![("f000".into(), b"x".to_vec())]));
    // Samples of one of 100 optional fields each keep theirs, as do fields every sample shares.
    let optional: Vec<String> = (0..300).map(|i| format!("s{i:03}.f{:02}", i % 100)).collect();
    let members: Vec<(&str, &[u8])> = optional.iter().map(|n| (n.as_str(), &b"x"[..])).collect();
    assert!(index(&archive(&members, Style::Gnu)).unwrap().layout.is_some());
    let shared: Vec<String> = (0..50).flat_map(|i| [format!("s{i:02}.cls"), format!("s{i:02}.jpg")]).collect();
    let members: Vec<(&str, &[u8])> = shared.iter().map(|n| (n.as_str(), &b"x"[..])).collect();
    assert!(index(&archive(&members, Style::Gnu)).unwrap().layout.is_some());
}

#[test]
fn a_shard_compressed_whole_says_so() {
    // A .tgz picked by a pattern (or renamed .tar) said only "no valid TAR header at offset 0".
    let body = b"x".repeat(600);
    for (magic, kind) in [
        (&[0x1f, 0x8b, 0x08][..], "gzip"),
        (&[0x28, 0xb5, 0x2f, 0xfd][..], "zstd"),
        (b"BZh9", "bzip2"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0][..], "xz"),
    ] {
        let bytes = [magic, &body[..]].concat();
        let err = index(&bytes).unwrap_err();
        assert!(matches!(err, TarError::NotTar { offset: 0, .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("{kind}-compressed")) && text.contains("uncompressed"), "{text}");
    }
    let err = index(&b"definitely not a tar file".repeat(50)).unwrap_err().to_string();
    assert!(!err.contains("compressed"), "{err}");
}

#[test]
fn keys_that_come_back_after_others_are_counted() {
    // `tar cf` of a directory orders members as the file system lists them: a sample's files
    // apart, each run then a sample of its own.
    let shard = |names: &[&str]| {
        let mut b = tar::Builder::new(Vec::new());
        for n in names {
            add_file(&mut b, Style::Ustar, n, b"x");
        }
        b.into_inner().unwrap()
    };
    let apart = index(&shard(&["d/a.jpg", "d/b.jpg", "d/a.cls", "d/c.jpg", "d/b.cls", "d/c.cls"])).unwrap();
    assert_eq!(apart.num_samples(), 6);
    assert_eq!(apart.split_keys, SplitKeys { count: 3, first: Some("d/a".into()) });
    let together = index(&shard(&["d/a.cls", "d/a.jpg", "d/b.cls", "d/b.jpg"])).unwrap();
    assert_eq!((together.num_samples(), together.split_keys), (2, SplitKeys::default()));
    // The same walk from memory.
    assert_eq!(index_tar_bytes(&shard(&["a.x", "b.x", "a.y"])).unwrap().split_keys.count, 1);
}
