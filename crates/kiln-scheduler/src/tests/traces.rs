//! Trace tests: scripts of scheduler calls and the transcript each must produce.
//! The format is described in `harness.rs`; `step` samples token `500 + id`.

use super::harness::check;
use crate::{ConfigError, KvCacheSpec, LayerGroup, LayerKind, Scheduler, SchedulerConfig};

#[test]
fn speculative_decodes_keep_the_accepted_drafts_and_give_back_the_rest() {
    check(
        "
        config blocks=8 block_size=4 budget=16
        submit 1 prompt=0..6 max=10
        step
        # Five drafts after token 501: positions 6..12, one more block.
        propose 1 7,8,9,10,11
        schedule
        table 1
        # Two drafts confirmed, the third sampled differently: 501, 7, 8 are
        # computed, 99 is the next token, the block past position 11 goes back.
        update 1:7,8,99
        table 1
        free
        # Four of five confirmed (max_tokens 10 leaves room for five drafts).
        propose 1 3,4,5,6,7,8,9
        schedule
        update 1:3,4,5,6,60
        table 1
        # A request that is not decoding ignores proposals.
        submit 2 prompt=0..3 max=2
        propose 2 1,2
        step
        stats
        ",
        "
        submit r1: ok
        step: r1 0+6 [0 1] logits | batched 6
        propose r1: ok
        schedule: r1 6+1+d5 [0 1 2] logits | batched 6
        table r1: [0 1 2] computed=12
        update: ok
        table r1: [0 1 2] computed=9
        free: 3 4 5 6 7
        propose r1: ok
        schedule: r1 9+1+d5 [0 1 2 3] logits | batched 6
        update: ok
        table r1: [0 1 2 3] computed=14
        submit r2: ok
        propose r2: ok
        step: r1 14+1 [0 1 2 3] logits, r2 0+3 [4] logits | batched 4 | finished r1 prompt=6 cached=0 output=10
        stats: waiting=0 running=1 used=1/8 cached=3 lookups=2 queried=9 hit_blocks=0 hit_tokens=0 collisions=0 evictions=0 preemptions=0 prompt=9 generated=11 finished=1 cancelled=0 drafts=10 accepted=6
        ",
    );
}

#[test]
fn prefix_hit_on_a_finished_request_and_last_token_recompute() {
    check(
        "
        config blocks=8 block_size=4
        submit 1 prompt=0..10 max=2
        step
        step
        free
        # Shares the first two full blocks (8 tokens) with request 1.
        submit 2 prompt=0..8,50,51 max=2
        # Its whole prompt is cached, but the last token is recomputed for logits,
        # so only the first full block counts.
        submit 3 prompt=0..8 max=1
        step
        free
        finish 2
        free
        stats
        ",
        "
        submit r1: ok
        step: r1 0+10 [0 1 2] logits | batched 10
        step: r1 10+1 [0 1 2] logits | batched 1 | finished r1 prompt=10 cached=0 output=2
        free: 2 3 4 5 6 7 1* 0*
        submit r2: ok
        submit r3: ok
        step: r2 8+2 [0 1 2] logits, r3 4+4 [0 3] logits | batched 6 | finished r3 prompt=8 cached=4 output=1
        free: 3 4 5 6 7
        finish r2: prompt=10 cached=8 output=1
        free: 2 3 4 5 6 7 1* 0*
        stats: waiting=0 running=0 used=0/8 cached=2 lookups=3 queried=28 hit_blocks=3 hit_tokens=12 collisions=0 evictions=0 preemptions=0 prompt=28 generated=4 finished=3 cancelled=0
        ",
    );
}

#[test]
fn generated_blocks_are_cached_for_the_next_turn() {
    check(
        "
        config block_size=4
        submit 1 prompt=0..6 max=4
        run
        # The next turn resends prompt + output + new tokens: the block holding
        # generated tokens hits too.
        submit 2 prompt=0..6,501,501,501,501,7,8 max=1
        step
        ",
        "
        submit r1: ok
        run: 4 steps; finished r1 prompt=6 cached=0 output=4
        submit r2: ok
        step: r2 8+4 [0 1 2] logits | batched 4 | finished r2 prompt=12 cached=8 output=1
        ",
    );
}

