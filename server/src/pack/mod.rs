//! `shardstream pack`: turns a tree of small files into shards (WebDataset TAR or Parquet) with a
//! manifest and per-shard sidecars, so the daemon opens the result with one read and no scans.
//!
//! The pipeline, and the module that owns each step:
//!
//! ```text
//!  walk ──► group ──► order ──► read (N threads) ──► writer (1 thread) ──► sink (1 thread) ──► manifest
//!  names    samples   sorted    files -> sample      cuts shards, appends   fsync, rename (or
//!  only     by key    or seeded buffers, in order    samples                upload), sidecar,
//!                     shuffle   (bounded window)                            journal
//! ```
//!
//! - [`walk`]: SRC walked in parallel, or `--files-from`; relative UTF-8 paths, nothing opened.
//! - [`group`]: the catalog: files grouped into samples by key, labels, the packing order.
//! - [`read`]: reader threads and the bounded reorder window feeding the writer; [`buffers`]
//!   recycles their sample buffers.
//! - [`writer`]: shard boundaries and the shard files; [`ustar`] encodes TAR headers,
//!   [`parquet`] writes Parquet shards.
//! - [`dest`]: `--output` parsed, locked, and checked for someone else's dataset.
//! - [`sink`]: where completed shards become durable: a local directory, or an S3 prefix
//!   ([`s3_sink`]: uploads overlapping with packing).
//! - [`journal`]: the resume journal and the dataset fingerprint.
//! - [`report`]: bad inputs, `--strict`, and what the summary counts.
//! - [`cli`]: the `shardstream pack` command line and its progress bar; [`interrupt`] says how
//!   to finish a pack stopped by Ctrl-C or SIGTERM.
//!
//! Guarantees: the same input and options give byte-identical output, whatever the thread
//! count (order and shard boundaries are decided in one place, headers carry fixed metadata);
//! memory is bounded by the names of the files plus a fixed window of samples; the manifest is
//! written only after every shard and sidecar is durable; an interrupted pack resumed with
//! `--resume` produces the same bytes as an uninterrupted one.

pub mod beneath;
pub mod buffers;
pub mod cli;
pub mod dest;
pub mod direct;
pub mod group;
pub mod interrupt;
pub mod journal;
pub mod parquet;
pub mod read;
pub mod report;
pub mod s3_sink;
pub mod shard_file;
pub mod sink;
pub mod ustar;
pub mod walk;
pub mod writer;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use cli::{PackArgs, run_cli};
pub use dest::{Dest, parse_dest};
pub use parquet::ParquetCompression;
pub use report::{BadInput, BadKind};
pub use walk::FileList;

use crate::format::parquet::footers;
use crate::index::manifest::{Manifest, ManifestShard, SIDECAR_DIR};
use crate::storage::s3::S3Store;
use crate::storage::s3_write::UploadOptions;
use crate::{Error, Result};
use dest::Destination;
use journal::{Journal, ShardRecord};
use read::{Layout, ReadContext, Window};
use report::Reporter;
use sink::Sink;
use writer::{FinishedShard, WriterConfig};

/// Default shard size: 1 GiB. Large enough that a dataset of a few TB is a few thousand shards
/// (one GET or open each, cheap per-shard overheads, a manifest that stays small), and that
/// sequential reads of a shard run at full disk or S3 bandwidth; small enough that a node cache
/// holds many shards, that the daemon's shuffle window of ~8 shards spans only ~8 GiB, and that
/// a retried download or a re-packed shard after an interruption costs seconds, not minutes. The
/// WebDataset documentation recommends shards of a few hundred MB to a few GB for the same
/// reasons.
pub const DEFAULT_SHARD_SIZE: u64 = 1 << 30;
/// Default shard name prefix: `shard-000000.tar`. Neutral (a pack is not always a training set);
/// use `--prefix train` and `--prefix val` to keep splits apart in one bucket.
pub const DEFAULT_PREFIX: &str = "shard";
/// File written next to the shards by `--label-from-dir`: `{"class name": index, ...}`.
pub const CLASSES_FILE: &str = "classes.json";
/// Most reader threads by default. Reads of small files are latency-bound (an open is a metadata
/// round trip on a parallel file system), so more threads than cores help; beyond 32 a metadata
/// server is being hammered rather than used.
const MAX_DEFAULT_THREADS: usize = 32;

