//! Every malformed GGUF gives an error, never a panic, and the message names
//! the file and, where there is one, the tensor or key and what was expected.

mod common;

use std::io::{Read, Write};

use common::*;
use kiln_formats::{FormatError, GgmlType, GgufFile, GgufWeights, WeightSource};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// A valid little llama file: one Q8_0 tensor, one F32 norm and a q projection.
fn valid_llama() -> GgufBuilder {
    let mut b = GgufBuilder::llama();
    let mut q8 = vec![0u8; 34];
    q8[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
    q8[2] = 3;
    b.tensor("token_embd.weight", &[32, 1], GgmlType::Q8_0, q8);
    b.f32_tensor("blk.0.attn_norm.weight", &[4], &[1.0, 2.0, 3.0, 4.0]);
    // q: 2 heads × head_dim 2 = 4 rows, 1 column.
    b.f32_tensor("blk.0.attn_q.weight", &[1, 4], &[10.0, 11.0, 12.0, 13.0]);
    b
}

#[test]
fn the_synthetic_writer_makes_files_the_reader_accepts() {
    let dir = tmp();
    let path = valid_llama().write(dir.path(), "ok.gguf");
    let w = GgufWeights::open(&path).unwrap();
    let embd = w.load_f32("model.embed_tokens.weight").unwrap();
    assert_eq!(embd.shape, vec![1, 32]);
    assert_eq!(embd.data[0], 1.5);
    assert_eq!(
        w.load_f32("model.layers.0.input_layernorm.weight")
            .unwrap()
            .data,
        [1.0, 2.0, 3.0, 4.0]
    );
    // GGUF rows [a, c, b, d] per head of 2 dims un-permute to themselves; with
    // head_dim 2 the permutation is the identity.
    assert_eq!(
        w.load_f32("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .data,
        [10.0, 11.0, 12.0, 13.0]
    );
}

#[test]
fn truncated_headers_of_the_real_file_are_errors() {
    let src = model_path(SMOLLM2);
    let dir = tmp();
    let mut head = vec![0u8; 2_000_000];
    std::fs::File::open(&src)
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    // Inside the magic, the version, the counts, the first key, the first
    // value, and deep in the tokenizer arrays.
    for (cut, what) in [
        (0, "magic"),
        (3, "magic"),
        (6, "version"),
        (12, "tensor count"),
        (20, "metadata count"),
        (30, "metadata key"),
        (1_000, ""),
        (100_000, "tokenizer.ggml"),
        (1_000_000, "tokenizer.ggml"),
        // In the tensor infos (the header ends at about 1.78 MB).
        (1_780_000, "of 272"),
        // In the first tensor's data.
        (
            1_999_999,
            "tensor token_embd.weight (30081024 bytes at data offset 0) runs past the end",
        ),
    ] {
        let path = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&path, &head[..cut]).unwrap();
        let err = expect_err(
            GgufFile::open(&path),
            &[&path.display().to_string(), "truncated or corrupt", what],
        );
        assert!(matches!(err, FormatError::Corrupt { .. }), "{err:?}");
    }
}

#[test]
fn truncated_tensor_data_of_the_real_file_names_the_tensor() {
    let src = model_path(SMOLLM2);
    let real = GgufFile::open(&src).unwrap();
    // The tensor whose data ends the file.
    let last = real
        .tensors
        .iter()
        .max_by_key(|t| t.offset)
        .unwrap()
        .name
        .clone();
    let len = std::fs::metadata(&src).unwrap().len();
    let dir = tmp();
    let path = dir.path().join("short.gguf");
    std::fs::copy(&src, &path).unwrap();
    for cut in [len - 1, len - 1000] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        expect_err(
            GgufFile::open(&path),
            &[
                &path.display().to_string(),
                &format!("tensor {last} "),
                "runs past the end",
                &format!("({cut} bytes)"),
                "truncated?",
            ],
        );
    }
    // Halfway through the data, some earlier tensor is the first to overrun.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    expect_err(
        GgufWeights::open(&path),
        &[
            &path.display().to_string(),
            "tensor blk.",
            "runs past the end",
        ],
    );
}