#[test]
fn a_hash_collision_is_a_miss() {
    // The weak hash ignores token ids, so block 0 of every unsalted prompt collides.
    check(
        "
        config blocks=8 block_size=4 hash=weak
        submit 1 prompt=0..8 max=1
        step
        submit 2 prompt=100..108 max=1
        step
        free
        submit 3 prompt=0..8,9 max=1
        step
        stats
        ",
        "
        submit r1: ok
        step: r1 0+8 [0 1] logits | batched 8 | finished r1 prompt=8 cached=0 output=1
        submit r2: ok
        step: r2 0+8 [2 3] logits | batched 8 | finished r2 prompt=8 cached=0 output=1
        free: 2 3 4 5 6 7 1* 0*
        submit r3: ok
        step: r3 8+1 [0 1 2] logits | batched 1 | finished r3 prompt=9 cached=8 output=1
        stats: waiting=0 running=0 used=0/8 cached=2 lookups=3 queried=25 hit_blocks=2 hit_tokens=8 collisions=1 evictions=0 preemptions=0 prompt=25 generated=3 finished=3 cancelled=0
        ",
    );
}

#[test]
fn eviction_is_lru_and_tail_first() {
    check(
        "
        config blocks=6 block_size=2
        submit 1 prompt=0..6 max=1
        step
        submit 2 prompt=10..16 max=1
        step
        # Request 1's blocks were freed first (least recently used), tail first.
        free
        submit 3 prompt=20..24 max=1
        step
        free
        # Request 1's head block survived; its middle block was evicted.
        submit 4 prompt=0..6 max=1
        step
        stats
        ",
        "
        submit r1: ok
        step: r1 0+6 [0 1 2] logits | batched 6 | finished r1 prompt=6 cached=0 output=1
        submit r2: ok
        step: r2 0+6 [3 4 5] logits | batched 6 | finished r2 prompt=6 cached=0 output=1
        free: 2* 1* 0* 5* 4* 3*
        submit r3: ok
        step: r3 0+4 [2 1] logits | batched 4 | finished r3 prompt=4 cached=0 output=1
        free: 0* 5* 4* 3* 1* 2*
        submit r4: ok
        step: r4 2+4 [0 5 4] logits | batched 4 | finished r4 prompt=6 cached=2 output=1
        stats: waiting=0 running=0 used=0/6 cached=6 lookups=4 queried=22 hit_blocks=1 hit_tokens=2 collisions=0 evictions=4 preemptions=0 prompt=22 generated=4 finished=4 cancelled=0
        ",
    );
}

#[test]
fn chunked_prefill_mixes_with_decodes_under_the_budget() {
    check(
        "
        config blocks=32 block_size=4 budget=8
        submit 1 prompt=0..3 max=5
        submit 2 prompt=100..120 max=2
        step
        step
        submit 3 prompt=200..230 max=1
        # Decodes first, then the running prefill; request 3 waits for budget.
        step
        step
        step
        run
        ",
        "
        submit r1: ok
        submit r2: ok
        step: r1 0+3 [0] logits, r2 0+5 [1 2] | batched 8
        step: r1 3+1 [0] logits, r2 5+7 [1 2 3] | batched 8
        submit r3: ok
        step: r1 4+1 [0 4] logits, r2 12+7 [1 2 3 5 6] | batched 8
        step: r1 5+1 [0 4] logits, r2 19+1 [1 2 3 5 6] logits, r3 0+6 [7 8] | batched 8
        step: r1 6+1 [0 4] logits, r2 20+1 [1 2 3 5 6 9] logits, r3 6+6 [7 8 10] | batched 8 | finished r1 prompt=3 cached=0 output=5, r2 prompt=20 cached=0 output=2
        run: 3 steps; finished r3 prompt=30 cached=0 output=1
        ",
    );
}

