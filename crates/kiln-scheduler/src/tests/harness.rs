//! The trace harness: `check(trace, expected)` runs a script of scheduler calls and
//! compares the transcript of what happened with `expected`, line by line.
//!
//! A trace is one command per line (blank lines and `#` comments are skipped):
//!
//! * `config blocks=16 block_size=4 budget=64 seqs=8 waiting=16 max_len=1024
//!   window=8 hash=weak` (first line, every key optional; `hash=weak` hashes only
//!   the parent, so blocks at the same index collide; `window` adds a
//!   sliding-window layer group),
//! * `submit 1 prompt=0..10,99 max=4 prio=1 salt=a adapter=2`
//!   (token ranges and single ids, comma-separated),
//! * `schedule`, `update 1:42 2:43,44` (the sampled tokens of each listed
//!   request: one, or a speculative decode's accepted drafts and its next),
//! * `propose 1 7,8,9` (drafts for request 1's next decode; a plan shows them
//!   as `+d3`),
//! * `step` (schedule, then update with token `500 + id` for each request that
//!   wants logits), `run` (steps until nothing is scheduled),
//! * `finish 1`, `cancel 1`, `stats`, `free` (free blocks in eviction order, `*`
//!   marking those that keep a cached hash), `table 1`.
//!
//! Every command prints one line, `<command>: <result>`. A plan prints as
//! `r1 4+8 [1 2 3] logits`: request 1 had 4 tokens computed, computes 8 more, has
//! block table `[1 2 3]` and wants logits. On a mismatch the test fails with the
//! whole actual transcript, ready to paste.

use std::fmt::Write;

use kiln_sampling::TokenId;

use crate::{
    AdapterId, BlockHash, FinishedRequest, KvCacheSpec, LayerGroup, LayerKind, Priority, Request,
    RequestId, Scheduler, SchedulerConfig, SchedulerOutput, UpdateOutput,
};

/// Runs `trace` and asserts its transcript equals `expected` (leading and trailing
/// whitespace of each line and blank lines are ignored).
pub(crate) fn check(trace: &str, expected: &str) {
    let actual = run_trace(trace);
    let normalize = |text: &str| -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    };
    let (actual_lines, expected_lines) = (normalize(&actual), normalize(expected));
    if actual_lines != expected_lines {
        let first_diff = actual_lines
            .iter()
            .zip(&expected_lines)
            .position(|(a, e)| a != e)
            .unwrap_or(actual_lines.len().min(expected_lines.len()));
        panic!(
            "trace transcript differs at line {}\n--- expected\n{}\n--- actual\n{}",
            first_diff + 1,
            expected_lines.join("\n"),
            actual_lines.join("\n")
        );
    }
}

/// A hash that ignores token ids: every block at the same index of a chain with the
/// same root collides.
fn weak_chain_hash(parent: BlockHash, _token_ids: &[TokenId]) -> BlockHash {
    BlockHash(parent.0.wrapping_add(1))
}

fn run_trace(trace: &str) -> String {
    let mut lines = trace
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .peekable();
    let config_line = match lines.peek() {
        Some(line) if line.starts_with("config") => lines.next(),
        _ => None,
    };
    let mut sched = build_scheduler(config_line.unwrap_or("config"));
    let mut out = String::new();
    for line in lines {
        let result = run_command(&mut sched, line);
        let name = line.split_whitespace().take(2).collect::<Vec<_>>();
        let label = match name.as_slice() {
            [cmd, id] if id.parse::<u64>().is_ok() => format!("{cmd} r{id}"),
            [cmd, ..] => (*cmd).to_string(),
            [] => unreachable!("blank lines are skipped"),
        };
        writeln!(out, "{label}: {result}").unwrap();
    }
    out
}

fn key_values(line: &str) -> impl Iterator<Item = (&str, &str)> {
    line.split_whitespace().filter_map(|w| w.split_once('='))
}

