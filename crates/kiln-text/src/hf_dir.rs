//! Loading a [`Tokenizer`] from a Hugging Face model directory and saving one to it.
//!
//! Read: `tokenizer.json` (required), `tokenizer_config.json` (special-token strings as
//! strings or `AddedToken` dicts, falling back to `special_tokens_map.json`, `add_bos_token`/`add_eos_token`, `chat_template` as a
//! string or a list of named templates), `chat_template.jinja` (which wins over the
//! config's default template, as in transformers), `additional_chat_templates/*.jinja`,
//! and `eos_token_id` of `generation_config.json` (extra stop ids).
//!
//! As in transformers, an explicit `add_bos_token`/`add_eos_token` replaces the
//! post-processor of `tokenizer.json` with one that adds exactly those tokens; without
//! them the post-processor of `tokenizer.json` decides. Not read: `added_tokens_decoder`
//! and `additional_special_tokens` of the config (`tokenizer.json` already lists the
//! added tokens in every file transformers writes).
//!
//! Written: `tokenizer.json` (with the post-processor, so no `add_bos_token` is needed)
//! and `tokenizer_config.json` with the special-token strings and the chat templates.

use std::fs;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{Result, TextError};
use crate::tokenizer::{
    bos_eos_post_processor, flagged_token, ChatTemplates, SpecialTokenStrings, Tokenizer,
    TokenizerParts,
};

/// Reads and parses a JSON file; `Ok(None)` when the file does not exist.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TextError::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TextError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// Reads a text file; `Ok(None)` when it does not exist.
fn read_text(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TextError::io(path, e)),
    }
}

/// One configuration file with error helpers that name it.
struct Config<'a> {
    path: &'a Path,
    json: Map<String, Value>,
}

impl<'a> Config<'a> {
    /// Reads a JSON object file; a missing file reads as an empty object.
    fn read(path: &'a Path) -> Result<Self> {
        let json = match read_json(path)? {
            None => Map::new(),
            Some(Value::Object(map)) => map,
            Some(_) => {
                return Err(TextError::Config {
                    path: path.to_path_buf(),
                    key: String::new(),
                    what: "expected a JSON object".to_string(),
                })
            }
        };
        Ok(Config { path, json })
    }

    fn err(&self, key: &str, what: impl Into<String>) -> TextError {
        TextError::Config {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            what: what.into(),
        }
    }

    /// A special token given as a string or as an `AddedToken` dict with `content`.
    fn token(&self, key: &str) -> Result<Option<String>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(self.err(key, "an AddedToken dict without a string `content`")),
            },
            Some(other) => Err(self.err(key, format!("expected a string or dict, got {other}"))),
        }
    }

    /// A flag: `Some(value)` when the key is present (`null` counts as false, as in
    /// transformers, where any presence makes the flag explicit).
    fn flag(&self, key: &str) -> Result<Option<bool>> {
        match self.json.get(key) {
            None => Ok(None),
            Some(Value::Null) => Ok(Some(false)),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.err(key, format!("expected a bool, got {other}"))),
        }
    }

    /// `chat_template` as one string or as a list of `{"name", "template"}` dicts.
    fn chat_templates(&self) -> Result<ChatTemplates> {
        let key = "chat_template";
        let mut templates = ChatTemplates::default();
        match self.json.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => templates.default = Some(s.clone()),
            Some(Value::Array(list)) => {
                for entry in list {
                    let name = entry.get("name").and_then(Value::as_str);
                    let template = entry.get("template").and_then(Value::as_str);
                    let (Some(name), Some(template)) = (name, template) else {
                        let what = "list entries need string `name` and `template`";
                        return Err(self.err(key, what));
                    };
                    templates.insert(name, template.to_string());
                }
            }
            Some(other) => {
                let what = format!("expected a string or a list, got {other}");
                return Err(self.err(key, what));
            }
        }
        Ok(templates)
    }
}

