//! `kiln_hub::get` against the mock hub on loopback: the cache layout,
//! resuming, verification, errors, revisions, filters and the disk check.

mod mock_hub;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kiln_hub::{get, GetOptions, HubConfig, HubError, Progress, ProgressEvent, RepoSpec, Snapshot};
use mock_hub::{
    fixture, MockFile, MockHub, MAIN_COMMIT, PINNED_COMMIT, PRIVATE_REPO, PUBLIC_REPO, TOKEN,
};

struct Env {
    hub: MockHub,
    cache: tempfile::TempDir,
    repos: Vec<mock_hub::MockRepo>,
}

fn env() -> Env {
    Env {
        hub: MockHub::start(fixture()),
        cache: tempfile::tempdir().unwrap(),
        repos: fixture(),
    }
}

fn options() -> GetOptions {
    GetOptions {
        reserve_bytes: 0,
        ..GetOptions::default()
    }
}

/// Records every event as a line.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Progress for Recorder {
    fn event(&self, e: &ProgressEvent<'_>) {
        let line = match e {
            ProgressEvent::Bytes { .. } => return,
            other => format!("{other:?}"),
        };
        self.0.lock().unwrap().push(line);
    }
}

impl Env {
    fn config(&self, token: Option<&str>) -> HubConfig {
        HubConfig {
            endpoint: self.hub.url.clone(),
            token: token.map(str::to_string),
            cache_dir: self.cache.path().to_path_buf(),
        }
    }

    fn get(&self, spec: &str, options: &GetOptions) -> Result<Snapshot, HubError> {
        get(
            &self.config(None),
            &RepoSpec::parse(spec).unwrap(),
            options,
            &kiln_hub::NoProgress,
        )
    }

    fn repo_dir(&self, repo: &str) -> PathBuf {
        self.cache
            .path()
            .join(format!("models--{}", repo.replace('/', "--")))
    }

    /// A file of the fixture: repository, commit, path.
    fn file(&self, repo: &str, commit: &str, path: &str) -> &MockFile {
        self.repos
            .iter()
            .find(|r| r.id == repo)
            .and_then(|r| r.revisions.iter().find(|v| v.commit == commit))
            .and_then(|v| v.files.iter().find(|f| f.path == path))
            .expect("fixture file")
    }

    /// Requests to `resolve` or the CDN.
    fn downloads(&self) -> Vec<mock_hub::Request> {
        self.hub
            .requests()
            .into_iter()
            .filter(|r| r.target.contains("/resolve/") || r.target.starts_with("/cdn/"))
            .collect()
    }
}

fn blob_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

const LFS1: &str = "model-00001-of-00002.safetensors";
const LFS2: &str = "weights/model-00002-of-00002.safetensors";

#[test]
fn full_download_writes_the_huggingface_cache_layout() {
    let env = env();
    let snap = env.get(PUBLIC_REPO, &options()).unwrap();
    let root = env.repo_dir(PUBLIC_REPO);
    assert_eq!(snap.commit, MAIN_COMMIT);
    assert_eq!(snap.dir, root.join("snapshots").join(MAIN_COMMIT));
    assert_eq!(snap.num_downloaded, 3);
    assert_eq!(snap.bytes_downloaded, 500_000 + 42);

    let mut expected: Vec<String> = ["config.json", LFS1, LFS2]
        .iter()
        .map(|p| env.file(PUBLIC_REPO, MAIN_COMMIT, p).etag())
        .collect();
    expected.sort();
    assert_eq!(
        blob_names(&root),
        expected,
        "blobs are named by sha256 / git sha1"
    );
    assert_eq!(expected.iter().filter(|e| e.len() == 64).count(), 2);

    for (path, link) in [
        ("config.json", "../../blobs/"),
        (LFS1, "../../blobs/"),
        (LFS2, "../../../blobs/"),
    ] {
        let f = env.file(PUBLIC_REPO, MAIN_COMMIT, path);
        let snap_file = snap.dir.join(path);
        let target = std::fs::read_link(&snap_file).unwrap();
        assert_eq!(
            target,
            PathBuf::from(format!("{link}{}", f.etag())),
            "{path}"
        );
        assert_eq!(std::fs::read(&snap_file).unwrap(), f.bytes, "{path}");
    }
    assert_eq!(
        std::fs::read_to_string(root.join("refs/main")).unwrap(),
        MAIN_COMMIT,
        "refs/main holds the commit with no newline"
    );
    assert_eq!(snap.files.len(), 3);

    // LFS files went through the redirect to the CDN; the git file did not.
    let downloads = env.downloads();
    assert_eq!(
        downloads
            .iter()
            .filter(|r| r.target.starts_with("/cdn/"))
            .count(),
        2
    );
    assert!(downloads.iter().any(|r| r.target
        == format!(
            "/{PUBLIC_REPO}/resolve/{MAIN_COMMIT}/weights/{}",
            &LFS2[8..]
        )));

    // A second run finds everything cached and downloads nothing.
    env.hub.clear_log();
    let again = env.get(PUBLIC_REPO, &options()).unwrap();
    assert_eq!((again.num_downloaded, again.bytes_downloaded), (0, 0));
    assert!(env.downloads().is_empty(), "{:?}", env.downloads());
}

