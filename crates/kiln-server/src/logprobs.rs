//! Token logprobs in the OpenAI shapes, with each token's raw bytes: GPT-2
//! byte-level vocabularies (`Ġworld`) are mapped back through the byte
//! table, SentencePiece ones (`▁world`, `<0x0A>`) through their spelling.

use kiln_sampling::{Sampled, TokenId};
use kiln_text::Tokenizer;
use serde_json::{Map, Value};

use crate::openai_types::{CompletionLogprobs, TokenLogprob, TopLogprob};

/// What OpenAI sends for a logprob of minus infinity.
const NEG_INF_LOGPROB: f32 = -9999.0;

/// Spells tokens as their bytes and text.
pub struct TokenSpeller<'a> {
    tokenizer: &'a Tokenizer,
    byte_level: bool,
}

impl<'a> TokenSpeller<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        // Byte-level BPE vocabularies spell the space byte as `Ġ`.
        let byte_level = tokenizer.token_to_id("\u{120}").is_some();
        TokenSpeller {
            tokenizer,
            byte_level,
        }
    }

    /// The raw bytes of a token (empty for an id outside the vocabulary).
    pub fn bytes(&self, id: TokenId) -> Vec<u8> {
        let Some(piece) = self.tokenizer.id_to_token(id.0) else {
            return Vec::new();
        };
        if self.tokenizer.is_special(id.0) {
            return piece.into_bytes();
        }
        if let Some(b) = byte_fallback(&piece) {
            return vec![b];
        }
        if self.byte_level {
            if let Some(bytes) = piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>() {
                return bytes;
            }
        }
        piece.replace('\u{2581}', " ").into_bytes()
    }

    /// The token as text (bytes that are not UTF-8 on their own become U+FFFD) and its bytes.
    pub fn spell(&self, id: TokenId) -> (String, Vec<u8>) {
        let bytes = self.bytes(id);
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// A chat `logprobs.content` entry.
    pub fn chat_entry(&self, sampled: &Sampled) -> TokenLogprob {
        let (token, bytes) = self.spell(sampled.token);
        TokenLogprob {
            token,
            logprob: finite(sampled.logprob),
            bytes,
            top_logprobs: sampled
                .top
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = self.spell(id);
                    TopLogprob {
                        token,
                        logprob: finite(logprob),
                        bytes,
                    }
                })
                .collect(),
        }
    }

    /// Appends one token to completions `logprobs`, at `text_offset`.
    pub fn push_completion(
        &self,
        out: &mut CompletionLogprobs,
        sampled: &Sampled,
        text_offset: usize,
    ) {
        let (token, _) = self.spell(sampled.token);
        out.tokens.push(token);
        out.token_logprobs.push(finite(sampled.logprob));
        let mut top = Map::new();
        for &(id, logprob) in &sampled.top {
            let (t, _) = self.spell(id);
            top.insert(t, Value::from(finite(logprob)));
        }
        out.top_logprobs.push(top);
        out.text_offset.push(text_offset);
    }
}

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        NEG_INF_LOGPROB
    }
}

/// SentencePiece byte-fallback pieces: `<0x0A>`.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The byte a GPT-2 byte-level character stands for: printable Latin-1
/// bytes stand for themselves, the other 68 bytes are `U+0100 + n` in order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let code = c as u32;
    if code < 0x100 {
        return printable(code).then_some(code as u8);
    }
    let n = code - 0x100;
    (0u32..0x100)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_byte_table() {
        assert_eq!(byte_of_char('Ġ'), Some(b' '));
        assert_eq!(byte_of_char('Ċ'), Some(b'\n'));
        assert_eq!(byte_of_char('a'), Some(b'a'));
        assert_eq!(byte_of_char('é'), Some(0xE9));
        assert_eq!(byte_of_char(' '), None);
        assert_eq!(byte_of_char('\u{2581}'), None);
    }

    #[test]
    fn sentencepiece_byte_pieces() {
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0x0>"), None);
        assert_eq!(byte_fallback("hello"), None);
    }
}
