"""Load test of `anchorspec serve`: concurrent streaming clients against a server with and without
a drafter, at several concurrency levels; reports per-user and total output tokens/s, latency
percentiles, TTFT, and the drafter/no-drafter speedup per level.

Each server runs as a subprocess (`python -m anchorspec serve`, this checkout) on a random free
loopback port, gets one unmeasured warm-up request, then the levels in order. A level sends a fixed
number of requests (the MT-bench first turns in file order, cycled), at most `concurrency` in flight;
greedy (temperature 0; `--temperature`/`--top-p` sample, seeded per prompt), streamed, `max_tokens` each.
The whole run has a hard timeout: on expiry the servers are killed and what was measured so far is written.

    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/load_test.py --out out/load.json
    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/load_test.py --concurrency 1,2 --requests 2 \
        --max-tokens 16 --out /tmp/load_smoke.json                                     # smoke
    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/load_test.py --drafter-arg=--no-lookup --out out/load-nolookup.json
                                                 # the drafter's server with an option the plain one refuses
    ANCHORSPEC_HOME=/tmp/ashome python benchmarks/load_test.py --modes plain,lookup --interleave 4 --out out/lookup.json
                                                 # prompt lookup (serve --lookup, no drafter) against plain,
                                                 # both servers up, each level in 4 alternating blocks each

Figures (per level and server):
  per-user tok/s   median over requests of completion tokens / request latency (what one user sees)
  total tok/s      all completion tokens of the level / wall time of the level
  latency          submit to last byte, p50 / p90 / p99 (linear interpolation)
  TTFT p50         submit to the first chunk with text
  tau              pooled acceptance length of the drafter server's speculative steps, with their count
                   and the drift-fallback switches (the server turns speculation off for requests where
                   it does not pay: pass --server-arg=--no-fallback to measure speculation throughout)
  break-even tau   the drift monitor's tau*(B) averaged over the level's batched rounds (the server's /metrics)
  rows per forward mean sequences per batched target forward, and per lockstep drafting round
                   (the server's /metrics)
  outputs differing requests whose greedy text differs between the two servers (same prompt)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
DEFAULT_DRAFTER = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3.1"
MODEL_NAME = "bench"
MODES = ("plain", "lookup", "drafter")  # plain first: every other server's speedup is over it


# --- pure helpers ---------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def requests_for(concurrency: int, fixed: int | None) -> int:
    return fixed if fixed is not None else max(8, 2 * concurrency)


def summarize(records: list[dict], wall_s: float) -> dict:
    ok = [r for r in records if r.get("error") is None]
    tokens = sum(r["tokens"] for r in ok)
    lat = [r["latency_s"] for r in ok]
    steps = sum(r["verify_steps"] for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok), "output_tokens": tokens, "wall_s": wall_s,
        "per_user_tok_s_median": statistics.median(r["tokens"] / r["latency_s"] for r in ok) if ok else float("nan"),
        "total_tok_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "latency_s": {f"p{q}": percentile(lat, q) for q in (50, 90, 99)},
        "ttft_s_p50": percentile([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 50),
        # pooled over requests: (accepted + steps) / steps; None if nothing was speculated
        "tau": (sum(r["accepted_tokens"] for r in ok) + steps) / steps if steps else None,
        "verify_steps": steps,
        "fallback_switches": sum(r["fallback_switches"] for r in ok),
    }


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def read_prompts(path: Path) -> list[str]:
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row["turns"][0] if "turns" in row else row["prompt"])
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return prompts


# --- the server -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m anchorspec serve` of this checkout, on loopback; its log goes to a file."""

    def __init__(self, args, mode: str, log_dir: Path):
        drafter = args.drafter if mode == "drafter" else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "anchorspec", "serve", "--target", args.target, "--port", str(self.port),
               "--model-name", MODEL_NAME, "--dtype", args.dtype, "--max-running", str(args.max_running),
               "--log-level", "warning"]
        if drafter:
            cmd += ["--drafter", drafter]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        cmd += args.server_arg + (args.drafter_arg if drafter else []) + (["--lookup"] if mode == "lookup" else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.log_path = log_dir / f"server-{mode}.log"
        self.log = self.log_path.open("w")
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    if (await client.get(self.url + "/health", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 20) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# --- the clients ----------------------------------------------------------------------------------

async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      sampling: dict | None = None) -> dict:
    """`sampling`: the request's temperature, top_p and seed (None: greedy)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(sampling or {})}
    t0 = time.perf_counter()
    ttft, tokens, spec, error, text = None, 0, {}, None, []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        error = chunk["error"].get("message", "server error")
                        break
                    pieces = [c.get("delta", {}).get("content") or "" for c in chunk.get("choices", [])]
                    if ttft is None and any(pieces):
                        ttft = time.perf_counter() - t0
                    text += pieces
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("speculative"):
                        spec = chunk["speculative"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"latency_s": time.perf_counter() - t0, "ttft_s": ttft, "tokens": tokens, "error": error,
            "text": "".join(text),
            "verify_steps": spec.get("verify_steps", 0), "accepted_tokens": spec.get("accepted_tokens", 0),
            "fallback_switches": spec.get("fallback_switches", 0)}


async def run_block(url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int,
                    temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """`n` requests, at most `concurrency` in flight: their records, the wall time and the server's /metrics
    before and after."""
    def sampled(index: int) -> dict | None:
        return None if temperature == 0 else {"temperature": temperature, "top_p": top_p, "seed": index}

    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i % len(prompts))
    records: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        before = parse_prometheus((await client.get(url + "/metrics")).text)

        async def user():
            while not queue.empty():
                index = queue.get_nowait()
                records.append({"prompt": index, **await one_request(client, url, prompts[index], max_tokens,
                                                                     sampled(index))})

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = parse_prometheus((await client.get(url + "/metrics")).text)
    return {"records": records, "wall_s": wall, "before": before, "after": after}


def level_summary(blocks: list[dict], concurrency: int) -> dict:
    """One level's figures from its blocks (one, or several interleaved with other servers' blocks)."""
    records = [r for b in blocks for r in b["records"]]
    out = summarize(records, sum(b["wall_s"] for b in blocks))
    out["concurrency"], out["blocks"] = concurrency, len(blocks)

    def mean(name: str) -> float | None:  # a histogram's mean over every block
        n = sum(b["after"].get(f"{name}_count", 0) - b["before"].get(f"{name}_count", 0) for b in blocks)
        total = sum(b["after"].get(f"{name}_sum", 0) - b["before"].get(f"{name}_sum", 0) for b in blocks)
        return total / n if n > 0 else None

    out["batch_rows_mean"] = mean("anchorspec_batch_rows")
    out["draft_rows_mean"] = mean("anchorspec_draft_rows")
    # tau*(B) averaged over the level's batched rounds: the gauge alone is the latest round's, whose B is
    # the burst's tail (session 31 quoted 1.34 at 16 users where a round of 16 breaks even near 1.9)
    out["break_even_tau"] = mean("anchorspec_round_break_even_tau")
    out["break_even_tau_last"] = blocks[-1]["after"].get("anchorspec_break_even_tau")
    # a round that compiled a graph (serve --compile) took seconds: a level with some is not steady state
    out["compiled_rounds"] = sum(b["after"].get("anchorspec_compiled_rounds_total", 0)
                                 - b["before"].get("anchorspec_compiled_rounds_total", 0) for b in blocks)
    out["error_samples"] = [r["error"] for r in records if r["error"]][:3]
    out["texts"] = {str(r["prompt"]): r["text"] for r in records if r["error"] is None}
    return out


async def run_level(url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int,
                    temperature: float = 0.0, top_p: float = 1.0) -> dict:
    return level_summary([await run_block(url, prompts, concurrency, n, max_tokens, temperature, top_p)], concurrency)


async def warm_up(server: Server, mode: str, args, prompts) -> None:
    """Wait until `server` is ready, then send it one request, not measured."""
    print(f"[{mode}] starting: {' '.join(server.cmd)}", file=sys.stderr)
    await server.wait_ready(args.start_timeout)
    async with httpx.AsyncClient(timeout=None) as client:
        warm = await one_request(client, server.url, prompts[0], args.max_tokens)
    if warm["error"]:
        raise RuntimeError(f"warm-up request failed: {warm['error']}\n{server.tail()}")


async def run_server(args, mode: str, prompts, results: dict, log_dir: Path) -> None:
    server = Server(args, mode, log_dir)
    try:
        await warm_up(server, mode, args, prompts)
        results[mode] = {}
        for c in args.concurrency:
            n = requests_for(c, args.requests)
            if args.warm_levels:  # the level once unmeasured: a compiled server builds its graphs for these batch shapes
                await run_level(server.url, prompts, c, n, args.max_tokens, args.temperature, args.top_p)
            level = await run_level(server.url, prompts, c, n, args.max_tokens, args.temperature, args.top_p)
            results[mode][str(c)] = level
            print(f"[{mode}] concurrency {c}: {n} requests, {level['total_tok_s']:.2f} tok/s total, "
                  f"{level['per_user_tok_s_median']:.2f} tok/s per user, {level['errors']} errors, "
                  f"{level['compiled_rounds']:.0f} rounds compiled a graph", file=sys.stderr)
    finally:
        server.stop()


async def run_interleaved(args, prompts, results: dict, log_dir: Path) -> None:
    """Every server up at once, each level's requests sent to one server at a time in `args.interleave` blocks
    per server, the servers' order reversed every block: a host whose speed drifts (session 76: the plain
    server's 16-user figure fell from 201 to 145 tok/s over four sequential runs) weighs on every server alike."""
    servers: dict[str, Server] = {}
    try:
        for mode in args.modes:  # one at a time: each server's start-up calibration runs alone on the cores
            servers[mode] = Server(args, mode, log_dir)
            await warm_up(servers[mode], mode, args, prompts)
            results[mode] = {}
        for c in args.concurrency:
            n = requests_for(c, args.requests)
            blocks: dict[str, list] = {mode: [] for mode in servers}
            if args.warm_levels:
                for mode, server in servers.items():
                    await run_block(server.url, prompts, c, n, args.max_tokens, args.temperature, args.top_p)
            for rep in range(args.interleave):
                for mode in (list(servers) if rep % 2 == 0 else list(servers)[::-1]):
                    blocks[mode].append(await run_block(servers[mode].url, prompts, c, n, args.max_tokens,
                                                        args.temperature, args.top_p))
            for mode in servers:
                level = results[mode][str(c)] = level_summary(blocks[mode], c)
                print(f"[{mode}] concurrency {c}: {args.interleave} x {n} requests, {level['total_tok_s']:.2f} tok/s "
                      f"total, {level['per_user_tok_s_median']:.2f} tok/s per user, {level['errors']} errors",
                      file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()


def speedups(results: dict, mode: str = "drafter") -> dict:
    """Per level, `mode`'s server over the plain one."""
    plain, spec = results.get("plain", {}), results.get(mode, {})
    out = {}
    for c in spec:
        if c in plain:
            a, b = plain[c]["texts"], spec[c]["texts"]
            out[c] = {"total_tok_s": spec[c]["total_tok_s"] / plain[c]["total_tok_s"],
                      "per_user_tok_s_median": spec[c]["per_user_tok_s_median"] / plain[c]["per_user_tok_s_median"],
                      # greedy on both servers: a difference is a near-tie flipped by float rounding, or a bug
                      "outputs_differing": sum(a[k] != b[k] for k in a.keys() & b.keys()),
                      "outputs_compared": len(a.keys() & b.keys())}
    return out


def markdown(results: dict, speedup: dict) -> str:
    lines = ["| concurrency | server | requests | per-user tok/s (median) | total tok/s | latency p50 / p90 / p99 (s) "
             "| TTFT p50 (s) | tau (verify steps, fallback switches) | break-even tau | rows per forward "
             "(target / drafter) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    levels = sorted({int(c) for mode in results.values() for c in mode})
    for c in levels:
        for mode in MODES:
            r = results.get(mode, {}).get(str(c))
            if r is None:
                continue
            lat = r["latency_s"]
            if mode == "plain":
                tau = "-"
            elif r["tau"] is None:  # every step plain: the drift fallback kept speculation off
                tau = f"- (0, {r['fallback_switches']})"
            else:
                tau = f"{r['tau']:.2f} ({r['verify_steps']}, {r['fallback_switches']})"
            rows = " / ".join(f"{r[k]:.2f}" if r.get(k) else "-" for k in ("batch_rows_mean", "draft_rows_mean"))
            tstar = r.get("break_even_tau")
            tstar = f"{tstar:.2f}" if mode == "drafter" and tstar is not None and tstar == tstar else "-"
            err = f" ({r['errors']} errors)" if r["errors"] else ""
            lines.append(f"| {c} | {mode} | {r['requests']}{err} | {r['per_user_tok_s_median']:.2f} | "
                         f"{r['total_tok_s']:.2f} | {lat['p50']:.2f} / {lat['p90']:.2f} / {lat['p99']:.2f} | "
                         f"{r['ttft_s_p50']:.2f} | {tau} | {tstar} | {rows} |")
    for mode, by_level in speedup.items():
        if not by_level:
            continue
        lines += ["", f"| concurrency | speedup {mode} / plain: total tok/s | per-user tok/s (median) "
                  "| outputs differing |", "|---|---|---|---|"]
        for c in sorted(by_level, key=int):
            s = by_level[c]
            lines.append(f"| {c} | {s['total_tok_s']:.2f}x | {s['per_user_tok_s_median']:.2f}x "
                         f"| {s['outputs_differing']} / {s['outputs_compared']} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    p.add_argument("--modes", default="plain,drafter",
                   help="which servers, comma-separated: plain (no drafter), lookup (no drafter, serve --lookup: "
                        "prompt lookup), drafter")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="MT-bench question.jsonl (first turns are used)")
    p.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, help="requests per level (default max(8, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="requests' temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="requests' top_p (with --temperature > 0)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float64"],
                   help="the servers' --dtype (auto: what this machine's GEMM probe picks, serve's default)")
    p.add_argument("--threads", type=int, help="--threads of the server (torch intra-op threads)")
    p.add_argument("--max-running", type=int, help="--max-running of the server (default: the largest level)")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for `anchorspec serve` (repeat)")
    p.add_argument("--drafter-arg", action="append", default=[],
                   help="extra argument for the drafter's server only (repeat; e.g. --drafter-arg=--no-lookup)")
    p.add_argument("--interleave", type=int, default=0, metavar="BLOCKS",
                   help="every server up at once, each level sent to one server at a time in BLOCKS blocks of "
                        "--requests per server, alternating (0, the default: one server after the other)")
    p.add_argument("--warm-levels", action="store_true",
                   help="run every level once unmeasured before measuring it (for --server-arg=--compile: the "
                        "graphs of its batch shapes are built then, not while measured)")
    p.add_argument("--timeout", type=float, default=3600, help="hard limit for the whole run, seconds")
    p.add_argument("--start-timeout", type=float, default=600, help="per server: load + calibration")
    p.add_argument("--out", required=True, help="JSON results")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        p.error(f"--modes takes a comma-separated subset of {','.join(MODES)}")
    if any(c < 1 for c in args.concurrency) or (args.requests is not None and args.requests < 1) or args.max_tokens < 1:
        p.error("--concurrency, --requests and --max-tokens must be >= 1")
    if args.interleave < 0:
        p.error("--interleave must be >= 0")
    if "drafter" in args.modes and not Path(args.drafter).is_dir():
        p.error(f"drafter directory {args.drafter} does not exist")
    args.max_running = args.max_running or max(args.concurrency)
    return args


async def main_async(args, prompts, results: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="anchorspec-load-") as tmp:
        if args.interleave:
            await run_interleaved(args, prompts, results, Path(tmp))
            return
        for mode in args.modes:
            await run_server(args, mode, prompts, results, Path(tmp))


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(Path(args.data))
    results: dict = {}
    status = "complete"
    try:
        asyncio.run(asyncio.wait_for(main_async(args, prompts, results), args.timeout))
    except asyncio.TimeoutError:
        status = f"timed out after {args.timeout:.0f} s (partial results)"
    except RuntimeError as exc:
        status = f"failed: {exc}"
    speedup = {mode: speedups(results, mode) for mode in MODES[1:]}
    record = {"status": status,
              "config": {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()},
              "prompts": len(prompts), "results": results, "speedup": speedup}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(markdown(results, speedup))
    print(f"\nstatus: {status}; JSON: {args.out}", file=sys.stderr)
    return 0 if status == "complete" else 1


if __name__ == "__main__":
    sys.exit(main())
