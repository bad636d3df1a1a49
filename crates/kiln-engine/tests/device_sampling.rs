//! The engine's device-sampling path on the real SmolLM2, through a test
//! double: the CPU backend with a host `sample_rows` in the device
//! sampler's semantics (kiln-sampling's *device order*: the first survivor
//! by id whose running weight exceeds `u · Σw`). Where the draw is forced
//! (top_k 1) the device path gives exactly the host path's tokens,
//! logprobs and alternatives, penalties and bias included; seeded requests
//! repeat; a constrained request sampled at temperature 0.8 on the device
//! parses.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel};
use kiln_sampling::{Sampled, SamplingParams, TokenId};
use kiln_structured::Format;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::{
    Activation, AttentionParams, Backend, BlockPart, BlockWeight, ForwardBatch, KvCache,
    KvPoolShape, Memory, Ops, QuantMatrix, Result, RopeParams, SampleRow, SampledRow, Sampling,
    StepRecording, Tensor, Weight, WeightKind,
};
use serde_json::{json, Value};

/// The CPU backend, sampling "on the device" (counting the calls).
struct DeviceSampling(CpuBackend, AtomicUsize);

/// One row as the device sampler does it, on the host.
fn sample_host(row: &[f32], p: &SampleRow<'_>) -> Option<SampledRow> {
    let mut l = row.to_vec();
    if let Some(m) = p.mask {
        for (i, x) in l.iter_mut().enumerate() {
            if m.get(i / 32).is_none_or(|w| (w >> (i % 32)) & 1 == 0) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    for &(t, b) in p.logit_bias {
        let x = &mut l[t as usize];
        *x = if b <= -100.0 {
            f32::NEG_INFINITY
        } else {
            *x + b
        };
    }
    let (r, f, pr) = (
        p.repetition_penalty,
        p.frequency_penalty,
        p.presence_penalty,
    );
    for &(t, count, in_prompt) in p.penalties {
        let x = &mut l[t as usize];
        if r != 1.0 && (in_prompt || count > 0) {
            *x = if *x > 0.0 { *x / r } else { *x * r };
        }
        if (f != 0.0 || pr != 0.0) && count > 0 {
            *x -= f * count as f32;
            *x -= pr;
        }
    }
    for x in &mut l {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
    }
    let desc = |v: &[f32]| {
        let v = v.to_vec();
        move |a: &u32, b: &u32| {
            v[*b as usize]
                .partial_cmp(&v[*a as usize])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(b))
        }
    };
    let mut order: Vec<u32> = (0..l.len() as u32)
        .filter(|&i| l[i as usize] > f32::NEG_INFINITY)
        .collect();
    order.sort_by(desc(&l));
    let max = l[*order.first()? as usize];
    let z: f64 = order
        .iter()
        .map(|&i| f64::from((l[i as usize] - max).exp()))
        .sum();
    let log_z = f64::from(max) + z.ln();
    let lp = |i: u32| (f64::from(l[i as usize]) - log_z) as f32;
    let top = order
        .iter()
        .take(p.top_logprobs as usize)
        .map(|&i| (i, lp(i)))
        .collect();
    let token = if p.temperature == 0.0 {
        order[0]
    } else {
        let mut kept = order;
        if p.top_k > 0 {
            kept.truncate(p.top_k as usize);
        }
        let w: Vec<f32> = l
            .iter()
            .map(|&x| ((x - max) / p.temperature).exp())
            .collect();
        if p.top_p < 1.0 {
            kept.sort_by(desc(&w));
            let total: f64 = kept.iter().map(|&i| f64::from(w[i as usize])).sum();
            let target = f64::from(p.top_p) * total;
            let mut mass = 0.0;
            let n = kept
                .iter()
                .position(|&i| {
                    let stop = mass >= target;
                    mass += f64::from(w[i as usize]);
                    stop
                })
                .unwrap_or(kept.len());
            kept.truncate(n);
        }
        kept.retain(|&i| w[i as usize] >= p.min_p);
        kept.sort_unstable();
        let total: f64 = kept.iter().map(|&i| f64::from(w[i as usize])).sum();
        let mut run = 0.0;
        *kept
            .iter()
            .find(|&&i| {
                run += f64::from(w[i as usize]);
                w[i as usize] > 0.0 && run > p.u * total
            })
            .or(kept.last())?
    };
    Some(SampledRow {
        token,
        logprob: lp(token),
        top,
    })
}

impl Backend for DeviceSampling {
    fn name(&self) -> &'static str {
        self.0.name()
    }
}

