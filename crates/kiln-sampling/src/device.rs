//! One step's sampling data for a backend that samples where the logits are.
//!
//! [`crate::Sampler::device_step`] fills a [`DeviceStep`] without touching logits;
//! the backend applies it as documented in [`crate::sampler`] (its *device order*
//! section), and [`crate::Sampler::finish_device_step`] then consumes the random
//! number the device used.

/// Everything a device sampler needs for one step of one request, as plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceStep {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 is off (also when the request's `top_k` covers the vocabulary).
    pub top_k: u32,
    /// 1 is off.
    pub top_p: f32,
    /// 0 is off.
    pub min_p: f32,
    /// The draw's uniform number in `[0, 1)`, exactly the one the host draw would
    /// use; 0 when greedy.
    pub u: f64,
    /// `(token, bias)`, distinct tokens; -100 bans.
    pub logit_bias: Vec<(u32, f32)>,
    /// The repetition penalty (1 is off).
    pub repetition_penalty: f32,
    /// The frequency penalty (0 is off).
    pub frequency_penalty: f32,
    /// The presence penalty (0 is off).
    pub presence_penalty: f32,
    /// `(token, generated_count, in_prompt)` for every distinct token a penalty
    /// applies to, sorted by token; empty when every penalty is off.
    pub penalties: Vec<(u32, u32, bool)>,
    /// How many top alternatives to return (0 to 20).
    pub top_logprobs: u32,
}

#[cfg(test)]
mod tests {
    use crate::{History, Sampler, SamplingParams, TokenId};

    fn ids(raw: &[u32]) -> Vec<TokenId> {
        raw.iter().copied().map(TokenId).collect()
    }

    fn sampler(params: SamplingParams, vocab: usize) -> Sampler {
        Sampler::new(params, vocab, 1).expect("valid params")
    }

    /// The token the device rule picks for `u`: the first in id order whose
    /// running weight exceeds `u * Σ w` (no truncation, temperature 1).
    fn id_order_draw(logits: &[f32], u: f64) -> u32 {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let w: Vec<f64> = logits.iter().map(|&l| f64::from((l - max).exp())).collect();
        let target = u * w.iter().sum::<f64>();
        let mut sum = 0.0;
        for (id, &x) in w.iter().enumerate() {
            sum += x;
            if sum > target {
                return id as u32;
            }
        }
        unreachable!("u < 1")
    }

    #[test]
    fn device_steps_consume_the_rng_as_host_samples_do() {
        let logits = [0.3f32, 1.0, -0.5, 0.8, 0.0, 0.2];
        let params = SamplingParams {
            seed: Some(99),
            ..SamplingParams::default()
        };
        // Host steps and device steps interleaved in any pattern leave the RNG
        // where the same number of host steps would: the next host sample agrees.
        let mut host = sampler(params.clone(), 6);
        let mut mixed = sampler(params.clone(), 6);
        let none = History::default();
        for step in 0..40 {
            let h = host.sample(&mut logits.to_vec(), &none).expect("sample");
            if step % 3 == 0 {
                let m = mixed.sample(&mut logits.to_vec(), &none).expect("sample");
                assert_eq!(h, m);
            } else {
                let d = mixed.device_step(&none).expect("device step");
                // Reading twice (a fallback) does not consume.
                assert_eq!(mixed.device_step(&none).expect("device step").u, d.u);
                mixed.finish_device_step();
                assert!((0.0..1.0).contains(&d.u));
            }
        }
        let h = host.sample(&mut logits.to_vec(), &none).expect("sample");
        let m = mixed.sample(&mut logits.to_vec(), &none).expect("sample");
        assert_eq!(h, m);
        // The device's u is the host draw's: with one candidate set and the id
        // order, the host's own draw from a sampler that consumed nothing
        // matches whenever the held order is the id order (no truncation).
        let mut a = sampler(params.clone(), 6);
        let mut b = sampler(params, 6);
        for _ in 0..50 {
            let d = a.device_step(&none).expect("device step");
            a.finish_device_step();
            let h = b.sample(&mut logits.to_vec(), &none).expect("sample");
            assert_eq!(id_order_draw(&logits, d.u), h.token.0);
        }
    }

    #[test]
    fn greedy_device_steps_draw_nothing() {
        let mut s = sampler(
            SamplingParams {
                seed: Some(5),
                ..SamplingParams::greedy()
            },
            4,
        );
        let d = s.device_step(&History::default()).expect("device step");
        assert_eq!((d.temperature, d.u), (0.0, 0.0));
        s.finish_device_step();
        let mut reference = sampler(
            SamplingParams {
                seed: Some(5),
                ..SamplingParams::greedy()
            },
            4,
        );
        let mut row = vec![0.0, 1.0, 0.5, 0.0];
        assert_eq!(
            s.sample(&mut row.clone(), &History::default()),
            reference.sample(&mut row, &History::default())
        );
    }

    #[test]
    fn penalty_entries_follow_the_history_through_rollbacks() {
        let params = SamplingParams {
            repetition_penalty: 1.5,
            frequency_penalty: 0.5,
            logit_bias: vec![(TokenId(2), -100.0)],
            top_k: 3,
            logprobs: Some(2),
            ..SamplingParams::default()
        };
        let mut s = sampler(params, 8);
        let prompt = ids(&[5, 1, 5]);
        let generated = ids(&[1, 3, 3, 7]);
        let d = s
            .device_step(&History::new(&prompt, &generated))
            .expect("device step");
        assert_eq!(
            d.penalties,
            [(1, 1, true), (3, 2, false), (5, 0, true), (7, 1, false)]
        );
        assert_eq!(d.logit_bias, [(2, -100.0)]);
        assert_eq!((d.top_k, d.top_logprobs), (3, 2));
        // A rollback to two tokens, then a different continuation.
        let rolled = ids(&[1, 3, 6]);
        let d = s
            .device_step(&History::new(&prompt, &rolled[..2]))
            .expect("device step");
        assert_eq!(d.penalties, [(1, 1, true), (3, 1, false), (5, 0, true)]);
        let d = s
            .device_step(&History::new(&prompt, &rolled))
            .expect("device step");
        assert_eq!(
            d.penalties,
            [(1, 1, true), (3, 1, false), (5, 0, true), (6, 1, false)]
        );
        // Without the repetition penalty, prompt-only tokens are left out.
        let mut f = sampler(
            SamplingParams {
                presence_penalty: 1.0,
                top_k: 8,
                ..SamplingParams::default()
            },
            8,
        );
        let d = f
            .device_step(&History::new(&prompt, &generated))
            .expect("device step");
        assert_eq!(d.penalties, [(1, 1, true), (3, 2, false), (7, 1, false)]);
        assert_eq!(d.top_k, 0, "a top_k covering the vocabulary is off");
        // No penalties: no entries, and out-of-vocabulary history is not read.
        let mut plain = sampler(SamplingParams::default(), 8);
        let d = plain
            .device_step(&History::new(&ids(&[99]), &[]))
            .expect("device step");
        assert!(d.penalties.is_empty());
        assert!(f.device_step(&History::new(&ids(&[99]), &[])).is_err());
    }
}
