//! The `shardstream pack` command line: its flags (with their `--help`), size parsing, and the
//! progress display (a bar with files/s, MB/s and ETA on a terminal, bad inputs named on stderr,
//! one summary line on stdout at the end).

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::parquet::DEFAULT_ROW_GROUP_ROWS;
use super::{
    BadInput, DEFAULT_PREFIX, FileList, PackOptions, PackProgress, ParquetCompression, ShardFormat, default_threads,
    pack_with,
};
use crate::limits;
use crate::storage::s3::{S3Options, S3Store};
use crate::storage::s3_write::UploadOptions;

/// How often the rate figures of the progress bar are recomputed.
const RATE_REFRESH: Duration = Duration::from_millis(250);
/// How often a pack without a terminal writes a line of progress.
const LOG_EVERY: Duration = Duration::from_secs(30);
/// Ignored files named individually on stderr; the rest are only counted.
const IGNORED_SHOWN: u64 = 10;
/// Bad inputs of each kind named individually on stderr (and samples left out with them); the
/// rest are counted in the summary. A tree can hold thousands of one mistake, whose lines would
/// bury everything else said.
const BAD_SHOWN: u64 = 20;

/// Arguments of `shardstream pack`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "\
Examples:
  shardstream pack /data/imagenet/train --output /data/imagenet-wds/train --label-from-dir --shuffle --seed 1
  find /data/raw -name '*.jpg' -o -name '*.json' | shardstream pack /data/raw --files-from - --output /data/shards
  shardstream pack /data/raw --output /data/pq --format parquet --row-group-size 512
  AWS_ENDPOINT_URL=http://minio:9000 shardstream pack /data/raw --output s3://datasets/raw-wds/

