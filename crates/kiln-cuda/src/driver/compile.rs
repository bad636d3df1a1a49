//! Run-time compilation of Kiln's kernels with NVRTC, cached on disk.

use std::path::{Path, PathBuf};

use std::ffi::CString;

use super::{nvrtc_available, nvrtc_version, CudaError};

/// PTX for one kernel source, and its machine code when the compiler was
/// given the GPU's exact architecture.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub name: String,
    pub ptx: String,
    /// CUBIN for [`KernelCompiler::machine`]: the module loads without the
    /// driver's (single-threaded) PTX compilation.
    pub cubin: Option<Vec<u8>>,
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
    /// The GPU's exact architecture (`sm_90`): NVRTC then also compiles the
    /// PTX to machine code, in the calling thread, so that units compiled
    /// in parallel load at once. `None`: PTX only (the driver compiles it
    /// at load).
    pub machine: Option<&'static str>,
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
        let target = self.machine.unwrap_or(self.arch);
        let key = format!(
            "{name}-{target}-nvrtc{major}.{minor}-{:016x}",
            fnv1a(src.as_bytes())
        );
        if let Some(dir) = &self.cache_dir {
            let ptx = std::fs::read_to_string(dir.join(format!("{key}.ptx")));
            let cubin = match self.machine {
                Some(_) => std::fs::read(dir.join(format!("{key}.cubin"))).map(Some),
                None => Ok(None),
            };
            if let (Ok(ptx), Ok(cubin)) = (ptx, cubin) {
                return Ok(CompiledKernel {
                    name: name.to_string(),
                    ptx,
                    cubin,
                    cached: true,
                });
            }
        }
        let (ptx, cubin) = self.nvrtc(name, &src, target)?;
        if let Some(dir) = &self.cache_dir {
            if let Some(c) = &cubin {
                write_atomic(dir, &format!("{key}.cubin"), c)?;
            }
            write_atomic(dir, &format!("{key}.ptx"), ptx.as_bytes())?;
        }
        Ok(CompiledKernel {
            name: name.to_string(),
            ptx,
            cubin,
            cached: false,
        })
    }

    /// One NVRTC compilation of `src` for `target`: its PTX, and its CUBIN
    /// when `target` is a machine architecture.
    fn nvrtc(
        &self,
        name: &str,
        src: &str,
        target: &str,
    ) -> Result<(String, Option<Vec<u8>>), CudaError> {
        use cudarc::nvrtc::{result, sys};
        let fail = |log: String| CudaError::Compile {
            kernel: name.to_string(),
            arch: target.to_string(),
            log,
        };
        let csrc = CString::new(src).map_err(|e| fail(format!("{e}")))?;
        let cname = CString::new(format!("{name}.cu")).map_err(|e| fail(format!("{e}")))?;
        let prog =
            result::create_program(&csrc, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
        let mut opts = vec![
            format!("--gpu-architecture={target}"),
            "--std=c++17".to_string(),
        ];
        opts.extend(
            self.include_paths
                .iter()
                .map(|p| format!("--include-path={}", p.display())),
        );
        // SAFETY: `prog` was created above and is destroyed once, below.
        let out = unsafe {
            let compiled = result::compile_program(prog, &opts);
            let out = match compiled {
                Err(_) => {
                    let log = result::get_program_log(prog)
                        .map(|l| c_chars_to_string(&l))
                        .unwrap_or_default();
                    Err(fail(log))
                }
                Ok(()) => result::get_ptx(prog)
                    .map_err(|e| fail(format!("{e:?}")))
                    .and_then(|ptx| {
                        let cubin = if target.starts_with("sm_") {
                            let mut size = 0usize;
                            sys::nvrtcGetCUBINSize(prog, &mut size)
                                .result()
                                .map_err(|e| fail(format!("{e:?}")))?;
                            let mut bin = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut std::ffi::c_char)
                                .result()
                                .map_err(|e| fail(format!("{e:?}")))?;
                            Some(bin)
                        } else {
                            None
                        };
                        Ok((c_chars_to_string(&ptx), cubin))
                    }),
            };
            let _ = result::destroy_program(prog);
            out
        };
        out
    }
}

/// A NUL-terminated C string buffer as a `String`.
fn c_chars_to_string(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
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

fn write_atomic(dir: &Path, key: &str, bytes: &[u8]) -> Result<(), CudaError> {
    let err = |source| CudaError::Cache {
        path: dir.join(key),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{key}.{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(err)?;
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
