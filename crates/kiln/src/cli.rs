//! Command-line arguments and the glue from them to engine types.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use kiln_engine::LoadedModel;
use kiln_sampling::{NgramRepeat, SamplingParams, TokenId};
use kiln_tensor::cpu::quant::CpuMatmul;
use kiln_tensor::cpu::{CpuBackend, CpuKvDtype};

/// The file the default model is fetched to by `scripts/fetch-models.sh`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[derive(Parser, Debug)]
#[command(name = "kiln", version, about = "Run open-weight language models")]
pub struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    /// A CUDA backend option as NAME=VALUE (repeatable; `kiln dev
    /// cuda-options` lists them; wins over the environment variable).
    #[arg(long = "cuda-option", global = true, value_name = "NAME=VALUE")]
    pub cuda_options: Vec<String>,
    /// How the CPU multiplies by quantized weights: `exact` (f32
    /// activations, batch-invariant, the default) or `fast` (prefill and
    /// batched products in bf16 on AMX or AVX512-BF16, where the CPU has
    /// one; decode rows stay exact; not batch-invariant).
    #[arg(long, global = true, default_value = "exact", value_parser = parse_cpu_matmul)]
    pub cpu_matmul: CpuMatmul,
    /// How the KV cache stores keys and values: `auto` (the backend's own:
    /// f32 on the CPU, bf16 on CUDA), `f16` (CPU: half the bytes, each
    /// value rounded to f16 when written; still batch-invariant, not the
    /// goldens' bits) or `fp8` (E4M3 at unit scale, CPU and CUDA: half of
    /// bf16's bytes, a quarter of f32's, so that many more tokens a pool).
    #[arg(long, global = true, default_value = "auto", value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: KvCacheDtype,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a completion for one prompt.
    Generate(crate::generate::GenerateArgs),
    /// Sentence embeddings of texts, one JSON array a line.
    Embed(crate::embed::EmbedArgs),
    /// Chat with a model interactively, streaming its answers.
    Chat(crate::chat::ChatArgs),
    /// Chat with a model by name, fetching ORG/NAME[:QUANT] from the hub
    /// first if it is not here.
    Run(crate::run::RunArgs),
    /// Measure prefill and decode speed.
    Bench(crate::bench::BenchArgs),
    /// Measure the engine loop: throughput under concurrency, cached-prefix TTFT.
    BenchEngine(crate::bench_engine::BenchEngineArgs),
    /// Measure speculative decoding against plain decoding on one workload.
    BenchSpec(crate::bench_spec::BenchSpecArgs),
    /// Serve the OpenAI API over HTTP.
    Serve(crate::serve::ServeArgs),
    /// Convert a GGUF file to a Hugging Face safetensors directory.
    Convert(crate::convert::ConvertArgs),
    /// Write a Hugging Face checkpoint (or a float GGUF) as a quantized GGUF.
    Quantize(crate::quantize::QuantizeArgs),
    /// Download a model from the Hugging Face hub into its cache (ORG/NAME[@REVISION]).
    Get(crate::get::GetArgs),
    /// Register the models in the hub cache, ./models and the given paths.
    Scan(crate::registry::ScanArgs),
    /// List registered models (one row per repository).
    Ls(crate::registry::LsArgs),
    /// Forget a registered model (optionally deleting its cached files).
    Rm(crate::registry::RmArgs),
    /// Will a model fit: weights, KV cache, activations and overhead
    /// against free memory.
    Fit(crate::fit::FitArgs),
    /// Developer tools.
    #[command(subcommand)]
    Dev(crate::dev::DevCommand),
    /// The engine process `kiln serve` starts for each model (internal).
    #[command(hide = true)]
    EngineWorker(crate::engine_worker::WorkerArgs),
}