#[test]
fn resumes_a_cut_download_with_a_range_request() {
    let env = env();
    let f = env.file(PUBLIC_REPO, MAIN_COMMIT, LFS1);
    let etag = f.etag();
    env.hub.cut_once(&etag, 120_000);
    let opts = GetOptions {
        num_workers: 1,
        ..options()
    };
    let err = env.get(PUBLIC_REPO, &opts).unwrap_err();
    assert!(matches!(err, HubError::Interrupted { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(LFS1) && msg.contains("resume"), "{msg}");
    let part = env
        .repo_dir(PUBLIC_REPO)
        .join(format!("blobs/{etag}.incomplete"));
    assert_eq!(
        std::fs::metadata(&part).unwrap().len(),
        120_000,
        "the partial is kept"
    );

    env.hub.clear_log();
    let progress = Recorder::default();
    let spec = RepoSpec::parse(PUBLIC_REPO).unwrap();
    let snap = get(&env.config(None), &spec, &opts, &progress).unwrap();
    assert!(!part.exists());
    assert_eq!(std::fs::read(snap.dir.join(LFS1)).unwrap(), f.bytes);
    let ranged: Vec<_> = env
        .downloads()
        .into_iter()
        .filter_map(|r| r.header("range").map(str::to_string))
        .collect();
    assert_eq!(
        ranged,
        ["bytes=120000-", "bytes=120000-"],
        "resolve and CDN both get the range"
    );
    let events = progress.0.lock().unwrap();
    assert!(
        events.iter().any(|e| e.contains("resumed_from: 120000")),
        "{events:?}"
    );
    // Blobs are fetched in etag order: the first run got the second shard, then
    // was cut in the first; config.json (42 bytes) comes after it.
    assert!(events[0].contains("missing_bytes: 180042"), "{events:?}");
}

#[test]
fn corrupted_bytes_are_caught_and_the_partial_deleted() {
    let env = env();
    let lfs = env.file(PUBLIC_REPO, MAIN_COMMIT, LFS1).etag();
    env.hub.corrupt(&lfs);
    let only = |p: &str| GetOptions {
        include: vec![p.to_string()],
        ..options()
    };
    let err = env.get(PUBLIC_REPO, &only(LFS1)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, HubError::Integrity { .. }), "{msg}");
    assert!(
        msg.contains("sha256 mismatch") && msg.contains(&lfs) && msg.contains(LFS1),
        "{msg}"
    );
    assert!(msg.contains("deleted"), "{msg}");
    let root = env.repo_dir(PUBLIC_REPO);
    assert!(blob_names(&root).is_empty(), "{:?}", blob_names(&root));
    assert!(!root.join("snapshots").join(MAIN_COMMIT).join(LFS1).exists());

    // A file kept in git is checked by its git blob sha1.
    let git = env.file(PUBLIC_REPO, MAIN_COMMIT, "config.json").etag();
    env.hub.corrupt(&git);
    let msg = env
        .get(PUBLIC_REPO, &only("config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("git blob sha1 mismatch") && msg.contains(&git),
        "{msg}"
    );
    assert!(blob_names(&root).is_empty());

    // Once the server is right again, the same command succeeds.
    env.hub.heal();
    env.get(PUBLIC_REPO, &options()).unwrap();
    assert_eq!(blob_names(&root).len(), 3);
}

#[test]
fn a_gated_repository_needs_the_token() {
    let env = env();
    let spec = RepoSpec::parse(PRIVATE_REPO).unwrap();
    let err = get(&env.config(None), &spec, &options(), &kiln_hub::NoProgress).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, HubError::Unauthorized { status: 401, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("HTTP 401") && msg.contains("set HF_TOKEN"),
        "{msg}"
    );
    assert!(msg.contains("accept the model's license"), "{msg}");
    assert!(
        msg.contains(&format!("{}/{PRIVATE_REPO}", env.hub.url)),
        "{msg}"
    );

    let wrong = get(
        &env.config(Some("hf_wrong")),
        &spec,
        &options(),
        &kiln_hub::NoProgress,
    )
    .unwrap_err()
    .to_string();
    assert!(wrong.contains("check that HF_TOKEN"), "{wrong}");

    env.hub.clear_log();
    let snap = get(
        &env.config(Some(TOKEN)),
        &spec,
        &options(),
        &kiln_hub::NoProgress,
    )
    .unwrap();
    assert_eq!(snap.num_downloaded, 2);
    for r in env.hub.requests() {
        let auth = r.header("authorization");
        if r.target.starts_with("/cdn/") {
            assert_eq!(auth, None, "the token never leaves the hub's origin");
        } else {
            assert_eq!(
                auth,
                Some(format!("Bearer {TOKEN}").as_str()),
                "{}",
                r.target
            );
        }
    }
}

#[test]
fn missing_repositories_revisions_and_endpoints_are_explained() {
    let env = env();
    let err = env.get("kiln-test/no-such-model", &options()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, HubError::NotFound { status: 404, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("repository kiln-test/no-such-model not found"),
        "{msg}"
    );
    assert!(msg.contains(&env.hub.url), "{msg}");

    let msg = env
        .get(&format!("{PUBLIC_REPO}@no-such-branch"), &options())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("revision \"no-such-branch\"") && msg.contains("not found"),
        "{msg}"
    );
    assert!(!env.repo_dir("kiln-test/no-such-model").exists());

    // Nothing listens on port 9 of loopback.
    let config = HubConfig {
        endpoint: "http://127.0.0.1:9".into(),
        ..env.config(None)
    };
    let err = get(
        &config,
        &RepoSpec::parse(PUBLIC_REPO).unwrap(),
        &options(),
        &kiln_hub::NoProgress,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, HubError::Network { .. }), "{msg}");
    assert!(msg.contains("could not reach http://127.0.0.1:9"), "{msg}");
}

#[test]
fn revisions_are_pinned_by_commit_or_branch() {
    let env = env();
    let root = env.repo_dir(PUBLIC_REPO);
    let snap = env
        .get(&format!("{PUBLIC_REPO}@{PINNED_COMMIT}"), &options())
        .unwrap();
    assert_eq!(snap.commit, PINNED_COMMIT);
    assert_eq!(snap.dir, root.join("snapshots").join(PINNED_COMMIT));
    let cfg = env.file(PUBLIC_REPO, PINNED_COMMIT, "config.json");
    assert_eq!(
        std::fs::read(snap.dir.join("config.json")).unwrap(),
        cfg.bytes
    );
    assert!(
        !snap.dir.join(LFS2).exists(),
        "the old commit has no second shard"
    );
    assert!(!root.join("refs").exists(), "a commit hash writes no ref");
    assert!(env
        .downloads()
        .iter()
        .all(|r| r.target.starts_with("/cdn/") || r.target.contains(PINNED_COMMIT)));

    // A branch name resolves to its commit and is recorded under refs/.
    let snap = env.get(&format!("{PUBLIC_REPO}@v1"), &options()).unwrap();
    assert_eq!(
        (snap.commit.as_str(), snap.num_downloaded),
        (PINNED_COMMIT, 0)
    );
    assert_eq!(
        std::fs::read_to_string(root.join("refs/v1")).unwrap(),
        PINNED_COMMIT
    );

    // main is a different snapshot beside it.
    env.get(PUBLIC_REPO, &options()).unwrap();
    assert!(root.join("snapshots").join(MAIN_COMMIT).join(LFS2).exists());
    assert_eq!(blob_names(&root).len(), 5);
}

#[test]
fn include_and_exclude_choose_the_files() {
    let env = env();
    let root = env.repo_dir(PUBLIC_REPO);
    let snap_dir = root.join("snapshots").join(MAIN_COMMIT);
    let with = |include: &[&str], exclude: &[&str]| GetOptions {
        include: include.iter().map(|s| s.to_string()).collect(),
        exclude: exclude.iter().map(|s| s.to_string()).collect(),
        ..options()
    };
    let snap = env.get(PUBLIC_REPO, &with(&["*.json"], &[])).unwrap();
    assert_eq!(snap.files, [snap_dir.join("config.json")]);
    assert!(!snap_dir.join(LFS1).exists());

    let snap = env.get(PUBLIC_REPO, &with(&[], &["weights/"])).unwrap();
    assert_eq!(snap.num_downloaded, 1, "config.json was already there");
    assert!(snap_dir.join(LFS1).exists() && !snap_dir.join(LFS2).exists());

    let snap = env
        .get(PUBLIC_REPO, &with(&["*.safetensors"], &["model-00001*"]))
        .unwrap();
    assert_eq!(snap.files, [snap_dir.join(LFS2)]);

    let err = env.get(PUBLIC_REPO, &with(&["*.gguf"], &[])).unwrap_err();
    assert!(
        err.to_string().contains("no file of kiln-test/tiny-model"),
        "{err}"
    );
}

#[test]
fn refuses_to_start_without_the_disk_space() {
    let env = env();
    let opts = GetOptions {
        free_bytes: Some(400_000),
        reserve_bytes: 1_000_000,
        ..GetOptions::default()
    };
    let err = env.get(PUBLIC_REPO, &opts).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, HubError::DiskSpace { .. }), "{msg}");
    assert!(
        msg.contains("1.5 MB needed (500.0 kB still to download + 1.0 MB reserve)"),
        "{msg}"
    );
    assert!(msg.contains("models--kiln-test--tiny-model"), "{msg}");
    assert!(msg.contains("400.0 kB available"), "{msg}");
    assert!(env.downloads().is_empty());

    // Bytes already on disk are not counted again; with enough room it goes ahead.
    let opts = GetOptions {
        free_bytes: Some(600_042),
        reserve_bytes: 100_000,
        ..GetOptions::default()
    };
    env.get(PUBLIC_REPO, &opts).unwrap();
    let opts = GetOptions {
        free_bytes: Some(0),
        ..opts
    };
    let snap = env.get(PUBLIC_REPO, &opts).unwrap();
    assert_eq!(snap.num_downloaded, 0, "nothing missing, no check");
}

