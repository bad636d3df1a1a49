//! Every kernel compiles with NVRTC to PTX for sm_90, on a machine with no
//! GPU: a kernel that does not compile never lands. NVRTC and the CUDA
//! headers come from PyPI wheels that `scripts/test.sh` installs into
//! `$KILN_CUDA_HOME` (and puts on `LD_LIBRARY_PATH`).

use std::path::PathBuf;

use kiln_cuda::{
    kernels::{block_entry_points, compile_units, expand, ENTRY_POINTS, SOURCES},
    KernelCompiler,
};

fn cuda_home() -> PathBuf {
    let home = std::env::var_os("KILN_CUDA_HOME")
        .map(PathBuf::from)
        .expect(
        "KILN_CUDA_HOME is not set: run the tests through scripts/test.sh, which installs NVRTC",
    );
    assert!(
        kiln_cuda::nvrtc_available(),
        "NVRTC does not load: scripts/test.sh puts {}/nvidia/cu13/lib on LD_LIBRARY_PATH",
        home.display()
    );
    home
}

fn compiler(cache: Option<PathBuf>) -> KernelCompiler {
    let inc = cuda_home().join("nvidia/cu13/include");
    KernelCompiler {
        arch: "compute_90",
        include_paths: vec![inc.clone(), inc.join("cccl")],
        cache_dir: cache,
        defines: String::new(),
        machine: None,
    }
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm90_with_every_entry_point() {
    let c = compiler(None);
    let mut ptx = String::new();
    for (name, k) in compile_units(&c) {
        let k = k.unwrap_or_else(|e| panic!("{e}"));
        assert!(k.ptx.contains(".target sm_90"), "{name}: PTX targets sm_90");
        ptx.push_str(&k.ptx);
    }
    // Every kernel the backend launches is an entry point of some source.
    let blocks = block_entry_points();
    for entry in ENTRY_POINTS
        .iter()
        .copied()
        .chain(blocks.iter().map(|s| s.as_str()))
    {
        assert!(
            ptx.contains(&format!(".entry {entry}(")),
            "entry {entry} in the PTX"
        );
    }
}

/// Every source compiles to machine code for Ampere (sm_80, the oldest
/// GPU the backend takes): ptxas rejects instructions newer than the
/// target — FP8 conversions need sm_89 — where PTX for sm_90 says nothing.
#[test]
fn every_kernel_compiles_to_machine_code_for_ampere() {
    let c = KernelCompiler {
        arch: "compute_80",
        machine: Some("sm_80"),
        ..compiler(None)
    };
    for (name, k) in compile_units(&c) {
        let k = k.unwrap_or_else(|e| panic!("{name} for sm_80: {e}"));
        assert!(k.cubin.is_some(), "{name}: machine code for sm_80");
    }
}

#[test]
fn compiled_ptx_is_cached_by_source_arch_and_nvrtc_version() {
    let dir = std::env::temp_dir().join(format!("kiln-ptx-cache-{}", std::process::id()));
    let c = compiler(Some(dir.clone()));
    // A few small units (every unit compiles in the test above).
    let some = || -> Vec<_> {
        SOURCES[..3]
            .iter()
            .map(|(name, src)| c.compile(name, &expand(src)).unwrap())
            .collect()
    };
    let first = some();
    assert!(first.iter().all(|k| !k.cached && k.cubin.is_none()));
    let second = some();
    assert!(
        second.iter().all(|k| k.cached),
        "a second start compiles nothing"
    );
    assert_eq!(first[0].ptx, second[0].ptx);
    // A changed source is a different key.
    let changed = c
        .compile(
            SOURCES[0].0,
            &format!("{}\n// edit\n", expand(SOURCES[0].1)),
        )
        .unwrap();
    assert!(!changed.cached);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_exact_architecture_gets_machine_code_cached_beside_the_ptx() {
    let dir = std::env::temp_dir().join(format!("kiln-cubin-cache-{}", std::process::id()));
    let c = KernelCompiler {
        machine: Some("sm_90"),
        ..compiler(Some(dir.clone()))
    };
    let (name, src) = SOURCES[0];
    let first = c.compile(name, &expand(src)).unwrap();
    let cubin = first.cubin.clone().expect("machine code for sm_90");
    assert_eq!(&cubin[..4], b"\x7fELF", "a CUBIN is an ELF image");
    assert!(
        first.ptx.contains(".entry"),
        "the PTX names the entry points"
    );
    let second = c.compile(name, &expand(src)).unwrap();
    assert!(second.cached);
    assert_eq!(second.cubin.as_deref(), Some(&cubin[..]));
    // PTX-only and machine-code compilations are different cache entries.
    let ptx_only = compiler(Some(dir.clone()))
        .compile(name, &expand(src))
        .unwrap();
    assert!(!ptx_only.cached && ptx_only.cubin.is_none());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_log() {
    let c = compiler(None);
    let err = c
        .compile(
            "broken",
            "extern \"C\" __global__ void f() { undefined_thing(); }",
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("broken") && msg.contains("undefined_thing"),
        "{msg}"
    );
}

#[test]
fn no_driver_is_reported_not_a_crash() {
    // On CI machines there is no GPU: the check must answer, not panic.
    let _ = kiln_cuda::driver_available();
}
