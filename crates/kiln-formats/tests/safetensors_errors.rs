//! Every malformed Hugging Face directory or safetensors file gives an error,
//! never a panic, naming the file and, where there is one, the tensor.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use kiln_formats::safetensors_dir::{SINGLE_WEIGHTS_FILE, WEIGHTS_INDEX_FILE};
use kiln_formats::{
    write_hf_dir_with, FormatError, HfDirOptions, HostTensor, SafetensorsDir, SafetensorsDtype,
    WeightSource,
};
use serde_json::json;

fn weights() -> MemWeights {
    MemWeights::new(vec![
        (
            "model.embed_tokens.weight",
            HostTensor::new(vec![4, 3], pseudo_random(12, 1)),
        ),
        (
            "model.layers.0.input_layernorm.weight",
            HostTensor::new(vec![3], pseudo_random(3, 2)),
        ),
        (
            "model.norm.weight",
            HostTensor::new(vec![3], pseudo_random(3, 3)),
        ),
    ])
}

/// A valid directory; `max_shard_bytes` small enough shards it.
fn write_dir(max_shard_bytes: u64) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let opts = HfDirOptions {
        max_shard_bytes,
        ..HfDirOptions::new(SafetensorsDtype::F32)
    };
    write_hf_dir_with(
        &dir,
        &json!({"model_type": "llama"}),
        None,
        &weights(),
        &opts,
    )
    .unwrap();
    (tmp, dir)
}

/// A raw safetensors file: header text (padded to 8) and `data_len` zero bytes.
fn raw_file(dir: &Path, header: &str, data_len: usize) {
    let mut h = header.as_bytes().to_vec();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.resize(bytes.len() + data_len, 0);
    std::fs::write(dir.join(SINGLE_WEIGHTS_FILE), bytes).unwrap();
}

fn st_path(dir: &Path) -> String {
    dir.join(SINGLE_WEIGHTS_FILE).display().to_string()
}

#[test]
fn truncated_file_at_every_region() {
    let (_tmp, dir) = write_dir(u64::MAX);
    let file = dir.join(SINGLE_WEIGHTS_FILE);
    let bytes = std::fs::read(&file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let cuts = [
        (0, "too short for the 8-byte header length"),
        (5, "too short for the 8-byte header length"),
        (8, "runs past the end of the file"),
        (8 + header_len / 2, "runs past the end of the file"),
        // Data is in name order, so the last tensor is the first to lose bytes.
        (bytes.len() - 1, "tensor model.norm.weight: data_offsets"),
        (8 + header_len + 4, "tensor model."),
    ];
    for (cut, want) in cuts {
        std::fs::write(&file, &bytes[..cut]).unwrap();
        expect_err(SafetensorsDir::open(&dir), &[&st_path(&dir), want]);
    }
    // And at every byte, never a panic.
    for cut in 0..bytes.len() {
        std::fs::write(&file, &bytes[..cut]).unwrap();
        SafetensorsDir::open(&dir).expect_err(&format!("cut at {cut}"));
    }
}

#[test]
fn bad_header_json() {
    let (_tmp, dir) = write_dir(u64::MAX);
    for (header, want) in [
        ("{not json", "header is not a JSON object"),
        ("[1, 2]", "header is not a JSON object"),
        (r#"{"w": 5}"#, "tensor w: no string \"dtype\""),
        (
            r#"{"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}"#,
            "tensor w: \"shape\" is not an array",
        ),
        (
            r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}"#,
            "tensor w: \"data_offsets\" is not [start, end]",
        ),
    ] {
        raw_file(&dir, header, 4);
        expect_err(SafetensorsDir::open(&dir), &[&st_path(&dir), want]);
    }
    // Not UTF-8.
    let mut bytes = 8u64.to_le_bytes().to_vec();
    bytes.extend([0xFF; 8]);
    std::fs::write(dir.join(SINGLE_WEIGHTS_FILE), bytes).unwrap();
    expect_err(
        SafetensorsDir::open(&dir),
        &[&st_path(&dir), "header is not a JSON object"],
    );
    // An absurd header length.
    let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
    bytes.extend([b' '; 8]);
    std::fs::write(dir.join(SINGLE_WEIGHTS_FILE), bytes).unwrap();
    expect_err(
        SafetensorsDir::open(&dir),
        &[&st_path(&dir), "header length 1099511627776 exceeds"],
    );
}

#[test]
fn offsets_past_end_and_size_mismatches() {
    let (_tmp, dir) = write_dir(u64::MAX);
    raw_file(
        &dir,
        r#"{"w": {"dtype": "F32", "shape": [250], "data_offsets": [0, 1000]}}"#,
        16,
    );
    expect_err(
        SafetensorsDir::open(&dir),
        &[
            &st_path(&dir),
            "tensor w: data_offsets [0, 1000] lie outside the data section of 16 bytes",
        ],
    );
    raw_file(
        &dir,
        r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}"#,
        16,
    );
    expect_err(
        SafetensorsDir::open(&dir),
        &[&st_path(&dir), "tensor w: data_offsets [8, 4]"],
    );
    raw_file(
        &dir,
        r#"{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}"#,
        16,
    );
    expect_err(
        SafetensorsDir::open(&dir),
        &[
            &st_path(&dir),
            "tensor w: F32 with shape [2, 2] needs 16 bytes, but data_offsets [0, 12] span 12",
        ],
    );
    raw_file(
        &dir,
        r#"{"w": {"dtype": "BF16", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}}"#,
        16,
    );
    expect_err(
        SafetensorsDir::open(&dir),
        &[&st_path(&dir), "tensor w", "more than 2^64"],
    );
}

