//! The retry policy for remote storage: exponential backoff with jitter, a cap per wait, a maximum
//! number of retries and a total deadline. One policy for every remote request, so the defaults
//! below are the whole story:
//!
//! | setting       | default | why |
//! |---------------|---------|-----|
//! | `max_retries` | 10      | rides out a server restart or a throttling burst (~25 s of waits) |
//! | `base`        | 100 ms  | a dropped connection usually works again at once |
//! | `cap`         | 5 s     | S3's own guidance for SlowDown; longer waits only add stall |
//! | `deadline`    | 120 s   | a shard that cannot be fetched in two minutes is reported, not hidden |
//!
//! Set `max_retries` to 0 to disable retries. Waits use "equal jitter" (half fixed, half random)
//! so that many ranks failing at once do not retry in lockstep, while no wait collapses to zero.

use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    pub max_retries: u32,
    pub base: Duration,
    pub cap: Duration,
    pub deadline: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_retries: 10,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(5),
            deadline: Duration::from_secs(120),
        }
    }
}

impl RetryConfig {
    /// The wait before retry number `attempt` (0-based), given `jitter` in [0, 1]. Never exceeds
    /// `cap`, never overflows whatever `attempt` is.
    pub fn delay(&self, attempt: u32, jitter: f64) -> Duration {
        let exp = self.base.saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX));
        let full = exp.min(self.cap);
        let half = full / 2;
        half + half.mul_f64(jitter.clamp(0.0, 1.0))
    }

    pub fn start(&self) -> Backoff {
        Backoff { config: self.clone(), started: Instant::now(), attempt: 0 }
    }
}

/// The retry state of one request.
#[derive(Debug)]
pub struct Backoff {
    config: RetryConfig,
    started: Instant,
    attempt: u32,
}

impl Backoff {
    /// The wait before the next retry, or `None` when retries or the deadline are used up.
    pub fn next_delay(&mut self) -> Option<Duration> {
        if self.attempt >= self.config.max_retries {
            return None;
        }
        let delay = self.config.delay(self.attempt, fastrand::f64());
        if self.started.elapsed() + delay > self.config.deadline {
            return None;
        }
        self.attempt += 1;
        Some(delay)
    }

    /// Retries made so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Starts counting retries afresh (progress was made: a resumed body delivered bytes), but
    /// keeps the deadline.
    pub fn progressed(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn delays_grow_then_stop_at_the_cap() {
        let c = RetryConfig::default();
        assert_eq!(c.delay(0, 1.0), Duration::from_millis(100));
        assert_eq!(c.delay(0, 0.0), Duration::from_millis(50));
        assert_eq!(c.delay(3, 1.0), Duration::from_millis(800));
        assert_eq!(c.delay(10, 1.0), Duration::from_secs(5));
    }

    #[test]
    fn retries_end_after_max_retries() {
        let c = RetryConfig { max_retries: 3, base: Duration::ZERO, ..RetryConfig::default() };
        let mut b = c.start();
        assert!(b.next_delay().is_some() && b.next_delay().is_some() && b.next_delay().is_some());
        assert_eq!(b.next_delay(), None);
        let mut none = RetryConfig { max_retries: 0, ..RetryConfig::default() }.start();
        assert_eq!(none.next_delay(), None, "0 disables retries");
    }

    #[test]
    fn the_deadline_ends_retries() {
        let c = RetryConfig { deadline: Duration::from_millis(10), base: Duration::from_secs(1), ..Default::default() };
        assert_eq!(c.start().next_delay(), None, "a wait past the deadline is not taken");
    }

    proptest! {
        #[test]
        fn delay_never_exceeds_the_cap_nor_overflows(
            attempt in any::<u32>(), jitter in -1.0f64..2.0, base_ms in 0u64..100_000, cap_ms in 0u64..1_000_000,
        ) {
            let c = RetryConfig {
                base: Duration::from_millis(base_ms),
                cap: Duration::from_millis(cap_ms),
                ..RetryConfig::default()
            };
            let d = c.delay(attempt, jitter);
            prop_assert!(d <= c.cap);
            prop_assert!(d >= c.cap.min(c.base.saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))) / 2);
        }
    }
}