#[test]
fn preemption_when_blocks_run_out_then_completion() {
    check(
        "
        config blocks=6 block_size=2 budget=16
        submit 1 prompt=0..4 max=6
        submit 2 prompt=10..14 max=6
        step
        step
        step
        # Request 1 needs a fourth block: request 2, the newest, is preempted.
        step
        table 2
        # Request 2 cannot come back yet: its cached head needs room to grow.
        step
        step
        step
        run
        stats
        ",
        "
        submit r1: ok
        submit r2: ok
        step: r1 0+4 [0 1] logits, r2 0+4 [2 3] logits | batched 8
        step: r1 4+1 [0 1 4] logits, r2 4+1 [2 3 5] logits | batched 2
        step: r1 5+1 [0 1 4] logits, r2 5+1 [2 3 5] logits | batched 2
        step: r1 6+1 [0 1 4 5] logits | preempted r2 | batched 1
        table r2: none (Waiting)
        step: r1 7+1 [0 1 4 5] logits | batched 1
        step: r1 8+1 [0 1 4 5 3] logits | batched 1 | finished r1 prompt=4 cached=0 output=6
        step: r2 2+5 [2 3 5 4] logits | batched 5
        run: 2 steps; finished r2 prompt=4 cached=0 output=6 preempted=1
        stats: waiting=0 running=0 used=0/6 cached=5 lookups=3 queried=15 hit_blocks=1 hit_tokens=2 collisions=0 evictions=5 preemptions=1 prompt=8 generated=12 finished=2 cancelled=0
        ",
    );
}

#[test]
fn priority_classes_order_admission_and_preemption() {
    check(
        "
        config blocks=16 block_size=4 budget=8
        submit 1 prompt=0..8 max=1 prio=1
        submit 2 prompt=10..18 max=1
        submit 3 prompt=20..28 max=1
        step
        step
        step
        ",
        "
        submit r1: ok
        submit r2: ok
        submit r3: ok
        step: r2 0+8 [0 1] logits | batched 8 | finished r2 prompt=8 cached=0 output=1
        step: r3 0+8 [2 3] logits | batched 8 | finished r3 prompt=8 cached=0 output=1
        step: r1 0+8 [4 5] logits | batched 8 | finished r1 prompt=8 cached=0 output=1
        ",
    );
    // The victim is the least urgent request even though it is older.
    check(
        "
        config blocks=4 block_size=2 budget=16
        submit 1 prompt=0..4 max=3 prio=5
        submit 2 prompt=10..14 max=3
        step
        step
        step
        step
        run
        ",
        "
        submit r1: ok
        submit r2: ok
        step: r2 0+4 [0 1] logits, r1 0+4 [2 3] logits | batched 8
        step: r2 4+1 [0 1 3] logits | preempted r1 | batched 1
        step: r2 5+1 [0 1 3] logits | batched 1 | finished r2 prompt=4 cached=0 output=3
        step: r1 2+3 [2 3 1] logits | batched 3
        run: 1 steps; finished r1 prompt=4 cached=0 output=3 preempted=1
        ",
    );
}

#[test]
fn cancel_frees_blocks_at_once() {
    check(
        "
        config blocks=8 block_size=4
        submit 1 prompt=0..10 max=5
        submit 2 prompt=20..30 max=5
        step
        cancel 1
        free
        # Cancelled while its step runs: the late result is ignored.
        schedule
        cancel 2
        update 2:7
        submit 3 prompt=0..3 max=1
        cancel 3
        cancel 3
        stats
        ",
        "
        submit r1: ok
        submit r2: ok
        step: r1 0+10 [0 1 2] logits, r2 0+10 [3 4 5] logits | batched 20
        cancel r1: prompt=10 cached=0 output=1
        free: 2 6 7 1* 0*
        schedule: r2 10+1 [3 4 5] logits | batched 1
        cancel r2: prompt=10 cached=0 output=1
        update: ok
        submit r3: ok
        cancel r3: prompt=3 cached=0 output=0
        cancel r3: error: request 3 is not waiting or running
        stats: waiting=0 running=0 used=0/8 cached=4 lookups=2 queried=20 hit_blocks=0 hit_tokens=0 collisions=0 evictions=0 preemptions=0 prompt=20 generated=2 finished=0 cancelled=3
        ",
    );
}

