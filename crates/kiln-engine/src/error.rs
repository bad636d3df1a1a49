//! Errors of the engine layer: everything below it, plus refused requests.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] kiln_formats::FormatError),
    #[error(transparent)]
    Model(#[from] kiln_models::ModelError),
    #[error(transparent)]
    Tensor(#[from] kiln_tensor::TensorError),
    #[error(transparent)]
    Text(#[from] kiln_text::TextError),
    #[error(transparent)]
    Sampling(#[from] kiln_sampling::SamplingError),
    #[error(
        "prompt of {prompt_tokens} tokens does not fit the context of {context_length} tokens"
    )]
    PromptTooLong {
        prompt_tokens: usize,
        context_length: usize,
    },
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,
    #[error("{path}: {what}")]
    BadModelPath { path: String, what: String },
    #[error("this model has no chat template; use a raw prompt")]
    NoChatTemplate,
    #[error(transparent)]
    Refused(#[from] kiln_scheduler::SubmitError),
    /// The requested output format does not compile (or cannot be used
    /// with this tokenizer).
    #[error(transparent)]
    Structured(#[from] kiln_structured::StructuredError),
    #[error("engine configuration: {0}")]
    Config(String),
    /// A request the model cannot serve as asked (an input past its limit,
    /// an unknown prompt name, an id outside the vocabulary): the caller's
    /// to fix.
    #[error("{0}")]
    InvalidRequest(String),
    /// Every slot of a bounded resource is taken for now: retry shortly.
    #[error("{0}")]
    Busy(String),
    #[error("request failed: {0}")]
    Failed(String),
    #[error("the engine has stopped")]
    EngineStopped,
    /// The engine loop failed and is being restarted; retry shortly.
    #[error("the engine is restarting after a failure; retry shortly")]
    Restarting,
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
