//! Finding models on disk: the hub cache's `models--ORG--NAME` folders
//! (one model per snapshot, or per GGUF file when a snapshot holds
//! several) and local folders of GGUF files and model directories.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::db::Source;

/// A model found on disk, before its headers are read.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// What `kiln ls` shows and queries match: `ORG/NAME` for the hub cache
    /// (`ORG/NAME/FILE` when a snapshot holds several GGUF files), the file
    /// stem or directory name for local models.
    pub name: String,
    /// `ORG/NAME` for the hub cache.
    pub repo: Option<String>,
    /// The snapshot's commit, for the hub cache.
    pub revision: Option<String>,
    /// Refs (`main`, tags) pointing at that commit.
    pub refs: Vec<String>,
    pub path: PathBuf,
    pub source: Source,
    /// Modification time, seconds since the epoch (newest wins a tie).
    pub modified: i64,
}

const MAX_DEPTH: usize = 3;

fn modified(p: &Path) -> i64 {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs() as i64)
}

fn is_gguf(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        && p.is_file()
}

fn is_model_dir(p: &Path) -> bool {
    p.join("config.json").is_file()
}

fn sorted_children(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn gguf_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    for p in sorted_children(dir) {
        if is_gguf(&p) {
            out.push(p);
        } else if p.is_dir() && depth < MAX_DEPTH {
            gguf_files(&p, depth + 1, out);
        }
    }
}

/// Ref names by commit under `refs/` (`main`, `v1`, `pr/3`).
fn read_refs(dir: &Path, prefix: &str, out: &mut Vec<(String, String)>) {
    for p in sorted_children(dir) {
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let full = format!("{prefix}{name}");
        if p.is_dir() {
            read_refs(&p, &format!("{full}/"), out);
        } else if let Ok(commit) = std::fs::read_to_string(&p) {
            out.push((full, commit.trim().to_string()));
        }
    }
}

/// Every model in a hub cache directory (`HF_HUB_CACHE`).
pub fn find_in_hub_cache(cache_dir: &Path) -> Vec<Found> {
    let mut out = Vec::new();
    for repo_dir in sorted_children(cache_dir) {
        let Some(folder) = repo_dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(rest) = folder.strip_prefix("models--") else {
            continue;
        };
        let repo = rest.replace("--", "/");
        let mut refs = Vec::new();
        read_refs(&repo_dir.join("refs"), "", &mut refs);
        for snap in sorted_children(&repo_dir.join("snapshots")) {
            let Some(commit) = snap.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let found = |name: String, path: PathBuf| Found {
                modified: modified(&snap),
                name,
                repo: Some(repo.clone()),
                revision: Some(commit.to_string()),
                refs: refs
                    .iter()
                    .filter(|(_, c)| c == commit)
                    .map(|(r, _)| r.clone())
                    .collect(),
                path,
                source: Source::HubCache,
            };
            if is_model_dir(&snap) {
                out.push(found(repo.clone(), snap.clone()));
                continue;
            }
            let mut files = Vec::new();
            gguf_files(&snap, 0, &mut files);
            let several = files.len() > 1;
            for f in files {
                let name = if several {
                    let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
                    format!("{repo}/{stem}")
                } else {
                    repo.clone()
                };
                out.push(found(name, f));
            }
        }
    }
    out
}

fn local(path: &Path) -> Found {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    Found {
        name: name
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string()),
        repo: None,
        revision: None,
        refs: Vec::new(),
        path: path.to_path_buf(),
        source: Source::Local,
        modified: modified(path),
    }
}

fn walk_local(dir: &Path, depth: usize, out: &mut Vec<Found>) {
    for p in sorted_children(dir) {
        if is_gguf(&p) || (p.is_dir() && is_model_dir(&p)) {
            out.push(local(&p));
        } else if p.is_dir() && depth < MAX_DEPTH {
            walk_local(&p, depth + 1, out);
        }
    }
}

/// Every model at `root`: a GGUF file, a model directory, a hub cache, or
/// a folder holding any of those (up to three levels down).
pub fn find_local(root: &Path) -> Vec<Found> {
    let root = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    if is_gguf(&root) || (root.is_dir() && is_model_dir(&root)) {
        return vec![local(&root)];
    }
    if !root.is_dir() {
        return Vec::new();
    }
    let is_cache = sorted_children(&root).iter().any(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("models--"))
    });
    if is_cache {
        return find_in_hub_cache(&root);
    }
    let mut out = Vec::new();
    walk_local(&root, 0, &mut out);
    out
}