#[test]
fn admission_refuses_with_the_numbers() {
    check(
        "
        config blocks=4 block_size=4 max_len=20 waiting=2
        submit 1 prompt=0..15 max=6
        submit 2 prompt=0..15 max=5
        submit 3 prompt=0..12 max=5
        submit 4 prompt=0 max=1
        submit 5 prompt=0 max=1
        submit 6 prompt=0..30 max=1
        submit 3 prompt=0 max=1
        submit 7 prompt= max=1
        submit 7 prompt=1 max=0
        step
        submit 5 prompt=0 max=1
        ",
        "
        submit r1: error: the prompt has 15 tokens and max_tokens is 6, 21 in all, beyond the model's context of 20 tokens
        submit r2: error: the request needs up to 5 KV blocks but the pool has only 4; shorten the prompt or max_tokens
        submit r3: ok
        submit r4: ok
        submit r5: error: busy: 2 requests are waiting, the most allowed is 2
        submit r6: error: the prompt has 30 tokens and max_tokens is 1, 31 in all, beyond the model's context of 20 tokens
        submit r3: error: request 3 is already submitted
        submit r7: error: the prompt is empty
        submit r7: error: max_tokens must be at least 1
        step: r3 0+12 [0 1 2] logits, r4 0+1 [3] logits | batched 13 | finished r4 prompt=1 cached=0 output=1
        submit r5: ok
        ",
    );
}

#[test]
fn salts_and_adapters_keep_caches_apart() {
    check(
        "
        submit 1 prompt=0..9 max=1 salt=a
        step
        submit 2 prompt=0..9 max=1 salt=b
        submit 3 prompt=0..9 max=1
        submit 4 prompt=0..9 max=1 salt=a adapter=1
        submit 5 prompt=0..9 max=1 salt=a
        step
        ",
        "
        submit r1: ok
        step: r1 0+9 [0 1 2] logits | batched 9 | finished r1 prompt=9 cached=0 output=1
        submit r2: ok
        submit r3: ok
        submit r4: ok
        submit r5: ok
        step: r2 0+9 [2 3 4] logits, r3 0+9 [5 6 7] logits, r4 0+9 [8 9 10] logits, r5 8+1 [0 1 11] logits | batched 28 | finished r2 prompt=9 cached=0 output=1, r3 prompt=9 cached=0 output=1, r4 prompt=9 cached=0 output=1, r5 prompt=9 cached=8 output=1
        ",
    );
}

#[test]
fn running_requests_share_cached_blocks() {
    check(
        "
        config blocks=16 block_size=4
        submit 1 prompt=0..9 max=3
        step
        submit 2 prompt=0..9 max=3
        step
        finish 1
        table 2
        free
        run
        free
        ",
        "
        submit r1: ok
        step: r1 0+9 [0 1 2] logits | batched 9
        submit r2: ok
        step: r1 9+1 [0 1 2] logits, r2 8+1 [0 1 3] logits | batched 2
        finish r1: prompt=9 cached=0 output=2
        table r2: [0 1 3] computed=9
        free: 2 4 5 6 7 8 9 10 11 12 13 14 15
        run: 2 steps; finished r2 prompt=9 cached=8 output=3
        free: 3 2 4 5 6 7 8 9 10 11 12 13 14 15 1* 0*
        ",
    );
}

