"""Replicated serving on a local Ray instance with a real redis-server: kv-aware routing (the replicas' KV events
reaching the front), the shared Redis tier, a replica killed mid-request, and the official OpenAI client against the
one endpoint. (The default prefix routing runs end to end in test_cluster_cli.py; its choices are unit-tested in
test_cluster_routing.py.)"""

import json
import os
import signal
import threading
import time

import httpx
import pytest
import ray  # the cluster extra: `make test` installs it, so these tests run on every fresh machine
from ray import serve

from kvstrata.bench.redis_server import RedisServer, free_port
from kvstrata.cluster.frontend import REPLICA_HEADER
from kvstrata.cluster.launch import APP_NAME, PROXY_READY_SECONDS, PROXY_READY_VARIABLE, deploy, undeploy
from kvstrata.cluster.routing import KVAwareRouting, prompt_blocks
from kvstrata.config import EngineConfig
from kvstrata.server.options import ServerOptions

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "cluster-key"  # the deployment asks for an API key: the front and the replicas check it
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama, redis):
    config = EngineConfig(model=str(tiny_llama), kv_store=f"host:64MiB,{redis.url}", kv_store_chunk_tokens=64)
    url = deploy(config, ServerOptions(api_key=KEY), replicas=2, routing="kv-aware", host="127.0.0.1", port=free_port(),
                 model_name=MODEL, routing_prefix_tokens=64)
    yield url
    undeploy(stop_ray=True)


def replica(index: int):
    return serve.get_deployment_handle(f"kvstrata-replica-{index}", APP_NAME)


def complete(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)


