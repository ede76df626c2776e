//! Fault injection for tests, built only with `--features failpoints` (the `fail` crate): without
//! it the crate's `fail_point!` calls in the I/O paths (a macro defined in `lib.rs`) compile to
//! nothing and `fail` is not a dependency.
//!
//! A build with the feature reads `FAILPOINTS` at start-up (`name=action;name=action`, the
//! `fail` crate's syntax: `return(ARG)`, `3*return`, `10%return`, `sleep(MS)`, `off`, ...). The
//! points, what `return` does there, and the outcome a caller must see:
//!
//! | point            | where                                   | injected                     | outcome |
//! |------------------|-----------------------------------------|------------------------------|---------|
//! | `local-read`     | every `pread` of a shard file           | I/O error (`EIO` or ARG)     | the stream fails with an error naming the file |
//! | `cache-copy-read`| reading a local shard into the cache    | I/O error                    | as above |
//! | `s3-get-body`    | each chunk of an S3 GET body            | the body breaks              | resumed from the last byte (retry), bytes intact |
//! | `s3-get-corrupt` | each chunk of an S3 GET body            | one byte flipped             | caught by the manifest's CRC-32C or the ETag's MD5, fetched again |
//! | `cache-fill`     | after a cache fill wrote its bytes      | I/O error (`ENOSPC` ...)     | ENOSPC: evict and retry, else a named error; no file left |
//! | `cache-fsync`    | before a cache file is fsynced          | I/O error                    | a named error; no file left |
//! | `cache-rename`   | before a cache file is renamed in place | I/O error                    | a named error; no file left |
//! | `sidecar-write`  | writing a sidecar                       | I/O error                    | a warning; the index is rebuilt next time |
//! | `atomic-write`   | `write_atomic` (manifests, journals)    | I/O error                    | the write fails naming the file; the old file stays |
//! | `shm-send`       | every frame sent on the shm side channel (fd passing) | I/O error      | the stream fails with a named error, no hang |
//! | `stream-send`    | before a batch goes to the gRPC stream  | the stream ends early        | the client reports a short stream, never a short epoch |
//! | `packed-gather`  | before a packed batch is written to its ring slot | error            | the stream fails; the slot is freed |
//! | `prefetch-spawn` | starting a prefetch's thread            | the thread cannot start      | a warning; the shard is fetched when needed, and the prefetch slot is free again |

/// The I/O error a `return(ARG)` action injects: `ARG` names an errno (`EIO` when absent).
pub fn io_error(arg: Option<String>) -> std::io::Error {
    let errno = match arg.as_deref().unwrap_or("EIO") {
        "ENOSPC" => libc::ENOSPC,
        "EDQUOT" => libc::EDQUOT,
        "EACCES" => libc::EACCES,
        "EISDIR" => libc::EISDIR,
        "ECONNRESET" => libc::ECONNRESET,
        "EPIPE" => libc::EPIPE,
        _ => libc::EIO,
    };
    std::io::Error::from_raw_os_error(errno)
}

/// The crate error for an I/O failure injected on `path` (see [`io_error`]).
pub fn io(op: &'static str, path: impl Into<std::path::PathBuf>, arg: Option<String>) -> crate::Error {
    crate::Error::io(op, path, io_error(arg))
}

/// A copy of `chunk` with its middle byte inverted: the "wrong bytes" a faulty network or store
/// delivers, which only a checksum can catch (in the middle, a flip lands in sample payload more
/// often than in a TAR header, whose own checksum would give it away).
pub fn flip_a_byte(chunk: &bytes::Bytes) -> bytes::Bytes {
    let mut v = chunk.to_vec();
    let middle = v.len() / 2;
    if let Some(b) = v.get_mut(middle) {
        *b = !*b;
    }
    bytes::Bytes::from(v)
}
