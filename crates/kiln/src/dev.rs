//! `kiln dev`: developer tools. `random-checkpoint` writes a Hugging Face
//! safetensors directory with random weights (normal(0, 0.02), norms 1) and
//! a given tokenizer, for fast tests and large-shape benchmarks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kiln_formats::GgufFile;
use kiln_models::random::{merge, preset, RandomWeights};
use kiln_models::ModelConfig;
use kiln_text::Tokenizer;
use serde_json::json;

#[derive(Subcommand, Debug)]
pub enum DevCommand {
    /// Write a safetensors checkpoint with random weights.
    RandomCheckpoint(RandomArgs),
    /// Write the logits of every position of a prompt as a float32 .npy
    /// `[tokens, vocab]` (for comparing against other implementations).
    Logits(LogitsArgs),
    /// Write a GGUF of a preset's (or a config's) shape with random
    /// quantized blocks, block by block: sizes and speed of large shapes
    /// (a 32B Q4_K_M) without a float checkpoint first. Not for text.
    RandomGguf(RandomGgufArgs),
    /// A batch mixing LoRA adapters and the base against each sequence
    /// alone: the largest logit difference of each row, as JSON.
    LoraMix(LoraMixArgs),
    /// Check every CUDA op against the CPU backend on GPU `--gpu`; writes
    /// a JSON report and fails if any check does.
    CudaCheck(CudaCheckArgs),
    /// NCCL on this machine's GPUs (all of them, or the first --gpus): one
    /// rank a GPU, each rank's all-reduce and column all-gather against
    /// the host's sums; prints JSON and fails if any differs.
    NcclCheck {
        #[arg(long)]
        gpus: Option<usize>,
    },
    /// List the CUDA backend's environment variables: each one's default,
    /// its value here, and what it does.
    CudaOptions,
}

