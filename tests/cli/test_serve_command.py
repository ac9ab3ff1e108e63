"""``flashdsa serve`` says where it listens and what it serves, and serves there."""

import queue
import re
import subprocess
import sys
import threading

import httpx

STARTED = re.compile(r"serving (\S+) at (http://127\.0\.0\.1:(\d+))/v1 \(model (\S+), mode reference, device cpu, "
                     r"KV cache 8 blocks = 512 tokens, [\d.]+ GiB; max model len 256\)")


def test_serve_logs_its_url_model_mode_device_and_cache_then_serves_there(shrunk):
    command = [sys.executable, "-m", "flashdsa.cli", "serve", "--model", str(shrunk), "--port", "0", "--device", "cpu",
               "--mode", "reference", "--num-blocks", "8", "--max-model-len", "256"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        seen = ""
        while (found := STARTED.search(seen)) is None:
            try:
                seen += lines.get(timeout=90)
            except queue.Empty:
                raise AssertionError(f"no startup line within 90 s; stderr: {seen}") from None
        name, url, port, model = found.groups()
        assert name == shrunk.name and model == str(shrunk) and int(port) > 0
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == name
    finally:
        process.terminate()
        process.wait(timeout=30)
