//! The bodies of shardstream's fuzz targets: each takes arbitrary bytes, feeds them to one reader
//! of untrusted input, and checks what must hold for every input, not only for well-formed ones:
//!
//! - no panic (a panic in the daemon on a bad shard or a bad client message is a bug: the daemon
//!   answers with a named error instead);
//! - no allocation out of proportion to the input (the fuzzers run with a malloc limit; the plain
//!   `cargo test` runner in `server/tests/fuzz_targets.rs` counts the largest allocation);
//! - what a reader accepts is self-consistent: every range it returns lies inside the input, and
//!   what it accepted re-encodes to something it accepts again, unchanged.
//!
//! The same functions run under libFuzzer (`make fuzz`, `fuzz/fuzz_targets/*.rs`) and as ordinary
//! tests over the committed seeds (`fuzz/seeds/<target>/`) plus generated inputs (`make test`), so
//! a toolchain without libFuzzer support still exercises them.

use std::io::Cursor;

use arrow_array::Array;
use arrow_array::cast::AsArray;
use arrow_schema::DataType;
use shardstream::format::parquet::{
    ParquetError, ParquetTable, Projection, decode, direct, footer, footers, partitions, pqidx,
};
use shardstream::format::{sidecar, tar};
use shardstream::index::manifest::Manifest;
use shardstream::pack::journal;
use shardstream_proto::ring::{self, RingHeader, SLOT_HEADER_BYTES};
use shardstream_proto::shm::{FRAME_BYTES, Frame};

/// A target's body: panics on a finding.
pub type Target = fn(&[u8]);

/// The targets, by name (the names of `fuzz/fuzz_targets/*.rs` and `fuzz/seeds/*/`).
pub const TARGETS: &[(&str, Target)] = &[
    ("tar_index", tar_index),
    ("tar_sample", tar_sample),
    ("sidecar", sidecar),
    ("manifest", manifest),
    ("shm_frame", shm_frame),
    ("ring", ring),
    ("journal", journal),
    ("parquet_footer", parquet_footer),
    ("parquet_footers", parquet_footers),
    ("parquet_row_group", parquet_row_group),
];

/// `index_tar` over a whole shard; every sample it finds must then parse with `parse_sample` (the
/// daemon indexes a shard once and parses each sample when it serves it: a shard that indexes but
/// whose samples do not parse fails mid-epoch).
pub fn tar_index(data: &[u8]) {
    let from_reader = tar::index_tar(Cursor::new(data), data.len() as u64);
    // The daemon indexes node-cache copies from their mapping: the same answer, error or not.
    let from_memory = tar::index_tar_bytes(data);
    assert_eq!(format!("{from_reader:?}"), format!("{from_memory:?}"), "indexing from memory disagrees");
    let Ok(index) = from_reader else { return };
    assert!(index.fits_shard(data.len() as u64), "index does not fit its shard: {index:?}");
    assert!(index.boundaries.windows(2).all(|w| w[0] <= w[1]), "boundaries go back: {index:?}");
    for i in 0..index.num_samples() {
        let r = index.sample_range(i).expect("a sample below num_samples has a range");
        let buf = &data[r.start as usize..r.end as usize];
        match tar::parse_sample(buf) {
            Ok(view) => {
                check_view(&view, buf.len());
                // What the index recorded (and clients slice without parsing) is what parsing says.
                if let Some(layout) = &index.layout {
                    let key = layout.key(i).expect("a sample below num_samples has a key");
                    assert_eq!(buf.get(key), Some(view.key.as_bytes()), "sample {i}: layout key");
                    for (f, name) in index.fields.iter().enumerate() {
                        let want = view.members.iter().find(|m| m.field == name.as_str()).map(|m| m.data.clone());
                        assert_eq!(layout.field(i, f), Some(want), "sample {i}: layout of field {name}");
                    }
                }
            }
            Err(e) => panic!("sample {i} ({r:?}) was indexed but does not parse: {e}"),
        }
    }
    // A shorter shard_len than the data (the listing's size is what bounds reads) must not read past it.
    let half = data.len() as u64 / 2;
    if let Ok(index) = tar::index_tar(Cursor::new(data), half) {
        assert!(index.fits_shard(half), "index past shard_len {half}: {index:?}");
    }
}

/// `parse_sample` over one sample's bytes (as read by the daemon for every delivered sample).
pub fn tar_sample(data: &[u8]) {
    if let Ok(view) = tar::parse_sample(data) {
        check_view(&view, data.len());
    }
}

