//! Constrained decoding: a request's output format (a JSON schema, any JSON
//! object, a regex, a Lark grammar, or one of a list of strings) compiled by
//! `llguidance` over the model's vocabulary into a token mask per step.
//!
//! [`StructuredVocab`] indexes a tokenizer once per model (every token's
//! bytes; special tokens marked so no grammar can spell them as text).
//! [`Constraint`] is one request's state: before each sampling step
//! [`Constraint::mask_logits`] sets every token the grammar forbids to
//! `-inf`, after it [`Constraint::commit`] advances the grammar. The end of
//! the output is the model's end-of-sequence token, allowed only where the
//! grammar accepts.
//!
//! [`Format::StrictJsonSchema`] is a schema under OpenAI's strict semantics
//! (closed objects, bounded numbers; see [`strict`]), applied by rewriting
//! the schema before it compiles. [`Format::TaggedJson`] leaves text free
//! and constrains only what the model opens with a marker (tool calls under
//! `tool_choice: auto`: a lazy grammar).
//!
//! This crate knows tokenizers and logits as plain slices; it does not know
//! models, requests or the server. Main types: [`StructuredVocab`],
//! [`Format`], [`Constraint`], [`StructuredError`].

pub mod strict;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_text::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::Value;

/// A token mask (one bit per vocabulary id).
pub use llguidance::toktrie::SimpleVob as TokenMask;

/// Why a format could not be used or a step could not be constrained.
#[derive(Debug, thiserror::Error)]
pub enum StructuredError {
    /// The schema, regex or grammar does not compile (llguidance's reason).
    #[error("invalid {kind}: {reason}")]
    Invalid { kind: &'static str, reason: String },
    /// The tokenizer cannot be indexed (no end-of-sequence token, ...).
    #[error("structured output is unavailable for this tokenizer: {0}")]
    Vocab(String),
    /// The grammar rejected a token or failed mid-generation.
    #[error("structured output: {0}")]
    Step(String),
}

pub type Result<T, E = StructuredError> = std::result::Result<T, E>;

/// An output format a request asks for.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Format {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against a JSON schema.
    JsonSchema(Value),
    /// JSON valid against a JSON schema read with OpenAI's strict
    /// semantics: objects admit only their declared properties unless the
    /// schema says otherwise, numbers stay within what parsers read
    /// exactly ([`strict`]).
    StrictJsonSchema(Value),
    /// Text matching a regular expression (whole output).
    Regex(String),
    /// Text in the language of a Lark grammar (llguidance's dialect).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Free text in which each [`TaggedJson::begin`] opens a JSON value
    /// constrained as [`TaggedJson::schema`] (strict semantics), closed by
    /// [`TaggedJson::end`].
    TaggedJson(TaggedJson),
}

/// Text left free until the model writes `begin`; from there a JSON value
/// valid against `schema` under strict semantics, then `end`, then free
/// text again. Tool calls under `tool_choice: auto` (llama.cpp's lazy
/// grammars, xgrammar's structural tags): the model may answer in prose or
/// call, and a call it opens holds.
///
/// A marker the vocabulary has as one special token is that token (text
/// cannot spell it); any other is text, and the free text around calls
/// cannot contain it except as the opening of a call.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TaggedJson {
    pub begin: String,
    pub schema: Value,
    /// May be empty: the value ends the output, or the next `begin` follows.
    pub end: String,
    /// Whether more than one tagged value may be written.
    pub many: bool,
}

