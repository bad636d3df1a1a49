"""Starting `kiln serve` for the Python test suites (standard library only): the server picks
its port (`--port 0`) and prints its address, listens at once and loads the model in the
background, /health answering 503 until the model is loaded, then 200."""
import re
import subprocess
import time
import urllib.error
import urllib.request


def wait_ready(p, base, deadline):
    """Waits for /health to answer 200 (the model loaded) before `deadline`."""
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise
        if p.poll() is not None:
            raise RuntimeError("kiln serve exited: " + p.stderr.read())
        time.sleep(0.05)
    p.kill()
    raise RuntimeError("kiln serve did not load the model in time")


def start(kiln, model, *extra, timeout=180):
    """`kiln serve MODEL` on the CPU with 2 threads and `extra` flags, ready: (process, base URL)."""
    p = subprocess.Popen([kiln, "serve", str(model), "--port", "0", "--threads", "2", "--device", "cpu", *extra],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = re.search(r"on (http://[0-9.:]+)", p.stderr.readline() or "")
        if m:
            wait_ready(p, m.group(1), deadline)
            return p, m.group(1)
        if p.poll() is not None:
            raise RuntimeError("kiln serve exited: " + p.stderr.read())
    p.kill()
    raise RuntimeError("kiln serve did not start in time")
