//! Writing and reading safetensors, checked against the reference `safetensors`
//! crate in both directions, plus the layout of written model directories.

mod common;

use std::path::Path;

use common::*;
use kiln_formats::safetensors_dir::{SINGLE_WEIGHTS_FILE, WEIGHTS_INDEX_FILE};
use kiln_formats::{
    write_hf_dir, write_hf_dir_with, write_safetensors, HfDirOptions, HostTensor, SafetensorsDir,
    SafetensorsDtype, WeightSource,
};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde_json::json;

/// bf16 rounding written out from its definition (round to nearest, ties to
/// even, on the top 16 bits), independent of the `half` crate the writer uses.
fn bf16_reference(x: f32) -> f32 {
    assert!(!x.is_nan());
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(rounded)
}

fn sample() -> Vec<(String, HostTensor)> {
    vec![
        (
            "b.weight".into(),
            HostTensor::new(vec![3, 5], pseudo_random(15, 7)),
        ),
        (
            "a.bias".into(),
            HostTensor::new(vec![5], pseudo_random(5, 8)),
        ),
        ("scalar".into(), HostTensor::new(vec![], vec![0.25])),
        ("empty".into(), HostTensor::new(vec![0, 4], vec![])),
    ]
}

fn refs(ts: &[(String, HostTensor)]) -> Vec<(String, &HostTensor)> {
    ts.iter().map(|(n, t)| (n.clone(), t)).collect()
}

fn one_file_dir(dir: &Path) {
    std::fs::write(dir.join("config.json"), "{}").unwrap();
}

#[test]
fn written_files_pass_the_reference_reader_in_every_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let ts = sample();
    for (dtype, st_dtype) in [
        (SafetensorsDtype::F32, Dtype::F32),
        (SafetensorsDtype::F16, Dtype::F16),
        (SafetensorsDtype::BF16, Dtype::BF16),
    ] {
        let path = tmp.path().join(format!("{}.safetensors", dtype.name()));
        write_safetensors(&path, &refs(&ts), dtype).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // The reference crate validates the header and that the data is covered exactly.
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        assert_eq!(st.len(), ts.len());
        for (name, t) in &ts {
            let view = st.tensor(name).unwrap();
            assert_eq!(view.dtype(), st_dtype);
            assert_eq!(view.shape(), t.shape.as_slice());
            let got: Vec<f32> = match dtype {
                SafetensorsDtype::F32 => view
                    .data()
                    .chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                SafetensorsDtype::F16 => view
                    .data()
                    .chunks(2)
                    .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
                    .collect(),
                SafetensorsDtype::BF16 => view
                    .data()
                    .chunks(2)
                    .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
                    .collect(),
            };
            let want: Vec<f32> = match dtype {
                SafetensorsDtype::F32 => t.data.clone(),
                SafetensorsDtype::F16 => t
                    .data
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_f32())
                    .collect(),
                SafetensorsDtype::BF16 => t.data.iter().map(|&x| bf16_reference(x)).collect(),
            };
            assert_eq!(got, want, "{name} as {}", dtype.name());
        }
        // And our reader agrees.
        let dir = tmp.path().join(dtype.name());
        std::fs::create_dir(&dir).unwrap();
        std::fs::rename(&path, dir.join(SINGLE_WEIGHTS_FILE)).unwrap();
        one_file_dir(&dir);
        let ours = SafetensorsDir::open(&dir).unwrap();
        for (name, _) in &ts {
            let view = st.tensor(name).unwrap();
            let got = ours.load_f32(name).unwrap();
            assert_eq!(got.shape, view.shape());
        }
        let stored = ours.tensors();
        assert!(stored.iter().all(|s| s.dtype == dtype.name()));
    }
}

#[test]
fn f16_rounding_spot_checks() {
    // Values whose f16 encodings are known by hand.
    let t = HostTensor::new(vec![4], vec![1.0, -2.0, 65504.0, 1.0 + 1.0 / 2048.0]);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(SINGLE_WEIGHTS_FILE);
    write_safetensors(&path, &[("t".into(), &t)], SafetensorsDtype::F16).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let data: Vec<u16> = bytes[8 + n..]
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    // 1 + 2^-11 is a tie between 1.0 and 1 + 2^-10 and rounds to even (1.0).
    assert_eq!(data, [0x3C00, 0xC000, 0x7BFF, 0x3C00]);
}

