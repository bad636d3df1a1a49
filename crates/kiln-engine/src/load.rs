//! Loading a model from a GGUF file or a Hugging Face safetensors directory.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use kiln_formats::{GgufWeights, Quantizing, SafetensorsDir};
use kiln_models::{load_model_with_progress, CausalLm, LoadProgress, ModelConfig};
use kiln_quant::QuantFormat;
use kiln_sampling::TokenId;
use kiln_structured::{Constraint, Format, StructuredError, StructuredVocab};
use kiln_tensor::Backend;
use kiln_text::{ChatTemplate, Tokenizer};

use crate::error::{EngineError, Result};

/// A model ready to generate: weights on a backend, tokenizer, chat template
/// and the token ids that end a turn.
pub struct LoadedModel {
    pub path: PathBuf,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Tokens that end generation: config and generation_config `eos_token_id`,
    /// the tokenizer's eos and end-of-turn tokens.
    pub eos_token_ids: Vec<TokenId>,
    /// Wall time of [`LoadedModel::load`].
    pub load_seconds: f64,
    /// The format float matrices were quantized to as they loaded
    /// (`--quantize`), if any.
    pub quantized: Option<QuantFormat>,
    /// The sampling defaults the model declares (`generation_config.json`,
    /// or `general.sampling.*` in a GGUF file).
    pub sampling_defaults: kiln_sampling::PartialSampling,
    /// The vocabulary indexed for constrained decoding, built on first use.
    structured: OnceLock<std::result::Result<Arc<StructuredVocab>, String>>,
}

/// An opened model's weights, not read yet.
enum Opened {
    Gguf(GgufWeights),
    Dir(SafetensorsDir),
}

/// What a model is besides its weights.
struct Parts {
    config: ModelConfig,
    tokenizer: Tokenizer,
    /// `eos_token_id` of the config (and generation config).
    eos: Vec<u32>,
    sampling_defaults: kiln_sampling::PartialSampling,
}

impl LoadedModel {
    /// Load `path`: a `.gguf` file, or a directory with `config.json`,
    /// safetensors weights and `tokenizer.json`.
    pub fn load(path: &Path, backend: Arc<dyn Backend>) -> Result<Self> {
        Self::load_with_progress(path, backend, None)
    }

    /// [`LoadedModel::load`], calling `progress(bytes loaded, total bytes)`
    /// after every weight.
    pub fn load_with_progress(
        path: &Path,
        backend: Arc<dyn Backend>,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        Self::load_with(path, backend, progress, None)
    }

    /// [`LoadedModel::load_with_progress`], with every float matrix
    /// quantized to `quantize` as it loads (`--quantize`; the rule is
    /// [`kiln_formats::quantizing::target_format`]: matrices already in
    /// blocks keep theirs).
    pub fn load_with(
        path: &Path,
        backend: Arc<dyn Backend>,
        progress: Option<LoadProgress<'_>>,
        quantize: Option<QuantFormat>,
    ) -> Result<Self> {
        Self::load_split(path, vec![backend], progress, quantize)
    }

    /// [`LoadedModel::load_with`] over several backends: the ranks of a
    /// tensor-parallel group, rank `r` on `backends[r]`
    /// ([`kiln_models::load_tensor_parallel`]); one backend is the whole
    /// model on it.
    pub fn load_split(
        path: &Path,
        backends: Vec<Arc<dyn Backend>>,
        progress: Option<LoadProgress<'_>>,
        quantize: Option<QuantFormat>,
    ) -> Result<Self> {
        Self::load_nodes(path, backends, None, false, progress, quantize)
    }

    /// [`LoadedModel::load_split`] with this node's ranks of a model split
    /// over several nodes (processes), the others following its steps
    /// through `followers` ([`kiln_models::tp::follow`] is their loop);
    /// `expert_parallel`: each rank holds a run of whole experts.
    pub fn load_nodes(
        path: &Path,
        mut backends: Vec<Arc<dyn Backend>>,
        followers: Option<Arc<kiln_models::tp::Followers>>,
        expert_parallel: bool,
        progress: Option<LoadProgress<'_>>,
        quantize: Option<QuantFormat>,
    ) -> Result<Self> {
        let start = Instant::now();
        let (weights, parts) = Self::open(path)?;
        let config = parts.config.clone();
        let split = backends.len() > 1 || backends.first().is_some_and(|b| b.tp_rank().1 > 1);
        let load =
            |source: &dyn kiln_formats::WeightSource| -> kiln_models::Result<Box<dyn CausalLm>> {
                if !split {
                    return load_model_with_progress(backends.remove(0), source, config, progress);
                }
                let m = kiln_models::tp::load_ranks(
                    backends,
                    source,
                    config,
                    progress,
                    expert_parallel,
                )?;
                Ok(match followers {
                    Some(f) => Box::new(m.with_followers(f)),
                    None => Box::new(m),
                })
            };
        let model = match (weights, quantize) {
            (Opened::Gguf(w), None) => load(&w)?,
            (Opened::Gguf(w), Some(f)) => load(&Quantizing::new(w, f)?)?,
            (Opened::Dir(w), None) => load(&w)?,
            (Opened::Dir(w), Some(f)) => load(&Quantizing::new(w, f)?)?,
        };
        let mut loaded = Self::assemble(path, model, parts)?;
        loaded.load_seconds = start.elapsed().as_secs_f64();
        loaded.quantized = quantize;
        Ok(loaded)
    }