#[test]
fn the_step_protocol_is_enforced() {
    check(
        "
        config block_size=4 budget=3
        submit 1 prompt=0..5 max=2
        update
        schedule
        schedule
        update 1:9
        update 2:9
        update
        schedule
        update
        update 1:9 1:9
        update 1:9
        finish 1
        finish 1
        ",
        "
        submit r1: ok
        update: error: no step is in flight; call schedule first
        schedule: r1 0+3 [0] | batched 3
        schedule: error: a step is in flight; call update before scheduling the next one
        update: error: request 1 got 1 sampled tokens, expected 0
        update: error: request 2 was not scheduled in this step
        update: ok
        schedule: r1 3+2 [0 1] logits | batched 2
        update: error: request 1 got 0 sampled tokens, expected 1
        update: error: request 1 has more than one result in this step
        update: ok
        finish r1: prompt=5 cached=0 output=1
        finish r1: error: request 1 is not waiting or running
        ",
    );
}

#[test]
fn running_requests_are_capped() {
    check(
        "
        config seqs=2
        submit 1 prompt=0..2 max=2
        submit 2 prompt=10..12 max=2
        submit 3 prompt=20..22 max=2
        step
        step
        step
        ",
        "
        submit r1: ok
        submit r2: ok
        submit r3: ok
        step: r1 0+2 [0] logits, r2 0+2 [1] logits | batched 4
        step: r1 2+1 [0] logits, r2 2+1 [1] logits | batched 2 | finished r1 prompt=2 cached=0 output=2, r2 prompt=2 cached=0 output=2
        step: r3 0+2 [1] logits | batched 2
        ",
    );
}

#[test]
fn sliding_window_groups_free_blocks_that_leave_the_window_and_still_hit() {
    // A global group (two layers) and a sliding group of window 4 (one layer), blocks
    // of 4: each step, the sliding group frees the blocks before the next query's
    // window (`-`); a freed block stays cached, so the same prompt hits again (the
    // sliding group takes only the hit inside the window).
    check(
        "
        config block_size=4 window=4
        submit 1 prompt=0..10 max=6
        step
        table 1
        step
        table 1
        step
        step
        table 1
        step
        step
        stats
        submit 2 prompt=0..10 max=1
        step
        ",
        "
        submit r1: ok
        step: r1 0+10 [0 1 2] [3 4 5] logits | batched 10
        table r1: [0 1 2] [- 4 5] computed=10
        step: r1 10+1 [0 1 2] [- 4 5] logits | batched 1
        table r1: [0 1 2] [- - 5] computed=11
        step: r1 11+1 [0 1 2] [- - 5] logits | batched 1
        step: r1 12+1 [0 1 2 6] [- - 5 7] logits | batched 1
        table r1: [0 1 2 6] [- - 5 7] computed=13
        step: r1 13+1 [0 1 2 6] [- - 5 7] logits | batched 1
        step: r1 14+1 [0 1 2 6] [- - 5 7] logits | batched 1 | finished r1 prompt=10 cached=0 output=6
        stats: waiting=0 running=0 used=0/16 cached=6 lookups=1 queried=10 hit_blocks=0 hit_tokens=0 collisions=0 evictions=0 preemptions=0 prompt=10 generated=6 finished=1 cancelled=0
        submit r2: ok
        step: r2 8+2 [0 1 7] [- 4 6] logits | batched 2 | finished r2 prompt=10 cached=8 output=1
        ",
    );
}