/// The CPU's memory (the defaults are the CPU's sizes).
impl Memory for DeviceSampling {
    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        self.0.upload(shape, data)
    }

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        self.0.to_host(t)
    }

    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache> {
        self.0.alloc_kv_cache(spec)
    }

    // The CPU's block weights, so both runs multiply the same stored form.
    fn supports_weight(&self, kind: WeightKind) -> bool {
        self.0.supports_weight(kind)
    }

    fn upload_blocks(&self, m: QuantMatrix) -> Result<BlockPart> {
        self.0.upload_blocks(m)
    }
}

/// The CPU's basic ops; `matmul` and `qkv_attention` are the defaults the
/// CPU uses too.
impl Ops for DeviceSampling {
    fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        self.0.embedding(table, ids)
    }

    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.0.matmul_dense(x, w, bias)
    }

    fn matmul_blocks(&self, x: &Tensor, w: &BlockWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        self.0.matmul_blocks(x, w, bias)
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor> {
        self.0.rms_norm(x, w, eps, weight_offset)
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.0.add(a, b)
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        self.0.scale(x, s)
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        self.0.gated_activation(gate, up, act)
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        self.0.rope(x, positions, p)
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        self.0.attention(q, k, v, cache, layer, batch, p)
    }

    fn attention_shared(
        &self,
        q: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        self.0.attention_shared(q, cache, layer, batch, p)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        self.0.gather_rows(x, rows)
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        self.0.split_cols(x, widths)
    }
}

/// The one part this double changes: sampling "on the device".
impl Sampling for DeviceSampling {
    fn argmax_rows(&self, logits: &Tensor) -> Result<Option<Vec<(u32, f32)>>> {
        self.0.argmax_rows(logits)
    }

    fn argmax_rows_masked(
        &self,
        logits: &Tensor,
        masks: &[Option<&[u32]>],
    ) -> Result<Option<Vec<(u32, f32)>>> {
        self.0.argmax_rows_masked(logits, masks)
    }

