//! The one rule that turns a query into a model: names are matched case-
//! insensitively, an exact name first, then a substring, then a
//! subsequence (`sm135` finds `SmolLM2-135M`); the best kind of match that
//! hits anything decides, and it must name exactly one model. Several
//! revisions of one repository are one model: the snapshot `main` points
//! at, else the newest.

use crate::db::Entry;
use crate::error::{RegistryError, Result};

/// One entry per name: the `main` snapshot, else the newest, else the
/// first path.
pub fn collapse(entries: Vec<Entry>) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    for e in entries {
        match out.iter_mut().find(|o| o.found.name == e.found.name) {
            None => out.push(e),
            Some(o) => {
                let key = |e: &Entry| (e.found.refs.iter().any(|r| r == "main"), e.found.modified);
                if key(&e) > key(o) {
                    *o = e;
                }
            }
        }
    }
    out
}

fn is_subsequence(needle: &str, hay: &str) -> bool {
    let mut hay = hay.chars();
    needle.chars().all(|c| hay.any(|h| h == c))
}

/// How well `query` matches `name`: 0 exact (the whole name or its last
/// `/` part), 1 substring, 2 subsequence.
fn match_rank(query: &str, name: &str) -> Option<u8> {
    let (q, n) = (query.to_lowercase(), name.to_lowercase());
    let last = n.rsplit('/').next().unwrap_or(&n);
    if q == n || q == last {
        Some(0)
    } else if n.contains(&q) {
        Some(1)
    } else if is_subsequence(&q, &n) {
        Some(2)
    } else {
        None
    }
}

/// Every model (collapsed) whose name matches `query` in any way, for
/// listing.
pub fn filter(entries: Vec<Entry>, query: &str) -> Vec<Entry> {
    collapse(entries)
        .into_iter()
        .filter(|e| match_rank(query, &e.found.name).is_some())
        .collect()
}

/// The one model `query` names among `entries` (collapsed first).
pub fn resolve(entries: Vec<Entry>, query: &str) -> Result<Entry> {
    let mut ranked: Vec<(u8, Entry)> = collapse(entries)
        .into_iter()
        .filter_map(|e| match_rank(query, &e.found.name).map(|r| (r, e)))
        .collect();
    let Some(best) = ranked.iter().map(|(r, _)| *r).min() else {
        return Err(RegistryError::NoMatch {
            query: query.to_string(),
        });
    };
    ranked.retain(|(r, _)| *r == best);
    if ranked.len() > 1 {
        return Err(RegistryError::Ambiguous {
            query: query.to_string(),
            candidates: ranked.into_iter().map(|(_, e)| e.found.name).collect(),
        });
    }
    Ok(ranked.remove(0).1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::Source;
    use crate::find::Found;
    use std::path::PathBuf;

    fn entry(name: &str, path: &str, refs: &[&str], modified: i64) -> Entry {
        Entry {
            found: Found {
                name: name.into(),
                repo: None,
                revision: None,
                refs: refs.iter().map(|s| s.to_string()).collect(),
                path: PathBuf::from(path),
                source: Source::Local,
                modified,
            },
            info: None,
            problem: None,
        }
    }

    fn all() -> Vec<Entry> {
        vec![
            entry("HuggingFaceTB/SmolLM2-135M", "/a", &["v1"], 5),
            entry("HuggingFaceTB/SmolLM2-135M", "/b", &["main"], 1),
            entry("HuggingFaceTB/SmolLM2-360M", "/c", &[], 1),
            entry("gemma-3-270m-q4_k_m", "/d", &[], 1),
            entry("qwen", "/e", &[], 1),
            entry("qwen2.5-coder", "/f", &[], 1),
        ]
    }

    #[test]
    fn revisions_collapse_to_main_then_newest() {
        let r = resolve(all(), "smollm2-135").unwrap();
        assert_eq!(r.found.path, PathBuf::from("/b"));
        let newest = vec![entry("x", "/1", &[], 1), entry("x", "/2", &[], 9)];
        assert_eq!(
            resolve(newest, "x").unwrap().found.path,
            PathBuf::from("/2")
        );
    }

    #[test]
    fn substring_beats_subsequence_and_exact_beats_substring() {
        assert_eq!(
            resolve(all(), "GEMMA").unwrap().found.path,
            PathBuf::from("/d")
        );
        assert_eq!(
            resolve(all(), "g3270").unwrap().found.path,
            PathBuf::from("/d")
        );
        assert_eq!(
            resolve(all(), "qwen").unwrap().found.path,
            PathBuf::from("/e")
        );
        assert_eq!(
            resolve(all(), "smollm2-135m").unwrap().found.path,
            PathBuf::from("/b")
        );
    }

    #[test]
    fn ambiguity_lists_candidates_and_no_match_says_what_to_do() {
        match resolve(all(), "smollm2") {
            Err(RegistryError::Ambiguous { candidates, .. }) => assert_eq!(
                candidates,
                ["HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-360M"]
            ),
            other => panic!("{other:?}"),
        }
        let e = resolve(all(), "llama-70b").unwrap_err().to_string();
        assert!(e.contains("kiln get") && e.contains("kiln scan"), "{e}");
    }
}
