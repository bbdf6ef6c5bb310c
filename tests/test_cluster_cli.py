"""`kvstrata serve --replicas 2 --fronts 2` as a user starts it: a process that serves, then exits 0 on SIGTERM."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvstrata.bench.redis_server import free_port

pytestmark = pytest.mark.slow


def test_serve_with_replicas_answers_and_stops_cleanly_on_sigterm(tiny_llama):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvstrata.cli.main", "serve", "--replicas", "2", "--fronts", "2", "--port",
                               str(port), "--model", str(tiny_llama), "--served-model-name", "tiny"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "the replicated server did not come up"
            try:
                health = httpx.get(url + "/health", timeout=2)  # Serve's proxy answers in plain text until
                if health.status_code == 200 and health.json().get("replicas_up") == 2:  # the app is up
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        answer = httpx.post(url + "/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "Once upon", "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'kvstrata:replica_up{replica="1"} 1.0' in metrics and "_created" not in metrics
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    assert code == 0, server.stderr.read().decode()[-2000:]
