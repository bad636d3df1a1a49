//! Run-time compilation of Kiln's kernels with NVRTC, cached on disk.

use std::path::{Path, PathBuf};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

use super::{nvrtc_available, nvrtc_version, CudaError};

/// PTX for one kernel source.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub name: String,
    pub ptx: String,
    /// Whether it came from the disk cache.
    pub cached: bool,
}

/// Compiles kernel sources for one architecture (`compute_90` for Hopper),
/// with the CUDA headers' include directories, caching PTX under `cache_dir`;
/// `defines` overrides tuning macros ([`crate::CudaOptions::kernel_defines`]).
#[derive(Debug, Clone)]
pub struct KernelCompiler {
    pub arch: &'static str,
    pub include_paths: Vec<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub defines: String,
}

/// 64-bit FNV-1a: a stable content hash for cache keys.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl KernelCompiler {
    /// Compile `name`'s source (its local includes already expanded:
    /// [`expand`]), from the cache when possible.
    pub fn compile(&self, name: &str, src: &str) -> Result<CompiledKernel, CudaError> {
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        let src = with_defines(src, &self.defines);
        let (major, minor) = nvrtc_version().ok_or(CudaError::NoNvrtc)?;
        let key = format!(
            "{name}-{}-nvrtc{major}.{minor}-{:016x}.ptx",
            self.arch,
            fnv1a(src.as_bytes())
        );
        if let Some(dir) = &self.cache_dir {
            if let Ok(ptx) = std::fs::read_to_string(dir.join(&key)) {
                return Ok(CompiledKernel {
                    name: name.to_string(),
                    ptx,
                    cached: true,
                });
            }
        }
        let opts = CompileOptions {
            arch: Some(self.arch),
            include_paths: self
                .include_paths
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
            options: vec!["--std=c++17".into()],
            name: Some(format!("{name}.cu")),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(&src, opts)
            .map_err(|e| CudaError::Compile {
                kernel: name.to_string(),
                arch: self.arch.to_string(),
                log: match e {
                    CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                    other => format!("{other:?}"),
                },
            })?
            .to_src();
        if let Some(dir) = &self.cache_dir {
            write_atomic(dir, &key, &ptx)?;
        }
        Ok(CompiledKernel {
            name: name.to_string(),
            ptx,
            cached: false,
        })
    }
}

/// `src` with its local includes (`#include "name"` of a header in
/// `headers`) expanded, once each.
pub fn expand(src: &str, headers: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(src.len() + 4096);
    for line in src.lines() {
        let included = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .and_then(|name| headers.iter().find(|(h, _)| *h == name));
        match included {
            Some((_, header)) => {
                out.push_str(&header.replace("#pragma once", ""));
                out.push('\n');
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

fn write_atomic(dir: &Path, key: &str, ptx: &str) -> Result<(), CudaError> {
    let err = |source| CudaError::Cache {
        path: dir.join(key),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{key}.{}", std::process::id()));
    std::fs::write(&tmp, ptx).map_err(err)?;
    std::fs::rename(&tmp, dir.join(key)).map_err(err)
}

/// `src` with `#define NAME VALUE` lines in front for the `defines` it names
/// (`NAME=VALUE` pairs separated by blanks or `+`; a bare `NAME` is
/// `NAME=1`): a kernel's `#ifndef NAME` tuning defaults are overridden only
/// in the sources that mention the name, so only their cache keys (the
/// source hash) change.
fn with_defines(src: &str, defines: &str) -> String {
    let mut head = String::new();
    for d in defines
        .split(|c: char| c.is_whitespace() || c == '+')
        .filter(|d| !d.is_empty())
    {
        let (name, value) = d.split_once('=').unwrap_or((d, "1"));
        if src.contains(name) {
            head.push_str(&format!("#define {name} {value}\n"));
        }
    }
    head + src
}

#[cfg(test)]
mod tests {
    use super::with_defines;

    #[test]
    fn defines_go_only_into_sources_that_name_them() {
        let src = "#ifndef KNOB_A\n#define KNOB_A 1\n#endif\n";
        assert_eq!(
            with_defines(src, "KNOB_A=3+KNOB_B=2 KNOB_C"),
            format!("#define KNOB_A 3\n{src}")
        );
        assert_eq!(with_defines(src, "KNOB_B=2"), src);
        assert_eq!(
            with_defines("KNOB_C", " KNOB_C "),
            "#define KNOB_C 1\nKNOB_C"
        );
    }
}
