//! The open-file limit of the `serve` process.
//!
//! The daemon holds a descriptor for every shard its streams' working sets have open (about the
//! shuffle window plus a batch's shards, per stream), every shm side channel and connection, and
//! the cache files being filled. 64 streams with a window of 8 shards need several hundred at
//! once, and shards of small samples many more: a soft limit of 1,024 (the default of many
//! shells, SLURM jobs and container runtimes) fails streams with "Too many open files" while
//! the hard limit allows far more. `serve` raises its soft limit to the hard one at start, as
//! servers commonly do (systemd's unit sets both, `deploy/systemd`), and says what it has.
//!
//! Only `serve`: the Python package's embedded server runs inside the trainer's process, whose
//! limits are not the daemon's to change.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Below this soft limit, once raised, the daemon warns: a few dozen streams can exhaust it.
pub const LOW: u64 = 4096;

/// What [`raise_to_hard_limit`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The soft limit before (`None`: unlimited).
    pub before: Option<u64>,
    /// The soft limit now.
    pub now: Option<u64>,
}

impl Outcome {
    /// True when the limit now is below [`LOW`].
    pub fn low(&self) -> bool {
        self.now.is_some_and(|n| n < LOW)
    }
}

/// Raises the soft open-file limit to the hard limit. An error leaves the limit as it was.
pub fn raise_to_hard_limit() -> std::io::Result<Outcome> {
    let limit = getrlimit(Resource::Nofile);
    let before = limit.current;
    if limit.current == limit.maximum {
        return Ok(Outcome { before, now: before });
    }
    setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum })?;
    Ok(Outcome { before, now: getrlimit(Resource::Nofile).current })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let limit = getrlimit(Resource::Nofile);
        let outcome = raise_to_hard_limit().unwrap();
        assert_eq!(outcome.before, limit.current);
        assert_eq!(outcome.now, limit.maximum);
        assert_eq!(getrlimit(Resource::Nofile).current, limit.maximum);
        assert_eq!(raise_to_hard_limit().unwrap(), Outcome { before: limit.maximum, now: limit.maximum });
        assert!(Outcome { before: None, now: Some(1024) }.low() && !Outcome { before: None, now: None }.low());
    }
}
