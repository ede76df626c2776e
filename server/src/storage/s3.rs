//! S3 and S3-compatible object stores (MinIO, Ceph, s3s, ...): list a prefix once, read small
//! objects (manifest.json), write small objects (`shardstream index`), and download shards into
//! local files with parallel ranged GETs that resume where a broken body stopped. Uploads of
//! whole files (`shardstream pack`) live in [`super::s3_write`], on the same connection and policy.
//!
//! Configuration comes from the standard AWS chain (`AWS_*` environment variables, profiles, web
//! identity, instance metadata). With a custom endpoint (`AWS_ENDPOINT_URL` or
//! [`S3Options::endpoint`]) path-style addressing is the default, because S3-compatible stores
//! rarely have wildcard DNS for virtual-hosted buckets. The SDK's own retries are off: every
//! request goes through [`super::retry`], the one documented policy. Errors of the SDK are turned
//! into crate errors in exactly one function, [`classify`], which names the object.
//!
//! Downloaded bytes are checked against the object's ETag when it is an MD5 (what S3 gives a
//! single-part upload) and the caller has no better checksum: a body corrupted in transit is
//! downloaded again rather than cached ([`S3Store::download_checked`]).
//!
//! Credentials never appear in logs or errors: only bucket, key and the server's message do.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use tokio::sync::Semaphore;

use super::retry::RetryConfig;
use super::s3_tls;
use crate::storage::table_log::ICEBERG_METADATA;
use crate::{Error, Result};

/// Bytes per ranged GET. S3 serves ~50-100 MB/s per connection, so a 32 MiB part takes ~0.3-0.6 s
/// and the per-request overhead (~10-30 ms to first byte) stays under 10%, while a 1 GiB shard
/// still spreads over [`DEFAULT_CONCURRENCY`] connections. Larger than the 8 MiB it was: every GET
/// costs the server a request's work whatever its size (s3s-fs even hashes the whole object per
/// GET), and on a small machine that CPU is taken from the loader's own download; a shard of up
/// to 32 MiB is now one GET (bench/PROFILES.md: 0.55x -> 0.78x of a plain client on 2 cores).
pub const DEFAULT_PART_SIZE: u64 = 32 << 20;

/// Ranged GETs in flight per shard: 8 x ~80 MB/s saturates a 5 Gb/s share of the NIC per shard;
/// the prefetcher downloads several shards at once for more.
pub const DEFAULT_CONCURRENCY: usize = 8;

/// Ranged GETs in flight for the whole daemon: 64 x ~80 MB/s fills a 40 Gb/s NIC, and bounds
/// sockets and buffers (64 x [`WRITE_CHUNK`]) whatever the number of shards in flight.
pub const MAX_GETS_IN_FLIGHT: usize = 64;

/// Small GETs of many objects in flight for the whole daemon ([`S3Store::get_each`]): half of
/// [`MAX_GETS_IN_FLIGHT`], so the fetches of streams already running keep the other half.
pub const PROBES_IN_FLIGHT: usize = MAX_GETS_IN_FLIGHT / 2;

/// Received bytes are held until this many have arrived, then written with one positioned
/// vectored write: large enough that the write syscall is negligible, small enough that a
/// download holds little memory. The body's own buffers are written as they are: gathering them
/// into one buffer first cost a copy of every downloaded byte, on a machine where the S3 server
/// and the trainer want the same cores (bench/PROFILES.md).
const WRITE_CHUNK: usize = 1 << 20;

/// Most buffers in one `pwritev` (Linux's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;

/// Whole downloads made of an object whose bytes do not match its ETag before the download fails:
/// a corruption in transit is rare and random, a second one in a row rarer still.
const MAX_ETAG_MISMATCHES: u32 = 3;

/// Read size of the MD5 pass over a downloaded file (from the page cache).
const MD5_CHUNK: usize = 1 << 20;

/// A body that delivers nothing for this long is treated as a dead connection and resumed.
const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Connecting to an S3 endpoint takes milliseconds; a connect that has not succeeded in this time
/// is retried rather than waited on.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long to wait for a response's headers before retrying.
const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(30);

/// Options for the S3 backend (from the daemon's command line).
#[derive(Debug, Clone)]
pub struct S3Options {
    /// Endpoint URL of an S3-compatible store; `None`: the AWS chain's (`AWS_ENDPOINT_URL`).
    pub endpoint: Option<String>,
    /// Path-style addressing; `None`: on when a custom endpoint is set.
    pub force_path_style: Option<bool>,
    pub part_size: u64,
    pub concurrency: usize,
    pub retry: RetryConfig,
}

impl Default for S3Options {
    fn default() -> Self {
        Self {
            endpoint: None,
            force_path_style: None,
            part_size: DEFAULT_PART_SIZE,
            concurrency: DEFAULT_CONCURRENCY,
            retry: RetryConfig::default(),
        }
    }
}

/// An object found by listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub etag: Option<String>,
    /// LastModified, in ns since the Unix epoch: what names the version when a store lists no
    /// ETags (some S3-compatible ones do not).
    pub modified_ns: Option<i64>,
}

/// Why a GET's answer is of another version of `obj` than the one listed (or indexed): the
/// object's whole size (`Content-Range`'s total) is not `obj.len`, or, for an object listed
/// without an ETag (whose GETs carry no `If-Match`), its `Last-Modified` is more than a second
/// from the listed one (the header holds whole seconds; a rewrite within that goes unseen). A
/// manifest's CRC covers only the bytes it indexed: a shard grown since would lose what was
/// appended, unsaid.
fn changed_since_listed(
    obj: &ObjectRef,
    content_range: Option<&str>,
    modified: Option<&aws_sdk_s3::primitives::DateTime>,
) -> Option<String> {
    let total = content_range.and_then(|r| r.rsplit_once('/')).and_then(|(_, t)| t.trim().parse::<u64>().ok());
    if let Some(total) = total
        && total != obj.len
    {
        return Some(format!(
            "is {total} bytes on the server, not the {} it was listed or indexed with: it changed since; open the \
             dataset again (with a manifest.json: run `shardstream index` again)",
            obj.len
        ));
    }
    let (None, Some(listed_ns), Some(now)) = (&obj.etag, obj.modified_ns, modified) else { return None };
    let listed = listed_ns.div_euclid(1_000_000_000);
    // Within a second either way: the header holds whole seconds, which a store may round up
    // from the listing's fractions (Swift does) or down (S3 does).
    (now.secs().abs_diff(listed) > 1).then(|| {
        format!(
            "was modified on the server (Last-Modified {}) after it was listed ({listed} s since the epoch): it \
             changed since; open the dataset again",
            now.secs()
        )
    })
}

/// What a download needs to know about its object.
#[derive(Debug, Clone)]
pub struct ObjectRef {
    pub bucket: String,
    pub key: String,
    pub len: u64,
    /// When set, every ranged GET carries `If-Match`: all parts come from one version of the
    /// object, or the download fails naming it. An ETag that is an MD5 (a single-part upload's,
    /// 32 hex digits) is also checked against the downloaded bytes: the integrity check of a
    /// dataset without manifest, whose CRC-32C nobody knows.
    pub etag: Option<String>,
    /// LastModified as listed (ns since the Unix epoch): without an ETag, what names the version
    /// listed, which every GET's answer must still have ([`changed_since_listed`]).
    pub modified_ns: Option<i64>,
}

impl ObjectRef {
    /// An object known by its name and size alone: no ETag or time to hold its GETs to (what
    /// `pack` reads back, what `index` lists).
    pub fn new(bucket: impl Into<String>, key: impl Into<String>, len: u64) -> Self {
        Self { bucket: bucket.into(), key: key.into(), len, etag: None, modified_ns: None }
    }

    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }
}

/// Progress and counters a download reports (bytes as they land, retries as they happen).
pub trait DownloadObserver: Send + Sync {
    fn bytes(&self, _n: u64) {}
    fn retry(&self) {}
}

impl DownloadObserver for () {}

/// A connection to one S3 endpoint, shared by every dataset and stream of the daemon.
#[derive(Debug, Clone)]
pub struct S3Store {
    pub(super) client: aws_sdk_s3::Client,
    options: S3Options,
    /// [`Self::answers_over_tls`].
    tls: bool,
    gets: Arc<Semaphore>,
    /// Slots of [`Self::get_each`]'s GETs, within `gets`.
    probes: Arc<Semaphore>,
    /// Where blocking callers run their requests.
    rt: tokio::runtime::Handle,
    /// Cancelled when the daemon stops ([`Self::close`]): no request is retried after that.
    closing: tokio_util::sync::CancellationToken,
}

/// The outcome of one failed request: worth retrying, or final.
pub(super) enum Failure {
    Transient(String),
    Permanent(Error),
}

