//! `get`: resolve a revision, check the disk, then fetch the missing blobs on
//! a few threads — each resumed from its `.incomplete` file, hashed while it
//! streams, renamed into `blobs/` only when its hash matches — and link the
//! snapshot.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::cache::RepoCache;
use crate::client::{header, HubClient, HubConfig};
use crate::error::ByteSize;
use crate::filter::FileFilter;
use crate::info::Etag;
use crate::repo::RepoSpec;
use crate::verify::BlobHasher;
use crate::{disk, HubError};

/// Free space kept beyond the download itself.
pub const DEFAULT_RESERVE_BYTES: u64 = 256 << 20;

const READ_CHUNK: usize = 1 << 20;

/// What to fetch and how.
#[derive(Clone, Debug)]
pub struct GetOptions {
    /// Glob patterns; only matching files are fetched (all when empty).
    pub include: Vec<String>,
    /// Glob patterns of files to leave out.
    pub exclude: Vec<String>,
    /// Files downloaded at once.
    pub num_workers: usize,
    /// Free bytes to assume on the cache's filesystem instead of asking it.
    pub free_bytes: Option<u64>,
    /// Space that must stay free after the download.
    pub reserve_bytes: u64,
}

impl Default for GetOptions {
    fn default() -> Self {
        GetOptions {
            include: Vec::new(),
            exclude: Vec::new(),
            num_workers: 4,
            free_bytes: None,
            reserve_bytes: DEFAULT_RESERVE_BYTES,
        }
    }
}

/// What happens during `get`, for a progress display. Called from several threads.
#[derive(Debug)]
pub enum ProgressEvent<'a> {
    /// The revision is known and the disk checked.
    Resolved {
        commit: &'a str,
        num_files: usize,
        total_bytes: u64,
        missing_bytes: u64,
    },
    /// A download starts (or resumes after `resumed_from` bytes).
    FileStarted {
        path: &'a str,
        size: u64,
        resumed_from: u64,
    },
    /// More bytes of `path` arrived.
    Bytes { path: &'a str, num_bytes: u64 },
    /// `path` is in the snapshot; `downloaded` is false when its blob was cached.
    FileDone {
        path: &'a str,
        size: u64,
        downloaded: bool,
    },
}

/// Receives progress events.
pub trait Progress: Sync {
    fn event(&self, event: &ProgressEvent<'_>);
}

/// Progress that goes nowhere.
pub struct NoProgress;

impl Progress for NoProgress {
    fn event(&self, _event: &ProgressEvent<'_>) {}
}

/// A revision in the cache after `get`.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub commit: String,
    /// `models--ORG--NAME`.
    pub repo_dir: PathBuf,
    /// `snapshots/{commit}`: the folder to load the model from.
    pub dir: PathBuf,
    /// The fetched files, in the repository's order.
    pub files: Vec<PathBuf>,
    pub num_downloaded: usize,
    pub bytes_downloaded: u64,
}

/// One blob to fetch and the repository paths that are it.
struct Job {
    etag: Etag,
    size: u64,
    paths: Vec<String>,
}

/// Everything the workers share.
struct Ctx<'a> {
    client: &'a HubClient,
    cache: &'a RepoCache,
    spec: &'a RepoSpec,
    commit: &'a str,
    progress: &'a dyn Progress,
}