Samples: files with the same directory and name up to the first dot form one sample (WebDataset
convention): a/x.jpg and a/x.json are sample a/x with fields jpg and json. Hidden files and files
without an extension are ignored, and so are hidden directories. Extensions are lower-cased (x.JPG is
field jpg). A TAR shard may have 1024 distinct fields (clip.0000.jpg, clip.0001.jpg, ... are one sample
with a field per frame); past that the pack fails naming the sample (a Parquet shard has a column per
field, and no such limit). Output: DEST/PREFIX-000000.tar ..., DEST/_shardstream/*.idx
(member tables) and DEST/manifest.json, written last. An interrupted pack (Ctrl-C, crash) is
finished by running the same command with --resume; the result is byte-identical.

S3 output (s3://bucket/prefix/, credentials and endpoint from the AWS_* environment): each shard is
written to a scratch file and uploaded as soon as it is complete, while packing goes on; the
objects are the same as a local pack's files. The resume journal and the scratch files live in
$XDG_CACHE_HOME/shardstream/pack/ (default ~/.cache/shardstream/pack/), and a copy of the journal
goes to the bucket, so --resume also works from another machine.")]
pub struct PackArgs {
    /// Directory of files to pack. Keys are paths relative to it.
    #[arg(value_name = "SRC")]
    pub src: PathBuf,

    /// Output directory (created if needed; file:// URLs accepted) or s3://bucket/prefix/. It must
    /// hold no other dataset: nothing, or an earlier pack of the same input and options. Inside
    /// SRC (whose walk skips it) it must hold nothing else either.
    #[arg(short, long, value_name = "DEST")]
    pub output: String,

    /// Pack the files named in LIST (one path per line, relative to SRC or absolute inside it; `-`
    /// reads standard input) instead of walking SRC: no directory listing, no stat per file.
    #[arg(long, value_name = "LIST")]
    pub files_from: Option<String>,

    /// The --files-from list is NUL-separated (as `find -print0` writes it).
    #[arg(short = '0', long = "null", requires = "files_from")]
    pub null: bool,

    /// Shard format: WebDataset TAR (served by the daemon) or Parquet (one row per sample).
    #[arg(long, value_enum, default_value_t = ShardFormat::Webdataset)]
    pub format: ShardFormat,

    /// Largest shard, e.g. 512MiB, 1G, 2GB (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB
    /// powers of 1000). A sample larger than this gets a shard of its own. A Parquet shard counts its
    /// values and keys: its footer and page index come on top. The 1 GiB default keeps a
    /// multi-TB dataset to a few thousand shards read at full bandwidth, while a node cache still
    /// holds many and a re-packed or re-downloaded shard costs seconds.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = limits::parse_shard_size)]
    pub shard_size: u64,

    /// Most samples per shard; a shard ends at whichever of this and --shard-size comes first.
    #[arg(long, value_name = "N", value_parser = limits::parse_samples_per_shard)]
    pub samples_per_shard: Option<u64>,

    /// Shard names: PREFIX-000000.tar, PREFIX-000001.tar, ...
    #[arg(long, default_value = DEFAULT_PREFIX)]
    pub prefix: String,

    /// Derive keys with a regex over the path relative to SRC: the group `key` (or the first
    /// group) is the key, the group `field` (or the second) the field, else what follows the match.
    /// Example: `'^(?P<key>.*/img_\d+)_(?P<field>\w+\.png)$'`. Files it does not match are ignored.
    #[arg(long, value_name = "REGEX")]
    pub key_regex: Option<String>,

    /// Add a `cls` field with the index of each sample's class directory (the one directly under
    /// SRC, however deep the file lies) among all of them, sorted (as torchvision's ImageFolder
    /// numbers them, except that hidden directories such as .ipynb_checkpoints, which it would
    /// count, are no classes here), and write DEST/classes.json mapping names to indices.
    #[arg(long)]
    pub label_from_dir: bool,

    /// Pack samples in a seeded random order instead of key order (so that shard-level shuffling
    /// later mixes classes).
    #[arg(long)]
    pub shuffle: bool,

    /// Seed of --shuffle: the same seed gives the same order on every machine.
    #[arg(long, default_value_t = 0, requires = "shuffle")]
    pub seed: u64,

    /// Rows per Parquet row group (--format parquet); a row group also ends once past 128 MiB.
    #[arg(long, value_name = "ROWS", default_value_t = DEFAULT_ROW_GROUP_ROWS, value_parser = limits::parse_row_group_size)]
    pub row_group_size: usize,

    /// Compression of Parquet pages (--format parquet). Images and audio are already compressed,
    /// so the default is none.
    #[arg(long, value_enum, default_value_t = ParquetCompression::None)]
    pub parquet_compression: ParquetCompression,

    /// Reader threads (default: twice the cores, at most 32; more help on a parallel file system).
    #[arg(long, default_value_t = default_threads(), value_parser = limits::parse_threads)]
    pub threads: usize,

    /// Continue an interrupted pack of the same input and options into DEST: complete shards are
    /// kept, the rest is packed again; the result is the same as an uninterrupted run. The same
    /// input is the same file names: a file added, removed or renamed is refused, but the
    /// contents of files already packed are not read again (change them, and pack anew).
    #[arg(long)]
    pub resume: bool,

    /// Stop at the first bad input (unreadable, vanished, non-UTF-8 name, symlink leaving SRC,
    /// duplicate key, ...) instead of skipping it and counting it in the summary.
    #[arg(long)]
    pub strict: bool,

    /// Write shards through the page cache. By default a local output is written around it
    /// (O_DIRECT): the shards are written once and made durable, and a pack of a large tree would
    /// otherwise fill the page cache with them, evicting what the machine had cached. Useful when
    /// the shards are read right after the pack on the same machine.
    #[arg(long)]
    pub buffered_io: bool,

    /// S3 output: bytes per part of a multipart upload (S3 requires at least 5 MiB).
    #[arg(long, value_name = "SIZE", default_value = "16MiB", value_parser = limits::parse_s3_upload_part_size)]
    pub s3_part_size: u64,

    /// S3 output: shards larger than this are uploaded in parts, smaller ones with one PUT.
    #[arg(long, value_name = "SIZE", default_value = "16MiB", value_parser = limits::parse_s3_multipart_threshold)]
    pub s3_multipart_threshold: u64,
}

