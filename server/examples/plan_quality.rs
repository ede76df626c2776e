//! Prints, as JSON, shuffle-quality figures of the epoch plan for one dataset shape, next to a
//! full random permutation and to no shuffle, so that tuning the shuffle window is measured rather
//! than guessed (`make bench` records the output). Only std: the figures are plain numbers.
//!
//! Usage: `plan_quality SHARDS SAMPLES_PER_SHARD WORLD_SIZE WINDOW_UNITS [UNITS_PER_SHARD]`
//!
//! `UNITS_PER_SHARD` (default 1) splits each shard into that many plan units, as a Parquet
//! file's row groups are: the plan and its window are then in units, while the figures stay
//! per shard (file), so the two plans of one dataset shape compare directly.
//!
//! Orders compared (see `shardstream::plan::quality` for the figures):
//! - `rank0`: rank 0's sequence, with shuffle on;
//! - `union`: every rank's sequence, rank 0 first, as one sequence: how the epoch as a whole
//!   covers the dataset (padding repeats included);
//! - `full_random_permutation`: a uniform permutation of all samples, the best possible mixing;
//! - `no_shuffle`: the union with shuffle off (stream order, padding repeats included).

use std::process::ExitCode;

use shardstream::plan::{self, EpochParams, PlanError, quality};

const USAGE: &str = "usage: plan_quality SHARDS SAMPLES_PER_SHARD WORLD_SIZE WINDOW_UNITS [UNITS_PER_SHARD]";

/// Fixed so that runs are comparable; the figures barely move with the seed.
const SEED: u64 = 0;

/// Does not change the order without drop_last; any valid value will do.
const BATCH_SIZE: u32 = 1;

struct Shape {
    shards: usize,
    samples_per_shard: u64,
    world_size: u32,
    window_shards: u32,
    units_per_shard: u64,
}

fn parse_args() -> Result<Shape, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (shards, per_shard, world, window, units) = match &args[..] {
        [a, b, c, d] => (a, b, c, d, "1"),
        [a, b, c, d, e] => (a, b, c, d, e.as_str()),
        _ => return Err(USAGE.to_owned()),
    };
    fn num<T: std::str::FromStr>(what: &str, s: &str) -> Result<T, String> {
        s.parse().map_err(|_| format!("{what} must be a non-negative integer in range, got {s:?}\n{USAGE}"))
    }
    Ok(Shape {
        shards: num("SHARDS", shards)?,
        samples_per_shard: num("SAMPLES_PER_SHARD", per_shard)?,
        world_size: num("WORLD_SIZE", world)?,
        window_shards: num("WINDOW_UNITS", window)?,
        units_per_shard: match num("UNITS_PER_SHARD", units)? {
            0 => return Err(format!("UNITS_PER_SHARD must be at least 1\n{USAGE}")),
            n => n,
        },
    })
}

/// The figures of one order, as a JSON object.
fn figures(order: &[u64], shard_samples: &[u64], window: usize) -> String {
    // Displacement and neighbour distance are defined on permutations of 0..len.
    let relabelled = quality::to_permutation(order);
    let working_set = quality::shards_in_window(order, shard_samples, window);
    format!(
        "{{\"samples\": {}, \"mean_normalized_displacement\": {:.6}, \"mean_neighbour_distance\": {:.6}, \
         \"same_shard_adjacency\": {:.6}, \"shards_in_window_max\": {}, \"shards_in_window_mean\": {:.3}}}",
        order.len(),
        quality::mean_normalized_displacement(&relabelled),
        quality::mean_neighbour_distance(&relabelled),
        quality::same_shard_adjacency(order, shard_samples),
        working_set.max,
        working_set.mean,
    )
}

/// Every rank's sequence, rank 0 first.
fn union(shard_samples: &[u64], p: EpochParams) -> Result<Vec<u64>, PlanError> {
    let mut all = Vec::new();
    for rank in 0..p.world_size {
        all.extend(plan::rank_sequence(shard_samples, &EpochParams { rank, ..p })?);
    }
    Ok(all)
}

fn run(shape: &Shape) -> Result<String, PlanError> {
    let shard_samples = vec![shape.samples_per_shard; shape.shards];
    // Units of (nearly) equal size that add up to each shard, in order: ids keep their shard.
    let units = shape.units_per_shard.min(shape.samples_per_shard.max(1));
    let unit_samples: Vec<u64> = (0..shape.shards)
        .flat_map(|_| {
            (0..units).map(move |u| shape.samples_per_shard / units + u64::from(u < shape.samples_per_shard % units))
        })
        .collect();
    let p = EpochParams {
        seed: SEED,
        epoch: 0,
        shuffle: true,
        window_shards: shape.window_shards,
        world_size: shape.world_size,
        rank: 0,
        batch_size: BATCH_SIZE,
        drop_last: false,
    };
    let summary = plan::summarize(&unit_samples, &p)?;
    let window = plan::window_samples(summary.total_samples, unit_samples.len(), shape.window_shards);
    let window = usize::try_from(window).unwrap_or(usize::MAX);
    let rank0 = plan::rank_sequence(&unit_samples, &p)?;
    let shuffled = union(&unit_samples, p)?;
    let plain = union(&unit_samples, EpochParams { shuffle: false, ..p })?;
    let random = quality::random_permutation(summary.total_samples, SEED);
    Ok(format!(
        "{{\n  \"shards\": {}, \"samples_per_shard\": {}, \"world_size\": {}, \"window_units\": {}, \
         \"units_per_shard\": {units}, \"window_samples\": {window}, \"samples_per_rank\": {}, \"padded_samples\": {},\n  \
         \"rank0\": {},\n  \"union\": {},\n  \"full_random_permutation\": {},\n  \"no_shuffle\": {}\n}}",
        shape.shards,
        shape.samples_per_shard,
        shape.world_size,
        shape.window_shards,
        summary.samples_per_rank,
        summary.padded_samples,
        figures(&rank0, &shard_samples, window),
        figures(&shuffled, &shard_samples, window),
        figures(&random, &shard_samples, window),
        figures(&plain, &shard_samples, window),
    ))
}

fn main() -> ExitCode {
    let shape = match parse_args() {
        Ok(shape) => shape,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    match run(&shape) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("plan_quality: {e}");
            ExitCode::FAILURE
        }
    }
}
