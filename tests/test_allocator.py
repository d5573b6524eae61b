import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_takes_effect_and_can_be_opted_out():
    # in a child process, so the test session's own allocator is left as it is
    code = "from anchorspec.allocator import keep_freed_memory as k; print(k())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"ANCHORSPEC_MALLOC": "default", "PATH": ""}).stdout.strip()
    assert (on, off) == ("True", "False")
