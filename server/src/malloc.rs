//! The allocator settings of the `serve` process (glibc only).
//!
//! A batch of large rows (an image column) whose columns are not all flat is gathered into fresh
//! Arrow buffers of a few MiB (flat ones go straight into the ring slot, see
//! `format::parquet::direct`), and decoding a row group allocates as much again. With
//! glibc's defaults such a buffer, once freed, goes back to the kernel (it was mmapped, or it sat at
//! the top of a heap that is then trimmed), so the next batch's buffers are fresh pages again: page
//! faults and the kernel zeroing every page were about a quarter of the daemon's time serving the
//! bench's image set (bench/PARQUET_PROFILE.md). `serve` therefore keeps freed blocks below
//! [`MMAP_THRESHOLD`] in its heaps for reuse, and returns the top of a heap to the kernel only past
//! [`TRIM_THRESHOLD`] free bytes. What is kept is memory the daemon has used before: its peak RSS
//! does not grow, it only shrinks later or less. [`trim`] gives it back where the daemon knows it
//! will not need it soon (the kept row-group writer, idle after writing: `service::kept_writer`).
//!
//! Only `serve` sets them: the Python package's embedded server runs inside the trainer's process,
//! whose allocator is not the daemon's to tune. An operator who set either threshold
//! (`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...` or `trim_threshold`, or the older
//! `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`) keeps both as glibc reads them.

/// Blocks smaller than this come from the heap and are reused after being freed: above the few
/// MiB of one batch's column buffers. glibc's own upper bound for its adaptive threshold.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Free bytes at the top of a heap kept before it is trimmed: a few batches in flight.
pub const TRIM_THRESHOLD: usize = 128 << 20;

/// What [`tune_for_serving`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tuning {
    Applied,
    /// The operator set a threshold in the environment.
    LeftToEnvironment,
    /// Not glibc, or glibc refused a value.
    Unavailable,
}

/// Sets the thresholds once at start-up (see the module docs); `env` is the process environment
/// (passed in so tests do not depend on the real one).
pub fn tune_for_serving(env: &[(String, String)]) -> Tuning {
    let operator = env.iter().any(|(k, v)| match k.as_str() {
        "GLIBC_TUNABLES" => v.contains("glibc.malloc.mmap_threshold") || v.contains("glibc.malloc.trim_threshold"),
        "MALLOC_MMAP_THRESHOLD_" | "MALLOC_TRIM_THRESHOLD_" => true,
        _ => false,
    });
    if operator {
        return Tuning::LeftToEnvironment;
    }
    apply()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> Tuning {
    let (Ok(mmap), Ok(trim)) = (i32::try_from(MMAP_THRESHOLD), i32::try_from(TRIM_THRESHOLD)) else {
        return Tuning::Unavailable;
    };
    // SAFETY: mallopt only changes parameters of the allocator (it takes its own lock); it is
    // given values inside the ranges glibc documents, and no memory is handed over.
    let ok =
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, mmap) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, trim) == 1 };
    if ok { Tuning::Applied } else { Tuning::Unavailable }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> Tuning {
    Tuning::Unavailable
}

/// Returns the heap's free memory to the kernel (glibc's `malloc_trim`), for when the daemon
/// will not need it soon: what [`tune_for_serving`] keeps is then given back once.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let started = std::time::Instant::now();
        // SAFETY: malloc_trim only releases free memory of the allocator's own heaps (under its
        // locks); it hands nothing to or from the caller.
        let released = unsafe { libc::malloc_trim(0) } == 1;
        tracing::debug!(released, seconds = started.elapsed().as_secs_f64(), "heap trimmed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operators_malloc_settings_are_left_alone() {
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        assert_eq!(
            tune_for_serving(&env("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")),
            Tuning::LeftToEnvironment
        );
        assert_eq!(tune_for_serving(&env("MALLOC_MMAP_THRESHOLD_", "65536")), Tuning::LeftToEnvironment);
        // Other malloc settings (debugging ones) do not stop the daemon's thresholds.
        assert_ne!(tune_for_serving(&env("MALLOC_PERTURB_", "85")), Tuning::LeftToEnvironment);
        assert_ne!(tune_for_serving(&env("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")), Tuning::LeftToEnvironment);
    }
}
