"""How long `/health` takes while `kvstrata serve` (default model) refuses large requests: a 10 MB body
(over --max-request-bytes), a 3.9 MB prompt (under it, refused by the character pre-check), and a prompt
just under the pre-check's bound (tokenized in a worker thread, then refused for its token count).
/health is polled every 10 ms from before each request is sent until its answer arrives; the JSON holds
the slowest /health answer per case, beside the idle server's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx

from kvstrata.bench.report import machine_info
from kvstrata.bench.serve import wait_healthy

PORT = 8765
URL = f"http://127.0.0.1:{PORT}"


def health_latencies_during(send) -> tuple[list[float], httpx.Response]:
    """Poll /health while `send()` runs; return the /health latencies and send's response."""
    done, latencies, result = threading.Event(), [], {}
    thread = threading.Thread(target=lambda: (result.update(reply=send()), done.set()))
    with httpx.Client(timeout=60) as http:
        thread.start()
        while not done.is_set():
            start = time.perf_counter()
            http.get(URL + "/health")
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    thread.join()
    return latencies, result["reply"]


def main() -> None:
    server = subprocess.Popen([sys.executable, "-m", "kvstrata.cli.main", "serve", "--port", str(PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(URL)
        model = httpx.get(URL + "/v1/models").json()["data"][0]
        max_chars = None  # the pre-check's bound, read from its message in the second case
        cases = {}
        idle, _ = health_latencies_during(lambda: time.sleep(1.0))
        for name, prompt_chars in (("10MB_body_over_limit", 10_000_000), ("3.9MB_prompt_precheck", 3_900_000),
                                   ("prompt_at_precheck_bound", -1)):
            if prompt_chars < 0:
                prompt_chars = max_chars
            body = {"model": model["id"], "prompt": "word " * (prompt_chars // 5), "max_tokens": 1}
            started = time.perf_counter()
            latencies, reply = health_latencies_during(
                lambda b=body: httpx.post(URL + "/v1/completions", json=b, timeout=120))
            message = reply.json()["error"]["message"]
            if max_chars is None and "characters" in message:
                max_chars = int(message.split("more than ")[1].split(" ")[0])
            cases[name] = {"prompt_chars": prompt_chars, "status": reply.status_code, "message": message[:160],
                           "request_seconds": round(time.perf_counter() - started, 3),
                           "health_polls": len(latencies), "health_max_ms": round(1000 * max(latencies), 1),
                           "health_median_ms": round(1000 * sorted(latencies)[len(latencies) // 2], 1)}
        print(json.dumps({"machine": machine_info(), "model": model["id"], "max_model_len": model["max_model_len"],
                          "idle_health_max_ms": round(1000 * max(idle), 1), "cases": cases}, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
