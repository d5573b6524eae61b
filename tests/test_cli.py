"""The CLI as a newcomer meets it: --version, help that explains, errors that name the flag before
any model loads, path-or-hub-id targets, a busy serve port, tau only where there is one, files
readable as the umask says, and a tuned profile that `generate` finds or explains. Tiny models only."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
from pathlib import Path

import pytest
from helpers import CHAT_WORDS, save_tiny_chat_target

import anchorspec
from anchorspec import cli
from anchorspec.atomic import atomic_write, atomic_write_text, make_temp_dir
from anchorspec.decode.tree import TreeShape
from anchorspec.errors import AnchorspecError
from anchorspec.metrics import GenerationStats
from anchorspec.models import hub
from anchorspec.models.dtype import DTYPE_CHOICES


def run(argv, capsys):
    """(exit code, stdout, stderr) of `anchorspec ARGV`, parse errors and --version included."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a model fails the test: argument checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    import anchorspec.api
    import anchorspec.models.target

    monkeypatch.setattr(anchorspec.api, "load", refuse)
    monkeypatch.setattr(anchorspec.models.target, "load_target", refuse)


# --- help and version -------------------------------------------------------------------------------

def test_version(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"anchorspec {anchorspec.__version__}"


def test_top_level_help_is_written_for_users(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    assert "first steps:" in out and "anchorspec generate --target smollm2-135m-instruct" in out
    for command in ("generate", "tune", "serve", "train", "export"):
        assert f"    {command}" in out


def test_every_option_has_a_help_line_and_shows_its_default(capsys):
    for name, parser in subparsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help line"
    code, out, _ = run(["generate", "--help"], capsys)
    assert code == 0
    assert "(default: 128)" in out and "(default: auto)" in out and "(default: 0.0)" in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_help_never_prints_the_api_key(capsys, monkeypatch):
    monkeypatch.setenv("ANCHORSPEC_API_KEY", "s3cret-key")
    code, out, _ = run(["serve", "--help"], capsys)
    assert code == 0 and "--api-key" in out and "s3cret-key" not in out


def test_shared_options_come_from_one_place():
    for name, parser in subparsers().items():
        options = {opt: a for a in parser._actions for opt in a.option_strings}
        if "--dtype" in options and name not in ("convert-drafter", "average-drafters"):  # a storage dtype, never auto
            assert tuple(options["--dtype"].choices) == DTYPE_CHOICES and options["--dtype"].default == "auto", name
        if "--threads" in options:
            assert options["--threads"].type is cli._count, name
        if "--chain" in options:
            assert options["--chain"].type is cli._count and options["--tree"].type is cli._tree_arg, name
        if "--target" in options and name != "regenerate":  # regenerate can answer through --endpoint instead
            assert options["--target"].required and options["--target"].help == cli.TARGET_HELP, name
    assert "__import__" not in Path(cli.__file__).read_text()


def test_shapes_print_as_the_flag_takes_them():
    shape = TreeShape(4, 4, 16)
    assert cli._shape_text(shape) == "4,4,16" and TreeShape.parse(cli._shape_text(shape)) == shape


# --- errors: one line, the flag named, before any model loads ---------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--max-new-tokens", "0"],
     "--max-new-tokens must be >= 1, got 0"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--chain", "0"], "--chain must be >= 1, got 0"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--dtype", "fp16"], "--dtype invalid choice"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--tree", "4,4"], "--tree expects TOP_K,DEPTH"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--staged-verify", "0"],
     "--staged-verify must be >= 1, got 0"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--staged-verify", "1"], "conflict with --no-spec"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--prune", "drift"], "conflict with --no-spec"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--prune", "confidence"], "--prune invalid choice"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--staged-verify", "1", "--depth-control",
      "pid"], "--staged-verify conflicts with --adaptive/--depth-control"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--lookup", "0"], "--lookup must be >= 1, got 0"),
    (["generate", "--target", "t", "--no-spec", "--prompt", "x", "--lookup", "8"], "conflict with --no-spec"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--lookup", "8", "--staged-verify", "1"],
     "--staged-verify conflicts with --lookup"),
    (["generate", "--target", "t", "--drafter", "d", "--prompt", "x", "--lookup", "8", "--no-lookup"],
     "not allowed with argument"),
    (["generate", "--target", "t", "--prompt", "x"], "give --drafter DIR for speculative decoding, --lookup for "
                                                     "prompt lookup"),
    (["generate", "--target", "t", "--prompt", "x", "--lookup", "--chain", "2"],
     "--chain/--tree/--adaptive/--depth-control/--staged-verify/--prune need --drafter"),
    (["serve", "--target", "t", "--chain", "3"], "--chain/--tree/--no-lookup need --drafter (--lookup alone serves "
                                                 "prompt lookup)"),
    (["serve", "--target", "t", "--no-lookup"], "--chain/--tree/--no-lookup need --drafter"),
    (["train", "--target", "t", "--data", "x", "--out", "o", "--max-steps", "0"], "--max-steps must be >= 1"),
    (["train", "--target", "t", "--data", "x", "--out", "o", "--max-steps", "1", "--eval-replay", "-1"],
     "--eval-replay must be >= 0"),
    (["bench", "--target", "t", "--out", "o", "--limit", "0"], "--limit must be >= 1"),
    (["tune", "--target", "t", "--drafter", "d", "--new-tokens", "4"], "--new-tokens must be >= 8, got 4"),
    (["serve", "--target", "t", "--max-running", "0"], "--max-running must be >= 1"),
    (["regenerate", "--target", "t", "--data", "x", "--out", "o", "--max-new-tokens", "0"],
     "--max-new-tokens must be >= 1"),
])
def test_bad_values_name_the_flag(argv, message, capsys, no_model_loads):
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_train_refuses_a_selection_of_missing_parts_before_the_model_loads(tmp_path, capsys, no_model_loads):
    from anchorspec.data.corpus import write_part

    write_part(tmp_path, [([1], [1])], vocab_size=96, provenance={})
    code, out, err = run(["train", "--target", "t", "--data", f"{tmp_path}:0000,0007", "--out", str(tmp_path / "o"),
                          "--max-steps", "1"], capsys)
    errors = [line for line in err.splitlines() if line.startswith("anchorspec: error:")]
    assert code == 2 and out == "" and len(errors) == 1 and errors[0].endswith("has no part 0007"), err


