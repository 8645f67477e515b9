//! What an operator meets first: start-up errors, help texts, log formats.

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("the binary runs")
}

#[test]
fn an_invalid_rust_log_is_a_one_line_start_up_error() {
    // `load` would otherwise send to this target: the error must come before anything starts.
    let out = run(
        &["load", "--target", "http://127.0.0.1:9", "--duration", "1s"],
        &[("RUST_LOG", "backstop=loud")],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: invalid RUST_LOG \"backstop=loud\""),
        "{stderr}"
    );
}

#[test]
fn a_bad_log_format_is_refused() {
    let out = run(&["--log-format", "xml", "psp"], &[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("json") && stderr.contains("text"),
        "{stderr}"
    );
}

/// The first log line of `backstop [global...] psp` on a free port; the child is stopped after.
fn first_psp_log_line(global: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(BIN)
        .args(global)
        .args(["psp", "--listen", "127.0.0.1:0"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut line = String::new();
    let read = BufReader::new(child.stderr.take().unwrap()).read_line(&mut line);
    let _ = child.kill();
    let _ = child.wait();
    read.expect("a log line");
    line
}

#[test]
fn logs_are_json_off_a_terminal_and_text_on_request() {
    let json = first_psp_log_line(&[]);
    let event: serde_json::Value = serde_json::from_str(&json).expect("a pipe gets JSON");
    assert_eq!(event["fields"]["message"], "starting psp", "{json}");
    let text = first_psp_log_line(&["--log-format", "text"]);
    assert!(
        serde_json::from_str::<serde_json::Value>(&text).is_err(),
        "{text}"
    );
    assert!(
        text.contains("INFO") && text.contains("starting psp"),
        "{text}"
    );
    assert!(
        !text.contains('\x1b'),
        "no colours off a terminal: {text:?}"
    );
    let chosen = first_psp_log_line(&["--log-format", "json"]);
    assert!(
        serde_json::from_str::<serde_json::Value>(&chosen).is_ok(),
        "{chosen}"
    );
}

/// Every subcommand of `backstop`, as `backstop --help` should list it.
const SUBCOMMANDS: [&str; 8] = [
    "serve",
    "psp",
    "load",
    "reconcile",
    "storm",
    "chaos",
    "proxy",
    "retries",
];

fn help(args: &[&str]) -> String {
    let out = run(args, &[]);
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn help_lists_every_subcommand_with_a_one_line_description() {
    let text = help(&["--help"]);
    let commands = text
        .split("Commands:\n")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .unwrap_or_else(|| panic!("no command list: {text}"));
    for name in SUBCOMMANDS {
        let line = commands
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from: {text}"));
        let description = line.trim_start()[name.len()..].trim();
        assert!(
            description.len() > 20,
            "{name} needs a description: {line:?}"
        );
        assert!(
            description.len() < 100,
            "one short line for {name}: {line:?}"
        );
    }
    // A new subcommand must be added here, and so to this check.
    let listed = commands
        .lines()
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect::<Vec<_>>();
    assert_eq!(listed, SUBCOMMANDS, "{text}");
}

/// Where `text` cites a section of a document that does not ship with the product: "seed
/// 2.4.3", "the seed's", "DESIGN section 6", "section 3", "§", or a bare "2.10.2".
fn section_references(text: &str) -> Vec<String> {
    let lower = text.to_lowercase();
    let mut found: Vec<String> = [
        "seed 2",
        "seed 1",
        "seed's",
        "design.md",
        "design section",
        "§",
        "chapter",
    ]
    .into_iter()
    .filter(|needle| lower.contains(needle))
    .map(str::to_owned)
    .collect();
    for word in lower.split(|c: char| !(c.is_ascii_digit() || c == '.')) {
        let word = word.trim_end_matches('.');
        let parts: Vec<_> = word.split('.').collect();
        // Three numbers: a section number (an address has four, a rate or a version in a help
        // text has two).
        if parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.len() <= 2) {
            found.push(word.to_owned());
        }
    }
    for (at, _) in lower.match_indices("section ") {
        if lower[at + "section ".len()..].starts_with(|c: char| c.is_ascii_digit()) {
            found.push(lower[at..].chars().take(12).collect());
        }
    }
    found
}

#[test]
fn the_reference_finder_finds_references() {
    assert_eq!(section_references("as seed 2.4.3 says").len(), 2);
    assert!(!section_references("(the seed's 2.10.2 bug)").is_empty());
    assert!(!section_references("DESIGN section 6").is_empty());
    assert!(section_references("listen on 127.0.0.1:8081, rate in [0, 1], 0.25").is_empty());
    assert!(section_references("Seed of the fault RNG").is_empty());
}

#[test]
fn no_help_text_cites_a_document_section() {
    let mut pages = vec![help(&["--help"])];
    for name in SUBCOMMANDS {
        pages.push(help(&[name, "--help"]));
        pages.push(help(&[name, "-h"]));
    }
    pages.push(help(&["storm", "sim", "--help"]));
    for page in pages {
        let found = section_references(&page);
        assert!(found.is_empty(), "{found:?} in:\n{page}");
    }
}

/// The long flags `backstop ARGS --help` lists (`--max-inflight`, ...), `--help` itself left
/// out.
fn long_flags(args: &[&str]) -> Vec<String> {
    let mut args = args.to_vec();
    args.push("--help");
    let text = help(&args);
    let mut flags: Vec<String> = text
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("--"))
        .map(|flag| {
            flag.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .next()
                .unwrap_or_default()
        })
        .filter(|flag| !flag.is_empty() && *flag != "help")
        .map(|flag| format!("--{flag}"))
        .collect();
    flags.sort();
    flags.dedup();
    flags
}

#[test]
fn package_assets_are_the_flags_of_this_binary() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        &[
            "package-assets",
            "--out-dir",
            dir.path().to_str().expect("a UTF-8 temporary path"),
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let read = |path: &str| {
        std::fs::read_to_string(dir.path().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    // A page for the command and each visible subcommand (and those of storm and retries),
    // none for hidden ones.
    let mut pages: Vec<String> = std::fs::read_dir(dir.path().join("man"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    pages.sort();
    let mut expected: Vec<String> = SUBCOMMANDS
        .iter()
        .map(|name| format!("backstop-{name}.1"))
        .chain(
            [
                "backstop.1",
                "backstop-storm-sim.1",
                "backstop-storm-run.1",
                "backstop-retries-off.1",
                "backstop-retries-on.1",
                "backstop-retries-ratio.1",
                "backstop-retries-status.1",
                "backstop-retries-webhook.1",
            ]
            .map(String::from),
        )
        .collect();
    expected.sort();
    assert_eq!(pages, expected);
    let completions = [
        read("completions/backstop.bash"),
        read("completions/_backstop"),
        read("completions/backstop.fish"),
    ];
    // Every flag `serve --help` shows is on its page and in every shell's completions.
    let serve_page = read("man/backstop-serve.1");
    let flags = long_flags(&["serve"]);
    assert!(flags.contains(&"--max-inflight".to_owned()), "{flags:?}");
    for flag in &flags {
        // roff escapes the dashes: `\-\-max\-inflight`.
        let escaped = flag.replace('-', "\\-");
        assert!(
            serve_page.contains(&escaped),
            "{flag} missing from backstop-serve.1"
        );
        let bare = flag.trim_start_matches('-');
        for (shell, text) in ["bash", "zsh", "fish"].iter().zip(&completions) {
            assert!(
                text.contains(bare),
                "{flag} missing from the {shell} completions"
            );
        }
    }
    assert!(!read("man/backstop.1").contains("package\\-assets"));
}
