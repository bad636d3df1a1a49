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
//! skip_special)` whenever the ids decode to valid UTF-8. The one exception is a run
//! of byte-fallback tokens (`<0xE2>`) that ends in an invalid sequence: the
//! `ByteFallback` decoder then turns the whole run into U+FFFD, one per byte, including
//! characters of the run that were complete and already streamed. A stream cannot take
//! those back; it keeps them and emits the invalid tail on its own (one U+FFFD per
//! byte token), so the stream shows more of the text than the full decode does.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Turns generated ids into text as they arrive, never splitting a UTF-8 character.
#[derive(Debug)]
pub struct IncrementalDetokenizer<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// How many ids at the start of `ids` are context, not output.
    num_context: usize,
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
            num_context: 0,
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// A detokenizer whose output continues `context` (the prompt's last few ids, say
    /// five): it returns `decode(context + ids)` minus `decode(context)`, as
    /// transformers' streamers do. This matters for SentencePiece decoders that drop
    /// the space of the first word (`▁Paris` alone decodes to `Paris`).
    pub fn with_context(tokenizer: &'a Tokenizer, skip_special: bool, context: &[u32]) -> Self {
        IncrementalDetokenizer {
            tokenizer,
            skip_special,
            ids: context.to_vec(),
            num_context: context.len(),
            prefix_offset: 0,
            read_offset: context.len(),
        }
    }

    /// Adds one id and returns the text it completes (often empty while a multi-byte
    /// character is still incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let delta = self.pending_text()?;
        if delta.is_empty() || delta.ends_with('\u{fffd}') {
            return Ok(String::new());
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Returns whatever is still held back (an incomplete character decodes as
    /// U+FFFD) and resets the stream.
    pub fn finish(&mut self) -> Result<String> {
        let delta = self.pending_text()?;
        self.ids.clear();
        self.num_context = 0;
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(delta)
    }

    /// All ids pushed since the stream began (without the context).
    pub fn ids(&self) -> &[u32] {
        &self.ids[self.num_context..]
    }

    /// The text of the ids after `read_offset`: the decode of the window from
    /// `prefix_offset` minus the already emitted decode of `prefix_offset..read_offset`.
    /// If the window's start no longer decodes to the emitted text (an invalid
    /// byte-fallback run, see the module documentation), the new ids are decoded alone.
    fn pending_text(&self) -> Result<String> {
        let window = &self.ids[self.prefix_offset..];
        let num_read = self.read_offset - self.prefix_offset;
        let decode = |ids: &[u32]| self.tokenizer.decode(ids, self.skip_special);
        let prefix_text = decode(&window[..num_read])?;
        let new_text = decode(window)?;
        match new_text.strip_prefix(prefix_text.as_str()) {
            Some(delta) => Ok(delta.to_string()),
            None => decode(&window[num_read..]),
        }
    }
}
