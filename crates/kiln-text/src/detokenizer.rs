//! [`IncrementalDetokenizer`]: text for a stream of generated ids, one id at a time.
//!
//! Decoding one id alone is wrong in general: a character may span several byte tokens,
//! and SentencePiece decoders treat the first token of a sequence differently. This
//! uses the prefix/read-offset technique of vLLM and TGI: each step decodes only the
//! ids from `prefix_offset` on, twice (without and with the ids after `read_offset`),
//! and emits the difference. While that text ends in U+FFFD, the last character may be
//! incomplete, so nothing is emitted and the offsets stay; the next id usually
//! completes it. A step costs a decode of the few ids since the last emission, so a
//! whole stream costs linear time, not quadratic.
//!
//! Invariant: the concatenation of everything [`IncrementalDetokenizer::push`] and
//! [`IncrementalDetokenizer::finish`] return equals `tokenizer.decode(all_ids,
//! skip_special)`.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Turns generated ids into text as they arrive, never splitting a UTF-8 character.
#[derive(Debug)]
pub struct IncrementalDetokenizer<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Where the decoded window starts; its text up to `read_offset` was emitted already.
    prefix_offset: usize,
    /// The ids before this one have all been emitted.
    read_offset: usize,
}

impl<'a> IncrementalDetokenizer<'a> {
    /// A detokenizer for a new stream; `skip_special` leaves special tokens out, as in
    /// [`Tokenizer::decode`].
    pub fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        IncrementalDetokenizer {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one id and returns the text it completes (often empty while a multi-byte
    /// character is still incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let (prefix_text, new_text) = self.window_texts()?;
        if new_text.ends_with('\u{fffd}') {
            return Ok(String::new());
        }
        match new_text.get(prefix_text.len()..) {
            Some(delta) if new_text.len() > prefix_text.len() => {
                let delta = delta.to_string();
                self.advance();
                Ok(delta)
            }
            _ => Ok(String::new()),
        }
    }

    /// Returns whatever is still held back (an incomplete character decodes as
    /// U+FFFD) and resets the stream.
    pub fn finish(&mut self) -> Result<String> {
        let (prefix_text, new_text) = self.window_texts()?;
        let delta = new_text
            .get(prefix_text.len()..)
            .filter(|_| new_text.len() > prefix_text.len())
            .unwrap_or("")
            .to_string();
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(delta)
    }

    /// All ids pushed since the stream began.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The decoded text of `ids[prefix_offset..read_offset]` and of `ids[prefix_offset..]`.
    fn window_texts(&self) -> Result<(String, String)> {
        let window = &self.ids[self.prefix_offset..];
        let num_read = self.read_offset - self.prefix_offset;
        let prefix_text = self
            .tokenizer
            .decode(&window[..num_read], self.skip_special)?;
        let new_text = self.tokenizer.decode(window, self.skip_special)?;
        Ok((prefix_text, new_text))
    }

    /// Everything up to the newest id has been emitted: the window now starts where the
    /// last emitted ids start.
    fn advance(&mut self) {
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
    }
}
