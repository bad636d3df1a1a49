//! Building a [`Tokenizer`] from a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! A GGUF carries no `tokenizer.json`, only llama.cpp's description of the vocabulary.
//! The goal is the tokenizer transformers 5 builds from the same file
//! (`integrations/gguf/gguf_tokenizer_mapping.py`), because that is what the goldens and
//! most users compare against:
//!
//! * `gpt2` (byte-level BPE): the vocabulary (tokens outside the byte alphabet are
//!   re-spelled in it) and the file's merges; the split regex is chosen by
//!   `tokenizer.ggml.pre` from transformers' table (`qwen2`, `llama-bpe`/`llama3`,
//!   `tekken`, `gpt-4o`, ...). A `pre` not in the table, and `default`, get GPT-2's own
//!   byte-level regex, as in transformers. `smollm` gets llama.cpp's split (each digit
//!   alone, then the GPT-2 regex), which is what SmolLM2's original `tokenizer.json`
//!   has; for its vocabulary (no multi-digit merges) it gives the same ids as
//!   transformers' plain GPT-2 split.
//! * `llama` (SentencePiece vocabulary with scores): a byte-fallback BPE. For Gemma
//!   (`gemma`, `gemma2`, `gemma3`) whitespace-only tokens stored with real spaces are
//!   re-spelled with `▁`, and the merges, which the file does not have, are rebuilt from
//!   the order of the vocabulary (transformers' `generate_merges`); spaces become `▁` in
//!   a normalizer and no prefix space is added. Other architectures follow
//!   transformers' `LlamaTokenizer` (merges from the scores, `Metaspace` with prefix
//!   space on the first word); `phi3` adds its prefix space in the normalizer.
//!
//! Token types: CONTROL (3) become special added tokens (in a byte-level vocabulary only
//! when spelled in the byte alphabet), USER_DEFINED (4) become non-special added tokens
//! when the vocabulary has them, and the BOS/EOS/UNK/PAD strings are added as special
//! tokens if they are not already.

use std::collections::HashMap;
use std::path::Path;

use kiln_formats::GgufMetadata;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use crate::error::{Result, TextError};
use crate::merges::{byte_alphabet, generate_merges, respell_byte_level};
use crate::tokenizer::{
    bos_eos_post_processor, flagged_token, ChatTemplates, SpecialTokenStrings, Tokenizer,
    TokenizerParts,
};

/// GGUF token type of llama.cpp's control tokens (`<|im_end|>`, `<bos>`).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF token type of user-defined tokens (`<tool_call>`, Gemma's `\n\n`).
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex (transformers' `_LLAMA3_SPLIT`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (transformers' `qwen2.tokenization_qwen2.PRETOKENIZE_REGEX`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's split regex.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken split regex.
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's split regex (also Llama 4).
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// transformers' `GGUF_PRE_TOKENIZER_SPLITS`: `tokenizer.ggml.pre` to split regex.
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// The raw tokenizer metadata of one GGUF file.
struct GgufVocab<'a> {
    path: &'a Path,
    tokens: Vec<&'a str>,
    token_types: Vec<i64>,
}

impl GgufVocab<'_> {
    fn err(&self, key: &str, what: impl Into<String>) -> TextError {
        TextError::GgufTokenizer {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            what: what.into(),
        }
    }

    /// The token string at `tokenizer.ggml.<key>`'s id, if the key is present.
    fn special(&self, meta: &GgufMetadata, key: &str) -> Result<Option<String>> {
        let full = format!("tokenizer.ggml.{key}");
        let Some(id) = meta.u64(&full)? else {
            return Ok(None);
        };
        let token = usize::try_from(id).ok().and_then(|i| self.tokens.get(i));
        match token {
            Some(t) => Ok(Some(t.to_string())),
            None => Err(self.err(&full, format!("id {id} is outside the vocabulary"))),
        }
    }

    fn tokens_of_type(&self, token_type: i64) -> impl Iterator<Item = &str> + '_ {
        self.tokens
            .iter()
            .zip(&self.token_types)
            .filter(move |(_, &t)| t == token_type)
            .map(|(s, _)| *s)
    }
}