fn check_view(view: &tar::SampleView<'_>, len: usize) {
    for m in &view.members {
        assert!(m.data.start <= m.data.end && m.data.end <= len, "member {m:?} outside {len} bytes");
    }
}

/// The identity the sidecar harness expects (any fixed bytes: the check is for equality).
const IDENTITY: &[u8] = b"len=4096;crc32c=00000001";

/// Sidecar decoding. The input is the body after the identity: the harness adds magic, version,
/// identity and a valid CRC, so the fuzzer spends its time on the structure, not on the checksum.
/// The raw input is decoded too (magic, version and CRC checks).
pub fn sidecar(data: &[u8]) {
    let _ = sidecar::decode(data, IDENTITY);
    let mut file = sidecar::MAGIC.to_vec();
    file.extend_from_slice(&sidecar::SIDECAR_VERSION.to_le_bytes());
    file.push(IDENTITY.len() as u8); // a one-byte varint: IDENTITY is shorter than 128 bytes
    file.extend_from_slice(IDENTITY);
    file.extend_from_slice(data);
    let crc = crc32c::crc32c(&file);
    file.extend_from_slice(&crc.to_le_bytes());
    if let Ok(Some(index)) = sidecar::decode(&file, IDENTITY) {
        let again = sidecar::decode(&sidecar::encode(IDENTITY, &index), IDENTITY);
        assert_eq!(again.ok().flatten().as_ref(), Some(&index), "a decoded sidecar does not round-trip");
    }
}

/// `manifest.json` parsing and validation; an accepted manifest serialises to one that is accepted
/// and equal.
pub fn manifest(data: &[u8]) {
    let Ok(m) = Manifest::parse(data, "fuzz") else { return };
    for s in &m.shards {
        // What the daemon trusts before a stream opens: the recorded largest sample is in the shard.
        if let Some(l) = s.largest() {
            assert!(l.local < s.samples && l.bytes <= s.bytes, "{s:?}");
        }
        assert_eq!(s.largest().is_some(), s.max_sample.is_some() || s.max_sample_bytes.is_some(), "{s:?}");
    }
    let json = m.to_json().expect("an accepted manifest serialises");
    let again = Manifest::parse(&json, "fuzz (re-serialised)").expect("a re-serialised manifest parses");
    assert_eq!(again, m);
    // An accepted manifest's names may be partition paths: their keys are read from them when a
    // Parquet dataset is built, and every file then has one value per key.
    let names: Vec<&str> = m.shards.iter().map(|s| s.name.as_str()).collect();
    if let Ok(Some(p)) = partitions::Partitions::of(&names, "/d/") {
        for i in 0..names.len() {
            assert_eq!(p.values(i).len(), p.fields().len(), "{names:?}");
        }
    }
}

/// The pack journal (`_shardstream/pack-journal.jsonl`, read back from a local directory or a
/// bucket to resume a pack): what it keeps is a contiguous run of shards from position 0, which
/// is what the resume logic assumes.
pub fn journal(data: &[u8]) {
    let Ok(prior) = journal::parse(data, "fuzz") else { return };
    let mut next = 0;
    for (k, rec) in prior.shards.iter().enumerate() {
        assert_eq!(rec.shard, k as u64);
        assert_eq!(rec.first, next, "shard {k} does not start where the previous one ended");
        assert!(rec.end >= rec.first);
        next = rec.end;
    }
}

/// Side-channel frames (what the client's receiver thread and the daemon's session read from the
/// socket): decode, and an accepted frame encodes to the same bytes.
pub fn shm_frame(data: &[u8]) {
    let Ok(frame) = Frame::decode(data) else { return };
    assert_eq!(data.len(), FRAME_BYTES);
    assert_eq!(&frame.encode()[..], data);
    let _ = frame.message();
    let _ = frame.token();
    // An error frame carries a prefix of its message, cut at a character boundary.
    let text = String::from_utf8_lossy(data);
    let sent = Frame::error(frame.a, &text).message();
    assert!(text.contains('\0') || text.starts_with(&sent), "{sent:?} is not a prefix of {text:?}");
}

