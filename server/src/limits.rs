//! The allowed range of every size and count flag of `serve`, `index`, `prefetch` and `pack`.
//!
//! A flag outside its range is refused when the command line is parsed, with an error naming the
//! flag and the range, instead of being accepted and hurting later (`--s3-part-size 1` would
//! turn each shard into millions of GETs; `--prefetch-parallel 0` was silently raised to 1). The
//! ranges are constants with `check` functions, so a configuration file loader can apply the same
//! rules to the same settings; the `parse_*` functions are the clap value parsers.
//!
//! The bounds are sanity bounds, not tuning advice: wide enough for any real deployment, narrow
//! enough that a typo (a missing unit, an extra zero) is caught.

use crate::pack::cli::parse_size;

/// Largest encoded request the daemon decodes at all (its gRPC decoding limit). Requests name a
/// dataset and a few numbers; only replies carry data. A peer cannot make the daemon buffer more.
pub const MAX_REQUEST_BYTES: usize = 64 << 10;

/// Each RPC's own bound on its encoded request, checked after decoding (within
/// [`MAX_REQUEST_BYTES`]). A URL is at most a path (PATH_MAX is 4 KiB) or an S3 key (1 KiB) plus a
/// brace pattern; a stream request adds its field names and a fingerprint.
pub fn request_limit(rpc: &str) -> usize {
    match rpc {
        "Status" => 1 << 10,
        "OpenDataset" | "Prefetch" => 16 << 10,
        _ => MAX_REQUEST_BYTES,
    }
}

/// Refuses (`InvalidArgument`, naming the RPC and its bound) a request larger than its RPC's bound.
pub fn check_request<M: prost::Message>(rpc: &str, request: &M) -> Result<(), tonic::Status> {
    let (len, limit) = (request.encoded_len(), request_limit(rpc));
    if len > limit {
        return Err(tonic::Status::invalid_argument(format!(
            "{rpc} request of {len} bytes is larger than the {limit} bytes this RPC accepts"
        )));
    }
    Ok(())
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// The range of a count flag (threads, retries, slots, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountLimit {
    pub flag: &'static str,
    pub min: u64,
    pub max: u64,
}

impl CountLimit {
    /// `n` when it is in range, else an error naming the flag and the range.
    pub fn check(&self, n: u64) -> Result<u64, String> {
        if (self.min..=self.max).contains(&n) {
            Ok(n)
        } else {
            Err(format!("{} must be from {} to {}, not {n}", self.flag, self.min, self.max))
        }
    }

    /// Parses and checks a command-line value, as the flag's integer type.
    pub fn parse<T: TryFrom<u64>>(&self, s: &str) -> Result<T, String> {
        let n: u64 = s.trim().parse().map_err(|_| {
            format!("{} must be a whole number from {} to {}, not {s:?}", self.flag, self.min, self.max)
        })?;
        // The maxima below fit every flag's type; a failure here means a constant is wrong.
        T::try_from(self.check(n)?).map_err(|_| format!("{} = {n} does not fit this platform", self.flag))
    }
}

/// The range of a size flag, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeLimit {
    pub flag: &'static str,
    pub min: u64,
    pub max: u64,
    /// Why the range is what it is, when that is not obvious (appended to the error).
    pub why: &'static str,
}

impl SizeLimit {
    /// `bytes` when in range, else an error naming the flag and the range.
    pub fn check(&self, bytes: u64) -> Result<u64, String> {
        if (self.min..=self.max).contains(&bytes) {
            return Ok(bytes);
        }
        let why = if self.why.is_empty() { String::new() } else { format!(" ({})", self.why) };
        Err(format!(
            "{} must be at least {} and at most {}{why}, not {bytes} bytes",
            self.flag,
            human(self.min),
            human(self.max)
        ))
    }

    /// Parses a size with a unit (`8MiB`, `2GB`) and checks it.
    pub fn parse(&self, s: &str) -> Result<u64, String> {
        self.check(parse_size(s).map_err(|e| format!("{}: {e}", self.flag))?)
    }
}

/// `bytes` with the largest binary unit that divides it (the bounds above are all such).
pub fn human(bytes: u64) -> String {
    for (unit, name) in [(TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")] {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{} {name}", bytes / unit);
        }
    }
    format!("{bytes} bytes")
}

/// Threads of `index` and `pack`: more than a thousand only adds contention.
pub const THREADS: CountLimit = CountLimit { flag: "--threads", min: 1, max: 1024 };

// serve