impl TaggedJson {
    /// The grammar in llguidance's Lark dialect; `special` says whether a
    /// marker is one special token of the vocabulary.
    fn lark(&self, special: impl Fn(&str) -> bool) -> String {
        let marker = |m: &str| {
            if special(m) {
                m.to_string()
            } else {
                serde_json::to_string(m).unwrap_or_default()
            }
        };
        let schema = compact(strict::strict_schema(self.schema.clone()));
        let repeat = if self.many { "*" } else { "?" };
        let end = if self.end.is_empty() {
            String::new()
        } else {
            format!(" _ws? {}", marker(&self.end))
        };
        let mut g = format!(
            "%llguidance {{}}\n\
             start: tagged{repeat} tail\n\
             _ws: /[ \\t\\r\\n]{{1,4}}/\n\
             value: %json {schema}\n"
        );
        if special(&self.begin) {
            // Text cannot spell a special token: free text is any text.
            g += &format!(
                "tagged: FREE? {} _ws? value{end}\n\
                 tail: FREE?\n\
                 FREE: /(?s:.+)/\n",
                self.begin
            );
        } else {
            // Free text up to the first `begin` (kept in the output), and
            // after the last call text that never spells `begin`.
            g += &format!(
                "tagged: before _ws? value{end}\n\
                 before[suffix={begin}]: /(?s:.*)/\n\
                 tail: TAIL?\n\
                 TAIL: /(?s:.+)/ & ~(/(?s:.*)/ {begin} /(?s:.*)/)\n",
                begin = marker(&self.begin)
            );
        }
        g
    }
}

