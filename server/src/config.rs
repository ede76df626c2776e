//! `shardstream serve --config FILE`: the TOML config file, merged with the command line.
//!
//! Every `serve` option is a key, spelled as its long flag (`cache-size = "500GiB"`,
//! `prefetch-horizon = 30`), plus the `allow` list (`[[allow]]` tables, see [`crate::access`]).
//! Each value goes through the same parser as the flag, so a file cannot hold what the command
//! line would refuse; an unknown key or a bad value stops the daemon at start with the file and
//! key named.
//!
//! Precedence, highest first: command-line flag > `SHARDSTREAM_*` environment variable > config
//! file > built-in default. clap records where each value came from (`ArgMatches::value_source`);
//! file values are added as flags only for options that neither the command line nor the
//! environment set, and the command line is parsed again.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use serde::{Deserialize, Serialize};

use crate::access::AllowRule;
use crate::cli::{Cli, Command, ServeArgs};

/// Options that are not config keys: they say where the config is and what to do with it.
const NOT_KEYS: [&str; 4] = ["config", "print_config", "help", "version"];

#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Bad command line (or `--help` / `--version`): clap prints it.
    #[error(transparent)]
    Clap(#[from] clap::Error),
    #[error("config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    /// A value the environment gave (no flag on the command line): named as the variable, which
    /// is what the operator wrote (a unit file, a pod spec).
    #[error("{var}={value} in the environment: {reason}")]
    Env { var: String, value: String, reason: String },
}

/// The config file's structured part; flag keys are checked against the `serve` options.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowOnly {
    #[serde(default)]
    allow: Vec<AllowRule>,
}

/// Parses the command line, and for `serve --config FILE` merges the file under it. Returns the
/// command line and the file's `allow` list.
pub fn parse<I, T>(args: I) -> Result<(Cli, Vec<AllowRule>), ParseError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let argv: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let cmd = Cli::command();
    let matches = cmd.clone().try_get_matches_from(&argv).map_err(|e| from_env(&cmd, &argv, e))?;
    let cli = Cli::from_arg_matches(&matches)?;
    let Command::Serve(serve) = &cli.command else { return Ok((cli, Vec::new())) };
    let Some(path) = serve.config.clone() else { return Ok((cli, Vec::new())) };
    let Some(sub) = matches.subcommand_matches("serve") else { return Ok((cli, Vec::new())) };
    let serve_cmd = cmd.find_subcommand("serve").cloned().ok_or_else(|| file_err(&path, "no serve command"))?;
    let text = std::fs::read_to_string(&path).map_err(|e| file_err(&path, format!("cannot read it: {e}")))?;
    let mut table: toml::Table = toml::from_str(&text).map_err(|e| file_err(&path, e.to_string()))?;
    let allow = match table.remove("allow") {
        Some(v) => {
            let wrapped = toml::Table::from_iter([("allow".to_owned(), v)]);
            wrapped.try_into::<AllowOnly>().map_err(|e| file_err(&path, format!("`allow`: {e}")))?.allow
        }
        None => Vec::new(),
    };
    let mut extra: Vec<OsString> = Vec::new();
    for (key, value) in &table {
        let arg = serve_cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(key.as_str()) && !NOT_KEYS.contains(&a.get_id().as_str()))
            .ok_or_else(|| file_err(&path, format!("unknown key `{key}` (keys: {})", keys(&serve_cmd).join(", "))))?;
        let text = scalar(value).ok_or_else(|| {
            file_err(&path, format!("`{key}`: expected a string, number or boolean, not {}", value.type_str()))
        })?;
        let set_by_user = matches!(
            sub.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        // A switch (`insecure = true`) takes no value on the command line: `true` adds the flag.
        if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
            match text.as_str() {
                "true" if !set_by_user => extra.push(format!("--{key}").into()),
                "true" | "false" => {}
                _ => return Err(file_err(&path, format!("`{key}`: expected true or false"))),
            }
            continue;
        }
        // The flag's own parser, so the file accepts exactly what the command line does.
        serve_cmd
            .clone()
            .try_get_matches_from(["serve".to_owned(), format!("--{key}"), text.clone()])
            .map_err(|e| file_err(&path, format!("`{key}`: {}", first_line(&e.to_string()))))?;
        if !set_by_user {
            extra.push(format!("--{key}").into());
            extra.push(text.into());
        }
    }
    if let Err(e) = crate::access::AllowList::new(&allow) {
        return Err(file_err(&path, e.to_string()));
    }
    // `serve` takes no positional arguments, so file values can follow the user's.
    let merged =
        cmd.clone().try_get_matches_from(argv.iter().cloned().chain(extra)).map_err(|e| from_env(&cmd, &argv, e))?;
    Ok((Cli::from_arg_matches(&merged)?, allow))
}