/// How often an S3 destination's copy of the resume journal is brought up to date (besides once
/// before the first new shard): an upload of the whole journal, so not after every shard.
const JOURNAL_SHARE_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The shard format of a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ShardFormat {
    /// WebDataset TAR shards (`.tar`), with sidecars; what the daemon serves.
    #[default]
    Webdataset,
    /// Parquet shards (`.parquet`): `__key__` plus one binary column per field.
    Parquet,
}

impl ShardFormat {
    /// The daemon's format of the shards a pack writes.
    pub fn format(self) -> crate::format::Format {
        match self {
            ShardFormat::Webdataset => crate::format::Format::WebDataset,
            ShardFormat::Parquet => crate::format::Format::Parquet,
        }
    }

    /// The manifest's `shard_format`.
    pub fn manifest_name(self) -> &'static str {
        self.format().name()
    }

    pub fn extension(self) -> &'static str {
        match self {
            ShardFormat::Webdataset => "tar",
            ShardFormat::Parquet => "parquet",
        }
    }
}

/// Default reader threads: twice the cores, at most 32 (`MAX_DEFAULT_THREADS`).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get() * 2).min(MAX_DEFAULT_THREADS)
}

/// Everything a pack needs to know.
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Root of the input tree; keys are paths relative to it.
    pub src: PathBuf,
    /// Pack the files of this list instead of walking SRC.
    pub files_from: Option<FileList>,
    /// List entries are NUL-separated (`find -print0`).
    pub null_separated: bool,
    /// Destination: a directory (`file://` URLs accepted) or `s3://bucket/prefix/`.
    pub dest: String,
    pub format: ShardFormat,
    pub shard_size: u64,
    pub samples_per_shard: Option<u64>,
    pub prefix: String,
    pub key_regex: Option<String>,
    pub label_from_dir: bool,
    pub shuffle: bool,
    pub seed: u64,
    pub row_group_rows: usize,
    pub compression: ParquetCompression,
    pub threads: usize,
    pub resume: bool,
    pub strict: bool,
    /// Write local shards through the page cache instead of around it (`O_DIRECT`).
    pub buffered_io: bool,
    /// How shards are uploaded to S3 output (no effect on the bytes).
    pub upload: UploadOptions,
}

impl PackOptions {
    /// Options with every default, for `src` -> `dest`.
    pub fn new(src: impl Into<PathBuf>, dest: impl Into<String>) -> Self {
        Self {
            src: src.into(),
            files_from: None,
            null_separated: false,
            dest: dest.into(),
            format: ShardFormat::Webdataset,
            shard_size: DEFAULT_SHARD_SIZE,
            samples_per_shard: None,
            prefix: DEFAULT_PREFIX.into(),
            key_regex: None,
            label_from_dir: false,
            shuffle: false,
            seed: 0,
            row_group_rows: parquet::DEFAULT_ROW_GROUP_ROWS,
            compression: ParquetCompression::None,
            threads: default_threads(),
            resume: false,
            strict: false,
            buffered_io: false,
            upload: UploadOptions::default(),
        }
    }

