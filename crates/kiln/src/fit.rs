//! `kiln fit`: will a model fit here (or in `--memory-bytes`)? The memory
//! equation of `kiln_engine::memory` from the model's headers alone, as a
//! breakdown or JSON, with the longest context and the largest batch that
//! fit. `kiln serve` applies the same check before loading.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kiln_engine::memory::{fit, ContextSource, FitInput, FitReport, MemoryTarget};
use kiln_formats::gguf_hf::GgufWeights;
use kiln_formats::safetensors_dir::SafetensorsDir;
use kiln_formats::weights::WeightSource;
use kiln_models::ModelConfig;
use kiln_tensor::Backend;
use kiln_tensor::{QuantFormat, WeightKind};
use serde_json::json;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct FitArgs {
    /// A GGUF file, a model directory, or a registered model's name.
    pub model: Option<String>,
    /// Tokens per sequence (default: what `kiln serve` would choose, the
    /// longest the KV pool holds at --batch, at most the trained length).
    #[arg(long)]
    pub context: Option<usize>,
    /// A fixed KV pool in MiB, as `kiln serve --kv-mib` (default: sized
    /// from what is free, as serve does).
    #[arg(long)]
    pub kv_mib: Option<u64>,
    /// Sequences at once.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Where it would run: cpu, cuda, cuda:N, or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Plan against this many free bytes instead of measuring them (for
    /// planning another machine, and for tests).
    #[arg(long)]
    pub memory_bytes: Option<u64>,
    /// Plan for `--quantize` at load: q8_0, q4_0, q4_k, q5_k, q6_k, fp8
    /// (int8, int4: q8_0, q4_0).
    #[arg(long, value_parser = crate::quantize::parse_quant_type)]
    pub quantize: Option<QuantFormat>,
    /// Count LoRA adapters (PEFT directories) kept in memory beside the
    /// model (repeatable).
    #[arg(long)]
    pub lora: Vec<String>,
    /// Plan one rank of a model split over N GPUs (tensor parallel): its
    /// share of the weights and KV heads, on each device's memory (CPU
    /// ranks share one memory: the whole model is planned); a degree the
    /// model's heads or sizes do not split over is refused.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tensor_parallel: u32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn mem_available() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .context("no MemAvailable in /proc/meminfo; pass --memory-bytes")
}

