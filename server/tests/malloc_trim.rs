//! `malloc::trim` in a process of its own: it measures the whole process's anonymous memory,
//! which other tests running beside it would move.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn rss_anon_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// What the serving thresholds keep after a free, `trim` gives back.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn trim_returns_the_free_memory_the_serving_thresholds_keep() {
    use shardstream::malloc;
    assert_eq!(malloc::tune_for_serving(&[]), malloc::Tuning::Applied);
    // 1 MiB blocks, each followed by a small one that stays, so that the freed blocks sit in the
    // allocator's bins, as a daemon's freed row groups do, and not in the top of a heap (which
    // free itself may shrink). 40 MiB: within one heap of a thread's arena.
    let (blocks, fences): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..40).map(|_| (vec![1u8; 1 << 20], vec![1u8; 64])).unzip();
    let held = rss_anon_mib();
    drop(blocks);
    let kept = rss_anon_mib();
    assert!(kept + 8 > held, "freed blocks below the thresholds stay: {held} then {kept} MiB");
    malloc::trim();
    let trimmed = rss_anon_mib();
    assert!(trimmed + 24 < kept, "trimmed: {kept} then {trimmed} MiB");
    drop(fences);
}