#[test]
fn recurrent_state_slots_are_held_while_running_and_find_no_prefix() {
    use crate::{Request, RequestId, TokenId};
    let mut config = SchedulerConfig::new(KvCacheSpec::uniform(2), 16, 128);
    config.max_num_seqs = 2;
    // Fewer slots than running requests is refused.
    config.state_slots = 1;
    assert_eq!(
        Scheduler::new(config.clone()).unwrap_err(),
        ConfigError::TooFewStateSlots {
            state_slots: 1,
            max_num_seqs: 2
        }
    );
    config.state_slots = 2;
    let mut sched = Scheduler::new(config).unwrap();
    let prompt: Vec<TokenId> = (0..40).map(TokenId).collect();
    for id in 1..=3 {
        sched
            .submit(Request::new(RequestId(id), prompt.clone(), 2))
            .unwrap();
    }
    let results = |out: &crate::SchedulerOutput| -> Vec<(RequestId, Vec<TokenId>)> {
        out.scheduled
            .iter()
            .filter(|s| s.wants_logits)
            .map(|s| (s.id, vec![TokenId(7)]))
            .collect()
    };
    // Two run, each on its own slot; the third waits for one.
    let out = sched.schedule().unwrap();
    let slots: Vec<_> = out
        .scheduled
        .iter()
        .map(|s| (s.id.0, s.state_slot))
        .collect();
    assert_eq!(slots, [(1, Some(0)), (2, Some(1))]);
    sched.update(&results(&out)).unwrap();
    let out = sched.schedule().unwrap();
    assert!(out.scheduled.iter().all(|s| s.id.0 != 3));
    let done = sched.update(&results(&out)).unwrap().finished_by_length;
    assert_eq!(done.len(), 2);
    // Request 3 shares request 1's whole prompt, yet computes all of it (no
    // block holds its recurrent state), on a slot the finished ones gave back.
    let out = sched.schedule().unwrap();
    let s = &out.scheduled[0];
    assert_eq!((s.id.0, s.num_computed_tokens), (3, 0));
    assert!(matches!(s.state_slot, Some(0 | 1)));
    // Without state slots the same prompt hits the prefix cache.
    let mut sched = Scheduler::new(SchedulerConfig::new(KvCacheSpec::uniform(2), 16, 128)).unwrap();
    for id in 1..=2 {
        sched
            .submit(Request::new(RequestId(id), prompt.clone(), 1))
            .unwrap();
        let out = sched.schedule().unwrap();
        assert_eq!(out.scheduled[0].state_slot, None);
        assert_eq!(
            out.scheduled[0].num_computed_tokens,
            if id == 1 { 0 } else { 32 }
        );
        sched.update(&results(&out)).unwrap();
    }
}

#[test]
fn recurrent_groups_are_refused_in_a_kv_spec() {
    // Recurrent layers keep state slots, not blocks: a KV spec naming them is a bug.
    let mut kv_cache = KvCacheSpec::uniform(2);
    kv_cache.groups.push(LayerGroup {
        kind: LayerKind::Recurrent,
        num_layers: 2,
    });
    let err = Scheduler::new(SchedulerConfig::new(kv_cache, 16, 128)).unwrap_err();
    assert_eq!(
        err,
        ConfigError::UnsupportedLayerKind {
            group_idx: 1,
            kind: "recurrent state"
        }
    );
    let mut config = SchedulerConfig::new(KvCacheSpec::uniform(2), 16, 128);
    config.max_num_seqs = 0;
    assert_eq!(
        Scheduler::new(config).unwrap_err().to_string(),
        "`max_num_seqs` must be positive"
    );
}

#[test]
fn lent_blocks_are_outside_every_request_and_come_back_unregistered() {
    use crate::{Request, RequestId};
    use kiln_sampling::TokenId;
    let (spec, _) = KvCacheSpec::for_layers(&[LayerKind::FullAttention], 4);
    let mut s = Scheduler::new(SchedulerConfig::new(spec, 6, 64)).unwrap();
    let prompt: Vec<TokenId> = (0..8).map(TokenId).collect();
    s.submit(Request::new(RequestId(1), prompt.clone(), 2))
        .unwrap();
    let out = s.schedule().unwrap();
    let held: Vec<_> = out.scheduled[0].block_tables[0].blocks.clone();
    // While a step is in flight nothing is lent.
    assert!(s.lend_blocks(1).is_none());
    s.update(&[(RequestId(1), vec![TokenId(9)])]).unwrap();
    assert_eq!(s.kv_manager().pool().num_free_blocks(), 4);
    // All or nothing.
    assert!(s.lend_blocks(5).is_none());
    let lent = s.lend_blocks(4).unwrap();
    assert!(lent.iter().all(|b| !held.contains(b)));
    assert_eq!(s.kv_manager().pool().num_free_blocks(), 0);
    s.take_back_blocks(&lent);
    assert_eq!(s.kv_manager().pool().num_free_blocks(), 4);
    assert!(lent
        .iter()
        .all(|&b| s.kv_manager().pool().block_hash(b).is_none()));
    // The request goes on as before.
    let out = s.schedule().unwrap();
    assert_eq!(out.scheduled[0].block_tables[0].blocks[..2], held[..2]);
}