    fn validate(&self) -> Result<()> {
        if self.shard_size == 0 {
            return Err(Error::invalid("--shard-size must be at least 1 byte"));
        }
        if self.samples_per_shard == Some(0) {
            return Err(Error::invalid("--samples-per-shard must be at least 1"));
        }
        if self.row_group_rows == 0 {
            return Err(Error::invalid("--row-group-size must be at least 1"));
        }
        if self.threads == 0 {
            return Err(Error::invalid("--threads must be at least 1"));
        }
        if self.upload.part_size < s3_sink::MIN_PART_SIZE {
            return Err(Error::invalid("--s3-part-size must be at least 5 MiB: S3 rejects smaller parts"));
        }
        if self.upload.multipart_threshold > s3_sink::MAX_PUT_SIZE {
            return Err(Error::invalid("--s3-multipart-threshold must be at most 5 GiB: S3's limit for one PUT"));
        }
        let p = &self.prefix;
        if p.is_empty()
            || p.starts_with(['.', '_'])
            || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(Error::invalid(format!(
                "--prefix {p:?}: use letters, digits, '.', '_' and '-', not starting with '.' or '_'"
            )));
        }
        if self.format == ShardFormat::Webdataset
            && (self.compression != ParquetCompression::None || self.row_group_rows != parquet::DEFAULT_ROW_GROUP_ROWS)
        {
            return Err(Error::invalid("--parquet-compression and --row-group-size apply to --format parquet only"));
        }
        Ok(())
    }

    /// The options that shape the output, canonically (part of the fingerprint).
    fn shaping(&self) -> String {
        format!(
            "format={};shard_size={};samples_per_shard={:?};prefix={};key_regex={:?};label_from_dir={};\
             shuffle={};seed={};row_group_rows={};compression={:?}",
            self.format.manifest_name(),
            self.shard_size,
            self.samples_per_shard,
            self.prefix,
            self.key_regex,
            self.label_from_dir,
            self.shuffle,
            if self.shuffle { self.seed } else { 0 },
            self.row_group_rows,
            self.compression,
        )
    }
}

/// What a pack reports as it goes. Every method has a no-op default; `()` reports nothing.
pub trait PackProgress: Sync {
    /// The catalog is known: `files` in `samples`, of which `done_files` are in shards kept from
    /// an interrupted run.
    fn planned(&self, _files: u64, _samples: u64, _done_files: u64) {}
    /// A sample was written (or skipped: `bytes` 0); called from the writer thread.
    fn sample_written(&self, _files: u64, _bytes: u64) {}
    /// A shard is durable.
    fn shard_done(&self, _name: &str, _bytes: u64) {}
    /// Every shard is written; `shards` of them (`bytes`) are still on their way to `dest`
    /// (uploads to S3), which the pack now waits for.
    fn finishing(&self, _shards: usize, _bytes: u64, _dest: &str) {}
    /// A bad input was skipped (not called under `--strict`: it is the error then).
    fn bad_input(&self, _bad: &BadInput) {}
    /// A file that is not part of any sample.
    fn ignored(&self, _path: &str, _why: &str) {}
    /// A sample with bad inputs was left out, and `other_files` of its files with it.
    fn sample_left_out(&self, _key: &str, _other_files: u64) {}
    /// Polled by the writer before each sample: true stops the pack as an interruption would
    /// (what is durable stays, `--resume` continues).
    fn stop_requested(&self) -> bool {
        false
    }
}

impl PackProgress for () {}

/// `"1 file"`, `"2 files"`.
pub(crate) fn count(n: u64, what: &str) -> String {
    if n == 1 { format!("1 {what}") } else { format!("{n} {what}s") }
}

/// The outcome of a pack.
#[derive(Debug, Clone)]
pub struct PackSummary {
    /// The destination: a path or an `s3://` URL.
    pub dest: String,
    /// Where the manifest was written (path or URL).
    pub manifest_location: String,
    pub manifest: Manifest,
    /// Files packed, over all shards (kept ones included).
    pub files: u64,
    /// Payload bytes packed, over all shards.
    pub payload_bytes: u64,
    /// Shards kept from an interrupted run (`--resume`).
    pub resumed_shards: u64,
    /// Shards an interrupted run of the same pack had finished, packed again for want of
    /// `--resume` (said, so that the next interruption is resumed).
    pub repacked_shards: u64,
    /// Files and payload bytes read by this run.
    pub files_read: u64,
    pub bytes_read: u64,
    /// Bad inputs skipped by this run, by kind.
    pub bad_inputs: BTreeMap<BadKind, u64>,
    /// Bad inputs the interrupted run skipped in the shards kept from it (`--resume`).
    pub resumed_bad_inputs: u64,
    /// Samples this run left out for their bad inputs, and their other files.
    pub left_out_samples: u64,
    pub left_out_files: u64,
    /// Files that are not samples by convention (hidden, no extension, not matching the regex).
    pub ignored: u64,
    pub elapsed: Duration,
}