    fn sample_rows(
        &self,
        logits: &Tensor,
        rows: &[SampleRow<'_>],
    ) -> Result<Option<Vec<Option<SampledRow>>>> {
        self.1.fetch_add(1, Ordering::Relaxed);
        let (_, vocab) = logits.dims2("sample_rows")?;
        let host = self.0.to_host(logits)?;
        Ok(Some(
            host.chunks(vocab)
                .zip(rows)
                .map(|(l, p)| sample_host(l, p))
                .collect(),
        ))
    }
}

impl StepRecording for DeviceSampling {}
impl kiln_tensor::Collectives for DeviceSampling {}

fn load(device: bool) -> (LoadedModel, Option<Arc<DeviceSampling>>) {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    if device {
        let b = Arc::new(DeviceSampling(CpuBackend::new(), AtomicUsize::new(0)));
        (LoadedModel::load(&p, b.clone()).unwrap(), Some(b))
    } else {
        (
            LoadedModel::load(&p, Arc::new(CpuBackend::new())).unwrap(),
            None,
        )
    }
}

fn engine(model: LoadedModel) -> Engine {
    Engine::start(
        model,
        EngineConfig {
            block_size: 16,
            num_blocks: 256,
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_waiting: 16,
            context_length: None,
        },
    )
    .unwrap()
}

fn prompt(m: &LoadedModel, text: &str) -> Vec<u32> {
    let rendered = m
        .render_chat(&json!([{"role": "user", "content": text}]), true)
        .unwrap();
    m.tokenizer.encode(&rendered, false).unwrap()
}

/// Token ids, text and logprobs of a finished request.
fn run(stream: kiln_engine::RequestStream) -> (Vec<u32>, String, Vec<Sampled>) {
    let (mut ids, mut text, mut lps) = (Vec::new(), String::new(), Vec::new());
    for ev in stream {
        match ev {
            Event::Token {
                token_id,
                text: t,
                logprobs,
            } => {
                if token_id != u32::MAX {
                    ids.push(token_id);
                }
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Event::Finished { .. } => return (ids, text, lps),
            Event::Failed { message, .. } => panic!("request failed: {message}"),
            Event::Progress => {}
        }
    }
    panic!("no Finished event")
}

/// The requests of one run: a forced draw with every processor on, a
/// greedy neighbour, and a seeded top-p request.
fn requests(m: &LoadedModel) -> Vec<GenerationRequest> {
    let forced = SamplingParams {
        temperature: 0.7,
        top_k: 1,
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.2,
        logit_bias: vec![(TokenId(13), 2.0), (TokenId(28), -100.0)],
        logprobs: Some(3),
        seed: Some(7),
        max_tokens: Some(16),
        ..SamplingParams::default()
    };
    let greedy = SamplingParams {
        max_tokens: Some(16),
        ..SamplingParams::greedy()
    };
    let nucleus = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        min_p: 0.02,
        seed: Some(3),
        max_tokens: Some(16),
        ..SamplingParams::default()
    };
    vec![
        GenerationRequest::new(prompt(m, "Tell me about the sea."), forced),
        GenerationRequest::new(prompt(m, "What is a prime number?"), greedy),
        GenerationRequest::new(prompt(m, "Name a colour."), nucleus),
    ]
}

fn run_all(e: &Engine, reqs: &[GenerationRequest]) -> Vec<(Vec<u32>, String, Vec<Sampled>)> {
    let h = e.handle();
    let streams: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
    streams.into_iter().map(run).collect()
}

#[test]
fn device_sampling_matches_the_host_where_the_draw_is_forced_and_repeats() {
    let (host_model, _) = load(false);
    let reqs = requests(&host_model);
    let host = run_all(&engine(host_model), &reqs);
    let (dev_model, backend) = load(true);
    let e = engine(dev_model);
    let dev = run_all(&e, &reqs);
    let calls = backend.as_ref().map_or(0, |b| b.1.load(Ordering::Relaxed));
    assert!(calls > 0, "the device sampler ran");
    // Forced draw and greedy: exactly the host path's tokens and logprobs.
    for i in 0..2 {
        assert_eq!(dev[i].0, host[i].0, "request {i}");
        assert_eq!(dev[i].1, host[i].1, "request {i}");
        assert_eq!(dev[i].2.len(), host[i].2.len(), "request {i}");
        for (d, h) in dev[i].2.iter().zip(&host[i].2) {
            assert_eq!(d.token, h.token);
            assert!((d.logprob - h.logprob).abs() < 1e-5, "{d:?} vs {h:?}");
            assert_eq!(d.top.len(), 3);
            for (a, b) in d.top.iter().zip(&h.top) {
                assert_eq!(a.0, b.0);
                assert!((a.1 - b.1).abs() < 1e-5, "{d:?} vs {h:?}");
            }
        }
    }
    assert!(!dev[0].0.contains(&28), "the banned token never comes");
    // A seeded request repeats on the device, alone or batched.
    let again = run_all(&e, &reqs[2..]);
    assert_eq!(again[0].0, dev[2].0);
}

#[test]
fn constrained_rows_sample_on_the_device_under_their_mask() {
    let (model, backend) = load(true);
    let p = prompt(&model, "Describe a cat as JSON with its name and age.");
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 30}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let e = engine(model);
    let req = GenerationRequest {
        format: Some(Format::JsonSchema(schema)),
        ..GenerationRequest::new(
            p,
            SamplingParams {
                temperature: 0.8,
                top_k: 20,
                seed: Some(11),
                max_tokens: Some(60),
                ..SamplingParams::default()
            },
        )
    };
    let (_, text, _) = run(e.handle().submit(req).unwrap());
    let calls = backend.as_ref().map_or(0, |b| b.1.load(Ordering::Relaxed));
    assert!(calls > 0, "the device sampler ran");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|err| panic!("{err}: {text:?}"));
    assert!(v["name"].is_string() && v["age"].is_i64(), "{v}");
}
