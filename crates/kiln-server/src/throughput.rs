//! The periodic throughput line (target `kiln::throughput`): every
//! interval in which the engine had work, the requests running and queued,
//! prompt and generation tokens per second over the interval, and KV-cache
//! use. Idle intervals write nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kiln_engine::EngineHandle;
use kiln_scheduler::SchedulerStats;

use crate::loading::Readiness;

/// Writes the throughput line every `interval` once the server is ready,
/// for each engine running (each model of a pool), until the task is
/// dropped.
pub(crate) async fn report(readiness: Readiness, interval: Duration) {
    let Some(served) = readiness.served().await else {
        return;
    };
    let mut last: HashMap<String, (SchedulerStats, Instant)> = HashMap::new();
    let mut ticks = tokio::time::interval(interval);
    loop {
        ticks.tick().await;
        let mut seen = HashMap::new();
        for (name, engine) in served.engines() {
            let Some(now) = stats(&engine).await else {
                continue;
            };
            let now_at = Instant::now();
            if let Some((before, at)) = last.get(&name) {
                // A model loaded again starts its counters from zero.
                if before.num_finished <= now.num_finished {
                    if let Some(line) =
                        Throughput::between(before, &now, (now_at - *at).as_secs_f64())
                    {
                        line.log(&name);
                    }
                }
            }
            seen.insert(name, (now, now_at));
        }
        last = seen;
    }
}

/// The engine's counters, read off the async threads; `None` once the
/// engine has stopped.
async fn stats(engine: &EngineHandle) -> Option<SchedulerStats> {
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || engine.stats().ok().map(|s| s.scheduler))
        .await
        .ok()
        .flatten()
}

/// One interval's figures.
#[derive(Debug, PartialEq)]
struct Throughput {
    num_running: usize,
    num_waiting: usize,
    prompt_tok_s: f64,
    generation_tok_s: f64,
    kv_used_pct: f64,
}

impl Throughput {
    /// The interval from `before` to `after`, `seconds` long; `None` when
    /// the engine was idle throughout.
    fn between(before: &SchedulerStats, after: &SchedulerStats, seconds: f64) -> Option<Self> {
        let prompt = after
            .num_prompt_tokens
            .saturating_sub(before.num_prompt_tokens);
        let generated = after
            .num_generated_tokens
            .saturating_sub(before.num_generated_tokens);
        let busy = after.num_running + after.num_waiting > 0;
        if !busy && prompt == 0 && generated == 0 {
            return None;
        }
        let rate = |n: u64| (n as f64 / seconds.max(1e-9) * 10.0).round() / 10.0;
        let kv = after.num_blocks_used as f64 / after.num_blocks_total.max(1) as f64;
        Some(Throughput {
            num_running: after.num_running,
            num_waiting: after.num_waiting,
            prompt_tok_s: rate(prompt),
            generation_tok_s: rate(generated),
            kv_used_pct: (kv * 1000.0).round() / 10.0,
        })
    }

    /// Logs the line; `model` names the model when a pool serves several
    /// (empty for a single engine).
    fn log(&self, model: &str) {
        tracing::info!(
            target: "kiln::throughput",
            model = (!model.is_empty()).then_some(model),
            running = self.num_running,
            queued = self.num_waiting,
            prompt_tok_s = self.prompt_tok_s,
            generation_tok_s = self.generation_tok_s,
            kv_used_pct = self.kv_used_pct,
            "throughput"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(running: usize, prompt: u64, generated: u64, blocks_used: usize) -> SchedulerStats {
        SchedulerStats {
            num_running: running,
            num_prompt_tokens: prompt,
            num_generated_tokens: generated,
            num_blocks_used: blocks_used,
            num_blocks_total: 200,
            ..SchedulerStats::default()
        }
    }

    #[test]
    fn idle_intervals_say_nothing() {
        let s = stats(0, 100, 50, 0);
        assert_eq!(Throughput::between(&s, &s, 10.0), None);
    }

    #[test]
    fn rates_are_over_the_interval() {
        let t = Throughput::between(&stats(0, 100, 50, 0), &stats(2, 300, 550, 50), 10.0)
            .expect("a busy interval");
        assert_eq!(
            t,
            Throughput {
                num_running: 2,
                num_waiting: 0,
                prompt_tok_s: 20.0,
                generation_tok_s: 50.0,
                kv_used_pct: 25.0,
            }
        );
    }

    #[test]
    fn the_interval_that_finished_the_work_is_reported() {
        // Nothing runs now, but tokens were generated since the last line.
        let t = Throughput::between(&stats(1, 0, 0, 10), &stats(0, 0, 40, 0), 10.0);
        assert_eq!(t.map(|t| t.generation_tok_s), Some(4.0));
    }
}
