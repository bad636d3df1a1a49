//! `<think>…</think>` reasoning split from the answer as it streams: the
//! Qwen3 / DeepSeek-R1 / SmolLM3 form, also when the template has already
//! opened the tag in the prompt (the output then starts inside it).
//!
//! Reasoning is trimmed at both ends (an empty `<think>\n\n</think>` gives
//! none) and blanks right after `</think>` are dropped. An answer that does
//! not start with `<think>` has no reasoning; a `</think>` that never comes
//! makes all of the output reasoning.

/// The tags of one reasoning syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkSyntax {
    pub open: String,
    pub close: String,
}

impl ThinkSyntax {
    /// The syntax a chat template uses, if it thinks.
    pub fn detect(template: &str) -> Option<ThinkSyntax> {
        (template.contains("<think>") || template.contains("</think>")).then(|| ThinkSyntax {
            open: "<think>".into(),
            close: "</think>".into(),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet known whether the output opens with the tag.
    Start,
    Thinking,
    /// Right after the closing tag: blanks are dropped.
    Closed,
    Answer,
}

/// Splits one output into reasoning and answer text.
#[derive(Debug)]
pub struct ThinkSplitter {
    syntax: ThinkSyntax,
    state: State,
    buf: String,
    /// Reasoning released so far is non-empty (leading blanks are dropped).
    reasoned: bool,
}

/// A decided piece of output.
#[derive(Debug, Clone, PartialEq)]
pub enum Split {
    Reasoning(String),
    Answer(String),
}

impl ThinkSplitter {
    /// `opened`: the prompt ends inside an open tag.
    pub fn new(syntax: ThinkSyntax, opened: bool) -> Self {
        ThinkSplitter {
            syntax,
            state: if opened {
                State::Thinking
            } else {
                State::Start
            },
            buf: String::new(),
            reasoned: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Split> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(false, &mut out);
        out
    }

    pub fn finish(&mut self) -> Vec<Split> {
        let mut out = Vec::new();
        self.drain(true, &mut out);
        out
    }

    fn drain(&mut self, end: bool, out: &mut Vec<Split>) {
        loop {
            match self.state {
                State::Start => {
                    let rest = self.buf.trim_start();
                    if rest.starts_with(&self.syntax.open) {
                        let skip = self.buf.len() - rest.len() + self.syntax.open.len();
                        self.buf.drain(..skip);
                        self.state = State::Thinking;
                    } else if !end && self.syntax.open.starts_with(rest) {
                        // Blank, or a prefix of the tag: wait.
                        return;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if !self.reasoned {
                        let blank = self.buf.len() - self.buf.trim_start().len();
                        self.buf.drain(..blank);
                    }
                    if let Some(pos) = self.buf.find(&self.syntax.close) {
                        let text = self.buf[..pos].trim_end().to_string();
                        self.buf.drain(..pos + self.syntax.close.len());
                        self.release(text, out);
                        self.state = State::Closed;
                        continue;
                    }
                    // Hold blanks and a tail that could start the tag.
                    let keep = if end {
                        self.buf.len() - self.buf.trim_end().len()
                    } else {
                        let tag = (1..self.syntax.close.len())
                            .rev()
                            .find(|&n| self.buf.ends_with(&self.syntax.close[..n]))
                            .unwrap_or(0);
                        let body = &self.buf[..self.buf.len() - tag];
                        self.buf.len() - body.trim_end().len()
                    };
                    let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.release(text, out);
                    if end {
                        self.buf.clear();
                    }
                    return;
                }
                State::Closed => {
                    let blank = self.buf.len() - self.buf.trim_start().len();
                    self.buf.drain(..blank);
                    if self.buf.is_empty() {
                        return;
                    }
                    self.state = State::Answer;
                }
                State::Answer => {
                    if !self.buf.is_empty() {
                        out.push(Split::Answer(std::mem::take(&mut self.buf)));
                    }
                    return;
                }
            }
        }
    }

    fn release(&mut self, text: String, out: &mut Vec<Split>) {
        if !text.is_empty() {
            self.reasoned = true;
            out.push(Split::Reasoning(text));
        }
    }
}