pub const CACHE_SIZE: SizeLimit = SizeLimit { flag: "--cache-size", min: MIB, max: 1 << 50, why: "" };
pub const DECODED_BUDGET: SizeLimit =
    SizeLimit { flag: "--decoded-budget", min: MIB, max: 1 << 50, why: "memory for decoded Parquet row groups" };
pub const RDMA_BUDGET: SizeLimit =
    SizeLimit { flag: "--rdma-budget", min: MIB, max: 1 << 50, why: "staging memory for rdma streams" };
pub const INLINE_BUDGET: SizeLimit =
    SizeLimit { flag: "--inline-budget", min: MIB, max: 1 << 50, why: "memory for inline batches queued for clients" };
/// Seconds of consumption fetched ahead; a day is far past any useful horizon.
pub const PREFETCH_HORIZON_MAX_S: f64 = 86_400.0;
/// Seconds of silence before a TCP peer is pinged (`serve --tcp-timeout`); as the client's
/// `SHARDSTREAM_TCP_TIMEOUT`.
pub const TCP_TIMEOUT_S: CountLimit = CountLimit { flag: "--tcp-timeout", min: 1, max: 3600 };
pub const PREFETCH_PARALLEL: CountLimit = CountLimit { flag: "--prefetch-parallel", min: 1, max: 256 };
/// Ranged GETs: below 64 KiB the request overhead dominates; above 1 GiB one GET is one shard.
pub const S3_GET_PART_SIZE: SizeLimit =
    SizeLimit { flag: "--s3-part-size", min: 64 * KIB, max: GIB, why: "bytes per ranged GET" };
pub const S3_CONCURRENCY: CountLimit = CountLimit { flag: "--s3-concurrency", min: 1, max: 256 };
pub const S3_MAX_RETRIES: CountLimit = CountLimit { flag: "--s3-max-retries", min: 0, max: 100 };
/// At least two: a plain `for batch in loader:` still holds the last batch (and its credit or
/// slot) while it asks for the next, so with one it stops for good after the first batch.
pub const SHM_CREDITS: CountLimit =
    CountLimit { flag: "--shm-credits", min: 2, max: crate::transport::shm::MAX_CREDITS as u64 };
pub const RING_SLOTS: CountLimit =
    CountLimit { flag: "--ring-slots", min: 2, max: crate::transport::shm::MAX_CREDITS as u64 };
pub const MAX_STREAMS: CountLimit = CountLimit { flag: "--max-streams", min: 1, max: 16_384 };
pub const MAX_STREAMS_PER_CLIENT: CountLimit = CountLimit { flag: "--max-streams-per-client", min: 1, max: 16_384 };

// prefetch

/// `--shards 0` would ask for "all" by the wire protocol's convention: refused, leave it out.
pub const PREFETCH_SHARDS: CountLimit = CountLimit { flag: "--shards", min: 1, max: u32::MAX as u64 };

// pack

pub const SHARD_SIZE: SizeLimit = SizeLimit { flag: "--shard-size", min: 64 * KIB, max: TIB, why: "" };
pub const SAMPLES_PER_SHARD: CountLimit = CountLimit { flag: "--samples-per-shard", min: 1, max: u32::MAX as u64 };
pub const ROW_GROUP_SIZE: CountLimit = CountLimit { flag: "--row-group-size", min: 1, max: 1 << 24 };
pub const S3_UPLOAD_PART_SIZE: SizeLimit = SizeLimit {
    flag: "--s3-part-size",
    min: crate::pack::s3_sink::MIN_PART_SIZE,
    max: 5 * GIB,
    why: "S3's limits for one part of a multipart upload",
};
pub const S3_MULTIPART_THRESHOLD: SizeLimit = SizeLimit {
    flag: "--s3-multipart-threshold",
    min: crate::pack::s3_sink::MIN_PART_SIZE,
    max: crate::pack::s3_sink::MAX_PUT_SIZE,
    why: "S3's smallest part and largest single PUT",
};

// clap value parsers, one per flag.