impl PackSummary {
    pub fn bad_total(&self) -> u64 {
        self.bad_inputs.values().sum::<u64>() + self.resumed_bad_inputs
    }

    /// The one-line summary the CLI prints.
    pub fn line(&self) -> String {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let m = &self.manifest;
        let mut s = format!(
            "packed {} ({}, {:.1} MB) into {} {} in {secs:.1} s ({:.0} files/s, {:.0} MB/s)",
            count(m.total_samples, "sample"),
            count(self.files, "file"),
            self.payload_bytes as f64 / 1e6,
            m.shards.len(),
            if m.shards.len() == 1 {
                format!("{} shard", m.shard_format)
            } else {
                format!("{} shards", m.shard_format)
            },
            self.files_read as f64 / secs,
            self.bytes_read as f64 / 1e6 / secs,
        );
        if self.resumed_shards > 0 {
            s += &format!("; {} kept from the interrupted run", count(self.resumed_shards, "shard"));
        }
        if self.repacked_shards > 0 {
            s += &format!(
                "; {} an interrupted run had finished packed again (--resume keeps them)",
                count(self.repacked_shards, "shard")
            );
        }
        if self.bad_total() > 0 {
            let mut kinds: Vec<String> = self.bad_inputs.iter().map(|(k, n)| format!("{n} {}", k.describe())).collect();
            if self.resumed_bad_inputs > 0 {
                kinds.push(format!("{} in kept shards", self.resumed_bad_inputs));
            }
            s += &format!("; skipped {} ({})", count(self.bad_total(), "bad input"), kinds.join(", "));
        }
        if self.left_out_samples > 0 {
            s += &format!(
                "; left out {} for its bad inputs ({} not packed)",
                count(self.left_out_samples, "sample"),
                count(self.left_out_files, "other file")
            );
        }
        if self.ignored > 0 {
            s += &format!(
                "; ignored {} (hidden, without a field extension, or not matching --key-regex)",
                count(self.ignored, "file")
            );
        }
        s += &format!("; wrote {}", self.manifest_location);
        s
    }
}

/// Packs `opts.src` into shards at `opts.dest`, a local directory.
pub fn pack(opts: &PackOptions, progress: &dyn PackProgress) -> Result<PackSummary> {
    pack_with(opts, None, progress)
}

