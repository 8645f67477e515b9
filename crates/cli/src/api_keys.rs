//! API keys from the environment and from a file, so they need not be on the command line
//! (where every user of the machine reads them in `ps`).

use std::path::Path;

use backstop_payment::config::ApiKey;

/// The environment variable holding `MERCHANT=KEY` pairs separated by commas.
pub(crate) const ENV: &str = "BACKSTOP_API_KEYS";

/// What a pair must look like; said in every refusal (never the pair itself: it is a secret).
const FORMAT: &str =
    "expected MERCHANT=KEY (merchant: 1-64 of [A-Za-z0-9._-]; key: 1-256 visible ASCII)";

/// The pairs of `BACKSTOP_API_KEYS`, e.g. `acme=k1,globex=k2`; blank entries are skipped.
pub(crate) fn from_env_value(value: &str) -> Result<Vec<ApiKey>, String> {
    value
        .split(',')
        .map(str::trim)
        .enumerate()
        .filter(|(_, entry)| !entry.is_empty())
        .map(|(i, entry)| {
            ApiKey::parse(entry).map_err(|_| format!("{ENV}: entry {}: {FORMAT}", i + 1))
        })
        .collect()
}

/// The pairs of an API key file: one `MERCHANT=KEY` a line; blank lines and lines starting
/// with `#` are skipped. `name` is how errors refer to the file.
pub(crate) fn from_file_text(name: &str, text: &str) -> Result<Vec<ApiKey>, String> {
    text.lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .map(|(number, line)| {
            ApiKey::parse(line).map_err(|_| format!("{name}: line {number}: {FORMAT}"))
        })
        .collect()
}

/// The pairs of the API key file at `path`. A file every user of the machine may read is
/// refused: keeping the keys out of `ps` would gain nothing.
pub(crate) fn from_file(path: &Path) -> Result<Vec<ApiKey>, String> {
    let name = path.display().to_string();
    let metadata =
        std::fs::metadata(path).map_err(|error| format!("cannot read {name}: {error}"))?;
    if !metadata.is_file() {
        return Err(format!("{name} is not a file"));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if metadata.permissions().mode() & 0o004 != 0 {
            return Err(format!(
                "{name} is readable by every user: restrict it (chmod 600 or 640) before it holds API keys"
            ));
        }
    }
    // A key file is a few lines; a bigger one is a wrong path.
    const MAX_FILE: u64 = 1 << 20;
    if metadata.len() > MAX_FILE {
        return Err(format!("{name} is larger than 1 MiB: not an API key file"));
    }
    let text =
        std::fs::read_to_string(path).map_err(|error| format!("cannot read {name}: {error}"))?;
    from_file_text(&name, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn merchants(keys: &[ApiKey]) -> Vec<&str> {
        keys.iter().map(|k| k.merchant.as_str()).collect()
    }

    #[test]
    fn keys_from_the_environment() {
        let keys = from_env_value("acme=k1, globex=k2,").unwrap();
        assert_eq!(merchants(&keys), ["acme", "globex"]);
        assert_eq!(keys[1].key, "k2");
        assert!(from_env_value("").unwrap().is_empty());
        let error = from_env_value("acme=k1,globex").unwrap_err();
        assert!(error.starts_with("BACKSTOP_API_KEYS: entry 2:"), "{error}");
    }

    #[test]
    fn key_file_lines_comments_and_blanks() {
        let text = "# production merchants\n\nacme=k1\n  globex=k-2  \n# rotated: acme=old\n";
        let keys = from_file_text("keys", text).unwrap();
        assert_eq!(merchants(&keys), ["acme", "globex"]);
        assert_eq!(keys[1].key, "k-2");
    }

    #[test]
    fn a_malformed_line_is_refused_with_its_number_not_its_secret() {
        let error = from_file_text("keys", "acme=k1\n\nglobex secret-123\n").unwrap_err();
        assert!(
            error.starts_with("keys: line 3: expected MERCHANT=KEY"),
            "{error}"
        );
        assert!(!error.contains("secret-123"), "{error}");
        let error = from_env_value("acme secret-456").unwrap_err();
        assert!(!error.contains("secret-456"), "{error}");
    }

    #[cfg(unix)]
    #[test]
    fn a_world_readable_key_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "acme=k1\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let error = from_file(&path).unwrap_err();
        assert!(error.contains("readable by every user"), "{error}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(merchants(&from_file(&path).unwrap()), ["acme"]);
        assert!(
            from_file(&dir.path().join("missing"))
                .unwrap_err()
                .starts_with("cannot read")
        );
    }
}
