//! `kiln`: run open-weight language models from the command line.
//!
//! This binary is the only place that reads environment variables, sets up
//! threads and prints. Subcommands: `generate`, `chat`, `bench`, `serve`,
//! `run`, `convert`, `get`, `scan`, `ls`, `rm`, `fit`, `dev random-checkpoint`.

mod bench;
mod bench_engine;
mod bench_spec;
mod chat;
mod chat_input;
mod cli;
mod convert;
mod cuda_env;
mod dev;
mod embed;
mod engine_worker;
mod fit;
mod generate;
mod get;
mod logging;
mod nodes;
mod quantize;
mod registry;
mod run;
mod serve;
mod serve_pool;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command};

/// When the process started (for "start to first token" figures).
pub static PROCESS_START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn main() {
    PROCESS_START.get_or_init(std::time::Instant::now);
    tune_malloc();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// glibc's allocator tuned for CPU steps, before any thread starts.
///
/// One arena for the process: CPU steps run on the compute pool's threads
/// (`StepRecording::run_step`), and with glibc's arena per thread the
/// activations one step frees on one thread are not reused by the next
/// step on another: measured SmolLM2 at a 2,000-token prompt peaking 10 %
/// above what `kiln fit` plans, and at the plan with one arena.
///
/// Activations up to 32 MiB from the heap, which keeps up to 512 MiB freed
/// before giving it back: each op's output was a fresh mapping, faulted in
/// page by page and unmapped after — measured all-MiniLM-L6-v2 embedding
/// 512 sentences with 1.5 s of the 4.2 s in the kernel zeroing pages, 0.2
/// s of 3.1 s without; Qwen2.5-1.5B prefill +3 %. The peak is unchanged
/// (freed memory is reused, not added to).
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_TRIM_THRESHOLD: std::ffi::c_int = -1;
        const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
        const M_ARENA_MAX: std::ffi::c_int = -8;
        extern "C" {
            fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
        }
        // SAFETY: mallopt only sets allocator parameters; no other thread
        // exists yet.
        unsafe {
            mallopt(M_ARENA_MAX, 1);
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 512 << 20);
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    cuda_env::set_flags(&cli.cuda_options)?;
    let _ = cli::CPU_MATMUL.set(cli.cpu_matmul);
    let _ = cli::KV_CACHE_DTYPE.set(cli.kv_cache_dtype);
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Embed(a) => embed::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Run(a) => run::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchEngine(a) => bench_engine::run(a),
        Command::BenchSpec(a) => bench_spec::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Get(a) => get::run(a),
        Command::Scan(a) => registry::scan(a),
        Command::Ls(a) => registry::ls(a),
        Command::Rm(a) => registry::rm(a),
        Command::Fit(a) => fit::run(a),
        Command::Dev(d) => dev::run(d),
        Command::EngineWorker(a) => engine_worker::run(a),
    }
}
