import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_is_opt_in():
    # in a child process, so the test session's own allocator is left as it is
    code = "from anchorspec.allocator import keep_freed_memory as k; print(k())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                        env={"ANCHORSPEC_MALLOC": "keep", "PATH": ""}).stdout.strip()
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": ""}).stdout.strip()
    assert (on, off) == ("True", "False")


def test_preload_command_only_in_auto_mode_and_once(monkeypatch):
    from anchorspec import allocator

    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    command, env = allocator.preload_command(["train", "--out", "o"], {"PATH": "/bin", "LD_PRELOAD": "/lib/x.so"})
    assert command[1:] == ["-m", "anchorspec", "train", "--out", "o"]
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4 /lib/x.so" and env["PATH"] == "/bin"
    assert allocator.preload_command(["train"], env) is None  # the re-run process does not re-run again
    for mode in ("glibc", "keep", "other"):
        assert allocator.preload_command(["train"], {"ANCHORSPEC_MALLOC": mode}) is None
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.preload_command(["train"], {}) is None


def _train_stderr(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ANCHORSPEC_MALLOC", "_ANCHORSPEC_PRELOADED")}
    # a data file that does not exist: the command stops right after choosing its allocator
    cmd = [sys.executable, "-m", "anchorspec", "train", "--target", "t", "--data", "/nonexistent/x.jsonl",
           "--out", "o", "--max-steps", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**env, **env_extra}, timeout=300)
    assert run.returncode == 2, run.stderr
    return run.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux-only")
def test_train_runs_on_tcmalloc_when_installed_and_glibc_when_asked():
    from anchorspec.allocator import find_tcmalloc

    if find_tcmalloc() is None:
        pytest.skip("tcmalloc is not installed here (apt-get install libtcmalloc-minimal4)")
    assert "train allocator: tcmalloc" in _train_stderr({})
    assert "train allocator: glibc" in _train_stderr({"ANCHORSPEC_MALLOC": "glibc"})
    assert "ANCHORSPEC_MALLOC must be one of" in _train_stderr({"ANCHORSPEC_MALLOC": "bogus"})