/// Download `spec` into the hub cache of `config` and return its snapshot.
pub fn get(
    config: &HubConfig,
    spec: &RepoSpec,
    options: &GetOptions,
    progress: &dyn Progress,
) -> Result<Snapshot, HubError> {
    let filter = FileFilter::new(&options.include, &options.exclude)?;
    let client = HubClient::new(config);
    let info = client.model_info(spec)?;
    let num_in_repo = info.files.len();
    let files: Vec<_> = info
        .files
        .into_iter()
        .filter(|f| filter.matches(&f.path))
        .collect();
    if files.is_empty() {
        return Err(HubError::NoFilesMatch {
            repo: spec.repo_id.clone(),
            commit: info.commit,
            num_files: num_in_repo,
        });
    }
    let cache = RepoCache::new(&config.cache_dir, &spec.folder_name());
    let mut by_etag: BTreeMap<Etag, Job> = BTreeMap::new();
    for f in &files {
        by_etag
            .entry(f.etag.clone())
            .or_insert_with(|| Job {
                etag: f.etag.clone(),
                size: f.size,
                paths: Vec::new(),
            })
            .paths
            .push(f.path.clone());
    }
    let jobs: Vec<Job> = by_etag.into_values().collect();
    let missing: u64 = jobs
        .iter()
        .filter(|j| !cache.has_blob(&j.etag, j.size))
        .map(|j| j.size - cache.partial_len(&j.etag).min(j.size))
        .sum();

    cache.create_dirs(&info.commit)?;
    if missing > 0 {
        let dir = cache.blobs_dir();
        let available = options.free_bytes.or_else(|| disk::free_bytes(&dir));
        let required = missing.saturating_add(options.reserve_bytes);
        if let Some(available) = available.filter(|&a| a < required) {
            return Err(HubError::DiskSpace {
                dir,
                required: ByteSize(required),
                missing: ByteSize(missing),
                reserve: ByteSize(options.reserve_bytes),
                available: ByteSize(available),
            });
        }
    }
    cache.write_ref(&spec.revision, &info.commit)?;
    progress.event(&ProgressEvent::Resolved {
        commit: &info.commit,
        num_files: files.len(),
        total_bytes: files.iter().map(|f| f.size).sum(),
        missing_bytes: missing,
    });

    let ctx = Ctx {
        client: &client,
        cache: &cache,
        spec,
        commit: &info.commit,
        progress,
    };
    let (num_downloaded, bytes_downloaded) = run_jobs(&ctx, &jobs, options.num_workers)?;
    Ok(Snapshot {
        dir: cache.snapshot_dir(&info.commit),
        files: files
            .iter()
            .map(|f| cache.snapshot_file(&info.commit, &f.path))
            .collect(),
        repo_dir: cache.root().to_path_buf(),
        commit: info.commit,
        num_downloaded,
        bytes_downloaded,
    })
}

