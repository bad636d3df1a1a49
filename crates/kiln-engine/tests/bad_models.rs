//! Bad model directories give errors that name the file, the tensor and
//! what was expected — never a panic.

use std::path::Path;
use std::sync::Arc;

use kiln_engine::LoadedModel;
use kiln_formats::{write_hf_dir, HostTensor, SafetensorsDtype, StoredTensor, WeightSource};
use kiln_models::random::{preset, RandomWeights};
use kiln_models::ModelConfig;
use kiln_tensor::cpu::CpuBackend;
use kiln_text::Tokenizer;

fn smollm2_tokenizer() -> Tokenizer {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    let f = kiln_formats::GgufFile::open(&p).unwrap();
    Tokenizer::from_gguf(&f.metadata).unwrap()
}

fn tiny_config() -> serde_json::Value {
    let mut c = preset("tiny").unwrap();
    c["vocab_size"] = 49152.into();
    c["eos_token_id"] = 2.into();
    c
}

/// Random weights with one tensor replaced by a wrongly shaped one.
struct Tampered {
    inner: RandomWeights,
    name: &'static str,
}

impl WeightSource for Tampered {
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn tensors(&self) -> Vec<StoredTensor> {
        self.inner
            .tensors()
            .into_iter()
            .map(|mut t| {
                if t.name == self.name {
                    t.shape = vec![t.shape[0], t.shape[1] + 1];
                }
                t
            })
            .collect()
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn load_f32(&self, name: &str) -> kiln_formats::Result<HostTensor> {
        let t = self.inner.load_f32(name)?;
        if name == self.name {
            let shape = vec![t.shape[0], t.shape[1] + 1];
            return Ok(HostTensor::new(
                shape.clone(),
                vec![0.0; shape.iter().product()],
            ));
        }
        Ok(t)
    }
}

#[test]
fn a_tiny_random_checkpoint_loads_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let w = RandomWeights::new(&ModelConfig::from_hf(&config).unwrap(), 1).unwrap();
    write_hf_dir(dir.path(), &config, None, &w, SafetensorsDtype::F32).unwrap();
    smollm2_tokenizer().save_hf(dir.path()).unwrap();
    let m = LoadedModel::load(dir.path(), Arc::new(CpuBackend::new())).unwrap();
    let prompt = m.tokenizer.encode("Hello there", true).unwrap();
    let req = kiln_engine::GenerationRequest {
        prompt,
        params: kiln_sampling::SamplingParams {
            max_tokens: Some(5),
            ignore_eos: true,
            ..kiln_sampling::SamplingParams::greedy()
        },
        skip_special_tokens: true,
        ..Default::default()
    };
    let g = m
        .generate(&req, &mut |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(g.token_ids.len(), 5);
}

#[test]
fn shape_mismatch_names_file_tensor_and_expected_shape() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let name = "model.layers.1.mlp.up_proj.weight";
    let w = Tampered {
        inner: RandomWeights::new(&ModelConfig::from_hf(&config).unwrap(), 1).unwrap(),
        name,
    };
    write_hf_dir(dir.path(), &config, None, &w, SafetensorsDtype::F32).unwrap();
    smollm2_tokenizer().save_hf(dir.path()).unwrap();
    let err = LoadedModel::load(dir.path(), Arc::new(CpuBackend::new()))
        .err()
        .expect("a wrongly shaped tensor must be refused")
        .to_string();
    assert!(err.contains(name), "{err}");
    assert!(
        err.contains("[128, 64]") && err.contains("[128, 65]"),
        "{err}"
    );
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
}

#[test]
fn unknown_model_type_and_missing_paths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = tiny_config();
    let w = RandomWeights::new(&ModelConfig::from_hf(&config).unwrap(), 1).unwrap();
    config["model_type"] = "mamba9".into();
    write_hf_dir(dir.path(), &config, None, &w, SafetensorsDtype::F32).unwrap();
    smollm2_tokenizer().save_hf(dir.path()).unwrap();
    let err = LoadedModel::load(dir.path(), Arc::new(CpuBackend::new()))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("mamba9") && err.contains("llama"), "{err}");
    let err = LoadedModel::load(
        Path::new("/nonexistent/model.gguf"),
        Arc::new(CpuBackend::new()),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn truncated_gguf_is_an_error_not_a_panic() {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(&src).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for cut in [3usize, 100, 5_000, 2_000_000, bytes.len() - 1] {
        let p = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let err = LoadedModel::load(&p, Arc::new(CpuBackend::new()))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&p.display().to_string()),
            "cut at {cut}: {err}"
        );
    }
}

/// A tiny checkpoint whose `config.json` then gets `key` = `value`.
fn load_with_config(key: &str, value: serde_json::Value) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let w = RandomWeights::new(&ModelConfig::from_hf(&config).unwrap(), 1).unwrap();
    write_hf_dir(dir.path(), &config, None, &w, SafetensorsDtype::F32).unwrap();
    smollm2_tokenizer().save_hf(dir.path()).unwrap();
    let mut edited = config.clone();
    edited[key] = value;
    std::fs::write(dir.path().join("config.json"), edited.to_string()).unwrap();
    LoadedModel::load(dir.path(), Arc::new(CpuBackend::new()))
        .err()
        .expect("a config that does not match its weights must be refused")
        .to_string()
}

#[test]
fn a_billion_layers_is_refused_by_name_before_allocating() {
    let err = load_with_config("num_hidden_layers", 1_000_000_000u64.into());
    assert!(err.contains("num_hidden_layers"), "{err}");
}

#[test]
fn config_dimensions_are_checked_against_the_tensor_table() {
    let layers = tiny_config()["num_hidden_layers"].as_u64().unwrap();
    // One layer more than the weights have: named, with both counts.
    let err = load_with_config("num_hidden_layers", (layers + 1).into());
    assert!(err.contains("num_hidden_layers"), "{err}");
    assert!(err.contains(&format!("have {layers}")), "{err}");
    let err = load_with_config("intermediate_size", 1000.into());
    assert!(
        err.contains("intermediate_size") && err.contains("1000"),
        "{err}"
    );
    let err = load_with_config("vocab_size", 50000.into());
    assert!(err.contains("vocab_size") && err.contains("50000"), "{err}");
}
