//! `scan`: find every model in the hub cache and the given folders, read
//! its headers, and bring the registry up to date (entries whose files are
//! gone are dropped).

use std::path::PathBuf;

use crate::db::{Entry, Registry};
use crate::error::Result;
use crate::find::{find_in_hub_cache, find_local, Found};
use crate::inspect::inspect;

/// Where to look.
#[derive(Debug, Clone, Default)]
pub struct ScanSources {
    /// The hub cache (`HF_HUB_CACHE`), if any.
    pub hub_cache: Option<PathBuf>,
    /// Files and folders: registered roots, the models folder, arguments.
    pub roots: Vec<PathBuf>,
}

/// What a scan did.
#[derive(Debug, Clone, Default)]
pub struct ScanReport {
    pub num_found: usize,
    /// Entries whose headers could not be read, with why.
    pub problems: Vec<(PathBuf, String)>,
    /// Entries dropped because their files are gone.
    pub num_removed: usize,
}

/// Read one found model into an entry; an unreadable one is kept with
/// its problem.
pub fn entry_for(found: Found) -> Entry {
    match inspect(&found.path) {
        Ok(info) => Entry {
            found,
            info: Some(info),
            problem: None,
        },
        Err(e) => Entry {
            found,
            info: None,
            problem: Some(e.to_string()),
        },
    }
}

pub fn scan(registry: &Registry, sources: &ScanSources) -> Result<ScanReport> {
    let mut report = ScanReport::default();
    let mut found = Vec::new();
    if let Some(cache) = &sources.hub_cache {
        found.extend(find_in_hub_cache(cache));
    }
    for root in &sources.roots {
        found.extend(find_local(root));
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found.dedup_by(|a, b| a.path == b.path);
    for f in found {
        let entry = entry_for(f);
        let problem = entry
            .problem
            .clone()
            .or_else(|| entry.info.as_ref().and_then(|i| i.problem.clone()));
        if let Some(p) = problem {
            report.problems.push((entry.found.path.clone(), p));
        }
        registry.upsert(&entry)?;
        report.num_found += 1;
    }
    for e in registry.entries()? {
        if !e.found.path.exists() && registry.remove(&e.found.path)? {
            report.num_removed += 1;
        }
    }
    Ok(report)
}