/// Packed-mode ring segments (mapped read-only by the client): the ring header, then every slot it
/// describes (as many as fit the input), each checked with the slot's own batch index and field
/// count so the checks past those two run. The input is also read as a lone slot.
pub fn ring(data: &[u8]) {
    read_slot_as_written(data, 0);
    let Ok(header) = RingHeader::decode(data) else { return };
    let segment = header.segment_bytes().expect("a decoded ring's geometry does not overflow");
    assert!(segment <= data.len() as u64);
    for k in 0..header.slot_count.min(64) {
        let r = header.slot_range(k).expect("a slot below slot_count has a range");
        assert!(r.end <= data.len(), "slot {k} ({r:?}) outside the segment of {} bytes", data.len());
        read_slot_as_written(&data[r], k);
    }
    assert!(header.slot_range(header.slot_count).is_none());
}

fn read_slot_as_written(slot: &[u8], k: u32) {
    let Some(head) = slot.get(..SLOT_HEADER_BYTES).and_then(|h| <&[u8; SLOT_HEADER_BYTES]>::try_from(h).ok()) else {
        assert!(ring::read_slot(slot, k, 0, 0).is_err());
        return;
    };
    let written = ring::SlotHeader::decode(head);
    let n_fields = usize::from(written.n_fields);
    if let Ok(view) = ring::read_slot(slot, k, written.batch_index, n_fields) {
        assert_eq!(view.fields.len(), n_fields);
        for f in &view.fields {
            let c = f.column().expect("an accepted column does not overflow");
            assert!(c.end <= slot.len() as u64, "column {c:?} outside the slot of {} bytes", slot.len());
        }
    }
}

/// The footer of a Parquet file read from its tail as the daemon reads it, and its decoded table;
/// None when either is refused.
fn parquet_table(data: &[u8]) -> Option<(Vec<u8>, ParquetTable)> {
    let len = data.len() as u64;
    let read = |off: u64, buf: &mut [u8]| {
        let src = usize::try_from(off).ok().and_then(|o| data.get(o..o.checked_add(buf.len())?));
        buf.copy_from_slice(src.expect("the footer reader reads inside the file"));
        Ok(())
    };
    let foot = footer::read_footer(len, read).ok()?;
    assert!(foot.len() as u64 + footer::MIN_FILE_BYTES <= len, "a footer longer than its file allows");
    let table = ParquetTable::decode(&foot, len).ok()?;
    Some((foot, table))
}

/// A whole Parquet file, as the daemon indexes it: the footer from the tail (one or two reads),
/// its decoded table (every chunk range inside the file's data region), the sidecar round trip
/// and the projection of every column. The footer path must not even panic internally (its own
/// checks run before arrow-rs can assert on damaged metadata), so a panic caught by
/// `format::parquet::no_panic` here is a finding too: libFuzzer aborts on any panic, and the plain
/// runner counts them. The page path is [`parquet_row_group`]'s.
pub fn parquet_footer(data: &[u8]) {
    let len = data.len() as u64;
    let Some((foot, table)) = parquet_table(data) else { return };
    let leaves = table.reader_metadata().parquet_schema().num_columns();
    for rg in 0..table.num_row_groups() {
        for c in 0..leaves {
            // A row group of no rows has its chunks unchecked and never read (pyarrow writes
            // them with data pages at offset 0): no range.
            if table.row_group_rows(rg) == 0 {
                assert_eq!(table.chunk_range(rg, c), None, "an empty row group's chunk has a range");
                continue;
            }
            let r = table.chunk_range(rg, c).expect("a checked table has every chunk range");
            assert!(r.start >= 4 && r.end <= len - 8 - foot.len() as u64, "chunk {r:?} outside the data");
        }
    }
    let mut starts = 0;
    for rg in 0..table.num_row_groups() {
        let span = table.row_group_span(rg).expect("a row group below the count has a span");
        assert_eq!(span.start, starts);
        starts = span.end;
    }
    assert_eq!(starts, table.num_rows());
    // Each top-level column taken for a partition key the files hold too: its statistics, as
    // the file claims them, are compared with a directory's value, never trusted to be sane.
    for f in table.schema().fields() {
        for value in [Some("1"), Some("x"), None] {
            let _ = partitions::check_key_column(&table, f.name(), value);
        }
    }
    let idx = pqidx::encode(b"fuzz", len, &foot);
    let again = pqidx::load(&idx, b"fuzz").expect("a sidecar of an accepted footer loads").expect("same identity");
    assert_eq!((again.num_rows(), again.num_row_groups()), (table.num_rows(), table.num_row_groups()));
    if let Ok(proj) = Projection::new(table.schema(), &[], None) {
        // A file agrees with its own schema; a codec this build does not decode is refused here.
        let fp = match proj.for_file(&table, &[]) {
            Ok(fp) => fp,
            Err(ParquetError::UnsupportedCodec { .. }) => return,
            Err(e) => panic!("a file disagrees with its own schema: {e}"),
        };
        for rg in 0..table.num_row_groups().min(16) {
            let ranges = decode::chunk_ranges(&table, rg, &fp);
            assert!(ranges.windows(2).all(|w| w[0].end < w[1].start), "ranges overlap: {ranges:?}");
        }
    }
}

