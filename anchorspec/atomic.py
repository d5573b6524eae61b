"""Atomic file writes (temp file in the same folder + rename) with the permissions a plain write gets.

`tempfile.mkstemp` creates 0600 files (and safetensors' `save_file` writes 0600 too), so an
atomically written export would be unreadable to anyone else (a vLLM container running as another
user, say). Here the written file is given 0666 less the process umask before the rename, exactly
what `open(path, "w")` would give it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_name(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def atomic_write(dest: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Call `write(temp_path)`, then rename the temp file over `dest`; on failure `dest` is untouched."""
    dest = Path(dest)
    tmp = _temp_name(dest)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # claim the name
    try:
        write(str(tmp))
        os.chmod(tmp, 0o666 & ~current_umask())  # `write` may have replaced the file with a 0600 one
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(dest: str | os.PathLike, text: str) -> None:
    atomic_write(dest, lambda tmp: Path(tmp).write_text(text))


def atomic_create_text(dest: str | os.PathLike, text: str) -> bool:
    """Write `dest` whole only if it does not exist yet; False if another process got there first (its
    content stays). Lets concurrent processes (DDP ranks) settle on one shared result."""
    dest = Path(dest)
    tmp = _temp_name(dest)
    try:
        tmp.write_text(text)
        os.link(tmp, dest)  # atomic and exclusive: fails if dest exists
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def make_temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty folder in `parent` (to fill, then rename into place), with the umask's permissions
    (`tempfile.mkdtemp` would make it 0700)."""
    while True:
        path = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=0o777)
            return path
        except FileExistsError:
            continue