impl Format {
    fn kind(&self) -> &'static str {
        match self {
            Format::JsonObject => "json_object format",
            Format::JsonSchema(_) | Format::StrictJsonSchema(_) => "JSON schema",
            Format::Regex(_) => "regex",
            Format::Lark(_) => "grammar",
            Format::Choice(_) => "choice list",
            Format::TaggedJson(_) => "tool-call schema",
        }
    }

    /// Check the limits a format must keep before it compiles (the
    /// number and size of choices); compile errors come later, from
    /// [`StructuredVocab::constraint`].
    pub fn check(&self) -> Result<()> {
        let invalid = |reason: String| {
            Err(StructuredError::Invalid {
                kind: self.kind(),
                reason,
            })
        };
        match self {
            Format::JsonSchema(s) | Format::StrictJsonSchema(s)
                if !s.is_object() && !s.is_boolean() =>
            {
                invalid("a JSON schema is an object (or true/false)".into())
            }
            Format::Choice(options) if options.is_empty() => {
                invalid("the list of choices is empty".into())
            }
            Format::Choice(options) if options.len() > MAX_CHOICES => invalid(format!(
                "{} choices given, at most {MAX_CHOICES} are allowed",
                options.len()
            )),
            Format::Choice(options) => {
                let bytes: usize = options.iter().map(String::len).sum();
                if bytes > MAX_CHOICE_BYTES {
                    return invalid(format!(
                        "the choices have {bytes} bytes together, at most {MAX_CHOICE_BYTES} are allowed"
                    ));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The grammar llguidance compiles; `special` says whether a string is
    /// one special token of the vocabulary.
    fn grammar(&self, special: impl Fn(&str) -> bool) -> Result<TopLevelGrammar> {
        self.check()?;
        Ok(match self {
            Format::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Format::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Format::StrictJsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(strict::strict_schema(schema.clone())))
            }
            Format::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Format::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Format::Choice(options) => {
                let alts: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Format::TaggedJson(t) => TopLevelGrammar::from_lark(t.lark(special)),
        })
    }
}

/// Choices a [`Format::Choice`] may list, and their bytes together.
pub const MAX_CHOICES: usize = 1000;
pub const MAX_CHOICE_BYTES: usize = 64 * 1024;

/// JSON with single spaces after `:` and `,` and no other whitespace
/// (llguidance's default allows any run of whitespace between tokens, which
/// small models fill forever), unless the schema sets its own options.
fn compact(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// llguidance's reason as a client can read it: its first line, without
/// the backtrace of a panic it caught, bounded in length.
fn readable(reason: &str) -> String {
    const MAX: usize = 300;
    let line = reason.lines().next().unwrap_or("").trim();
    let line = match line.strip_prefix("panic:") {
        Some(p) => format!("the grammar compiler failed on it ({})", p.trim()),
        None => line.to_string(),
    };
    if line.len() <= MAX {
        return line;
    }
    let cut = (0..=MAX)
        .rev()
        .find(|&i| line.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}…", &line[..cut])
}

/// A model's vocabulary indexed for constrained decoding; built once per
/// model and shared by every request.
pub struct StructuredVocab {
    factory: ParserFactory,
    /// Rows of the model's logits (may exceed the tokenizer's vocabulary).
    vocab_size: usize,
    /// The id llguidance knows as end-of-sequence, and every id the model
    /// stops on (all equivalent to it here).
    eos: u32,
    stop_ids: Vec<u32>,
    /// Tokens that spell only blanks (spaces, tabs, newlines).
    blank_ids: Vec<u32>,
    /// Compiled grammars by their serialized form: a format seen before is
    /// cloned, not compiled again (schemas repeat across requests).
    compiled: Mutex<HashMap<String, TokenParser>>,
}

/// Compiled grammars kept (the cache starts over when full).
const COMPILED_CACHE: usize = 256;

impl StructuredVocab {
    /// Index `tokenizer` for a model with `vocab_size` logits and stop ids
    /// `stop_ids` (the first is the canonical end of sequence).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, stop_ids: &[u32]) -> Result<Arc<Self>> {
        let &eos = stop_ids.first().ok_or_else(|| {
            StructuredError::Vocab("the model has no end-of-sequence token".into())
        })?;
        let size = vocab_size.max(tokenizer.vocab_size());
        if eos as usize >= size {
            return Err(StructuredError::Vocab(format!(
                "end-of-sequence id {eos} outside the vocabulary of {size}"
            )));
        }
        let words: Vec<Vec<u8>> = (0..size as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                // Specials (and ids with no token, padding rows of the
                // embedding) carry the marker byte: no grammar spells them.
                Some(b) if !tokenizer.is_special(id) && !b.is_empty() => b,
                Some(b) if !b.is_empty() => {
                    let mut m = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    m.extend(b);
                    m
                }
                _ => format!("\u{ff}<unused {id}>").into_bytes(),
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: size as u32,
            tok_eos: eos,
            tok_bos: tokenizer.bos_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let blank_ids = words
            .iter()
            .enumerate()
            .filter(|(_, w)| !w.is_empty() && w.iter().all(|b| b" \t\r\n".contains(b)))
            .map(|(id, _)| id as u32)
            .collect();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| StructuredError::Vocab(e.to_string()))?;
        factory.quiet();
        Ok(Arc::new(StructuredVocab {
            factory,
            vocab_size,
            eos,
            stop_ids: stop_ids.to_vec(),
            blank_ids,
            compiled: Mutex::new(HashMap::new()),
        }))
    }

    /// Whether `text` is one special token of the vocabulary.
    pub fn is_special_token(&self, text: &str) -> bool {
        let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        bytes.extend_from_slice(text.as_bytes());
        self.factory.tok_env().tok_trie().token_id(&bytes).is_some()
    }

    /// Compile `format` into a fresh constraint (errors name the reason).
    pub fn constraint(self: &Arc<Self>, format: &Format) -> Result<Constraint> {
        let grammar = format.grammar(|s| self.is_special_token(s))?;
        let key = serde_json::to_string(&grammar).ok();
        let cached = key.as_ref().and_then(|k| {
            let cache = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
            cache.get(k).map(TokenParser::deep_clone)
        });
        let parser = match cached {
            Some(p) => p,
            None => {
                let parser =
                    self.factory
                        .create_parser(grammar)
                        .map_err(|e| StructuredError::Invalid {
                            kind: format.kind(),
                            reason: readable(&e.to_string()),
                        })?;
                if let Some(k) = key {
                    let mut cache = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
                    if cache.len() >= COMPILED_CACHE {
                        cache.clear();
                    }
                    cache.insert(k, parser.deep_clone());
                }
                parser
            }
        };
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StructuredError::Invalid {
                kind: format.kind(),
                reason: readable(&e),
            });
        }
        let mut constraint = Constraint {
            vocab: self.clone(),
            matcher,
            finished: false,
        };
        // A format whose language is empty (a `$ref` that only refers to
        // itself) compiles; refuse it now rather than at the first step.
        if constraint.allowed().is_err() {
            return Err(StructuredError::Invalid {
                kind: format.kind(),
                reason: "no output can satisfy it (does a `$ref` only refer to itself?)".into(),
            });
        }
        Ok(constraint)
    }
}

/// One request's grammar state.
pub struct Constraint {
    vocab: Arc<StructuredVocab>,
    matcher: Matcher,
    finished: bool,
}