/// The footers bundle of a dataset (`format::parquet::footers`), as given and behind a valid
/// header and checksum (so that the structure past them is explored); an accepted bundle
/// re-encodes to one that decodes to the same entries.
pub fn parquet_footers(data: &[u8]) {
    let _ = footers::decode(data);
    let mut bundle = footers::MAGIC.to_vec();
    bundle.extend_from_slice(&footers::VERSION.to_le_bytes());
    bundle.extend_from_slice(data);
    let crc = crc32c::crc32c(&bundle);
    bundle.extend_from_slice(&crc.to_le_bytes());
    let Ok(entries) = footers::decode(&bundle) else { return };
    for (name, sidecar) in &entries {
        let range = sidecar.as_ptr() as usize..sidecar.as_ptr() as usize + sidecar.len();
        let inside = bundle.as_ptr() as usize..bundle.as_ptr() as usize + bundle.len();
        assert!(range.start >= inside.start && range.end <= inside.end, "{name}: a sidecar outside the bundle");
        // What the daemon does with each entry: a damaged one is an error, never a panic.
        let _ = pqidx::load(sidecar, b"fuzz");
    }
    let again = footers::encode(entries.iter().map(|(n, s)| (*n, *s))).expect("accepted entries re-encode");
    assert_eq!(footers::decode(&again).expect("a re-encoded bundle decodes"), entries);
}

/// Row groups of a Parquet file decoded the daemon's way (`decode::read_row_group`, arrow-rs under
/// `catch_unwind`): all columns, and the flat ones alone with bytes as views (what a flat
/// projection decodes to), then gathered into a slot's bytes by `direct`. When every column is
/// flat the two are one projection, decoded once (as views). Pages are not checksummed, so damaged
/// values may decode; what must hold is that a damaged page is an error, never a panic, an abort
/// or an allocation out of proportion, and that what decodes has the footer's row count and the
/// projection's schema, and reads the same in the slot as decoded.
pub fn parquet_row_group(data: &[u8]) {
    let Some((_, table)) = parquet_table(data) else { return };
    let read_at = |off: u64, n: usize| {
        let src = usize::try_from(off).ok().and_then(|o| data.get(o..o.checked_add(n)?));
        src.map(<[u8]>::to_vec).ok_or_else(|| ParquetError::Truncated(format!("{n} bytes at {off}")))
    };
    let Ok(all) = Projection::new(table.schema(), &[], None) else { return };
    // A codec this build does not decode is refused here, before any page is read.
    let all_fp = match all.for_file(&table, &[]) {
        Ok(fp) => fp,
        Err(ParquetError::UnsupportedCodec { .. }) => return,
        Err(e) => panic!("a file disagrees with its own schema: {e}"),
    };
    // The page checksums a column-chunk copy's fetch checks: over the copy made of the file's
    // bytes (pieces past its end read as zeros), a reason or nothing, never a panic.
    let pf = shardstream::format::parquet::projected::ProjectedFile::new(&table, &all_fp);
    let mut copy = Vec::new();
    for (range, _) in pf.pieces().iter().take(64) {
        let (start, end) =
            (usize::try_from(range.start).unwrap_or(usize::MAX), usize::try_from(range.end).unwrap_or(0));
        copy.extend((start..end.min(start.saturating_add(1 << 20))).map(|k| data.get(k).copied().unwrap_or(0)));
    }
    let _ = pf.check_pages(|at, buf| {
        let src = usize::try_from(at).ok().and_then(|a| copy.get(a..a.checked_add(buf.len())?));
        src.map(|s| buf.copy_from_slice(s)).ok_or_else(|| "past the copy".to_string())
    });
    let flat_names: Vec<String> =
        (all.schema().fields().iter()).filter(|f| direct::is_flat(f.data_type())).map(|f| f.name().clone()).collect();
    let flat = Projection::new(table.schema(), &[], Some(&flat_names)).expect("the file's own columns");
    let flat_fp = flat.for_file(&table, &[]).expect("the file's own columns, whose codecs it accepted");
    let flat_cols: Vec<usize> =
        flat_names.iter().map(|n| all.schema().index_of(n).expect("a column of the file")).collect();
    let message = direct::schema_message(flat.schema()).expect("a flat schema has a message");
    for rg in 0..table.num_row_groups().min(8) {
        let rows = table.row_group_rows(rg);
        let plain = match decode::read_row_group(&table, rg, &all_fp, read_at) {
            Ok((batch, _)) => {
                assert_eq!(batch.num_rows() as u64, rows, "row group {rg}: rows");
                assert_eq!(&batch.schema(), all_fp.schema(), "row group {rg}: schema");
                Some(batch)
            }
            Err(e) => {
                assert!(!matches!(e, ParquetError::Ipc(_) | ParquetError::SlotTooSmall { .. }), "{e}");
                None
            }
        };
        if flat_names.is_empty() {
            continue;
        }
        let viewed = if flat_names.len() == all.schema().fields().len() {
            let Some(plain) = &plain else { continue };
            plain.clone()
        } else {
            let Ok((viewed, _)) = decode::read_row_group(&table, rg, &flat_fp, read_at) else { continue };
            viewed
        };
        assert_eq!(viewed.num_rows() as u64, rows, "row group {rg}: rows as views");
        assert_eq!(&viewed.schema(), flat_fp.schema(), "row group {rg}: schema as views");
        let Some(plain) = plain else { continue };
        let plain = plain.project(&flat_cols).expect("columns of the batch");
        // Every row, backwards, and one twice: the gather of a shuffled batch.
        let n = viewed.num_rows();
        let picked: Vec<(usize, usize)> = (0..n).rev().map(|r| (0, r)).chain((n > 0).then_some((0, n / 2))).collect();
        let sources = [&viewed];
        let Some(d) = direct::Direct::plan(flat.schema(), &message, &sources, &picked, None).expect("rows that exist")
        else {
            panic!("row group {rg}: views of flat columns are not written directly");
        };
        let mut stream = vec![0u8; d.stream_len()];
        d.write(&mut stream).expect("a slot of the stream's length");
        // What a client reads from the slot (arrow-ipc validates the stream as it reads it).
        let mut reader = arrow_ipc::reader::StreamReader::try_new(Cursor::new(&stream), None).expect("a stream");
        let got = reader.next().expect("one batch").expect("a valid batch");
        assert!(reader.next().is_none(), "one batch to a slot");
        assert_eq!(&got.schema(), flat.schema(), "row group {rg}: the delivered schema");
        assert_eq!(got.num_rows(), picked.len());
        for (c, name) in flat_names.iter().enumerate() {
            for (i, &(_, r)) in picked.iter().enumerate() {
                assert!(
                    same_value(got.column(c).as_ref(), i, plain.column(c).as_ref(), r),
                    "row group {rg}, column {name}: delivered row {i} is not decoded row {r}"
                );
            }
        }
    }
}