#[test]
fn unsupported_dtype_opens_but_fails_to_load() {
    let (_tmp, dir) = write_dir(u64::MAX);
    raw_file(
        &dir,
        r#"{"ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
            "f8": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [16, 20]},
            "ok": {"dtype": "F16", "shape": [2], "data_offsets": [20, 24]}}"#,
        24,
    );
    let st = SafetensorsDir::open(&dir).unwrap();
    assert_eq!(st.load_f32("ok").unwrap().data, [0.0, 0.0]);
    for (name, dtype) in [("ids", "I64"), ("f8", "F8_E4M3")] {
        let err = expect_err(
            st.load_f32(name),
            &[
                &st_path(&dir),
                &format!("tensor {name}: unsupported dtype {dtype}"),
                "supported: F32, F16, BF16",
            ],
        );
        assert!(matches!(err, FormatError::UnsupportedDtype { .. }));
    }
}

#[test]
fn missing_shard_file() {
    let (_tmp, dir) = write_dir(10);
    let files = SafetensorsDir::open(&dir).unwrap().weight_files().len();
    assert_eq!(files, 3, "the fixture should be sharded");
    let shard = dir.join("model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let err = expect_err(
        SafetensorsDir::open(&dir),
        &[
            &dir.join(WEIGHTS_INDEX_FILE).display().to_string(),
            &shard.display().to_string(),
            "tensor model.",
        ],
    );
    assert!(matches!(err, FormatError::MissingShard { .. }), "{err:?}");
}