fn build_scheduler(line: &str) -> Scheduler {
    let mut kv_cache = KvCacheSpec::uniform(2);
    kv_cache.block_size = 4;
    let mut config = SchedulerConfig::new(kv_cache, 16, 1024);
    config.max_num_batched_tokens = 64;
    config.max_num_seqs = 8;
    config.max_waiting = 16;
    let mut weak_hash = false;
    for (key, value) in key_values(line) {
        let n = || value.parse::<usize>().expect("numeric config value");
        match key {
            "blocks" => config.num_blocks = n(),
            "block_size" => config.kv_cache.block_size = n(),
            "budget" => config.max_num_batched_tokens = n(),
            "seqs" => config.max_num_seqs = n(),
            "waiting" => config.max_waiting = n(),
            "max_len" => config.max_model_len = n(),
            "window" => config.kv_cache.groups.push(LayerGroup {
                kind: LayerKind::SlidingWindow { window: n() },
                num_layers: 1,
            }),
            "hash" => weak_hash = value == "weak",
            other => panic!("unknown config key {other}"),
        }
    }
    let mut sched = Scheduler::new(config).expect("valid trace config");
    if weak_hash {
        sched.kv_manager_mut().set_chain_hash(weak_chain_hash);
    }
    sched
}

fn parse_tokens(spec: &str) -> Vec<TokenId> {
    let mut out = Vec::new();
    for item in spec.split(',').filter(|item| !item.is_empty()) {
        match item.split_once("..") {
            Some((lo, hi)) => out.extend((lo.parse().unwrap()..hi.parse().unwrap()).map(TokenId)),
            None => out.push(TokenId(item.parse().unwrap())),
        }
    }
    out
}

fn parse_id(word: Option<&str>) -> RequestId {
    RequestId(word.and_then(|w| w.parse().ok()).expect("a request id"))
}

fn run_command(sched: &mut Scheduler, line: &str) -> String {
    let mut words = line.split_whitespace();
    let cmd = words.next().expect("non-empty line");
    match cmd {
        "submit" => {
            let id = parse_id(words.next());
            let mut request = Request::new(id, Vec::new(), 1);
            for (key, value) in key_values(line) {
                match key {
                    "prompt" => request.prompt_token_ids = parse_tokens(value),
                    "max" => request.max_tokens = value.parse().unwrap(),
                    "prio" => request.priority = Priority(value.parse().unwrap()),
                    "salt" => request.cache_salt = Some(value.to_string()),
                    "adapter" => request.adapter_id = Some(AdapterId(value.parse().unwrap())),
                    other => panic!("unknown submit key {other}"),
                }
            }
            match sched.submit(request) {
                Ok(()) => "ok".to_string(),
                Err(e) => format!("error: {e}"),
            }
        }
        "schedule" => match sched.schedule() {
            Ok(output) => render_plan(&output),
            Err(e) => format!("error: {e}"),
        },
        "update" => {
            let results: Vec<(RequestId, Vec<TokenId>)> = words
                .map(|w| {
                    let (id, tok) = w.split_once(':').expect("id:token");
                    let tokens = parse_tokens(tok);
                    (RequestId(id.parse().unwrap()), tokens)
                })
                .collect();
            match sched.update(&results) {
                Ok(update) => render_update("ok", &update),
                Err(e) => format!("error: {e}"),
            }
        }
        "step" => step(sched),
        "propose" => {
            let id = parse_id(words.next());
            sched.propose(id, parse_tokens(words.next().unwrap_or("")));
            "ok".to_string()
        }
        "run" => {
            let mut num_steps = 0;
            let mut finished = Vec::new();
            loop {
                let output = sched.schedule().expect("no step in flight");
                if output.is_empty() {
                    break;
                }
                num_steps += 1;
                let update = sched.update(&auto_results(&output)).expect("valid results");
                finished.extend(update.finished_by_length.iter().map(render_finished));
            }
            format!("{num_steps} steps; finished {}", finished.join(", "))
        }
        "finish" | "cancel" => {
            let id = parse_id(words.next());
            let result = if cmd == "finish" {
                sched.finish(id)
            } else {
                sched.cancel(id)
            };
            match result {
                Ok(done) => render_finished(&done)
                    .split_once(' ')
                    .unwrap()
                    .1
                    .to_string(),
                Err(e) => format!("error: {e}"),
            }
        }
        "stats" => {
            let s = sched.stats();
            let p = s.prefix_cache;
            format!(
                "waiting={} running={} used={}/{} cached={} lookups={} queried={} \
                 hit_blocks={} hit_tokens={} collisions={} evictions={} preemptions={} \
                 prompt={} generated={} finished={} cancelled={}{}",
                s.num_waiting,
                s.num_running,
                s.num_blocks_used,
                s.num_blocks_total,
                s.num_blocks_cached,
                p.num_lookups,
                p.num_queried_tokens,
                p.num_hit_blocks,
                p.num_hit_tokens,
                p.num_collisions,
                s.num_evictions,
                s.num_preemptions,
                s.num_prompt_tokens,
                s.num_generated_tokens,
                s.num_finished,
                s.num_cancelled,
                match s.num_draft_tokens {
                    0 => String::new(),
                    n => format!(" drafts={n} accepted={}", s.num_accepted_draft_tokens),
                }
            )
        }
        "free" => {
            let pool = sched.kv_manager().pool();
            let ids: Vec<String> = pool
                .free_blocks()
                .map(|b| {
                    let mark = if pool.block_hash(b).is_some() {
                        "*"
                    } else {
                        ""
                    };
                    format!("{}{mark}", b.0)
                })
                .collect();
            ids.join(" ")
        }
        "table" => {
            let id = parse_id(words.next());
            match (sched.kv_manager().block_tables(id), sched.request(id)) {
                (Some(table), Some(info)) => {
                    format!(
                        "{} computed={}",
                        render_blocks(table),
                        info.num_computed_tokens
                    )
                }
                (None, Some(info)) => format!("none ({:?})", info.status),
                _ => "unknown".to_string(),
            }
        }
        other => panic!("unknown trace command {other}"),
    }
}