/// Loads a tokenizer from a Hugging Face model directory (see the module documentation).
pub(crate) fn load(dir: &Path) -> Result<Tokenizer> {
    let tokenizer_path = dir.join("tokenizer.json");
    let bytes = fs::read(&tokenizer_path).map_err(|e| TextError::io(&tokenizer_path, e))?;
    let mut inner = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| TextError::build(&tokenizer_path, e))?;
    // Padding and truncation saved in the file (all-MiniLM-L6-v2 pads every
    // text to 128 ids) are per-call options in transformers, off unless a
    // call asks; Kiln encodes one text at a time and truncates itself.
    inner.with_padding(None);
    inner
        .with_truncation(None)
        .map_err(|e| TextError::build(&tokenizer_path, e))?;

    let config_path = dir.join("tokenizer_config.json");
    let config = Config::read(&config_path)?;
    let map_path = dir.join("special_tokens_map.json");
    let special_map = Config::read(&map_path)?;
    // tokenizer_config.json wins; older repositories keep the strings in
    // special_tokens_map.json only.
    let token = |key: &str| -> Result<Option<String>> {
        match config.token(key)? {
            Some(t) => Ok(Some(t)),
            None if !config.json.contains_key(key) => special_map.token(key),
            None => Ok(None),
        }
    };
    let special = SpecialTokenStrings {
        bos: token("bos_token")?,
        eos: token("eos_token")?,
        pad: token("pad_token")?,
        unk: token("unk_token")?,
    };

    let add_bos = config.flag("add_bos_token")?;
    let add_eos = config.flag("add_eos_token")?;
    if add_bos.is_some() || add_eos.is_some() || inner.get_post_processor().is_none() {
        let bos = flagged_token(&inner, add_bos == Some(true), special.bos.as_deref());
        let eos = flagged_token(&inner, add_eos == Some(true), special.eos.as_deref());
        let post =
            bos_eos_post_processor(bos, eos).map_err(|e| TextError::build(&tokenizer_path, e))?;
        inner.with_post_processor(Some(post));
    }

    let mut chat_templates = config.chat_templates()?;
    if let Some(t) = read_text(&dir.join("chat_template.jinja"))? {
        chat_templates.default = Some(t);
    }
    let extra_dir = dir.join("additional_chat_templates");
    if extra_dir.is_dir() {
        let entries = fs::read_dir(&extra_dir).map_err(|e| TextError::io(&extra_dir, e))?;
        let mut named = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| TextError::io(&extra_dir, e))?.path();
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .map(str::to_string);
            if let (Some(name), Some("jinja")) = (name, path.extension().and_then(|e| e.to_str())) {
                let text = fs::read_to_string(&path).map_err(|e| TextError::io(&path, e))?;
                named.push((name, text));
            }
        }
        named.sort();
        for (name, text) in named {
            chat_templates.insert(&name, text);
        }
    }

    Ok(Tokenizer::from_parts(TokenizerParts {
        inner,
        special,
        chat_templates,
        extra_stop_ids: generation_eos_ids(&dir.join("generation_config.json"))?,
    }))
}

/// `eos_token_id` of `generation_config.json`: one id or a list of ids.
fn generation_eos_ids(path: &Path) -> Result<Vec<u32>> {
    let Some(json) = read_json(path)? else {
        return Ok(Vec::new());
    };
    let key = "eos_token_id";
    let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let err = || TextError::Config {
        path: path.to_path_buf(),
        key: key.to_string(),
        what: "expected a token id or a list of token ids".to_string(),
    };
    match json.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(|v| as_id(v).ok_or_else(err)).collect(),
        Some(v) => as_id(v).map(|id| vec![id]).ok_or_else(err),
    }
}

/// Writes `tokenizer.json` and `tokenizer_config.json` (see the module documentation).
pub(crate) fn save(tokenizer: &Tokenizer, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| TextError::io(dir, e))?;
    let tokenizer_path = dir.join("tokenizer.json");
    let text = tokenizer
        .inner()
        .to_string(true)
        .map_err(|e| TextError::build(&tokenizer_path, e))?;
    fs::write(&tokenizer_path, text).map_err(|e| TextError::io(&tokenizer_path, e))?;

    let special = tokenizer.special_strings();
    let mut config = Map::new();
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    for (key, value) in [
        ("bos_token", &special.bos),
        ("eos_token", &special.eos),
        ("unk_token", &special.unk),
        ("pad_token", &special.pad),
    ] {
        config.insert(key.into(), json!(value));
    }
    let templates = tokenizer.chat_templates();
    if templates.named.is_empty() {
        if let Some(t) = &templates.default {
            config.insert("chat_template".into(), json!(t));
        }
    } else {
        let default = templates.default.iter().map(|t| ("default", t.as_str()));
        let named = templates
            .named
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()));
        let list: Vec<Value> = default
            .chain(named)
            .map(|(name, template)| json!({"name": name, "template": template}))
            .collect();
        config.insert("chat_template".into(), Value::Array(list));
    }
    let config_path = dir.join("tokenizer_config.json");
    let text =
        serde_json::to_string_pretty(&Value::Object(config)).map_err(|source| TextError::Json {
            path: config_path.clone(),
            source,
        })?;
    fs::write(&config_path, text).map_err(|e| TextError::io(&config_path, e))
}