def metric(url: str, name: str, replica_index: int | None = None, default: float | None = None,
           **labels: str) -> float:
    """The value of one series on the cluster's /metrics: a replica's, or (no index) the cluster's total;
    `default` when the series is not there (yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {**labels, **({} if replica_index is None else {"replica": str(replica_index)})}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()) and \
                    (replica_index is not None or "replica" not in sample.labels):
                return sample.value
    if default is not None:
        return default
    raise AssertionError(f"{name} {wanted} is not on /metrics")


def documents(count: int) -> list[str]:
    words = ["river", "stone", "lamp", "garden", "winter", "letter", "harbour", "violin", "meadow", "clock"]
    return [" ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(60)) for i in range(count)]


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_same_prefix_meets_the_same_replica_and_distinct_prefixes_spread(cluster):
    homes = []
    for document in documents(8):
        first = complete(cluster, document + " Question one?")
        second = complete(cluster, document + " And a different question two?")
        assert first.status_code == second.status_code == 200
        assert first.headers[REPLICA_HEADER] == second.headers[REPLICA_HEADER]
        homes.append(first.headers[REPLICA_HEADER])
    assert set(homes) == {"0", "1"}
    assert metric(cluster, "kvstrata:prefix_cache_hits_total") > 0  # the second questions reused the first's blocks


def test_the_replicas_run_at_the_priority_of_the_machine_s_other_processes(cluster):
    """At Ray's own default (niceness 15) two busy loops beside it kept Serve's proxy from starting for over a minute."""
    for index in (0, 1):
        pid = replica(index).identity.remote().result()["pid"]
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)


def test_ray_s_workers_give_serve_s_proxy_a_minute_to_start(cluster):
    @ray.remote(num_cpus=0)
    def setting(name: str) -> str | None:
        return os.environ.get(name)

    assert ray.get(setting.remote(PROXY_READY_VARIABLE)) == str(PROXY_READY_SECONDS)


def test_a_prompt_goes_where_a_replica_reports_holding_its_prefix(cluster):
    passage = [3 + (5 * i) % 300 for i in range(80)]  # five blocks, beyond the 64-token hashing key
    namespace, window, _ = replica(0).kv_events.remote(None, 0).result()
    assert window is None  # the tiny model has no sliding window
    hashing = KVAwareRouting(2, 16, 64)
    by_hashing = hashing.order(prompt_blocks(passage, 16, None, namespace), [0, 0], [True, True])[0]
    holder = 1 - by_hashing
    # Computed on the replica the ring would not pick, behind the front's back: only its events can tell the front.
    body = json.dumps({"model": MODEL, "prompt": passage + [9], "max_tokens": 2, "temperature": 0}).encode()
    headers = [("content-type", "application/json"), ("content-length", str(len(body))),
               ("authorization", AUTH["Authorization"])]
    messages = list(replica(holder).forward.options(stream=True).remote("POST", "/v1/completions", "", headers, body))
    assert messages[0].status == 200
    _, _, events = replica(holder).kv_events.remote(None, 0).result()
    held = {block for _, block in events.changes}
    assert set(prompt_blocks(passage, 16, None, namespace)) <= held  # the replica reports the front's own keys
    wait_until(lambda: metric(cluster, "kvstrata:router_kv_blocks", holder) >= len(held), 30,
               "the front to read the replica's events")
    answer = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": passage + [11], "max_tokens": 2},
                        headers=AUTH, timeout=120)
    assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == str(holder)


def test_a_prefix_computed_on_one_replica_is_a_store_hit_on_the_other(cluster):
    prompt = documents(9)[-1] + " What happened next?"
    answer = complete(cluster, prompt)
    home = int(answer.headers[REPLICA_HEADER])
    other = 1 - home
    wait_until(lambda: metric(cluster, "kvstrata:kv_store_written_bytes_total", home, tier="redis") > 0, 30, "the store write")
    hits_before = metric(cluster, "kvstrata:kv_store_hit_tokens_total", other, tier="redis")
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    headers = [("content-type", "application/json"), ("content-length", str(len(body))),
               ("authorization", AUTH["Authorization"])]
    messages = list(replica(other).forward.options(stream=True).remote(
        "POST", "/v1/completions", "", headers, body.encode()))
    assert messages[0].status == 200
    direct = json.loads(b"".join(messages[1:]))
    assert direct["choices"][0]["text"] == answer.json()["choices"][0]["text"]
    assert metric(cluster, "kvstrata:kv_store_hit_tokens_total", other, tier="redis") > hits_before


def test_the_openai_client_works_unchanged(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True) if chunk.choices)
    assert streamed == completion.choices[0].text
    answer = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, temperature=0,
                                          stream=True))  # relayed as the replica streams it
    assert events[-1].response.output_text == answer.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="temperature"):  # the replica's own validation, passed on
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=-1)


def test_a_client_that_leaves_has_its_request_aborted_on_the_replica(cluster):
    body = {"model": MODEL, "prompt": documents(12)[-1], "max_tokens": 250, "ignore_eos": True, "stream": True}
    aborted = metric(cluster, "kvstrata:request_success_total", default=0.0, finished_reason="abort")
    with httpx.stream("POST", cluster + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        next(response.iter_lines())  # the first event arrived: the request runs on its replica; now leave
    wait_until(lambda: metric(cluster, "kvstrata:request_success_total", default=0.0,
                              finished_reason="abort") > aborted, 30, "the replica to abort the request")


def test_a_body_routing_cannot_read_is_still_answered_by_a_replica(cluster):
    answer = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": [2**70], "max_tokens": 2},
                        headers=AUTH)
    assert answer.status_code == 400, answer.text


def test_the_front_turns_away_requests_without_the_api_key(cluster):
    def routed_so_far() -> float:
        return sum(metric(cluster, "kvstrata:router_requests_total", i, default=0.0) for i in (0, 1))

    routed = routed_so_far()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = httpx.post(cluster + "/v1/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert routed_so_far() == routed  # no replica was asked
    assert httpx.get(cluster + "/health").status_code == 200  # probes and scrapers need no key


def _kill_when_running(url: str, index: int) -> None:
    wait_until(lambda: metric(url, "kvstrata:num_requests_running", index) >= 1, 30, "the request to start")
    os.kill(replica(index).identity.remote().result()["pid"], signal.SIGKILL)


def test_killing_a_replica_loses_no_request_and_ray_restarts_it(cluster):
    prompt = documents(10)[-1] + " Tell the whole story."
    expected = complete(cluster, prompt, max_tokens=250)
    home = int(expected.headers[REPLICA_HEADER])

    # A stream that already sent tokens ends with a clear error event.
    killer = threading.Thread(target=_kill_when_running, args=(cluster, home))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        killer.start()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    killer.join()
    assert lines[-1] == "data: [DONE]"
    assert "failed mid-stream" in json.loads(lines[-2][6:])["error"]["message"]
    wait_until(lambda: httpx.get(cluster + "/health").json()["replicas_up"] == 2, 120, "the replica's restart")

    # A non-streaming request is answered by the other replica, exactly as the first would have.
    home = int(complete(cluster, prompt, max_tokens=2).headers[REPLICA_HEADER])
    killer = threading.Thread(target=_kill_when_running, args=(cluster, home))
    killer.start()
    answer = complete(cluster, prompt, max_tokens=250)
    killer.join()
    assert answer.status_code == 200
    assert answer.headers[REPLICA_HEADER] != str(home)
    assert answer.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    assert metric(cluster, "kvstrata:router_retries_total") >= 1


def test_losing_the_shared_redis_degrades_to_recompute(cluster, redis):
    prompt = documents(11)[-1] + " One more question?"
    failures_before = metric(cluster, "kvstrata:kv_store_errors_total", tier="redis")
    redis.stop()
    try:
        answer = complete(cluster, prompt)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        assert metric(cluster, "kvstrata:kv_store_errors_total", tier="redis") > failures_before
    finally:
        redis.start()  # the other tests need Redis, and need not run before this one (pytest-xdist's --dist load)


def test_the_front_renders_a_chat_s_routing_key_with_the_replicas_chat_template(tiny_llama):
    """Where --chat-template replaces the model's, the front renders chats with it too (not with the checkpoint's),
    so a chat's key is the replicas' prompt."""
    from kvstrata.cluster.frontend import Frontend, FrontOptions
    from kvstrata.cluster.routing import prompt_blocks
    from kvstrata.model.tokenizer import Tokenizer
    from kvstrata.server.embeddings import EmbeddingRequest
    from kvstrata.server.protocol import ChatCompletionRequest
    from kvstrata.server.responses_protocol import ResponsesRequest

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    options = FrontOptions(checkpoint=str(tiny_llama), routing="prefix", block_size=16, routing_prefix_tokens=256,
                           max_request_bytes=2**20, chat_template=template)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Where is Highbury?"}]}'
    blocks, _ = Frontend(options, None)._route_on(ChatCompletionRequest, body)
    assert blocks == prompt_blocks(Tokenizer.from_directory(tiny_llama).encode("[user] Where is Highbury?\n"), 16)
    responses = b'{"model": "m", "input": "Where is Highbury?", "stream": true}'  # the chat request it amounts to
    assert Frontend(options, None)._route_on(ResponsesRequest, responses) == (blocks, True)
    embedding = b'{"model": "m", "input": ["[user] Where is Highbury?\\n", "Hartfield"]}'  # by its first input
    assert Frontend(options, None)._route_on(EmbeddingRequest, embedding) == (blocks, False)
