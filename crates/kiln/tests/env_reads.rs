//! Nothing below the binary reads environment variables: the libraries take
//! their settings in option structs that `crates/kiln` builds (for CUDA,
//! `crates/kiln/src/cuda_env.rs`). This test reads every library source
//! file (tests, examples, benches and `#[cfg(test)] mod tests` excepted) and
//! fails on any `env::var*` call in one.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src` up to its unit-test module, if it has one.
fn without_unit_tests(src: &str) -> &str {
    src.find("#[cfg(test)]\nmod tests")
        .map_or(src, |at| &src[..at])
}

/// The lines of `src` that read the environment at run time
/// (`option_env!` and `env!` are compile time and allowed).
fn env_reads(src: &str) -> Vec<(usize, String)> {
    without_unit_tests(src)
        .lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or("");
            code.contains("env::var")
        })
        .map(|(i, line)| (i + 1, line.trim().to_string()))
        .collect()
}

#[test]
fn no_library_crate_reads_environment_variables() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&crates)
        .expect("the crates directory")
        .flatten()
    {
        if entry.file_name() != "kiln" {
            rust_files(&entry.path().join("src"), &mut files);
        }
    }
    assert!(
        files.iter().any(|f| f.ends_with("kiln-cuda/src/lib.rs")),
        "the library sources were found ({} files)",
        files.len()
    );
    let mut found = Vec::new();
    for file in &files {
        let src = std::fs::read_to_string(file).expect("a readable source file");
        for (line, text) in env_reads(&src) {
            found.push(format!("{}:{line}: {text}", file.display()));
        }
    }
    assert!(
        found.is_empty(),
        "environment read below the binary (pass the setting in an options struct \
         built in crates/kiln instead):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scan_sees_every_form_of_env_read() {
    for read in [
        "let v = std::env::var(\"X\");",
        "let v = std::env::var_os(\"X\");",
        "for (k, v) in std::env::vars() {}",
        "use std::env::var;",
        "let v = env::var(\"X\");",
    ] {
        assert_eq!(env_reads(read).len(), 1, "{read}");
    }
    assert!(env_reads("let v = option_env!(\"X\");").is_empty());
    assert!(env_reads("// std::env::var in a comment").is_empty());
    let with_tests =
        "fn f() {}\n#[cfg(test)]\nmod tests {\n    fn g() { std::env::var(\"X\"); }\n}\n";
    assert!(env_reads(with_tests).is_empty());
}

#[test]
fn kiln_dev_cuda_options_lists_every_variable_and_refuses_a_bad_value() {
    let run = |pdl: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["dev", "cuda-options"])
            .env("KILN_PDL", pdl)
            .output()
            .expect("kiln runs")
    };
    let out = run("0");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    for var in [
        "KILN_PDL",
        "KILN_CUDA_GRAPHS",
        "KILN_PINNED_STAGING",
        "KILN_DEVICE_SAMPLING",
        "KILN_DECODE_FUSED",
        "KILN_DECODE_VPRE_SPLIT",
        "KILN_DIRECT_COLS",
        "KILN_KERNEL_DEFINES",
    ] {
        assert!(table.contains(var), "{var} in\n{table}");
    }
    let pdl = table
        .lines()
        .find(|l| l.starts_with("KILN_PDL"))
        .unwrap_or("");
    assert!(pdl.contains("set 0"), "{pdl}");
    let out = run("sometimes");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("KILN_PDL") && err.contains("sometimes"),
        "{err}"
    );
}
