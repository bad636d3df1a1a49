//! `kiln`: run open-weight language models from the command line.
//!
//! This binary is the only place that reads environment variables, sets up
//! threads and prints. Subcommands: `generate`, `chat`, `bench`, `serve`,
//! `run`, `convert`, `get`, `scan`, `ls`, `rm`, `fit`, `dev random-checkpoint`.

mod bench;
mod bench_engine;
mod chat;
mod chat_input;
mod cli;
mod convert;
mod cuda_env;
mod dev;
mod fit;
mod generate;
mod get;
mod logging;
mod quantize;
mod registry;
mod run;
mod serve;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command};

/// When the process started (for "start to first token" figures).
pub static PROCESS_START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn main() {
    PROCESS_START.get_or_init(std::time::Instant::now);
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    cuda_env::set_flags(&cli.cuda_options)?;
    let _ = cli::CPU_MATMUL.set(cli.cpu_matmul);
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Run(a) => run::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchEngine(a) => bench_engine::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Get(a) => get::run(a),
        Command::Scan(a) => registry::scan(a),
        Command::Ls(a) => registry::ls(a),
        Command::Rm(a) => registry::rm(a),
        Command::Fit(a) => fit::run(a),
        Command::Dev(d) => dev::run(d),
    }
}