#[test]
fn synthetic_file_truncated_anywhere_is_an_error() {
    let bytes = valid_llama().build();
    let dir = tmp();
    let path = dir.path().join("t.gguf");
    for cut in 0..bytes.len() {
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&bytes[..cut])
            .unwrap();
        let err = GgufFile::open(&path).expect_err(&format!("cut at {cut} of {}", bytes.len()));
        assert!(err.to_string().contains("t.gguf"), "{err}");
    }
}

#[test]
fn wrong_magic() {
    let dir = tmp();
    let mut b = valid_llama();
    b.magic = *b"GGML";
    let path = b.write(dir.path(), "magic.gguf");
    let err = expect_err(
        GgufFile::open(&path),
        &["magic.gguf", "not a GGUF file", "expected \"GGUF\""],
    );
    assert!(matches!(err, FormatError::BadMagic { found, .. } if &found == b"GGML"));
    // A safetensors file is not mistaken for GGUF either.
    let path = dir.path().join("st.gguf");
    std::fs::write(
        &path,
        [
            8, 0, 0, 0, 0, 0, 0, 0, b'{', b'}', b' ', b' ', b' ', b' ', b' ', b' ',
        ],
    )
    .unwrap();
    expect_err(GgufFile::open(&path), &["st.gguf", "not a GGUF file"]);
}

#[test]
fn unsupported_versions_1_and_4() {
    let dir = tmp();
    for version in [1, 4] {
        let mut b = valid_llama();
        b.version = version;
        let path = b.write(dir.path(), &format!("v{version}.gguf"));
        let err = expect_err(
            GgufFile::open(&path),
            &[
                &format!("v{version}.gguf"),
                &format!("unsupported GGUF version {version}"),
                "supported: 2, 3",
            ],
        );
        assert!(matches!(err, FormatError::UnsupportedVersion { .. }));
    }
}

#[test]
fn unknown_ggml_type_ids() {
    let dir = tmp();
    // 4 and 5 were Q4_2 / Q4_3, removed from GGML; 99 never existed.
    for id in [4u32, 5, 99] {
        let mut b = valid_llama();
        b.tensor_raw("blk.0.ffn_up.weight", &[32], id, vec![0; 64]);
        let path = b.write(dir.path(), &format!("type{id}.gguf"));
        let err = expect_err(
            GgufFile::open(&path),
            &[
                &format!("type{id}.gguf"),
                "tensor blk.0.ffn_up.weight",
                &format!("ggml type {id}"),
            ],
        );
        assert!(matches!(err, FormatError::UnsupportedDtype { .. }));
    }
}

#[test]
fn known_but_unsupported_type_fails_on_load_not_open() {
    let dir = tmp();
    let mut b = valid_llama();
    // Q8_1 is GGML's activation format: a known type no weight file uses.
    b.tensor(
        "blk.0.ffn_down.weight",
        &[256, 1],
        GgmlType::Q8_1,
        vec![0; 8 * 36],
    );
    let path = b.write(dir.path(), "q8_1.gguf");
    let w = GgufWeights::open(&path).unwrap();
    let t = w
        .tensors()
        .into_iter()
        .find(|t| t.name == "model.layers.0.mlp.down_proj.weight")
        .unwrap();
    assert_eq!(t.dtype, "Q8_1");
    let err = expect_err(
        w.load_f32("model.layers.0.mlp.down_proj.weight"),
        &[
            "q8_1.gguf",
            "model.layers.0.mlp.down_proj.weight",
            "blk.0.ffn_down.weight",
            "unsupported dtype Q8_1",
        ],
    );
    assert!(matches!(err, FormatError::UnsupportedDtype { .. }));
}

#[test]
fn missing_tensor() {
    let dir = tmp();
    let path = valid_llama().write(dir.path(), "ok.gguf");
    let w = GgufWeights::open(&path).unwrap();
    assert!(!w.contains("lm_head.weight"));
    expect_err(
        w.load_f32("lm_head.weight"),
        &["ok.gguf", "missing tensor lm_head.weight"],
    );
    expect_err(
        w.file.tensor_f32("output.weight"),
        &["ok.gguf", "missing tensor output.weight"],
    );
}