/// Builds the tokenizer described by `metadata` (see the module documentation).
pub(crate) fn build(meta: &GgufMetadata) -> Result<Tokenizer> {
    let path = meta.path.as_path();
    let missing = |key: &str| TextError::GgufTokenizer {
        path: path.to_path_buf(),
        key: key.to_string(),
        what: "missing".to_string(),
    };
    let model = meta
        .str("tokenizer.ggml.model")?
        .ok_or_else(|| missing("tokenizer.ggml.model"))?;
    let tokens = meta
        .str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| missing("tokenizer.ggml.tokens"))?;
    let token_types = meta
        .i64_array("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    let vocab = GgufVocab {
        path,
        tokens,
        token_types,
    };
    if !vocab.token_types.is_empty() && vocab.token_types.len() != vocab.tokens.len() {
        return Err(vocab.err(
            "tokenizer.ggml.token_type",
            format!(
                "{} entries for {} tokens",
                vocab.token_types.len(),
                vocab.tokens.len()
            ),
        ));
    }
    let arch = meta.str("general.architecture")?.unwrap_or("");
    let (mut inner, byte_level, default_add_bos) = match model {
        "gpt2" => (byte_level_bpe(meta, &vocab)?, true, false),
        "llama" => (sentencepiece_bpe(meta, &vocab, arch)?, false, true),
        other => {
            return Err(vocab.err(
                "tokenizer.ggml.model",
                format!("unsupported tokenizer model {other:?} (supported: gpt2, llama)"),
            ))
        }
    };

    let special = SpecialTokenStrings {
        bos: vocab.special(meta, "bos_token_id")?,
        eos: vocab.special(meta, "eos_token_id")?,
        pad: vocab.special(meta, "padding_token_id")?,
        unk: vocab.special(meta, "unknown_token_id")?,
    };
    add_gguf_tokens(&mut inner, &vocab, byte_level, &special)
        .map_err(|e| TextError::build(path, e))?;

    let add_bos = meta
        .bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(default_add_bos);
    let add_eos = meta.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let bos = flagged_token(&inner, add_bos, special.bos.as_deref());
    let eos = flagged_token(&inner, add_eos, special.eos.as_deref());
    let post = bos_eos_post_processor(bos, eos).map_err(|e| TextError::build(path, e))?;
    inner.with_post_processor(Some(post));

    Ok(Tokenizer::from_parts(TokenizerParts {
        inner,
        special,
        chat_templates: chat_templates(meta)?,
        extra_stop_ids: Vec::new(),
    }))
}

/// The default template (`tokenizer.chat_template`) and the named ones
/// (`tokenizer.chat_templates` lists names, `tokenizer.chat_template.<name>` holds each).
fn chat_templates(meta: &GgufMetadata) -> Result<ChatTemplates> {
    let mut templates = ChatTemplates {
        default: meta.str("tokenizer.chat_template")?.map(str::to_string),
        named: Vec::new(),
    };
    for name in meta
        .str_array("tokenizer.chat_templates")?
        .unwrap_or_default()
    {
        if let Some(t) = meta.str(&format!("tokenizer.chat_template.{name}"))? {
            templates.insert(name, t.to_string());
        }
    }
    Ok(templates)
}

/// transformers' `byte_level_tokenizer` plus `set_split_regex`.
fn byte_level_bpe(meta: &GgufMetadata, vocab: &GgufVocab) -> Result<tokenizers::Tokenizer> {
    let alphabet = byte_alphabet();
    let bpe_vocab: Vocab = vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (respell_byte_level(t, &alphabet), i as u32))
        .collect();
    let merges_key = "tokenizer.ggml.merges";
    let merges = meta
        .str_array(merges_key)?
        .ok_or_else(|| vocab.err(merges_key, "missing (a byte-level vocabulary needs merges)"))?;
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| vocab.err(merges_key, format!("merge {m:?} has no space")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .build()
        .map_err(|e| TextError::build(vocab.path, e))?;

    let pre = meta.str("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre_tokenizer =
        byte_level_pre_tokenizer(pre).map_err(|e| TextError::build(vocab.path, e))?;

    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::new(true, true, true)));
    Ok(tokenizer)
}

/// The split a byte-level vocabulary with `tokenizer.ggml.pre` = `pre` gets.
pub(crate) fn byte_level_pre_tokenizer(pre: &str) -> tokenizers::Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    Ok(if pre == "smollm" {
        PreSequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into()
    } else if let Some(regex) = split_regex(pre) {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )?;
        PreSequence::new(vec![split.into(), byte_level(false).into()]).into()
    } else {
        byte_level(true).into()
    })
}