/// Which model to load.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, a Hugging Face model directory, or a query naming one
    /// registered model (`kiln ls`). Default: the SmolLM2 model in
    /// $KILN_MODELS_DIR (or ./models).
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Where to run: cpu, cuda, cuda:N, or auto (a usable GPU, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Quantize the model's float matrices as it loads: q8_0, q4_0, q4_k,
    /// q5_k, q6_k, fp8 (E4M3 in runs of 128 under an f32 scale), or int8 /
    /// int4 (q8_0 / q4_0); matrices already quantized
    /// keep their blocks.
    #[arg(long, value_parser = crate::quantize::parse_quant_type)]
    pub quantize: Option<kiln_quant::QuantFormat>,
    /// Split the model over N ranks (tensor parallel; llama- and
    /// moe-family models): N GPUs from --device's on, over NCCL; on the
    /// CPU, N ranks sharing its threads. Each rank holds its shard of the
    /// weights and of the KV cache.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tensor_parallel: u32,
    /// How GPU ranks exchange: nccl (one GPU a rank), or host (through
    /// host memory, ranks may share a GPU; for checking the split).
    #[arg(long, value_enum, default_value_t = TpTransport::Nccl)]
    pub tp_transport: TpTransport,
    /// With --tensor-parallel on a Mixture-of-Experts model: each rank
    /// holds a run of whole experts instead of a slice of every expert.
    #[arg(long)]
    pub expert_parallel: bool,
    #[command(flatten)]
    pub nodes: crate::nodes::NodeArgs,
}

/// Include directories for NVRTC: $KILN_CUDA_HOME's wheel layout, then
/// $CUDA_HOME, then /usr/local/cuda.
fn cuda_include_paths() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(h) = std::env::var_os("KILN_CUDA_HOME") {
        let inc = PathBuf::from(h).join("nvidia/cu13/include");
        out.push(inc.join("cccl"));
        out.push(inc);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            out.push(PathBuf::from(h).join("include"));
        }
    }
    out.push(PathBuf::from("/usr/local/cuda/include"));
    out.into_iter().filter(|p| p.exists()).collect()
}

/// Open GPU `ordinal` with kernels cached under `~/.cache/kiln/kernels`
/// and the options flags and environment set (`cuda_env.rs`).
pub fn cuda_backend(ordinal: usize) -> Result<kiln_cuda::CudaBackend> {
    let cache_dir = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln/kernels"));
    let compiler = kiln_cuda::KernelCompiler {
        arch: "compute_90",
        include_paths: cuda_include_paths(),
        cache_dir,
        defines: String::new(),
        machine: None,
    };
    let mut options = crate::cuda_env::cuda_options()?;
    options.kv_cache_fp8 = kv_cache_dtype() == KvCacheDtype::Fp8;
    let b = kiln_cuda::CudaBackend::new(ordinal, compiler, options)
        .with_context(|| format!("--device cuda:{ordinal}"))?;
    eprintln!("kiln: running on {} (cuda:{ordinal})", b.device_name);
    for w in kiln_tensor::Backend::warnings(&b) {
        eprintln!("kiln: warning: {w}");
    }
    Ok(b)
}

fn parse_cpu_matmul(s: &str) -> Result<CpuMatmul, String> {
    match s {
        "exact" => Ok(CpuMatmul::Exact),
        "fast" => Ok(CpuMatmul::Fast),
        other => Err(format!("unknown --cpu-matmul {other:?} (exact, fast)")),
    }
}

/// `--kv-cache-dtype`: the backend's own, a CPU-only element, or FP8 (both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    Cpu(CpuKvDtype),
    /// E4M3 keys and values (`kiln_cuda::CudaOptions::kv_cache_fp8`,
    /// `CpuKvDtype::Fp8`).
    Fp8,
}

impl KvCacheDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Cpu(d) => d.name(),
            KvCacheDtype::Fp8 => "fp8",
        }
    }
}

fn parse_kv_cache_dtype(s: &str) -> Result<KvCacheDtype, String> {
    match s {
        "auto" => Ok(KvCacheDtype::Auto),
        "f32" => Ok(KvCacheDtype::Cpu(CpuKvDtype::F32)),
        "f16" => Ok(KvCacheDtype::Cpu(CpuKvDtype::F16)),
        "fp8" => Ok(KvCacheDtype::Fp8),
        other => Err(format!(
            "unknown --kv-cache-dtype {other:?} (auto, f32, f16, fp8)"
        )),
    }
}

/// `--kv-cache-dtype`, set once by `main` before any backend is made.
pub static KV_CACHE_DTYPE: std::sync::OnceLock<KvCacheDtype> = std::sync::OnceLock::new();

