//! Why a request stopped generating.

use std::fmt;

/// The reason generation ended for one request.
///
/// [`fmt::Display`] (and [`FinishReason::as_openai_str`]) give the `finish_reason` value
/// sent on the OpenAI wire: `stop` or `length` for the reasons OpenAI knows. Reasons
/// OpenAI has no name for are mapped as documented on each variant; the server keeps
/// the precise variant for logs and for fields such as vLLM's `stop_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token or one of `stop_token_ids`.
    /// Sent as `stop`.
    Stop,
    /// The text matched the stop string at this index of `SamplingParams::stop`.
    /// Sent as `stop`.
    StopString(usize),
    /// `max_tokens` was reached, or the context window is full. Sent as `length`.
    Length,
    /// A repetition guard fired (see [`crate::RepetitionGuard`]). OpenAI has no such
    /// reason; it is sent as `stop`, because the server ended the text on a rule of its
    /// own, as it does for a stop string, and `length` would wrongly blame `max_tokens`.
    Repetition,
    /// The client went away or the request was aborted. Nothing is usually sent; if it
    /// is, it is sent as `abort`, the name vLLM uses.
    Cancelled,
}

impl FinishReason {
    /// The `finish_reason` string for the OpenAI API.
    pub const fn as_openai_str(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString(_) | FinishReason::Repetition => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "abort",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_openai_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_match_openai() {
        assert_eq!(FinishReason::Stop.to_string(), "stop");
        assert_eq!(FinishReason::StopString(3).to_string(), "stop");
        assert_eq!(FinishReason::Length.to_string(), "length");
        assert_eq!(FinishReason::Repetition.to_string(), "stop");
        assert_eq!(FinishReason::Cancelled.to_string(), "abort");
    }
}
