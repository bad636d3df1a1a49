//! `--include` / `--exclude` patterns, with `huggingface_hub`'s meaning
//! (fnmatch: `*` also crosses `/`; a pattern ending in `/` means everything under it).

use globset::{Glob, GlobSet, GlobSetBuilder};

use crate::HubError;

/// Which repository paths to fetch.
pub struct FileFilter {
    include: Option<GlobSet>,
    exclude: Option<GlobSet>,
}

impl FileFilter {
    /// Everything matching some `include` pattern (all files when there is none)
    /// and no `exclude` pattern.
    pub fn new(include: &[String], exclude: &[String]) -> Result<FileFilter, HubError> {
        Ok(FileFilter {
            include: build(include)?,
            exclude: build(exclude)?,
        })
    }

    pub fn matches(&self, path: &str) -> bool {
        self.include.as_ref().is_none_or(|s| s.is_match(path))
            && !self.exclude.as_ref().is_some_and(|s| s.is_match(path))
    }
}

fn build(patterns: &[String]) -> Result<Option<GlobSet>, HubError> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let full = if p.ends_with('/') {
            format!("{p}*")
        } else {
            p.clone()
        };
        let glob = Glob::new(&full).map_err(|e| HubError::BadPattern {
            pattern: p.clone(),
            reason: e.kind().to_string(),
        })?;
        b.add(glob);
    }
    b.build().map(Some).map_err(|e| HubError::BadPattern {
        pattern: patterns.join(" "),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::FileFilter;

    fn filter(include: &[&str], exclude: &[&str]) -> FileFilter {
        let v = |s: &[&str]| s.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        FileFilter::new(&v(include), &v(exclude)).unwrap()
    }

    #[test]
    fn includes_then_excludes_like_fnmatch() {
        let all = filter(&[], &[]);
        assert!(all.matches("anything/at/all.bin"));
        let f = filter(&["*.json", "onnx/"], &["tokenizer*"]);
        assert!(f.matches("config.json"));
        assert!(f.matches("sub/generation_config.json"), "* crosses /");
        assert!(f.matches("onnx/model.onnx"));
        assert!(!f.matches("tokenizer.json"));
        assert!(!f.matches("model.safetensors"));
        let f = filter(&[], &["*.bin", "original/*"]);
        assert!(f.matches("model.safetensors"));
        assert!(!f.matches("pytorch_model.bin"));
        assert!(!f.matches("original/consolidated.pth"));
        let f = filter(&["*Q4_K_M.gguf"], &[]);
        assert!(f.matches("qwen2.5-0.5b-instruct-Q4_K_M.gguf"));
        assert!(!f.matches("qwen2.5-0.5b-instruct-Q8_0.gguf"));
    }

    #[test]
    fn bad_patterns_are_named() {
        let e = FileFilter::new(&["[unclosed".to_string()], &[])
            .err()
            .unwrap();
        assert!(e.to_string().contains("[unclosed"), "{e}");
    }
}