#[test]
fn index_inconsistent_with_shards() {
    let (_tmp, dir) = write_dir(10);
    let index_path = dir.join(WEIGHTS_INDEX_FILE);
    let index = read_json(&index_path);
    let write_index = |v: &serde_json::Value| std::fs::write(&index_path, v.to_string()).unwrap();

    // The index places a tensor in a shard that does not hold it.
    let mut bad = index.clone();
    bad["weight_map"]["model.ghost.weight"] = json!("model-00001-of-00003.safetensors");
    write_index(&bad);
    let err = expect_err(
        SafetensorsDir::open(&dir),
        &[
            "model-00001-of-00003.safetensors",
            "missing tensor model.ghost.weight",
            WEIGHTS_INDEX_FILE,
        ],
    );
    assert!(matches!(err, FormatError::MissingTensor { .. }));

    // Shard names must stay inside the directory.
    let mut bad = index.clone();
    bad["weight_map"]["model.norm.weight"] = json!("../model.safetensors");
    write_index(&bad);
    expect_err(
        SafetensorsDir::open(&dir),
        &[
            WEIGHTS_INDEX_FILE,
            "\"../model.safetensors\" is not a plain file name",
        ],
    );

    for (v, want) in [
        (json!({"metadata": {}}), "no \"weight_map\" object"),
        (
            json!({"weight_map": {"a": 3}}),
            "weight_map[\"a\"] is not a file name",
        ),
    ] {
        write_index(&v);
        expect_err(SafetensorsDir::open(&dir), &[WEIGHTS_INDEX_FILE, want]);
    }
    std::fs::write(&index_path, "{").unwrap();
    let err = expect_err(
        SafetensorsDir::open(&dir),
        &[WEIGHTS_INDEX_FILE, "invalid JSON"],
    );
    assert!(matches!(err, FormatError::Json { .. }));
}

#[test]
fn missing_tensor_config_and_weights() {
    let (_tmp, dir) = write_dir(u64::MAX);
    let st = SafetensorsDir::open(&dir).unwrap();
    assert!(!st.contains("lm_head.weight"));
    let err = expect_err(
        st.load_f32("lm_head.weight"),
        &[&dir.display().to_string(), "missing tensor lm_head.weight"],
    );
    assert!(matches!(err, FormatError::MissingTensor { .. }));

    std::fs::write(dir.join("generation_config.json"), "{oops").unwrap();
    expect_err(
        SafetensorsDir::open(&dir),
        &["generation_config.json", "invalid JSON"],
    );
    std::fs::remove_file(dir.join("generation_config.json")).unwrap();

    std::fs::write(dir.join("config.json"), "[1]").unwrap();
    expect_err(
        SafetensorsDir::open(&dir),
        &["config.json", "expected a JSON object"],
    );
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = expect_err(SafetensorsDir::open(&dir), &["config.json", "cannot read"]);
    assert!(matches!(err, FormatError::Io { .. }));

    std::fs::write(dir.join("config.json"), "{}").unwrap();
    std::fs::remove_file(dir.join(SINGLE_WEIGHTS_FILE)).unwrap();
    expect_err(
        SafetensorsDir::open(&dir),
        &[
            &dir.display().to_string(),
            "no model.safetensors or model.safetensors.index.json",
        ],
    );

    expect_err(
        SafetensorsDir::open(dir.join("nope")),
        &["nope", "config.json", "cannot read"],
    );
}

#[test]
fn writer_reports_a_source_that_disagrees_with_its_listing() {
    /// Lists a shape, then loads another: the writer must notice.
    struct Liar(MemWeights);
    impl WeightSource for Liar {
        fn path(&self) -> &Path {
            self.0.path()
        }
        fn tensors(&self) -> Vec<kiln_formats::StoredTensor> {
            let mut t = self.0.tensors();
            t[0].shape = vec![12];
            t
        }
        fn contains(&self, name: &str) -> bool {
            self.0.contains(name)
        }
        fn load_f32(&self, name: &str) -> kiln_formats::Result<HostTensor> {
            self.0.load_f32(name)
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let err = expect_err(
        kiln_formats::write_hf_dir(
            &dir,
            &json!({}),
            None,
            &Liar(weights()),
            SafetensorsDtype::BF16,
        ),
        &[
            "model.safetensors",
            "tensor model.embed_tokens.weight",
            "shape [4, 3], expected [12]",
        ],
    );
    assert!(matches!(err, FormatError::ShapeMismatch { .. }));
    // Nothing half-written is left: no weights file, no temporary, no config.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
