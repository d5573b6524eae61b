"""The OpenAI-compatible server, end to end: the official `openai` client against real uvicorn
servers on loopback (tiny float64 chat target, random-init drafter), plus the scheduler's
interleaving, the drift monitor as a pure object, and the vLLM/SGLang export layout."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from anchorspec.api import DEFAULT_TREE, load  # noqa: E402
from anchorspec.cli import main  # noqa: E402
from anchorspec.decode.engine import StepReport  # noqa: E402
from anchorspec.models.drafter import init_drafter, load_drafter, save_drafter  # noqa: E402
from anchorspec.models.export import export_drafter  # noqa: E402
from anchorspec.serve.app import create_app  # noqa: E402
from anchorspec.decode.fallback import DriftMonitor  # noqa: E402
from anchorspec.decode.lookup import LookupSettings  # noqa: E402
from anchorspec.serve.scheduler import Scheduler  # noqa: E402
from helpers import CHAT_WORDS, save_tiny_chat_target  # noqa: E402

KEY = "test-key"
MODEL = "tiny-chat"
PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w5", "w7 w7 w7 w8", "w60 w61", "w3 w1 w4 w1 w5"]
MAX_TOKENS = 12


class LiveServer:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def client(self, api_key=KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self, api_key=KEY) -> dict:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {api_key}"}).text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metric(values: dict, name: str, **labels) -> float:
    return values.get(name + json.dumps(labels, sort_keys=True), 0.0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("serve")
    target = save_tiny_chat_target(root / "target", dtype=torch.float64)
    drafter = init_drafter(AutoConfig.from_pretrained(target), "eagle3.1", draft_vocab_size=64, seed=1)
    save_drafter(drafter, root / "drafter")
    return {"target": str(target), "drafter": str(root / "drafter"), "root": root}


@pytest.fixture(scope="module")
def reference(dirs):
    """Solo Engine.generate outputs (a separate engine: the servers' models stay on their worker)."""
    # the server's shape, speculating at every step (its monitor is off too), without generate's lookup chain
    # (the server's is opt-in): the same steps
    spec = load(dirs["target"], dirs["drafter"], dtype="float64", threads=1, shape=DEFAULT_TREE, fallback=False)
    plain = load(dirs["target"], dtype="float64", threads=1)
    out = {}
    for p in PROMPTS:
        for chat in (True, False):
            a = spec.generate(p, chat=chat, max_new_tokens=MAX_TOKENS, lookup=None)
            b = plain.generate(p, chat=chat, max_new_tokens=MAX_TOKENS)
            c = plain.generate(p, chat=chat, max_new_tokens=MAX_TOKENS, lookup=LookupSettings())  # prompt lookup
            assert a.token_ids == b.token_ids == c.token_ids  # lossless, so one reference serves every server
            out[p, chat], out["spec", p, chat], out["lookup", p, chat] = b, a, c
    return out


@pytest.fixture(scope="module")
def spec_server(dirs):
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    server = LiveServer(create_app(engine, MODEL, api_key=KEY, max_body_bytes=8192,
                                   monitor=DriftMonitor(enabled=False)))
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain_server(dirs):
    server = LiveServer(create_app(load(dirs["target"], dtype="float64"), MODEL))
    yield server
    server.close()


@pytest.fixture(scope="module")
def lookup_server(dirs):
    """Prompt lookup (no drafter, serve --lookup), every chain verified whole: the steps of a solo prompt lookup."""
    server = LiveServer(create_app(load(dirs["target"], dtype="float64"), MODEL, lookup=LookupSettings()))
    server.app.state.scheduler.chains.cost = lambda rows, width: 1.0  # a tiny model's timings are noise
    yield server
    server.close()


def chat_args(prompt, **kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0, **kw)


# --- outputs equal the solo engine ----------------------------------------------------------------

@pytest.mark.parametrize("which", ["spec", "plain", "lookup"])
def test_chat_and_completions_match_engine(which, spec_server, plain_server, lookup_server, reference):
    server = {"spec": spec_server, "plain": plain_server, "lookup": lookup_server}[which]
    client = server.client()
    for prompt in PROMPTS[:3]:
        ref = reference[prompt, True]
        r = client.chat.completions.create(**chat_args(prompt))
        assert r.object == "chat.completion" and r.model == MODEL
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        spec = r.speculative
        assert spec["enabled"] is (which != "plain")
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
        if which == "lookup":  # the very figures of a solo prompt lookup (same chains, float64)
            solo = reference["lookup", prompt, True].stats
            assert (spec["drafted_tokens"], spec["accepted_tokens"]) == (solo.drafted_tokens, solo.accepted_tokens)
            assert spec["verify_steps"] == solo.verify_steps > 0 and spec["tau"] == round(solo.tau, 4)
        elif which == "spec":  # the very figures of a solo speculative run (same steps, float64)
            solo = reference["spec", prompt, True].stats
            assert (spec["drafted_tokens"], spec["accepted_tokens"]) == (solo.drafted_tokens, solo.accepted_tokens)
            assert spec["verify_steps"] == solo.verify_steps > 0 and spec["tau"] == round(solo.tau, 4)
            assert 1 <= len(spec["acceptance_per_depth"]) <= 4  # DEFAULT_TREE depth
        else:
            assert spec["drafted_tokens"] == 0 and spec["acceptance_per_depth"] == []

        ref = reference[prompt, False]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.object == "text_completion"
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.speculative["accepted_tokens"] <= r.speculative["drafted_tokens"]


def test_token_id_prompt_and_models(spec_server, reference, dirs):
    client = spec_server.client()
    ids = load(dirs["target"], dtype="float64").encode(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference[PROMPTS[0], False].text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streaming_matches_engine(spec_server, reference):
    client = spec_server.client()
    prompt = PROMPTS[1]
    chunks = list(client.chat.completions.create(**chat_args(prompt), stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference[prompt, True].text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == reference[prompt, True].finish_reason
    assert last.speculative["drafted_tokens"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference[prompt, True].token_ids)

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == reference[prompt, False].text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_raw_sse_framing(path, spec_server):
    body = {**chat_args(PROMPTS[0]), "stream": True}
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", spec_server.url + path, json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    objects = [json.loads(e[len("data: "):]) for e in events[:-2]]  # every event but [DONE] is one JSON object
    kind = "chat.completion.chunk" if "chat" in path else "text_completion"
    for obj in objects:
        assert obj["object"] == kind and obj["model"] == MODEL and len(obj["choices"]) == 1
        assert set(obj) <= {"id", "object", "created", "model", "choices", "speculative"}
    assert len({obj["id"] for obj in objects}) == 1
    assert objects[-1]["choices"][0]["finish_reason"] == "length" and "speculative" in objects[-1]


def batched_rows(values: dict) -> tuple[float, float]:
    """(batched forwards, those with a single row) from the anchorspec_batch_rows histogram."""
    return metric(values, "anchorspec_batch_rows_count"), metric(values, "anchorspec_batch_rows_bucket", le="1.0")


def test_concurrent_streaming_clients_match_solo(spec_server, reference):
    client = spec_server.client()
    results, errors = {}, []
    before = batched_rows(spec_server.metrics())

    def worker(prompt):
        try:
            stream = client.chat.completions.create(**chat_args(prompt), stream=True)
            results[prompt] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert results == {p: reference[p, True].text for p in PROMPTS}
    after = batched_rows(spec_server.metrics())
    forwards, single = after[0] - before[0], after[1] - before[1]
    assert forwards > single  # some target forwards verified several requests at once


def queued_then_run(scheduler, engine, prompts) -> list:
    """Greedy requests for `prompts`, all queued before the scheduler's worker starts; their final results."""
    async def run():
        handles = [scheduler.submit(engine.encode(p), MAX_TOKENS, 0.0) for p in prompts]
        scheduler.start()
        outs = []
        for h in handles:
            while True:
                kind, payload = await h.queue.get()
                if kind != "tokens":
                    assert kind == "done", payload
                    outs.append(payload)
                    break
        return outs

    try:
        return asyncio.run(run())
    finally:
        scheduler.stop()


def test_scheduler_batches_forwards(dirs, reference):
    """Four requests queued before the worker starts: one prefill each, then every round verifies all
    four in ONE target forward, and each output is still the solo one."""
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    scheduler = Scheduler(engine, monitor=DriftMonitor(enabled=False), calibrate=False)
    prompts = PROMPTS[:4]
    outs = [result.token_ids for result in queued_then_run(scheduler, engine, prompts)]
    assert outs == [reference[p, False].token_ids for p in prompts]
    reg = scheduler.metrics.registry
    forwards = reg.get_sample_value("anchorspec_batch_rows_count")
    assert reg.get_sample_value("anchorspec_target_forwards_total", {"kind": "prefill"}) == 4
    assert reg.get_sample_value("anchorspec_target_forwards_total", {"kind": "batched"}) == forwards
    assert reg.get_sample_value("anchorspec_batch_rows_bucket", {"le": "3.0"}) < forwards  # a 4-row forward
    assert reg.get_sample_value("anchorspec_batch_rows_sum") > forwards  # more than one row on average
    # one batched forward per round: no more forwards than the longest request has steps
    assert forwards <= MAX_TOKENS


def test_scheduler_with_a_lookup_chain_keeps_every_output(dirs, reference):
    """Greedy requests batched with context-lookup chains merged into their drafts (decode/lookup.py, opt-in
    here): each output is still the solo plain one, and the chains were verified."""
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    scheduler = Scheduler(engine, monitor=DriftMonitor(enabled=False), calibrate=False, lookup=LookupSettings())
    prompts = PROMPTS[:4]
    outs = queued_then_run(scheduler, engine, prompts)
    assert [o.token_ids for o in outs] == [reference[p, False].token_ids for p in prompts]
    assert sum(o.stats.lookup_rows for o in outs) > 0
    # /metrics says the same as the requests' stats
    sample = scheduler.metrics.registry.get_sample_value
    assert sample("anchorspec_lookup_drafted_tokens_total") == sum(o.stats.lookup_rows for o in outs)
    assert sample("anchorspec_lookup_accepted_tokens_total") == sum(o.stats.lookup_tokens for o in outs)


def test_prompt_lookup_server_keeps_every_output(dirs, reference):
    """No drafter, --lookup: each request drafts the chain copied from its own text, each round caps the chains at
    what its widths cost (ChainPlanner); greedy outputs are the plain ones, chains were verified, and the
    calibration measured the widths a chain verifies."""
    engine = load(dirs["target"], dtype="float64")
    scheduler = Scheduler(engine, lookup=LookupSettings(max_tokens=8), calibrate=False)
    scheduler.calibrate()
    assert {1, 2, 4, 8, 9} <= set(scheduler.widths.curves)  # the widths a chain verifies, up to 8 + 1
    assert sorted(scheduler.widths.curves[9].points) == [1, 4, 16]  # and a full batch (max_running), measured
    scheduler.chains.cost = lambda rows, width: 1.0  # a tiny model's timings are noise: here every width pays
    prompts = PROMPTS[:4]
    outs = queued_then_run(scheduler, engine, prompts)
    assert [o.token_ids for o in outs] == [reference[p, False].token_ids for p in prompts]
    sample = scheduler.metrics.registry.get_sample_value
    assert sample("anchorspec_lookup_drafted_tokens_total") == sum(o.stats.lookup_rows for o in outs) > 0
    assert sample("anchorspec_lookup_accepted_tokens_total") == sum(o.stats.lookup_tokens for o in outs)
    assert any(greedy for greedy, _ in scheduler.chains.counts)  # verified chains taught it their acceptance


def test_scheduler_interleaves_requests(dirs):
    """Three requests submitted together: each gets tokens before the first one finishes."""
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    scheduler = Scheduler(engine, monitor=DriftMonitor(enabled=False), calibrate=False)
    scheduler.start()

    async def run():
        prompts = [engine.encode(p) for p in PROMPTS[:3]]
        handles = [scheduler.submit(ids, 20, 0.0) for ids in prompts]
        order = []

        async def drain(i, h):
            while True:
                kind, _ = await h.queue.get()
                order.append((i, kind))
                if kind != "tokens":
                    return

        await asyncio.gather(*(drain(i, h) for i, h in enumerate(handles)))
        return order

    try:
        order = asyncio.run(run())
    finally:
        scheduler.stop()
    first_done = next(n for n, (_, kind) in enumerate(order) if kind == "done")
    assert {i for i, kind in order[:first_done] if kind == "tokens"} == {0, 1, 2}


def test_a_scheduler_bug_fails_the_running_requests_and_the_worker_goes_on(dirs, reference):
    """An exception outside any one sequence's decoding (here: the monitor's bookkeeping) answers the
    running requests with an error instead of killing the worker thread, after which every request,
    those and all later ones, would wait forever; the next request is served as usual."""

    class Broken(DriftMonitor):
        fail = True

        def observe_round(self, *args, **kwargs):
            if Broken.fail:
                raise RuntimeError("bookkeeping bug")
            super().observe_round(*args, **kwargs)

    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    scheduler = Scheduler(engine, monitor=Broken(), calibrate=False)
    scheduler.start()

    async def outcome(prompt):
        handle = scheduler.submit(engine.encode(prompt), MAX_TOKENS, 0.0)
        while True:
            kind, payload = await asyncio.wait_for(handle.queue.get(), timeout=60)
            if kind != "tokens":
                return kind, payload

    try:
        kind, message = asyncio.run(outcome(PROMPTS[0]))
        Broken.fail = False
        later = asyncio.run(outcome(PROMPTS[1]))
    finally:
        scheduler.stop()
    assert kind == "error" and "internal scheduler error" in message
    assert later[0] == "done" and later[1].token_ids == reference[PROMPTS[1], False].token_ids
    assert scheduler.running_count == 0
    assert scheduler.metrics.registry.get_sample_value("anchorspec_requests_total", {"outcome": "error"}) == 1


# --- bad input, auth, limits -------------------------------------------------------------------

def post(server, path, body=None, *, raw=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=raw, headers=headers, timeout=60)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("case, status, param", [
    ("malformed", 400, None),
    ("not_object", 400, None),
    ("missing_messages", 400, "messages"),
    ("empty_messages", 400, "messages"),
    ("bad_role", 400, "messages.0.role"),
    ("unknown_model", 404, "model"),
    ("max_tokens_zero", 400, "max_tokens"),
    ("max_tokens_negative", 400, "max_tokens"),
    ("max_tokens_huge", 400, "max_tokens"),
    ("n2", 400, "n"),
    ("stop", 400, "stop"),
    ("temperature_negative", 400, "temperature"),
    ("top_p_zero", 400, "top_p"),
    ("prompt_too_long", 400, "messages"),
    ("bad_key", 401, None),
    ("no_key", 401, None),
    ("too_large", 413, None),
])
def test_bad_requests_get_openai_errors(case, status, param, spec_server):
    good = chat_args(PROMPTS[0])
    bodies = {
        "missing_messages": {"model": MODEL},
        "empty_messages": {**good, "messages": []},
        "bad_role": {**good, "messages": [{"role": "robot", "content": "w1"}]},
        "unknown_model": {**good, "model": "gpt-4"},
        "max_tokens_zero": {**good, "max_tokens": 0},
        "max_tokens_negative": {**good, "max_tokens": -5},
        "max_tokens_huge": {**good, "max_tokens": 10**6},
        "n2": {**good, "n": 2},
        "stop": {**good, "stop": ["w1"]},
        "temperature_negative": {**good, "temperature": -1},
        "top_p_zero": {**good, "top_p": 0},
        "prompt_too_long": {**good, "messages": [{"role": "user", "content": " ".join(CHAT_WORDS[:10] * 60)}]},
        "bad_key": good,
        "no_key": good,
    }
    if case == "malformed":
        r = post(spec_server, "/v1/chat/completions", raw=b'{"model": "tiny-chat", "messages": [')
    elif case == "not_object":
        r = post(spec_server, "/v1/chat/completions", raw=b"[1, 2]")
    elif case == "too_large":
        r = post(spec_server, "/v1/chat/completions", raw=json.dumps({**good, "pad": "x" * 20000}).encode())
    else:
        r = post(spec_server, "/v1/chat/completions", bodies[case],
                 key={"bad_key": "wrong", "no_key": None}.get(case, KEY))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if case == "prompt_too_long":
        assert err["code"] == "context_length_exceeded"
    assert httpx.get(spec_server.url + "/health").status_code == 200  # still serving


def test_openai_client_sees_errors(spec_server):
    with pytest.raises(openai.AuthenticationError):
        spec_server.client(api_key="wrong").chat.completions.create(**chat_args("w1"))
    with pytest.raises(openai.NotFoundError):
        spec_server.client().chat.completions.create(**{**chat_args("w1"), "model": "nope"})
    with pytest.raises(openai.BadRequestError):
        spec_server.client().completions.create(model=MODEL, prompt="w1", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        spec_server.client().completions.create(model=MODEL, prompt=[1, 2, 10**6], max_tokens=4)
    r = httpx.get(spec_server.url + "/v2/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert spec_server.client().chat.completions.create(**chat_args("w1")).choices[0].message.content is not None


def test_disconnect_frees_the_sequence(spec_server):
    scheduler = spec_server.app.state.scheduler
    before = metric(spec_server.metrics(), "anchorspec_requests_total", outcome="cancelled")
    body = {**chat_args("w1 w2"), "max_tokens": 400, "stream": True}
    with httpx.stream("POST", spec_server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '""' not in line:
                break  # got real text: now hang up mid-stream
    deadline = time.time() + 20
    while scheduler.running_count and time.time() < deadline:
        time.sleep(0.05)
    assert scheduler.running_count == 0
    assert metric(spec_server.metrics(), "anchorspec_requests_total", outcome="cancelled") == before + 1


# --- metrics and the drift fallback ------------------------------------------------------------

def test_metrics_move(spec_server):
    before = spec_server.metrics()
    spec_server.client().chat.completions.create(**chat_args(PROMPTS[2]))
    after = spec_server.metrics()
    for name in ("anchorspec_generated_tokens_total", "anchorspec_drafts_total", "anchorspec_drafted_tokens_total",
                 "anchorspec_prompt_tokens_total", "anchorspec_request_latency_seconds_count",
                 "anchorspec_time_to_first_token_seconds_count"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "anchorspec_requests_total", outcome="ok") == metric(before, "anchorspec_requests_total",
                                                                              outcome="ok") + 1
    assert metric(after, "anchorspec_accepted_tokens_total") <= metric(after, "anchorspec_drafted_tokens_total")
    assert metric(after, "anchorspec_requests_running") == 0
    assert metric(after, "anchorspec_speculation_enabled") == 1
    text = httpx.get(spec_server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert text.headers["content-type"].startswith("text/plain")
    assert httpx.get(spec_server.url + "/metrics").status_code == 401  # guarded by the key too


def test_fallback_switches_off_and_back_on(dirs, reference):
    """A break-even tau no drafter reaches: every request falls back, retries, and says so."""
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    monitor = DriftMonitor(threshold=100.0, window=4, min_steps=2, retry_after=3, global_min_steps=2,
                           max_retry_after=3)  # no probe backoff: every retry round probes
    server = LiveServer(create_app(engine, MODEL, monitor=monitor))
    try:
        r = server.client().chat.completions.create(**chat_args(PROMPTS[3]))
        values = server.metrics()
    finally:
        server.close()
    assert r.choices[0].message.content == reference[PROMPTS[3], True].text  # still lossless
    assert r.speculative["fallback_switches"] >= 2
    assert metric(values, "anchorspec_fallback_switches_total", direction="off") >= 1
    assert metric(values, "anchorspec_fallback_switches_total", direction="on") >= 1
    assert metric(values, "anchorspec_speculation_enabled") == 0  # new requests would start plain
    assert metric(values, "anchorspec_break_even_tau") == 100.0
    rounds = metric(values, "anchorspec_round_break_even_tau_count")  # tau*(B) of every batched round
    assert rounds >= 1 and metric(values, "anchorspec_round_break_even_tau_sum") == 100.0 * rounds


def step(state, monitor, accepted):
    return monitor.record(state, "speculative", accepted=accepted, tokens=accepted + 1)


def feed(monitor, rows_list=(1, 4), width=4):
    """Rounds on exact cost lines: forward = 0.8 + 0.2 * padded tokens, drafting = 0.4 + 0.1 * rows."""
    for rows in rows_list:
        monitor.observe_round(rows, 1, 0.8 + 0.2 * rows)  # plain rounds
        monitor.observe_round(rows, width, 0.8 + 0.2 * rows * width, rows, 0.4 + 0.1 * rows)  # speculative


def test_monitor_threshold_comes_from_measured_costs():
    m = DriftMonitor()
    assert m.threshold is None  # nothing measured: never switches
    m.observe_round(1, 1, 1.0)
    assert m.threshold is None  # no drafting round yet
    m.observe_round(1, 4, 1.5, 1, 0.5)
    assert m.threshold == pytest.approx(2.0)  # batch 1: (t_draft + t_verify) / t_plain = (0.5 + 1.5) / 1.0
    assert DriftMonitor(threshold=3.5).threshold == 3.5

    m = DriftMonitor()
    feed(m)
    # the fitted lines are exact, so tau*(B) = (drafting(B) + forward(4 B)) / forward(B)
    assert m.threshold_at(1) == pytest.approx((0.5 + 1.6) / 1.0)
    assert m.threshold_at(4) == pytest.approx((0.8 + 4.0) / 1.6)
    assert m.threshold_at(16) == pytest.approx((2.0 + 13.6) / 4.0)
    assert m.rows == 4 and m.threshold == m.threshold_at(4)  # the latest round's batch size


def test_forward_costs_are_learned_per_width_so_many_plain_rows_do_not_price_one_rows_tree():
    """16 plain rows and one row's 16-node tree are both 16 tokens, but the first reads 16 KV caches:
    on one curve over tokens, a burst of 16 users' plain rounds priced the next lone request's verify
    at their cost, and tau*(1) rose until speculation at 1 user stopped paying on paper."""
    m = DriftMonitor()
    m.observe_round(1, 1, 1.0)
    m.observe_round(1, 16, 1.5, 1, 0.5)
    assert m.threshold_at(1) == pytest.approx(2.0)
    for _ in range(50):
        m.observe_round(16, 1, 5.0)  # plain rounds of 16 rows (16 tokens) at 5x a 1-row step
    assert m.threshold_at(1) == pytest.approx(2.0)
    assert m.forward(16, 1) == pytest.approx(5.0) and m.forward(1, 16) == pytest.approx(1.5)
    assert m.forward(4, 3) is None  # a width never run: no guess


def test_a_batched_round_speculates_on_the_rows_mean_tau_not_on_its_luckiest_row():
    """Riders make a round all-speculative or all-plain, so the batch decides: at tau*(4) = 3.0 one row
    at tau 4 beside three at 1-2 (mean 2.25) must not make the round speculate; rows at 3.25 must."""
    m = DriftMonitor(window=4, min_steps=2, global_min_steps=2)
    feed(m)
    assert m.threshold_at(4) == pytest.approx(3.0)

    def row(accepted: int, speculating: bool = True):
        state = m.new_request()
        for _ in range(2):
            state.window.append(accepted + 1)
        state.speculating = speculating
        return state

    lucky, slow = row(3), [row(0, speculating=False), row(1, speculating=False), row(1, speculating=False)]
    assert not any(m.round_plan([lucky, *slow]))  # mean (4 + 1 + 2 + 2) / 4 = 2.25 < 3.0
    assert any(m.round_plan([lucky, *slow], probing=True))  # a retry round probes whatever the mean
    assert all(m.round_plan([row(2), row(2), row(3), row(2)]))  # mean 3.25 >= 3.0
    assert not any(m.round_plan([row(3, speculating=False)] * 4))  # nobody speculating: plain
    fresh = m.new_request()  # no steps yet: nothing known, so the round speculates to learn
    assert all(m.round_plan([fresh, fresh, fresh, fresh]))
    assert all(DriftMonitor(enabled=False, threshold=9.0).round_plan([lucky, *slow]))


def test_rows_switched_off_join_a_round_only_where_it_pays_by_the_switch_on_margin():
    """Rows switched off that a round turns on each pay their drafter's catch-up, so a batch with such rows
    speculates only where its pooled lengths beat tau*(B) by switch_on_margin (10 %); a batch already speculating
    stays on at tau*(B) itself. At tau*(4) = 3.0, lengths pooled at 3.15 (shrinking off): +5 %."""
    m = DriftMonitor(window=4, min_steps=2, global_min_steps=2)
    m.prior_steps = 0  # no shape tracked anyway; the pooled mean is the lengths' own
    feed(m)
    assert m.threshold_at(4) == pytest.approx(3.0) and m.switch_on_margin == pytest.approx(0.1)

    def row(lengths, speculating=True):
        state = m.new_request()
        state.window.extend(lengths)
        state.speculating = speculating
        return state

    near = [[3, 3], [3, 4], [3, 3], [3, 3.2]]  # pooled 3.15
    assert all(m.round_plan([row(w) for w in near]))  # all on: stays on at tau* itself
    mixed = [row(w, speculating=k < 2) for k, w in enumerate(near)]
    assert not any(m.round_plan(mixed))  # two rows off: 3.15 < 3.3
    assert all(m.round_plan([row(w, speculating=k < 2) for k, w in enumerate([[4, 4]] * 4)]))  # 4.0 >= 3.3
    m.switch_on_margin = 0.0  # the rule before session 82 (negative control): the same rows turn on
    assert all(m.round_plan(mixed))


def test_one_probe_round_of_many_rows_is_evidence_enough_and_a_veto_switches_them_off():
    """Pooled, the first accepted lengths of 4 probing rows decide the next round (each row's own
    min_steps would keep a 16-row batch speculating at a loss for 4 more rounds after every probe),
    and the vetoed rows switch off, due again after retry_after plain tokens."""
    m = DriftMonitor(window=4, min_steps=4, retry_after=2, global_min_steps=2)
    feed(m)  # tau*(4) = 3.0
    rows = [m.new_request() for _ in range(4)]
    assert all(m.round_plan(rows))  # nothing known yet: learn
    for state, accepted in zip(rows, (1, 2, 1, 1)):
        step(state, m, accepted)  # one probe round: lengths 2, 3, 2, 2 (mean 2.25 < 3.0)
    assert all(state.speculating for state in rows)  # no row has min_steps of its own yet
    assert not any(m.round_plan(rows))  # ... but 4 pooled lengths decide
    assert m.veto(rows) == rows and not any(state.speculating for state in rows)
    assert all(state.plain_left == m.retry_after for state in rows) and m.switches_off == 4
    assert m.veto(rows) == []  # nothing left on
    m = DriftMonitor(window=4, min_steps=4, retry_after=2, global_min_steps=2)
    feed(m)
    good = [m.new_request() for _ in range(4)]
    for state in good:
        step(state, m, 2)  # lengths 3: mean 3.0 reaches tau*(4)
    assert all(m.round_plan(good))  # negative control


def test_a_probe_of_a_plain_batch_retries_a_few_rows_in_a_forward_apart_where_that_costs_less():
    """At 16 rows a speculative round of all rows costs many plain ones (and every drafter's catch-up),
    so a probe of a plain batch retries min_steps rows, the most overdue first, and they speculate in
    a forward apart while the rest step plain. Where the costs say padding is cheaper (a forward and
    drafting that cost the same at any size, as on a GPU), the rest ride along as before."""
    m = DriftMonitor(window=4, min_steps=4, retry_after=2, global_min_steps=2, max_retry_after=2)
    feed(m, rows_list=(1, 4, 12, 16))  # forward 0.8 + 0.2 x tokens, drafting 0.4 + 0.1 x rows
    rows = [m.new_request() for _ in range(16)]
    for k, state in enumerate(rows):
        m._switch_off(state)
        state.plain_left = -k  # the last rows are the most overdue
    assert m.start_round(rows) == [] and m.start_round(rows) == rows[-1:-5:-1]  # every 2nd round: 4 rows
    plan = m.round_plan(rows, probing=True)
    assert plan == [state.speculating for state in rows] and sum(plan) == 4  # ... apart from the plain 12
    # against plain rounds (0.25 s a token at 16 rows): split 0.8 + 4.0 + 3.2 - 16 x 0.25 = 4.0 s lost,
    # padded 2.0 + 13.6 - 16 x 0.25 = 11.6 s lost
    assert m._split_pays(16, 4)
    one_on = [m.new_request() for _ in range(16)]  # one row on already (a new request): 3 more make 4
    for state in one_on[1:]:
        m._switch_off(state)
        state.plain_left = 0
    m.rounds = 1  # the next start_round is a retry round (every 2nd)
    assert len(m.start_round(one_on)) == 3 and sum(m.round_plan(one_on, probing=True)) == 4
    for _ in range(8):  # a global tau of 4: the riders' accepted tokens pay for their padding
        m.record(m.new_request(), "speculative", accepted=3)
    assert not m._split_pays(16, 4)  # padded 15.6 - 16 x 4 x 0.25 = -0.4 s against split 8.0 - 28 x 0.25 = 1.0 s
    flat = DriftMonitor(window=4, min_steps=4, retry_after=2, global_min_steps=2, max_retry_after=2)
    for n in (1, 4, 12, 16):  # every forward and every drafting pass 1 s
        flat.observe_round(n, 1, 1.0)
        flat.observe_round(n, 4, 1.0, n, 1.0)
    assert not flat._split_pays(16, 4)
    assert all(flat.round_plan(rows, probing=True))  # riders pad: 1 s lost against 2 s for a split
    some_on = [flat.new_request() for _ in range(16)]
    for state in some_on[1:]:
        flat._switch_off(state)
        state.plain_left = 0
    flat.rounds = 1
    assert len(flat.start_round(some_on)) == 15  # padding is cheaper: every due row retries


def test_a_veto_forgets_the_windows_so_a_probe_of_few_rows_decides_on_fresh_lengths():
    """After a veto, a probe of 4 rows out of 16 accepting well must switch the batch back on: the
    12 other rows' old, judged lengths must not outvote it; negative control: a poor probe stays off."""
    def probe(accepted: int) -> list[bool]:
        m = DriftMonitor(window=4, min_steps=4, retry_after=1, global_min_steps=2, max_retry_after=1)
        feed(m, rows_list=(1, 4, 12, 16))
        tstar = m.threshold_at(16)
        rows = [m.new_request() for _ in range(16)]
        for state in rows:
            for _ in range(3):
                step(state, m, 0)  # lengths of 1, far below tau*(16); under min_steps a row, 48 pooled
        assert not any(m.round_plan(rows)) and len(m.veto(rows)) == 16
        assert not any(state.window for state in rows)
        for state in rows:
            state.plain_left = 0
        probed = m.start_round(rows)
        assert len(probed) == 4
        for state in probed:
            step(state, m, accepted)
        assert 2 < tstar < 5  # between the poor probe's lengths and the good one's
        return m.round_plan(rows)

    assert all(probe(accepted=4))  # lengths 5 >= tau*(16) = 3.9: the batch speculates again, riders too
    assert not any(probe(accepted=1))  # lengths 2: plain


def test_probes_back_off_while_the_global_tau_is_far_below_the_break_even_at_this_batch_size():
    """A retry round is skipped while the recent speculative steps put tau more than PROBE_MARGIN below
    tau*(B) of the running batch, but a probe still comes every max_retry_after rounds; at a batch
    size whose break-even the same tau clears, the retry happens on time."""
    from anchorspec.decode.fallback import PROBE_MARGIN

    def run(rows: int, global_accepted: int, rounds: int = 16) -> list[int]:
        m = DriftMonitor(window=4, min_steps=1, retry_after=4, max_retry_after=12, global_min_steps=4)
        feed(m)  # tau*(1) = 2.1, tau*(4) = 3.0
        for _ in range(8):
            m.record(m.new_request(), "speculative", accepted=global_accepted)
        states = [m.new_request() for _ in range(rows)]
        for state in states:
            m._switch_off(state)
            state.plain_left = 0  # due
        probes = []
        for r in range(1, rounds + 1):
            if m.start_round(states):
                probes.append(r)
                for state in states:
                    m._switch_off(state)
                    state.plain_left = 0
        return probes, m.probes_skipped

    assert 2.5 < (1 - PROBE_MARGIN) * 3.0 and 2.5 > (1 - PROBE_MARGIN) * 2.1
    # tau 2.5 vs tau*(4) 3.0: rounds 4 and 8 skipped, 12 probes (12 rounds since the last), 16 skipped again
    assert run(rows=4, global_accepted=1) == ([12], 3)
    assert run(rows=1, global_accepted=1) == ([4, 8, 12, 16], 0)  # tau*(1) 2.1: every retry round
    assert run(rows=4, global_accepted=2) == ([4, 8, 12, 16], 0)  # tau 3.0 clears tau*(4)
    assert DriftMonitor(retry_after=32).max_retry_after == 8 * 32
    with pytest.raises(ValueError):
        DriftMonitor(retry_after=32, max_retry_after=16)


def test_forced_probes_that_stay_futile_come_ever_later_until_the_tau_recovers():
    """While the global tau stays far below tau*(B), each forced probe doubles the wait for the next one (up to
    2**PROBE_DOUBLINGS times max_retry_after); a retry round that finds tau no longer that far below probes on
    time and sets the wait back. With probe_doublings 0 (the rule before session 77) they come every
    max_retry_after rounds."""
    from anchorspec.decode.fallback import PROBE_DOUBLINGS

    def probes(doublings: int, rounds: int, m=None, states=None) -> tuple:
        if m is None:
            m = DriftMonitor(window=4, min_steps=1, retry_after=4, max_retry_after=12, global_min_steps=4)
            m.probe_doublings = doublings
            feed(m)  # tau*(4) = 3.0
            for _ in range(8):
                m.record(m.new_request(), "speculative", accepted=1)  # global tau 2.0: futile at 4 rows
            states = [m.new_request() for _ in range(4)]
        seen = []
        for _ in range(rounds):
            for state in states:
                if state.speculating:
                    m._switch_off(state)
                state.plain_left = 0  # due
            if m.start_round(states):
                seen.append(m.rounds)
        return seen, m, states

    assert probes(0, 100)[0] == [12, 24, 36, 48, 60, 72, 84, 96]
    seen, m, states = probes(PROBE_DOUBLINGS, 200)
    assert seen == [12, 36, 84, 180]  # waits 12, 24, 48, 96
    assert m.probe_wait() == 12 * 2 ** min(4, PROBE_DOUBLINGS)
    for _ in range(64):
        m.record(m.new_request(), "speculative", accepted=3)  # the traffic changed: tau 4 clears tau*(4)
    seen, m, _ = probes(PROBE_DOUBLINGS, 8, m, states)
    assert seen == [m.rounds - 4, m.rounds] and m.probe_wait() == 12  # every retry round again, the wait reset


def test_a_new_request_is_judged_at_the_batch_size_it_joins():
    """After a burst drained to one row, the latest round's tau* is batch 1's: a request joining a
    batch of 4 must be judged at tau*(4), or a new burst starts speculating where it cannot pay."""
    m = DriftMonitor(window=4, min_steps=2, global_min_steps=4)
    feed(m, rows_list=(4, 1))  # latest round: batch 1, tau*(1) = 2.1; tau*(4) = 3.0
    for accepted in (1, 2, 1, 2):
        m.record(m.new_request(), "speculative", accepted=accepted)  # global tau 2.5
    assert m.rows == 1 and m.global_speculating
    assert m.new_request().speculating and m.new_request(rows=1).speculating
    late = m.new_request(rows=4)
    assert not late.speculating and late.plain_left == 0  # plain, due at the next retry round


def test_a_request_joining_a_plain_batch_waits_for_its_next_probe(dirs):
    """Every running request switched off: a new one starts off too, due at once, and probes with the
    batch at its next retry round; learning alone while the global window is short took a forward of
    its own for up to min_steps rounds. A batch with a row on, or no batch, leaves the gate to decide."""
    m = DriftMonitor(window=4, min_steps=2, global_min_steps=4)
    assert m.new_request(rows=4).speculating  # nothing known: the global gate lets it learn
    joined = m.new_request(rows=4, batch_plain=True)
    assert not joined.speculating and joined.plain_left == 0
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    scheduler = Scheduler(engine, monitor=DriftMonitor(window=4, min_steps=2, global_min_steps=10**6),
                          calibrate=False)
    loop = asyncio.new_event_loop()
    try:
        for p in PROMPTS[:2]:
            scheduler.submit(engine.encode(p), 8, 0.0, loop=loop)
        scheduler._admit()
        first = [seq.monitor_state for seq in scheduler._running]
        assert all(state.speculating for state in first)  # an empty batch: learn
        scheduler.submit(engine.encode(PROMPTS[2]), 8, 0.0, loop=loop)
        first[0].speculating = False
        scheduler._admit()
        assert scheduler._running[2].monitor_state.speculating  # one row still on: the gate decides
        scheduler.monitor.veto([seq.monitor_state for seq in scheduler._running])
        scheduler.submit(engine.encode(PROMPTS[3]), 8, 0.0, loop=loop)
        scheduler._admit()
        late = scheduler._running[3].monitor_state
        assert not late.speculating and late.plain_left == 0
    finally:
        loop.close()


def test_a_few_unlucky_steps_do_not_switch_a_paying_drafter_off():
    """Switching off judges the window's plausible tau (mean plus one standard error), not its mean: four
    steps of lengths 1, 2, 1, 2 (mean 1.5) against tau* 1.7 are what a drafter at tau 2.6 often shows
    (session 46: judged on the mean, `generate` spent half its steps plain); a fifth short step turns it
    off, and a drafter that accepts nothing still switches off after min_steps."""
    m = DriftMonitor(window=16, min_steps=4, threshold=1.7)
    lucky = m.new_request()
    assert [step(lucky, m, a) for a in (0, 1, 0, 1)] == [None] * 4 and lucky.speculating  # 1.5 + 0.29 >= 1.7
    assert step(lucky, m, 0) == "off"  # 1.4 + 0.24 < 1.7: a fifth short step is evidence enough
    state = m.new_request()
    assert [step(state, m, 0) for _ in range(4)] == [None] * 3 + ["off"]  # no spread: off after min_steps
    assert DriftMonitor(window=16, min_steps=4, threshold=1.7).new_request().upper_tau(1.0) is None


def test_monitor_threshold_rises_with_load():
    """A request at tau 2.5 pays alone but not in a batch of 4: the padded forward of 4 trees costs
    more than the extra tokens bring (a threshold from batch-1 costs would keep it speculating)."""
    m = DriftMonitor(window=4, min_steps=2, global_min_steps=2)
    feed(m, rows_list=(4, 1))  # latest round: batch 1
    alone = m.new_request()
    assert step(alone, m, 1) is None and step(alone, m, 2) is None  # tau 2.5 > 2.1
    assert alone.speculating
    assert m.global_speculating
    feed(m, rows_list=(1, 4))  # latest round: batch 4
    assert step(alone, m, 1) == "off"  # its rolling tau 2.33, plausibly up to 2.67 (one standard error): < 3.0
    assert not m.global_speculating and not m.new_request().speculating  # global tau 2.33: new ones start plain


def test_cost_curve():
    from anchorspec.decode.fallback import CostCurve

    curve = CostCurve(0.1)
    assert curve(3) is None
    curve.add(2, 5.0)
    assert curve(10) == 5.0 and curve(1) == 5.0  # one bucket: flat
    curve = CostCurve(0.1)
    for x in (1, 4, 16, 64):
        curve.add(x, 1.0 + 0.5 * x)
    for x in (1, 2, 8, 40, 64, 100):  # a straight line is interpolated (and extrapolated) exactly
        assert curve(x) == pytest.approx(1.0 + 0.5 * x)
    for _ in range(200):  # long traffic at one size does not move the other buckets
        curve.add(64, 40.0)
    assert curve(1) == pytest.approx(1.5) and curve(64) == pytest.approx(40.0, rel=1e-6)
    falling = CostCurve(0.5)
    falling.add(1, 4.0)
    falling.add(8, 2.0)
    assert falling(100) == pytest.approx(4.0)  # never a negative slope


def test_monitor_switches_off_low_acceptance_and_retries():
    m = DriftMonitor(window=4, min_steps=3, retry_after=5, global_min_steps=3, max_retry_after=5)  # no backoff
    m.observe_round(1, 1, 1.0)
    m.observe_round(1, 4, 1.5, 1, 0.5)  # tau* = 2.0
    state = m.new_request()
    assert state.speculating
    assert step(state, m, 0) is None and step(state, m, 0) is None  # too few steps to judge
    assert step(state, m, 0) == "off"  # rolling tau 1.0 < 2.0
    assert not state.speculating and m.switches_off == 1
    rounds = []
    for r in range(1, 11):  # one plain token per round
        if m.start_round([state]):
            rounds.append(r)
        if not state.speculating:
            m.record(state, "plain", tokens=1)
    # due after retry_after = 5 plain tokens (round 5), retried at the next retry round: 10
    assert rounds == [10] and m.rounds == 10
    assert state.speculating and not state.window and state.switches == 2 and m.switches_on == 1
    assert not m.global_speculating  # the global window saw only rejections: new requests start plain
    late = m.new_request()
    assert not late.speculating and m.switches_off == 2 and late.plain_left == 0  # due at the next retry round

    good = DriftMonitor(window=4, min_steps=2)
    feed(good, rows_list=(1,))
    s = good.new_request()
    assert all(step(s, good, 3) is None for _ in range(10))  # tau 4 > 2.1: keeps speculating
    assert s.speculating and good.global_speculating

    off = DriftMonitor(enabled=False, min_steps=1)
    feed(off, rows_list=(1,))
    s = off.new_request()
    assert all(step(s, off, 0) is None for _ in range(5)) and s.speculating


def test_monitor_retries_happen_together():
    """Requests switched off at different rounds retry in the same round, so a batch does not pad
    to a tree's width round after round for one probing request at a time."""
    m = DriftMonitor(window=2, min_steps=1, retry_after=4, threshold=2.0)
    a, b = m.new_request(), m.new_request()
    retried = {}
    for r in range(1, 13):
        for state in m.start_round([a, b]):
            retried.setdefault(r, []).append("a" if state is a else "b")
        if r == 1:
            step(a, m, 0)  # a off at round 1
        if r == 3:
            step(b, m, 0)  # b off at round 3
        for state in (a, b):
            if not state.speculating:
                m.record(state, "plain", tokens=1)
    assert retried == {8: ["a", "b"]}  # a due at round 5, b at 7: both at the retry round 8


def test_monitor_accepts_step_reports():
    r = StepReport([1, 2], "speculative", drafted=15, accepted=1, draft_s=0.1, verify_s=0.2)
    m = DriftMonitor(min_steps=1, threshold=1.5)
    state = m.new_request()
    assert m.record(state, r.kind, r.accepted, len(r.tokens)) is None  # tau 2 >= 1.5


# --- export ------------------------------------------------------------------------------------

EXPECTED_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "fc_norm.0.weight", "fc_norm.1.weight",
                 "fc_norm.2.weight"} | {f"midlayer.{k}.weight" for k in (
                     "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def read_export(out):
    cfg = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return cfg, tensors


def test_export_vllm_layout(dirs):
    drafter = load_drafter(dirs["drafter"])
    out = dirs["root"] / "vllm"
    assert main([ "export", dirs["drafter"], "--format", "vllm", "--out", str(out)]) == 0
    cfg, tensors = read_export(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == drafter.config.eagle_aux_hidden_state_layer_ids
    assert "eagle_config" not in cfg
    assert cfg["norm_before_residual"] is False
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 32 and cfg["num_hidden_layers"] == 1
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    assert set(tensors) == EXPECTED_KEYS  # no embed_tokens: shared with the target
    assert tensors["d2t"].dtype == torch.int64 and tensors["lm_head.weight"].dtype == torch.bfloat16
    back = load_drafter(out)  # our own loader reads it back (same aux convention as vLLM)
    assert back.config.eagle_aux_hidden_state_layer_ids == drafter.config.eagle_aux_hidden_state_layer_ids
    assert torch.equal(back.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())


def test_export_sglang_layout(dirs):
    drafter = load_drafter(dirs["drafter"])
    out = dirs["root"] / "sglang"
    assert not export_drafter(drafter, out, "sglang") == []  # EAGLE-3.1: warns about SGLang support
    cfg, tensors = read_export(out)
    ids = drafter.config.eagle_aux_hidden_state_layer_ids
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ids]  # layer outputs
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 64
    assert set(tensors) == EXPECTED_KEYS and not any(k.startswith("layers.") for k in tensors)


def test_export_and_serve_cli_errors(dirs, capsys):
    assert main(["export", dirs["drafter"], "--format", "vllm", "--out", dirs["drafter"]]) == 2
    assert main(["serve", "--target", dirs["target"], "--port", "0"]) == 2
    assert main(["serve", "--target", dirs["target"], "--chain", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("anchorspec: error:") for line in err) and len(err) == 3


def test_serve_compile_reaches_the_engine(dirs, monkeypatch):
    """`serve --compile` loads a compiled target (the flag is not dropped on the way to `load`); by default
    the graph is used when it is on disk (auto), and --compile off never compiles."""
    import anchorspec.api

    seen = {}

    class Loaded(Exception):
        pass

    def fake_load(*args, **kwargs):
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr(anchorspec.api, "load", fake_load)
    for flags, compiled in (([], "auto"), (["--compile"], True), (["--compile", "off"], False)):
        with pytest.raises(Loaded):
            main(["serve", "--target", dirs["target"], "--port", "58127", *flags])
        assert seen["compile"] is compiled


def test_rounds_that_compiled_a_graph_are_counted_in_metrics():
    """`anchorspec_compiled_rounds_total` counts the rounds whose RoundResult says a graph compiled (serve
    --compile: those took seconds, and the load test reports them per level), and only those."""
    from anchorspec.decode.round import RoundResult
    from anchorspec.serve.metrics import ServerMetrics

    m = ServerMetrics()
    for compiled in (False, True, False, True, True):
        m.observe_round(RoundResult([], rows=2, width=1, tokens=2, forward_s=0.01, compiled=compiled))
    values = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
              for line in m.render().decode().splitlines() if line and not line.startswith("#")}
    assert values["anchorspec_compiled_rounds_total"] == 3
    assert values["anchorspec_target_forwards_total{kind=\"batched\"}"] == 5


def test_a_round_that_catches_up_on_a_plain_stretch_does_not_teach_the_drafting_cost(dirs):
    """The first speculative round after plain ones reads every missed position's features: a one-off,
    so its drafting time stays out of the curve tau*(B) is priced from; the rounds after it teach it."""

    class Recording(DriftMonitor):
        def observe_round(self, *args, catch_up=False, **kwargs):
            flags.append((args[3] > 0, catch_up))  # (drafted, caught up)
            super().observe_round(*args, catch_up=catch_up, **kwargs)

    flags: list = []
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    monitor = Recording(threshold=1.0, retry_after=10**6)
    scheduler = Scheduler(engine, monitor=monitor, calibrate=False)
    loop = asyncio.new_event_loop()
    try:
        for p in PROMPTS[:2]:
            scheduler.submit(engine.encode(p), 40, 0.0, loop=loop)
        scheduler._admit()
        states = [seq.monitor_state for seq in scheduler._running]
        scheduler._round()  # prefills
        scheduler._round()  # speculative, straight after the prefill: nothing to catch up on
        monitor.veto(states)
        scheduler._round()
        scheduler._round()  # two plain rounds
        for state in states:
            state.speculating = True
        before = dict(monitor.drafting.points)
        scheduler._round()  # speculative: the drafters read the two plain rounds' features first
        assert {k: list(v) for k, v in monitor.drafting.points.items()} == {k: list(v) for k, v in before.items()}
        scheduler._round()  # speculative again: a steady round
    finally:
        loop.close()
    assert flags[1:] == [(True, False), (False, False), (False, False), (True, True), (True, False)]
    m = DriftMonitor()
    m.observe_round(4, 4, 1.0, 4, 9.0, catch_up=True)
    assert m.drafting.points == {} and m.width == 4  # the width is still the latest drafting round's


def test_switched_off_rows_ride_along_in_a_speculative_round(dirs, reference):
    """A round with one speculating row pads every batched row to its tree's width, so the rows switched
    off draft too: each round is all-plain or all-speculative (the shape tau*(B) prices), the riders'
    steps teach the global window, their retry countdown still runs, and every output is the solo one."""
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    monitor = DriftMonitor(threshold=1.0, retry_after=10**6)  # tau >= 1 always pays: no switch by itself
    scheduler = Scheduler(engine, monitor=monitor, calibrate=False)
    prompts = PROMPTS[:3]
    loop = asyncio.new_event_loop()
    try:
        [scheduler.submit(engine.encode(p), MAX_TOKENS, 0.0, loop=loop) for p in prompts]
        scheduler._admit()
        running = list(scheduler._running)
        scheduler._round()  # the prefills
        off = running[1].monitor_state
        monitor._switch_off(off)  # one request off, as a bad stretch would leave it
        plain_left = off.plain_left
        kinds = []
        real_round = scheduler.decoder.round
        scheduler.decoder.round = lambda items, split=False, **kw: (kinds.append([s for _, s in items])
                                                                    or real_round(items, split, **kw))
        scheduler._round()
        assert kinds[-1] == [True, True, True]  # the switched-off row rides along
        assert not off.speculating and off.window and off.plain_left < plain_left
        monitor.fixed_threshold = 100.0  # a break-even no batch reaches: the batch vetoes, and its rows switch off
        for seq in running:
            seq.monitor_state.window.extend([1] * monitor.min_steps)
        assert running[0].monitor_state.speculating
        scheduler._round()
        assert kinds[-1] == [False, False, False] and not running[0].monitor_state.speculating
        monitor.fixed_threshold = 1.0
        for seq in running:  # every request off: the next round is all plain
            if seq.monitor_state.speculating:
                monitor._switch_off(seq.monitor_state)
        scheduler._round()
        assert kinds[-1] == [False, False, False]
        monitor.global_min_steps = 10**6  # keep the gate open: only the rows' own states decide below
        for seq in running:
            seq.monitor_state.speculating = seq is running[0]
        while scheduler._running:
            scheduler._round()
        outs = [seq.decoding.result().token_ids for seq in running]
    finally:
        loop.close()
    assert all(set(k) == {True} or set(k) == {False} for k in kinds if None not in k)
    assert outs == [reference[p, False].token_ids for p in prompts]


def run_to_completion(scheduler, engine, prompts, loop) -> list:
    """Submit `prompts` (greedy, MAX_TOKENS) and drive the scheduler's rounds from this thread until every request
    is done; returns the sequences in the order they were admitted."""
    for p in prompts:
        scheduler.submit(engine.encode(p), MAX_TOKENS, 0.0, loop=loop)
    running = []
    while scheduler._running or scheduler._waiting:
        scheduler._admit()
        running += [seq for seq in scheduler._running if seq not in running]
        scheduler._round()
    return running


def test_a_scheduler_probe_runs_its_few_rows_apart_and_every_output_stays_the_solo_one(dirs, reference):
    """Six requests against a break-even no batch reaches: the batch vetoes, and every retry round
    probes min_steps = 2 rows in a forward of their own while the other rows step plain (costs that
    make the split pay), switching rows on and off throughout; every output is still plain greedy's."""

    class SplitPays(DriftMonitor):
        def _split_pays(self, rows, speculating):
            return True

    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    monitor = SplitPays(threshold=100.0, window=4, min_steps=2, retry_after=2, global_min_steps=2, max_retry_after=2)
    scheduler = Scheduler(engine, monitor=monitor, calibrate=False)
    forwards = []
    real_round = scheduler.decoder.round

    def recording(items, split=False, **kw):
        result = real_round(items, split, **kw)
        forwards.append((split, [(rows, width) for rows, width, _ in result.forwards], [s for _, s in items]))
        return result

    scheduler.decoder.round = recording
    loop = asyncio.new_event_loop()
    try:
        seqs = [scheduler.submit(engine.encode(p), MAX_TOKENS, 0.0, loop=loop) for p in PROMPTS]
        running = []
        while scheduler._running or scheduler._waiting:
            scheduler._admit()
            running += [seq for seq in scheduler._running if seq not in running]
            scheduler._round()
        outs = [seq.decoding.result().token_ids for seq in running]
    finally:
        loop.close()
    assert len(seqs) == len(running) == len(PROMPTS)
    split_rounds = [(shapes, flags) for split, shapes, flags in forwards if split]
    assert split_rounds, forwards
    assert all(0 < sum(flags) < len(flags) for _, flags in split_rounds)
    probes = [shapes for shapes, flags in split_rounds if sum(flags) == 2 and len(shapes) == 2]
    assert probes and all(min(w for _, w in shapes) == 1 for shapes in probes)  # 2 rows apart from the plain rows
    assert outs == [reference[p, False].token_ids for p in PROMPTS]


def test_rounds_that_change_their_draft_shape_keep_every_output_the_solo_one(dirs, reference):
    """A scheduler with shapes to choose from (here made to change shape every round, each of BATCH_SHAPES and the
    default tree in turn) drafts each round with the shape chosen, learns the drafter's acceptance from the
    speculative steps, and every output is still plain greedy's; with one shape it passes none."""
    from anchorspec.decode.fallback import GREEDY, shape_key
    from anchorspec.serve.scheduler import BATCH_SHAPES

    class Cycling(DriftMonitor):
        def shape_for_rows(self, rows, shapes):
            self.calls = getattr(self, "calls", 0) + 1
            return shapes[self.calls % len(shapes)]

    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    outs, drafted = {}, {}
    for shapes in (BATCH_SHAPES, None):
        monitor = Cycling(threshold=1.0, retry_after=10**6)  # tau >= 1 always pays: every round speculates
        scheduler = Scheduler(engine, monitor=monitor, calibrate=False, shapes=shapes)
        real_round, seen = scheduler.decoder.round, []

        def recording(items, split=False, **kw):
            result = real_round(items, split, **kw)
            seen.append((kw.get("shape"), result.width))
            return result

        scheduler.decoder.round = recording
        loop = asyncio.new_event_loop()
        try:
            running = run_to_completion(scheduler, engine, PROMPTS[:4], loop)
            outs[shapes] = [seq.decoding.result().token_ids for seq in running]
        finally:
            loop.close()
        drafted[shapes] = {shape_key(s) for s, _ in seen if s is not None}
        widths = {s: [w for shape, w in seen if shape == s and w] for s in scheduler.shapes}
        if shapes:  # each round's trees are the shape it chose (a chain of 1: 2 rows a sequence, at most)
            assert max(widths[BATCH_SHAPES[0]]) <= 2 and max(widths[DEFAULT_TREE]) > 5
        learned = sum(monitor.learned[GREEDY].reached)
        assert learned > 0 if shapes else learned == 0
    assert drafted[BATCH_SHAPES] == {shape_key(s) for s in (*BATCH_SHAPES, DEFAULT_TREE)} and drafted[None] == set()
    for got in outs.values():
        assert got == [reference[p, False].token_ids for p in PROMPTS[:4]]


def test_a_server_choosing_shapes_merges_lookup_chains_only_into_a_lone_request_round(dirs, reference):
    """One row's copied chain would widen every row of a batched round: a scheduler choosing its shapes per batch
    size merges lookup chains only while one request decodes; outputs stay plain greedy's either way."""
    from anchorspec.serve.scheduler import BATCH_SHAPES

    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    monitor = DriftMonitor(threshold=1.0, retry_after=10**6)  # every round speculates
    scheduler = Scheduler(engine, monitor=monitor, calibrate=False, shapes=BATCH_SHAPES, lookup=LookupSettings())
    real_round, merged = scheduler.decoder.round, {1: 0, 2: 0}

    def recording(items, split=False, **kw):
        result = real_round(items, split, **kw)
        if result.rows:
            merged[min(result.rows, 2)] += sum(r.lookup_rows for r in result.reports if isinstance(r, StepReport))
        return result

    scheduler.decoder.round = recording
    loop = asyncio.new_event_loop()
    outs = []
    try:
        for group in (PROMPTS[3:4], PROMPTS[:4]):  # alone, then four together
            running = run_to_completion(scheduler, engine, group, loop)
            outs.append([seq.decoding.result().token_ids for seq in running])
            assert len(running) == len(group)
    finally:
        loop.close()
    assert merged[1] > 0 and merged[2] == 0
    assert outs == [[reference[p, False].token_ids for p in group] for group in (PROMPTS[3:4], PROMPTS[:4])]


def test_a_round_that_grew_a_cache_is_no_cost_sample(dirs):
    """A round that paid a one-off (a compiled graph, a KV cache grown: decode/batch.one_offs) teaches the monitor
    nothing: growing 16 slots' cache mid-round took 0.7-1.3 s against ~50 ms, and as a sample it priced plain rounds
    at twice their cost (session 82). Every round flagged: nothing learned; the same rounds unflagged: learned."""
    engine = load(dirs["target"], dirs["drafter"], dtype="float64")
    learned = {}
    for flagged in (True, False):
        scheduler = Scheduler(engine, monitor=DriftMonitor(), calibrate=False)
        inner = scheduler.decoder.round

        def round_(items, _inner=inner, _flagged=flagged, **kw):
            result = _inner(items, **kw)
            result.one_off = result.one_off or _flagged
            return result

        scheduler.decoder.round = round_
        loop = asyncio.new_event_loop()
        try:
            run_to_completion(scheduler, engine, PROMPTS[:3], loop)
        finally:
            loop.close()
        learned[flagged] = scheduler.monitor.forward.curves
    assert learned[True] == {} and learned[False]


def test_one_slow_round_does_not_move_a_servers_round_costs():
    """A round's cost is the median of its bucket's recent rounds (ROUND_COST_WINDOW): one 20x round (a host stall)
    leaves forward(16, 1) and tau*(16) where steady rounds put them; under a moving average (the rule before session
    82, round_cost_window=None) the same stall moves them (the negative control)."""
    priced = {}
    for window in (DriftMonitor().round_cost_window, None):
        m = DriftMonitor(round_cost_window=window)
        m.follow_pace = False  # the window alone (pacing would scale the wide rounds with the plain price)
        for _ in range(5):
            m.observe_round(16, 1, 0.050)
            m.observe_round(16, 3, 0.080, 16, 0.010)
        steady = m.forward(16, 1), m.threshold_at(16)
        m.observe_round(16, 1, 1.0)  # one stall
        m.observe_round(16, 1, 0.050)
        priced[window] = steady, (m.forward(16, 1), m.threshold_at(16))
    (steady, after), (_, averaged) = priced[DriftMonitor().round_cost_window], priced[None]
    assert steady == pytest.approx((0.050, 1.8)) and after == pytest.approx(steady)
    assert averaged[0] > 0.1 and averaged[1] < 1.2  # averaged: plain priced at 2x+, the chain as paying at tau 1.2


def test_wide_rounds_are_priced_at_the_plain_rounds_pace():
    """A speculative round's forward and drafting are priced at the plain round's cost now (FOLLOW_PACE): measured at
    start-up next to 44 ms plain rounds, then plain rounds at 68 ms as contexts grew, tau*(16) stays the calibrated
    2.73 (the ratio); priced in seconds (follow_pace off, the negative control) it falls to 1.76 and a chain that
    costs 2.7-2.9 plain rounds looks paying (session 82)."""
    priced = {}
    for pace in (True, False):
        m = DriftMonitor()
        m.follow_pace = pace
        for _ in range(3):  # the calibration: plain and speculative rounds side by side
            m.observe_round(16, 1, 0.044)
            m.observe_round(16, 4, 0.100, 16, 0.020)
        assert m.threshold_at(16) == pytest.approx((0.100 + 0.020) / 0.044)
        for _ in range(9):  # traffic: plain rounds only, at longer contexts
            m.observe_round(16, 1, 0.068)
        priced[pace] = m.threshold_at(16), m.verify_cost(16, 4), m.drafting_cost(16)
    assert priced[True] == pytest.approx(((0.100 + 0.020) / 0.044, 0.100 * 68 / 44, 0.020 * 68 / 44))
    assert priced[False] == pytest.approx(((0.100 + 0.020) / 0.068, 0.100, 0.020))
