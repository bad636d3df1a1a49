//! Generated text split into reasoning, answer text and tool calls — the
//! same pieces whether the text arrives whole or token by token, so
//! streamed and non-streamed responses carry the same thing.

mod forced;
mod gemma;
mod harmony;
mod json_scan;
mod reasoning;
#[cfg(test)]
mod tests;
mod tools;
mod xml_calls;

pub use forced::ForcedCallStream;
pub use harmony::HarmonyStream;
pub use reasoning::{Split, ThinkSplitter, ThinkSyntax};
pub use tools::{CallSpelling, ToolCall, ToolStream, ToolSyntax};

/// A decided piece of output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Text(String),
    Call(ToolCall),
    /// A forced call opens (its arguments follow as they are written).
    CallOpen {
        name: String,
    },
    /// More of the open call's arguments.
    CallArguments(String),
}

/// What the server says about the model's output where the chat template
/// should not decide (`--tool-call-parser`, `--reasoning-parser`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputOverrides {
    /// The tool-call syntax (else the one the template teaches).
    pub tool_syntax: Option<ToolSyntax>,
    /// Whether `<think>` blocks are split out (else: when the template
    /// mentions them).
    pub reasoning: Option<bool>,
}

/// What to look for in one request's output.
#[derive(Debug, Clone, Default)]
pub struct OutputSyntax {
    /// The reasoning tags, and whether the prompt has opened them.
    pub think: Option<(ThinkSyntax, bool)>,
    /// The tool-call syntax and the declared tools.
    pub tools: Option<(ToolSyntax, Vec<String>)>,
    /// The answer is one call the output format forces
    /// ([`ForcedCallStream`]), whatever the syntax.
    pub forced_call: bool,
    /// gpt-oss's harmony channels ([`HarmonyStream`]): reasoning, answer
    /// and calls all come from its message headers.
    pub harmony: bool,
}

impl OutputSyntax {
    /// Whether anything is parsed at all.
    pub fn is_plain(&self) -> bool {
        self.think.is_none() && self.tools.is_none() && !self.forced_call && !self.harmony
    }
}

/// The streaming parser of one output (with a plain syntax, every piece
/// of text is text).
#[derive(Debug)]
pub struct OutputParser {
    think: Option<ThinkSplitter>,
    tools: Option<ToolStream>,
    forced: Option<ForcedCallStream>,
    harmony: Option<HarmonyStream>,
}

impl OutputParser {
    pub fn new(syntax: &OutputSyntax) -> Self {
        OutputParser {
            think: syntax
                .think
                .clone()
                .map(|(s, opened)| ThinkSplitter::new(s, opened)),
            tools: syntax
                .tools
                .clone()
                .filter(|_| !syntax.forced_call)
                .map(|(s, names)| ToolStream::new(s, names)),
            forced: syntax.forced_call.then(|| {
                let names = syntax.tools.clone().map(|t| t.1).unwrap_or_default();
                ForcedCallStream::new(names)
            }),
            // A forced call's output is the bare call, without headers.
            harmony: (syntax.harmony && !syntax.forced_call).then(HarmonyStream::new),
        }
    }

    /// Takes the next piece of output; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        if let Some(h) = self.harmony.as_mut() {
            return h.push(text);
        }
        let splits = match self.think.as_mut() {
            Some(t) => t.push(text),
            None => vec![Split::Answer(text.to_string())],
        };
        self.answer(splits, false)
    }

    /// The end of the output: everything held is decided.
    pub fn finish(&mut self) -> Vec<Piece> {
        if let Some(h) = self.harmony.as_mut() {
            return h.finish();
        }
        let splits = match self.think.as_mut() {
            Some(t) => t.finish(),
            None => Vec::new(),
        };
        self.answer(splits, true)
    }

    fn answer(&mut self, splits: Vec<Split>, end: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        for s in splits {
            match (s, self.tools.as_mut(), self.forced.as_mut()) {
                (Split::Reasoning(r), _, _) => out.push(Piece::Reasoning(r)),
                (Split::Answer(a), _, Some(f)) => out.extend(f.push(&a)),
                (Split::Answer(a), Some(t), None) => out.extend(t.push(&a)),
                (Split::Answer(a), None, None) if !a.is_empty() => out.push(Piece::Text(a)),
                _ => {}
            }
        }
        if end {
            if let Some(t) = self.tools.as_mut() {
                out.extend(t.finish());
            }
            if let Some(f) = self.forced.as_mut() {
                out.extend(f.finish());
            }
        }
        out
    }
}

/// A whole output, parsed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    pub reasoning: Option<String>,
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    /// The pieces in order, neighbours of one kind merged: the blocks of
    /// an Anthropic message.
    pub pieces: Vec<Piece>,
}

impl Parsed {
    /// Gathers pieces (as a stream gave them) into the whole answer; a
    /// call that came in parts is one [`Piece::Call`].
    pub fn from_pieces(pieces: impl IntoIterator<Item = Piece>) -> Parsed {
        let mut p = Parsed::default();
        for piece in pieces {
            let piece = match piece {
                Piece::CallOpen { name } => Piece::Call(ToolCall {
                    name,
                    arguments: String::new(),
                }),
                Piece::CallArguments(a) => {
                    if let Some(Piece::Call(c)) = p.pieces.last_mut() {
                        c.arguments.push_str(&a);
                    }
                    if let Some(c) = p.calls.last_mut() {
                        c.arguments.push_str(&a);
                    }
                    continue;
                }
                piece => piece,
            };
            match &piece {
                Piece::Reasoning(r) => p.reasoning.get_or_insert_with(String::new).push_str(r),
                Piece::Text(t) => p.content.get_or_insert_with(String::new).push_str(t),
                Piece::Call(c) => p.calls.push(c.clone()),
                Piece::CallOpen { .. } | Piece::CallArguments(_) => {}
            }
            match (p.pieces.last_mut(), piece) {
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, piece) => p.pieces.push(piece),
            }
        }
        p
    }
}

/// Parses a whole output.
pub fn parse(text: &str, syntax: &OutputSyntax) -> Parsed {
    let mut parser = OutputParser::new(syntax);
    let mut pieces = parser.push(text);
    pieces.extend(parser.finish());
    Parsed::from_pieces(pieces)
}
