"""`kiln get` and the official `huggingface_hub` share one cache.

    python3 tests/hub/hub_interop.py KILN_BINARY

Serves a fake model repository from a mock hub on loopback (model info with
blobs, resolve with a 302 to a CDN path for LFS files, Range requests), then:
Kiln downloads it and huggingface_hub must see it (`scan_cache_dir`,
`try_to_load_from_cache`, `hf_hub_download(local_files_only=True)`);
huggingface_hub downloads it into a second cache and the two layouts must be
identical; Kiln run on huggingface_hub's cache must download nothing.

Needs `huggingface_hub` on PYTHONPATH (scripts/install-hfhub.sh). Prints one
`test result:` line in cargo's format so scripts/test.sh counts it.
"""
import hashlib
import http.server
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = "kiln-test/interop-model"
MAIN = "a" * 40
PINNED = "b" * 40


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_files(seed: int, sizes: dict) -> dict:
    rng = random.Random(seed)
    files = {"config.json": (json.dumps({"model_type": "llama", "seed": seed}).encode(), False)}
    for path, n in sizes.items():
        files[path] = (bytes(rng.getrandbits(8) for _ in range(n)), True)
    return files


REVISIONS = {
    MAIN: make_files(1, {"model.safetensors": 300_000, "shards/part-2.safetensors": 150_000}),
    PINNED: make_files(2, {"model.safetensors": 120_000}),
}
BRANCHES = {"main": MAIN}
# The CDN's origin (another port: the real hub's CDN is another origin too).
CDN = [""]


def etag(data: bytes, lfs: bool) -> str:
    return hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)


class Hub(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, headers=(), body=b"", head=False):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_HEAD(self):
        self.route(head=True)

    def do_GET(self):
        self.route(head=False)

    def serve_bytes(self, data, headers, head):
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
            headers.append(("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}"))
            return self.send(206, headers, data[start:], head)
        return self.send(200, headers, data, head)

    def route(self, head):
        from urllib.parse import unquote

        path = self.path.split("?")[0]
        if path.startswith("/cdn/"):
            want = path[5:]
            for files in REVISIONS.values():
                for data, lfs in files.values():
                    if lfs and etag(data, True) == want:
                        return self.serve_bytes(data, [], head)
            return self.send(404, head=head)
        api = path.startswith("/api/models/")
        rest = path[len("/api/models/"):] if api else path[1:]
        sep = "/revision/" if api else "/resolve/"
        if sep not in rest or rest.split(sep)[0] != REPO:
            return self.send(404, [("X-Error-Code", "RepoNotFound")], head=head)
        after = rest.split(sep, 1)[1]
        rev, _, fpath = (after, "", "") if api else after.partition("/")
        rev, fpath = unquote(rev), unquote(fpath)
        commit = BRANCHES.get(rev, rev)
        if commit not in REVISIONS:
            return self.send(404, [("X-Error-Code", "RevisionNotFound")], head=head)
        files = REVISIONS[commit]
        if api:
            siblings = []
            for p, (data, lfs) in files.items():
                s = {"rfilename": p, "size": len(data), "blobId": git_sha1(data if not lfs else b"ptr")}
                if lfs:
                    s["lfs"] = {"sha256": etag(data, True), "size": len(data), "pointerSize": 134}
                siblings.append(s)
            body = json.dumps({"id": REPO, "sha": commit, "siblings": siblings}).encode()
            return self.send(200, [("Content-Type", "application/json")], body, head)
        if fpath not in files:
            return self.send(404, [("X-Error-Code", "EntryNotFound"), ("X-Repo-Commit", commit)], head=head)
        data, lfs = files[fpath]
        tag = etag(data, lfs)
        if lfs:
            return self.send(302, [
                ("Location", f"{CDN[0]}/cdn/{tag}?X-Amz-Signature=x"),
                ("X-Linked-Etag", f'"{tag}"'),
                ("X-Linked-Size", str(len(data))),
                ("ETag", f'"{git_sha1(b"ptr")}"'),
                ("X-Repo-Commit", commit),
            ], head=head)
        return self.serve_bytes(data, [("ETag", f'"{tag}"'), ("X-Repo-Commit", commit)], head)


def tree(repo_dir: Path) -> dict:
    """Every path under a cached repository: symlink targets, ref contents, blob sizes."""
    out = {}
    for p in sorted(repo_dir.rglob("*")):
        rel = p.relative_to(repo_dir).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            continue
        elif rel.startswith("refs/"):
            out[rel] = p.read_text()
        else:
            out[rel] = p.stat().st_size
    return out


