//! The registry of the CUDA backend's options: every knob, its default and
//! what it does, in one table ([`KNOBS`]), set by an environment variable or
//! by `--cuda-option NAME=VALUE` (the variable's name, with or without its
//! `KILN_` prefix, any case; a flag wins over the environment). The binary
//! is the only place that reads them; it builds a [`CudaOptions`] here and
//! hands it to `kiln_cuda::CudaBackend::new` (whose fields document the
//! same settings from the library's side). Unset or empty means the
//! default; a value that is not understood is an error naming the knob.

use std::sync::OnceLock;

use anyhow::{bail, Result};
use kiln_cuda::CudaOptions;

/// One environment variable and the [`CudaOptions`] field it sets.
pub struct Knob {
    pub var: &'static str,
    pub default: &'static str,
    pub help: &'static str,
    set: Set,
}

/// How a variable's value becomes its field.
enum Set {
    /// An on/off switch: `1` or `0` (also true/false, on/off, yes/no).
    Switch(fn(&mut CudaOptions) -> &mut bool),
    /// Any other value, parsed by the function.
    Parse(fn(&mut CudaOptions, &str) -> Result<()>),
}

/// Every environment variable the CUDA backend's options come from.
pub const KNOBS: &[Knob] = &[
    Knob {
        var: "KILN_PDL",
        default: "1",
        help: "programmatic dependent launch on sm_90+ (kernels overlap their neighbours); 0 launches strictly in turn",
        set: Set::Switch(|o| &mut o.pdl),
    },
    Knob {
        var: "KILN_CUDA_GRAPHS",
        default: "1",
        help: "record decode steps as CUDA graphs and replay them; 0 runs every step eagerly",
        set: Set::Switch(|o| &mut o.graphs),
    },
    Knob {
        var: "KILN_PINNED_STAGING",
        default: "1",
        help: "upload weights through two pinned 64 MiB buffers; 0 copies from pageable memory",
        set: Set::Switch(|o| &mut o.pinned_staging),
    },
    Knob {
        var: "KILN_DEVICE_SAMPLING",
        default: "1",
        help: "sample on the GPU (every sampling parameter); 0 samples on the host",
        set: Set::Switch(|o| &mut o.device_sampling),
    },
    Knob {
        var: "KILN_DECODE_FUSED",
        default: "1",
        help: "split decode attention combines its partitions in the last block to finish; 0 runs the separate reduce kernel",
        set: Set::Switch(|o| &mut o.decode_combine_in_kernel),
    },
    Knob {
        var: "KILN_DECODE_VPRE_SPLIT",
        default: "1",
        help: "split decode steps load each chunk's first values with its keys; 0 loads them apart",
        set: Set::Switch(|o| &mut o.decode_vpre_split),
    },
    Knob {
        var: "KILN_DIRECT_COLS",
        default: "",
        help: "tile width (8 or 16 columns) of the decode GEMV's plain products; unset lets the host rule pick",
        set: Set::Parse(|o, v| {
            o.direct_cols = Some(one_of("KILN_DIRECT_COLS", v, &[8, 16])?);
            Ok(())
        }),
    },
    Knob {
        var: "KILN_DECODE_PARTITION_KEYS",
        default: "32",
        help: "fewest keys a split decode attention partition takes",
        set: Set::Parse(|o, v| {
            o.decode_partition_keys = positive("KILN_DECODE_PARTITION_KEYS", v)?;
            Ok(())
        }),
    },
    Knob {
        var: "KILN_DECODE_TARGET_BLOCKS",
        default: "256",
        help: "blocks split decode attention aims for over a step's rows and KV heads",
        set: Set::Parse(|o, v| {
            o.decode_target_blocks = positive("KILN_DECODE_TARGET_BLOCKS", v)?;
            Ok(())
        }),
    },
    Knob {
        var: "KILN_QGEMV_BLOCKS_PER_SM",
        default: "2",
        help: "blocks a multiprocessor the block-quantized decode products launch, one wave (each stages x once)",
        set: Set::Parse(|o, v| {
            o.qgemv_blocks_per_sm = positive("KILN_QGEMV_BLOCKS_PER_SM", v)?;
            Ok(())
        }),
    },
    Knob {
        var: "KILN_LORA_MMA_ROWS",
        default: "",
        help: "LoRA deltas of steps of at least this many rows run on the tensor cores (prefill; 128 intended); unset: none, until a round has timed those kernels (they pass cuda-check)",
        set: Set::Parse(|o, v| {
            o.lora_mma_rows = positive("KILN_LORA_MMA_ROWS", v)?;
            Ok(())
        }),
    },
    Knob {
        var: "KILN_LORA_EXPAND8",
        default: "0",
        help: "LoRA's expands take 8 adjacent columns a thread (16-byte pieces, 8 products a staged value); 0 keeps one column a thread, until a GPU has checked and timed them",
        set: Set::Switch(|o| &mut o.lora_expand8),
    },
    Knob {
        var: "KILN_FP8_ACTIVATIONS",
        default: "1",
        help: "FP8 weights' prefill and batched products on the FP8 tensor cores, activations rounded to E4M3 (W8A8); 0 keeps them exact (dequantized bf16 slabs)",
        set: Set::Switch(|o| &mut o.fp8_activations),
    },
    Knob {
        var: "KILN_CUDA_RECURRENT",
        default: "1",
        help: "hybrid models' recurrent layers (DeltaNet, short convolutions) on the GPU; 0 refuses such models at load",
        set: Set::Switch(|o| &mut o.recurrent),
    },
    Knob {
        var: "KILN_DELTA_CHUNK_ROWS",
        default: "64",
        help: "steps in which a sequence has at least this many new tokens run the delta rule chunk-parallel (prefill); fewer go token by token",
        set: Set::Parse(|o, v| {
            o.delta_chunk_rows = positive("KILN_DELTA_CHUNK_ROWS", v)?;
            Ok(())
        }),
    },
    Knob {
        var: "KILN_KERNEL_DEFINES",
        default: "",
        help: "NAME=VALUE overrides of kernels' #ifndef tuning macros, separated by blanks or +, for timing experiments",
        set: Set::Parse(|o, v| {
            o.kernel_defines = v.to_string();
            Ok(())
        }),
    },
];

