"""`mokv serve` over HTTP with the `openai` client, beside MAX's own `max serve` on the
same checkpoint and flags (MAX's tiny random-weight Llama on the CPU, float32).

Both servers start once for the module (the model compiles once per machine: minutes
cold, ~30 s warm). The mokv server runs with a host tier, KV-cache events, sessions and
pins from `--mokv-config`; the traces compared with MAX's server stay within the device pages,
where the host tier does not change what a request finds. Prompts are token ids: both
servers see the same ids whatever the tokenizer does with text.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import mokv_graphs as mg
import numpy as np
import pytest
import zmq
from mokv.events.format import BatchDecoder
from mokv.pipelines.server_process import ServerProcess, free_port

openai = pytest.importorskip("openai")

SERVE_ARGS = [
    "--devices",
    "cpu",
    "--quantization-encoding",
    "float32",
    "--max-length",
    "1024",
    "--max-batch-size",
    "2",
    "--enable-prefix-caching",
]
"""MAX's pool for these: 2 requests x 8 pages of 128 tokens, plus its null page."""
PAGE = 128
SYSTEM = [int(t) for t in np.random.default_rng(7).integers(3, 256, 300)]
"""A shared system prompt: two full pages and 44 tokens."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return mg.tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def events_port():
    return free_port()


@pytest.fixture(scope="module")
def mokv_server(model, tmp_path_factory, events_port):
    directory = tmp_path_factory.mktemp("mokv-serve")
    config = directory / "mokv.yaml"
    config.write_text(
        json.dumps(
            {
                "host_tier": {"swap_space_gb": 0.05},
                "kv_events": {"endpoint": f"tcp://127.0.0.1:{events_port}"},
                "sessions": {"ttl_s": 600},
                "pins": {"max_share": 0.5},
            }
        )
    )
    args = ["--model", str(model), *SERVE_ARGS, "--mokv-config", str(config)]
    with ServerProcess("mokv", args, directory / "serve.log") as server:
        yield server


@pytest.fixture(scope="module")
def max_server(model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("max-serve")
    with ServerProcess("max", ["--model", str(model), *SERVE_ARGS], directory / "serve.log") as s:
        yield s


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=120)


def complete(server, prompt, max_tokens=8, **extra):
    """(text, cached tokens) of a greedy completion of a token-id prompt."""
    response = client(server).completions.create(
        model=str(server.command[server.command.index("--model") + 1]),
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra or None,
    )
    return response.choices[0].text, response.usage.prompt_tokens_details.cached_tokens


def settled_metric(server, name, **labels):
    """A Prometheus series once it stops changing (MAX's scheduler hands its batch metrics
    to a telemetry process, which exports them a moment later)."""
    value, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(1)
        value, last = server.metric(name, **labels), value
        if value is not None and value == last:
            break
    return value


def metric_reaches(server, name, accept, timeout_s=15.0) -> bool:
    """Whether a Prometheus series reads a value `accept` takes within `timeout_s` (MAX
    records its batch gauges as batches run and exports them from another process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = server.metric(name)
        if value is not None and accept(value):
            return True
        time.sleep(0.5)
    return False


def test_mokv_serve_answers_as_max_serve_does(mokv_server, max_server):
    trace = [
        SYSTEM + [60, 61, 62],
        SYSTEM + [70, 71],
        SYSTEM + [60, 61, 62],
        [5] * 40,
        SYSTEM + list(range(3, 200)),
    ]
    ours = [complete(mokv_server, prompt) for prompt in trace]
    theirs = [complete(max_server, prompt) for prompt in trace]
    assert ours == theirs
    assert [cached for _, cached in ours] == [0, 2 * PAGE, 2 * PAGE, 0, 2 * PAGE]
    log = mokv_server.log_text()
    assert "mokv KV cache: 17 pages of 128 tokens" in log  # MAX's memory plan, all of it
    assert "Jenga KV manager" not in log and "legacy KV cache" not in log  # MAX's pool: never
    assert "Jenga KV manager: 17 huge pages" in max_server.log_text()


def test_more_requests_than_the_batch_holds_are_all_served(mokv_server, max_server):
    prompts = [SYSTEM + [100 + i] * (i + 1) for i in range(6)]  # max_batch_size is 2
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        ours = list(pool.map(lambda p: complete(mokv_server, p)[0], prompts))
    assert ours == [complete(max_server, p)[0] for p in prompts]


def test_a_stream_carries_the_same_tokens_and_usage(mokv_server):
    prompt = SYSTEM + [80, 81]
    stream = client(mokv_server).completions.create(
        model=mokv_server.command[mokv_server.command.index("--model") + 1],
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert (text, usage.prompt_tokens_details.cached_tokens) == complete(mokv_server, prompt)


def test_a_client_that_disconnects_mid_stream_frees_its_pages(mokv_server):
    stream = client(mokv_server).completions.create(
        model=mokv_server.command[mokv_server.command.index("--model") + 1],
        prompt=[9] * 600,
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    for _ in zip(range(3), stream):  # a few tokens, then the client goes away
        pass
    # MAX's gauge of the pages in use at its last batch (rounded down by MAX: int(17 x
    # share)): the stream's 5 pages while it runs ...
    used = "maxserve_cache_num_used_blocks"
    assert metric_reaches(mokv_server, used, lambda pages: pages >= 4)
    stream.close()
    time.sleep(2)
    complete(mokv_server, [11, 12, 13], max_tokens=2)  # a batch of its own: one page
    # ... and no more than the small request's page once it has gone.
    assert metric_reaches(mokv_server, used, lambda pages: pages <= 1)


def test_reset_prefix_cache_forgets_every_prefix(mokv_server):
    import urllib.request

    prompt = SYSTEM + [90, 91]
    complete(mokv_server, prompt)
    assert complete(mokv_server, prompt)[1] == 2 * PAGE
    request = urllib.request.Request(f"{mokv_server.url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request) as response:
        assert response.status == 200
    time.sleep(1)  # the model worker resets between two scheduler iterations
    assert complete(mokv_server, prompt)[1] == 0


def test_events_name_the_served_pages_and_their_session(mokv_server, events_port):
    # The server's publisher connects to this address (a router binds: llm-d's topology).
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.bind(f"tcp://127.0.0.1:{events_port}")
    # The publisher reconnects within its 100 ms retry interval; a SUB socket sends its
    # subscription to a new peer only when this thread calls into it (a poll), and a PUB
    # drops what it sends before the subscription arrives.
    for _ in range(20):
        socket.poll(100)
    agent = [int(t) for t in np.random.default_rng(8).integers(3, 256, 260)]
    complete(mokv_server, agent, dkv_cache_hint={"session_id": "agent-1"})
    stored = []
    while socket.poll(2000):
        batch = BatchDecoder().decode(socket.recv_multipart()[2])
        stored += [e for e in batch.events if type(e).__name__ == "BlockStored"]
    socket.close()
    device = [e for e in stored if e.medium == "GPU"]
    # One event may carry several pages (block_hashes), their tokens one after another.
    assert sum(len(e.block_hashes) for e in device) == 2
    assert [t for e in device for t in e.token_ids] == agent[: 2 * PAGE]
    assert {e.session_id for e in device} == {"agent-1"}
    assert {e.medium for e in stored} == {"GPU", "CPU"}  # written through to the host tier


def test_the_host_tier_serves_a_prefix_the_device_evicted(mokv_server):
    prompt = [int(t) for t in np.random.default_rng(9).integers(3, 256, 260)]
    assert complete(mokv_server, prompt)[1] == 0
    for seed in range(5):  # other prompts push its pages off the 17 device pages
        filler = [int(t) for t in np.random.default_rng(100 + seed).integers(3, 256, 900)]
        complete(mokv_server, filler, max_tokens=1)
    external = "maxserve_cache_hits_tokens_total"  # MAX's count of what its tiers supplied
    before = settled_metric(mokv_server, external, tier="external") or 0
    assert complete(mokv_server, prompt + [4, 5])[1] == 2 * PAGE  # loaded, not recomputed
    assert settled_metric(mokv_server, external, tier="external") == before + 2 * PAGE


def test_a_bad_request_gets_an_http_error_and_the_server_keeps_serving(mokv_server):
    for bad in ([7] * 1100, [100_000, 5]):  # past --max-length; out of the vocabulary
        with pytest.raises(openai.APIStatusError) as error:
            complete(mokv_server, bad)
        assert 400 <= error.value.status_code < 500
    assert complete(mokv_server, SYSTEM + [1, 2])[0]


def test_cache_control_pins_write_policies_and_usage(mokv_server):
    """Anthropic's cache_control and a write policy ride in dkv_cache_hint on a token-id
    completion; usage reports cache_read_input_tokens / cache_creation_input_tokens.
    Last in the module: its pin holds device pages until the reset at its end."""
    import urllib.request

    model = str(mokv_server.command[mokv_server.command.index("--model") + 1])

    def usage(prompt, stream=False, **hint):
        kwargs = dict(model=model, prompt=prompt, max_tokens=1, temperature=0,
                      extra_body={"dkv_cache_hint": hint} if hint else None)
        if not stream:
            return client(mokv_server).completions.create(**kwargs).usage
        chunks = client(mokv_server).completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        return [chunk.usage for chunk in chunks if chunk.usage is not None][-1]

    def counters(u):
        return (u.prompt_tokens_details.cached_tokens, u.cache_read_input_tokens,
                u.cache_creation_input_tokens)

    rng = np.random.default_rng(21)
    pinned, read_only, prefix = ([int(t) for t in rng.integers(3, 256, 300)] for _ in range(3))
    pin = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert counters(usage(pinned, **pin)) == (0, 0, 2 * PAGE)
    assert counters(usage(pinned + [7], stream=True)) == (2 * PAGE, 2 * PAGE, 0)
    # read-only: it writes nothing, on the device or in the host tier
    assert counters(usage(read_only, write_policy="read_only")) == (0, 0, 0)
    assert counters(usage(read_only)) == (0, 0, 2 * PAGE)
    assert counters(usage(prefix, write_policy={"prefix_tokens": PAGE})) == (0, 0, PAGE)
    assert counters(usage(prefix)) == (PAGE, PAGE, PAGE)
    for bad in ({"cache_control": {"type": "ephemeral", "ttl": "2h"}},
                {"cache_control": {"type": "persistent"}}, {"write_policy": "some"}):
        with pytest.raises(openai.BadRequestError, match=next(iter(bad))):
            usage(pinned, **bad)
    request = urllib.request.Request(f"{mokv_server.url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request) as response:  # ends the pin
        assert response.status == 200