def test_command_checks_run_before_the_model_loads(tmp_path, capsys, no_model_loads):
    code, _, err = run(["generate", "--target", "smollm2-135m-instruct", "--drafter", str(tmp_path / "none"),
                        "--prompt", "x"], capsys)
    assert code == 2 and "--drafter directory" in err and "does not exist" in err


# --- --target: a path or a hub id -----------------------------------------------------------------------

@pytest.mark.parametrize("target,path_like", [
    ("org/name", False), ("HuggingFaceTB/SmolLM2-135M-Instruct", False), ("./model", True), ("../x/y", True),
    ("/abs/model", True), ("~/model", True), ("a/b/c", True), ("org/", True), ("a\\b", True), ("runs/d31", True),
])
def test_what_looks_like_a_path(target, path_like, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # runs/d31: its first part is a local folder, so it is a path
    assert hub.looks_like_path(target) is path_like


def test_missing_path_target_fails_at_once(tmp_path, capsys, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("a path-like target must not reach the hub")

    monkeypatch.setattr(hub, "hub_reachable", no_hub)
    for target in (str(tmp_path / "missing"), "./missing-model", "a/b/missing"):
        code, out, err = run(["generate", "--target", target, "--no-spec", "--prompt", "x", "--dtype", "float32"],
                             capsys)
        assert code == 2 and err.strip().count("\n") == 0 and f"target directory {target} does not exist" in err


def test_hub_id_offline_fails_at_once_or_uses_the_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    monkeypatch.setattr(hub, "cached_hub_snapshot", lambda repo: None)
    with pytest.raises(AnchorspecError, match="neither a local directory nor a cached hub model.*cannot be reached"):
        hub.resolve_target("org/model")
    monkeypatch.setattr(hub, "cached_hub_snapshot", lambda repo: str(tmp_path / "snapshot"))
    assert hub.resolve_target("org/model") == str(tmp_path / "snapshot")
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    assert hub.resolve_target("org/model") == "org/model"  # online: transformers downloads it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # told to stay offline: never probes, uses the cache
    monkeypatch.setattr(hub, "hub_reachable", lambda: pytest.fail("probed the hub with HF_HUB_OFFLINE=1"))
    assert hub.resolve_target("org/model") == str(tmp_path / "snapshot")


# --- serve: a port in use -------------------------------------------------------------------------------

def test_serve_port_in_use_fails_before_loading(capsys, no_model_loads):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out, err = run(["serve", "--target", "smollm2-135m-instruct", "--port", str(port)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in err, err


def test_only_a_server_or_a_batched_compile_asks_for_the_batched_graphs(capsys, monkeypatch):
    """A second graph per model (models/attention.py: graph_forms) pays only for rounds of several sequences:
    `serve` asks for it unless it runs one at a time, `compile` with --batched; `generate` never."""
    asked = []

    def load(*args, **kwargs):
        asked.append(kwargs.get("batched", False))
        raise AnchorspecError("stop here: load was called")

    monkeypatch.setattr(anchorspec.api, "load", load)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    for argv in (["serve", "--port", port], ["serve", "--port", port, "--max-running", "1"],
                 ["compile", "--batched"], ["compile"], ["generate", "--prompt", "hi", "--no-spec"]):
        code, _, err = run(argv + ["--target", "smollm2-135m-instruct"], capsys)
        assert code == 2 and "stop here" in err, (argv, err)
    assert asked == [True, False, True, False, False]


def test_serve_free_port_passes_the_check():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cli._check_port_free("127.0.0.1", port)  # no exception


# --- stats that mean what they say ----------------------------------------------------------------------

def test_plain_decoding_reports_no_tau():
    plain = GenerationStats(new_tokens=5, target_forwards=5)
    assert plain.to_dict()["tau"] is None
    spec = GenerationStats()
    spec.record_step(draft_depth=3, drafted=3, accepted=2)
    assert spec.to_dict()["tau"] == 3.0
    assert plain.merge(spec).to_dict()["tau"] == 3.0


def test_server_does_not_call_a_plain_request_speculative():
    from anchorspec.serve.app import speculative_summary

    kept_plain = GenerationStats(new_tokens=8, target_forwards=8)
    summary = speculative_summary(kept_plain, 1)  # drafter loaded, but the fallback kept it plain
    assert summary["enabled"] is False and summary["tau"] is None and summary["fallback_switches"] == 1
    speculated = GenerationStats()
    speculated.record_step(2, 2, 1)
    summary = speculative_summary(speculated, 0)
    assert summary["enabled"] is True and summary["tau"] == 2.0


# --- files readable as the umask says -------------------------------------------------------------------

@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775),
                                                      (0o077, 0o600, 0o700)])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    atomic_write_text(tmp_path / "a.json", "{}\n")
    atomic_write(tmp_path / "b.bin", lambda tmp: Path(tmp).write_bytes(b"\0" * 10))
    folder = make_temp_dir(tmp_path, "run.tmp-")
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "b.bin").stat().st_mode) == file_mode
    assert stat.S_IMODE(folder.stat().st_mode) == dir_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin", folder.name]  # no temp files left


