//! gpt-oss's `harmony` output: messages of the form
//! `<|channel|>NAME[ to=RECIPIENT][<|constrain|>json]<|message|>BODY` ended
//! by `<|end|>`, `<|call|>` or `<|return|>`, the next one opened by
//! `<|start|>assistant` (the recipient may also stand before the channel:
//! `<|start|>assistant to=functions.f<|channel|>commentary ...`). The
//! `analysis` channel is reasoning; a message to `functions.NAME` is a call
//! of `NAME` with the body as its arguments; any other message (`final`,
//! `commentary` with no recipient) is answer text.

use super::tools::ToolCall;
use super::Piece;

/// The markers that end a message body.
const BODY_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];
const MESSAGE: &str = "<|message|>";

/// Where the stream is.
#[derive(Debug)]
enum State {
    /// In a header: its text so far.
    Header(String),
    /// In a body of the given kind.
    Body(Kind),
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Reasoning,
    Text,
    /// A call of the function, its arguments so far.
    Call(String, String),
}

/// The streaming harmony parser of one output.
#[derive(Debug)]
pub struct HarmonyStream {
    state: State,
    /// Body text held back: it may be the start of a marker.
    held: String,
}

impl Default for HarmonyStream {
    fn default() -> Self {
        Self::new()
    }
}

impl HarmonyStream {
    pub fn new() -> Self {
        HarmonyStream {
            state: State::Header(String::new()),
            held: String::new(),
        }
    }

    /// The pieces `text` decides.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            match &mut self.state {
                State::Header(h) => {
                    h.push_str(&std::mem::take(&mut self.held));
                    let Some(at) = h.find(MESSAGE) else { break };
                    let rest = h[at + MESSAGE.len()..].to_string();
                    let kind = header_kind(&h[..at]);
                    self.state = State::Body(kind);
                    self.held = rest;
                }
                State::Body(kind) => {
                    let end = BODY_ENDS
                        .iter()
                        .filter_map(|m| self.held.find(m).map(|i| (i, m.len())))
                        .min();
                    match end {
                        Some((i, len)) => {
                            let body = self.held[..i].to_string();
                            let rest = self.held[i + len..].to_string();
                            emit(kind, body, &mut out);
                            close(kind, &mut out);
                            self.state = State::Header(String::new());
                            self.held = rest;
                        }
                        None => {
                            // Keep what could begin a marker.
                            let keep = partial_marker(&self.held);
                            let body = self.held[..self.held.len() - keep].to_string();
                            self.held.drain(..self.held.len() - keep);
                            emit(kind, body, &mut out);
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    /// The end of the output (a stop token such as `<|return|>` or
    /// `<|call|>` is not in the text): what is held is decided, an open
    /// call is complete.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        match &mut self.state {
            State::Body(kind) => {
                let body = std::mem::take(&mut self.held);
                emit(kind, body, &mut out);
                close(kind, &mut out);
            }
            // A header the model never finished: its text is the answer,
            // as a plain model's would be.
            State::Header(h) => {
                let text = std::mem::take(h) + &std::mem::take(&mut self.held);
                let text = text.trim_start_matches("<|start|>assistant");
                if !text.is_empty() && !text.starts_with("<|channel|>") {
                    out.push(Piece::Text(text.to_string()));
                }
            }
        }
        self.state = State::Header(String::new());
        out
    }
}

/// What a header says the body is.
fn header_kind(header: &str) -> Kind {
    let recipient = header
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("to="))
        .map(|r| r.split("<|").next().unwrap_or(r))
        .next_back();
    if let Some(name) = recipient.and_then(|r| r.strip_prefix("functions.")) {
        return Kind::Call(name.to_string(), String::new());
    }
    let channel = header
        .rsplit("<|channel|>")
        .next()
        .filter(|_| header.contains("<|channel|>"))
        .and_then(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next())
        .unwrap_or("");
    match channel {
        "analysis" => Kind::Reasoning,
        _ => Kind::Text,
    }
}

fn emit(kind: &mut Kind, body: String, out: &mut Vec<Piece>) {
    if body.is_empty() {
        return;
    }
    match kind {
        Kind::Reasoning => out.push(Piece::Reasoning(body)),
        Kind::Text => out.push(Piece::Text(body)),
        Kind::Call(_, args) => args.push_str(&body),
    }
}

/// A call's body is complete.
fn close(kind: &mut Kind, out: &mut Vec<Piece>) {
    if let Kind::Call(name, args) = kind {
        out.push(Piece::Call(ToolCall {
            name: std::mem::take(name),
            arguments: std::mem::take(args).trim().to_string(),
        }));
    }
}

/// Bytes at the end of `s` that could be the start of a marker.
fn partial_marker(s: &str) -> usize {
    let mut keep = 0;
    for m in BODY_ENDS {
        for n in (1..m.len()).rev() {
            if n > keep && s.ends_with(&m[..n]) {
                keep = n;
                break;
            }
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::Parsed;

    const OUT: &str = "<|channel|>analysis<|message|>The user wants weather. Call the tool.<|end|>\
        <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
        <|message|>{\"city\": \"Paris\"}";

    fn whole(text: &str) -> Parsed {
        let mut h = HarmonyStream::new();
        let mut pieces = h.push(text);
        pieces.extend(h.finish());
        Parsed::from_pieces(pieces)
    }

    #[test]
    fn analysis_is_reasoning_and_a_function_recipient_is_a_call() {
        let p = whole(OUT);
        assert_eq!(
            p.reasoning.as_deref(),
            Some("The user wants weather. Call the tool.")
        );
        assert_eq!(p.content, None);
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].name, "get_weather");
        assert_eq!(p.calls[0].arguments, "{\"city\": \"Paris\"}");
    }

    #[test]
    fn final_is_the_answer_and_streaming_gives_the_same_pieces() {
        let text = "<|channel|>analysis<|message|>Think <|briefly|>.<|end|>\
            <|start|>assistant<|channel|>final<|message|>It is 21 °C in Paris.";
        let p = whole(text);
        assert_eq!(p.reasoning.as_deref(), Some("Think <|briefly|>."));
        assert_eq!(p.content.as_deref(), Some("It is 21 °C in Paris."));
        // Any split into pieces, even inside markers and characters.
        for step in [1, 2, 3, 5, 7] {
            let mut h = HarmonyStream::new();
            let mut pieces = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for chunk in chars.chunks(step) {
                pieces.extend(h.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(h.finish());
            assert_eq!(Parsed::from_pieces(pieces), p, "chunks of {step}");
        }
        // The recipient before the channel, and a call ended by <|call|>.
        let q = whole(
            "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>",
        );
        assert_eq!(q.calls[0].name, "lookup");
        assert_eq!(q.calls[0].arguments, "{}");
    }

    #[test]
    fn text_without_harmony_headers_is_the_answer() {
        let p = whole("plain words");
        assert_eq!(p.content.as_deref(), Some("plain words"));
        assert!(whole("").pieces.is_empty());
    }
}
