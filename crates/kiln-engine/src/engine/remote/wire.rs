//! The messages between the server's process and an engine process, and
//! their framing: each message is a little-endian `u32` length and that
//! many bytes of JSON. Both ends are the same binary, so the messages are
//! the engine's own types as serde writes them.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use crate::embed::EmbedInput;
use crate::engine::EngineStats;
use crate::error::EngineError;
use crate::events::Event;
use crate::generate::GenerationRequest;

/// Frames larger than this are refused as corrupt (a long prompt with its
/// sampling fields is far smaller; so are 2,048 embeddings of 4,096 values).
const MAX_FRAME: usize = 256 << 20;

/// To the engine process.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum ToWorker {
    Submit {
        id: u64,
        request: WireRequest,
    },
    /// The caller went away: drop the request.
    Cancel {
        id: u64,
    },
    Stats {
        call: u64,
    },
    Embed {
        call: u64,
        inputs: Vec<EmbedInput>,
    },
}

/// From the engine process.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum FromWorker {
    /// The model is loaded and the engine runs.
    Ready {
        generates: bool,
        context: usize,
    },
    /// The model could not be loaded; the process exits.
    LoadFailed {
        message: String,
    },
    Admitted {
        id: u64,
    },
    Refused {
        id: u64,
        error: WireError,
    },
    Event {
        id: u64,
        event: Event,
    },
    Stats {
        call: u64,
        stats: Box<EngineStats>,
    },
    Embedded {
        call: u64,
        result: Result<Vec<Vec<f32>>, WireError>,
    },
}

/// A [`GenerationRequest`] on the wire (LoRA adapters stay in-process).
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct WireRequest {
    prompt: Vec<u32>,
    params: kiln_sampling::SamplingParams,
    skip_special_tokens: bool,
    priority: i32,
    cache_salt: Option<String>,
    format: Option<kiln_structured::Format>,
    reasoning: Option<crate::process::ReasoningTags>,
    jump_forward: bool,
    prediction: Option<Vec<u32>>,
}

impl WireRequest {
    pub(super) fn new(r: GenerationRequest) -> Self {
        WireRequest {
            prompt: r.prompt,
            params: r.params,
            skip_special_tokens: r.skip_special_tokens,
            priority: r.priority,
            cache_salt: r.cache_salt,
            format: r.format,
            reasoning: r.reasoning,
            jump_forward: r.jump_forward,
            prediction: r.prediction,
        }
    }

    pub(super) fn into_request(self) -> GenerationRequest {
        GenerationRequest {
            prompt: self.prompt,
            params: self.params,
            skip_special_tokens: self.skip_special_tokens,
            priority: self.priority,
            cache_salt: self.cache_salt,
            format: self.format,
            reasoning: self.reasoning,
            jump_forward: self.jump_forward,
            adapter: None,
            prediction: self.prediction,
        }
    }
}

/// An [`EngineError`] on the wire: the kinds the server answers
/// differently keep their kind, the rest their message.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum WireError {
    Refused(kiln_scheduler::SubmitError),
    PromptTooLong {
        prompt_tokens: usize,
        context_length: usize,
    },
    InvalidRequest(String),
    Busy(String),
    Restarting,
    Stopped,
    Failed(String),
}

impl From<EngineError> for WireError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Refused(s) => WireError::Refused(s),
            EngineError::PromptTooLong {
                prompt_tokens,
                context_length,
            } => WireError::PromptTooLong {
                prompt_tokens,
                context_length,
            },
            EngineError::InvalidRequest(m) => WireError::InvalidRequest(m),
            EngineError::Busy(m) => WireError::Busy(m),
            EngineError::Restarting => WireError::Restarting,
            EngineError::EngineStopped => WireError::Stopped,
            e @ (EngineError::EmptyPrompt
            | EngineError::Text(_)
            | EngineError::Sampling(_)
            | EngineError::Structured(_)) => WireError::InvalidRequest(e.to_string()),
            e => WireError::Failed(e.to_string()),
        }
    }
}

impl From<WireError> for EngineError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Refused(s) => EngineError::Refused(s),
            WireError::PromptTooLong {
                prompt_tokens,
                context_length,
            } => EngineError::PromptTooLong {
                prompt_tokens,
                context_length,
            },
            WireError::InvalidRequest(m) => EngineError::InvalidRequest(m),
            WireError::Busy(m) => EngineError::Busy(m),
            WireError::Restarting => EngineError::Restarting,
            WireError::Stopped => EngineError::EngineStopped,
            WireError::Failed(m) => EngineError::Failed(m),
        }
    }
}

/// Writes one message.
pub(super) fn write<T: Serialize>(w: &mut impl Write, message: &T) -> io::Result<()> {
    let body = serde_json::to_vec(message).map_err(io::Error::other)?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&n| (n as usize) <= MAX_FRAME)
        .ok_or_else(|| io::Error::other(format!("a message of {} bytes", body.len())))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one message; `Ok(None)` at the end of the stream.
pub(super) fn read<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_sampling::{FinishReason, SamplingParams};

    #[test]
    fn messages_survive_the_wire() {
        let mut params = SamplingParams::greedy();
        params.stop = vec!["\n\n".into()];
        params.seed = Some(7);
        let request = GenerationRequest {
            format: Some(kiln_structured::Format::Regex("[a-z]+".into())),
            prediction: Some(vec![5, 6]),
            ..GenerationRequest::new(vec![1, 2, 3], params.clone())
        };
        let mut buf = Vec::new();
        write(
            &mut buf,
            &ToWorker::Submit {
                id: 9,
                request: WireRequest::new(request),
            },
        )
        .unwrap();
        let event = Event::Finished {
            finish_reason: FinishReason::Length,
            usage: crate::events::Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                ..Default::default()
            },
            timings: Default::default(),
        };
        write(
            &mut buf,
            &FromWorker::Event {
                id: 9,
                event: event.clone(),
            },
        )
        .unwrap();
        let mut r = buf.as_slice();
        match read::<ToWorker>(&mut r).unwrap() {
            Some(ToWorker::Submit { id: 9, request }) => {
                let back = request.into_request();
                assert_eq!(back.prompt, [1, 2, 3]);
                assert_eq!(back.params, params);
                assert_eq!(back.prediction, Some(vec![5, 6]));
                assert!(
                    matches!(back.format, Some(kiln_structured::Format::Regex(ref s)) if s == "[a-z]+")
                );
            }
            other => panic!("{other:?}"),
        }
        match read::<FromWorker>(&mut r).unwrap() {
            Some(FromWorker::Event { id: 9, event: e }) => assert_eq!(e, event),
            other => panic!("{other:?}"),
        }
        assert!(
            read::<FromWorker>(&mut r).unwrap().is_none(),
            "the end of the stream"
        );
        // A corrupt length is refused, not allocated.
        let mut bad: &[u8] = &[0xff, 0xff, 0xff, 0xff];
        assert!(read::<FromWorker>(&mut bad).is_err());
    }

    #[test]
    fn errors_keep_their_kind() {
        let busy = EngineError::from(WireError::from(EngineError::Busy("full".into())));
        assert!(matches!(busy, EngineError::Busy(m) if m == "full"));
        let long = EngineError::from(WireError::from(EngineError::PromptTooLong {
            prompt_tokens: 9,
            context_length: 4,
        }));
        assert!(matches!(
            long,
            EngineError::PromptTooLong {
                prompt_tokens: 9,
                ..
            }
        ));
        assert!(matches!(
            EngineError::from(WireError::from(EngineError::Restarting)),
            EngineError::Restarting
        ));
    }
}
