#!/usr/bin/env python3
"""The chat page (`GET /`) in headless Chromium, driven over the DevTools
protocol: `kiln serve` with an API key; the page asks for the key, lists the
model, a typed message streams its answer into the page (the text is seen
growing), the stats line shows tokens/s, a long answer is stopped and the
server cancels it, a reload keeps the conversation, the markdown renderer
escapes HTML; a screenshot is saved.

    tests/web/chat_page.py KILN_BINARY MODEL SCREENSHOT.png

Needs Chromium (`apt-get install chromium`); stdlib only otherwise (a small
WebSocket client for the DevTools protocol is below).
"""
import base64
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

KEY = "page-test-key"


def fail(msg):
    print(f"chat_page: FAIL: {msg}", flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print(f"chat_page: ok: {msg}", flush=True)


class WebSocket:
    """Just enough of RFC 6455 for a client: text frames, masked."""

    def __init__(self, url):
        m = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        host, port, path = m.group(1), int(m.group(2)), m.group(3)
        self.sock = socket.create_connection((host, port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError(head.decode(errors="replace"))

    def send(self, text):
        data = text.encode()
        n = len(data)
        header = bytes([0x81])
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _exact(self, n):
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError("websocket closed")
            out += chunk
        return out

    def recv(self):
        message = b""
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise EOFError("websocket closed")
            if opcode in (0x9, 0xA):
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()


class Page:
    """One DevTools target: commands and their answers (events dropped)."""

    def __init__(self, ws_url):
        self.ws = WebSocket(ws_url)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, what, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        fail(f"timed out waiting for {what}")

    def type(self, element_id, text):
        self.js(f"document.getElementById({json.dumps(element_id)}).focus()")
        self.call("Input.insertText", text=text)

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)


def start_server(kiln, model):
    proc = subprocess.Popen(
        [kiln, "serve", model, "--device", "cpu", "--port", "0", "--api-key", KEY,
         "--throughput-log-secs", "0"],
        stderr=subprocess.PIPE, text=True)
    addr = None
    for line in proc.stderr:
        m = re.search(r" on http://(\S+)", line)
        if m:
            addr = m.group(1)
        if line.rstrip().endswith("; ready"):
            break
    threading.Thread(target=lambda: [print("server:", l.rstrip(), flush=True) for l in proc.stderr if os.environ.get("CHAT_PAGE_VERBOSE")], daemon=True).start()
    if addr is None:
        proc.kill()
        fail("kiln serve did not start")
    return proc, addr


def start_chromium(profile):
    exe = next((e for e in ("chromium", "chromium-browser", "google-chrome") if shutil_which(e)), None)
    if exe is None:
        fail("no chromium on PATH (apt-get install chromium)")
    proc = subprocess.Popen(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--window-size=1280,820", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, int(m.group(1))
    fail("chromium did not start")


def shutil_which(name):
    import shutil
    return shutil.which(name)


def stats(addr):
    req = urllib.request.Request(f"http://{addr}/stats", headers={"authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def main():
    kiln, model, shot = sys.argv[1:4]
    server, addr = start_server(kiln, model)
    profile = tempfile.mkdtemp(prefix="kiln-chromium-")
    browser, port = start_chromium(profile)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            targets = json.load(r)
        target = next(t for t in targets if t["type"] == "page")
        page = Page(target["webSocketDebuggerUrl"])
        page.call("Page.enable")
        page.call("Page.navigate", url=f"http://{addr}/")
        page.wait("document.readyState === 'complete' && !!document.getElementById('prompt')", "the page")

        # The key: asked for, then the model list.
        page.wait("document.getElementById('banner').classList.contains('show')", "the API-key banner")
        check(True, "the page asks for the API key (the server answers 401 without it)")
        page.type("api-key", KEY)
        page.js("document.getElementById('save-key').click()")
        model_name = page.wait(
            "document.getElementById('model').options.length ? document.getElementById('model').value : ''",
            "the model list")
        check(os.path.basename(model).startswith(model_name), f"the model picker lists {model_name}")

        # A short answer, streamed.
        page.js("document.getElementById('toggle-settings').click()")
        page.type("max-tokens", "48")
        page.type("temperature", "0")
        page.type("prompt", "Write three short sentences about pottery kilns.")
        page.press_enter()
        answer = "(() => { const a = document.querySelectorAll('.msg.assistant .answer'); " \
                 "const x = a[a.length - 1]; return x ? [x.textContent, x.classList.contains('cursor')] : null; })()"
        seen = set()
        deadline = time.time() + 180
        while time.time() < deadline:
            v = page.js(answer)
            if v and v[1] and v[0]:
                seen.add(v[0])
            if v and not v[1] and v[0]:
                break
            time.sleep(0.02)
        final = page.js(answer)
        check(final and final[0].strip(), f"the answer is on the page: {final[0][:60]!r}...")
        check(len(seen) >= 2, f"the text was seen growing while it streamed ({len(seen)} partial states)")
        stats_line = page.wait(
            "(() => { const s = document.querySelectorAll('.msg.assistant .stats'); "
            "return s.length ? s[s.length - 1].textContent : ''; })()", "the stats line")
        check("tok/s" in stats_line and "tokens" in stats_line, f"the stats line: {stats_line!r}")
        png = page.call("Page.captureScreenshot", format="png")["data"]
        with open(shot, "wb") as f:
            f.write(base64.b64decode(png))
        check(os.path.getsize(shot) > 10_000, f"screenshot saved to {shot}")

        # Stop: the page aborts and the server cancels the request. (A small
        # model may end its answer on its own just as Stop is pressed: the
        # server then counts it finished, not cancelled; then again.)
        page.js("document.getElementById('max-tokens').value = ''")
        page.type("max-tokens", "2000")
        last_stats = "(() => { const s = document.querySelectorAll('.msg.assistant .stats'); return s.length ? s[s.length - 1].textContent : ''; })()"
        for attempt in range(4):
            before = stats(addr)["scheduler"]
            page.type("prompt", "Write a long story about a potter and her kiln, at least 600 words.")
            page.press_enter()
            page.wait("(() => { const a = document.querySelectorAll('.msg.assistant .answer'); "
                      "const x = a[a.length - 1]; return x && x.classList.contains('cursor') && x.textContent.length > 5; })()",
                      "the long answer to start")
            page.js("document.getElementById('stop').click()")
            page.wait("document.getElementById('send').style.display === ''", "the page to stop")
            check("stopped" in page.js(last_stats), "the stopped message says so")
            deadline = time.time() + 60
            s = stats(addr)["scheduler"]
            while time.time() < deadline and s["num_running"] > 0:
                time.sleep(0.05)
                s = stats(addr)["scheduler"]
            if s["num_finished"] == before["num_finished"]:
                break
            print(f"chat_page: the answer ended on its own as Stop was pressed; again", flush=True)
        check(s["num_cancelled"] > before["num_cancelled"] and s["num_running"] == 0
              and s["num_finished"] == before["num_finished"],
              f"Stop cancelled the request in the server (cancelled {before['num_cancelled']} -> "
              f"{s['num_cancelled']}; running {s['num_running']}, finished {s['num_finished']})")
        messages = page.js("document.querySelectorAll('.msg').length")

        # The conversation survives a reload (the browser's storage).
        page.call("Page.reload")
        time.sleep(0.5)
        page.wait(f"document.readyState === 'complete' && document.querySelectorAll('.msg').length === {messages}",
                  "the conversation after a reload")
        again = page.js("document.querySelectorAll('.msg.assistant .answer')[0].textContent")
        check(again == final[0], "a reload shows the same conversation from the browser's storage")
        check(page.js("document.querySelectorAll('#conversations li').length") == 1, "one conversation listed")

        # The markdown renderer escapes what the model writes.
        html = page.js("markdown('<img src=x onerror=alert(1)> **bold** `a<b`\\n\\n```js\\nif (a < b) {}\\n```\\n- [x](javascript:alert(1))')")
        check("<img" not in html and "&lt;img" in html, "HTML in an answer is escaped")
        check("<strong>bold</strong>" in html and "<code>a&lt;b</code>" in html, "bold and inline code")
        check('<span class="lang">js</span><code>if (a &lt; b) {}</code>' in html, "a fenced code block with its language")
        check("href" not in html, "only http(s) links become links")
        html = page.js("markdown('1. one\\n\\n2. two\\n\\n3) three\\n\\nafter')")
        check(html == "<ol><li>one</li><li>two</li><li>three</li></ol><p>after</p>", f"a list split by blank lines is one list: {html}")
        # Reasoning apart from the answer, tool calls shown (a message as
        # the stream leaves it; SmolLM2 writes neither).
        node = page.js("(() => { const n = messageNode({role: 'assistant', content: 'The answer.', "
                       "reasoning: 'First, think.', toolCalls: [{name: 'get_weather', arguments: '{\"city\": \"Oslo\"}'}], "
                       "usage: {completion_tokens: 9, prompt_tokens: 20, prompt_tokens_details: {cached_tokens: 16}}, "
                       "tokensPerSecond: 12.5}, false); return [n.querySelector('details.reasoning .text').textContent, "
                       "n.querySelector('.answer').textContent, n.querySelector('.tool-call .name').textContent, "
                       "n.querySelector('.tool-call pre').textContent, n.querySelector('.stats').textContent]; })()")
        check(node[0] == "First, think." and node[1] == "The answer.", "reasoning is shown apart from the answer")
        check(node[2] == "Tool call: get_weather" and node[3] == '{"city": "Oslo"}', "a tool call is shown with its arguments")
        check("(16 cached)" in node[4] and "12.5 tok/s" in node[4], f"cached tokens and speed: {node[4]!r}")
        print("chat_page: all checks passed", flush=True)
    finally:
        browser.kill()
        server.kill()


if __name__ == "__main__":
    main()
