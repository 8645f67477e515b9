//! Every problem code the service can answer with is listed in README.md, so a client author
//! can handle each one: the codes are read from the sources (the call sites that build a
//! refusal and the constants they use), not from a list that could fall behind them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `.rs` files under `dir`, recursively, sorted.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The code of a file without its unit tests (from the first `#[cfg(test)]`) and without
/// comment lines; a `tests.rs` or `testing.rs` module is all test code.
fn code_of(path: &Path) -> String {
    let name = path.file_name().unwrap().to_str().unwrap();
    if matches!(name, "tests.rs" | "testing.rs") {
        return String::new();
    }
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap();
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_code(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// The string literals of `text` that look like problem codes.
fn literals(text: &str) -> Vec<String> {
    text.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| is_code(s))
        .map(str::to_owned)
        .collect()
}

/// The upper-case identifiers of `text` (the last segment of a path), except the variants of
/// `StatusCode::` and `Code::`, which name statuses, not problem codes.
fn constants(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        if i > start {
            let word = &text[start..i];
            let status =
                text[..start].ends_with("StatusCode::") || text[..start].ends_with("Code::");
            if !status
                && word.len() > 1
                && word
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b == b'_' || b.is_ascii_digit())
            {
                found.push(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    found
}

/// The text of the call arguments that start right after `open` (just past a `(`), up to the
/// matching `)`.
fn arguments(text: &str) -> &str {
    let mut depth = 1;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return &text[..i];
                }
            }
            _ => {}
        }
    }
    text
}

/// `const NAME: &str = "value";` declarations of `text`.
fn const_declarations(text: &str, into: &mut BTreeMap<String, String>) {
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.split("const ").nth(1) else {
            continue;
        };
        let Some((name, value)) = rest.split_once(": &str = \"") else {
            continue;
        };
        if let Some(value) = value.strip_suffix("\";") {
            into.insert(name.trim().to_owned(), value.to_owned());
        }
    }
}

/// `UpperCamel` to `snake_case`, as `Code::problem` names a code.
fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The problem codes the service's sources can answer with.
fn codes_in_sources() -> BTreeSet<String> {
    let root = root();
    let backstop = root.join("crates/backstop/src");
    let payment = root.join("crates/payment/src");
    // The service: the server layers and the payment service, not the client stack (its codes
    // are never sent to a caller) nor the PSP simulator (a stand-in for another company's API).
    let mut service: Vec<PathBuf> = sources(&backstop.join("server"));
    service.extend(sources(&backstop.join("admission")));
    service.push(backstop.join("status.rs"));
    service.extend(
        sources(&payment)
            .into_iter()
            .filter(|p| !p.starts_with(payment.join("psp")) && !p.ends_with("psp_client.rs")),
    );

    let mut consts = BTreeMap::new();
    for path in sources(&backstop).iter().chain(&sources(&payment)) {
        const_declarations(&code_of(path), &mut consts);
    }

    let mut codes = BTreeSet::new();
    for path in &service {
        let code = code_of(path);
        // The codes a refusal is built with: `Problem::new(status, CODE)`, `with_problem(CODE)`.
        for call in ["Problem::new(", ".with_problem("] {
            for (at, _) in code.match_indices(call) {
                let args = arguments(&code[at + call.len()..]);
                let code_arg = if call == "Problem::new(" {
                    args.split_once(',').map_or("", |(_, rest)| rest)
                } else {
                    args
                };
                codes.extend(literals(code_arg));
                codes.extend(
                    constants(code_arg)
                        .iter()
                        .filter_map(|c| consts.get(c).cloned()),
                );
            }
        }
        // A status built without a problem code answers with its code's snake-case name.
        for (at, _) in code.match_indices("Status::new(Code::") {
            let rest = &code[at + "Status::new(Code::".len()..];
            let statement = rest.split(';').next().unwrap_or_default();
            if !statement.contains("with_problem(") {
                let name: String = rest
                    .chars()
                    .take_while(char::is_ascii_alphanumeric)
                    .collect();
                codes.insert(snake(&name));
            }
        }
        // Codes chosen by a `fn code(&self) -> &'static str` (an error's problem code).
        for (at, _) in code.match_indices("fn code(&self) -> &'static str") {
            let body = &code[at..];
            let end = body.find("\n    }").unwrap_or(body.len());
            codes.extend(literals(&body[..end]));
        }
    }
    // Every code of the library's catalogue of problem codes.
    let status = code_of(&backstop.join("status.rs"));
    let catalogue = status
        .split("pub mod problem {")
        .nth(1)
        .and_then(|rest| rest.split("\n}").next())
        .expect("status.rs has a problem module");
    let mut listed = BTreeMap::new();
    const_declarations(catalogue, &mut listed);
    codes.extend(listed.into_values());
    codes
}

#[test]
fn every_problem_code_is_listed_in_the_readme() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let codes = codes_in_sources();
    // The scan finds the codes it should: if it found none, it would prove nothing.
    for known in [
        "request_in_progress",
        "malformed_json",
        "payment_outcome_unknown",
        "not_found",
    ] {
        assert!(codes.contains(known), "the scan misses {known}: {codes:?}");
    }
    let missing: Vec<_> = codes
        .iter()
        .filter(|code| !readme.contains(&format!("`{code}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "problem codes the service can answer with but README.md does not list: {missing:?}"
    );
}

/// The OpenAPI document's `Problem.code` enumerates every code the sources can answer with,
/// and only codes README.md explains.
#[test]
fn every_problem_code_is_in_the_openapi_document() {
    use utoipa::OpenApi;
    let document = backstop_payment::service::openapi::ApiDoc::openapi()
        .to_json()
        .expect("the document serializes");
    let document: serde_json::Value = serde_json::from_str(&document).unwrap();
    let code = &document["components"]["schemas"]["Problem"]["properties"]["code"];
    // Inline, the enum sits in a one-element `oneOf` beside the member's description.
    let listed: BTreeSet<String> = code["enum"]
        .as_array()
        .or_else(|| code["oneOf"][0]["enum"].as_array())
        .expect("Problem.code is an enum")
        .iter()
        .map(|c| c.as_str().expect("a string").to_owned())
        .collect();
    let codes = codes_in_sources();
    let missing: Vec<_> = codes.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "codes the OpenAPI document misses: {missing:?}"
    );
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let unexplained: Vec<_> = listed
        .iter()
        .filter(|code| !readme.contains(&format!("`{code}`")))
        .collect();
    assert!(
        unexplained.is_empty(),
        "codes README.md does not explain: {unexplained:?}"
    );
}
