//! `kiln get`: download a model from the Hugging Face hub into its standard
//! cache (or check that a local file or directory is there), printing the
//! snapshot folder on stdout and progress on stderr, and register it in the
//! model registry. `ORG/NAME:Q4_K_M` takes one quantization of a GGUF
//! repository; a complete cached snapshot is used when the hub cannot be
//! reached (or with `HF_HUB_OFFLINE=1`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kiln_hub::{ByteSize, GetOptions, HubConfig, Progress, ProgressEvent, RepoSpec};

#[derive(Args, Debug)]
pub struct GetArgs {
    /// ORG/NAME[@REVISION][:QUANT] on the hub (revision: branch, tag or
    /// commit; default main; QUANT such as Q4_K_M picks that GGUF file of
    /// the repository), or a local GGUF file or model directory.
    pub model: String,
    /// Only files matching this glob (repeatable; `*` also matches `/`).
    #[arg(long)]
    pub include: Vec<String>,
    /// Leave out files matching this glob (repeatable).
    #[arg(long)]
    pub exclude: Vec<String>,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4)]
    pub jobs: usize,
}

pub fn run(a: GetArgs) -> Result<()> {
    let path = fetch(&a)?;
    println!("{}", path.display());
    Ok(())
}

/// `kiln get`: the folder (or GGUF file's snapshot folder) to load.
pub fn fetch(a: &GetArgs) -> Result<PathBuf> {
    if looks_local(&a.model) {
        return show_local(Path::new(&a.model));
    }
    let (repo, quant) = split_quant(&a.model);
    let spec = RepoSpec::parse(repo)?;
    let config = hub_config();
    let mut include = a.include.clone();
    if let Some(q) = quant {
        include.extend(quant_globs(q));
    }
    let options = GetOptions {
        include,
        exclude: a.exclude.clone(),
        num_workers: a.jobs.max(1),
        // Tests set this to exercise the disk-space check.
        free_bytes: std::env::var("KILN_TEST_FREE_BYTES")
            .ok()
            .and_then(|v| v.parse().ok()),
        ..GetOptions::default()
    };
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0");
    let cached = || cached_snapshot(&config.cache_dir, &spec, quant);
    if offline {
        let dir = cached().with_context(|| {
            format!(
                "HF_HUB_OFFLINE is set and {}@{} is not complete in {}",
                spec.repo_id,
                spec.revision,
                config.cache_dir.display()
            )
        })?;
        eprintln!(
            "kiln: offline (HF_HUB_OFFLINE): using the cached snapshot {}",
            dir.display()
        );
        return register_snapshot(&config.cache_dir, &dir);
    }
    eprintln!(
        "kiln: fetching {}@{} from {} into {}",
        spec.repo_id,
        spec.revision,
        config.endpoint,
        config.cache_dir.display()
    );
    let progress = Display::new();
    let snap = match kiln_hub::get(&config, &spec, &options, &progress) {
        Ok(snap) => snap,
        Err(e @ kiln_hub::HubError::Network { .. }) => {
            let Some(dir) = cached() else {
                return Err(e.into());
            };
            eprintln!(
                "kiln: {e}\nkiln: using the complete cached snapshot {}",
                dir.display()
            );
            return register_snapshot(&config.cache_dir, &dir);
        }
        Err(e) => {
            return Err(match quant {
                Some(q) => {
                    anyhow::Error::new(e).context(format!("no `{q}` GGUF file in {}", spec.repo_id))
                }
                None => e.into(),
            })
        }
    };
    progress.finish();
    eprintln!(
        "kiln: {} at {}: {} files, {} downloaded ({}) in {:.1}s",
        spec.repo_id,
        &snap.commit[..12],
        snap.files.len(),
        snap.num_downloaded,
        ByteSize(snap.bytes_downloaded),
        progress.start.elapsed().as_secs_f64()
    );
    register_snapshot(&config.cache_dir, &snap.dir)
}

