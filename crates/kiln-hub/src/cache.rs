//! The hub cache layout, written exactly as `huggingface_hub` writes it:
//!
//! ```text
//! {cache}/models--ORG--NAME/
//!     blobs/{etag}                  file contents, named by sha256 (LFS) or git blob sha1
//!     blobs/{etag}.incomplete       a download in progress, resumed with a Range request
//!     snapshots/{commit}/{path}     relative symlinks to ../../blobs/{etag}
//!     refs/{revision}               the commit a branch or tag pointed at (no newline)
//! ```

use std::fs;
use std::path::{Path, PathBuf};

use crate::info::Etag;
use crate::HubError;

/// One repository's folder in the cache.
pub struct RepoCache {
    root: PathBuf,
}

impl RepoCache {
    /// The folder for `folder_name` (`models--ORG--NAME`) under `cache_dir`.
    pub fn new(cache_dir: &Path, folder_name: &str) -> RepoCache {
        RepoCache {
            root: cache_dir.join(folder_name),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs")
    }

    pub fn blob_path(&self, etag: &Etag) -> PathBuf {
        self.blobs_dir().join(etag.hex())
    }

    pub fn incomplete_path(&self, etag: &Etag) -> PathBuf {
        self.blobs_dir().join(format!("{}.incomplete", etag.hex()))
    }

    pub fn snapshot_dir(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    /// `snapshots/{commit}/{path}`; `path` is a checked repository path.
    pub fn snapshot_file(&self, commit: &str, path: &str) -> PathBuf {
        path.split('/')
            .fold(self.snapshot_dir(commit), |p, part| p.join(part))
    }

    /// Whether the blob is already whole (its size is trusted, as `huggingface_hub` does).
    pub fn has_blob(&self, etag: &Etag, size: u64) -> bool {
        fs::metadata(self.blob_path(etag)).is_ok_and(|m| m.is_file() && m.len() == size)
    }

    /// Bytes of a partial download already on disk.
    pub fn partial_len(&self, etag: &Etag) -> u64 {
        fs::metadata(self.incomplete_path(etag)).map_or(0, |m| m.len())
    }

    /// Create `blobs/` and `snapshots/{commit}/`.
    pub fn create_dirs(&self, commit: &str) -> Result<(), HubError> {
        for dir in [self.blobs_dir(), self.snapshot_dir(commit)] {
            fs::create_dir_all(&dir).map_err(|e| HubError::io("creating", &dir, e))?;
        }
        Ok(())
    }

    /// Point `snapshots/{commit}/{path}` at the blob with a relative symlink.
    pub fn link(&self, commit: &str, path: &str, etag: &Etag) -> Result<PathBuf, HubError> {
        let dst = self.snapshot_file(commit, path);
        let depth = path.split('/').count() + 1; // the snapshot folder, its parent, and path's folders
        let target: PathBuf = std::iter::repeat_n("..", depth)
            .collect::<PathBuf>()
            .join("blobs")
            .join(etag.hex());
        if fs::read_link(&dst).is_ok_and(|t| t == target) {
            return Ok(dst);
        }
        if let Some(parent) = dst.parent() {
            fs::create_dir_all(parent).map_err(|e| HubError::io("creating", parent, e))?;
        }
        if fs::symlink_metadata(&dst).is_ok() {
            fs::remove_file(&dst).map_err(|e| HubError::io("replacing", &dst, e))?;
        }
        make_link(&target, &self.blob_path(etag), &dst)?;
        Ok(dst)
    }

    /// Record that `revision` pointed at `commit`, unless the revision is that commit.
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        if revision == commit {
            return Ok(());
        }
        let path = revision
            .split('/')
            .fold(self.root.join("refs"), |p, part| p.join(part));
        if fs::read_to_string(&path).is_ok_and(|c| c == commit) {
            return Ok(());
        }
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| HubError::io("creating", parent, e))?;
        }
        // Written aside and renamed, so a reader never sees half a hash.
        let tmp = path.with_extension(format!("kiln-tmp-{}", std::process::id()));
        fs::write(&tmp, commit).map_err(|e| HubError::io("writing", &tmp, e))?;
        fs::rename(&tmp, &path).map_err(|e| HubError::io("writing", &path, e))
    }
}

#[cfg(unix)]
fn make_link(target: &Path, _blob: &Path, dst: &Path) -> Result<(), HubError> {
    std::os::unix::fs::symlink(target, dst).map_err(|e| HubError::io("linking", dst, e))
}

/// Where symlinks are not available the snapshot holds a copy, as `huggingface_hub` does.
#[cfg(not(unix))]
fn make_link(_target: &Path, blob: &Path, dst: &Path) -> Result<(), HubError> {
    fs::copy(blob, dst)
        .map(|_| ())
        .map_err(|e| HubError::io("copying", dst, e))
}
