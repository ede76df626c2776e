//! Sizes as people write them, the same for the daemon's flags and the client's environment
//! variables: a byte count, or a number with a binary (`K`, `MiB`, ...) or decimal (`kB`, `GB`)
//! unit.

/// Parses a size: bytes, or a number with a unit (`512MiB`, `1G` = `1GiB`, `2GB`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("unknown size unit {unit:?} in {s:?} (use e.g. 512MiB, 1G, 2GB)")),
    };
    let value: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (use e.g. 512MiB, 1G, 2GB)"))?;
    // Zero and fractions of a byte parse (as 0): each flag's range check then names its range.
    let bytes = value * mult as f64;
    if !(bytes.is_finite() && bytes < u64::MAX as f64) {
        return Err(format!("size {s:?} is too large"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("512mib").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5K").unwrap(), 1536);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("0").unwrap(), 0);
        for bad in ["", "G", "1Q", "-1G", "1e30T", "99999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