/// Whose AWS settings an error points at: trainers never talk to S3 themselves.
const WHOSE_CREDENTIALS: &str = "the process that reads or writes the bucket: the daemon's for a Loader or \
     `shardstream prefetch`, the command's own for `shardstream pack` or `index`";

/// Maps an SDK error for `url` to a retry decision or a crate error. The one place SDK errors
/// are interpreted: status codes, not message texts, decide.
pub(super) fn classify<E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static>(
    url: &str,
    err: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> Failure {
    let status = err.raw_response().map(|r| r.status().as_u16());
    let code = err.code().map(str::to_owned);
    // The whole cause chain (plain Display hides it), without the Debug dump that the SDK's
    // DisplayErrorContext appends: the message reaches trainers.
    let detail = shardstream_client::error_chain(&err);
    // The handshake with the store was refused (its certificate not trusted, nothing in common):
    // every later one ends the same way, and ten retries would only hide why. (A credential
    // provider's own refusal is the credentials' error, below.)
    if matches!(err, SdkError::DispatchFailure(_))
        && !names_credentials(&err)
        && let Some(why) = s3_tls::handshake_refused(&err)
    {
        return Failure::Permanent(Error::invalid(format!("{url}: {why}: {detail}")));
    }
    match (&err, status) {
        (SdkError::TimeoutError(_), _) => Failure::Transient(detail),
        (SdkError::DispatchFailure(d), _) if d.as_connector_error().is_some_and(may_recover) => {
            Failure::Transient(detail)
        }
        // The request could not be made at all, for a reason no retry mends: no credentials
        // anywhere, an endpoint that is no URL.
        (SdkError::DispatchFailure(_), _) if names_credentials(&err) => Failure::Permanent(Error::PermissionDenied {
            path: url.to_owned(),
            reason: format!(
                "no usable AWS credentials ({detail}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, \
                 AWS_PROFILE, or give the node a role, in the environment of {WHOSE_CREDENTIALS}"
            ),
        }),
        (SdkError::DispatchFailure(_), _) => Failure::Permanent(Error::invalid(format!(
            "{url}: the request could not be made: {detail} (check AWS_ENDPOINT_URL and the other AWS_* settings \
             of {WHOSE_CREDENTIALS})"
        ))),
        (_, Some(404)) => Failure::Permanent(Error::NotFound { what: "S3 object", path: url.to_owned() }),
        (_, Some(401 | 403)) => Failure::Permanent(Error::PermissionDenied {
            path: url.to_owned(),
            reason: format!(
                "{} (check the bucket policy, and the AWS_* credentials of {WHOSE_CREDENTIALS})",
                code.as_deref().unwrap_or("denied")
            ),
        }),
        (_, Some(412)) => Failure::Permanent(Error::Shard {
            shard: url.to_owned(),
            offset: None,
            reason: "changed on the server while it was being read (ETag no longer matches)".into(),
        }),
        // Bytes asked for by a manifest or listing lie past the object's end: it shrank since.
        (_, Some(416)) => Failure::Permanent(Error::Shard {
            shard: url.to_owned(),
            offset: None,
            reason: "shorter than when it was listed or indexed (the range asked for is past its end): it changed \
                     on the server; index the dataset again"
                .into(),
        }),
        // A server that does not implement a request (some S3-compatible stores lack
        // AbortMultipartUpload, for one) will not implement it on the next try either.
        (_, Some(501)) => Failure::Permanent(Error::Unavailable(format!(
            "{url}: the server does not implement this request: {detail}"
        ))),
        (_, Some(408 | 425 | 429 | 499 | 500..=599)) => Failure::Transient(detail),
        (SdkError::ResponseError(_), _) => Failure::Transient(detail),
        (_, Some(s @ 400..=499)) => refused(url, s, code.as_deref(), detail),
        (_, Some(s)) => Failure::Permanent(Error::Unavailable(format!("{url}: S3 answered {s}: {detail}"))),
        _ => Failure::Permanent(Error::Unavailable(format!("{url}: {detail}"))),
    }
}

/// A 4xx not handled on its own, by S3's error code: a code that comes and goes (the SDK's own
/// transient and throttling codes, a conflicting operation S3 says to try again, a body cut short
/// on its way) is retried; credentials that expired mid-epoch are the credentials' error; any
/// other refuses the request itself (a bucket name the store does not take, say), the same on
/// every try: a `ValueError`, not the `ConnectionError` reconnect logic retries for good.
fn refused(url: &str, status: u16, code: Option<&str>, detail: String) -> Failure {
    match code {
        Some(
            "RequestTimeout"
            | "RequestTimeoutException"
            | "RequestLimitExceeded"
            | "BandwidthLimitExceeded"
            | "Throttling"
            | "ThrottlingException"
            | "SlowDown"
            | "OperationAborted"
            | "IncompleteBody",
        ) => Failure::Transient(detail),
        Some(c @ ("ExpiredToken" | "InvalidToken" | "TokenRefreshRequired")) => {
            Failure::Permanent(Error::PermissionDenied {
                path: url.to_owned(),
                reason: format!("{c} (the credentials expired or are not valid: refresh them)"),
            })
        }
        _ => Failure::Permanent(Error::invalid(format!("{url}: S3 refused the request ({status}): {detail}"))),
    }
}

/// Whether a request that could not be sent may go through on a later try: a connection or
/// timeout failure, or one the SDK itself calls transient. Anything else (no credentials, an
/// endpoint that is no URL) fails the same way every time.
fn may_recover(d: &aws_sdk_s3::error::ConnectorError) -> bool {
    use aws_smithy_types::retry::ErrorKind;
    d.is_io()
        || d.is_timeout()
        || matches!(d.as_other(), Some(ErrorKind::TransientError | ErrorKind::ThrottlingError | ErrorKind::ServerError))
}

/// Whether the credential chain's error is somewhere in `err`'s causes.
fn names_credentials(err: &(dyn std::error::Error + 'static)) -> bool {
    s3_tls::causes(err).any(|e| e.is::<aws_credential_types::provider::error::CredentialsError>())
}

/// Picks a dataset's shards from a listing of its prefix: objects directly under it with a shard
/// extension (sorted by name) that `pick` keeps, or exactly its names in the given order.
/// Returns (name, object).
fn shards_in_listing(
    listed: Vec<ObjectInfo>,
    bucket: &str,
    prefix: &str,
    pick: &crate::storage::Pick,
) -> Result<Vec<(String, ObjectInfo)>> {
    // The listing is recursive: keys below a "subdirectory" are not the dataset's, but they say
    // where its shards are when the prefix holds none of its own.
    let mut nested = std::collections::BTreeSet::new();
    let mut unserved = crate::storage::Unserved::default();
    let mut found: Vec<(String, ObjectInfo)> = Vec::new();
    // Shards at any depth below a subdirectory, for a partitioned prefix ([`partitions`]).
    let mut below: Vec<(String, ObjectInfo)> = Vec::new();
    let mut partitioned: Option<String> = None;
    // A listing of the whole place (not a glob's or named files' pick).
    let whole = matches!(pick, crate::storage::Pick::All | crate::storage::Pick::Every);
    // An Iceberg table's own prefix holds no shard but `metadata/` and `data/` below it.
    let mut iceberg = false;
    // `pack`'s journal, and whether the manifest it writes last is there.
    let (mut pack_journal, mut manifest) = (None, false);
    for o in listed {
        let Some(name) = o.key.strip_prefix(prefix) else { continue };
        match name.split_once('/') {
            None if !name.is_empty() => {
                manifest |= name == crate::index::manifest::MANIFEST_FILE;
                unserved.note(name);
                found.push((name.to_owned(), o));
            }
            Some((sub, _)) if sub == crate::storage::table_log::DELTA_LOG && whole => {
                return Err(crate::storage::table_log::delta_table(&format!("s3://{bucket}/{prefix}")));
            }
            Some((sub, rest))
                if sub == crate::index::manifest::SIDECAR_DIR && rest == crate::pack::journal::JOURNAL_FILE =>
            {
                pack_journal = Some(o.key.clone());
            }
            Some((sub, rest)) => {
                iceberg |= sub == ICEBERG_METADATA && crate::storage::table_log::is_iceberg_metadata(rest);
                if partitioned.is_none() && crate::storage::partitions::key_value(sub).is_some() {
                    partitioned = Some(sub.to_owned());
                }
                let file = crate::storage::pick::file_name(rest);
                if crate::format::Format::is_shard_name(file) && !crate::storage::partitions::hidden_path(name) {
                    if !rest.contains('/') && !nested.contains(sub) {
                        nested.insert(sub.to_owned());
                    }
                    below.push((name.to_owned(), o));
                }
            }
            _ => {}
        }
    }
    // `pack` uploads each shard to its final key as it completes, its journal before the first
    // and the manifest last: a journal without a manifest is a pack still running or interrupted,
    // whose shards are only part of its dataset. [`S3Store::list_picked`] adds the journal and
    // manifest to a glob's narrowed listing.
    let names = matches!(pick, crate::storage::Pick::Names(_));
    if let Some(journal) = pack_journal.filter(|_| !names && !manifest) {
        let shards: Vec<&str> = found
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| crate::format::Format::is_shard_name(n) && !crate::storage::pick::is_hidden(n))
            .collect();
        return Err(crate::pack::journal::unfinished(
            &format!("s3://{bucket}/{prefix}"),
            &format!("s3://{bucket}/{journal}"),
            &shards,
        ));
    }
    let own_shard =
        |(n, _): &&(String, ObjectInfo)| crate::format::Format::is_shard_name(n) && !crate::storage::pick::is_hidden(n);
    if iceberg && whole && !found.iter().any(|f| own_shard(&f)) {
        let place = format!("s3://{bucket}/{prefix}");
        return Err(crate::storage::table_log::iceberg_table(&place, &place));
    }
    if let (Some(part), true) = (&partitioned, whole) {
        let place = format!("s3://{bucket}/{prefix}");
        let here = found.iter().find(own_shard);
        if let Some((shard, _)) = here {
            return Err(crate::storage::partitions::beside_partitions(&place, shard, part));
        }
        below.sort_by(|a, b| a.0.cmp(&b.0));
        found = crate::storage::partitions::partitioned(below, |(n, _)| n.as_str(), &place)?;
    }
    let shards = match pick {
        crate::storage::Pick::Names(names) => {
            let mut by_name: std::collections::HashMap<String, ObjectInfo> = found.into_iter().collect();
            names
                .iter()
                .map(|n| {
                    by_name.remove(n).map(|o| (n.clone(), o)).ok_or_else(|| match nested.contains(n) {
                        true => Error::NotFound {
                            what: "S3 object",
                            path: format!(
                                "s3://{bucket}/{prefix}{n} (a prefix of shards has that name: \
                                 s3://{bucket}/{prefix}{n}/; end the URL with '/' to read it)"
                            ),
                        },
                        false => Error::NotFound { what: "shard", path: format!("s3://{bucket}/{prefix}{n}") },
                    })
                })
                .collect::<Result<_>>()?
        }
        crate::storage::Pick::All | crate::storage::Pick::Every | crate::storage::Pick::Glob(_) => {
            found.retain(|(n, _)| crate::format::Format::is_shard_name(n));
            if whole
                && partitioned.is_none()
                && !found.is_empty()
                && let Some(e) = unserved.beside_shards(&format!("s3://{bucket}/{prefix}"))
            {
                return Err(e);
            }
            found.sort_by(|a, b| a.0.cmp(&b.0));
            pick.keep_listed(found, |(n, _)| n.as_str(), &format!("s3://{bucket}/{prefix}"))?
        }
    };
    if shards.is_empty() {
        let nested: Vec<String> = nested.into_iter().collect();
        return Err(crate::storage::no_shards(
            "shards (*.tar or *.parquet objects)",
            format!("s3://{bucket}/{prefix}"),
            "prefix",
            &nested,
            &unserved,
        ));
    }
    Ok(shards)
}

/// "1 retry", "3 retries": how a failure that outlasted its retries says so.
fn retries(n: u32) -> String {
    if n == 1 { "1 retry".into() } else { format!("{n} retries") }
}

/// The prefix to list for the objects of `prefix` that `pick` can take: a glob's literal start,
/// or what named shards' names share (`train-{000000..000099}.tar`: `train-0000`), narrows the
/// listing of a prefix that holds other files (train, test and validation side by side).
fn listing_prefix(prefix: &str, pick: &crate::storage::Pick) -> String {
    match pick {
        crate::storage::Pick::Glob(g) => format!("{prefix}{}", g.literal_prefix()),
        crate::storage::Pick::Names(names) => format!("{prefix}{}", shared_start(names)),
        crate::storage::Pick::All | crate::storage::Pick::Every => prefix.to_owned(),
    }
}

/// The longest start every name has (cut back to a character boundary).
fn shared_start(names: &[String]) -> &str {
    let Some((first, rest)) = names.split_first() else { return "" };
    let mut end = first.len();
    for n in rest {
        end = first.bytes().zip(n.bytes()).take(end).take_while(|(a, b)| a == b).count();
    }
    while !first.is_char_boundary(end) {
        end -= 1;
    }
    &first[..end]
}

impl S3Store {
    /// Loads the AWS configuration from the standard chain and builds a client. Async: the
    /// chain may query instance metadata.
    pub async fn connect(options: S3Options) -> Result<Self> {
        use aws_smithy_http_client::tls;
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
            .tls_context(s3_tls::context().await?)
            .build_https();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(http)
            .retry_config(aws_config::retry::RetryConfig::disabled())
            .timeout_config(
                aws_config::timeout::TimeoutConfig::builder()
                    .connect_timeout(CONNECT_TIMEOUT)
                    .read_timeout(FIRST_BYTE_TIMEOUT)
                    .build(),
            );
        if let Some(endpoint) = &options.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        let sdk = loader.load().await;
        let endpoint = s3_tls::endpoint(&sdk);
        let mut config = aws_sdk_s3::config::Builder::from(&sdk)
            .force_path_style(options.force_path_style.unwrap_or(endpoint.is_some()));
        if sdk.region().is_none() {
            // S3-compatible stores ignore the region but SigV4 needs one; AWS itself redirects.
            config = config.region(aws_sdk_s3::config::Region::from_static("us-east-1"));
        }
        let tls = endpoint.as_deref().is_none_or(s3_tls::is_https);
        // What decides how Parquet copies are checked (`answers_over_tls`), said once.
        tracing::info!(endpoint = endpoint.as_deref().unwrap_or("AWS"), tls, "S3 connection");
        Ok(Self {
            client: aws_sdk_s3::Client::from_conf(config.build()),
            options,
            tls,
            gets: Arc::new(Semaphore::new(MAX_GETS_IN_FLIGHT)),
            probes: Arc::new(Semaphore::new(PROBES_IN_FLIGHT)),
            rt: tokio::runtime::Handle::current(),
            closing: tokio_util::sync::CancellationToken::new(),
        })
    }

    pub fn options(&self) -> &S3Options {
        &self.options
    }

    /// True when every answer reaches the daemon over TLS, whose record MACs check its bytes in
    /// transit: an `https://` endpoint, or AWS's own (no custom endpoint: always HTTPS).
    pub fn answers_over_tls(&self) -> bool {
        self.tls
    }

    /// Stops retrying, for good: a failed request (or one waiting to be retried) fails at once.
    /// The daemon calls it before its runtime goes: a fetch thread still retrying then would
    /// have slept on the stopped runtime's timer, which panics (and the next try could only
    /// fail: the runtime's connections are gone with it).
    pub fn close(&self) {
        self.closing.cancel();
    }

    /// The shards of `s3://bucket/prefix` that `pick` takes ([`shards_in_listing`]) from one
    /// listing, narrowed to a glob's literal prefix. Blocking, as [`S3Store::block_on`].
    pub fn list_picked(
        &self,
        bucket: &str,
        prefix: &str,
        pick: &crate::storage::Pick,
    ) -> Result<Vec<(String, ObjectInfo)>> {
        let whole = matches!(pick, crate::storage::Pick::All | crate::storage::Pick::Every);
        let listing = listing_prefix(prefix, pick);
        let (listed, iceberg, journal) = self.block_on(async {
            tokio::join!(
                self.list(bucket, &listing),
                self.iceberg_data(bucket, prefix, whole),
                self.pack_journal_beside(bucket, prefix, &listing, pick)
            )
        });
        // The prefix's own failure first: a missing bucket is named by the URL given.
        let mut listed = listed?;
        listed.extend(journal?);
        if let Some(table) = iceberg? {
            return Err(crate::storage::table_log::iceberg_table(
                &format!("s3://{bucket}/{table}"),
                &format!("s3://{bucket}/{prefix}"),
            ));
        }
        shards_in_listing(listed, bucket, prefix, pick)
    }

    /// For a glob, whose listing starts at its literal prefix: a pack journal under `prefix` and,
    /// when there is one, the manifest beside it, which the narrowed listing cannot hold. One
    /// request of one key, and one more only beside a journal.
    async fn pack_journal_beside(
        &self,
        bucket: &str,
        prefix: &str,
        listing: &str,
        pick: &crate::storage::Pick,
    ) -> Result<Vec<ObjectInfo>> {
        use crate::index::manifest::{MANIFEST_FILE, SIDECAR_DIR};
        let key = format!("{prefix}{SIDECAR_DIR}/{}", crate::pack::journal::JOURNAL_FILE);
        if !matches!(pick, crate::storage::Pick::Glob(_)) || key.starts_with(listing) {
            return Ok(Vec::new());
        }
        let mut found = self.list_pages(bucket, &key, Some(1)).await?;
        found.retain(|o| o.key == key);
        if !found.is_empty() {
            let manifest = format!("{prefix}{MANIFEST_FILE}");
            found.extend(self.list_pages(bucket, &manifest, Some(1)).await?.into_iter().filter(|o| o.key == manifest));
        }
        Ok(found)
    }

    /// The table above `prefix` when it is an Iceberg table's `data/` ([`crate::storage::table_log`]),
    /// for a listing of the `whole` prefix: one page of the `metadata/` beside it, for a prefix
    /// named `data/` only.
    async fn iceberg_data<'a>(&self, bucket: &str, prefix: &'a str, whole: bool) -> Result<Option<&'a str>> {
        let Some(table) = crate::storage::table_log::iceberg_table_above(prefix).filter(|_| whole) else {
            return Ok(None);
        };
        let page = self.list_pages(bucket, &format!("{table}{ICEBERG_METADATA}/"), Some(1)).await?;
        let found = page
            .iter()
            .any(|o| crate::storage::table_log::is_iceberg_metadata(crate::storage::pick::file_name(&o.key)));
        Ok(found.then_some(table))
    }

    /// Runs `f` on the store's runtime from a blocking thread (never from async code).
    pub fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.block_on(f)
    }

    /// Starts `f` on the store's runtime, so that requests run while the caller's thread goes on.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.rt.spawn(f)
    }

    /// Fails when the daemon is stopping ([`Self::close`]): no new request goes out then. A fetch
    /// thread the daemon does not join may start one as its runtime goes, and the runtime's
    /// drivers may be gone under it.
    fn open_for_requests(&self, url: &str, what: &str) -> Result<()> {
        if self.closing.is_cancelled() {
            return Err(Error::Unavailable(format!("{url}: no {what} sent: the daemon is stopping")));
        }
        Ok(())
    }

    /// Waits `delay` before retrying a request that failed with `msg`, unless the daemon is
    /// stopping ([`Self::close`]): then the request fails now. The closing branch is polled first,
    /// so once the daemon stops the timer is never polled again (its driver may be gone).
    async fn pause_before_retry(&self, delay: Duration, url: &str, what: &str, msg: &str) -> Result<()> {
        let stopping =
            || Error::Unavailable(format!("{url}: {what} failed and was not retried: the daemon is stopping ({msg})"));
        if self.closing.is_cancelled() {
            return Err(stopping());
        }
        tokio::select! {
            biased;
            () = self.closing.cancelled() => Err(stopping()),
            () = tokio::time::sleep(delay) => Ok(()),
        }
    }

    /// Retries `op` by the policy until it succeeds or fails for good.
    pub(super) async fn retrying<T, F, Fut>(&self, url: &str, what: &'static str, mut op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, Failure>>,
    {
        let mut backoff = self.options.retry.start();
        loop {
            self.open_for_requests(url, what)?;
            crate::metrics::storage_request("s3", what);
            match op().await {
                Ok(v) => return Ok(v),
                Err(Failure::Permanent(e)) => return Err(e),
                Err(Failure::Transient(msg)) => match backoff.next_delay() {
                    Some(d) => {
                        // Logged when it failed, not after the pause: a log line's time is the failure's.
                        tracing::warn!(object = %url, attempt = backoff.attempts(), retry_in_ms = d.as_millis() as u64, error = %msg, "s3 request failed, retrying");
                        self.pause_before_retry(d, url, what, &msg).await?;
                        crate::metrics::storage_retry("s3");
                    }
                    None => {
                        return Err(Error::Unavailable(format!(
                            "{url}: {what} failed after {} in {:.1} s: {msg}",
                            retries(backoff.attempts()),
                            backoff.elapsed().as_secs_f64()
                        )));
                    }
                },
            }
        }
    }

    /// Lists every object under `prefix`, page by page (each page retried on its own).
    pub async fn list(&self, bucket: &str, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.list_pages(bucket, prefix, None).await
    }

    /// Lists the objects under `prefix` on at most `most_pages` pages (all when `None`).
    async fn list_pages(&self, bucket: &str, prefix: &str, most_pages: Option<usize>) -> Result<Vec<ObjectInfo>> {
        let url = format!("s3://{bucket}/{prefix}");
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        for page_number in 1.. {
            let page = self
                .retrying(&url, "list", || async {
                    self.client
                        .list_objects_v2()
                        .bucket(bucket)
                        .prefix(prefix)
                        .set_continuation_token(token.clone())
                        .send()
                        .await
                        .map_err(|e| classify(&url, e))
                })
                .await;
            let page = match page {
                Err(Error::NotFound { .. }) => return Err(Error::NotFound { what: "S3 bucket", path: url }),
                other => other?,
            };
            for o in page.contents() {
                let (Some(key), Some(size)) = (o.key(), o.size()) else { continue };
                out.push(ObjectInfo {
                    key: key.to_owned(),
                    size: u64::try_from(size).unwrap_or(0),
                    etag: o.e_tag().map(str::to_owned),
                    modified_ns: o
                        .last_modified()
                        .and_then(|t| t.secs().checked_mul(1_000_000_000)?.checked_add(i64::from(t.subsec_nanos()))),
                });
            }
            token = page.next_continuation_token().map(str::to_owned);
            if page.is_truncated() != Some(true) || token.is_none() || most_pages == Some(page_number) {
                break;
            }
        }
        Ok(out)
    }

    /// Reads a whole small object (a manifest); `Ok(None)` when it does not exist.
    pub async fn get_small(&self, bucket: &str, key: &str) -> Result<Option<Bytes>> {
        let url = format!("s3://{bucket}/{key}");
        let got = self
            .retrying(&url, "get", || async {
                let resp =
                    self.client.get_object().bucket(bucket).key(key).send().await.map_err(|e| classify(&url, e))?;
                let md5 = resp
                    .e_tag()
                    .filter(|_| etag_may_be_md5(resp.server_side_encryption(), resp.sse_customer_algorithm()))
                    .and_then(etag_md5);
                let body =
                    resp.body.collect().await.map(|b| b.into_bytes()).map_err(|e| Failure::Transient(e.to_string()))?;
                // A body changed in transit is fetched again, like a broken one.
                match md5 {
                    Some(want) if md5_of(&body) != want => {
                        Err(Failure::Transient("body does not match its ETag (MD5): corrupted in transit".into()))
                    }
                    _ => Ok(body),
                }
            })
            .await;
        match got {
            Ok(b) => {
                crate::metrics::storage_bytes("s3", b.len() as u64);
                Ok(Some(b))
            }
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Reads bytes `range` of `obj` into memory with one ranged GET (retried as a whole): a
    /// Parquet footer, never a whole shard. Carries `If-Match` when `obj.etag` is known, so the
    /// bytes come from the version the caller listed. A short or long body is an error. Returns
    /// the bytes and the ETag the server answered with (a listing may not give one).
    pub async fn get_range(&self, obj: &ObjectRef, range: Range<u64>) -> Result<(Bytes, Option<String>)> {
        self.get_range_answered(obj, range).await.map(|(bytes, etag, _)| (bytes, etag))
    }

    /// [`Self::get_range`], and whether the answer's ETag may check its object whole (the MD5's
    /// form, and [`etag_may_be_md5`]), as [`Self::get_each`] says it.
    pub async fn get_range_etag_md5(
        &self,
        obj: &ObjectRef,
        range: Range<u64>,
    ) -> Result<(Bytes, Option<String>, bool)> {
        let (bytes, etag, may_be_md5) = self.get_range_answered(obj, range).await?;
        let md5 = answer_may_be_md5(etag.as_deref(), may_be_md5);
        Ok((bytes, etag, md5))
    }

    /// [`Self::get_range`], and whether the answer's ETag may be the MD5 of the object's bytes
    /// ([`etag_may_be_md5`]).
    async fn get_range_answered(&self, obj: &ObjectRef, range: Range<u64>) -> Result<(Bytes, Option<String>, bool)> {
        let url = obj.url();
        let want = range.end.saturating_sub(range.start);
        if want == 0 {
            return Ok((Bytes::new(), obj.etag.clone(), true));
        }
        let got = self
            .retrying(&url, "get", || async {
                let resp = self
                    .client
                    .get_object()
                    .bucket(&obj.bucket)
                    .key(&obj.key)
                    .range(format!("bytes={}-{}", range.start, range.end - 1))
                    .set_if_match(obj.etag.clone())
                    .send()
                    .await
                    .map_err(|e| classify(&url, e))?;
                if let Some(why) = changed_since_listed(obj, resp.content_range(), resp.last_modified()) {
                    return Err(Failure::Permanent(Error::Shard { shard: url.clone(), offset: None, reason: why }));
                }
                let etag = resp.e_tag().map(str::to_owned);
                let may_be_md5 = etag_may_be_md5(resp.server_side_encryption(), resp.sse_customer_algorithm());
                let body =
                    resp.body.collect().await.map(|b| b.into_bytes()).map_err(|e| Failure::Transient(e.to_string()))?;
                if body.len() as u64 != want {
                    return Err(Failure::Transient(format!(
                        "ranged GET of {want} bytes at {} answered {} bytes",
                        range.start,
                        body.len()
                    )));
                }
                Ok((body, etag, may_be_md5))
            })
            .await?;
        crate::metrics::storage_bytes("s3", got.0.len() as u64);
        Ok(got)
    }

    /// Reads `ranges` of `obj` (a file's column chunks) with one ranged GET each, up to the
    /// store's per-shard concurrency at once and within its daemon-wide cap, and hands each
    /// range's bytes to `each` with the range's index, in the order they arrive (one after the
    /// other, each range cost its round trip). The first failure ends the call and cancels the
    /// GETs still running. Returns what the GETs answered of the object (its ETag); GETs that
    /// answered different ETags (the object replaced between them, possible only without
    /// `obj.etag`, which every GET sends as `If-Match`) are an error naming it.
    pub async fn get_ranges(
        &self,
        obj: &ObjectRef,
        ranges: &[Range<u64>],
        mut each: impl FnMut(usize, Bytes) -> Result<()>,
    ) -> Result<Answered> {
        let per_call = Arc::new(Semaphore::new(self.options.concurrency.max(1)));
        let shared = Arc::new(obj.clone());
        let mut answered = Answered::default();
        let mut tasks = tokio::task::JoinSet::new();
        self.spawn_gets(&mut tasks, &per_call, ranges.iter().cloned().enumerate().map(|(i, r)| (i, shared.clone(), r)));
        while let Some(joined) = tasks.join_next().await {
            // Dropping the set aborts the other GETs at once.
            let (i, got) = joined.map_err(|e| join_failed(e, &obj.url()))?;
            let (bytes, etag, may_be_md5) = got?;
            if answered.record(etag.as_deref(), may_be_md5) {
                return Err(changed_mid_read(obj.url()));
            }
            each(i, bytes)?
        }
        Ok(answered)
    }

    /// Reads one range of each of `reads` (a few KiB of many objects: their first page
    /// headers), at most [`PROBES_IN_FLIGHT`] of them at once in the daemon and within its cap
    /// (each GET is a round trip, not a transfer: at 30 ms each, 10,000 files would take 38 s a
    /// shard's 8 at a time, 9 s 32 at a time; the rest of the cap stays free for the fetches of
    /// streams already running). Each read's bytes, in the order of `reads`, with whether an MD5
    /// may check its object whole (its answer's ETag has an MD5's form and `etag_may_be_md5`:
    /// not under SSE-KMS), or its own error: one object that fails leaves the others' answers.
    /// An error for the whole call only when the daemon stops.
    pub async fn get_each(&self, reads: &[(ObjectRef, Range<u64>)]) -> Result<Vec<Result<(Bytes, bool)>>> {
        let mut tasks = tokio::task::JoinSet::new();
        let ids = self.spawn_gets(
            &mut tasks,
            &self.probes,
            reads.iter().cloned().enumerate().map(|(i, (obj, r))| (i, Arc::new(obj), r)),
        );
        let mut got: Vec<Option<Result<(Bytes, bool)>>> = reads.iter().map(|_| None).collect();
        while let Some(joined) = tasks.join_next_with_id().await {
            let (i, answer) = match joined {
                Ok((_, (i, answer))) => (i, answer),
                // The daemon stops: nothing of the call is wanted any more.
                Err(e) if e.is_cancelled() => return Err(join_failed(e, &format!("{} objects", reads.len()))),
                // One task that did not finish is its object's error, named.
                Err(e) => {
                    let Some(&i) = ids.get(&e.id()) else { return Err(join_failed(e, "an unknown object")) };
                    let url = reads.get(i).map(|(o, _)| o.url()).unwrap_or_default();
                    (i, Err(join_failed(e, &url)))
                }
            };
            let answer = answer.map(|(bytes, etag, may_be_md5)| {
                let md5 = answer_may_be_md5(etag.as_deref(), may_be_md5);
                (bytes, md5)
            });
            if let Some(slot) = got.get_mut(i) {
                *slot = Some(answer);
            }
        }
        Ok(got
            .into_iter()
            .zip(reads)
            .map(|(answer, (o, _))| {
                answer.unwrap_or_else(|| Err(Error::Internal(format!("{}: no answer to a ranged GET", o.url()))))
            })
            .collect())
    }

    /// Starts a ranged GET of each `(index, object, range)` of `gets` on `tasks`, each waiting
    /// for a slot of `per_call` and of the daemon-wide cap; each task answers its index, and the
    /// index of each task is returned by its id (for a task that panicked).
    fn spawn_gets(
        &self,
        tasks: &mut tokio::task::JoinSet<(usize, Result<RangeAnswer>)>,
        per_call: &Arc<Semaphore>,
        gets: impl IntoIterator<Item = (usize, Arc<ObjectRef>, Range<u64>)>,
    ) -> std::collections::HashMap<tokio::task::Id, usize> {
        let mut ids = std::collections::HashMap::new();
        for (i, obj, range) in gets {
            let (store, per_call) = (self.clone(), per_call.clone());
            let task = tasks.spawn(async move {
                let closed = || Error::Internal("semaphore closed".into());
                let got = async {
                    let _slot = per_call.acquire_owned().await.map_err(|_| closed())?;
                    let _get = store.gets.clone().acquire_owned().await.map_err(|_| closed())?;
                    store.get_range_answered(&obj, range).await
                };
                (i, got.await)
            });
            ids.insert(task.id(), i);
        }
        ids
    }

    /// Writes a whole object.
    pub async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<()> {
        let url = format!("s3://{bucket}/{key}");
        self.retrying(&url, "put", || async {
            self.client
                .put_object()
                .bucket(bucket)
                .key(key)
                .body(ByteStream::from(body.clone()))
                .send()
                .await
                .map(|_| ())
                .map_err(|e| classify(&url, e))
        })
        .await
    }

    /// Downloads `obj` into `file` (created by the caller at `dest`, named in errors) with
    /// parallel ranged GETs, and returns the CRC-32C of its bytes. A part whose body breaks is
    /// resumed from the last byte received. Nothing is held in memory beyond one write chunk per
    /// part in flight. The bytes are checked against the object's ETag, see
    /// [`Self::download_checked`].
    pub async fn download(
        &self,
        obj: &ObjectRef,
        file: Arc<File>,
        dest: &Path,
        observer: Arc<dyn DownloadObserver>,
    ) -> Result<u32> {
        self.download_checked(obj, file, dest, observer, true).await.map(|(crc, _)| crc)
    }

    /// [`Self::download`], where `check_md5` says whether to check the bytes against the object's
    /// ETag (`obj.etag`, else the one the GETs answered) when it is an MD5, as S3 gives
    /// single-part uploads: the file is read back once (from the page cache) and a mismatch, a
    /// body corrupted in transit, downloads the object again, up to [`MAX_ETAG_MISMATCHES`]
    /// times. A caller that verifies the bytes another way (a manifest's CRC-32C) passes false.
    /// Returns the bytes' CRC-32C and whether their MD5 was checked (false: no MD5 to check them
    /// by, or not asked).
    pub async fn download_checked(
        &self,
        obj: &ObjectRef,
        file: Arc<File>,
        dest: &Path,
        observer: Arc<dyn DownloadObserver>,
        check_md5: bool,
    ) -> Result<(u32, bool)> {
        for attempt in 1..=MAX_ETAG_MISMATCHES {
            let (crc, answered) = self.download_once(obj, file.clone(), dest, observer.clone()).await?;
            let want = match answered.md5(obj) {
                Some(want) if check_md5 => want,
                _ => return Ok((crc, false)),
            };
            // Read back through a new descriptor: the caller's may be open for writing only.
            let (path, len) = (dest.to_owned(), obj.len);
            let got = tokio::task::spawn_blocking(move || {
                File::open(&path).and_then(|f| file_md5(&f, len)).map_err(|e| Error::io("cannot read", path, e))
            })
            .await
            .map_err(|e| Error::Internal(format!("md5 task failed: {e}")))??;
            if got == want {
                return Ok((crc, true));
            }
            crate::metrics::storage_retry("s3");
            observer.retry();
            tracing::warn!(object = %obj.url(), attempt, "downloaded bytes do not match the ETag (MD5), downloading again");
        }
        Err(Error::Shard {
            shard: obj.url(),
            offset: None,
            reason: format!(
                "the downloaded bytes did not match the object's ETag (MD5) in {MAX_ETAG_MISMATCHES} downloads; \
                 refusing to serve them"
            ),
        })
    }

    /// One download of every part of `obj`, without the ETag check: the CRC-32C of the bytes and
    /// the ETag the GETs answered.
    async fn download_once(
        &self,
        obj: &ObjectRef,
        file: Arc<File>,
        dest: &Path,
        observer: Arc<dyn DownloadObserver>,
    ) -> Result<(u32, Answered)> {
        if obj.len == 0 {
            return Ok((0, Answered::default()));
        }
        let answered: Arc<std::sync::Mutex<Answered>> = Arc::default();
        let part = self.options.part_size.max(1);
        let parts: Vec<Range<u64>> =
            (0..obj.len.div_ceil(part)).map(|i| i * part..((i + 1) * part).min(obj.len)).collect();
        let per_shard = Arc::new(Semaphore::new(self.options.concurrency.max(1)));
        let obj = Arc::new(obj.clone());
        let dest: Arc<PathBuf> = Arc::new(dest.to_owned());
        let mut tasks = tokio::task::JoinSet::new();
        for (i, range) in parts.iter().cloned().enumerate() {
            let (store, obj, file, dest, observer, answered) =
                (self.clone(), obj.clone(), file.clone(), dest.clone(), observer.clone(), answered.clone());
            let per_shard = per_shard.clone();
            tasks.spawn(async move {
                let _slot = per_shard.acquire_owned().await.map_err(|_| Error::Internal("semaphore closed".into()))?;
                let _get =
                    store.gets.clone().acquire_owned().await.map_err(|_| Error::Internal("semaphore closed".into()))?;
                store.fetch_part(&obj, &file, &dest, range, observer.as_ref(), &answered).await.map(|crc| (i, crc))
            });
        }
        let mut crcs = vec![0u32; parts.len()];
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(Ok((i, crc))) => crcs[i] = crc,
                // Dropping the set aborts the other parts at once.
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(Error::Internal(format!("download task of {} failed: {e}", obj.url()))),
            }
        }
        let mut crc = 0u32;
        for (c, r) in crcs.iter().zip(&parts) {
            crc = crc32c::crc32c_combine(crc, *c, (r.end - r.start) as usize);
        }
        let answered = std::mem::take(&mut *answered.lock().unwrap_or_else(|p| p.into_inner()));
        Ok((crc, answered))
    }

    /// One part: GET, stream to disk, resume from the last byte on a broken body. `answered`:
    /// the ETag of the first response of any part; a later one that differs means the object
    /// changed mid-download (possible only without `obj.etag`, which every GET sends as If-Match).
    async fn fetch_part(
        &self,
        obj: &ObjectRef,
        file: &Arc<File>,
        dest: &Arc<PathBuf>,
        range: Range<u64>,
        observer: &dyn DownloadObserver,
        answered: &std::sync::Mutex<Answered>,
    ) -> Result<u32> {
        let url = obj.url();
        let mut backoff = self.options.retry.start();
        let mut pos = range.start;
        let mut crc = 0u32;
        let mut buf = Received::default();
        loop {
            self.open_for_requests(&url, "get")?;
            crate::metrics::storage_request("s3", "get");
            let failure = match self
                .client
                .get_object()
                .bucket(&obj.bucket)
                .key(&obj.key)
                .range(format!("bytes={}-{}", pos, range.end - 1))
                .set_if_match(obj.etag.clone())
                .send()
                .await
            {
                Err(e) => Some(classify(&url, e)),
                Ok(resp) if let Some(why) = changed_since_listed(obj, resp.content_range(), resp.last_modified()) => {
                    Some(Failure::Permanent(Error::Shard { shard: url.clone(), offset: None, reason: why }))
                }
                Ok(resp)
                    if etag_changed(
                        answered,
                        resp.e_tag(),
                        etag_may_be_md5(resp.server_side_encryption(), resp.sse_customer_algorithm()),
                    ) =>
                {
                    Some(Failure::Permanent(changed_mid_read(url.clone())))
                }
                Ok(resp) => {
                    let mut body = resp.body;
                    loop {
                        match next_chunk(&mut body).await {
                            Ok(Some(chunk)) => {
                                if pos + (buf.len + chunk.len()) as u64 > range.end {
                                    break Some(Failure::Permanent(Error::Shard {
                                        shard: url.clone(),
                                        offset: Some(pos),
                                        reason: format!(
                                            "server sent more than the {} bytes asked for",
                                            range.end - pos
                                        ),
                                    }));
                                }
                                crc = crc32c::crc32c_append(crc, &chunk);
                                buf.push(chunk);
                                if buf.len >= WRITE_CHUNK {
                                    let at = write_chunk(file, dest, &mut buf, pos).await?;
                                    observer.bytes(at - pos);
                                    pos = at;
                                    backoff.progressed();
                                }
                            }
                            Ok(None) => break None,
                            Err(msg) => break Some(Failure::Transient(msg)),
                        }
                    }
                }
            };
            // What arrived before a failure is good: keep it and resume after it.
            let at = write_chunk(file, dest, &mut buf, pos).await?;
            if at > pos {
                observer.bytes(at - pos);
                backoff.progressed();
            }
            pos = at;
            let failure = match failure {
                // Every byte of the part is here: a body that broke after its last byte lost nothing
                // (and a resume would ask for an empty range, which servers refuse).
                None | Some(Failure::Transient(_)) if pos == range.end => return Ok(crc),
                None => Failure::Transient(format!("body ended at byte {pos}, expected {}", range.end)),
                Some(f) => f,
            };
            match failure {
                Failure::Permanent(e) => return Err(e),
                Failure::Transient(msg) => match backoff.next_delay() {
                    Some(d) => {
                        tracing::warn!(object = %url, offset = pos, attempt = backoff.attempts(), retry_in_ms = d.as_millis() as u64, error = %msg, "ranged get failed, resuming");
                        self.pause_before_retry(d, &url, "get", &msg).await?;
                        observer.retry();
                        crate::metrics::storage_retry("s3");
                    }
                    None => {
                        return Err(Error::Unavailable(format!(
                            "{url}: download failed at byte {pos} after {} in {:.1} s: {msg}",
                            retries(backoff.attempts()),
                            backoff.elapsed().as_secs_f64()
                        )));
                    }
                },
            }
        }

        async fn write_chunk(file: &Arc<File>, dest: &Arc<PathBuf>, buf: &mut Received, pos: u64) -> Result<u64> {
            if buf.len == 0 {
                return Ok(pos);
            }
            let data = std::mem::take(buf);
            let n = data.len as u64;
            let (file, dest2) = (file.clone(), dest.clone());
            // Page-cache writes can block on writeback: keep them off the async workers.
            tokio::task::spawn_blocking(move || write_all_at(&file, &data.chunks, pos))
                .await
                .map_err(|e| Error::Internal(format!("write task failed: {e}")))?
                .map_err(|e| Error::io("cannot write", dest2.as_path(), e))?;
            crate::metrics::storage_bytes("s3", n);
            Ok(pos + n)
        }
    }
}