#[derive(Args, Debug)]
pub struct CudaCheckArgs {
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Output JSON report.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: crate::cli::ModelArgs,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<u32>,
    /// Output .npy file.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Compute the first PREFILL positions in one step, then the rest one
    /// token per step (the decode path: split-KV attention, recorded
    /// steps); by default every position is one prefill step.
    #[arg(long)]
    pub prefill: Option<usize>,
    /// After the first PREFILL positions, steps of this many tokens
    /// (prefill chunks) instead of one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub step: u64,
    /// Run every position with this LoRA adapter (a PEFT directory).
    #[arg(long)]
    pub lora: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct LoraMixArgs {
    #[command(flatten)]
    pub model: crate::cli::ModelArgs,
    /// Comma-separated token ids of the prompts (each sequence of the mix
    /// takes them rotated by its index).
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<u32>,
    /// Adapters (PEFT directories); the mix runs base, adapter 1, ...,
    /// adapter N, then the same again in reverse order.
    #[arg(long, required = true)]
    pub lora: Vec<PathBuf>,
    /// Output JSON file.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

/// The shape and tokenizer of a random model (`random-checkpoint`, `random-gguf`).
#[derive(Args, Debug)]
pub struct RandomShape {
    /// A preset shape: tiny, smollm2-135m, llama3-8b.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// A config.json to use instead of a preset (merged over it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Where the tokenizer comes from: a GGUF file or a directory with tokenizer.json.
    #[arg(long)]
    pub tokenizer: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args, Debug)]
pub struct RandomArgs {
    #[command(flatten)]
    pub shape: RandomShape,
    /// Weight dtype on disk: f32 or bf16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Spread of the projection matrices (default 0.02, as everything
    /// else); 0.01 keeps the 32-layer 8B shape out of the chaotic regime
    /// where bf16 and f32 logits part.
    #[arg(long)]
    pub proj_std: Option<f64>,
    /// Output directory.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct RandomGgufArgs {
    #[command(flatten)]
    pub shape: RandomShape,
    /// The blocks: q4_k_m (llama.cpp's mix) or one GGUF block format (q8_0, q4_k, ...).
    #[arg(long = "type", default_value = "q4_k_m")]
    pub mix: String,
    /// Output GGUF file.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
}

pub fn run(cmd: DevCommand) -> Result<()> {
    match cmd {
        DevCommand::RandomCheckpoint(a) => random_checkpoint(a),
        DevCommand::RandomGguf(a) => random_gguf(a),
        DevCommand::Logits(a) => logits(a),
        DevCommand::LoraMix(a) => lora_mix(a),
        DevCommand::CudaCheck(a) => cuda_check(a),
        DevCommand::NcclCheck { gpus } => nccl_check(gpus),
        DevCommand::CudaOptions => {
            print!("{}", crate::cuda_env::describe()?);
            Ok(())
        }
    }
}

fn nccl_check(gpus: Option<usize>) -> Result<()> {
    use kiln_tensor::Backend;
    let n = gpus.unwrap_or_else(kiln_cuda::device_count);
    anyhow::ensure!(n >= 1, "no GPU");
    let ordinals: Vec<usize> = (0..n).collect();
    let ranks = kiln_cuda::nccl_ranks(&ordinals)?;
    let backends: Vec<Arc<dyn Backend>> = ordinals
        .iter()
        .zip(ranks)
        .map(|(&o, r)| -> Result<Arc<dyn Backend>> {
            Ok(Arc::new(
                crate::cli::cuda_backend(o)?.in_group(kiln_cuda::CudaGroup::Nccl(r)),
            ))
        })
        .collect::<Result<_>>()?;
    let (rows, width) = (5usize, 24usize);
    // Values bf16 holds exactly, and sums of them: the check is exact.
    let data = |r: usize| -> Vec<f32> {
        (0..rows * width)
            .map(|i| ((i * 7 + r * 13) % 64) as f32 - 32.0)
            .collect()
    };
    let keep: Vec<usize> = (0..n).map(|r| width - r % 3).collect();
    let results: Vec<Result<(Vec<f32>, Vec<f32>)>> = std::thread::scope(|s| {
        let hs: Vec<_> = backends
            .iter()
            .enumerate()
            .map(|(r, b)| {
                let keep = &keep;
                s.spawn(move || -> Result<(Vec<f32>, Vec<f32>)> {
                    let x = b.upload(&[rows, width], &data(r))?;
                    let sum = b.to_host(&b.all_reduce_sum(&x)?)?;
                    let gathered = b.to_host(&b.all_gather_columns(&x, keep)?)?;
                    Ok((sum, gathered))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked")))
            })
            .collect()
    });
    let want_sum: Vec<f32> = (0..rows * width)
        .map(|i| (0..n).map(|r| data(r)[i]).sum())
        .collect();
    let mut want_gather = Vec::new();
    for row in 0..rows {
        for (r, &k) in keep.iter().enumerate() {
            want_gather.extend_from_slice(&data(r)[row * width..row * width + k]);
        }
    }
    let mut ok = true;
    for (r, res) in results.iter().enumerate() {
        let (sum, gathered) = res
            .as_ref()
            .map_err(|e| anyhow::anyhow!("rank {r}: {e:#}"))?;
        let (s_ok, g_ok) = (sum == &want_sum, gathered == &want_gather);
        println!("rank {r}: all_reduce_sum {s_ok}, all_gather_columns {g_ok}");
        ok &= s_ok && g_ok;
    }
    println!("{}", json!({"ranks": n, "pass": ok}));
    anyhow::ensure!(ok, "NCCL results differ from the host's");
    Ok(())
}

fn cuda_check(a: CudaCheckArgs) -> Result<()> {
    let b = crate::cli::cuda_backend(a.gpu)?;
    let checks = kiln_cuda::selfcheck::run(&b).map_err(anyhow::Error::msg)?;
    let failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.pass)
        .map(|c| c.op.as_str())
        .collect();
    for c in &checks {
        println!(
            "{:5} {:70} rel {:.2e} max|d| {:.2e} (tol {:.0e})",
            if c.pass { "ok" } else { "FAIL" },
            c.op,
            c.rel_err,
            c.max_abs_err,
            c.tolerance
        );
    }
    let report = json!({
        "device": b.device_name,
        "num_checks": checks.len(),
        "failed": failed,
        "checks": checks.iter().map(|c| json!({
            "op": c.op, "rel_err": c.rel_err, "max_abs_err": c.max_abs_err,
            "tolerance": c.tolerance, "pass": c.pass,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)?)?;
    anyhow::ensure!(
        failed.is_empty(),
        "{} of {} CUDA checks failed",
        failed.len(),
        checks.len()
    );
    Ok(())
}

pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if path.is_dir() {
        Ok(Tokenizer::from_hf_dir(path)?)
    } else {
        let f = GgufFile::open(path)?;
        Ok(Tokenizer::from_gguf(&f.metadata)?)
    }
}

/// The tokenizer, and the preset merged with `--config`, its vocabulary the tokenizer's.
fn random_config(shape: &RandomShape) -> Result<(serde_json::Value, Tokenizer)> {
    let tokenizer = load_tokenizer(&shape.tokenizer)
        .with_context(|| format!("tokenizer from {}", shape.tokenizer.display()))?;
    let mut config = preset(&shape.preset)?;
    if let Some(p) = &shape.config {
        let text = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
        config = merge(
            config,
            &serde_json::from_str(&text).with_context(|| p.display().to_string())?,
        );
    }
    config["vocab_size"] = json!(tokenizer.vocab_size());
    Ok((config, tokenizer))
}

fn random_gguf(a: RandomGgufArgs) -> Result<()> {
    let mix = kiln_formats::QuantMix::parse_ggml(&a.mix).with_context(|| {
        format!(
            "unknown --type {:?} (q4_k_m, or a GGUF block format)",
            a.mix
        )
    })?;
    let (config, tokenizer) = random_config(&a.shape)?;
    let r = kiln_engine::quantize::random_gguf(&config, &tokenizer, mix, a.shape.seed, &a.out)?;
    eprintln!(
        "wrote {} ({} {}, {:.2} GB of tensors: {:?})",
        a.out.display(),
        r.arch,
        a.mix,
        r.tensor_bytes as f64 / 1e9,
        r.tensors_by_type
    );
    Ok(())
}

fn random_checkpoint(a: RandomArgs) -> Result<()> {
    let (mut config, tokenizer) = random_config(&a.shape)?;
    if let Some(b) = tokenizer.bos_id() {
        config["bos_token_id"] = json!(b);
    }
    if let Some(e) = tokenizer.eos_id() {
        config["eos_token_id"] = json!(e);
    }
    let cfg = ModelConfig::from_hf(&config)?;
    let mut weights = RandomWeights::new(&cfg, a.shape.seed)?;
    if let Some(std) = a.proj_std {
        weights = weights.with_proj_std(std);
    }
    let dtype = crate::convert::parse_dtype(&a.dtype)?;
    let gen = json!({"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")});
    kiln_formats::write_hf_dir(&a.out, &config, Some(&gen), &weights, dtype)?;
    tokenizer.save_hf(&a.out)?;
    eprintln!(
        "wrote {} ({} tensors)",
        a.out.display(),
        weights.num_tensors()
    );
    Ok(())
}

fn logits(a: LogitsArgs) -> Result<()> {
    anyhow::ensure!(!a.ids.is_empty(), "--ids is empty");
    let m = a.model.load()?;
    let mut cache = m.model.kv_cache_for_tokens(a.ids.len(), 16)?;
    let first = a.prefill.unwrap_or(a.ids.len()).clamp(1, a.ids.len());
    let adapter = match &a.lora {
        Some(dir) => Some(std::sync::Arc::new(kiln_models::lora::load_peft(
            dir,
            "lora",
            m.model.as_ref(),
        )?)),
        None => None,
    };
    let spec = cache.spec.clone();
    let batch = |ids: &[u32], pos: usize| {
        let mut b = kiln_tensor::ForwardBatch::single(ids, pos, &spec, 0);
        if let Some(ad) = &adapter {
            b.lora.groups.push(kiln_tensor::LoraGroup {
                adapter: ad.clone(),
                rows: vec![0..ids.len()],
            });
        }
        b
    };
    let b0 = batch(&a.ids[..first], 0);
    let t = m.model.forward(&b0, &mut cache)?;
    let mut data = m.model.backend().to_host(&t)?;
    let mut pos = first;
    while pos < a.ids.len() {
        let end = (pos + a.step as usize).min(a.ids.len());
        let b = batch(&a.ids[pos..end], pos);
        let t = m.model.forward(&b, &mut cache)?;
        data.extend(m.model.backend().to_host(&t)?);
        pos = end;
    }
    let (rows, cols) = (a.ids.len(), data.len() / a.ids.len());
    write_npy_f32(&a.out, &[rows, cols], &data)?;
    eprintln!("wrote {} [{rows}, {cols}]", a.out.display());
    Ok(())
}

type Seq = (Vec<u32>, Option<std::sync::Arc<kiln_tensor::LoraAdapter>>);

/// Logits of the last row of each of `seqs` from one prefill step of them
/// all, then of one decode step of them all (each sequence's next token
/// its prompt's first).
fn mixed_steps(model: &dyn kiln_models::CausalLm, seqs: &[Seq]) -> Result<[Vec<Vec<f32>>; 2]> {
    const BS: usize = 16;
    let blocks: usize = seqs.iter().map(|(s, _)| (s.len() + 1).div_ceil(BS)).sum();
    let mut cache = model.new_kv_cache(blocks, BS)?;
    let mut tables = Vec::new();
    let mut next = 0u32;
    for (ids, _) in seqs {
        let n = (ids.len() + 1).div_ceil(BS) as u32;
        tables.push((next..next + n).collect::<Vec<u32>>());
        next += n;
    }
    let mut out: [Vec<Vec<f32>>; 2] = Default::default();
    for (step, rows) in out.iter_mut().enumerate() {
        let mut batch = kiln_tensor::ForwardBatch {
            block_size: BS,
            ..Default::default()
        };
        for ((ids, adapter), table) in seqs.iter().zip(&tables) {
            let start = batch.token_ids.len();
            let (tokens, done) = if step == 0 {
                (ids.clone(), 0)
            } else {
                (vec![ids[0]], ids.len())
            };
            batch.push_seq(&tokens, done, table.clone(), true);
            if let Some(a) = adapter {
                batch.lora.push(a, start..start + tokens.len());
            }
        }
        let t = model.forward(&batch, &mut cache)?;
        let v = model.backend().to_host(&t)?;
        let vocab = v.len() / seqs.len();
        *rows = v.chunks_exact(vocab).map(<[f32]>::to_vec).collect();
    }
    Ok(out)
}

fn lora_mix(a: LoraMixArgs) -> Result<()> {
    anyhow::ensure!(!a.ids.is_empty(), "--ids is empty");
    let m = a.model.load()?;
    let adapters = a
        .lora
        .iter()
        .enumerate()
        .map(|(i, dir)| {
            Ok(Some(std::sync::Arc::new(kiln_models::lora::load_peft(
                dir,
                &format!("lora{i}"),
                m.model.as_ref(),
            )?)))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut order = vec![None];
    order.extend(adapters.iter().cloned());
    order.extend(adapters.iter().rev().cloned());
    order.push(None);
    let seqs: Vec<Seq> = order
        .into_iter()
        .enumerate()
        .map(|(i, ad)| {
            let mut ids = a.ids.clone();
            ids.rotate_left(i % a.ids.len());
            (ids, ad)
        })
        .collect();
    let mixed = mixed_steps(m.model.as_ref(), &seqs)?;
    let mut rows = Vec::new();
    for (i, seq) in seqs.iter().enumerate() {
        let alone = mixed_steps(m.model.as_ref(), std::slice::from_ref(seq))?;
        let diff = |step: usize| {
            mixed[step][i]
                .iter()
                .zip(&alone[step][0])
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max)
        };
        let same = |step: usize| {
            mixed[step][i]
                .iter()
                .zip(&alone[step][0])
                .all(|(x, y)| x.to_bits() == y.to_bits())
        };
        rows.push(serde_json::json!({
            "row": i,
            "adapter": seq.1.as_ref().map(|a| a.name.clone()),
            "prefill_max_abs_logit_diff": diff(0),
            "prefill_bit_identical": same(0),
            "decode_max_abs_logit_diff": diff(1),
            "decode_bit_identical": same(1),
        }));
    }
    let report = serde_json::json!({
        "backend": m.model.backend().name(),
        "sequences": seqs.len(),
        "prompt_tokens": a.ids.len(),
        "rows": rows,
    });
    std::fs::write(&a.out, serde_json::to_string_pretty(&report)?)?;
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// Write a little-endian float32 `.npy` (format 1.0).
fn write_npy_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_str}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).with_context(|| path.display().to_string())?;
    Ok(())
}