    /// `path`'s headers and tokenizer, with a model `make` builds from its
    /// configuration instead of its weights.
    pub(crate) fn load_parts(
        path: &Path,
        make: impl FnOnce(ModelConfig) -> Result<Box<dyn CausalLm>>,
    ) -> Result<Self> {
        let (_, parts) = Self::open(path)?;
        let model = make(parts.config.clone())?;
        Self::assemble(path, model, parts)
    }

    /// Opens `path` (a `.gguf` file, or a directory with `config.json`,
    /// safetensors weights and `tokenizer.json`) and reads everything but
    /// the weights.
    fn open(path: &Path) -> Result<(Opened, Parts)> {
        if path.is_dir() {
            let weights = SafetensorsDir::open(path)?;
            let config = ModelConfig::from_hf(weights.config())?;
            let mut eos = config.eos_token_ids.clone();
            if let Some(gen) = weights.generation_config() {
                match gen.get("eos_token_id") {
                    Some(serde_json::Value::Number(n)) => eos.extend(n.as_u64().map(|v| v as u32)),
                    Some(serde_json::Value::Array(a)) => {
                        eos.extend(a.iter().filter_map(|v| v.as_u64().map(|v| v as u32)))
                    }
                    _ => {}
                }
            }
            let sampling_defaults = weights
                .generation_config()
                .map(crate::gen_defaults::from_generation_config)
                .unwrap_or_default();
            let tokenizer = Tokenizer::from_hf_dir(path)?;
            let parts = Parts {
                config,
                tokenizer,
                eos,
                sampling_defaults,
            };
            Ok((Opened::Dir(weights), parts))
        } else if path.is_file() {
            let weights = GgufWeights::open(path)?;
            let config = ModelConfig::from_hf(&weights.hf_config()?)?;
            let tokenizer = Tokenizer::from_gguf(weights.metadata())?;
            let parts = Parts {
                eos: config.eos_token_ids.clone(),
                sampling_defaults: crate::gen_defaults::from_gguf(weights.metadata()),
                config,
                tokenizer,
            };
            Ok((Opened::Gguf(weights), parts))
        } else {
            Err(EngineError::BadModelPath {
                path: path.display().to_string(),
                what: "no such file or directory".into(),
            })
        }
    }

    fn assemble(path: &Path, model: Box<dyn CausalLm>, parts: Parts) -> Result<Self> {
        let Parts {
            tokenizer,
            eos: config_eos,
            sampling_defaults,
            ..
        } = parts;
        let chat_template = tokenizer
            .chat_template()
            .map(ChatTemplate::new)
            .transpose()?;
        let mut eos: Vec<u32> = config_eos;
        eos.extend(tokenizer.eos_id());
        eos.extend(tokenizer.stop_ids());
        eos.sort_unstable();
        eos.dedup();
        Ok(LoadedModel {
            path: path.to_path_buf(),
            model,
            tokenizer,
            chat_template,
            eos_token_ids: eos.into_iter().map(TokenId).collect(),
            load_seconds: 0.0,
            quantized: None,
            sampling_defaults,
            structured: OnceLock::new(),
        })
    }

    /// A constraint for `format` over this model's vocabulary (the
    /// vocabulary is indexed once, on first use).
    pub fn constraint(&self, format: &Format) -> Result<Constraint> {
        let vocab = self
            .structured
            .get_or_init(|| {
                let stops: Vec<u32> = self.eos_token_ids.iter().map(|t| t.0).collect();
                StructuredVocab::new(&self.tokenizer, self.model.config().vocab_size, &stops)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| StructuredError::Vocab(e.clone()))?;
        Ok(vocab.constraint(format)?)
    }

    /// Replaces the model's chat template with `source` (compiled first:
    /// a template that does not compile leaves the model as it was).
    pub fn set_chat_template(&mut self, source: &str) -> Result<()> {
        self.chat_template = Some(ChatTemplate::new(source)?);
        self.tokenizer.set_chat_template(source.to_string());
        Ok(())
    }

    /// The context length the model was trained for.
    pub fn context_length(&self) -> usize {
        self.model.config().max_position_embeddings
    }
}

impl LoadedModel {
    /// Render `messages` (a JSON list of `{role, content, ...}`) with the
    /// model's chat template, as transformers' `apply_chat_template` does.
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut ctx = self.tokenizer.chat_context(messages.clone());
        ctx.add_generation_prompt = add_generation_prompt;
        self.render_chat_with(&ctx)
    }

    /// Render a full chat context (tools, `enable_thinking`, template kwargs).
    pub fn render_chat_with(&self, ctx: &kiln_text::ChatContext) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(EngineError::NoChatTemplate)?;
        Ok(template.render(ctx)?)
    }
}