def test_atomic_write_failure_leaves_the_old_file(tmp_path):
    dest = tmp_path / "keep.txt"
    dest.write_text("old")

    def broken(tmp):
        Path(tmp).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(dest, broken)
    assert dest.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


# --- tiny end-to-end: init-drafter, convert-drafter, generate, tune ----------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    save_tiny_chat_target(root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": " ".join(CHAT_WORDS[i:i + 6])}) + "\n"
                                                for i in (0, 7, 14)))
    return root


def test_init_convert_and_export_write_readable_files(tiny, tmp_path, capsys, umask, one_thread):
    umask(0o022)
    drafter, half = tmp_path / "d", tmp_path / "d-bf16"
    code, out, err = run(["init-drafter", "--target", str(tiny / "target"), "--out", str(drafter)], capsys)
    assert code == 0, err
    code, out, err = run(["convert-drafter", str(drafter), "--out", str(half), "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    code, out, err = run(["export", str(drafter), "--format", "vllm", "--out", str(tmp_path / "vllm")], capsys)
    assert code == 0, err
    for folder in (drafter, half, tmp_path / "vllm"):  # a vLLM container running as another user reads these
        for name in ("config.json", "model.safetensors"):
            assert stat.S_IMODE((folder / name).stat().st_mode) == 0o644, folder / name


def test_generate_states_shape_and_tau(tiny, tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))  # no tuned profiles
    target, drafter = str(tiny / "target"), str(tmp_path / "d")
    assert run(["init-drafter", "--target", target, "--out", drafter], capsys)[0] == 0
    common = ["--target", target, "--prompts", str(tiny / "prompts.jsonl"), "--chat", "--max-new-tokens", "8",
              "--dtype", "float32", "--json"]
    code, out, err = run(["generate", *common, "--drafter", drafter, "--chain", "2", "--no-fallback"], capsys)
    assert code == 0, err
    assert "[draft shape 1,2,3: given]" in err  # a given shape: no profile look-up to explain
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 3 and all(r["stats"]["verify_steps"] > 0 and r["stats"]["tau"] >= 1 for r in rows)
    code, out, err = run(["generate", *common, "--drafter", drafter, "--chain", "2"], capsys)  # fallback on
    assert code == 0, err
    for row in map(json.loads, out.splitlines()):  # a random drafter may be kept plain: then no tau, not 0
        assert (row["stats"]["tau"] is None) == (row["stats"]["verify_steps"] == 0)
    code, out, err = run(["generate", *common, "--no-spec"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 3 and all(r["stats"]["tau"] is None for r in rows)
    code, out, err = run(["generate", *common, "--drafter", drafter], capsys)
    assert code == 0, err
    assert "no tuned profile for this target and drafter (dtype float32" in err, err
    plain = [json.loads(line)["token_ids"] for line in out.splitlines()]
    code, out, err = run(["generate", *common, "--drafter", drafter, "--tree", "2,3,6", "--no-fallback",
                          "--staged-verify", "1", "--prune", "drift"], capsys)
    assert code == 0, err
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == plain


def test_generate_with_lookup_and_no_drafter_is_prompt_lookup(tiny, capsys, one_thread):
    common = ["generate", "--target", str(tiny / "target"), "--prompts", str(tiny / "prompts.jsonl"), "--chat",
              "--max-new-tokens", "24", "--dtype", "float64", "--json"]
    code, out, err = run([*common, "--no-spec"], capsys)
    assert code == 0, err
    plain = [json.loads(line) for line in out.splitlines()]
    code, out, err = run([*common, "--lookup"], capsys)
    assert code == 0, err
    assert "[prompt lookup, no drafter: chains of up to 16 tokens" in err
    looked = [json.loads(line) for line in out.splitlines()]
    assert [r["token_ids"] for r in looked] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["lookup_tokens"] for r in looked) > 0  # the tiny target's answers repeat themselves


def test_tune_and_generate_agree_on_the_profile(tiny, tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setenv("ANCHORSPEC_HOME", str(tmp_path / "home"))
    target, drafter = str(tiny / "target"), str(tmp_path / "d")
    assert run(["init-drafter", "--target", target, "--out", drafter], capsys)[0] == 0
    code, out, err = run(["tune", "--target", target, "--drafter", drafter, "--prompts", str(tiny / "prompts.jsonl"),
                          "--limit", "1", "--new-tokens", "8", "--dtype", "float32", "--threads", "1"], capsys)
    assert code == 0, err
    profile = out.strip().splitlines()[-1].rpartition("profile: ")[2]
    assert Path(profile).is_file()
    base = ["generate", "--target", target, "--drafter", drafter, "--prompt", CHAT_WORDS[3], "--max-new-tokens", "4"]
    code, _, err = run([*base, "--dtype", "float32", "--threads", "1"], capsys)
    assert code == 0 and f"tuned ({profile})" in err, err
    code, _, err = run([*base, "--dtype", "float64", "--threads", "1"], capsys)  # another dtype: says why not
    assert code == 0 and "no tuned profile for dtype float64, threads 1" in err and "dtype float32" in err, err


def test_serve_lookup_is_on_with_a_drafter_unless_turned_off():
    """`anchorspec serve`'s chain (cli.serve_lookup): on by default with a drafter, its length from --lookup,
    off with --no-lookup; without a drafter only when --lookup asks (prompt lookup)."""
    import argparse

    from anchorspec.cli import serve_lookup
    from anchorspec.decode.lookup import LookupSettings

    def args(**kw):
        return argparse.Namespace(**{"drafter": "d", "lookup": None, "no_lookup": False, **kw})

    assert serve_lookup(args()) == LookupSettings()
    assert serve_lookup(args(lookup=8)) == LookupSettings(8)
    assert serve_lookup(args(no_lookup=True)) is None
    assert serve_lookup(args(drafter=None)) is None
    assert serve_lookup(args(drafter=None, lookup=16)) == LookupSettings(16)