fn kv_cache_dtype() -> KvCacheDtype {
    KV_CACHE_DTYPE.get().copied().unwrap_or_default()
}

/// `--cpu-matmul`, set once by `main` before any backend is made.
pub static CPU_MATMUL: std::sync::OnceLock<CpuMatmul> = std::sync::OnceLock::new();

/// The CPU backend `--cpu-matmul` asks for (saying so when `fast` cannot run here).
pub(crate) fn cpu_backend() -> CpuBackend {
    let mode = CPU_MATMUL.get().copied().unwrap_or_default();
    if mode == CpuMatmul::Fast && !CpuMatmul::fast_available() {
        eprintln!(
            "kiln: --cpu-matmul fast needs AMX-BF16 or AVX512-BF16, which this CPU lacks; running exact"
        );
    }
    let kv = match kv_cache_dtype() {
        KvCacheDtype::Cpu(d) => d,
        KvCacheDtype::Fp8 => CpuKvDtype::Fp8,
        KvCacheDtype::Auto => CpuKvDtype::default(),
    };
    CpuBackend::with_matmul(mode).with_kv_dtype(kv)
}

/// The backend `--device` names.
pub fn backend_for(device: &str) -> Result<Arc<dyn kiln_tensor::Backend>> {
    let cuda = |ordinal: usize| -> Result<Arc<dyn kiln_tensor::Backend>> {
        if let KvCacheDtype::Cpu(d) = kv_cache_dtype() {
            anyhow::bail!(
                "--kv-cache-dtype {} is a CPU option: the CUDA backend keeps its KV cache in bf16 (auto) or fp8",
                d.name()
            );
        }
        Ok(Arc::new(cuda_backend(ordinal)?))
    };
    let cpu = || -> Result<Arc<dyn kiln_tensor::Backend>> { Ok(Arc::new(cpu_backend())) };
    match device {
        "cpu" => cpu(),
        "cuda" => cuda(0),
        "auto" => {
            if kiln_cuda::driver_available() {
                match cuda(0) {
                    Ok(b) => return Ok(b),
                    Err(e) => eprintln!("kiln: no usable GPU ({e:#}); running on the CPU"),
                }
            }
            cpu()
        }
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => cuda(n),
            None => anyhow::bail!("unknown --device {other:?} (cpu, cuda, cuda:N, auto)"),
        },
    }
}

/// How the ranks of a tensor-parallel group on GPUs reach each other.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TpTransport {
    /// NCCL, one GPU a rank (--device cuda:K: GPUs K to K+N-1).
    #[default]
    Nccl,
    /// Host memory: ranks may share a GPU and steps run eagerly — to
    /// check the split on a machine with fewer GPUs than ranks.
    Host,
}

/// The `n` ranks of a tensor-parallel group on `device`: on the CPU, ranks
/// of an in-process group, each on its share of the threads; on GPUs, one
/// backend a rank with NCCL communicators made together by this process.
/// Whether tensor-parallel ranks on `device` are CPU ranks.
pub(crate) fn tensor_parallel_on_cpu(device: &str) -> Result<bool> {
    Ok(match device {
        "cpu" => true,
        "auto" => !kiln_cuda::driver_available(),
        "cuda" => false,
        other => {
            first_gpu(other)?;
            false
        }
    })
}

/// The first GPU `device` names (`cuda`, `auto`: 0; `cuda:K`: K).
pub(crate) fn first_gpu(device: &str) -> Result<usize> {
    match device {
        "cuda" | "auto" => Ok(0),
        other => match other.strip_prefix("cuda:").and_then(|k| k.parse().ok()) {
            Some(k) => Ok(k),
            None => anyhow::bail!("unknown --device {other:?} (cpu, cuda, cuda:N, auto)"),
        },
    }
}