/// A positive count's value (at most 2^20).
fn positive(var: &str, v: &str) -> Result<usize> {
    match v.parse::<usize>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
        _ => bail!("{var}={v:?}: expected a positive count"),
    }
}

/// A value that must be one of `allowed`.
fn one_of(var: &str, v: &str, allowed: &[usize]) -> Result<usize> {
    match v.parse::<usize>() {
        Ok(n) if allowed.contains(&n) => Ok(n),
        _ => {
            let list: Vec<String> = allowed.iter().map(|n| n.to_string()).collect();
            bail!("{var}={v:?}: expected {}", list.join(" or "))
        }
    }
}

/// An on/off switch's value.
fn switch(var: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => bail!("{var}={v:?}: expected 0 or 1"),
    }
}

/// The options `get` (a variable's value, if set) asks for.
pub fn cuda_options_from(get: impl Fn(&str) -> Option<String>) -> Result<CudaOptions> {
    let mut options = CudaOptions::default();
    for knob in KNOBS {
        if let Some(v) = get(knob.var).filter(|v| !v.is_empty()) {
            let v = v.trim();
            match knob.set {
                Set::Switch(field) => *field(&mut options) = switch(knob.var, v)?,
                Set::Parse(parse) => parse(&mut options, v)?,
            }
        }
    }
    Ok(options)
}