/// Body chunks received and not yet written, and their total length.
#[derive(Default)]
struct Received {
    chunks: Vec<Bytes>,
    len: usize,
}

impl Received {
    fn push(&mut self, chunk: Bytes) {
        self.len += chunk.len();
        self.chunks.push(chunk);
    }
}

/// Writes `chunks` back to back at `pos` with `pwritev`, [`MAX_IOVECS`] at a time, resuming after
/// a short write.
fn write_all_at(file: &File, chunks: &[Bytes], mut pos: u64) -> std::io::Result<()> {
    let (mut first, mut skip) = (0usize, 0usize);
    while first < chunks.len() {
        let iov: Vec<std::io::IoSlice<'_>> = chunks[first..]
            .iter()
            .take(MAX_IOVECS)
            .enumerate()
            .map(|(i, c)| std::io::IoSlice::new(if i == 0 { &c[skip..] } else { c }))
            .collect();
        let mut n = match rustix::io::pwritev(file, &iov, pos) {
            Ok(0) if iov.iter().any(|s| !s.is_empty()) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        pos += n as u64;
        // Step past what was written, and past empty chunks, which write nothing.
        while first < chunks.len() && n >= chunks[first].len() - skip {
            n -= chunks[first].len() - skip;
            first += 1;
            skip = 0;
        }
        skip += n;
    }
    Ok(())
}

/// The MD5 an ETag stands for: a single-part upload's ETag is the hex MD5 of the object's bytes
/// (quoted). A multipart ETag (`<hex>-<parts>`) or any other form says nothing checkable: `None`.
pub fn etag_md5(etag: &str) -> Option<[u8; 16]> {
    let hex = etag.trim_matches('"');
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Whether an answer with `etag` (and headers that let it be an MD5: `may_be_md5`) may check its
/// object whole.
fn answer_may_be_md5(etag: Option<&str>, may_be_md5: bool) -> bool {
    may_be_md5 && etag.and_then(etag_md5).is_some()
}

/// Whether an object's ETag can be the MD5 of its bytes, by how the response says it is
/// encrypted: S3 gives objects under SSE-KMS (`aws:kms`, `aws:kms:dsse`) or SSE-C ETags of the
/// same 32-hex form that are not (its documentation says so), SSE-S3 (`AES256`) and unencrypted
/// ones MD5s.
fn etag_may_be_md5(sse: Option<&aws_sdk_s3::types::ServerSideEncryption>, sse_customer: Option<&str>) -> bool {
    use aws_sdk_s3::types::ServerSideEncryption;
    sse_customer.is_none() && matches!(sse, None | Some(ServerSideEncryption::Aes256))
}

/// What a download's responses said of the object.
#[derive(Debug, Default)]
pub struct Answered {
    /// The ETag of the first response.
    etag: Option<String>,
    /// A response said the ETag is no MD5 of the bytes ([`etag_may_be_md5`]).
    not_md5: bool,
}

impl Answered {
    /// The MD5 of `obj`'s bytes its ETag holds (the listed one, else the one answered), when no
    /// response said it cannot be one.
    pub fn md5(&self, obj: &ObjectRef) -> Option<[u8; 16]> {
        if self.not_md5 {
            return None;
        }
        obj.etag.as_deref().or(self.etag.as_deref()).and_then(etag_md5)
    }

    /// Records what one response said: the first ETag (and whether it can be an MD5); true when
    /// this one differs from the first.
    fn record(&mut self, etag: Option<&str>, may_be_md5: bool) -> bool {
        self.not_md5 |= !may_be_md5;
        let Some(etag) = etag else { return false };
        match self.etag.as_deref() {
            Some(first) => first != etag,
            None => {
                self.etag = Some(etag.to_owned());
                false
            }
        }
    }
}

/// [`Answered::record`] of a download whose parts answer from several tasks.
fn etag_changed(answered: &std::sync::Mutex<Answered>, etag: Option<&str>, may_be_md5: bool) -> bool {
    answered.lock().unwrap_or_else(|p| p.into_inner()).record(etag, may_be_md5)
}

/// A ranged GET's bytes, the ETag it answered, and whether that ETag may be the object's MD5.
type RangeAnswer = (Bytes, Option<String>, bool);

/// A GET task that did not finish (`what`: the object or the reads it served): cancelled when
/// the daemon stops, else failed.
fn join_failed(e: tokio::task::JoinError, what: &str) -> Error {
    if e.is_cancelled() {
        Error::Unavailable(format!("{what}: a ranged GET was cancelled: the daemon is stopping"))
    } else {
        Error::Internal(format!("a ranged GET of {what} failed: {e}"))
    }
}

/// The error of an object whose GETs answered different ETags.
fn changed_mid_read(url: String) -> Error {
    Error::Shard {
        shard: url,
        offset: None,
        reason: "changed on the server while it was being read (its ETag changed)".into(),
    }
}

fn md5_of(bytes: &[u8]) -> [u8; 16] {
    use md5::Digest;
    md5::Md5::digest(bytes).into()
}

/// MD5 of the first `len` bytes of `file`, read with positioned reads.
pub fn file_md5(file: &File, len: u64) -> std::io::Result<[u8; 16]> {
    use md5::Digest;
    let mut hasher = md5::Md5::new();
    let mut buf = vec![0u8; MD5_CHUNK];
    let mut pos = 0u64;
    while pos < len {
        let n = usize::try_from(len - pos).map_or(MD5_CHUNK, |left| left.min(MD5_CHUNK));
        file.read_exact_at(&mut buf[..n], pos)?;
        hasher.update(&buf[..n]);
        pos += n as u64;
    }
    Ok(hasher.finalize().into())
}

/// The next chunk of a GET body, or why the body broke (a failed read, or no data for
/// [`BODY_IDLE_TIMEOUT`]): either way the caller resumes from the last byte it has.
async fn next_chunk(body: &mut ByteStream) -> std::result::Result<Option<Bytes>, String> {
    fail_point!("s3-get-body", |_| Err("body broke: failpoint s3-get-body".into()));
    match tokio::time::timeout(BODY_IDLE_TIMEOUT, body.try_next()).await {
        Ok(Ok(Some(chunk))) => {
            fail_point!("s3-get-corrupt", |_| Ok(Some(crate::failpoints::flip_a_byte(&chunk))));
            Ok(Some(chunk))
        }
        Ok(Ok(None)) => Ok(None),
        Ok(Err(e)) => Err(format!("body broke: {e}")),
        Err(_) => Err(format!("no data for {} s", BODY_IDLE_TIMEOUT.as_secs())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Pick;
    use crate::storage::pick::NameGlob;

    fn obj(key: &str) -> ObjectInfo {
        ObjectInfo { key: key.into(), size: 1, etag: None, modified_ns: None }
    }

    #[test]
    fn a_refused_request_is_retried_a_credentials_error_or_a_value_error_by_its_code() {
        let url = "s3://b/k";
        for code in ["RequestTimeout", "OperationAborted", "SlowDown", "IncompleteBody", "RequestLimitExceeded"] {
            assert!(matches!(refused(url, 400, Some(code), String::new()), Failure::Transient(_)), "{code}");
        }
        let expired = refused(url, 400, Some("ExpiredToken"), String::new());
        assert!(matches!(expired, Failure::Permanent(Error::PermissionDenied { .. })));
        for code in [Some("InvalidBucketName"), Some("InvalidArgument"), None] {
            let Failure::Permanent(e) = refused(url, 400, code, "detail".into()) else { panic!("{code:?}: retried") };
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("S3 refused"), "{e}");
        }
    }

    #[test]
    fn a_closed_store_makes_no_request() {
        // Nothing listens on port 9 (discard): a request would be refused and retried.
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        let options = S3Options { endpoint: Some("http://127.0.0.1:9".into()), ..S3Options::default() };
        let store = rt.block_on(S3Store::connect(options)).unwrap();
        store.close();
        let obj = ObjectRef::new("b", "k", 10);
        let requests = || crate::metrics::STORAGE_REQUESTS.load(std::sync::atomic::Ordering::Relaxed);
        let before = requests();
        let started = std::time::Instant::now();
        let err = store.block_on(store.get_range(&obj, 0..10)).unwrap_err();
        assert!(err.to_string().contains("the daemon is stopping"), "{err}");
        let err = store.block_on(store.get_ranges(&obj, &[0..5, 5..10], |_, _| Ok(()))).unwrap_err();
        assert!(err.to_string().contains("the daemon is stopping"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        // No lib test but this one talks to S3, so the process-wide count is this test's.
        assert_eq!(requests(), before, "a closed store sent requests");
    }

    #[test]
    fn an_answer_of_another_size_or_time_than_listed_is_named() {
        use aws_sdk_s3::primitives::DateTime;
        let listed_ns = 1_700_000_000_250_000_000; // listed with its milliseconds
        let obj = ObjectRef { modified_ns: Some(listed_ns), ..ObjectRef::new("b", "k", 100) };
        let same = DateTime::from_secs(1_700_000_000); // the header's seconds
        assert_eq!(changed_since_listed(&obj, Some("bytes 0-9/100"), Some(&same)), None);
        assert_eq!(changed_since_listed(&obj, None, None), None);
        let grown = changed_since_listed(&obj, Some("bytes 0-9/110"), Some(&same)).unwrap();
        assert!(grown.starts_with("is 110 bytes on the server, not the 100"), "{grown}");
        // A store that rounds the header up from the listing's fractions.
        let rounded = DateTime::from_secs(1_700_000_001);
        assert_eq!(changed_since_listed(&obj, Some("bytes 0-9/100"), Some(&rounded)), None);
        let later = DateTime::from_secs(1_700_000_002);
        let rewritten = changed_since_listed(&obj, Some("bytes 0-9/100"), Some(&later)).unwrap();
        assert!(rewritten.contains("Last-Modified 1700000002) after it was listed (1700000000 s"), "{rewritten}");
        // With an ETag every GET carries If-Match: the time is not compared (a store may list it
        // otherwise than it answers it).
        let pinned = ObjectRef { etag: Some("\"e\"".into()), ..obj.clone() };
        assert_eq!(changed_since_listed(&pinned, Some("bytes 0-9/100"), Some(&later)), None);
        assert!(changed_since_listed(&pinned, Some("bytes 0-9/99"), Some(&same)).is_some());
    }

    #[test]
    fn etags_that_are_md5s_are_recognised() {
        let md5 = md5_of(b"hello");
        assert_eq!(etag_md5("\"5d41402abc4b2a76b9719d911017c592\""), Some(md5));
        assert_eq!(etag_md5("5d41402abc4b2a76b9719d911017c592"), Some(md5));
        for other in ["\"5d41402abc4b2a76b9719d911017c592-3\"", "", "xyz", "\"5d41402abc4b2a76b9719d911017c59g\""] {
            assert_eq!(etag_md5(other), None, "{other}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(file_md5(&File::open(&path).unwrap(), bytes.len() as u64).unwrap(), md5_of(&bytes));
    }

    #[test]
    fn received_chunks_are_written_back_to_back_in_batches_of_iovecs() {
        let dir = tempfile::tempdir().unwrap();
        let file =
            File::options().read(true).write(true).create(true).truncate(true).open(dir.path().join("f")).unwrap();
        // More chunks than one pwritev takes, of uneven sizes, some empty.
        let chunks: Vec<Bytes> =
            (0..2_500u32).map(|i| Bytes::from(vec![(i % 251) as u8; (i % 7) as usize * 3])).collect();
        let want: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        write_all_at(&file, &chunks, 5).unwrap();
        let mut got = vec![0u8; want.len() + 5];
        file.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(&got[..5], &[0; 5]);
        assert!(got[5..] == want[..], "bytes differ");
        write_all_at(&file, &[], 0).unwrap();
    }

    #[test]
    fn a_changed_etag_mid_download_is_noticed() {
        let answered = std::sync::Mutex::new(Answered::default());
        assert!(!etag_changed(&answered, None, true), "a response without ETag says nothing");
        assert!(!etag_changed(&answered, Some("\"a\""), true), "the first ETag is recorded");
        assert!(!etag_changed(&answered, Some("\"a\""), true));
        assert!(etag_changed(&answered, Some("\"b\""), true), "another part saw another version");
        let seen = answered.lock().unwrap();
        assert_eq!((seen.etag.as_deref(), seen.not_md5), (Some("\"a\""), false));
    }

    #[test]
    fn an_etag_is_an_md5_only_for_objects_not_encrypted_with_kms_or_a_customer_key() {
        use aws_sdk_s3::types::ServerSideEncryption as Sse;
        assert!(etag_may_be_md5(None, None));
        assert!(etag_may_be_md5(Some(&Sse::Aes256), None));
        assert!(!etag_may_be_md5(Some(&Sse::AwsKms), None));
        assert!(!etag_may_be_md5(Some(&Sse::AwsKmsDsse), None));
        assert!(!etag_may_be_md5(None, Some("AES256")), "SSE-C");
        let answered = std::sync::Mutex::new(Answered::default());
        assert!(!etag_changed(&answered, Some("\"a\""), false));
        assert!(answered.lock().unwrap().not_md5, "one part's word is enough");
    }

    #[test]
    fn an_iceberg_tables_own_prefix_is_refused_and_a_prefix_with_shards_of_its_own_is_not() {
        let table = vec![
            obj("t/data/00000-0-a.parquet"),
            obj("t/metadata/00000-b.metadata.json"),
            obj("t/metadata/snap-1-0-c.avro"),
        ];
        let err = shards_in_listing(table.clone(), "bk", "t/", &Pick::All).unwrap_err().to_string();
        assert!(err.contains("s3://bk/t/ is an Iceberg table") && err.contains("pyiceberg"), "{err}");
        // A glob over the table's prefix is the user's pick: it meets no shard there.
        let glob = Pick::Glob(NameGlob::new("*.parquet").unwrap());
        let err = shards_in_listing(table.clone(), "bk", "t/", &glob).unwrap_err().to_string();
        assert!(!err.contains("Iceberg"), "{err}");
        // Shards of its own: a dataset that happens to keep a `metadata/` beside them.
        let mut own = table;
        own.push(obj("t/a.tar"));
        let got = shards_in_listing(own, "bk", "t/", &Pick::All).unwrap();
        assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["a.tar"]);
        // Other files in a `metadata/` are not a table's.
        let other = vec![obj("u/data/x.parquet"), obj("u/metadata/labels.json")];
        let err = shards_in_listing(other, "bk", "u/", &Pick::All).unwrap_err().to_string();
        assert!(!err.contains("Iceberg") && err.contains("data/"), "{err}");
    }

    #[test]
    fn a_pack_journal_without_its_manifest_is_an_unfinished_pack() {
        let running = vec![obj("p/shard-000000.tar"), obj("p/_shardstream/pack-journal.jsonl")];
        let err = shards_in_listing(running.clone(), "bk", "p/", &Pick::All).unwrap_err().to_string();
        assert!(err.contains("unfinished") && err.contains("s3://bk/p/_shardstream/pack-journal.jsonl"), "{err}");
        assert!(err.contains("name it (s3://bk/p/shard-000000.tar)"), "{err}");
        // The shards there so far, by the pattern that names them (the listing's order is not).
        let three = vec![obj("p/train-0002.tar"), obj("p/train-0000.tar"), obj("p/train-0001.tar")];
        let err =
            shards_in_listing([three, vec![obj("p/_shardstream/pack-journal.jsonl")]].concat(), "bk", "p/", &Pick::All);
        let err = err.unwrap_err().to_string();
        assert!(
            err.contains("the 3 shards there so far knowingly, name them (s3://bk/p/train-{0000..0002}.tar)"),
            "{err}"
        );
        let none = shards_in_listing(vec![obj("p/_shardstream/pack-journal.jsonl")], "bk", "p/", &Pick::All);
        assert!(none.unwrap_err().to_string().contains("None of its shards is at s3://bk/p/ yet"));
        // Done: the manifest is written last (an `index` of a packed prefix lists it too).
        let done = [running.clone(), vec![obj("p/manifest.json")]].concat();
        assert_eq!(shards_in_listing(done.clone(), "bk", "p/", &Pick::All).unwrap().len(), 1);
        // A glob over its shards takes only those uploaded so far: refused alike, unless done.
        let glob = Pick::Glob(NameGlob::new("shard-*.tar").unwrap());
        let err = shards_in_listing(running.clone(), "bk", "p/", &glob).unwrap_err().to_string();
        assert!(err.contains("unfinished"), "{err}");
        assert_eq!(shards_in_listing(done, "bk", "p/", &glob).unwrap().len(), 1);
        // Named shards are each there whole or not found by name: no subset passes for the whole.
        let named = Pick::Names(vec!["shard-000000.tar".into()]);
        assert_eq!(shards_in_listing(running, "bk", "p/", &named).unwrap().len(), 1);
    }

    #[test]
    fn a_listing_yields_the_prefix_shards_in_name_order() {
        let listed = vec![obj("p/b.tar"), obj("p/a.tar"), obj("p/sub/c.tar"), obj("p/manifest.json"), obj("q/x.tar")];
        let got = shards_in_listing(listed.clone(), "bk", "p/", &Pick::All).unwrap();
        assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["a.tar", "b.tar"]);
        let names = vec!["b.tar".to_string(), "a.tar".to_string()];
        let got = shards_in_listing(listed.clone(), "bk", "p/", &Pick::Names(names)).unwrap();
        assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["b.tar", "a.tar"]);
        let missing = vec!["z.tar".to_string()];
        let err = shards_in_listing(listed.clone(), "bk", "p/", &Pick::Names(missing)).unwrap_err().to_string();
        assert!(err.contains("s3://bk/p/z.tar"), "{err}");
        let err = shards_in_listing(listed.clone(), "bk", "empty/", &Pick::All).unwrap_err().to_string();
        assert!(err.contains("s3://bk/empty/"), "{err}");
        let glob = Pick::Glob(NameGlob::new("b*").unwrap());
        let got = shards_in_listing(listed.clone(), "bk", "p/", &glob).unwrap();
        assert_eq!(got.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["b.tar"]);
        assert_eq!(listing_prefix("p/", &glob), "p/b");
        let names = |n: &[&str]| Pick::Names(n.iter().map(|s| s.to_string()).collect());
        assert_eq!(listing_prefix("p/", &names(&["t-000098.tar", "t-000099.tar", "t-000100.tar"])), "p/t-000");
        assert_eq!(listing_prefix("p/", &names(&["one.tar"])), "p/one.tar");
        assert_eq!(listing_prefix("p/", &names(&["a.tar", "b.tar"])), "p/");
        // A shared start that ends inside a character is cut back to its boundary.
        assert_eq!(listing_prefix("", &names(&["é1.tar", "è2.tar"])), "");
        assert_eq!(listing_prefix("", &names(&["éa.tar", "éb.tar"])), "é");
        let none = Pick::Glob(NameGlob::new("z*").unwrap());
        let err = shards_in_listing(listed, "bk", "p/", &none).unwrap_err().to_string();
        assert!(err.contains("s3://bk/p/z*"), "{err}");
    }
}
