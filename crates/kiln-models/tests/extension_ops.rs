//! The backend seam from a new backend's side: one that implements only the
//! basic ops runs a model (the unfused `matmul` and `qkv_attention`
//! defaults) with the CPU's logits bit for bit, and a model layer that needs
//! an extension op it lacks fails when it is built, at load, naming the op
//! and the backend. The CPU's soft-capping is checked against the formula.

use std::sync::Arc;

use kiln_models::layers::SoftCapping;
use kiln_models::random::{preset, RandomWeights};
use kiln_models::{load_model, ModelConfig, ModelError};
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::{
    Activation, AttentionParams, Backend, ForwardBatch, KvCache, KvPoolShape, Memory, Ops, Result,
    RopeParams, Sampling, StepRecording, Tensor, TensorError, Weight,
};

/// A backend with the basics only: the CPU's required methods, every
/// default left as it is, no extension ops.
struct Basics(CpuBackend);

impl Backend for Basics {
    fn name(&self) -> &'static str {
        "basics"
    }
}

impl Memory for Basics {
    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        self.0.upload(shape, data)
    }

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        self.0.to_host(t)
    }

    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache> {
        self.0.alloc_kv_cache(spec)
    }
}

impl Ops for Basics {
    fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        self.0.embedding(table, ids)
    }

    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.0.matmul_dense(x, w, bias)
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

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        self.0.gather_rows(x, rows)
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        self.0.split_cols(x, widths)
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
}

impl Sampling for Basics {}

impl StepRecording for Basics {}
impl kiln_tensor::Collectives for Basics {}

fn tiny() -> (ModelConfig, RandomWeights) {
    let mut c = preset("tiny").unwrap();
    c["vocab_size"] = 256.into();
    // Biases too, so that the bias epilogue is composed as well.
    c["attention_bias"] = true.into();
    let cfg = ModelConfig::from_hf(&c).unwrap();
    let weights = RandomWeights::new(&cfg, 7).unwrap();
    (cfg, weights)
}

#[test]
fn a_backend_of_basic_ops_runs_a_model_like_the_cpu_bit_for_bit() {
    let (cfg, weights) = tiny();
    let tokens: Vec<u32> = (0..11).map(|i| (i * 37 % cfg.vocab_size) as u32).collect();
    let logits = |b: Arc<dyn Backend>| -> Vec<f32> {
        let m = load_model(b.clone(), &weights, cfg.clone()).unwrap();
        let mut cache = m.kv_cache_for_tokens(11, 16).unwrap();
        // A prefill of ten tokens, then one decode step, every row's logits.
        let first = ForwardBatch::single(&tokens[..10], 0, &cache.spec, 0);
        let mut out = b.to_host(&m.forward(&first, &mut cache).unwrap()).unwrap();
        let next = ForwardBatch::single(&tokens[10..], 10, &cache.spec, 0);
        out.extend(b.to_host(&m.forward(&next, &mut cache).unwrap()).unwrap());
        out
    };
    let cpu = logits(Arc::new(CpuBackend::new()));
    let basics = logits(Arc::new(Basics(CpuBackend::new())));
    assert_eq!(cpu.len(), 11 * cfg.vocab_size);
    assert!(cpu.iter().all(|v| v.is_finite()));
    assert_eq!(
        cpu.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        basics.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn a_layer_whose_extension_op_the_backend_lacks_fails_at_load() {
    let err = SoftCapping::load(&Basics(CpuBackend::new()), 30.0)
        .err()
        .expect("the basics backend has no extension ops");
    let ModelError::Tensor(TensorError::Unsupported { backend, ref what }) = err else {
        panic!("not an unsupported-op error: {err}");
    };
    assert_eq!(backend, "basics");
    assert!(what.contains("`softcap`"), "{what}");
    let message = err.to_string();
    assert!(
        message.starts_with("the basics backend does not support the extension op `softcap`"),
        "{message}"
    );
    assert!(SoftCapping::load(&CpuBackend::new(), 30.0).is_ok());
}

#[test]
fn a_bidirectional_model_on_a_causal_only_backend_fails_at_load() {
    let mut config = serde_json::json!({
        "model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 50, "sliding_window": 4, "query_pre_attn_scalar": 16,
        "use_bidirectional_attention": true});
    let cfg = ModelConfig::from_hf(&config).unwrap();
    let w = RandomWeights::new(&cfg, 3).unwrap();
    let err = load_model(Arc::new(Basics(CpuBackend::new())), &w, cfg.clone())
        .err()
        .expect("the basics backend attends causally only");
    let message = err.to_string();
    assert!(message.contains("use_bidirectional_attention"), "{message}");
    assert!(message.contains("basics backend"), "{message}");
    assert!(load_model(Arc::new(CpuBackend::new()), &w, cfg).is_ok());
    // The causal model loads on it.
    config["use_bidirectional_attention"] = serde_json::json!(false);
    let cfg = ModelConfig::from_hf(&config).unwrap();
    let w = RandomWeights::new(&cfg, 3).unwrap();
    assert!(load_model(Arc::new(Basics(CpuBackend::new())), &w, cfg).is_ok());
}

#[test]
fn soft_capping_on_the_cpu_is_tanh_of_x_over_cap_times_cap() {
    let cpu = CpuBackend::new();
    let cap = 30.0f32;
    let layer = SoftCapping::load(&cpu, cap).unwrap();
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 4.1).collect();
    let t = cpu.upload(&[4, 16], &x).unwrap();
    let y = cpu.to_host(&layer.forward(&cpu, &t).unwrap()).unwrap();
    for (&xi, &yi) in x.iter().zip(&y) {
        let want = (f64::from(xi) / f64::from(cap)).tanh() * f64::from(cap);
        assert!((f64::from(yi) - want).abs() < 1e-4, "{xi}: {yi} vs {want}");
        assert!(yi.abs() < cap);
    }
    // Small logits pass almost unchanged, large ones saturate below the cap.
    assert!((y[32] - x[32]).abs() < 1e-6);
    assert!(y[0] < -0.99 * cap && y[63] > 0.99 * cap);
}