def main():
    kiln = sys.argv[1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    cdn = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    CDN[0] = f"http://127.0.0.1:{cdn.server_address[1]}"
    for s in (server, cdn):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    work = Path(tempfile.mkdtemp(prefix="kiln-hub-interop-"))
    kiln_cache, hf_cache = work / "kiln-cache", work / "hf-cache"
    os.environ.update({"HF_ENDPOINT": endpoint, "HF_HOME": str(work / "home"),
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    os.environ.pop("HF_TOKEN", None)
    os.environ.pop("HF_HUB_OFFLINE", None)
    # huggingface_hub reads its environment when imported.
    import huggingface_hub
    from huggingface_hub import hf_hub_download, scan_cache_dir, try_to_load_from_cache

    passed = failed = 0

    def check(name, fn):
        nonlocal passed, failed
        try:
            fn()
            print(f"test {name} ... ok")
            passed += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported
            print(f"test {name} ... FAILED: {type(e).__name__}: {e}")
            failed += 1

    def kiln_get(cache, *args):
        env = dict(os.environ, HF_HUB_CACHE=str(cache), KILN_TEST_FREE_BYTES="100000000000")
        r = subprocess.run([kiln, "get", *args], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"kiln get {args} failed: {r.stderr}"
        return r

    def kiln_downloads():
        r = kiln_get(kiln_cache, REPO)
        snap = kiln_cache / "models--kiln-test--interop-model" / "snapshots" / MAIN
        assert r.stdout.strip() == str(snap), r.stdout
        kiln_get(kiln_cache, f"{REPO}@{PINNED}")

    def scan_lists_kilns_repo():
        info = scan_cache_dir(kiln_cache)
        assert not info.warnings, info.warnings
        (repo,) = info.repos
        assert (repo.repo_id, repo.repo_type) == (REPO, "model"), repo
        revs = {r.commit_hash: r for r in repo.revisions}
        assert set(revs) == {MAIN, PINNED}, revs
        assert revs[MAIN].refs == frozenset({"main"}), revs[MAIN].refs
        assert revs[PINNED].refs == frozenset(), revs[PINNED].refs
        assert revs[MAIN].nb_files == 3, revs[MAIN].files
        expected = sum(len(d) for d, _ in REVISIONS[MAIN].values()) + sum(
            len(d) for d, _ in REVISIONS[PINNED].values())
        assert repo.size_on_disk == expected, (repo.size_on_disk, expected)

    def try_to_load_finds_kilns_files():
        for rev, files in REVISIONS.items():
            for fpath, (data, _) in files.items():
                kw = {} if rev == MAIN else {"revision": rev}
                got = try_to_load_from_cache(REPO, fpath, cache_dir=kiln_cache, **kw)
                want = kiln_cache / "models--kiln-test--interop-model" / "snapshots" / rev / fpath
                assert got is not None and Path(got) == want, (fpath, got, want)
                assert Path(got).read_bytes() == data, fpath

    def offline_download_uses_kilns_files():
        for fpath in REVISIONS[MAIN]:
            got = hf_hub_download(REPO, fpath, cache_dir=kiln_cache, local_files_only=True)
            assert Path(got).read_bytes() == REVISIONS[MAIN][fpath][0], fpath

    def same_layout_as_huggingface_hub():
        for fpath in REVISIONS[MAIN]:
            hf_hub_download(REPO, fpath, cache_dir=hf_cache)
        for fpath in REVISIONS[PINNED]:
            hf_hub_download(REPO, fpath, revision=PINNED, cache_dir=hf_cache)
        ours = tree(kiln_cache / "models--kiln-test--interop-model")
        theirs = tree(hf_cache / "models--kiln-test--interop-model")
        assert ours == theirs, f"\nkiln:            {ours}\nhuggingface_hub: {theirs}"

    def kiln_reuses_huggingface_hubs_cache():
        r = kiln_get(hf_cache, REPO)
        assert "0 B to download" in r.stderr and "0 downloaded" in r.stderr, r.stderr

    print(f"huggingface_hub {huggingface_hub.__version__}, mock hub at {endpoint}")
    check("hub::kiln_get_downloads_from_the_mock_hub", kiln_downloads)
    check("hub::scan_cache_dir_lists_kilns_repo", scan_lists_kilns_repo)
    check("hub::try_to_load_from_cache_finds_kilns_files", try_to_load_finds_kilns_files)
    check("hub::hf_hub_download_offline_uses_kilns_files", offline_download_uses_kilns_files)
    check("hub::kiln_and_huggingface_hub_write_the_same_layout", same_layout_as_huggingface_hub)
    check("hub::kiln_reuses_huggingface_hubs_cache", kiln_reuses_huggingface_hubs_cache)
    server.shutdown()
    cdn.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; 0 ignored")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