/// Fetch and link every job on `num_workers` threads; the first error stops
/// new jobs from starting and is returned once the running ones end.
fn run_jobs(ctx: &Ctx<'_>, jobs: &[Job], num_workers: usize) -> Result<(usize, u64), HubError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<HubError>> = Mutex::new(None);
    let totals = Mutex::new((0usize, 0u64));
    std::thread::scope(|s| {
        for _ in 0..num_workers.clamp(1, jobs.len().max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) {
                    return;
                }
                let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return;
                };
                match run_job(ctx, job) {
                    Ok(bytes) => {
                        let mut t = totals.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some(b) = bytes {
                            t.0 += 1;
                            t.1 += b;
                        }
                    }
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(totals.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// Make sure the blob is whole, then link its paths. `Some(bytes)` when it was downloaded.
fn run_job(ctx: &Ctx<'_>, job: &Job) -> Result<Option<u64>, HubError> {
    let fetched = if ctx.cache.has_blob(&job.etag, job.size) {
        None
    } else {
        Some(fetch_blob(ctx, job)?)
    };
    for path in &job.paths {
        ctx.cache.link(ctx.commit, path, &job.etag)?;
        ctx.progress.event(&ProgressEvent::FileDone {
            path,
            size: job.size,
            downloaded: fetched.is_some(),
        });
    }
    Ok(fetched)
}

/// Download one blob into `{etag}.incomplete`, resuming what is there, and
/// rename it into place once its hash matches. Returns the bytes transferred.
fn fetch_blob(ctx: &Ctx<'_>, job: &Job) -> Result<u64, HubError> {
    let path = &job.paths[0];
    let part = ctx.cache.incomplete_path(&job.etag);
    let url = ctx.client.resolve_url(&ctx.spec.repo_id, ctx.commit, path);
    let mut retried = false;
    loop {
        let mut start = ctx.cache.partial_len(&job.etag);
        if start > job.size {
            remove(&part)?;
            start = 0;
        }
        let mut hasher = BlobHasher::new(&job.etag, job.size);
        if start > 0 {
            hash_prefix(&part, start, &mut hasher)?;
        }
        ctx.progress.event(&ProgressEvent::FileStarted {
            path,
            size: job.size,
            resumed_from: start,
        });
        if start > 0 && start == job.size {
            // Whole but never moved into place (stopped between the two).
            finish(ctx, job, hasher, &part)?;
            return Ok(0);
        }
        let resp = ctx.client.get(&url, (start > 0).then_some(start))?;
        match resp.status().as_u16() {
            206 if start > 0 => check_content_range(&resp, &url, start, job.size)?,
            200 => {
                if start > 0 {
                    // The server ignored the range: start over.
                    start = 0;
                    hasher = BlobHasher::new(&job.etag, job.size);
                }
            }
            416 if start > 0 && !retried => {
                retried = true;
                remove(&part)?;
                continue;
            }
            _ => return Err(ctx.client.status_error(&resp, &url, ctx.spec, Some(path))),
        }
        let mut file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(start > 0)
            .truncate(start == 0)
            .open(&part)
            .map_err(|e| HubError::io("opening", &part, e))?;
        let mut reader = resp.into_body().into_reader();
        let mut buf = vec![0u8; READ_CHUNK];
        let mut received = start;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(HubError::Interrupted {
                        file: path.clone(),
                        received,
                        size: job.size,
                        message: e.to_string(),
                    })
                }
            };
            if received + n as u64 > job.size {
                drop(file);
                remove(&part)?;
                return Err(HubError::BadResponse {
                    url,
                    reason: format!(
                        "{path} is longer than the {} bytes the model info gives; the partial download was deleted",
                        job.size
                    ),
                });
            }
            file.write_all(&buf[..n])
                .map_err(|e| HubError::io("writing", &part, e))?;
            hasher.update(&buf[..n]);
            received += n as u64;
            ctx.progress.event(&ProgressEvent::Bytes {
                path,
                num_bytes: n as u64,
            });
        }
        if received < job.size {
            return Err(HubError::Interrupted {
                file: path.clone(),
                received,
                size: job.size,
                message: "the connection closed early".to_string(),
            });
        }
        file.sync_all()
            .map_err(|e| HubError::io("writing", &part, e))?;
        drop(file);
        finish(ctx, job, hasher, &part)?;
        return Ok(received - start);
    }
}

/// Check the hash of a whole `.incomplete` file and move it into `blobs/`.
fn finish(ctx: &Ctx<'_>, job: &Job, hasher: BlobHasher, part: &PathBuf) -> Result<(), HubError> {
    let actual = hasher.finish();
    if actual != job.etag.hex() {
        remove(part)?;
        return Err(HubError::Integrity {
            file: job.paths[0].clone(),
            algorithm: job.etag.algorithm(),
            expected: job.etag.hex().to_string(),
            actual,
        });
    }
    let blob = ctx.cache.blob_path(&job.etag);
    fs::rename(part, &blob).map_err(|e| HubError::io("moving into place", &blob, e))
}

/// Feed the first `len` bytes already on disk into the hasher.
fn hash_prefix(part: &PathBuf, len: u64, hasher: &mut BlobHasher) -> Result<(), HubError> {
    let mut f = File::open(part)
        .map_err(|e| HubError::io("opening", part, e))?
        .take(len);
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| HubError::io("reading", part, e))?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
    }
}

/// A 206 must continue exactly where the partial file ends.
fn check_content_range(
    resp: &ureq::http::Response<ureq::Body>,
    url: &str,
    start: u64,
    size: u64,
) -> Result<(), HubError> {
    let range = header(resp, "content-range").unwrap_or_default();
    let expected = format!("bytes {start}-{}/{size}", size - 1);
    // The total may be `*` when unknown.
    let ok = range == expected || range == format!("bytes {start}-{}/*", size - 1);
    if ok {
        return Ok(());
    }
    Err(HubError::BadResponse {
        url: url.to_string(),
        reason: format!(
            "asked for bytes {start}- and got Content-Range {range:?}, expected {expected:?}"
        ),
    })
}

fn remove(path: &PathBuf) -> Result<(), HubError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(HubError::io("deleting", path, e)),
    }
}
