//! The daemon's logs: what `--log` and `--log-format` mean.
//!
//! `--log LEVEL` sets the level of shardstream's own targets (`shardstream*`) only; dependencies
//! (tonic, h2, hyper, the AWS SDK) stay at `info` or quieter, so `--log debug` shows the daemon's
//! decisions and not every HTTP/2 frame. A value with `=` or `,` is a full tracing directive and
//! is used as given (`--log info,h2=debug`). Logs go to stderr; `--log-format json` writes one
//! JSON object per line for log shippers (Kubernetes, journald forwarders). Text logs are coloured
//! only on a terminal (and never with `NO_COLOR` set): a file or a pipe gets plain lines. Panics
//! are logged too, once a subscriber is installed (see [`crate::panics`]).

use std::io::IsTerminal;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The tracing directive for a `--log` value (see the module docs).
pub fn directive(log: &str) -> String {
    let log = log.trim();
    if log.contains('=') || log.contains(',') {
        return log.to_owned();
    }
    let level = log.to_ascii_lowercase();
    let Some(rank) = LEVELS.iter().position(|l| *l == level) else { return log.to_owned() };
    // Dependencies: as quiet as asked, but never chattier than info.
    let deps = LEVELS[rank.min(3)];
    format!("{deps},shardstream={level}")
}

/// `--log` as given, checked (its clap parser, so a config file's value is refused naming the
/// key): a level, or a directive with `=` or `,` that tracing parses. A bare word that is not a
/// level would parse as a target name, enabling that target alone: every other line, warnings
/// included, silently off (`--log warning`).
pub fn parse_log(s: &str) -> Result<String, String> {
    let t = s.trim();
    if t.contains('=') || t.contains(',') {
        return match tracing_subscriber::EnvFilter::try_new(t) {
            Ok(_) => Ok(s.to_owned()),
            Err(e) => Err(format!("{s:?} is not a tracing directive: {e}")),
        };
    }
    if LEVELS.contains(&t.to_ascii_lowercase().as_str()) {
        return Ok(s.to_owned());
    }
    Err(format!(
        "unknown log level {s:?}: give one of {}, or a tracing directive such as info,h2=debug",
        LEVELS.join(", ")
    ))
}

/// Installs the global subscriber (once; later calls do nothing). A filter that does not parse
/// falls back to `info` with a warning rather than leaving the daemon silent.
pub fn init(log: &str, format: LogFormat) {
    let wanted = directive(log);
    let (filter, bad) = match tracing_subscriber::EnvFilter::try_new(&wanted) {
        Ok(f) => (f, None),
        Err(e) => (tracing_subscriber::EnvFilter::new(directive("info")), Some(e)),
    };
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(colour);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if let Some(e) = bad {
        tracing::warn!(log, error = %e, "bad --log filter, logging at info");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_apply_to_shardstream_only() {
        assert_eq!(directive("info"), "info,shardstream=info");
        assert_eq!(directive("debug"), "info,shardstream=debug");
        assert_eq!(directive("TRACE"), "info,shardstream=trace");
        assert_eq!(directive("warn"), "warn,shardstream=warn");
        assert_eq!(directive("info,h2=debug"), "info,h2=debug");
        assert_eq!(directive("shardstream::cache=trace"), "shardstream::cache=trace");
    }

    #[test]
    fn a_word_that_is_not_a_level_is_refused() {
        for ok in ["warn", "DEBUG", " info ", "info,h2=debug", "shardstream::cache=trace", "off"] {
            assert!(parse_log(ok).is_ok(), "{ok}");
        }
        for bad in ["warning", "verbose", "", "info,h2=loud"] {
            assert!(parse_log(bad).is_err(), "{bad}");
        }
        assert!(parse_log("warning").unwrap_err().contains("off, error, warn, info, debug, trace"));
    }
}