#[test]
fn unknown_or_missing_architecture() {
    let dir = tmp();
    let mut b = GgufBuilder::new();
    b.meta("general.architecture", Meta::Str("foo".into()));
    b.f32_tensor("token_embd.weight", &[2, 2], &[0.0; 4]);
    let path = b.write(dir.path(), "foo.gguf");
    // The file itself is fine; only the mapping to HF names refuses it.
    GgufFile::open(&path).unwrap();
    let err = expect_err(
        GgufWeights::open(&path),
        &["foo.gguf", "unknown architecture \"foo\"", "llama", "qwen2"],
    );
    assert!(matches!(err, FormatError::UnknownArchitecture { .. }));

    let mut b = GgufBuilder::new();
    b.f32_tensor("token_embd.weight", &[2, 2], &[0.0; 4]);
    let path = b.write(dir.path(), "noarch.gguf");
    expect_err(
        GgufWeights::open(&path),
        &["noarch.gguf", "general.architecture", "missing"],
    );
}

#[test]
fn bad_head_counts() {
    let dir = tmp();
    let mut b = GgufBuilder::new();
    b.meta("general.architecture", Meta::Str("llama".into()));
    b.meta("llama.attention.head_count", Meta::U32(0));
    let path = b.write(dir.path(), "zero.gguf");
    expect_err(
        GgufWeights::open(&path),
        &["zero.gguf", "llama.attention.head_count", "found 0"],
    );

    let mut b = GgufBuilder::new();
    b.meta("general.architecture", Meta::Str("llama".into()));
    b.meta("llama.attention.head_count", Meta::Str("nine".into()));
    let path = b.write(dir.path(), "str.gguf");
    expect_err(
        GgufWeights::open(&path),
        &[
            "str.gguf",
            "llama.attention.head_count",
            "expected an unsigned integer",
        ],
    );

    let mut b = GgufBuilder::new();
    b.meta("general.architecture", Meta::Str("llama".into()));
    let path = b.write(dir.path(), "none.gguf");
    expect_err(
        GgufWeights::open(&path),
        &["none.gguf", "llama.attention.head_count", "missing"],
    );
}

#[test]
fn shape_and_size_inconsistencies() {
    let dir = tmp();
    // Rows must split into whole blocks.
    let mut b = valid_llama();
    b.tensor("blk.0.ffn_up.weight", &[33, 1], GgmlType::Q8_0, vec![0; 34]);
    let path = b.write(dir.path(), "rows.gguf");
    expect_err(
        GgufFile::open(&path),
        &[
            "rows.gguf",
            "tensor blk.0.ffn_up.weight",
            "[33, 1]",
            "Q8_0's block size 32",
        ],
    );

    // Zero and too many dimensions.
    for (n, ne) in [("dims0", vec![]), ("dims9", vec![1u64; 9])] {
        let mut b = valid_llama();
        b.tensor("blk.0.ffn_up.weight", &ne, GgmlType::F32, vec![0; 4]);
        let path = b.write(dir.path(), &format!("{n}.gguf"));
        expect_err(
            GgufFile::open(&path),
            &[
                &format!("{n}.gguf"),
                "tensor blk.0.ffn_up.weight",
                "dimensions",
            ],
        );
    }

    // A shape whose byte size overflows u64.
    let mut b = valid_llama();
    b.tensor(
        "blk.0.ffn_up.weight",
        &[1 << 40, 1 << 40],
        GgmlType::F32,
        vec![],
    );
    let path = b.write(dir.path(), "huge.gguf");
    expect_err(
        GgufFile::open(&path),
        &["huge.gguf", "tensor blk.0.ffn_up.weight"],
    );

    // A shape larger than the data that follows it.
    let mut b = valid_llama();
    b.f32_tensor("blk.0.ffn_up.weight", &[1000, 1000], &[0.0; 8]);
    let path = b.write(dir.path(), "big.gguf");
    expect_err(
        GgufFile::open(&path),
        &[
            "big.gguf",
            "tensor blk.0.ffn_up.weight (4000000 bytes",
            "runs past the end",
        ],
    );

    // The same tensor twice.
    let mut b = valid_llama();
    b.f32_tensor("blk.0.attn_norm.weight", &[4], &[0.0; 4]);
    let path = b.write(dir.path(), "dup.gguf");
    expect_err(
        GgufFile::open(&path),
        &["dup.gguf", "tensor blk.0.attn_norm.weight appears twice"],
    );

    // llama q rows must split into 2 × n_head halves for the un-permutation.
    let mut b = GgufBuilder::llama();
    b.f32_tensor("blk.0.attn_q.weight", &[1, 6], &[0.0; 6]);
    let path = b.write(dir.path(), "q6.gguf");
    let w = GgufWeights::open(&path).unwrap();
    let err = expect_err(
        w.load_f32("model.layers.0.self_attn.q_proj.weight"),
        &["q6.gguf", "self_attn.q_proj.weight", "[6, 1]"],
    );
    assert!(matches!(err, FormatError::ShapeMismatch { .. }));
}