fn tensor_parallel_backends(
    device: &str,
    n: usize,
    transport: TpTransport,
) -> Result<Vec<Arc<dyn kiln_tensor::Backend>>> {
    if tensor_parallel_on_cpu(device)? {
        let group = kiln_tensor::HostGroup::new(n);
        let threads = (rayon::current_num_threads() / n).max(1);
        return (0..n)
            .map(|r| -> Result<Arc<dyn kiln_tensor::Backend>> {
                Ok(Arc::new(cpu_backend().in_group(
                    group.clone(),
                    r,
                    threads,
                )?))
            })
            .collect();
    }
    let first = first_gpu(device)?;
    let gpus = kiln_cuda::device_count();
    let ordinals: Vec<usize> = match transport {
        TpTransport::Host => (0..n).map(|r| (first + r) % gpus.max(1)).collect(),
        TpTransport::Nccl => {
            if first + n > gpus {
                anyhow::bail!(
                    "--tensor-parallel {n} from cuda:{first} needs {} GPUs, this machine has {gpus} \
                     (--tp-transport host puts several ranks on one GPU, to check the split)",
                    first + n
                );
            }
            (first..first + n).collect()
        }
    };
    let mut groups: Vec<kiln_cuda::CudaGroup> = match transport {
        TpTransport::Nccl => kiln_cuda::nccl_ranks(&ordinals)?
            .into_iter()
            .map(kiln_cuda::CudaGroup::Nccl)
            .collect(),
        TpTransport::Host => {
            let g = kiln_tensor::HostGroup::new(n);
            (0..n)
                .map(|rank| {
                    kiln_cuda::CudaGroup::Host(kiln_tensor::HostRank {
                        group: g.clone(),
                        rank,
                    })
                })
                .collect()
        }
    };
    ordinals
        .iter()
        .zip(groups.drain(..))
        .map(|(&o, g)| -> Result<Arc<dyn kiln_tensor::Backend>> {
            Ok(Arc::new(cuda_backend(o)?.in_group(g)))
        })
        .collect()
}

impl ModelArgs {
    /// The model's path: the default model, an existing path, or the one
    /// registered model the query names.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(q) => crate::registry::resolve_model(q),
            None => {
                let path = crate::registry::models_dir().join(DEFAULT_MODEL_FILE);
                if !path.exists() {
                    anyhow::bail!(
                        "the default model {} is missing: run scripts/fetch-models.sh, or pass a model",
                        path.display()
                    );
                }
                Ok(path)
            }
        }
    }

    pub fn load(&self) -> Result<LoadedModel> {
        self.load_on(self.backend()?)
    }

    pub fn backend(&self) -> Result<Arc<dyn kiln_tensor::Backend>> {
        backend_for(&self.device)
    }

    /// Load onto a given backend (e.g. a profiling wrapper), or with
    /// `--tensor-parallel N` onto the N ranks of `--device` instead.
    pub fn load_on(&self, backend: Arc<dyn kiln_tensor::Backend>) -> Result<LoadedModel> {
        let path = self.path()?;
        if self.nodes.nnodes > 1 && self.nodes.node_rank > 0 {
            // A following node serves nothing: it runs node 0's steps.
            crate::nodes::follow(self)?;
            std::process::exit(0);
        }
        let (backends, followers) = match (self.tensor_parallel, self.nodes.nnodes) {
            (0 | 1, _) => (vec![backend], None),
            (n, 1) => (
                tensor_parallel_backends(&self.device, n as usize, self.tp_transport)?,
                None,
            ),
            (n, _) => {
                let j =
                    crate::nodes::join(&self.nodes, &self.device, n as usize, self.tp_transport)?;
                match j.role {
                    crate::nodes::Role::Leader(f) => (j.backends, Some(f)),
                    crate::nodes::Role::Follower(_) => unreachable!("node 0 leads"),
                }
            }
        };
        let bar = LoadBar::new();
        let progress = |done: u64, total: u64| bar.update(done, total);
        let loaded = LoadedModel::load_nodes(
            &path,
            backends,
            followers,
            self.expert_parallel,
            Some(&progress),
            self.quantize,
        )
        .with_context(|| format!("loading {}", path.display()));
        bar.finish();
        loaded
    }
}

/// A progress bar over the weights' bytes on stderr while a model loads,
/// when stderr is a terminal (nothing otherwise).
struct LoadBar {
    bar: Option<indicatif::ProgressBar>,
}

