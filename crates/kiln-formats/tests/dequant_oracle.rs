//! Dequantization against an independent oracle: the `gguf` Python package's
//! numpy dequantizers, whose outputs are committed under `tests/fixtures/dequant`
//! (see `make_fixtures.py` there). Comparisons are bit-exact: both sides do
//! the same f32 operations in the same order, so any difference is a bug.

mod common;

use std::collections::BTreeMap;

use common::*;
use kiln_formats::dequant::dequantize;
use kiln_formats::{GgmlType, GgufFile};

struct Case {
    ty: GgmlType,
    raw: Vec<u8>,
    expected: Vec<f32>,
    blocks: Vec<serde_json::Value>,
}

fn cases() -> Vec<Case> {
    let manifest = read_json(&fixture("dequant/manifest.json"));
    manifest["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ty = ggml_type(c["type"].as_str().unwrap());
            assert_eq!(c["block_size"].as_u64().unwrap(), ty.block_size());
            assert_eq!(c["type_size"].as_u64().unwrap(), ty.type_size());
            let raw =
                std::fs::read(fixture(&format!("dequant/{}", c["raw"].as_str().unwrap()))).unwrap();
            let expected = read_f32_le(&fixture(&format!(
                "dequant/{}",
                c["expected"].as_str().unwrap()
            )));
            assert_eq!(expected.len() as u64, c["num_elements"].as_u64().unwrap());
            Case {
                ty,
                raw,
                expected,
                blocks: c["blocks"].as_array().unwrap().clone(),
            }
        })
        .collect()
}

/// Bit-exact, except that any NaN matches any NaN (payloads may differ).
#[track_caller]
fn assert_same_bits(ty: GgmlType, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        assert!(
            same,
            "{}: element {i}: got {g:e} ({:#x}), gguf-py {w:e} ({:#x})",
            ty.name(),
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn every_type_matches_gguf_py_bit_for_bit() {
    let cases = cases();
    let names: Vec<&str> = cases.iter().map(|c| c.ty.name()).collect();
    for want in [
        "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    ] {
        assert!(names.contains(&want), "fixtures lack {want}");
    }
    for c in &cases {
        let got = dequantize(c.ty, &c.raw, c.expected.len()).unwrap();
        assert_same_bits(c.ty, &got, &c.expected);
        // Values are not trivially zero: the fixture exercises the formula.
        assert!(
            c.expected.iter().filter(|x| **x != 0.0).count() > c.expected.len() / 2,
            "{}",
            c.ty.name()
        );
    }
}

#[test]
fn fixture_blocks_come_from_real_files_and_synthetic_sources() {
    let mut kinds: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let cases = cases();
    for c in &cases {
        for b in &c.blocks {
            kinds
                .entry(c.ty.name())
                .or_default()
                .push(b["kind"].as_str().unwrap().to_string());
        }
    }
    for ty in ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"] {
        assert!(
            kinds[ty].iter().any(|k| k == "gguf"),
            "{ty} has no block from a real file"
        );
    }
    for ty in ["Q4_0", "Q5_1", "Q5_K"] {
        assert!(!kinds[ty].is_empty(), "{ty} has no blocks");
    }
}

/// The blocks taken from real files sit where the manifest says, so
/// `GgufFile::tensor_bytes` finds the same bytes and `tensor_f32` gives the
/// same values at that position: this checks the reader's offsets end to end.
#[test]
fn real_blocks_are_found_in_place_by_the_reader() {
    let mut files: BTreeMap<String, GgufFile> = BTreeMap::new();
    let mut checked = 0;
    for c in cases() {
        let (bs, ts) = (c.ty.block_size() as usize, c.ty.type_size() as usize);
        // Fixture blocks are stored back to back in manifest order.
        for (i, b) in c.blocks.iter().enumerate() {
            if b["kind"] != "gguf" {
                continue;
            }
            let file_name = b["file"].as_str().unwrap();
            let file = files
                .entry(file_name.to_string())
                .or_insert_with(|| GgufFile::open(model_path(file_name)).unwrap());
            let tensor = b["tensor"].as_str().unwrap();
            let block = b["block"].as_u64().unwrap() as usize;
            let info = file.tensor_info(tensor).unwrap().clone();
            assert_eq!(info.ggml_type, c.ty, "{tensor}");
            let bytes = file.tensor_bytes(&info);
            assert_eq!(
                &bytes[block * ts..(block + 1) * ts],
                &c.raw[i * ts..(i + 1) * ts],
                "{file_name}: {tensor} block {block}"
            );
            let want = &c.expected[i * bs..(i + 1) * bs];
            if info.num_elements() <= 8 << 20 {
                let all = file.tensor_f32(tensor).unwrap();
                assert_same_bits(c.ty, &all[block * bs..(block + 1) * bs], want);
            } else {
                let got = dequantize(c.ty, &bytes[block * ts..(block + 1) * ts], bs).unwrap();
                assert_same_bits(c.ty, &got, want);
            }
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} real blocks checked");
}

#[test]
fn unsupported_and_mis_sized_inputs_are_errors() {
    // Q8_K is a known type (llama.cpp's activation format) that weights
    // are never stored in.
    let err = dequantize(GgmlType::Q8K, &[0u8; 292], 256).unwrap_err();
    assert!(err.contains("Q8_K"), "{err}");
    // A byte count that does not match the element count.
    let err = dequantize(GgmlType::Q8_0, &[0u8; 33], 32).unwrap_err();
    assert!(
        err.contains("33 bytes") && err.contains("32 elements"),
        "{err}"
    );
    let err = dequantize(GgmlType::Q4K, &[0u8; 144], 128).unwrap_err();
    assert!(err.contains("Q4_K"), "{err}");
}

/// MXFP4 (gpt-oss's experts in GGUF) against gguf-py, every e8m0 scale
/// byte from 0 to 254 (`fixtures/dequant/make_mxfp4.py`).
#[test]
fn mxfp4_matches_gguf_py_bit_for_bit() {
    let raw = std::fs::read(fixture("dequant/mxfp4.raw")).unwrap();
    let want = read_f32_le(&fixture("dequant/mxfp4.f32"));
    assert_eq!(GgmlType::from_u32(39), Some(GgmlType::MXFP4));
    let got = dequantize(GgmlType::MXFP4, &raw, want.len()).unwrap();
    assert_same_bits(GgmlType::MXFP4, &got, &want);
    assert!(want.iter().filter(|x| **x != 0.0).count() > want.len() / 2);
    // Subnormal and large scales are both there.
    assert!(want
        .iter()
        .any(|x| x.abs() > 0.0 && x.abs() < f32::MIN_POSITIVE));
    assert!(want.iter().any(|x| x.abs() > 1e30));
}