#[test]
fn corrupt_metadata() {
    let dir = tmp();
    let cases: Vec<(&str, Meta, &str)> = vec![
        ("type", Meta::Raw(13, vec![0; 8]), "unknown value type 13"),
        (
            "strlen",
            Meta::Raw(8, (1u64 << 40).to_le_bytes().to_vec()),
            "string length 1099511627776 is implausible",
        ),
        (
            "arrlen",
            Meta::Raw(
                9,
                [
                    8u32.to_le_bytes().to_vec(),
                    1_000_000u64.to_le_bytes().to_vec(),
                ]
                .concat(),
            ),
            "array of 1000000 overruns the file",
        ),
        (
            "nested",
            Meta::Raw(
                9,
                [
                    9u32.to_le_bytes().to_vec(),
                    1u64.to_le_bytes().to_vec(),
                    9u32.to_le_bytes().to_vec(),
                    1u64.to_le_bytes().to_vec(),
                    9u32.to_le_bytes().to_vec(),
                    1u64.to_le_bytes().to_vec(),
                    9u32.to_le_bytes().to_vec(),
                    1u64.to_le_bytes().to_vec(),
                    0u32.to_le_bytes().to_vec(),
                    1u64.to_le_bytes().to_vec(),
                    vec![0],
                ]
                .concat(),
            ),
            "nested too deep",
        ),
    ];
    for (name, meta, want) in cases {
        let mut b = valid_llama();
        b.meta("bad.key", meta);
        let path = b.write(dir.path(), &format!("{name}.gguf"));
        expect_err(
            GgufFile::open(&path),
            &[&format!("{name}.gguf"), "bad.key", want],
        );
    }

    // Implausible counts in the header.
    let mut bytes = valid_llama().build();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let path = dir.path().join("count.gguf");
    std::fs::write(&path, &bytes).unwrap();
    expect_err(GgufFile::open(&path), &["count.gguf", "implausible counts"]);

    // A typed getter names the key and what it expected.
    let mut b = valid_llama();
    b.meta("llama.embedding_length", Meta::U32(4));
    b.meta("llama.feed_forward_length", Meta::U32(8));
    b.meta("llama.block_count", Meta::U32(1));
    b.meta("llama.rope.freq_base", Meta::Str("high".into()));
    let path = b.write(dir.path(), "rope.gguf");
    let w = GgufWeights::open(&path).unwrap();
    expect_err(
        w.hf_config(),
        &["rope.gguf", "llama.rope.freq_base", "expected a number"],
    );
}

#[test]
fn not_a_file() {
    let dir = tmp();
    let missing = dir.path().join("nope.gguf");
    let err = expect_err(GgufFile::open(&missing), &["nope.gguf", "cannot read"]);
    assert!(matches!(err, FormatError::Io { .. }));
    expect_err(
        GgufFile::open(dir.path()),
        &[&dir.path().display().to_string()],
    );
}
