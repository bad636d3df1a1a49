//! Property tests: random sessions of submits, steps, finishes and cancels under
//! random configurations, with every invariant checked after every call, and a
//! simulated overload (32 requests through a pool sized for about 4).

use std::collections::BTreeMap;

use kiln_sampling::TokenId;

use super::model::SimEngine;
use super::rng::Rng;
use crate::{
    AdapterId, BlockHash, BlockTable, KvCacheSpec, LayerKind, Priority, Request, RequestId,
    Scheduler, SchedulerConfig, SchedulerOutput,
};

fn weak_chain_hash(parent: BlockHash, _token_ids: &[TokenId]) -> BlockHash {
    BlockHash(parent.0.wrapping_add(1))
}

fn random_tokens(rng: &mut Rng, len: usize, vocab: usize) -> Vec<TokenId> {
    (0..len).map(|_| TokenId(rng.below(vocab) as u32)).collect()
}

fn random_config(rng: &mut Rng) -> SchedulerConfig {
    let block_size = [1, 2, 3, 4, 16][rng.below(5)];
    // Some models mix sliding-window layers (of a random window) with global ones.
    let kinds: Vec<LayerKind> = if rng.chance(40) {
        let window = [1, 2, 5, 8, 17][rng.below(5)];
        (0..rng.range(2, 7))
            .map(|i| {
                if i == 0 || rng.chance(30) {
                    LayerKind::FullAttention
                } else {
                    LayerKind::SlidingWindow { window }
                }
            })
            .collect()
    } else {
        vec![LayerKind::FullAttention; 2]
    };
    let (kv_cache, _) = KvCacheSpec::for_layers(&kinds, block_size);
    // Requests need up to 60 tokens of KV; some pools are too small for the longest.
    let max_blocks = 60usize.div_ceil(block_size) * kv_cache.groups.len();
    let mut config =
        SchedulerConfig::new(kv_cache, rng.range(max_blocks / 2 + 1, max_blocks * 3), 64);
    config.max_num_batched_tokens = rng.range(1, 48);
    config.max_num_seqs = rng.range(1, 8);
    config.max_waiting = rng.range(1, 12);
    // Some models are hybrids: state slots, snapshots, checkpoints.
    if rng.chance(30) {
        config.state_slots = config.max_num_seqs + rng.below(3);
        config.state_snapshots = rng.below(6);
        config.state_checkpoint_tokens = block_size * rng.range(1, 4);
        // Spare slots let their decodes speculate (none: proposals ignored).
        config.state_spare_slots = rng.below(3);
    }
    config
}

/// A request built from a few shared prefixes over a tiny vocabulary, so that
/// prefixes, whole blocks and generated blocks repeat across requests.
fn random_request(rng: &mut Rng, id: u64, bases: &[Vec<TokenId>]) -> Request {
    let base = &bases[rng.below(bases.len())];
    let mut prompt = base[..rng.below(base.len() + 1)].to_vec();
    let suffix_len = rng.range(usize::from(prompt.is_empty()), 16);
    prompt.extend(random_tokens(rng, suffix_len, 4));
    let mut request = Request::new(RequestId(id), prompt, rng.range(1, 20));
    request.priority = Priority(rng.below(3) as i32);
    request.cache_salt = [None, Some("a"), Some("b")][rng.below(3)].map(String::from);
    request.adapter_id = rng.chance(20).then_some(AdapterId(1));
    request
}

/// Block tables seen so far, to check that each only ever grows at its end and
/// drops entries only at its front.
#[derive(Default)]
struct TableLog(BTreeMap<RequestId, Vec<BlockTable>>);

impl TableLog {
    fn observe(&mut self, output: &SchedulerOutput) {
        for id in &output.preempted {
            self.0.remove(id);
        }
        for s in &output.scheduled {
            if let Some(old) = self.0.get(&s.id) {
                for (old, new) in old.iter().zip(&s.block_tables) {
                    assert!(new.first >= old.first && new.len() >= old.len());
                    for idx in new.first..old.len() {
                        assert_eq!(
                            new.get(idx),
                            old.get(idx),
                            "block table of {} changed at {idx}",
                            s.id
                        );
                    }
                }
            }
            self.0.insert(s.id, s.block_tables.clone());
        }
    }
}