impl PackArgs {
    pub fn to_options(&self) -> PackOptions {
        let files_from = self.files_from.as_ref().map(|f| match f.as_str() {
            "-" => FileList::Stdin,
            p => FileList::Path(PathBuf::from(p)),
        });
        PackOptions {
            src: self.src.clone(),
            files_from,
            null_separated: self.null,
            dest: self.output.clone(),
            format: self.format,
            shard_size: self.shard_size,
            samples_per_shard: self.samples_per_shard,
            prefix: self.prefix.clone(),
            key_regex: self.key_regex.clone(),
            label_from_dir: self.label_from_dir,
            shuffle: self.shuffle,
            seed: self.seed,
            row_group_rows: self.row_group_size,
            compression: self.parquet_compression,
            threads: self.threads,
            resume: self.resume,
            strict: self.strict,
            buffered_io: self.buffered_io,
            upload: UploadOptions { multipart_threshold: self.s3_multipart_threshold, part_size: self.s3_part_size },
        }
    }
}

pub use shardstream_proto::size::parse_size;

/// The terminal progress display.
struct Display {
    bar: indicatif::ProgressBar,
    started: Instant,
    files: AtomicU64,
    bytes: AtomicU64,
    shards: AtomicU64,
    ignored: AtomicU64,
    /// Bad inputs said so far, by kind.
    bad: Mutex<std::collections::BTreeMap<super::report::BadKind, u64>>,
    left_out: AtomicU64,
    last_refresh: Mutex<Instant>,
    /// Without a terminal (a batch job's log) the bar draws nothing: a line every
    /// [`LOG_EVERY`] instead, the last one's time here.
    logged: Option<Mutex<Instant>>,
    /// Set once every file is read and the pack waits for its last uploads: the rates stop.
    finishing: std::sync::atomic::AtomicBool,
}

