//! `backstop package-assets --out-dir DIR` (hidden): the man pages and shell completions the
//! Debian package installs (`deploy/debian/build`), generated from the same `clap` definitions
//! the binary parses its command line with, so that they cannot drift from its flags.
//!
//! It writes `DIR/man/backstop.1` and one page per visible subcommand (`backstop-serve.1`,
//! `backstop-storm-sim.1`, ...), and `DIR/completions/` `backstop.bash`, `_backstop` (zsh) and
//! `backstop.fish`.

use std::error::Error;
use std::path::{Path, PathBuf};

use clap_complete::Shell;

/// Flags of `backstop package-assets`.
#[derive(Debug, clap::Args)]
pub(crate) struct PackageAssetsArgs {
    /// Directory to write `man/` and `completions/` into (created when missing).
    #[arg(long, value_name = "DIR")]
    out_dir: PathBuf,
}

/// Shells whose completions the package installs.
const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// Writes the man pages and completions of `command` (the whole `backstop` command) under
/// `args.out_dir`, and prints the paths written.
pub(crate) fn run(args: &PackageAssetsArgs, command: clap::Command) -> Result<(), Box<dyn Error>> {
    let man = args.out_dir.join("man");
    let completions = args.out_dir.join("completions");
    for dir in [&man, &completions] {
        // Stale pages of a renamed subcommand must not be packaged.
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| with_path(e, dir))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| with_path(e, dir))?;
    }
    let name = command.get_name().to_owned();
    // Hidden subcommands (development aids, this one) get no page.
    clap_mangen::generate_to(command.clone(), &man).map_err(|e| with_path(e, &man))?;
    let mut command = command;
    for shell in SHELLS {
        clap_complete::generate_to(shell, &mut command, &name, &completions)
            .map_err(|e| with_path(e, &completions))?;
    }
    for dir in [&man, &completions] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| with_path(e, dir))?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .map_err(|e| with_path(e, dir))?;
        files.sort();
        for file in files {
            println!("{}", file.display());
        }
    }
    Ok(())
}

fn with_path(error: std::io::Error, path: &Path) -> String {
    format!("{}: {error}", path.display())
}
