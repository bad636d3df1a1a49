//! What `kiln chat` reads: lines from a line editor with history when
//! stdin is a terminal (else plain lines from stdin), gathered into
//! messages. A paste is one message (the editor takes bracketed pastes
//! whole); a line ending in `\` continues on the next; a block between two
//! `"""` lines is one message; a blank line is nothing.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::Result;
use rustyline::error::ReadlineError;

/// The prompt for a new message, and for the lines that continue one.
pub const PROMPT: &str = ">>> ";
pub const CONTINUE: &str = "... ";

/// The marker that opens and closes a multi-line block.
const BLOCK: &str = "\"\"\"";

/// What one read gave.
#[derive(Debug, PartialEq)]
pub enum Input {
    /// A message or command, without its continuation markers.
    Message(String),
    /// Ctrl-C at the prompt (whatever was typed is dropped).
    Interrupted,
    /// Ctrl-D or the end of stdin.
    End,
}

/// Where lines come from.
pub enum Lines {
    /// A terminal: line editing, history (kept in `history`, if any) and
    /// bracketed paste.
    Editor {
        editor: Box<rustyline::DefaultEditor>,
        history: Option<PathBuf>,
    },
    /// A pipe or file; the prompt goes to stderr.
    Plain(std::io::StdinLock<'static>),
}

impl Lines {
    /// The line editor when stdin and stdout are terminals, else plain
    /// lines. `history` is the file the editor's history is kept in.
    pub fn open(history: Option<PathBuf>) -> Result<Self> {
        if !(std::io::stdin().is_terminal() && std::io::stdout().is_terminal()) {
            return Ok(Lines::Plain(std::io::stdin().lock()));
        }
        let config = rustyline::Config::builder()
            .auto_add_history(false)
            .bracketed_paste(true)
            .max_history_size(1000)?
            .build();
        // Built with its `signal-hook` feature, the editor leaves SIGINT to
        // the chat's own handler (without it, it takes SIGINT over for its
        // whole lifetime, and Ctrl-C could not stop an answer).
        let mut editor = Box::new(rustyline::DefaultEditor::with_config(config)?);
        if let Some(path) = &history {
            // A missing history file is the first session.
            let _ = editor.load_history(path);
        }
        Ok(Lines::Editor { editor, history })
    }

    /// One line, without its newline.
    fn line(&mut self, prompt: &str) -> Result<Option<String>, ReadlineError> {
        match self {
            Lines::Editor { editor, .. } => match editor.readline(prompt) {
                Ok(line) => Ok(Some(line)),
                Err(ReadlineError::Eof) => Ok(None),
                Err(e) => Err(e),
            },
            Lines::Plain(stdin) => {
                eprint!("{prompt}");
                let _ = std::io::stderr().flush();
                let mut line = String::new();
                if stdin.read_line(&mut line)? == 0 {
                    return Ok(None);
                }
                let trimmed = line.trim_end_matches(['\n', '\r']).len();
                line.truncate(trimmed);
                Ok(Some(line))
            }
        }
    }

    /// The next message: lines read until one completes it. Blank lines
    /// are skipped.
    pub fn message(&mut self) -> Result<Input> {
        let mut pending = Pending::default();
        loop {
            let prompt = if pending.is_empty() { PROMPT } else { CONTINUE };
            let line = match self.line(prompt) {
                Ok(Some(line)) => line,
                Ok(None) => return Ok(Input::End),
                Err(ReadlineError::Interrupted) => return Ok(Input::Interrupted),
                Err(e) => return Err(e.into()),
            };
            if let Some(message) = pending.feed(&line) {
                self.remember(&message);
                return Ok(Input::Message(message));
            }
        }
    }

    /// Adds a message to the editor's history and its file.
    fn remember(&mut self, message: &str) {
        if let Lines::Editor { editor, history } = self {
            let _ = editor.add_history_entry(message);
            if let Some(path) = history {
                if let Some(dir) = path.parent() {
                    let _ = std::fs::create_dir_all(dir);
                }
                let _ = editor.save_history(path);
            }
        }
    }
}

/// A message being gathered from lines.
#[derive(Debug, Default)]
struct Pending {
    text: String,
    started: bool,
    /// Inside a `"""` block.
    block: bool,
}

impl Pending {
    fn is_empty(&self) -> bool {
        !self.started
    }

    /// Takes one line; returns the message when it is complete.
    fn feed(&mut self, line: &str) -> Option<String> {
        if self.block {
            if let Some(head) = line.trim_end().strip_suffix(BLOCK) {
                self.text.push_str(head);
                (self.started, self.block) = (false, false);
                let message = std::mem::take(&mut self.text).trim().to_string();
                return Some(message).filter(|m| !m.is_empty());
            }
            self.text.push_str(line);
            self.text.push('\n');
            return None;
        }
        if !self.started {
            if let Some(rest) = line.trim_start().strip_prefix(BLOCK) {
                // `"""text"""` on one line is a whole block.
                if let Some(inner) = rest.trim_end().strip_suffix(BLOCK) {
                    return Some(inner.trim().to_string()).filter(|m| !m.is_empty());
                }
                self.started = true;
                self.block = true;
                if !rest.trim().is_empty() {
                    self.text.push_str(rest);
                    self.text.push('\n');
                }
                return None;
            }
        }
        if let Some(head) = line.strip_suffix('\\') {
            self.started = true;
            self.text.push_str(head);
            self.text.push('\n');
            return None;
        }
        self.text.push_str(line);
        let message = std::mem::take(&mut self.text).trim().to_string();
        self.started = false;
        // A blank line (or blank continuation) is no message.
        Some(message).filter(|m| !m.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages `lines` make, fed in order.
    fn messages(lines: &[&str]) -> Vec<String> {
        let mut p = Pending::default();
        lines.iter().filter_map(|l| p.feed(l)).collect()
    }

    #[test]
    fn one_line_is_one_message_and_blank_lines_are_none() {
        assert_eq!(messages(&["", "  ", "hello", ""]), ["hello"]);
    }

    #[test]
    fn a_pasted_multi_line_text_is_one_message() {
        // The editor hands over a bracketed paste as one line with newlines.
        assert_eq!(messages(&["one\ntwo\nthree"]), ["one\ntwo\nthree"]);
    }

    #[test]
    fn a_trailing_backslash_continues() {
        assert_eq!(
            messages(&["first \\", "second\\", "third", "next"]),
            ["first \nsecond\nthird", "next"]
        );
    }

    #[test]
    fn triple_quotes_make_a_block() {
        assert_eq!(
            messages(&["\"\"\"", "a", "", "/not a command", "\"\"\"", "after"]),
            ["a\n\n/not a command", "after"]
        );
        assert_eq!(messages(&["\"\"\"start", "end\"\"\""]), ["start\nend"]);
        assert_eq!(messages(&["\"\"\"inline\"\"\""]), ["inline"]);
    }

    #[test]
    fn continuation_is_reported_until_the_message_completes() {
        let mut p = Pending::default();
        assert!(p.is_empty());
        assert_eq!(p.feed("\"\"\""), None);
        assert!(!p.is_empty());
        assert_eq!(p.feed("x"), None);
        assert_eq!(p.feed("\"\"\"").as_deref(), Some("x"));
    }
}