/// Whether `s` reads as `ORG/NAME[@REVISION][:QUANT]` on the hub.
pub fn is_hub_id(s: &str) -> bool {
    !looks_local(s) && RepoSpec::parse(split_quant(s).0).is_ok()
}

/// `ORG/NAME[@REV]:QUANT` → (`ORG/NAME[@REV]`, `QUANT`); a colon is not
/// otherwise part of a repository id or revision.
fn split_quant(s: &str) -> (&str, Option<&str>) {
    match s.rsplit_once(':') {
        Some((repo, q)) if !q.is_empty() && !q.contains(['/', '@']) => (repo, Some(q)),
        _ => (s, None),
    }
}

/// Globs for the GGUF files of one quantization, in any letter case and
/// with `-`, `_` or `.` between its parts (`Q4_K_M` matches
/// `model-q4_k_m.gguf` and `model.Q4_K_M-00001-of-00002.gguf`, not
/// `model-IQ4_K_M.gguf`).
fn quant_globs(q: &str) -> Vec<String> {
    let tag: String = q
        .chars()
        .map(|c| match c {
            '_' | '-' | '.' => "[-_.]".to_string(),
            c if c.is_ascii_alphabetic() => {
                format!("[{}{}]", c.to_ascii_lowercase(), c.to_ascii_uppercase())
            }
            c => c.to_string(),
        })
        .collect();
    vec![format!("*[-_./]{tag}[-.]*gguf"), format!("{tag}[-.]*gguf")]
}

/// A snapshot of `spec` in the cache whose every file is there (no broken
/// link), holding a file of `quant` if one is asked for.
fn cached_snapshot(cache_dir: &Path, spec: &RepoSpec, quant: Option<&str>) -> Option<PathBuf> {
    let repo = kiln_hub::RepoCache::new(cache_dir, &spec.folder_name());
    let commit = if kiln_hub::is_commit_hash(&spec.revision) {
        spec.revision.clone()
    } else {
        std::fs::read_to_string(repo.root().join("refs").join(&spec.revision))
            .ok()?
            .trim()
            .to_string()
    };
    let dir = repo.snapshot_dir(&commit);
    let mut files = Vec::new();
    collect_files(&dir, &mut files).ok()?;
    if files.is_empty() {
        return None;
    }
    if let Some(q) = quant {
        let filter = kiln_hub::FileFilter::new(&quant_globs(q), &[]).ok()?;
        let wanted = files.iter().any(|f| {
            f.strip_prefix(&dir)
                .ok()
                .and_then(|p| p.to_str())
                .is_some_and(|p| filter.matches(p))
        });
        if !wanted {
            return None;
        }
    }
    Some(dir)
}

/// Every file under `dir`; an error for a link whose blob is missing.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let meta = std::fs::metadata(&path)?; // Follows the link to its blob.
        if meta.is_dir() {
            collect_files(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// Registers the models of a snapshot folder; returns the path to load:
/// the one model's (the folder, or its GGUF file), else the folder.
fn register_snapshot(cache_dir: &Path, dir: &Path) -> Result<PathBuf> {
    let reg = crate::registry::open()?;
    let mut paths = Vec::new();
    for found in kiln_registry::find_in_hub_cache(cache_dir)
        .into_iter()
        .filter(|f| f.path.starts_with(dir))
    {
        let entry = kiln_registry::entry_for(found);
        reg.upsert(&entry)?;
        eprintln!("kiln: registered {} ({})", entry.found.name, entry.tier());
        paths.push(entry.found.path);
    }
    Ok(match <[PathBuf; 1]>::try_from(paths) {
        Ok([one]) => one,
        Err(_) => dir.to_path_buf(),
    })
}

/// A path rather than a repository id: starts like one, or exists.
fn looks_local(s: &str) -> bool {
    s.starts_with(['/', '.', '~']) || Path::new(s).exists()
}

fn show_local(path: &Path) -> Result<PathBuf> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("{} is not a file or directory here", path.display()))?;
    let full = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    if meta.is_dir() {
        eprintln!(
            "kiln: {} is a local model directory; nothing to download",
            full.display()
        );
    } else {
        eprintln!(
            "kiln: {} is a local file ({}); nothing to download",
            full.display(),
            ByteSize(meta.len())
        );
    }
    let entry = crate::registry::register_local(&full)?;
    let what = match (&entry.info, &entry.problem) {
        (Some(i), _) => format!("{}, {}", i.model_type, entry.tier()),
        (None, Some(p)) => format!("unreadable: {p}"),
        (None, None) => entry.tier().to_string(),
    };
    eprintln!("kiln: registered {} ({what})", entry.found.name);
    Ok(full)
}