#[test]
fn speculative_decodes_with_recurrent_state_write_a_spare_slot() {
    use crate::{Request, RequestId, TokenId};
    let mut config = SchedulerConfig::new(KvCacheSpec::uniform(2), 64, 256);
    config.max_num_seqs = 2;
    config.state_slots = 2;
    let t = |v: &[u32]| v.iter().map(|&x| TokenId(x)).collect::<Vec<_>>();
    let prompt: Vec<TokenId> = (0..10).map(TokenId).collect();
    // Without spare slots a request with state ignores proposals.
    let mut sched = Scheduler::new(config.clone()).unwrap();
    sched
        .submit(Request::new(RequestId(1), prompt.clone(), 20))
        .unwrap();
    let out = sched.schedule().unwrap();
    sched.update(&[(RequestId(1), t(&[7]))]).unwrap();
    assert_eq!(out.scheduled[0].state_slot, Some(0));
    sched.propose(RequestId(1), t(&[20, 21]));
    assert_eq!(sched.schedule().unwrap().scheduled[0].num_draft_tokens, 0);
    // With one spare slot (slot 2, after the running ones).
    config.state_spare_slots = 1;
    let mut sched = Scheduler::new(config).unwrap();
    sched
        .submit(Request::new(RequestId(1), prompt, 20))
        .unwrap();
    sched.schedule().unwrap();
    sched.update(&[(RequestId(1), t(&[7]))]).unwrap();
    // Every draft accepted: the state written to the spare is the request's.
    sched.propose(RequestId(1), t(&[20, 21, 22]));
    let s = sched.schedule().unwrap().scheduled.remove(0);
    assert_eq!(
        (s.num_draft_tokens, s.state_slot, s.state_restore),
        (3, Some(2), Some(0))
    );
    sched
        .update(&[(RequestId(1), t(&[20, 21, 22, 55]))])
        .unwrap();
    assert_eq!(sched.request(RequestId(1)).unwrap().num_computed_tokens, 14);
    // One of three accepted: the state before the step (in slot 2) stays,
    // and the step's accepted tokens are computed again.
    sched.propose(RequestId(1), t(&[30, 31, 32]));
    let s = sched.schedule().unwrap().scheduled.remove(0);
    assert_eq!(
        (s.num_computed_tokens, s.state_slot, s.state_restore),
        (14, Some(0), Some(2))
    );
    sched.update(&[(RequestId(1), t(&[30, 99]))]).unwrap();
    assert_eq!(sched.request(RequestId(1)).unwrap().num_computed_tokens, 14);
    let s = sched.schedule().unwrap().scheduled.remove(0);
    assert_eq!(
        (
            s.num_computed_tokens,
            s.new_token_ids.clone(),
            s.state_slot,
            s.state_restore
        ),
        (14, t(&[55, 30, 99]), Some(2), None)
    );
    sched.update(&[(RequestId(1), t(&[5]))]).unwrap();
    // A second request takes the first's idle spare (none is free).
    sched
        .submit(Request::new(
            RequestId(2),
            (40..45).map(TokenId).collect(),
            20,
        ))
        .unwrap();
    let out = sched.schedule().unwrap();
    let results: Vec<_> = out.scheduled.iter().map(|s| (s.id, t(&[9]))).collect();
    sched.update(&results).unwrap();
    sched.propose(RequestId(2), t(&[1]));
    let out = sched.schedule().unwrap();
    let s2 = out.scheduled.iter().find(|s| s.id == RequestId(2)).unwrap();
    assert_eq!((s2.num_draft_tokens, s2.state_slot), (1, Some(0)));
    let results: Vec<_> = out
        .scheduled
        .iter()
        .map(|s| (s.id, t(&[1, 2][..1 + s.num_draft_tokens])))
        .collect();
    sched.update(&results).unwrap();
    sched.check_invariants().unwrap();
}
