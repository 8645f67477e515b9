//! Sizes in bytes as an operator writes them: `1048576`, `64KiB`, `1MiB`, `1GiB`.

use serde::{Deserialize, Deserializer};

/// The largest size accepted: a bound past this keeps nothing worth replaying.
const MAX: u64 = 1 << 30;

/// Parses a size: a whole number of bytes, optionally followed by `B`, `KiB`, `MiB` or `GiB`,
/// at most 1 GiB.
pub fn parse(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let unit_size: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(format!("{text:?} is not a size like 65536, 64KiB or 1MiB")),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 65536, 64KiB or 1MiB"))?;
    match n.checked_mul(unit_size) {
        Some(bytes) if bytes <= MAX => {
            usize::try_from(bytes).map_err(|_| format!("{text} is too large"))
        }
        _ => Err(format!("{text:?} is more than 1GiB")),
    }
}

/// A size in a TOML file: a number of bytes, or a string [`parse`] reads.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    let text = match Size::deserialize(d)? {
        Size::Bytes(n) => n.to_string(),
        Size::Text(text) => text,
    };
    parse(&text).map(Some).map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_written() {
        for (text, want) in [
            ("0", 0),
            ("1048576", 1 << 20),
            ("512B", 512),
            ("64KiB", 64 << 10),
            ("1MiB", 1 << 20),
            (" 2 MiB ", 2 << 20),
            ("1GiB", 1 << 30),
        ] {
            assert_eq!(parse(text), Ok(want), "{text}");
        }
        for text in [
            "",
            "MiB",
            "1MB",
            "1.5MiB",
            "-1",
            "2GiB",
            "99999999999999999999",
        ] {
            assert!(parse(text).is_err(), "{text}");
        }
    }
}
