//! One line for an error and its causes.
//!
//! Libraries disagree on whether an error's `Display` includes its source: some print only
//! their own context and leave the cause to `source()`, others repeat the cause's text too, so
//! walking the chain naively prints "error connecting to server: error connecting to server".

use std::error::Error;
use std::fmt;

/// Displays an error followed by each cause in its `source()` chain, separated by `": "`, on
/// one line, leaving out a cause whose text the line already contains.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = String::new();
        let mut next = Some(self.0);
        while let Some(error) = next {
            let text = one_line(&error.to_string());
            if !text.is_empty() && !line.contains(&text) {
                if !line.is_empty() {
                    line.push_str(": ");
                }
                line.push_str(&text);
            }
            next = error.source();
        }
        f.write_str(&line)
    }
}

/// `text` with its line breaks folded into spaces and trimmed, so a multi-line message from a
/// dependency cannot break the one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a fixed text and an optional cause.
    #[derive(Debug)]
    struct Layer {
        text: &'static str,
        source: Option<Box<Layer>>,
    }

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.text)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.source.as_deref().map(|s| s as _)
        }
    }

    fn chain(texts: &[&'static str]) -> Layer {
        texts
            .iter()
            .rev()
            .fold(None, |source, text| {
                Some(Layer {
                    text,
                    source: source.map(Box::new),
                })
            })
            .expect("at least one text")
    }

    #[test]
    fn a_cause_is_printed_after_its_context() {
        let error = chain(&["cannot open the store", "permission denied"]);
        assert_eq!(
            Chain(&error).to_string(),
            "cannot open the store: permission denied"
        );
    }

    #[test]
    fn a_cause_repeated_by_its_context_is_printed_once() {
        let error = chain(&[
            "cannot set up the idempotency store",
            "error connecting to server: Connection refused (os error 111)",
            "error connecting to server",
            "Connection refused (os error 111)",
        ]);
        assert_eq!(
            Chain(&error).to_string(),
            "cannot set up the idempotency store: error connecting to server: Connection refused (os error 111)"
        );
    }

    #[test]
    fn identical_texts_in_a_row_are_printed_once() {
        let error = chain(&["error connecting to server", "error connecting to server"]);
        assert_eq!(Chain(&error).to_string(), "error connecting to server");
    }

    #[test]
    fn the_chain_is_one_line() {
        let error = chain(&[
            "cannot listen on 127.0.0.1:8081",
            "address in use\n  (busy)\n",
        ]);
        let line = Chain(&error).to_string();
        assert_eq!(
            line,
            "cannot listen on 127.0.0.1:8081: address in use (busy)"
        );
        assert!(!line.contains('\n'));
    }

    #[test]
    fn empty_texts_leave_no_separator() {
        let error = chain(&["", "disk full"]);
        assert_eq!(Chain(&error).to_string(), "disk full");
    }
}