/// A value error about an option the command line (`argv`) does not give but its environment
/// variable does, as [`ParseError::Env`]; anything else as clap's own error.
fn from_env(cmd: &clap::Command, argv: &[OsString], e: clap::Error) -> ParseError {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(e.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) {
        return ParseError::Clap(e);
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else { return ParseError::Clap(e) };
    let long = arg.trim_start_matches("--").split_whitespace().next().unwrap_or_default().to_owned();
    let on_command_line = argv.iter().filter_map(|a| a.to_str()).any(|a| {
        a.strip_prefix("--")
            .is_some_and(|a| a == long || a.strip_prefix(long.as_str()).is_some_and(|r| r.starts_with('=')))
    });
    let env = cmd
        .get_subcommands()
        .flat_map(|c| c.get_arguments())
        .chain(cmd.get_arguments())
        .find(|a| a.get_long() == Some(long.as_str()))
        .and_then(|a| a.get_env())
        .and_then(|v| v.to_str())
        .map(str::to_owned);
    match env {
        Some(var) if !on_command_line => match std::env::var_os(&var) {
            Some(value) => ParseError::Env {
                value: value.to_string_lossy().into_owned(),
                var,
                reason: first_line(&e.to_string()).to_owned(),
            },
            None => ParseError::Clap(e),
        },
        _ => ParseError::Clap(e),
    }
}

fn file_err(path: &Path, reason: impl Into<String>) -> ParseError {
    ParseError::File { path: path.to_owned(), reason: reason.into() }
}

fn first_line(s: &str) -> &str {
    s.trim_start_matches("error: ").lines().next().unwrap_or(s)
}

fn keys(serve: &clap::Command) -> Vec<String> {
    let mut k: Vec<String> = serve
        .get_arguments()
        .filter(|a| !NOT_KEYS.contains(&a.get_id().as_str()))
        .filter_map(|a| a.get_long().map(str::to_owned))
        .collect();
    k.push("allow".into());
    k
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Keys whose values are printed as TOML numbers (the others as strings).
const NUMERIC: [&str; 11] = [
    "prefetch-horizon",
    "prefetch-parallel",
    "s3-concurrency",
    "s3-max-retries",
    "shm-credits",
    "ring-slots",
    "ring-keep",
    "max-streams",
    "max-streams-per-client",
    "drain-timeout",
    "socket-group",
];

/// The effective configuration as a config file (what `serve --print-config` prints): every
/// key with its value and, as a comment, where the value came from.
pub fn effective_toml(args: &ServeArgs, allow: &[AllowRule]) -> String {
    // Re-derive the values from the parsed arguments, so what is printed is what runs.
    let values: Vec<(&str, Option<String>)> = vec![
        ("listen", Some(args.listen.clone())),
        ("socket-mode", Some(format!("{:04o}", args.socket_mode))),
        ("socket-group", args.socket_group.map(|g| g.to_string())),
        ("cache-dir", Some(args.cache_dir.display().to_string())),
        ("cache-size", args.cache_size.map(|b| b.to_string())),
        ("cache-policy", Some(format!("{:?}", args.cache_policy).to_lowercase())),
        ("no-keep-decoded", Some(args.no_keep_decoded.to_string())),
        ("decoded-budget", Some(args.decoded_budget.to_string())),
        ("prefetch-horizon", Some(args.prefetch_horizon.to_string())),
        ("prefetch-parallel", Some(args.prefetch_parallel.to_string())),
        ("s3-part-size", Some(args.s3_part_size.to_string())),
        ("s3-concurrency", Some(args.s3_concurrency.to_string())),
        ("s3-max-retries", Some(args.s3_max_retries.to_string())),
        ("shm-credits", Some(args.shm_credits.to_string())),
        ("ring-slots", Some(args.ring_slots.to_string())),
        ("packed-budget", args.packed_budget.map(|b| b.to_string())),
        ("inline-budget", args.inline_budget.map(|b| b.to_string())),
        ("ring-keep", Some(args.ring_keep.to_string())),
        ("max-streams", Some(args.max_streams.to_string())),
        ("max-streams-per-client", args.max_streams_per_client.map(|n| n.to_string())),
        ("metrics-addr", args.metrics_addr.map(|a| a.to_string())),
        ("drain-timeout", Some(args.drain_timeout.to_string())),
        ("tls-cert", args.tls_cert.as_ref().map(|p| p.display().to_string())),
        ("tls-key", args.tls_key.as_ref().map(|p| p.display().to_string())),
        ("tls-client-ca", args.tls_client_ca.as_ref().map(|p| p.display().to_string())),
        ("tokens", args.token_file.as_ref().map(|p| p.display().to_string())),
        ("insecure", Some(args.insecure.to_string())),
        ("tcp-timeout", Some(args.tcp_timeout.to_string())),
        ("rdma", Some(args.rdma.to_string())),
        ("rdma-provider", args.rdma_provider.clone()),
        ("rdma-budget", args.rdma_budget.map(|b| b.to_string())),
        ("log", Some(args.log.clone())),
        ("log-format", Some(format!("{:?}", args.log_format).to_lowercase())),
    ];
    let mut out = String::from("# shardstream serve: effective configuration\n");
    if let Some(p) = &args.config {
        out.push_str(&format!("# config file: {}\n", p.display()));
    }
    for (key, value) in values {
        match value {
            None => out.push_str(&format!("# {key} = (not set)\n")),
            Some(v) if NUMERIC.contains(&key) && v.parse::<f64>().is_ok() => out.push_str(&format!("{key} = {v}\n")),
            Some(v) if matches!(key, "insecure" | "rdma" | "no-keep-decoded") => {
                out.push_str(&format!("{key} = {v}\n"))
            }
            Some(v) => out.push_str(&format!("{key} = {}\n", toml::Value::String(v))),
        }
    }
    if !allow.is_empty() {
        let a = AllowOnly { allow: allow.to_vec() };
        out.push('\n');
        out.push_str(&toml::to_string(&a).unwrap_or_else(|e| format!("# cannot print the allow list: {e}\n")));
    }
    out
}

/// Every key `serve` accepts in a config file (for docs and tests).
pub fn all_keys() -> BTreeSet<String> {
    Cli::command().find_subcommand("serve").map(|s| keys(s).into_iter().collect()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    fn serve(args: &[&str]) -> Result<(ServeArgs, Vec<AllowRule>), ParseError> {
        let argv = ["shardstream", "serve"].iter().chain(args).map(|s| s.to_string());
        let (cli, allow) = parse(argv)?;
        match cli.command {
            Command::Serve(a) => Ok((a, allow)),
            _ => unreachable!(),
        }
    }

    #[test]
    fn file_fills_in_and_flags_win() {
        let f = write(
            "cache-size = \"2GiB\"\nprefetch-horizon = 30\nlisten = \"unix:///tmp/x/sock\"\n[[allow]]\nuid = 1000\nroots = [\"/data\"]\n",
        );
        let p = f.path().to_str().unwrap();
        let (a, allow) = serve(&["--config", p]).unwrap();
        assert_eq!(a.cache_size, Some(2 << 30));
        assert_eq!(a.prefetch_horizon, 30.0);
        assert_eq!(a.listen, "unix:///tmp/x/sock");
        assert_eq!(allow.len(), 1);
        let (a, _) = serve(&["--config", p, "--prefetch-horizon", "5"]).unwrap();
        assert_eq!(a.prefetch_horizon, 5.0);
        assert_eq!(a.cache_size, Some(2 << 30));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        for (text, key) in [
            ("cache-sise = \"1GiB\"\n", "cache-sise"),
            ("cache-size = \"lots\"\n", "cache-size"),
            ("s3-concurrency = -1\n", "s3-concurrency"),
            ("socket-mode = \"0444\"\n", "socket-mode"),
            ("drain-timeout = -5\n", "drain-timeout"),
            ("prefetch-horizon = \"soon\"\n", "prefetch-horizon"),
            ("config = \"/x\"\n", "config"),
            ("listen = [1]\n", "listen"),
            ("[[allow]]\nuid = 1\nroot = [\"/x\"]\n", "root"),
            ("[[allow]]\nroots = [\"relative\"]\n", "allow[0]"),
        ] {
            let f = write(text);
            let e = serve(&["--config", f.path().to_str().unwrap()]).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(&f.path().display().to_string()), "{text}: {e}");
        }
    }

    #[test]
    fn printed_config_reads_back_the_same() {
        let f = write(
            "cache-size = \"3GiB\"\nsocket-mode = \"0660\"\ndrain-timeout = 7.5\n[[allow]]\ngid = 5\nroots = [\"s3://b/p\"]\n",
        );
        let (a, allow) = serve(&["--config", f.path().to_str().unwrap(), "--log", "debug"]).unwrap();
        let printed = effective_toml(&a, &allow);
        let g = write(&printed);
        let (b, allow2) = serve(&["--config", g.path().to_str().unwrap()]).unwrap();
        assert_eq!(
            effective_toml(&b, &allow2).lines().skip(2).collect::<Vec<_>>(),
            printed.lines().skip(2).collect::<Vec<_>>()
        );
        assert_eq!(b.socket_mode, 0o660);
        assert_eq!(b.log, "debug");
        assert_eq!(allow2, allow);
    }

    #[test]
    fn print_config_shows_every_key() {
        let (a, _) = serve(&[]).unwrap();
        let printed = effective_toml(&a, &[]);
        for key in all_keys().iter().filter(|k| *k != "allow") {
            let shown =
                printed.lines().any(|l| l.starts_with(&format!("{key} = ")) || l == format!("# {key} = (not set)"));
            assert!(shown, "--print-config does not show `{key}`:\n{printed}");
        }
    }

    #[test]
    fn remote_security_keys_read_back() {
        let f = write(
            "listen = \"tcp://127.0.0.1:7000\"\ninsecure = true\ntokens = \"/etc/shardstream/tokens\"\n\
             [[allow]]\nclient = \"trainer-a\"\nroots = [\"s3://b/p\"]\n",
        );
        let (a, allow) = serve(&["--config", f.path().to_str().unwrap()]).unwrap();
        assert!(a.insecure);
        assert_eq!(a.token_file.as_deref(), Some(Path::new("/etc/shardstream/tokens")));
        assert_eq!(allow[0].client.as_deref(), Some("trainer-a"));
        let printed = effective_toml(&a, &allow);
        assert!(printed.contains("insecure = true\n") && printed.contains("client = \"trainer-a\""), "{printed}");
        let g = write(&printed);
        let (b, _) = serve(&["--config", g.path().to_str().unwrap()]).unwrap();
        assert!(b.insecure);
        let (c, _) = serve(&[]).unwrap();
        let h = write(&effective_toml(&c, &[]));
        assert!(!serve(&["--config", h.path().to_str().unwrap()]).unwrap().0.insecure);
        let bad = write("insecure = \"yes\"\n");
        assert!(serve(&["--config", bad.path().to_str().unwrap()]).unwrap_err().to_string().contains("insecure"));
    }

    #[test]
    fn every_flag_is_a_key() {
        let k = all_keys();
        for key in
            ["listen", "cache-dir", "cache-size", "socket-mode", "socket-group", "drain-timeout", "log-format", "allow"]
        {
            assert!(k.contains(key), "{key}");
        }
        assert!(!k.contains("config") && !k.contains("print-config"));
    }
}
