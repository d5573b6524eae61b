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