fn random_session(seed: u64, num_ops: usize) -> crate::SchedulerStats {
    let mut rng = Rng::new(seed);
    let mut sched = Scheduler::new(random_config(&mut rng)).unwrap();
    if rng.chance(20) {
        sched.kv_manager_mut().set_chain_hash(weak_chain_hash);
    }
    let bases: Vec<Vec<TokenId>> = (0..3).map(|_| random_tokens(&mut rng, 24, 4)).collect();
    let mut engine = SimEngine::default();
    let mut tables = TableLog::default();
    let mut next_id = 0;
    let mut num_accepted = 0u64;
    let speculative = rng.chance(40);
    for _ in 0..num_ops {
        let tracked: Vec<RequestId> = engine.requests.keys().copied().collect();
        match rng.below(100) {
            0..=29 => {
                let request = random_request(&mut rng, next_id, &bases);
                next_id += 1;
                num_accepted += u64::from(engine.submit(&mut sched, request));
                if let Some(&id) = tracked.first() {
                    let duplicate = Request::new(id, vec![TokenId(0)], 1);
                    assert!(sched.submit(duplicate).is_err(), "duplicate id accepted");
                }
            }
            30..=74 => {
                if speculative && rng.chance(60) {
                    engine.propose(&mut sched, &mut rng);
                }
                let output = sched.schedule().unwrap();
                tables.observe(&output);
                if output.is_empty() {
                    assert!(sched.update(&[]).is_err());
                    continue;
                }
                assert!(sched.schedule().is_err(), "scheduled twice");
                if rng.chance(10) {
                    // The client goes away while the step runs.
                    let victim = output.scheduled[rng.below(output.scheduled.len())].id;
                    engine.end(&mut sched, victim, true);
                    tables.0.remove(&victim);
                }
                let results = engine.run_model(&sched, &output);
                engine.apply(&mut sched, &results);
                // A speculative decode's table gave back what its rejected
                // drafts took.
                for s in output.scheduled.iter().filter(|s| s.num_draft_tokens > 0) {
                    match sched.kv_manager().block_tables(s.id) {
                        Some(t) => tables.0.insert(s.id, t.to_vec()),
                        None => tables.0.remove(&s.id),
                    };
                }
                for (id, _) in results {
                    if engine.requests.contains_key(&id) && rng.chance(10) {
                        engine.end(&mut sched, id, false);
                        tables.0.remove(&id);
                    }
                }
            }
            n if !tracked.is_empty() => {
                let id = tracked[rng.below(tracked.len())];
                engine.end(&mut sched, id, n >= 87);
                tables.0.remove(&id);
            }
            _ => {}
        }
        if let Err(e) = sched.check_invariants() {
            panic!("seed {seed}: {e}");
        }
    }
    // Drain: everything left completes with the oracle's output.
    let mut num_steps = 0;
    while {
        if speculative {
            engine.propose(&mut sched, &mut rng);
        }
        engine.step(&mut sched)
    } {
        sched.check_invariants().unwrap();
        num_steps += 1;
        assert!(num_steps < 10_000, "seed {seed}: no progress");
    }
    assert!(engine.requests.is_empty() && !sched.has_unfinished_requests());
    let stats = sched.stats();
    assert_eq!(stats.num_blocks_used, 0, "seed {seed}: blocks leaked");
    assert_eq!(
        sched.kv_manager().pool().num_free_blocks(),
        stats.num_blocks_total
    );
    assert_eq!(stats.num_finished + stats.num_cancelled, num_accepted);
    stats
}

#[test]
fn random_sessions_keep_every_invariant() {
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..2000 {
        let stats = random_session(seed, 200);
        drafted += stats.num_draft_tokens;
        accepted += stats.num_accepted_draft_tokens;
    }
    // Speculative sessions verified drafts, accepting some and rejecting some.
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted} drafts accepted"
    );
}

/// 32 requests with shared system prompts through a pool that holds about 4 at
/// their longest. Returns every output and the plan of every step.
fn overload(
    seed: u64,
) -> (
    BTreeMap<RequestId, Vec<TokenId>>,
    Vec<SchedulerOutput>,
    Scheduler,
) {
    let mut rng = Rng::new(seed);
    let mut kv_cache = KvCacheSpec::uniform(2);
    kv_cache.block_size = 16;
    // The longest request: 48 + 60 prompt tokens and 64 generated, 11 blocks.
    let mut config = SchedulerConfig::new(kv_cache, 44, 4096);
    config.max_num_batched_tokens = 128;
    config.max_num_seqs = 16;
    config.max_waiting = 64;
    let mut sched = Scheduler::new(config).unwrap();
    let systems: Vec<Vec<TokenId>> = (0..2).map(|_| random_tokens(&mut rng, 48, 1000)).collect();
    let mut engine = SimEngine::default();
    for id in 0..32 {
        let mut prompt = match rng.below(10) {
            0..=4 => systems[0].clone(),
            5..=7 => systems[1].clone(),
            _ => Vec::new(),
        };
        let suffix_len = rng.range(8, 60);
        prompt.extend(random_tokens(&mut rng, suffix_len, 1000));
        let request = Request::new(RequestId(id), prompt, rng.range(16, 64));
        assert!(engine.submit(&mut sched, request));
    }
    let mut plans = Vec::new();
    let mut tables = TableLog::default();
    loop {
        let output = sched.schedule().unwrap();
        if output.is_empty() {
            break;
        }
        tables.observe(&output);
        let results = engine.run_model(&sched, &output);
        engine.apply(&mut sched, &results);
        sched.check_invariants().unwrap();
        plans.push(output);
        assert!(plans.len() < 20_000, "no progress");
    }
    (engine.completed, plans, sched)
}

#[test]
fn thirty_two_requests_complete_through_a_pool_for_four() {
    let (outputs, plans, sched) = overload(7);
    // Every request finished at max_tokens with the output it has alone (the
    // simulated engine checks each against the oracle as it finishes).
    assert_eq!(outputs.len(), 32);
    let stats = sched.stats();
    assert!(
        stats.num_preemptions > 0,
        "the pool was never short: {stats:?}"
    );
    assert!(
        stats.prefix_cache.num_hit_tokens > 0,
        "no prefix hits: {stats:?}"
    );
    assert_eq!(stats.num_blocks_used, 0);
    assert_eq!(stats.num_finished, 32);
    assert!(plans.iter().all(|p| p.num_batched_tokens <= 128));
    assert!(plans.iter().all(|p| p.scheduled.len() <= 16));
    // Some step mixed a prompt chunk with decodes.
    assert!(plans.iter().any(|p| {
        p.scheduled.iter().any(|s| s.num_new_tokens > 1)
            && p.scheduled
                .iter()
                .any(|s| s.num_new_tokens == 1 && s.num_computed_tokens > 0)
    }));
}

#[test]
fn same_inputs_give_the_same_schedule() {
    let (outputs_a, plans_a, sched_a) = overload(11);
    let (outputs_b, plans_b, sched_b) = overload(11);
    assert_eq!(outputs_a, outputs_b);
    assert_eq!(plans_a, plans_b);
    assert_eq!(sched_a.stats(), sched_b.stats());
}