impl Constraint {
    /// The tokens allowed next (end-of-sequence ids included once the
    /// output is complete).
    pub fn allowed(&mut self) -> Result<SimpleVob> {
        // Once the grammar is complete only end of sequence may follow.
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| StructuredError::Step(e.to_string()))?;
        if mask.num_set() == 0 {
            return Err(StructuredError::Step(
                self.matcher
                    .get_error()
                    .unwrap_or_else(|| "no token can continue the output".into()),
            ));
        }
        Ok(mask)
    }

    /// Set every logit the grammar forbids to `-inf` (logits of the model's
    /// vocabulary size).
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self.allowed()?;
        self.apply(&mask, logits);
        Ok(())
    }

    /// Set every logit `mask` (from [`Constraint::allowed`], computed for
    /// the current state) forbids to `-inf`.
    pub fn apply(&self, mask: &SimpleVob, logits: &mut [f32]) {
        let eos_ok = mask.is_allowed(self.vocab.eos);
        let stops: Vec<(usize, f32)> = self
            .vocab
            .stop_ids
            .iter()
            .filter_map(|&id| logits.get(id as usize).map(|&l| (id as usize, l)))
            .collect();
        // 32 ids per mask word: whole words at a time.
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        // Every stop id stands for end of sequence.
        for (id, l) in stops {
            logits[id] = if eos_ok { l } else { f32::NEG_INFINITY };
        }
    }

    /// `mask` as words for a device (`vocab_size` ids, bit `i % 32` of word
    /// `i / 32`), every stop id allowed exactly when end of sequence is.
    pub fn mask_words(&self, mask: &SimpleVob) -> Vec<u32> {
        let mut words = vec![0u32; self.vocab.vocab_size.div_ceil(32)];
        for (w, &m) in words.iter_mut().zip(mask.as_slice()) {
            *w = m;
        }
        let eos_ok = mask.is_allowed(self.vocab.eos);
        for &id in &self.vocab.stop_ids {
            if let Some(w) = words.get_mut(id as usize / 32) {
                let bit = 1u32 << (id % 32);
                if eos_ok {
                    *w |= bit;
                } else {
                    *w &= !bit;
                }
            }
        }
        words
    }

    /// Advance past the sampled `token` (any stop id ends the output).
    pub fn commit(&mut self, token: u32) -> Result<()> {
        let t = if self.vocab.stop_ids.contains(&token) {
            self.finished = true;
            // A complete grammar has stopped already: nothing to consume.
            if self.matcher.is_stopped() {
                return Ok(());
            }
            self.vocab.eos
        } else {
            token
        };
        self.matcher
            .consume_token(t)
            .map_err(|e| StructuredError::Step(e.to_string()))
    }

    /// How many of `tokens`, in order from the current state, the grammar
    /// accepts (nothing is consumed): guessed tokens are cut there before
    /// a model verifies them. A stop id counts as end of sequence.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if self.is_finished() {
            return 0;
        }
        let mapped: Vec<u32> = tokens
            .iter()
            .map(|t| {
                if self.vocab.stop_ids.contains(t) {
                    self.vocab.eos
                } else {
                    *t
                }
            })
            .collect();
        self.matcher.validate_tokens(&mapped).unwrap_or(0)
    }

    /// Whether the grammar has reached its end (nothing but end of sequence
    /// may follow) or a stop token was committed.
    pub fn is_finished(&self) -> bool {
        self.finished || self.matcher.is_stopped()
    }

    /// The one token the grammar allows next, if it allows exactly one
    /// (every stop id counts as end of sequence, returned as the canonical
    /// one); with its mask, for reuse when there is no such token.
    pub fn forced(&mut self) -> Result<(Option<u32>, SimpleVob)> {
        let mask = self.allowed()?;
        let forced = (mask.num_set() == 1)
            .then(|| mask.first_bit_set())
            .flatten()
            .map(|t| t as u32);
        Ok((forced, mask))
    }

    /// Tokens that spell only blanks.
    pub fn blank_ids(&self) -> &[u32] {
        &self.vocab.blank_ids
    }

    /// Rows of the logits this constraint masks.
    pub fn vocab_size(&self) -> usize {
        self.vocab.vocab_size
    }
}