/// Schedules one step and updates it with token `500 + id` for each request that
/// wants logits.
fn step(sched: &mut Scheduler) -> String {
    let output = match sched.schedule() {
        Ok(output) => output,
        Err(e) => return format!("error: {e}"),
    };
    if output.is_empty() {
        return render_plan(&output);
    }
    match sched.update(&auto_results(&output)) {
        Ok(update) => render_update(&render_plan(&output), &update),
        Err(e) => format!("{} | update error: {e}", render_plan(&output)),
    }
}

fn auto_results(output: &SchedulerOutput) -> Vec<(RequestId, Vec<TokenId>)> {
    output
        .scheduled
        .iter()
        .filter(|s| s.wants_logits)
        .map(|s| (s.id, vec![TokenId(500 + s.id.0 as u32)]))
        .collect()
}

/// Each group's table as `[ids]`, entries freed from a window as `-`.
fn render_blocks(tables: &[crate::BlockTable]) -> String {
    let rendered: Vec<String> = tables
        .iter()
        .map(|t| {
            let ids: Vec<String> = (0..t.len())
                .map(|i| t.get(i).map_or("-".to_string(), |b| b.0.to_string()))
                .collect();
            format!("[{}]", ids.join(" "))
        })
        .collect();
    rendered.join(" ")
}

fn render_plan(output: &SchedulerOutput) -> String {
    let mut parts: Vec<String> = output
        .scheduled
        .iter()
        .map(|s| {
            let logits = if s.wants_logits { " logits" } else { "" };
            let drafts = match s.num_draft_tokens {
                0 => String::new(),
                n => format!("+d{n}"),
            };
            format!(
                "r{} {}+{}{drafts} {}{logits}",
                s.id,
                s.num_computed_tokens,
                s.num_new_tokens - s.num_draft_tokens,
                render_blocks(&s.block_tables)
            )
        })
        .collect();
    if parts.is_empty() {
        parts.push("idle".to_string());
    }
    let mut text = parts.join(", ");
    if !output.preempted.is_empty() {
        let ids: Vec<String> = output.preempted.iter().map(|id| format!("r{id}")).collect();
        write!(text, " | preempted {}", ids.join(" ")).unwrap();
    }
    if output.num_batched_tokens > 0 {
        write!(text, " | batched {}", output.num_batched_tokens).unwrap();
    }
    text
}

fn render_update(prefix: &str, update: &UpdateOutput) -> String {
    if update.finished_by_length.is_empty() {
        return prefix.to_string();
    }
    let done: Vec<String> = update
        .finished_by_length
        .iter()
        .map(render_finished)
        .collect();
    format!("{prefix} | finished {}", done.join(", "))
}

fn render_finished(done: &FinishedRequest) -> String {
    let preempted = if done.num_preemptions > 0 {
        format!(" preempted={}", done.num_preemptions)
    } else {
        String::new()
    };
    format!(
        "r{} prompt={} cached={} output={}{preempted}",
        done.id,
        done.num_prompt_tokens,
        done.num_cached_tokens,
        done.output_token_ids.len()
    )
}
