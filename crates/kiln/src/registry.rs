//! `kiln scan`, `kiln ls`, `kiln rm`, and model resolution: every command
//! that takes a model takes a path or a query, resolved by one rule (an
//! existing path wins; else the one registry model whose name matches).
//! The registry lives at `$KILN_HOME/registry.sqlite` (default
//! `~/.cache/kiln/registry.sqlite`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use kiln_hub::ByteSize;
use kiln_registry::{Entry, Registry, ScanSources, Source};

#[derive(Args, Debug)]
pub struct ScanArgs {
    /// Files or folders to register and scan (remembered for later scans),
    /// besides the hub cache, the models folder and paths registered before.
    pub paths: Vec<PathBuf>,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Only models whose name matches (case-insensitive substring or subsequence).
    pub query: Option<String>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// The model to forget (a query as for every other command).
    pub query: String,
    /// Also delete its files, which must be in the hub cache (local files
    /// are never deleted).
    #[arg(long)]
    pub delete_files: bool,
}

/// `$KILN_HOME`, default `~/.cache/kiln`.
pub fn kiln_home() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("KILN_HOME").unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .or_else(|| var("HOME").map(|h| h.join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("kiln")
    })
}

/// `$KILN_MODELS_DIR`, default `./models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("KILN_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

fn db_path() -> PathBuf {
    kiln_home().join("registry.sqlite")
}

pub fn open() -> Result<Registry> {
    let path = db_path();
    Registry::open(&path).with_context(|| {
        format!(
            "opening the model registry (delete {} to start over)",
            path.display()
        )
    })
}

/// The path a model argument names: an existing path, else the one
/// registered model whose name matches.
pub fn resolve_model(query: &str) -> Result<PathBuf> {
    let as_path = Path::new(query);
    if as_path.exists() {
        return Ok(as_path.to_path_buf());
    }
    // A query spelled as a path (a folder, or a model file's extension)
    // names a file, not a registered model: say it is missing.
    let looks_like_path = ["/", "./", "../", "~"].iter().any(|p| query.starts_with(p))
        || [".gguf", ".safetensors"].iter().any(|x| query.ends_with(x));
    if looks_like_path {
        bail!(
            "{query}: no such file or directory. The README's example models are fetched by \
             `scripts/fetch-models.sh` (into ./models); `kiln get ORG/NAME` downloads from the \
             Hugging Face hub, and `kiln ls` lists the models registered here"
        );
    }
    if !db_path().exists() {
        bail!(
            "{query:?} is not a file or directory, and no models are registered yet: `kiln scan` registers the hub cache and ./models, `kiln get ORG/NAME` downloads one"
        );
    }
    let reg = open()?;
    let entry = kiln_registry::resolve(reg.entries()?, query)?;
    if !entry.found.path.exists() {
        bail!(
            "{query:?} is {}, whose files are gone; run `kiln scan`",
            entry.found.path.display()
        );
    }
    eprintln!(
        "kiln: {query:?} is {} ({})",
        entry.found.name,
        entry.found.path.display()
    );
    Ok(entry.found.path)
}

/// Register a local model file or directory (`kiln get PATH`).
pub fn register_local(path: &Path) -> Result<Entry> {
    let reg = open()?;
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    reg.add_root(&path)?;
    let mut entry = None;
    for found in kiln_registry::find_local(&path) {
        let e = kiln_registry::entry_for(found);
        reg.upsert(&e)?;
        entry.get_or_insert(e);
    }
    entry.with_context(|| format!("{} holds no GGUF file or model directory", path.display()))
}

pub fn scan(a: ScanArgs) -> Result<()> {
    let reg = open()?;
    for p in &a.paths {
        if !p.exists() {
            bail!("{} is not a file or directory here", p.display());
        }
        reg.add_root(&p.canonicalize().unwrap_or_else(|_| p.clone()))?;
    }
    let hub_cache = crate::get::hub_config().cache_dir;
    let mut roots = reg.roots()?;
    let models = models_dir();
    if models.is_dir() {
        roots.push(models);
    }
    let sources = ScanSources {
        hub_cache: hub_cache.is_dir().then_some(hub_cache.clone()),
        roots,
    };
    let report = kiln_registry::scan(&reg, &sources)?;
    for (path, why) in &report.problems {
        eprintln!("kiln scan: {}: {why}", path.display());
    }
    eprintln!(
        "kiln scan: {} models in {} and {} other places; {} gone ones forgotten",
        report.num_found,
        hub_cache.display(),
        sources.roots.len(),
        report.num_removed
    );
    print_table(&kiln_registry::collapse(reg.entries()?));
    Ok(())
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.0}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.0}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn row(e: &Entry) -> [String; 8] {
    let dash = || "-".to_string();
    let i = e.info.as_ref();
    [
        e.found.name.clone(),
        i.map_or_else(dash, |i| i.model_type.clone()),
        i.and_then(|i| i.num_params).map_or_else(dash, human_count),
        i.map_or_else(dash, |i| i.quant.clone()),
        i.and_then(|i| i.context_length)
            .map_or_else(dash, |c| c.to_string()),
        i.map_or_else(dash, |i| ByteSize(i.size_bytes).to_string()),
        e.tier().to_string(),
        i.map(|i| i.capabilities.names().join(","))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(dash),
    ]
}

