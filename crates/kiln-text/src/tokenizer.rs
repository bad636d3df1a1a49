//! [`Tokenizer`]: a `tokenizers` tokenizer plus the special tokens, stop tokens and chat
//! templates that come with a model.
//!
//! Behaviour follows Hugging Face transformers' `TokenizersBackend`: special-token
//! strings in the text are matched as special tokens, `add_special_tokens` runs the
//! post-processor (which is where a BOS is added), and decoding never applies
//! `clean_up_tokenization_spaces` (transformers 5 skips it for BPE models too).
//! Loading from a Hugging Face directory and saving to one live in `hf_dir.rs`;
//! building from GGUF metadata lives in `gguf_tokenizer.rs`.

use std::collections::HashSet;
use std::path::Path;

use kiln_formats::GgufMetadata;
use serde_json::json;
use tokenizers::PostProcessorWrapper;

use crate::error::{Result, TextError};

/// Token strings that end a turn, in the order they are preferred as [`Tokenizer::eot_id`].
const EOT_TOKENS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|end|>",
    "<|end_of_turn|>",
    "<EOT>",
];

/// Special token strings that end generation wherever the vocabulary has them as
/// special tokens (the end-of-generation list llama.cpp uses).
const STOP_TOKENS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|end|>",
    "<|end_of_turn|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
];

/// The chat templates that ship with a tokenizer: an optional default and any number of
/// named ones (Hugging Face's list form, GGUF's `tokenizer.chat_template.<name>`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatTemplates {
    /// The template used when no name is given.
    pub default: Option<String>,
    /// Named templates such as `tool_use`, in file order, without the default.
    pub named: Vec<(String, String)>,
}

impl ChatTemplates {
    /// The template with this name; `default` names the default template.
    pub fn get(&self, name: &str) -> Option<&str> {
        if name == "default" {
            if let Some(t) = &self.default {
                return Some(t);
            }
        }
        self.named
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// Adds or replaces a template; the name `default` sets the default one.
    pub fn insert(&mut self, name: &str, template: String) {
        if name == "default" {
            self.default = Some(template);
        } else if let Some(slot) = self.named.iter_mut().find(|(n, _)| n == name) {
            slot.1 = template;
        } else {
            self.named.push((name.to_string(), template));
        }
    }
}

/// The special-token strings a configuration names, before they are resolved to ids.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokenStrings {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub pad: Option<String>,
    pub unk: Option<String>,
}

/// Everything a loader gathers before [`Tokenizer::from_parts`] resolves ids.
pub(crate) struct TokenizerParts {
    pub inner: tokenizers::Tokenizer,
    pub special: SpecialTokenStrings,
    pub chat_templates: ChatTemplates,
    /// Stop ids from outside the tokenizer files (`generation_config.json`).
    pub extra_stop_ids: Vec<u32>,
}

/// A text tokenizer with the model's special tokens, stop tokens and chat templates.
///
/// Ids are `u32`, as in the `tokenizers` library. All methods take `&self`; a
/// `Tokenizer` can be shared between threads.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokenStrings,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eot_id: Option<u32>,
    pad_id: Option<u32>,
    unk_id: Option<u32>,
    stop_ids: Vec<u32>,
    add_bos: bool,
    special_ids: HashSet<u32>,
    vocab_size: usize,
    chat_templates: ChatTemplates,
}

