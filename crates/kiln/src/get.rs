//! `kiln get`: download a model from the Hugging Face hub into its standard
//! cache (or check that a local file or directory is there), printing the
//! snapshot folder on stdout and progress on stderr. A local path is
//! registered in the model registry instead.

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
    /// ORG/NAME[@REVISION] on the hub (revision: branch, tag or commit; default main),
    /// or a local GGUF file or model directory.
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
    if looks_local(&a.model) {
        return show_local(Path::new(&a.model));
    }
    let spec = RepoSpec::parse(&a.model)?;
    let config = hub_config();
    let options = GetOptions {
        include: a.include,
        exclude: a.exclude,
        num_workers: a.jobs.max(1),
        // Tests set this to exercise the disk-space check.
        free_bytes: std::env::var("KILN_TEST_FREE_BYTES")
            .ok()
            .and_then(|v| v.parse().ok()),
        ..GetOptions::default()
    };
    eprintln!(
        "kiln: fetching {}@{} from {} into {}",
        spec.repo_id,
        spec.revision,
        config.endpoint,
        config.cache_dir.display()
    );
    let progress = Display::new();
    let snap = kiln_hub::get(&config, &spec, &options, &progress)?;
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
    println!("{}", snap.dir.display());
    Ok(())
}

/// A path rather than a repository id: starts like one, or exists.
fn looks_local(s: &str) -> bool {
    s.starts_with(['/', '.', '~']) || Path::new(s).exists()
}

fn show_local(path: &Path) -> Result<()> {
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
    println!("{}", full.display());
    Ok(())
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