pub fn parse_threads(s: &str) -> Result<usize, String> {
    THREADS.parse(s)
}
pub fn parse_cache_size(s: &str) -> Result<u64, String> {
    CACHE_SIZE.parse(s)
}
pub fn parse_decoded_budget(s: &str) -> Result<u64, String> {
    DECODED_BUDGET.parse(s)
}
pub fn parse_inline_budget(s: &str) -> Result<u64, String> {
    INLINE_BUDGET.parse(s)
}
pub fn parse_rdma_budget(s: &str) -> Result<u64, String> {
    RDMA_BUDGET.parse(s)
}
pub fn parse_prefetch_horizon(s: &str) -> Result<f64, String> {
    let bad =
        || format!("--prefetch-horizon must be a number of seconds from 0 to {PREFETCH_HORIZON_MAX_S}, not {s:?}");
    let v: f64 = s.trim().parse().map_err(|_| bad())?;
    if v.is_finite() && (0.0..=PREFETCH_HORIZON_MAX_S).contains(&v) { Ok(v) } else { Err(bad()) }
}
pub fn parse_tcp_timeout(s: &str) -> Result<u64, String> {
    TCP_TIMEOUT_S.parse(s)
}
pub fn parse_prefetch_parallel(s: &str) -> Result<usize, String> {
    PREFETCH_PARALLEL.parse(s)
}
pub fn parse_s3_get_part_size(s: &str) -> Result<u64, String> {
    S3_GET_PART_SIZE.parse(s)
}
pub fn parse_s3_concurrency(s: &str) -> Result<usize, String> {
    S3_CONCURRENCY.parse(s)
}
pub fn parse_s3_max_retries(s: &str) -> Result<u32, String> {
    S3_MAX_RETRIES.parse(s)
}
pub fn parse_shm_credits(s: &str) -> Result<u32, String> {
    SHM_CREDITS.parse(s)
}
pub fn parse_ring_slots(s: &str) -> Result<u32, String> {
    RING_SLOTS.parse(s)
}
pub fn parse_max_streams(s: &str) -> Result<usize, String> {
    MAX_STREAMS.parse(s)
}
pub fn parse_max_streams_per_client(s: &str) -> Result<usize, String> {
    MAX_STREAMS_PER_CLIENT.parse(s)
}
pub fn parse_prefetch_shards(s: &str) -> Result<u64, String> {
    PREFETCH_SHARDS.parse(s)
}
pub fn parse_shard_size(s: &str) -> Result<u64, String> {
    SHARD_SIZE.parse(s)
}
pub fn parse_samples_per_shard(s: &str) -> Result<u64, String> {
    SAMPLES_PER_SHARD.parse(s)
}
pub fn parse_row_group_size(s: &str) -> Result<usize, String> {
    ROW_GROUP_SIZE.parse(s)
}
pub fn parse_s3_upload_part_size(s: &str) -> Result<u64, String> {
    S3_UPLOAD_PART_SIZE.parse(s)
}
pub fn parse_s3_multipart_threshold(s: &str) -> Result<u64, String> {
    S3_MULTIPART_THRESHOLD.parse(s)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn parse(args: &[&str]) -> Result<Cli, String> {
        Cli::try_parse_from(std::iter::once("shardstream").chain(args.iter().copied())).map_err(|e| e.to_string())
    }

    fn refused(args: &[&str], needle: &str) {
        match parse(args) {
            Ok(c) => panic!("{args:?} accepted: {c:?}"),
            Err(e) => assert!(e.contains(needle), "{args:?}: {e}"),
        }
    }

    const SERVE: &[&str] = &["serve", "--listen", "unix:///tmp/s", "--cache-dir", "/tmp/c"];

    fn serve<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut v: Vec<&'a str> = SERVE.to_vec();
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn serve_defaults_are_in_range() {
        let Command::Serve(args) = parse(SERVE).unwrap().command else { panic!() };
        assert_eq!(args.s3_part_size, 32 * MIB);
        assert!(args.prefetch_parallel >= 1 && args.shm_credits >= 1 && args.ring_slots >= 1);
    }

    #[test]
    fn serve_flags_are_range_checked() {
        for (flag, bad, good, needle) in [
            ("--s3-part-size", "1", "64KiB", "--s3-part-size must be at least 64 KiB and at most 1 GiB"),
            ("--s3-part-size", "2GiB", "1GiB", "at most 1 GiB"),
            ("--cache-size", "1000", "1GiB", "--cache-size must be at least 1 MiB"),
            ("--cache-size", "0", "1MiB", "--cache-size must be at least 1 MiB and at most 1024 TiB, not 0 bytes"),
            ("--cache-size", "0.1", "1MiB", "--cache-size must be at least 1 MiB and at most 1024 TiB, not 0 bytes"),
            ("--prefetch-horizon", "1e6", "0", "--prefetch-horizon must be a number of seconds from 0 to 86400"),
            ("--prefetch-horizon=-1", "", "", "--prefetch-horizon must be a number of seconds"),
            ("--prefetch-horizon", "inf", "30.5", "--prefetch-horizon"),
            ("--prefetch-parallel", "0", "256", "--prefetch-parallel must be from 1 to 256, not 0"),
            ("--s3-concurrency", "0", "1", "--s3-concurrency must be from 1 to 256, not 0"),
            ("--s3-concurrency", "100000", "256", "not 100000"),
            ("--s3-max-retries", "101", "0", "--s3-max-retries must be from 0 to 100, not 101"),
            ("--shm-credits", "1", "1024", "--shm-credits must be from 2 to 1024, not 1"),
            ("--ring-slots", "1025", "2", "--ring-slots must be from 2 to 1024, not 1025"),
            ("--ring-slots", "x", "2", "--ring-slots must be a whole number"),
            ("--tcp-timeout", "0", "1", "--tcp-timeout must be from 1 to 3600, not 0"),
        ] {
            if bad.is_empty() {
                refused(&serve(&[flag]), needle); // flag=value (a negative number)
                continue;
            }
            refused(&serve(&[flag, bad]), needle);
            parse(&serve(&[flag, good])).unwrap_or_else(|e| panic!("{flag} {good}: {e}"));
        }
    }

    #[test]
    fn index_and_prefetch_flags_are_range_checked() {
        refused(&["index", "/d", "--threads", "0"], "--threads must be from 1 to 1024, not 0");
        parse(&["index", "/d", "--threads", "8"]).unwrap();
        refused(&["prefetch", "s3://b/p/", "--shards", "0"], "--shards must be from 1 to");
        parse(&["prefetch", "s3://b/p/", "--shards", "3"]).unwrap();
    }

    #[test]
    fn pack_flags_are_range_checked() {
        fn pack<'a>(extra: &[&'a str]) -> Vec<&'a str> {
            let mut v = vec!["pack", "/src", "--output", "/out"];
            v.extend_from_slice(extra);
            v
        }
        for (flag, bad, good, needle) in [
            ("--s3-part-size", "1", "5MiB", "--s3-part-size must be at least 5 MiB and at most 5 GiB"),
            ("--s3-part-size", "1MiB", "5GiB", "at least 5 MiB"),
            ("--s3-multipart-threshold", "6GiB", "16MiB", "--s3-multipart-threshold must be at least 5 MiB"),
            ("--shard-size", "1", "64KiB", "--shard-size must be at least 64 KiB and at most 1 TiB"),
            ("--shard-size", "0", "64KiB", "--shard-size must be at least 64 KiB and at most 1 TiB, not 0 bytes"),
            ("--samples-per-shard", "0", "1", "--samples-per-shard must be from 1 to"),
            ("--row-group-size", "0", "512", "--row-group-size must be from 1 to 16777216, not 0"),
            ("--threads", "0", "2", "--threads must be from 1 to 1024, not 0"),
            ("--threads", "many", "1024", "--threads must be a whole number"),
        ] {
            refused(&pack(&[flag, bad]), needle);
            parse(&pack(&[flag, good])).unwrap_or_else(|e| panic!("{flag} {good}: {e}"));
        }
        // The defaults themselves pass their own checks.
        parse(&pack(&[])).unwrap();
    }

    #[test]
    fn limits_are_usable_without_clap() {
        assert_eq!(S3_GET_PART_SIZE.check(8 * MIB), Ok(8 * MIB));
        assert!(S3_GET_PART_SIZE.check(1).unwrap_err().contains("--s3-part-size"));
        assert_eq!(RING_SLOTS.parse::<u32>("8"), Ok(8));
        assert_eq!(human(5 * GIB), "5 GiB");
        assert_eq!(human(1000), "1000 bytes");
    }

    #[test]
    fn requests_are_bounded_per_rpc() {
        let small = shardstream_proto::OpenRequest { url: "/data/train".into(), ..Default::default() };
        assert!(check_request("OpenDataset", &small).is_ok());
        let big = shardstream_proto::OpenRequest { url: "x".repeat(20 << 10), ..Default::default() };
        let e = check_request("OpenDataset", &big).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("OpenDataset") && e.message().contains("16384"), "{}", e.message());
        // The same URL fits a stream request's larger bound, and nothing exceeds the decoding limit.
        let stream = shardstream_proto::StreamRequest { url: "x".repeat(20 << 10), ..Default::default() };
        assert!(check_request("StreamBatches", &stream).is_ok());
        assert!(
            ["Status", "OpenDataset", "Prefetch", "StreamBatches"]
                .iter()
                .all(|r| request_limit(r) <= MAX_REQUEST_BYTES)
        );
    }
}