/// The hub settings, read as `huggingface_hub` reads them.
pub fn hub_config() -> HubConfig {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let hf_home = var("HF_HOME").unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .or_else(|| var("HOME").map(|h| h.join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("huggingface")
    });
    let cache_dir = var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .unwrap_or_else(|| hf_home.join("hub"));
    // HF_TOKEN, else the token `hf auth login` saved.
    let token = std::env::var("HF_TOKEN")
        .ok()
        .or_else(|| std::fs::read_to_string(hf_home.join("token")).ok())
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    HubConfig {
        endpoint: std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| kiln_hub::DEFAULT_ENDPOINT.to_string()),
        token,
        cache_dir,
    }
}

/// One status line, redrawn on a terminal; a line per file otherwise.
struct Display {
    tty: bool,
    start: Instant,
    total: AtomicU64,
    done: AtomicU64,
    last_draw: Mutex<Instant>,
}

impl Display {
    fn new() -> Display {
        Display {
            tty: std::io::stderr().is_terminal(),
            start: Instant::now(),
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            last_draw: Mutex::new(Instant::now()),
        }
    }

    fn draw(&self) {
        let done = self.done.load(Ordering::Relaxed);
        let total = self.total.load(Ordering::Relaxed).max(1);
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        eprint!(
            "\r\x1b[Kdownloading: {:3}% {} of {} ({}/s)",
            done * 100 / total,
            ByteSize(done),
            ByteSize(total),
            ByteSize((done as f64 / secs) as u64)
        );
    }

    fn finish(&self) {
        if self.tty && self.total.load(Ordering::Relaxed) > 0 {
            self.draw();
            eprintln!();
        }
    }
}

impl Progress for Display {
    fn event(&self, e: &ProgressEvent<'_>) {
        match *e {
            ProgressEvent::Resolved {
                commit,
                num_files,
                total_bytes,
                missing_bytes,
            } => {
                self.total.store(missing_bytes, Ordering::Relaxed);
                eprintln!(
                    "kiln: commit {commit}: {num_files} files, {}, {} to download",
                    ByteSize(total_bytes),
                    ByteSize(missing_bytes)
                );
            }
            ProgressEvent::FileStarted {
                path,
                size,
                resumed_from,
            } if resumed_from > 0 && !self.tty => {
                eprintln!(
                    "kiln: resuming {path} at {} of {}",
                    ByteSize(resumed_from),
                    ByteSize(size)
                );
            }
            ProgressEvent::FileStarted { .. } => {}
            ProgressEvent::Bytes { num_bytes, .. } => {
                self.done.fetch_add(num_bytes, Ordering::Relaxed);
                if self.tty {
                    let mut last = self.last_draw.lock().unwrap_or_else(|p| p.into_inner());
                    if last.elapsed().as_millis() >= 100 {
                        *last = Instant::now();
                        self.draw();
                    }
                }
            }
            ProgressEvent::FileDone {
                path,
                size,
                downloaded,
            } => {
                if !self.tty {
                    let how = if downloaded { "downloaded" } else { "cached" };
                    eprintln!("kiln: {how} {path} ({})", ByteSize(size));
                }
            }
        }
    }
}