impl Tokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (plus `chat_template.jinja`,
    /// `additional_chat_templates/` and `generation_config.json` where present) from a
    /// Hugging Face model directory.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        crate::hf_dir::load(dir.as_ref())
    }

    /// Builds the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata,
    /// the way transformers 5 does when it loads that file.
    ///
    /// Supported `tokenizer.ggml.model` kinds: `gpt2` (byte-level BPE with the file's
    /// merges; the split regex follows `tokenizer.ggml.pre`: `qwen2`, `llama-bpe`,
    /// `llama3`, `tekken`, `gpt-4o` and the other names of transformers' table; `smollm`
    /// splits every digit alone first, as llama.cpp and SmolLM2's `tokenizer.json` do;
    /// `default`, a missing key and any unknown name fall back to GPT-2's regex, as in
    /// transformers) and `llama` (SentencePiece vocabulary as byte-fallback BPE; Gemma
    /// architectures rebuild the merges from vocabulary order, others from the scores).
    /// CONTROL tokens become special tokens and USER_DEFINED tokens plain added tokens.
    /// `tokenizer.ggml.add_bos_token` decides the BOS (default: true for `llama`, false
    /// for `gpt2`). Chat templates come from `tokenizer.chat_template` and
    /// `tokenizer.chat_template.<name>`.
    pub fn from_gguf(metadata: &GgufMetadata) -> Result<Self> {
        crate::gguf_tokenizer::build(metadata)
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir` (created if
    /// missing), so that [`Tokenizer::from_hf_dir`] and transformers load the same
    /// tokenizer back.
    pub fn save_hf(&self, dir: impl AsRef<Path>) -> Result<()> {
        crate::hf_dir::save(self, dir.as_ref())
    }

    pub(crate) fn from_parts(parts: TokenizerParts) -> Self {
        let TokenizerParts {
            inner,
            special,
            chat_templates,
            extra_stop_ids,
        } = parts;
        let lookup = |s: &Option<String>| s.as_deref().and_then(|t| inner.token_to_id(t));
        let (bos_id, eos_id) = (lookup(&special.bos), lookup(&special.eos));
        let (pad_id, unk_id) = (lookup(&special.pad), lookup(&special.unk));

        let special_ids: HashSet<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let special_id = |content: &str| {
            inner
                .token_to_id(content)
                .filter(|id| special_ids.contains(id))
        };
        let eot_id = EOT_TOKENS.iter().find_map(|t| special_id(t));
        let mut stop_ids = Vec::new();
        let candidates = eos_id.into_iter().chain(eot_id);
        let candidates = candidates.chain(STOP_TOKENS.iter().filter_map(|t| special_id(t)));
        for id in candidates.chain(extra_stop_ids) {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }

        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        // The post-processor decides; probe it with a one-letter text (not the empty
        // text, where an appended EOS equal to the BOS would look like a BOS).
        let first_id = |with_special| {
            let enc = inner.encode_fast("a", with_special).ok()?;
            enc.get_ids().first().copied()
        };
        let add_bos = bos_id.is_some() && first_id(true) == bos_id && first_id(false) != bos_id;
        Tokenizer {
            inner,
            special,
            bos_id,
            eos_id,
            eot_id,
            pad_id,
            unk_id,
            stop_ids,
            add_bos,
            special_ids,
            vocab_size,
            chat_templates,
        }
    }

    /// Encodes text. Special-token strings in `text` become their special tokens.
    /// With `add_special_tokens`, the post-processor runs (it adds the BOS where
    /// [`Tokenizer::add_bos`] is true).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Encode {
                message: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids to text; with `skip_special`, special tokens are left out. Ids outside
    /// the vocabulary are skipped, as in transformers.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::Decode {
                message: e.to_string(),
            })
    }

    /// The vocabulary entry of an id (in the model's spelling, e.g. `Ġworld` or `▁world`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry or added token, spelled as the vocabulary spells it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// One past the largest id, counting added tokens: the number of rows an embedding
    /// for this tokenizer needs at least.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The raw bytes a token stands for: GPT-2 byte-level pieces (`Ġworld`)
    /// through the byte table, SentencePiece pieces (`▁world`, `<0x0A>`)
    /// through their spelling, special tokens as their text. `None` for an
    /// id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        if self.is_special(id) {
            return Some(piece.into_bytes());
        }
        if let Some(b) = byte_fallback_piece(&piece) {
            return Some(vec![b]);
        }
        // Byte-level BPE vocabularies spell the space byte as `Ġ`.
        if self.inner.token_to_id("\u{120}").is_some() {
            if let Some(bytes) = piece
                .chars()
                .map(gpt2_byte_of_char)
                .collect::<Option<Vec<u8>>>()
            {
                return Some(bytes);
            }
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }

    /// Whether an id is a special token (the ones `decode(.., true)` leaves out).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// The beginning-of-sequence id, if the configuration names one in the vocabulary.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The end-of-sequence id, if the configuration names one in the vocabulary.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The end-of-turn id (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, `<|end|>`, ...)
    /// when the vocabulary has one as a special token.
    pub fn eot_id(&self) -> Option<u32> {
        self.eot_id
    }

    /// The padding id, if the configuration names one in the vocabulary.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The unknown-token id, if the configuration names one in the vocabulary.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    /// Every id that ends generation: the EOS, the end-of-turn tokens the vocabulary has
    /// as special tokens, and the `eos_token_id`s of `generation_config.json`. No
    /// duplicates; the EOS comes first.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Whether `encode(text, true)` starts with the BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The BOS string, as chat templates receive it in `bos_token`.
    pub fn bos_token(&self) -> Option<&str> {
        self.special.bos.as_deref()
    }

    /// The EOS string, as chat templates receive it in `eos_token`.
    pub fn eos_token(&self) -> Option<&str> {
        self.special.eos.as_deref()
    }

    /// The padding string.
    pub fn pad_token(&self) -> Option<&str> {
        self.special.pad.as_deref()
    }

    /// The unknown-token string.
    pub fn unk_token(&self) -> Option<&str> {
        self.special.unk.as_deref()
    }

    /// The default chat template, if the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_templates.default.as_deref()
    }

    /// Replaces the default chat template (`--chat-template`).
    pub fn set_chat_template(&mut self, source: String) {
        self.chat_templates.insert("default", source);
    }

    /// All chat templates, including named ones such as `tool_use`.
    pub fn chat_templates(&self) -> &ChatTemplates {
        &self.chat_templates
    }

    /// A [`crate::ChatContext`] for `messages` with `bos_token` and `eos_token` filled in,
    /// as transformers passes them to every template.
    pub fn chat_context(&self, messages: serde_json::Value) -> crate::ChatContext {
        let mut ctx = crate::ChatContext::new(messages);
        ctx.bos_token = self.special.bos.clone();
        ctx.eos_token = self.special.eos.clone();
        ctx
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub(crate) fn special_strings(&self) -> &SpecialTokenStrings {
        &self.special
    }
}

/// The token and its id, when `flag` is set and the tokenizer knows the token.
pub(crate) fn flagged_token<'a>(
    inner: &tokenizers::Tokenizer,
    flag: bool,
    token: Option<&'a str>,
) -> Option<(&'a str, u32)> {
    let token = token.filter(|_| flag)?;
    Some((token, inner.token_to_id(token)?))
}

/// The post-processor transformers' `update_post_processor` builds: the BOS before and
/// the EOS after each sequence, each only where asked for.
pub(crate) fn bos_eos_post_processor(
    bos: Option<(&str, u32)>,
    eos: Option<(&str, u32)>,
) -> std::result::Result<PostProcessorWrapper, serde_json::Error> {
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let sequence = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut tokens = serde_json::Map::new();
    for (seq, type_id) in [("A", 0), ("B", 1)] {
        let out = if seq == "A" { &mut single } else { &mut pair };
        if let Some((t, _)) = bos {
            out.push(special(t, type_id));
        }
        out.push(sequence(seq, type_id));
        if let Some((t, _)) = eos {
            out.push(special(t, type_id));
        }
    }
    let pair = [single.clone(), pair].concat();
    for (t, id) in bos.into_iter().chain(eos) {
        tokens.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    serde_json::from_value(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": tokens,
    }))
}

/// `<0xAB>`: a SentencePiece byte-fallback piece.
fn byte_fallback_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The byte a GPT-2 byte-level character stands for: printable Latin-1
/// bytes stand for themselves, the other 68 bytes are `U+0100 + n` in order.
pub fn gpt2_byte_of_char(c: char) -> Option<u8> {
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
