//! `kiln engine-worker` (hidden): the engine process `kiln serve` starts
//! for each model it serves in isolation. It loads the model as serve
//! would, then answers the server over the socket that is its standard
//! input ([`kiln_engine::serve_worker`]) until the server closes it.

use std::ffi::OsString;
use std::path::Path;

use anyhow::Result;
use clap::Args;

use crate::cli::{ModelArgs, SpeculativeArgs};

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The name the server serves the model under (for its log lines and
    /// `ps`).
    #[arg(long)]
    pub name: String,
    /// The model file or directory (resolved by the server).
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub device: String,
    #[arg(long, value_parser = crate::quantize::parse_quant_type)]
    pub quantize: Option<kiln_quant::QuantFormat>,
    /// The served context, as the server planned it.
    #[arg(long)]
    pub context: usize,
    /// The KV pool's bytes (none: what the device has free).
    #[arg(long)]
    pub kv_bytes: Option<usize>,
    /// Speculative decoding (the default model's flags).
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// Whether `speculative` applies.
    #[arg(long)]
    pub with_speculation: bool,
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel: u32,
    #[arg(long)]
    pub expert_parallel: bool,
}

pub fn run(a: WorkerArgs) -> Result<()> {
    let path = Path::new(&a.model).to_path_buf();
    let model_args = ModelArgs {
        model: Some(a.model.clone()),
        device: a.device.clone(),
        quantize: a.quantize,
        tensor_parallel: a.tensor_parallel,
        tp_transport: Default::default(),
        expert_parallel: a.expert_parallel,
        nodes: Default::default(),
    };
    let loaded = model_args.backend().and_then(|backend| {
        crate::serve::load_engine(
            &model_args,
            &path,
            backend,
            a.kv_bytes,
            a.context,
            None,
            a.with_speculation.then_some(&a.speculative),
        )
    });
    match loaded {
        Ok((engine, note)) => {
            eprintln!("kiln engine `{}`: {note}", a.name);
            kiln_engine::serve_worker(engine)?;
            Ok(())
        }
        Err(e) => {
            kiln_engine::report_load_failure(&format!("{e:#}"));
            Err(e)
        }
    }
}

/// The command that starts an engine process for these settings: this
/// binary in its engine mode, with the process's global flags (threads,
/// CPU products, KV dtype, CUDA options) passed on.
pub fn command(
    name: &str,
    path: &Path,
    model: &ModelArgs,
    context: usize,
    kv_bytes: Option<usize>,
    speculative: Option<&SpeculativeArgs>,
) -> Result<kiln_engine::WorkerCommand> {
    let program = std::env::current_exe()?;
    let mut args: Vec<OsString> = global_flags(std::env::args_os().skip(1));
    args.push("engine-worker".into());
    args.extend(["--name".into(), name.into()]);
    args.push("--model".into());
    args.push(path.as_os_str().to_owned());
    args.extend(["--device".into(), model.device.clone().into()]);
    if let Some(q) = model.quantize {
        args.extend(["--quantize".into(), q.name().into()]);
    }
    args.extend(["--context".into(), context.to_string().into()]);
    if model.tensor_parallel > 1 {
        args.extend([
            "--tensor-parallel".into(),
            model.tensor_parallel.to_string().into(),
        ]);
    }
    if model.expert_parallel {
        args.push("--expert-parallel".into());
    }
    if let Some(b) = kv_bytes {
        args.extend(["--kv-bytes".into(), b.to_string().into()]);
    }
    if let Some(s) = speculative {
        let method = match s.speculative {
            kiln_engine::SpeculativeMethod::Off => "off",
            kiln_engine::SpeculativeMethod::Ngram => "ngram",
            kiln_engine::SpeculativeMethod::Draft => "draft",
            kiln_engine::SpeculativeMethod::Mtp => "mtp",
        };
        args.push("--with-speculation".into());
        args.extend(["--speculative".into(), method.into()]);
        if let Some(d) = &s.draft_model {
            args.extend(["--draft-model".into(), d.into()]);
        }
        args.extend([
            "--speculative-tokens".into(),
            s.speculative_tokens.to_string().into(),
            "--speculative-max-batch".into(),
            s.speculative_max_batch.to_string().into(),
        ]);
    }
    Ok(kiln_engine::WorkerCommand {
        program,
        args,
        watchdog: None,
    })
}

/// The global flags among `args` (each with its value), in order.
fn global_flags(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    const GLOBAL: [&str; 4] = [
        "--threads",
        "--cuda-option",
        "--cpu-matmul",
        "--kv-cache-dtype",
    ];
    let args: Vec<OsString> = args.collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if let Some(flag) = GLOBAL
            .iter()
            .find(|f| a == **f || a.starts_with(&format!("{f}=")))
        {
            out.push(args[i].clone());
            if a == *flag && i + 1 < args.len() {
                out.push(args[i + 1].clone());
                i += 1;
            }
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_flags_are_passed_on() {
        let args = [
            "serve",
            "m.gguf",
            "--threads",
            "2",
            "--port",
            "0",
            "--cpu-matmul=fast",
            "--cuda-option",
            "A=1",
        ];
        let got: Vec<String> = global_flags(args.iter().map(OsString::from))
            .into_iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            got,
            [
                "--threads",
                "2",
                "--cpu-matmul=fast",
                "--cuda-option",
                "A=1"
            ]
        );
    }
}