impl Display {
    fn new() -> Self {
        // indicatif draws nothing when stderr is not a terminal.
        let bar = indicatif::ProgressBar::new(0).with_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {elapsed_precise} [{bar:30}] {human_pos}/{human_len} files  {msg}  ETA {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message("listing files");
        bar.enable_steady_tick(Duration::from_millis(200));
        Self {
            bar,
            started: Instant::now(),
            files: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            shards: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            bad: Mutex::default(),
            left_out: AtomicU64::new(0),
            last_refresh: Mutex::new(Instant::now()),
            logged: (!std::io::IsTerminal::is_terminal(&std::io::stderr())).then(|| Mutex::new(Instant::now())),
            finishing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn refresh(&self, force: bool) {
        let now = Instant::now();
        {
            let mut last = self.last_refresh.lock().unwrap_or_else(|p| p.into_inner());
            if !force && now.duration_since(*last) < RATE_REFRESH {
                return;
            }
            *last = now;
        }
        if self.finishing.load(Ordering::Relaxed) {
            return;
        }
        let secs = now.duration_since(self.started).as_secs_f64().max(1e-9);
        let (files, bytes) = (self.files.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed));
        let shards = self.shards.load(Ordering::Relaxed);
        self.bar.set_message(format!(
            "{:.0} files/s  {:.0} MB/s  {shards} shards",
            files as f64 / secs,
            bytes as f64 / 1e6 / secs,
        ));
        if let Some(logged) = &self.logged {
            let mut last = logged.lock().unwrap_or_else(|p| p.into_inner());
            if now.duration_since(*last) >= LOG_EVERY {
                *last = now;
                eprintln!(
                    "shardstream pack: {}/{} files, {:.0} MB read, {shards} shards done, {:.0} s",
                    self.bar.position(),
                    self.bar.length().unwrap_or(0),
                    bytes as f64 / 1e6,
                    secs
                );
            }
        }
    }
}

impl PackProgress for Display {
    fn planned(&self, files: u64, _samples: u64, done_files: u64) {
        self.bar.set_length(files);
        self.bar.set_position(done_files);
        self.bar.reset_eta();
        self.refresh(true);
    }

    fn sample_written(&self, files: u64, bytes: u64) {
        self.files.fetch_add(files, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.bar.inc(files);
        self.refresh(false);
    }

    fn shard_done(&self, _name: &str, _bytes: u64) {
        self.shards.fetch_add(1, Ordering::Relaxed);
    }

    fn finishing(&self, shards: usize, bytes: u64, dest: &str) {
        self.finishing.store(true, Ordering::Relaxed);
        let what = super::count(shards as u64, "shard");
        let line = format!("all files read; waiting for {what} ({:.0} MB) to reach {dest}", bytes as f64 / 1e6);
        if self.logged.is_some() {
            eprintln!("shardstream pack: {line}");
        }
        self.bar.set_message(line);
    }

    fn bad_input(&self, bad: &BadInput) {
        let n = {
            let mut said = self.bad.lock().unwrap_or_else(|p| p.into_inner());
            let n = said.entry(bad.kind).or_default();
            *n += 1;
            *n
        };
        if n <= BAD_SHOWN {
            self.bar.suspend(|| eprintln!("shardstream pack: skipped {bad}"));
        } else if n == BAD_SHOWN + 1 {
            let kind = bad.kind.describe();
            self.bar.suspend(|| {
                eprintln!(
                    "shardstream pack: further {kind} inputs are only counted (the summary says how many; --strict \
                     stops at the first bad input)"
                )
            });
        }
    }

    fn sample_left_out(&self, key: &str, other_files: u64) {
        if other_files == 0 {
            return;
        }
        let n = self.left_out.fetch_add(1, Ordering::Relaxed);
        if n < BAD_SHOWN {
            let files = if other_files == 1 { "1 other file".to_owned() } else { format!("{other_files} other files") };
            self.bar.suspend(|| eprintln!("shardstream pack: left out sample {key} ({files} not packed)"));
        } else if n == BAD_SHOWN {
            self.bar.suspend(|| eprintln!("shardstream pack: further samples left out are only counted"));
        }
    }

    fn ignored(&self, path: &str, why: &str) {
        let n = self.ignored.fetch_add(1, Ordering::Relaxed);
        if n < IGNORED_SHOWN {
            self.bar.suspend(|| eprintln!("shardstream pack: ignored {path} ({why})"));
        } else if n == IGNORED_SHOWN {
            self.bar.suspend(|| eprintln!("shardstream pack: further ignored files are only counted"));
        }
    }
}

/// Runs `shardstream pack`.
pub fn run_cli(args: PackArgs) -> anyhow::Result<()> {
    let opts = args.to_options();
    // S3 output: the uploads run on this runtime while the pack's own threads block on it.
    let s3 = match super::parse_dest(&opts.dest)? {
        super::Dest::S3 { .. } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let store = rt.block_on(S3Store::connect(S3Options::default()))?;
            Some((rt, store))
        }
        super::Dest::Local(_) => None,
    };
    super::interrupt::tell_on_interrupt(&format!(
        "shardstream pack: interrupted before it finished; readers refuse {} until it does: the same \
         command with --resume finishes it, keeping the shards written so far",
        opts.dest
    ))?;
    let display = Display::new();
    let result = pack_with(&opts, s3.as_ref().map(|(_, store)| store), &display);
    display.bar.finish_and_clear();
    let summary = result?;
    crate::cli::outln!("{}", summary.line())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct T {
            #[command(flatten)]
            a: PackArgs,
        }
        let t =
            T::try_parse_from(["x", "src", "-o", "out", "--shuffle", "--seed", "3", "--shard-size", "64M"]).unwrap();
        let o = t.a.to_options();
        assert_eq!((o.shuffle, o.seed, o.shard_size), (true, 3, 64 << 20));
        assert_eq!(o.upload, UploadOptions::default(), "the flags' defaults are the sink's");
        assert!(T::try_parse_from(["x", "src", "-o", "out", "--seed", "3"]).is_err());
        assert!(T::try_parse_from(["x", "src", "-o", "out", "--null"]).is_err());
        let t = T::try_parse_from(["x", "src", "-o", "out", "--files-from", "-", "-0", "--format", "parquet"]).unwrap();
        let o = t.a.to_options();
        assert_eq!((o.files_from, o.null_separated, o.format), (Some(FileList::Stdin), true, ShardFormat::Parquet));
    }
}