/// transformers' `sentencepiece_tokenizer` with `GemmaTokenizer`, `LlamaTokenizer` or
/// the Phi-3 variant, chosen by architecture.
fn sentencepiece_bpe(
    meta: &GgufMetadata,
    vocab: &GgufVocab,
    arch: &str,
) -> Result<tokenizers::Tokenizer> {
    let gemma = matches!(arch, "gemma" | "gemma2" | "gemma3");
    let tokens: Vec<String> = if gemma {
        vocab
            .tokens
            .iter()
            .map(|t| respell_gemma_spaces(t))
            .collect()
    } else {
        vocab.tokens.iter().map(|t| t.to_string()).collect()
    };
    let merges = if gemma {
        // Gemma's scores do not follow its merge order; the vocabulary order does.
        let scores: Vec<f64> = (0..tokens.len()).map(|i| -(i as f64)).collect();
        generate_merges(&tokens, &scores)
    } else if let Some(merges) = meta.str_array("tokenizer.ggml.merges")? {
        merges
            .iter()
            .filter_map(|m| m.split_once(' '))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    } else {
        let key = "tokenizer.ggml.scores";
        let scores = meta
            .f64_array(key)?
            .ok_or_else(|| vocab.err(key, "missing (needed to rebuild the merges)"))?;
        if scores.len() != tokens.len() {
            let what = format!("{} scores for {} tokens", scores.len(), tokens.len());
            return Err(vocab.err(key, what));
        }
        generate_merges(&tokens, &scores)
    };
    let bpe_vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let has_unk = bpe_vocab.contains_key("<unk>");
    let mut builder = BPE::builder()
        .vocab_and_merges(bpe_vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if gemma && has_unk {
        builder = builder.unk_token("<unk>".to_string());
    }
    let bpe = builder
        .build()
        .map_err(|e| TextError::build(vocab.path, e))?;

    let build_err = |e| TextError::build(vocab.path, e);
    let replace = |from: &str, to: &str| Replace::new(from, to).map_err(build_err);
    let mut decoders: Vec<DecoderWrapper> = vec![
        replace("\u{2581}", " ")?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    if gemma {
        tokenizer
            .with_normalizer(Some(replace(" ", "\u{2581}")?))
            .map_err(build_err)?;
        let split = Split::new(
            SplitPattern::String(" ".to_string()),
            SplitDelimiterBehavior::MergedWithPrevious,
            false,
        )
        .map_err(build_err)?;
        tokenizer.with_pre_tokenizer(Some(split));
    } else {
        decoders.push(Strip::new(' ', 1, 0).into());
        if arch == "phi3" {
            let normalizer: NormalizerWrapper = tokenizers::normalizers::Sequence::new(vec![
                Prepend::new("\u{2581}".to_string()).into(),
                replace(" ", "\u{2581}")?.into(),
            ])
            .into();
            tokenizer
                .with_normalizer(Some(normalizer))
                .map_err(build_err)?;
        } else {
            let metaspace = Metaspace::new('\u{2581}', PrependScheme::First, false);
            tokenizer.with_pre_tokenizer(Some(metaspace));
        }
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// Gemma files store whitespace-only tokens containing a space with real spaces; the
/// vocabulary looks them up as `▁` runs of the same length.
fn respell_gemma_spaces(token: &str) -> String {
    let py_isspace = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    if token.contains(' ') && token.chars().all(py_isspace) {
        "\u{2581}".repeat(token.chars().count())
    } else {
        token.to_string()
    }
}

/// Adds the GGUF's control and user-defined tokens, then any special-token string not
/// yet added (see the module documentation).
fn add_gguf_tokens(
    tokenizer: &mut tokenizers::Tokenizer,
    vocab: &GgufVocab,
    byte_level: bool,
    special: &SpecialTokenStrings,
) -> tokenizers::Result<()> {
    let alphabet = byte_alphabet();
    let control: Vec<AddedToken> = vocab
        .tokens_of_type(TOKEN_TYPE_CONTROL)
        .filter(|t| !byte_level || t.chars().all(|c| alphabet.contains(&c)))
        .map(|t| AddedToken::from(t, true).normalized(false))
        .collect();
    tokenizer.add_special_tokens(control)?;

    let known: HashMap<String, u32> = tokenizer.get_vocab(true);
    let user_defined: Vec<AddedToken> = vocab
        .tokens_of_type(TOKEN_TYPE_USER_DEFINED)
        .filter(|t| known.contains_key(*t))
        .map(|t| AddedToken::from(t, false).normalized(false))
        .collect();
    tokenizer.add_tokens(user_defined)?;

    let added: Vec<String> = tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    let named = [&special.bos, &special.eos, &special.unk, &special.pad];
    let mut missing: Vec<AddedToken> = Vec::new();
    for t in named.into_iter().flatten() {
        if !added.contains(t) && !missing.iter().any(|m| &m.content == t) {
            missing.push(AddedToken::from(t.as_str(), true).normalized(false));
        }
    }
    tokenizer.add_tokens(missing)?;
    Ok(())
}