#[test]
fn empty_files_and_shared_blobs_are_fetched_once() {
    let files = vec![
        MockFile::git(".gitattributes", b""),
        MockFile::git("a/copy.txt", b"same\n"),
        MockFile::git("b/copy.txt", b"same\n"),
    ];
    let hub = MockHub::start(vec![mock_hub::MockRepo {
        id: "kiln-test/odd-files".into(),
        token: None,
        revisions: vec![mock_hub::MockRevision {
            commit: MAIN_COMMIT.into(),
            branches: vec!["main".into()],
            files,
        }],
    }]);
    let cache = tempfile::tempdir().unwrap();
    let config = HubConfig {
        endpoint: hub.url.clone(),
        token: None,
        cache_dir: cache.path().to_path_buf(),
    };
    let spec = RepoSpec::parse("kiln-test/odd-files").unwrap();
    let snap = get(&config, &spec, &options(), &kiln_hub::NoProgress).unwrap();
    assert_eq!(snap.num_downloaded, 2, "one blob for the two copies");
    assert_eq!(std::fs::read(snap.dir.join(".gitattributes")).unwrap(), b"");
    assert_eq!(
        std::fs::read(snap.dir.join("b/copy.txt")).unwrap(),
        b"same\n"
    );
    let root = cache.path().join("models--kiln-test--odd-files");
    assert!(root
        .join("blobs/e69de29bb2d1d6434b8b29ae775ad8c2e48c5391")
        .is_file());
    assert_eq!(blob_names(&root).len(), 2);
}