#[test]
fn files_from_the_reference_writer_are_read() {
    let ts = sample();
    let f32_bytes: Vec<Vec<u8>> = ts
        .iter()
        .map(|(_, t)| t.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let bf16_bytes: Vec<u8> = ts[0]
        .1
        .data
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    let mut views: Vec<(String, TensorView)> = ts
        .iter()
        .zip(&f32_bytes)
        .map(|((n, t), b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, t.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    views.push((
        "b16".into(),
        TensorView::new(Dtype::BF16, vec![3, 5], &bf16_bytes).unwrap(),
    ));
    let tmp = tempfile::tempdir().unwrap();
    safetensors::tensor::serialize_to_file(views, None, &tmp.path().join(SINGLE_WEIGHTS_FILE))
        .unwrap();
    one_file_dir(tmp.path());
    let st = SafetensorsDir::open(tmp.path()).unwrap();
    for (name, t) in &ts {
        assert_eq!(&st.load_f32(name).unwrap(), t, "{name}");
    }
    let b16 = st.load_f32("b16").unwrap();
    let want: Vec<f32> = ts[0].1.data.iter().map(|&x| bf16_reference(x)).collect();
    assert_eq!(b16.data, want);
}

#[test]
fn hf_dir_sharding_index_configs_and_tied_head() {
    let embed = HostTensor::new(vec![8, 4], pseudo_random(32, 1));
    let w = MemWeights::new(vec![
        ("model.embed_tokens.weight", embed.clone()),
        (
            "model.layers.0.mlp.up_proj.weight",
            HostTensor::new(vec![6, 4], pseudo_random(24, 2)),
        ),
        (
            "model.layers.1.mlp.up_proj.weight",
            HostTensor::new(vec![6, 4], pseudo_random(24, 3)),
        ),
        (
            "model.norm.weight",
            HostTensor::new(vec![4], pseudo_random(4, 4)),
        ),
        ("lm_head.weight", embed),
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let config =
        json!({"model_type": "llama", "tie_word_embeddings": true, "torch_dtype": "bfloat16"});
    let gen = json!({"eos_token_id": [2, 3]});
    let opts = HfDirOptions {
        max_shard_bytes: 120,
        ..HfDirOptions::new(SafetensorsDtype::F32)
    };
    let files = write_hf_dir_with(&dir, &config, Some(&gen), &w, &opts).unwrap();
    // 128 + 96 + 96 + 16 bytes under a 120-byte limit: [embed] (alone, though
    // over the limit), [up0], [up1, norm].
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );
    assert!(!dir.join(SINGLE_WEIGHTS_FILE).exists());
    let index = read_json(&dir.join(WEIGHTS_INDEX_FILE));
    assert_eq!(index["metadata"]["total_size"], 128 + 96 + 96 + 16);
    assert_eq!(
        index["weight_map"]["model.norm.weight"],
        "model-00003-of-00003.safetensors"
    );
    assert!(
        index["weight_map"].get("lm_head.weight").is_none(),
        "tied head must not be written"
    );
    for f in &files {
        SafeTensors::deserialize(&std::fs::read(f).unwrap()).unwrap();
    }

    let st = SafetensorsDir::open(&dir).unwrap();
    assert_eq!(
        st.config()["torch_dtype"],
        "float32",
        "torch_dtype follows the dtype written"
    );
    assert_eq!(st.config()["tie_word_embeddings"], true);
    assert_eq!(st.generation_config(), Some(&gen));
    assert_eq!(st.weight_files().len(), 3);
    assert!(!st.contains("lm_head.weight"));
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
    ] {
        assert_eq!(
            st.load_f32(name).unwrap(),
            w.load_f32(name).unwrap(),
            "{name}"
        );
    }

    // Rewriting the same directory unsharded, untied and filtered replaces the
    // index with a single file, so a reader cannot pick stale weights.
    let untied = json!({"model_type": "llama", "tie_word_embeddings": false});
    let keep = |n: &str| n != "model.norm.weight";
    let opts = HfDirOptions {
        filter: Some(&keep),
        ..HfDirOptions::new(SafetensorsDtype::BF16)
    };
    write_hf_dir_with(&dir, &untied, None, &w, &opts).unwrap();
    assert!(!dir.join(WEIGHTS_INDEX_FILE).exists());
    let st = SafetensorsDir::open(&dir).unwrap();
    assert_eq!(st.weight_files().len(), 1);
    assert!(st.contains("lm_head.weight"));
    assert!(!st.contains("model.norm.weight"));
    assert_eq!(st.tensors().len(), 4);
    assert_eq!(st.config()["torch_dtype"], "bfloat16");
    let head = st.load_f32("lm_head.weight").unwrap();
    let want: Vec<f32> = w
        .load_f32("lm_head.weight")
        .unwrap()
        .data
        .iter()
        .map(|&x| bf16_reference(x))
        .collect();
    assert_eq!(head.data, want);
    // Rewriting sharded again removes the single file.
    write_hf_dir_with(
        &dir,
        &config,
        None,
        &w,
        &HfDirOptions {
            max_shard_bytes: 1,
            ..HfDirOptions::new(SafetensorsDtype::F16)
        },
    )
    .unwrap();
    assert!(!dir.join(SINGLE_WEIGHTS_FILE).exists());
    assert_eq!(SafetensorsDir::open(&dir).unwrap().weight_files().len(), 4);
    // No temporary files anywhere.
    for e in std::fs::read_dir(&dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with('.'), "left behind: {name}");
    }
}

#[test]
fn default_writer_keeps_one_file_and_writes_no_generation_config_when_none() {
    let w = MemWeights::new(vec![("x", HostTensor::new(vec![2], vec![1.0, 2.0]))]);
    let tmp = tempfile::tempdir().unwrap();
    let files = write_hf_dir(tmp.path(), &json!({}), None, &w, SafetensorsDtype::F32).unwrap();
    assert_eq!(files, [tmp.path().join(SINGLE_WEIGHTS_FILE)]);
    let st = SafetensorsDir::open(tmp.path()).unwrap();
    assert_eq!(st.generation_config(), None);
    assert_eq!(st.load_f32("x").unwrap().data, [1.0, 2.0]);
}