/// Whether row `i` of `a` and row `j` of `b` hold the same value, `b` possibly holding bytes as
/// views where `a` holds them as offsets (a flat projection's decoded row groups, see
/// `format::parquet::schema`). Values under a null struct row are not compared (Arrow leaves them
/// undefined).
fn same_value(a: &dyn Array, i: usize, b: &dyn Array, j: usize) -> bool {
    if a.is_null(i) != b.is_null(j) {
        return false;
    }
    if a.is_null(i) {
        return true;
    }
    if let (Some(x), Some(y)) = (bytes_at(a, i), bytes_at(b, j)) {
        return x == y;
    }
    match (a.data_type(), b.data_type()) {
        (DataType::Struct(_), DataType::Struct(_)) => {
            let (a, b) = (a.as_struct(), b.as_struct());
            a.num_columns() == b.num_columns()
                && a.columns().iter().zip(b.columns()).all(|(x, y)| same_value(x.as_ref(), i, y.as_ref(), j))
        }
        (x, y) if x == y => a.slice(i, 1).to_data() == b.slice(j, 1).to_data(),
        _ => false,
    }
}

/// The bytes of row `i` of a binary or string column, in any of its three layouts.
fn bytes_at(a: &dyn Array, i: usize) -> Option<&[u8]> {
    Some(match a.data_type() {
        DataType::Binary => a.as_binary::<i32>().value(i),
        DataType::LargeBinary => a.as_binary::<i64>().value(i),
        DataType::BinaryView => a.as_binary_view().value(i),
        DataType::Utf8 => a.as_string::<i32>().value(i).as_bytes(),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i).as_bytes(),
        DataType::Utf8View => a.as_string_view().value(i).as_bytes(),
        _ => return None,
    })
}