impl LoadBar {
    fn new() -> Self {
        let bar = std::io::IsTerminal::is_terminal(&std::io::stderr()).then(|| {
            let bar = indicatif::ProgressBar::with_draw_target(
                None,
                indicatif::ProgressDrawTarget::stderr(),
            );
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "loading weights {wide_bar} {binary_bytes}/{binary_total_bytes} ({eta})",
                )
                .expect("the progress template is valid; this is a bug"),
            );
            bar
        });
        LoadBar { bar }
    }

    fn update(&self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            if bar.length() != Some(total) {
                bar.set_length(total);
            }
            bar.set_position(done);
        }
    }

    /// Clears the bar (the caller says how the load went).
    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Sampling flags shared by `generate`, `chat` and `bench`.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Token bias as ID=BIAS (repeatable).
    #[arg(long, value_parser = parse_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Stop strings (repeatable); never part of the output.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Return this many top alternatives with each token's logprob.
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Stop after this many identical tokens in a row.
    #[arg(long)]
    pub max_consecutive_identical: Option<usize>,
    /// Stop when an N-gram repeats K times: N,K.
    #[arg(long, value_parser = parse_ngram)]
    pub ngram_repeat: Option<(usize, usize)>,
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, b) = s.split_once('=').ok_or("expected ID=BIAS")?;
    Ok((
        id.trim().parse().map_err(|e| format!("token id: {e}"))?,
        b.trim().parse().map_err(|e| format!("bias: {e}"))?,
    ))
}

fn parse_ngram(s: &str) -> Result<(usize, usize), String> {
    let (n, k) = s.split_once(',').ok_or("expected N,K")?;
    Ok((
        n.trim().parse().map_err(|e| format!("N: {e}"))?,
        k.trim().parse().map_err(|e| format!("K: {e}"))?,
    ))
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self
                .logit_bias
                .iter()
                .map(|&(t, b)| (TokenId(t), b))
                .collect(),
            seed: self.seed,
            max_tokens: Some(self.max_tokens),
            stop: self.stop.clone(),
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            max_consecutive_identical: self.max_consecutive_identical,
            ngram_repeat: self
                .ngram_repeat
                .map(|(ngram_len, num_repeats)| NgramRepeat {
                    ngram_len,
                    num_repeats,
                }),
        }
    }
}

/// Speculative decoding flags (`serve`, `generate`, `bench`).
#[derive(clap::Args, Debug, Clone)]
pub struct SpeculativeArgs {
    /// Guess tokens and verify them in the decode step: ngram (prompt
    /// lookup), draft (a smaller model, --draft-model), mtp (the model's
    /// own multi-token-prediction head: Qwen3.5, Qwen3-Next), or off. Requests
    /// with an OpenAI `prediction` verify it under any setting. Outputs are
    /// the same as without.
    #[arg(long, default_value = "off")]
    pub speculative: kiln_engine::SpeculativeMethod,
    /// The draft model for --speculative draft: a GGUF file, a Hugging Face
    /// directory or a registry query, with the target's tokenizer.
    #[arg(long)]
    pub draft_model: Option<String>,
    /// The most guessed tokens a request verifies in one step (the length
    /// adapts to each request's acceptance below it).
    #[arg(long, default_value_t = kiln_engine::speculative::DEFAULT_NUM_TOKENS)]
    pub speculative_tokens: usize,
    /// No request speculates in a step while more than this many run.
    #[arg(long, default_value_t = kiln_engine::speculative::DEFAULT_MAX_BATCH)]
    pub speculative_max_batch: usize,
}

impl SpeculativeArgs {
    pub fn config(&self) -> kiln_engine::SpeculativeConfig {
        kiln_engine::SpeculativeConfig {
            method: self.speculative,
            num_tokens: self.speculative_tokens.max(1),
            max_batch: self.speculative_max_batch,
            ..kiln_engine::SpeculativeConfig::default()
        }
    }

    /// Whether requests go through the engine to speculate.
    pub fn on(&self) -> bool {
        self.speculative != kiln_engine::SpeculativeMethod::Off
    }

    /// The draft model, loaded on `backend` (none without --draft-model).
    pub fn load_draft(
        &self,
        backend: Arc<dyn kiln_tensor::Backend>,
    ) -> Result<Option<LoadedModel>> {
        let Some(q) = &self.draft_model else {
            return Ok(None);
        };
        let path = crate::registry::resolve_model(q)?;
        let m = LoadedModel::load(&path, backend)
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        Ok(Some(m))
    }
}