/// Bytes of the weight files: the GGUF file, or a directory's safetensors.
fn file_bytes(path: &Path) -> u64 {
    if path.is_file() {
        return std::fs::metadata(path).map_or(0, |m| m.len());
    }
    std::fs::read_dir(path)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .filter_map(|e| std::fs::metadata(e.path()).ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The bytes a backend holds for every 2-D weight the file stores in
/// a block format (GGUF's quantized types, F16, BF16), by Hugging Face
/// name: on the CPU the quantized ones as it repacks them at load (16-row
/// groups), F16 and BF16 as stored; on a device (`on_device`) all as stored.
pub(crate) fn block_bytes(
    path: &Path,
    config: &ModelConfig,
    quantize: Option<QuantFormat>,
    on_device: bool,
) -> Result<HashMap<String, u64>> {
    let tensors = if path.is_file() {
        GgufWeights::open(path)?.tensors()
    } else {
        SafetensorsDir::open(path)?.tensors()
    };
    let held = |format: QuantFormat, rows: usize, cols: usize, stored: u64| match on_device {
        true => stored,
        false => {
            kiln_tensor::cpu::quant::packed_bytes(format, rows, cols).map_or(stored, |b| b as u64)
        }
    };
    // Blocks a family stores under names of its own (gpt-oss's MXFP4
    // experts), counted under the names of the weights they hold.
    let mut out = HashMap::new();
    for t in &tensors {
        for b in kiln_models::stored_blocks(config, t)? {
            let stored = b
                .format
                .row_bytes(b.cols)
                .map_or(0, |r| (r * b.rows) as u64);
            out.insert(b.name, held(b.format, b.rows, b.cols, stored));
        }
    }
    out.extend(tensors.into_iter().filter_map(|mut t| {
        // `--quantize` holds the matrices it applies to in its format.
        if let Some(f) = quantize.and_then(|f| kiln_formats::quantizing::target_format(f, &t)) {
            t.dtype = f.name().to_string();
        }
        let format = QuantFormat::from_name(&t.dtype)?;
        let &[rows, cols] = t.shape.as_slice() else {
            return None;
        };
        // The CPU repacks blocks (`packed_bytes`); a device keeps a
        // file's blocks as stored (the same bytes, split in two arrays).
        let stored = format
            .row_bytes(cols)
            .map_or(t.num_bytes, |b| (b * rows) as u64);
        Some((t.name, held(format, rows, cols, stored)))
    }));
    Ok(out)
}

/// Where memory is counted: the target and what is free there.
pub fn target_for(
    device: &str,
    backend: Option<&Arc<dyn Backend>>,
    memory_bytes: Option<u64>,
) -> Result<(MemoryTarget, u64)> {
    if device == "cpu" {
        let avail = match memory_bytes {
            Some(b) => b,
            None => mem_available()?,
        };
        // The CPU cache's element (`--kv-cache-dtype`).
        let kv_bytes_per_element = match backend {
            Some(b) if b.device_memory().is_none() => b.kv_bytes_per_element(),
            _ => crate::cli::backend_for("cpu")?.kv_bytes_per_element(),
        };
        let target = MemoryTarget {
            kv_bytes_per_element,
            ..MemoryTarget::cpu()
        };
        return Ok((target, avail));
    }
    let opened;
    let backend = match backend {
        Some(b) => b,
        None => match crate::cli::backend_for(device) {
            Ok(b) => {
                opened = b;
                &opened
            }
            // Planning a card this machine lacks (`--memory-bytes` says its
            // size): the CUDA backend's defaults, its context counted in.
            Err(_) if device.starts_with("cuda") && memory_bytes.is_some() => {
                let mut target = MemoryTarget::cuda(false);
                if crate::cli::KV_CACHE_DTYPE.get() == Some(&crate::cli::KvCacheDtype::Fp8) {
                    target.kv_bytes_per_element = 1;
                }
                return Ok((target, memory_bytes.unwrap_or(0)));
            }
            Err(e) => return Err(e),
        },
    };
    match backend.device_memory() {
        Some(m) => {
            let target = MemoryTarget {
                weight_bytes_per_element: backend.weight_bytes_per_element(),
                keeps_blocks: backend.supports_weight(WeightKind::Blocks(QuantFormat::Q8_0)),
                kv_bytes_per_element: backend.kv_bytes_per_element(),
                ..MemoryTarget::cuda(memory_bytes.is_none())
            };
            Ok((target, memory_bytes.unwrap_or(m.free_bytes)))
        }
        None => target_for("cpu", None, memory_bytes),
    }
}

/// What to plan for: where, against how much memory, and the sizes asked.
pub struct FitQuery {
    pub target: MemoryTarget,
    pub available_bytes: u64,
    /// `None`: the longest the pool holds.
    pub context: Option<usize>,
    pub batch: usize,
    /// `--kv-mib` in bytes.
    pub kv_pool_bytes: Option<u64>,
    /// `--quantize`: float matrices counted in this format.
    pub quantize: Option<QuantFormat>,
    /// What LoRA adapters may hold.
    pub adapter_bytes: u64,
    /// Ranks the model is split over (1: whole); the plan is one rank's.
    pub tensor_parallel: usize,
}

/// The memory plan for the model at `path` (`kiln fit` prints it, `kiln
/// serve` runs it).
pub fn check(path: &Path, q: &FitQuery) -> Result<FitReport> {
    let config = kiln_registry::hf_config(path)?;
    let config = ModelConfig::from_hf(&config)
        .with_context(|| format!("reading the config of {}", path.display()))?;
    let mut blocks = block_bytes(path, &config, q.quantize, q.target.on_device)?;
    let config = match q.tensor_parallel {
        0 | 1 => config,
        // CPU ranks share one memory: the whole model is what it holds
        // (a rank's pool is its share of the planned one).
        n if !q.target.on_device => {
            kiln_models::tp::check_degree(&config, n)
                .with_context(|| format!("splitting {} over {n} ranks", path.display()))?;
            config
        }
        n => {
            let rank = kiln_models::tp::shard_config(&config, 0, n, false)
                .with_context(|| format!("splitting {} over {n} ranks", path.display()))?;
            rank_share(&config, &rank, &mut blocks)?;
            rank
        }
    };
    let input = FitInput {
        context: q.context,
        config: &config,
        target: q.target,
        batch: q.batch,
        kv_pool_bytes: q.kv_pool_bytes,
        available_bytes: q.available_bytes,
        file_bytes: match q.target.on_device {
            true => file_bytes(path) / q.tensor_parallel.max(1) as u64,
            false => file_bytes(path),
        },
        block_bytes: &blocks,
        adapter_bytes: q.adapter_bytes,
    };
    Ok(fit(&input)?)
}

/// `blocks` (a whole model's block weights' bytes, by name) cut to what
/// one rank of `rank`'s split holds: each weight's bytes in the ratio of
/// its rank shape to its whole shape.
fn rank_share(
    whole: &ModelConfig,
    rank: &ModelConfig,
    blocks: &mut HashMap<String, u64>,
) -> Result<()> {
    let full: HashMap<String, Vec<usize>> =
        kiln_models::tensor_shapes(whole)?.into_iter().collect();
    for (name, shape) in kiln_models::tensor_shapes(rank)? {
        if let (Some(b), Some(f)) = (blocks.get_mut(&name), full.get(&name)) {
            let (part, all) = (shape.iter().product::<usize>(), f.iter().product::<usize>());
            *b = (*b as u128 * part as u128 / all.max(1) as u128) as u64;
        }
    }
    Ok(())
}

pub fn report_json(path: &Path, r: &FitReport) -> serde_json::Value {
    let overheads: serde_json::Map<String, serde_json::Value> = r
        .overheads
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    json!({
        "model": path.display().to_string(),
        "device": if r.on_device { "cuda" } else { "cpu" },
        "context": r.context,
        "context_source": match r.context_source {
            ContextSource::Requested => "requested",
            ContextSource::Trained => "trained",
            ContextSource::Memory => "memory",
        },
        "trained_context": r.trained_context,
        "kv_pool_bytes": r.kv_pool_bytes,
        "batch": r.batch,
        "weights_bytes": r.weights_bytes,
        "decode_weight_bytes": r.decode_weight_bytes,
        "weights_in_place_bytes": r.weights_in_place_bytes,
        "weights_blocks_bytes": r.weights_blocks_bytes,
        "kv_bytes_per_token": r.kv_bytes_per_token,
        "kv_bytes": r.kv_bytes,
        "kv_full_attention_bytes": r.kv_full_attention_bytes,
        "kv_chunk_bytes": r.kv_chunk_bytes,
        "activation_bytes": r.activation_bytes,
        "loading_bytes": r.loading_bytes,
        "overheads": overheads,
        "total_bytes": r.total_bytes,
        "available_bytes": r.available_bytes,
        "fits": r.fits,
        "max_context": r.max_context,
        "max_batch": r.max_batch,
    })
}

pub fn run(a: FitArgs) -> Result<()> {
    let path = ModelArgs {
        model: a.model.clone(),
        device: a.device.clone(),
        quantize: a.quantize,
        tensor_parallel: a.tensor_parallel,
        tp_transport: Default::default(),
        expert_parallel: false,
        nodes: Default::default(),
    }
    .path()?;
    let (target, available_bytes) = target_for(&a.device, None, a.memory_bytes)?;
    let query = FitQuery {
        target,
        available_bytes,
        context: a.context,
        batch: a.batch,
        kv_pool_bytes: a.kv_mib.map(|m| m << 20),
        quantize: a.quantize,
        adapter_bytes: a
            .lora
            .iter()
            .map(|p| kiln_models::lora::peft_bytes(std::path::Path::new(p)))
            .sum::<Result<u64, _>>()?,
        tensor_parallel: a.tensor_parallel as usize,
    };
    let report = check(&path, &query)?;
    if a.json {
        let mut j = report_json(&path, &report);
        j["tensor_parallel"] = json!(a.tensor_parallel);
        println!("{j}");
    } else {
        match a.tensor_parallel {
            1 => println!("{}:", path.display()),
            n => println!(
                "{} split over {n} ranks (tensor parallel); each rank's device:",
                path.display()
            ),
        }
        print!("{report}");
    }
    if !report.fits {
        // The verdict is the exit status too, for scripts.
        std::process::exit(1);
    }
    Ok(())
}