/// `--cuda-option` values, by variable name (set once by `main`).
static FLAGS: OnceLock<Vec<(&'static str, String)>> = OnceLock::new();

/// `NAME=VALUE` flags as (variable, value) pairs; an unknown name is an
/// error listing the known ones.
fn parse_flags(flags: &[String]) -> Result<Vec<(&'static str, String)>> {
    flags
        .iter()
        .map(|f| {
            let Some((name, value)) = f.split_once('=') else {
                bail!("--cuda-option {f:?}: expected NAME=VALUE");
            };
            let upper = name.trim().to_ascii_uppercase();
            let var = KNOBS
                .iter()
                .map(|k| k.var)
                .find(|v| *v == upper || v.strip_prefix("KILN_") == Some(upper.as_str()));
            match var {
                Some(var) => Ok((var, value.trim().to_string())),
                None => {
                    let known: Vec<&str> = KNOBS.iter().map(|k| k.var).collect();
                    bail!("--cuda-option {name:?} is not one of {}", known.join(", "))
                }
            }
        })
        .collect()
}

/// Takes this process's `--cuda-option` flags (checked now, so a bad one
/// fails before any model loads).
pub fn set_flags(flags: &[String]) -> Result<()> {
    let parsed = parse_flags(flags)?;
    cuda_options_from(|var| lookup(&parsed, var))?;
    let _ = FLAGS.set(parsed);
    Ok(())
}

fn lookup(flags: &[(&'static str, String)], var: &str) -> Option<String> {
    flags
        .iter()
        .rev()
        .find(|(v, _)| *v == var)
        .map(|(_, value)| value.clone())
}

/// A knob's value here: its flag, else its environment variable.
fn value(var: &str) -> Option<String> {
    FLAGS
        .get()
        .and_then(|f| lookup(f, var))
        .or_else(|| std::env::var(var).ok())
}

/// The options this process's flags and environment ask for.
pub fn cuda_options() -> Result<CudaOptions> {
    cuda_options_from(value)
}

/// The table of [`KNOBS`] for `kiln dev cuda-options`: each variable, its
/// default, its value here (flag or environment), and what it does; an
/// error if a value set here is not understood.
pub fn describe() -> Result<String> {
    cuda_options()?;
    let mut out = String::new();
    for knob in KNOBS {
        let now = value(knob.var).unwrap_or_default();
        let show = |v: &str| {
            if v.is_empty() {
                "-".to_string()
            } else {
                v.to_string()
            }
        };
        out.push_str(&format!(
            "{:24} default {:4} set {:8} {}\n",
            knob.var,
            show(knob.default),
            show(&now),
            knob.help
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(pairs: &[(&str, &str)]) -> Result<CudaOptions> {
        cuda_options_from(|var| {
            pairs
                .iter()
                .find(|(k, _)| *k == var)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn an_empty_environment_gives_the_defaults() {
        assert_eq!(from(&[]).unwrap(), CudaOptions::default());
        assert_eq!(from(&[("KILN_PDL", "")]).unwrap(), CudaOptions::default());
    }

    #[test]
    fn every_knob_sets_its_field() {
        let o = from(&[
            ("KILN_PDL", "0"),
            ("KILN_CUDA_GRAPHS", "0"),
            ("KILN_PINNED_STAGING", "0"),
            ("KILN_DEVICE_SAMPLING", "0"),
            ("KILN_DECODE_FUSED", "0"),
            ("KILN_DECODE_VPRE_SPLIT", "0"),
            ("KILN_DIRECT_COLS", "16"),
            ("KILN_DECODE_PARTITION_KEYS", "128"),
            ("KILN_DECODE_TARGET_BLOCKS", "64"),
            ("KILN_QGEMV_BLOCKS_PER_SM", "3"),
            ("KILN_FP8_ACTIVATIONS", "0"),
            ("KILN_LORA_MMA_ROWS", "1"),
            ("KILN_LORA_EXPAND8", "1"),
            ("KILN_CUDA_RECURRENT", "0"),
            ("KILN_DELTA_CHUNK_ROWS", "32"),
            ("KILN_KERNEL_DEFINES", "KILN_DIRECT_U=3+KILN_DECODE_GB=8"),
        ])
        .unwrap();
        assert_eq!(
            o,
            CudaOptions {
                pdl: false,
                graphs: false,
                pinned_staging: false,
                device_sampling: false,
                decode_combine_in_kernel: false,
                decode_vpre_split: false,
                direct_cols: Some(16),
                decode_partition_keys: 128,
                decode_target_blocks: 64,
                qgemv_blocks_per_sm: 3,
                // Set by --kv-cache-dtype, not by a variable.
                kv_cache_fp8: false,
                fp8_activations: false,
                recurrent: false,
                delta_chunk_rows: 32,
                lora_mma_rows: 1,
                lora_expand8: true,
                kernel_defines: "KILN_DIRECT_U=3+KILN_DECODE_GB=8".into(),
            }
        );
        // Every knob in the table was set above: a new one needs a case.
        assert_eq!(KNOBS.len(), 16);
        assert!(from(&[("KILN_DECODE_PARTITION_KEYS", "0")]).is_err());
    }

    #[test]
    fn flags_name_knobs_with_or_without_the_prefix_and_win_over_the_environment() {
        let flags = parse_flags(&[
            "cuda_graphs=0".into(),
            "KILN_PDL = 0".into(),
            "direct_cols=8".into(),
        ])
        .unwrap();
        let env = [("KILN_PDL", "1"), ("KILN_DEVICE_SAMPLING", "0")];
        let o = cuda_options_from(|var| {
            lookup(&flags, var).or_else(|| {
                env.iter()
                    .find(|(k, _)| *k == var)
                    .map(|(_, v)| v.to_string())
            })
        })
        .unwrap();
        assert!(!o.graphs && !o.pdl && !o.device_sampling, "{o:?}");
        assert_eq!(o.direct_cols, Some(8));
        let err = parse_flags(&["graphs=0".into()]).unwrap_err().to_string();
        assert!(err.contains("KILN_CUDA_GRAPHS"), "lists the knobs: {err}");
        assert!(parse_flags(&["pdl".into()]).is_err(), "no value");
        assert!(
            set_flags(&["pdl=maybe".into()]).is_err(),
            "checked when set"
        );
    }

    #[test]
    fn a_value_not_understood_names_its_variable() {
        let err = from(&[("KILN_PDL", "maybe")]).unwrap_err().to_string();
        assert!(err.contains("KILN_PDL") && err.contains("maybe"), "{err}");
        let err = from(&[("KILN_DIRECT_COLS", "12")]).unwrap_err().to_string();
        assert!(err.contains("KILN_DIRECT_COLS"), "{err}");
    }
}
