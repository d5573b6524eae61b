"""benchmarks/peers.py arithmetic: vLLM's spec-decode counters and anchorspec's stats give the same tau and
depth-1 acceptance for the same accept pattern (issue 14: a gap between engines must not come from how
each one's figures are read). No vLLM needed: its counters are written by hand as vLLM's scheduler
counts them (one draft per verification, accepted tokens per position)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peers  # noqa: E402

from anchorspec.metrics import GenerationStats  # noqa: E402

CHAIN = 3
ACCEPTED_PER_STEP = [0, 1, 3, 0, 2, 0, 0, 1]  # accepted draft tokens at each verification of a chain of 3


def vllm_delta(accepted_per_step, k):
    """One request's change in vLLM's counters (SpecDecodingStats.observe_draft, per verification)."""
    per_pos = [sum(a > i for a in accepted_per_step) for i in range(k)]
    return {"vllm:spec_decode_num_drafts": len(accepted_per_step),
            "vllm:spec_decode_num_draft_tokens": k * len(accepted_per_step),
            "vllm:spec_decode_num_accepted_tokens": sum(accepted_per_step),
            "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos}


def anchorspec_stats(accepted_per_step, k):
    stats = GenerationStats()
    for a in accepted_per_step:
        stats.record_step(k, k, a)
    return stats


def rows_for(accepted_per_step, k=CHAIN):
    vllm = peers.new_row("vllm", "vLLM-CPU", "float32")
    ours = peers.new_row("anchorspec", "anchorspec", "float32")
    new_tokens = sum(accepted_per_step) + len(accepted_per_step)
    peers.add_sample(vllm, new_tokens, 1.0, "x", **peers.vllm_acceptance(vllm_delta(accepted_per_step, k)))
    peers.add_sample(ours, new_tokens, 1.0, "x", **peers.anchorspec_acceptance(anchorspec_stats(accepted_per_step, k)))
    return peers.finish(vllm, None), peers.finish(ours, None)


def test_same_accept_pattern_same_figures_in_both_engines():
    vllm, ours = rows_for(ACCEPTED_PER_STEP)
    # tau = 1 + accepted / drafts: vLLM's "mean acceptance length"
    assert vllm["tau"] == ours["tau"] == pytest.approx(1 + sum(ACCEPTED_PER_STEP) / len(ACCEPTED_PER_STEP))
    # depth 1: the share of verifications whose first draft token was accepted
    first = sum(a > 0 for a in ACCEPTED_PER_STEP) / len(ACCEPTED_PER_STEP)
    assert vllm["depth1_rate"] == ours["depth1_rate"] == pytest.approx(first)
    assert vllm["accept_rate"] == ours["accept_rate"]


def test_depth1_rate_does_not_depend_on_the_chain_length():
    """The same first-token verdicts drafted as chains of 1 and of 5: tau moves, depth 1 does not."""
    first_only = [min(a, 1) for a in ACCEPTED_PER_STEP]
    short, _ = rows_for(first_only, k=1)
    long, _ = rows_for(ACCEPTED_PER_STEP, k=5)
    assert short["depth1_rate"] == long["depth1_rate"]
    assert short["tau"] < long["tau"]


def test_plain_rows_and_missing_per_position_counters_have_no_depth1():
    delta = vllm_delta(ACCEPTED_PER_STEP, CHAIN)
    del delta["vllm:spec_decode_num_accepted_tokens_per_pos"]  # an older vLLM without the vector
    row = peers.new_row("vllm", "vLLM-CPU", "float32")
    peers.add_sample(row, 10, 1.0, "x", **peers.vllm_acceptance(delta))
    assert "depth1_rate" not in peers.finish(row, None) and row["tau"] > 1
    plain = peers.new_row("plain", "anchorspec", "float32")
    peers.add_sample(plain, 10, 1.0, "x")
    assert "tau" not in peers.finish(plain, None) and "depth1_rate" not in plain


def test_markdown_shows_depth1_column():
    vllm, ours = rows_for(ACCEPTED_PER_STEP)
    env = {"cpu": "cpu", "cpu_capability": "AVX2", "args": {"threads": 1, "max_new_tokens": 8}}
    table = peers.markdown([ours, vllm], env)
    assert "depth 1 accepted" in table.splitlines()[2]
    hits = sum(a > 0 for a in ACCEPTED_PER_STEP)
    assert table.count(f"{hits}/{len(ACCEPTED_PER_STEP)} ({hits / len(ACCEPTED_PER_STEP):.1%})") == 2


STUB_VLLM = '''
from dataclasses import dataclass, field

@dataclass
class Counter:
    name: str
    value: int

@dataclass
class Vector:
    name: str
    values: list = field(default_factory=list)

class SamplingParams:
    def __init__(self, **kwargs):
        pass

class _Output:
    def __init__(self, text):
        self.text, self.token_ids = text, [1, 2, 3]

class _Result:
    def __init__(self, text):
        self.outputs = [_Output(text)]

class LLM:
    """Two requests, each adding the counters below; the per-position vector only exists after drafting."""
    STEP = {"vllm:spec_decode_num_drafts": 8, "vllm:spec_decode_num_draft_tokens": 24,
            "vllm:spec_decode_num_accepted_tokens": 7}
    PER_POS = [4, 2, 1]

    def __init__(self, **kwargs):
        self.requests = 0

    def get_metrics(self):
        out = [Counter("vllm:prompt_tokens", 99 * self.requests)]
        out += [Counter(name, n * self.requests) for name, n in self.STEP.items()]
        if self.requests:
            per_pos = [n * self.requests for n in self.PER_POS]
            out.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", per_pos))
        return out

    def chat(self, messages, params, use_tqdm=False):
        self.requests += 1
        return [_Result(messages[0]["content"])]
'''


def test_vllm_job_script_reports_per_request_counters(tmp_path):
    """The script peers.py runs in vLLM's virtualenv, against a stand-in `vllm` module: each request's
    counter change, per-position vector included, comes back and reads as 1 + accepted / drafts."""
    import json
    import os
    import subprocess

    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text(STUB_VLLM)
    script, job, result = tmp_path / "job.py", tmp_path / "job.json", tmp_path / "result.json"
    script.write_text(peers.VLLM_SCRIPT)
    job.write_text(json.dumps({"target": "t", "drafter": "d", "chain": 3, "max_new_tokens": 8,
                               "prompts": ["a", "b"], "metrics": peers.VLLM_METRICS}))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    subprocess.run([sys.executable, str(script), str(job), str(result)], env=env, check=True, timeout=60)
    row = peers.new_row("vllm", "vLLM-CPU", "float32")
    for r in json.loads(result.read_text()):
        assert r["spec_metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"] == [4, 2, 1]
        peers.add_sample(row, r["new_tokens"], r["seconds"], r["text"], **peers.vllm_acceptance(r["spec_metrics"]))
    peers.finish(row, None)
    assert (row["verify_steps"], row["accepted"], row["drafted"]) == (16, 14, 48)
    assert row["tau"] == pytest.approx(1 + 14 / 16) and row["depth1_rate"] == pytest.approx(8 / 16)


def test_a_llamacpp_target_that_segfaults_reruns_without_repacking(tmp_path, monkeypatch):
    """llama-completion segfaulted on the Q4_1 GGUF with weight repacking on (an AMX host): the run is
    repeated once with --no-repack, later runs of that target pass it from the start, another target
    keeps repacking, and a crash that --no-repack does not cure is an error, not a loop."""
    calls = tmp_path / "calls"
    fake = tmp_path / "llama-fake"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                    'case "$*" in *--no-repack*) echo ok; exit 0;; esac\n'
                    'case "$*" in *crashy*) kill -SEGV $$;; esac\necho ok\n')
    fake.chmod(0o755)
    monkeypatch.setattr(peers, "NO_REPACK", set())
    crashy, fine = tmp_path / "crashy.gguf", tmp_path / "fine.gguf"
    assert peers._run([str(fake), "-m", str(crashy)], crashy).stdout == "ok\n"
    assert peers._run([str(fake), "-m", str(crashy)], crashy).stdout == "ok\n"
    assert peers._run([str(fake), "-m", str(fine)], fine).stdout == "ok\n"
    lines = calls.read_text().splitlines()
    assert ["--no-repack" in line for line in lines] == [False, True, True, False]
    always = tmp_path / "always-crashes"
    always.write_text("#!/bin/sh\nkill -SEGV $$\n")
    always.chmod(0o755)
    with pytest.raises(RuntimeError, match="failed"):
        peers._run([str(always)], tmp_path / "other.gguf")


class _CompilingEngine:
    """Stands in for a compiled anchorspec engine: a (speculative, max_new_tokens) pair it has not met yet
    compiles a graph, as a new step shape does under torch.compile."""

    def __init__(self):
        self.target = type("T", (), {"dtype": __import__("torch").bfloat16})()
        self.met, self.calls, self.graphs = set(), [], 0

    def generate(self, ids, max_new_tokens, speculative=True):
        if (speculative, max_new_tokens) not in self.met:
            self.met.add((speculative, max_new_tokens))
            self.graphs += 1
        self.calls.append((tuple(ids), max_new_tokens, speculative))
        stats = GenerationStats()
        if speculative:
            stats.record_step(3, 3, 2)
        stats.new_tokens, stats.total_s = max_new_tokens, 0.5
        return type("C", (), {"token_ids": list(ids)[:1] * max_new_tokens, "stats": stats})()


def test_auto_dtype_rows_warm_up_every_timed_shape_then_compare_with_their_own_plain(monkeypatch):
    """The auto-dtype rows, eager (generate's defaults) and compiled, each run a short and a full-length
    generation of each kind before any timed prompt, so no graph compiles while timed; their weights say the
    chosen dtype and how it ran, and each speculative row is checked against its own plain row."""
    import anchorspec.models.compiled as compiled

    made, loads = [], []

    def fake_load(target, drafter, **kw):
        loads.append((kw["dtype"], kw["compile"]))
        made.append(_CompilingEngine())
        return made[-1]

    monkeypatch.setattr(peers, "load", fake_load)
    monkeypatch.setattr(compiled, "graphs_compiled", lambda: sum(e.graphs for e in made))
    args = peers.parse_args(["--out", "x", "--max-new-tokens", "32", "--fast-drafter", "/d/my-eagle3.1"])
    encoded = [[1, 2], [3], [4, 5, 6]]
    rows = peers.run_auto_dtype(args, encoded)
    assert loads == [("auto", False), ("auto", True)]
    for engine in made:
        assert engine.calls[:4] == [((1, 2), 16, False), ((4, 5, 6), 32, False), ((1, 2), 16, True), ((4, 5, 6), 32, True)]
    assert [r["weights"] for r in rows] == ["bfloat16, eager"] * 2 + ["bfloat16, compiled"] * 2
    for plain, spec in (rows[:2], rows[2:]):
        assert plain["graphs_compiled_while_timed"] == spec["graphs_compiled_while_timed"] == 0
        assert "my-eagle3.1" in spec["name"] and plain["prompts"] == spec["prompts"] == 3
        assert spec["same_as_plain"] == 3 and spec["tau"] == pytest.approx(3.0) and plain.get("tau") is None
    # negative control: engines whose graphs also depend on the prompt's length meet new shapes while
    # timed (prompt [3] is shorter than both warm-up prompts), and the rows say so
    def keyed_load(target, drafter, **kw):
        keyed = _CompilingEngine()
        keyed.generate = lambda ids, max_new_tokens, speculative=True, g=keyed.generate: g(
            ids, max_new_tokens * 1000 + len(ids), speculative) and g(ids, max_new_tokens, speculative)
        made.append(keyed)
        return keyed

    made.clear()
    monkeypatch.setattr(peers, "load", keyed_load)
    rows = peers.run_auto_dtype(args, encoded)
    assert [r["graphs_compiled_while_timed"] for r in rows] == [2, 2, 2, 2]


def test_the_hf_row_runs_the_stock_model_not_the_projects_packed_one(monkeypatch):
    """HF `generate` is timed on the target as transformers loads it (stock_twin), never on the engine's
    packed weights and grouped attention, which made HF look 1.5x faster than it is."""
    ours = type("T", (), {"dtype": torch.float32})()
    stock = type("T", (), {"dtype": torch.float32})()
    engine = type("E", (), {"target": ours, "drafter": None, "encode": lambda self, text, chat: [1, 2]})()
    twins, seen = [], []
    monkeypatch.setattr(peers, "load", lambda *a, **kw: engine)
    monkeypatch.setattr(peers, "stock_twin", lambda target, name, dtype: twins.append((target, name, dtype)) or stock)
    monkeypatch.setattr(peers, "hf_generate", lambda eng, ids, n: seen.append(eng.target) or [7] * n)
    args = peers.parse_args(["--out", "x", "--max-new-tokens", "4", "--target", "tgt"])
    rows, _ = peers.run_torch(args, [{"text": "hi"}], skip={"anchorspec", "fast"})
    assert twins == [(ours, "tgt", torch.float32)]
    assert seen == [stock] and rows[0]["name"] == "hf generate" and rows[0]["new_tokens"] == 4


def test_hf_generate_refuses_the_projects_model_and_times_the_stock_one():
    """The Hugging Face baseline itself rejects a target with the project's attention or packed weights
    (every benchmark goes through it), and runs the stock model."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helpers import tiny_target

    from anchorspec.api import Engine
    from bench_core import hf_generate

    with pytest.raises(ValueError, match="stock_twin"):
        hf_generate(Engine(tiny_target()), [1, 2, 3], 4)
    stock = tiny_target(stock=True)
    stock.model.generation_config.eos_token_id = 2  # a tiny random model has no stop token of its own
    out = hf_generate(Engine(stock), [1, 2, 3], 4)
    assert 1 <= len(out) <= 4


@pytest.mark.parametrize("p_min", [None, "0.75"])
def test_llamacpp_drafts_with_the_p_min_asked_for(monkeypatch, p_min):
    """--p-min reaches llama.cpp's own early stop (0, its default, unless asked); the counts come back from
    llama.cpp's log."""
    seen = []
    log = "decoded   12 tokens in 0.5 seconds\nn_drafted = 9\nn_accept  = 5\n"
    proc = type("P", (), {"stdout": "\n\nprompt continued", "stderr": log, "returncode": 0})()
    monkeypatch.setattr(peers, "llamacpp_binary", lambda name: Path("/bin") / name)
    monkeypatch.setattr(peers, "_run", lambda argv, target: seen.append(argv) or proc)
    args = peers.parse_args(["--out", "x"] + (["--p-min", p_min] if p_min else []))
    r = peers.llamacpp_eagle3(Path("t.gguf"), Path("d.gguf"), "prompt", args)
    argv = seen[0]
    assert argv[argv.index("--spec-draft-p-min") + 1] == str(float(p_min or 0))
    assert (r["text"], r["new_tokens"], r["drafted"], r["accepted"], r["steps"]) == (" continued", 12, 9, 5, 7)


# --- benchmarks/llamacpp_verify_cost.py: costs read off llama.cpp's logs --------------------------------

def llamacpp_log(prompt_ms, prompt_tokens, eval_ms=0.0, runs=0, total_ms=0.0, sampling_ms=0.0, predicted=None,
                 accepted=None, decoded_speed=None):
    """The timing lines llama-completion / llama-speculative-simple print (common_perf_print and the
    speculative summary), with made-up numbers."""
    lines = [f"0.01.386.107 I common_perf_print: prompt eval time =   {prompt_ms:8.2f} ms / {prompt_tokens:5d} tokens "
             f"(    3.35 ms per token,   298.47 tokens per second)",
             f"0.01.386.108 I common_perf_print:        eval time =   {eval_ms:8.2f} ms / {runs:5d} runs   "
             f"(    8.02 ms per token,   124.64 tokens per second)",
             f"0.02.172.748 I common_perf_print:    sampling time =      {sampling_ms:.2f} ms",
             f"0.02.172.753 I common_perf_print:       total time =    {total_ms:.2f} ms / {prompt_tokens + 1:5d} tokens"]
    if predicted is not None:
        lines += [f"0.02.172.707 I decoded  {predicted} tokens in    1.579 seconds, speed:   {decoded_speed:.3f} t/s",
                  f"0.02.172.708 I n_predict = {predicted}", "0.02.172.708 I n_drafted = 180",
                  f"0.02.172.708 I n_accept  = {accepted}"]
    return "\n".join(lines)


def test_llamacpp_costs_from_logs():
    import llamacpp_verify_cost as cost

    plain = cost.parse_plain(llamacpp_log(prompt_ms=70.0, prompt_tokens=21, eval_ms=1016.0, runs=127))
    assert plain == {"step_ms": pytest.approx(8.0), "prefill_ms": 70.0, "prompt_tokens": 21}
    # 60 verifications of 4 tokens (a chain of 3) at 20 ms, 69 drafts accepted, 5 ms of drafting a step
    spec = cost.parse_speculative(llamacpp_log(prompt_ms=70.0 + 60 * 20.0, prompt_tokens=21 + 60 * 4,
                                               total_ms=70.0 + 60 * 20.0 + 10.0 + 60 * 5.0, sampling_ms=10.0,
                                               predicted=129, accepted=69, decoded_speed=81.7), plain)
    assert spec["tau"] == pytest.approx(129 / 60)
    assert spec["verify_ms"] == pytest.approx(20.0)
    assert spec["verify_tokens"] == pytest.approx(4.0)
    assert spec["draft_ms"] == pytest.approx(5.0)
    assert spec["tokens_per_s"] == pytest.approx(81.7)