fn print_table(entries: &[Entry]) {
    let header = [
        "NAME", "ARCH", "PARAMS", "QUANT", "CTX", "SIZE", "TIER", "CAPS",
    ]
    .map(String::from);
    let rows: Vec<[String; 8]> = std::iter::once(header)
        .chain(entries.iter().map(row))
        .collect();
    let widths: Vec<usize> = (0..8)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(s, w)| format!("{s:<w$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

fn entry_json(e: &Entry) -> serde_json::Value {
    let i = e.info.as_ref();
    serde_json::json!({
        "name": e.found.name,
        "repo": e.found.repo,
        "revision": e.found.revision,
        "refs": e.found.refs,
        "path": e.found.path.display().to_string(),
        "source": e.found.source.name(),
        "format": i.map(|i| i.format.name()),
        "architecture": i.map(|i| &i.architecture),
        "model_type": i.map(|i| &i.model_type),
        "num_params": i.and_then(|i| i.num_params),
        "quant": i.map(|i| &i.quant),
        "context_length": i.and_then(|i| i.context_length),
        "size_bytes": i.map(|i| i.size_bytes),
        "tier": e.tier(),
        "capabilities": i.map(|i| i.capabilities.names()).unwrap_or_default(),
        "problem": e.problem.clone().or_else(|| i.and_then(|i| i.problem.clone())),
    })
}

pub fn ls(a: LsArgs) -> Result<()> {
    let entries = if db_path().exists() {
        open()?.entries()?
    } else {
        Vec::new()
    };
    let shown = match &a.query {
        Some(q) => kiln_registry::filter(entries, q),
        None => kiln_registry::collapse(entries),
    };
    if a.json {
        for e in &shown {
            println!("{}", entry_json(e));
        }
    } else if shown.is_empty() {
        eprintln!(
            "kiln ls: no models registered{}; run `kiln scan` or `kiln get`",
            match &a.query {
                Some(q) => format!(" match {q:?}"),
                None => String::new(),
            }
        );
    } else {
        print_table(&shown);
    }
    Ok(())
}

/// The hub-cache repository folder (`models--ORG--NAME`) holding `path`.
fn cache_repo_folder(path: &Path) -> Option<PathBuf> {
    path.ancestors()
        .find(|a| {
            a.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("models--"))
        })
        .map(Path::to_path_buf)
}

pub fn rm(a: RmArgs) -> Result<()> {
    let reg = open()?;
    let all = reg.entries()?;
    let chosen = kiln_registry::resolve(all.clone(), &a.query)?;
    // Every revision of the model goes.
    let same: Vec<&Entry> = all
        .iter()
        .filter(|e| e.found.name == chosen.found.name)
        .collect();
    if a.delete_files {
        if chosen.found.source != Source::HubCache {
            bail!(
                "{} is a local path, not in the hub cache; kiln deletes only cached downloads (forget it with `kiln rm` without --delete-files)",
                chosen.found.path.display()
            );
        }
        let folder = cache_repo_folder(&chosen.found.path).with_context(|| {
            format!(
                "{} is not in a hub cache folder",
                chosen.found.path.display()
            )
        })?;
        // A snapshot holding several GGUF files is one folder: delete it
        // only when every model in it is being forgotten.
        let others: Vec<&Entry> = all
            .iter()
            .filter(|e| e.found.path.starts_with(&folder) && e.found.name != chosen.found.name)
            .collect();
        if !others.is_empty() {
            bail!(
                "{} also holds {}; forget those too or delete nothing",
                folder.display(),
                others
                    .iter()
                    .map(|e| e.found.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let size = same
            .iter()
            .filter_map(|e| e.info.as_ref().map(|i| i.size_bytes))
            .sum::<u64>();
        std::fs::remove_dir_all(&folder)
            .with_context(|| format!("deleting {}", folder.display()))?;
        eprintln!("kiln rm: deleted {} ({})", folder.display(), ByteSize(size));
    }
    for e in &same {
        reg.remove(&e.found.path)?;
        reg.remove_root(&e.found.path)?;
    }
    eprintln!(
        "kiln rm: forgot {} ({} revision{})",
        chosen.found.name,
        same.len(),
        if same.len() == 1 { "" } else { "s" }
    );
    Ok(())
}