/// Packs `opts.src` into shards at `opts.dest`; `s3` is the connection for `s3://` output
/// (blocking calls enter its runtime, so this must not run on one of its workers).
pub fn pack_with(opts: &PackOptions, s3: Option<&S3Store>, progress: &dyn PackProgress) -> Result<PackSummary> {
    let started = Instant::now();
    opts.validate()?;
    dest::parse_dest(&opts.dest)?;
    let key_regex = opts.key_regex.as_deref().map(group::compile_key_regex).transpose()?;
    if let Some(url) = opts.src.to_str().filter(|s| s.starts_with("s3://")) {
        return Err(Error::invalid(format!(
            "source {url} is an S3 URL: pack reads a local directory (or a file system mounted as one) and \
             writes to a local directory or s3://; copy the objects down first (e.g. `aws s3 sync {url} DIR`)"
        )));
    }
    let src = std::fs::canonicalize(&opts.src).map_err(|e| Error::io("cannot open source directory", &opts.src, e))?;
    if !src.is_dir() {
        return Err(Error::invalid(format!("source {} is not a directory", opts.src.display())));
    }
    let dest = Destination::open(&opts.dest, &src, s3)?;
    let reporter = Reporter::new(opts.strict, progress);

    // 1. Names only: walk or list, group, order.
    let named = || -> Result<group::Catalog> {
        let paths = match &opts.files_from {
            None => walk::walk(&src, Some(dest.local_dir()), opts.threads, &reporter)?,
            Some(list) => walk::read_list(list, opts.null_separated, &opts.src, &src, &reporter)?,
        };
        let catalog = group::Catalog::build(
            paths,
            group::GroupOptions { key_regex: key_regex.as_ref(), label_from_dir: opts.label_from_dir },
            &reporter,
        )?;
        if catalog.num_samples() == 0 {
            return Err(Error::invalid(format!(
                "nothing to pack: no samples found in {} ({} files ignored, {} bad inputs)",
                opts.src.display(),
                reporter.ignored_count(),
                reporter.counts().values().sum::<u64>()
            )));
        }
        Ok(catalog)
    };
    let catalog = named().inspect_err(|_| dest.remove_if_made_and_empty())?;
    let order = catalog.order(opts.shuffle, opts.seed);
    let fingerprint = journal::fingerprint(&opts.shaping(), &catalog, &order);

    // 2. Whose DEST is this, and what of it is already done?
    let mut repacked = 0;
    let kept: Vec<ShardRecord> = match dest.load_journal()? {
        Some((prior, _)) if prior.fingerprint == fingerprint => {
            if opts.resume {
                prior.shards
            } else {
                // A finished pack's journal lists every shard too: only an unfinished one's count.
                if !dest.has_manifest()? {
                    repacked = prior.shards.len() as u64;
                }
                Vec::new()
            }
        }
        // A pack that finished no shard (stopped early, or every input was bad) left nothing to
        // resume or to protect: a pack of other inputs starts over there. Only where this pack's
        // lock keeps every other out: an S3 prefix's journal of no shard may be another
        // machine's pack writing its first one.
        Some((prior, _)) if prior.shards.is_empty() && dest.locked_everywhere() && !dest.has_manifest()? => Vec::new(),
        Some((_, journal_at)) if opts.resume && !dest.has_manifest()? => {
            return Err(Error::invalid(format!(
                "--resume: output {} holds an unfinished pack of other files or options than these (see \
                 {journal_at}): a file added, removed or renamed in SRC since, or another option that shapes \
                 shards, makes another dataset; run the interrupted command as it was, or remove the output \
                 and pack anew",
                dest.location(),
            )));
        }
        Some((_, journal_at)) => {
            let state = if dest.has_manifest()? { "a complete" } else { "an unfinished pack of a" };
            return Err(Error::invalid(format!(
                "output {} already holds {state} different dataset (packed from other files or with other \
                 options, see {journal_at}); pack into an empty directory or remove it first",
                dest.location(),
            )));
        }
        None => {
            if let Some(what) = dest.foreign_dataset()? {
                return Err(Error::invalid(format!(
                    "output {} already holds a dataset ({what}) that was not written by a resumable pack; \
                     pack into an empty directory or remove it first",
                    dest.location()
                )));
            }
            Vec::new()
        }
    };
    let sink = dest.sink(opts.upload)?;
    sink.remove_manifest()?;
    let with_sidecar = opts.format == ShardFormat::Webdataset;
    // A record past the end of the order is corrupt (the fingerprint matched, the numbers did
    // not): it and what follows are packed again.
    let kept: Vec<ShardRecord> = kept
        .into_iter()
        .take_while(|r| r.end <= order.len() as u64 && r.files <= catalog.num_files() as u64)
        .take_while(|r| sink.has_shard(r, with_sidecar))
        .collect();
    let mut journal = Journal::create(dest.journal_path(), &fingerprint, &kept)?;
    // Before the first new shard reaches the destination: whoever finds shards there from now on
    // also finds whose they are, and can resume (from another machine too).
    sink.share_journal(dest.journal_path())?;
    let journal_path = dest.journal_path();

    let total_files = catalog.num_files() as u64;
    let kept_files: u64 = kept.iter().map(|r| r.files).sum();
    progress.planned(total_files, catalog.num_samples() as u64, kept_files);

    // 3. Read, write, make durable.
    let start = kept.last().map_or(0, |r| r.end);
    let end = order.len() as u64;
    let layout = if opts.format == ShardFormat::Webdataset { Layout::Tar } else { Layout::Raw };
    let root = beneath::SrcDir::open(&src).map_err(|e| Error::io("cannot open source directory", &src, e))?;
    let ctx = ReadContext { src: &root, catalog: &catalog, order: &order, layout, reporter: &reporter };
    let cfg = WriterConfig {
        format: opts.format,
        shard_size: opts.shard_size,
        samples_per_shard: opts.samples_per_shard,
        prefix: &opts.prefix,
        parquet: parquet::ParquetOptions {
            fields: &catalog.fields,
            row_group_rows: opts.row_group_rows,
            compression: opts.compression,
        },
        route: if opts.buffered_io || sink.rereads_scratch() {
            shard_file::WriteRoute::ThroughPageCache
        } else {
            shard_file::WriteRoute::AroundPageCache
        },
    };
    let window = Window::new(start as usize, end as usize);
    let scratch = |name: &str| sink.scratch_path(name);
    let (tx, rx) = std::sync::mpsc::sync_channel::<FinishedShard>(1);
    let (written, sunk) = std::thread::scope(|s| {
        let spawn_error = |e: std::io::Error| Error::Internal(format!("cannot start a pack thread: {e}"));
        let mut readers = Vec::with_capacity(opts.threads);
        for i in 0..opts.threads {
            let r =
                std::thread::Builder::new().name(format!("pack-read-{i}")).spawn_scoped(s, || window.run_reader(&ctx));
            match r {
                Ok(h) => readers.push(h),
                Err(e) => {
                    window.stop();
                    return (Err(spawn_error(e)), Ok(Vec::new()));
                }
            }
        }
        let sink_ref: &dyn Sink = sink.as_ref();
        let journal = &mut journal;
        let sink_thread = std::thread::Builder::new().name("pack-sink".into()).spawn_scoped(
            s,
            move || -> Result<Vec<ShardRecord>> {
                let mut done = Vec::new();
                // Handed to the sink, not yet durable: journaled as the sink reports them done.
                let mut pending = std::collections::VecDeque::new();
                let mut shared = std::time::Instant::now();
                let mut record = |n: usize, pending: &mut std::collections::VecDeque<ShardRecord>| -> Result<()> {
                    for rec in pending.drain(..n.min(pending.len())) {
                        journal.append(&rec)?;
                        progress.shard_done(&rec.name, rec.bytes);
                        done.push(rec);
                    }
                    // The destination's copy, at most every JOURNAL_SHARE_EVERY: a resume elsewhere
                    // packs again at most what was done since (the same bytes, overwritten).
                    if n > 0 && shared.elapsed() >= JOURNAL_SHARE_EVERY {
                        sink_ref.share_journal(journal_path)?;
                        shared = std::time::Instant::now();
                    }
                    Ok(())
                };
                for shard in rx {
                    let rec = ShardRecord {
                        shard: shard.number,
                        name: shard.name.clone(),
                        first: shard.first,
                        end: shard.end,
                        bytes: shard.bytes,
                        samples: shard.samples,
                        files: shard.files,
                        payload: shard.payload,
                        crc32c: format!("{:08x}", shard.crc),
                        fields: shard.fields.clone(),
                        bad_inputs: shard.bad_inputs,
                        largest: shard.tar_index.as_ref().and_then(|t| t.largest_sample()),
                    };
                    pending.push_back(rec);
                    let n = sink_ref.put_shard(shard)?;
                    record(n, &mut pending)?;
                }
                // The writer is done (or failed): what is in flight still becomes durable, so
                // that a resumed pack keeps it.
                if !pending.is_empty() {
                    let bytes = pending.iter().map(|r| r.bytes).sum();
                    progress.finishing(pending.len(), bytes, &sink_ref.describe());
                }
                let n = sink_ref.flush()?;
                record(n, &mut pending)?;
                Ok(done)
            },
        );
        let sink_thread = match sink_thread {
            Ok(h) => h,
            Err(e) => {
                window.stop();
                return (Err(spawn_error(e)), Ok(Vec::new()));
            }
        };
        let written =
            writer::write_shards(&cfg, &window, start, end, kept.len() as u64, &scratch, tx, &reporter, progress);
        window.stop();
        for r in readers {
            let _ = r.join();
        }
        let sunk = sink_thread.join().unwrap_or_else(|_| Err(Error::Internal("the shard sink thread panicked".into())));
        (written, sunk)
    });
    // A sink failure makes the writer fail too (its channel closes): report the cause.
    let (stats, new_shards) = match (written, sunk) {
        (Ok(w), Ok(s)) => (w, s),
        (_, Err(e)) | (Err(e), _) => return Err(e),
    };

    // 4. Publish: shards, classes, and the manifest last.
    let all: Vec<ShardRecord> = kept.iter().cloned().chain(new_shards).collect();
    if all.iter().all(|r| r.samples == 0) {
        // Every file named was bad (gone, unreadable): a manifest of no samples is no dataset.
        let bad: Vec<String> = reporter.counts().iter().map(|(k, n)| format!("{n} {}", k.describe())).collect();
        return Err(Error::invalid(format!(
            "nothing packed: none of the {} files named in {} could be read ({}); no manifest written",
            catalog.num_files(),
            opts.src.display(),
            bad.join(", ")
        )));
    }
    let names: Vec<String> = all.iter().map(|r| r.name.clone()).collect();
    sink.publish(&names, &opts.prefix, opts.format.extension())?;
    if opts.label_from_dir {
        let classes: serde_json::Map<String, serde_json::Value> =
            catalog.classes.iter().enumerate().map(|(i, c)| (c.clone(), serde_json::Value::from(i))).collect();
        let json = serde_json::to_vec_pretty(&classes).map_err(|e| Error::Internal(e.to_string()))?;
        sink.put_file(CLASSES_FILE, &json)?;
    }
    let mut fields = std::collections::BTreeSet::new();
    let entries: Vec<ManifestShard> = all
        .iter()
        .map(|r| {
            fields.extend(r.fields.iter().cloned());
            ManifestShard {
                name: r.name.clone(),
                bytes: r.bytes,
                samples: r.samples,
                crc32c: r.crc32c.clone(),
                index: with_sidecar.then(|| format!("{SIDECAR_DIR}/{}.idx", r.name)),
                max_sample: None,
                max_sample_bytes: None,
                etag: None,
                page_checksums: None,
                etag_md5: None,
            }
            .with_largest(r.largest)
        })
        .collect();
    let mut manifest = Manifest::new(opts.format.manifest_name(), fields.into_iter().collect(), entries);
    if opts.format == ShardFormat::Parquet {
        sink.put_file(footers::NAME, &bundle_footers(&*sink, &all)?)?;
        manifest.footers = Some(footers::NAME.to_owned());
    }
    sink.put_manifest(&manifest)?;

    Ok(PackSummary {
        dest: dest.location(),
        manifest_location: dest.manifest_location(),
        files: all.iter().map(|r| r.files).sum(),
        payload_bytes: all.iter().map(|r| r.payload).sum(),
        resumed_shards: kept.len() as u64,
        repacked_shards: repacked,
        files_read: stats.files,
        bytes_read: stats.payload,
        bad_inputs: reporter.counts(),
        resumed_bad_inputs: kept.iter().map(|r| r.bad_inputs).sum(),
        ignored: reporter.ignored_count(),
        left_out_samples: reporter.left_out_counts().0,
        left_out_files: reporter.left_out_counts().1,
        elapsed: started.elapsed(),
        manifest,
    })
}

/// The footers bundle of the published Parquet shards `all` (`format::parquet::footers`): each
/// footer read back from the destination (a tail read, a ranged GET on S3), so that a dataset of
/// any number of files opens with two reads. Identities are the manifest's (`len`, whole-file CRC).
fn bundle_footers(sink: &dyn Sink, all: &[ShardRecord]) -> Result<Vec<u8>> {
    let sidecars = crate::parallel::try_map(all, 8, |r| {
        let table = crate::format::parquet::dataset::read_table(&r.name, r.bytes, |off, buf| {
            sink.read_published(&r.name, r.bytes, off, buf)
        })?;
        let identity = format!("len={};crc32c={}", r.bytes, r.crc32c);
        let table = crate::format::ShardTable::Parquet(std::sync::Arc::new(table));
        Ok(table.encode_sidecar(identity.as_bytes()))
    })?;
    footers::encode(all.iter().zip(&sidecars).map(|(r, s)| (r.name.as_str(), s.as_slice())))
        .map_err(|e| Error::Internal(format!("cannot bundle the footers: {e}")))
}
