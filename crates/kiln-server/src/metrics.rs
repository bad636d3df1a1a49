//! Request and token counters, per-request latency histograms, and their
//! Prometheus text rendering together with the engine's gauges
//! (`GET /metrics`).
//!
//! The latencies are recorded where the server reads each request's events
//! ([`crate::generation::EventReceiver`]): time to first token and
//! end-to-end latency from the moment the request was handed to generation,
//! the gap between consecutive tokens as the server sees them, and the
//! engine's own queue time from `Event::Finished`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kiln_engine::{EngineStats, Usage};

use crate::histogram::Histogram;

/// Counters since the server started.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Responses by (endpoint, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    finished: AtomicU64,
    pub latency: Latency,
}

/// Per-request latency histograms, in seconds.
#[derive(Debug, Default)]
pub struct Latency {
    /// From the start of generation (prompt rendering and tokenization
    /// included) until the first token reached the server.
    pub time_to_first_token: Histogram,
    /// Between consecutive tokens of one request.
    pub inter_token: Histogram,
    /// From the start of generation until the request finished.
    pub end_to_end: Histogram,
    /// In the engine's queue: submission until its first step.
    pub queue: Histogram,
}

impl Latency {
    /// The histograms with their metric names and help texts, in the order
    /// `/metrics` and `/stats` show them.
    pub fn named(&self) -> [(&'static str, &'static str, &Histogram); 4] {
        [
            (
                "time_to_first_token_seconds",
                "Time from the start of a request to its first token.",
                &self.time_to_first_token,
            ),
            (
                "inter_token_latency_seconds",
                "Time between consecutive tokens of a request.",
                &self.inter_token,
            ),
            (
                "e2e_request_latency_seconds",
                "Time from the start of a request until it finished.",
                &self.end_to_end,
            ),
            (
                "request_queue_time_seconds",
                "Time a request waited in the engine's queue.",
                &self.queue,
            ),
        ]
    }
}

impl Metrics {
    /// Counts one response of `endpoint` (a route such as
    /// `/v1/chat/completions`, or `unmatched`) with `status`.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        let mut map = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    /// Counts the tokens of a finished generation.
    pub fn record_usage(&self, usage: &Usage) {
        self.prompt_tokens
            .fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
        self.finished.fetch_add(1, Ordering::Relaxed);
    }

    /// Responses by (endpoint, status) so far.
    pub fn requests(&self) -> Vec<((String, u16), u64)> {
        let map = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        map.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Prompt, generated and cached tokens of finished generations.
    pub fn token_totals(&self) -> (u64, u64, u64) {
        (
            self.prompt_tokens.load(Ordering::Relaxed),
            self.generation_tokens.load(Ordering::Relaxed),
            self.cached_tokens.load(Ordering::Relaxed),
        )
    }

    /// The Prometheus text exposition of these counters and `stats`.
    pub fn render(&self, model: &str, stats: &EngineStats) -> String {
        let mut out = String::new();
        let model = escape(model);
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{model=\"{model}\"}} {value}");
        };
        let (prompt, generated, cached) = self.token_totals();
        let s = &stats.scheduler;
        metric(
            "kiln_num_requests_running",
            "gauge",
            "Requests running in the engine.",
            s.num_running as f64,
        );
        metric(
            "kiln_num_requests_waiting",
            "gauge",
            "Requests waiting in the engine's queue.",
            s.num_waiting as f64,
        );
        metric(
            "kiln_kv_blocks_used",
            "gauge",
            "KV cache blocks held by running requests.",
            s.num_blocks_used as f64,
        );
        metric(
            "kiln_kv_blocks_total",
            "gauge",
            "KV cache blocks in the pool.",
            s.num_blocks_total as f64,
        );
        metric(
            "kiln_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            prompt as f64,
        );
        metric(
            "kiln_generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            generated as f64,
        );
        metric(
            "kiln_cached_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests served from the prefix cache.",
            cached as f64,
        );
        metric(
            "kiln_requests_finished_total",
            "counter",
            "Generations that finished (not counting cancelled ones).",
            self.finished.load(Ordering::Relaxed) as f64,
        );
        metric(
            "kiln_preemptions_total",
            "counter",
            "Requests preempted to free KV blocks.",
            s.num_preemptions as f64,
        );
        metric(
            "kiln_spec_decode_num_draft_tokens_total",
            "counter",
            "Draft tokens verified by speculative decoding (n-gram lookup, predictions).",
            s.num_draft_tokens as f64,
        );
        metric(
            "kiln_spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens speculative decoding accepted.",
            s.num_accepted_draft_tokens as f64,
        );
        metric(
            "kiln_spec_decode_num_drafts_total",
            "counter",
            "Speculative decodes: a request's step with draft tokens.",
            s.num_speculative_decodes as f64,
        );
        metric(
            "kiln_prefix_cache_queried_tokens_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache.num_queried_tokens as f64,
        );
        metric(
            "kiln_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache.num_hit_tokens as f64,
        );
        let queried = s.prefix_cache.num_queried_tokens;
        metric(
            "kiln_prefix_cache_hit_rate",
            "gauge",
            "Share of the prompt tokens looked up in the prefix cache that were found (0 before any lookup).",
            if queried == 0 {
                0.0
            } else {
                s.prefix_cache.num_hit_tokens as f64 / queried as f64
            },
        );
        metric(
            "kiln_engine_steps_total",
            "counter",
            "Forward steps run by the engine.",
            stats.num_steps as f64,
        );
        for (name, help, h) in self.latency.named() {
            h.render(&mut out, &format!("kiln_{name}"), help, &model);
        }
        let _ = writeln!(
            out,
            "# HELP kiln_http_requests_total HTTP responses by endpoint and status.\n\
             # TYPE kiln_http_requests_total counter"
        );
        for ((endpoint, status), n) in self.requests() {
            let _ = writeln!(
                out,
                "kiln_http_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                escape(&endpoint)
            );
        }
        out
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_requests_and_tokens() {
        let m = Metrics::default();
        m.record_request("/v1/completions", 200);
        m.record_request("/v1/completions", 200);
        m.record_request("/v1/completions", 400);
        m.record_usage(&Usage {
            prompt_tokens: 10,
            cached_tokens: 4,
            completion_tokens: 3,
            ..Usage::default()
        });
        assert_eq!(
            m.requests(),
            vec![
                (("/v1/completions".to_string(), 200), 2),
                (("/v1/completions".to_string(), 400), 1)
            ]
        );
        assert_eq!(m.token_totals(), (10, 3, 4));
        assert_eq!(escape("a\"b\\"), "a\\\"b\\\\");
    }
}
