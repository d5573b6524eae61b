#!/usr/bin/env bash
# Proof that a bare clone is enough: copy this repository into an empty temporary directory (nothing
# beside it, so no ../shared/data), make a virtualenv and a fresh $ANCHORSPEC_HOME, and run the
# README's two set-up commands there. Not part of pytest (it takes minutes); run it by hand or in CI:
#   bash tests/bare_clone_check.sh               # both commands; the test suite alone takes ~5 min on 2 cores
#   CHECK=demo bash tests/bare_clone_check.sh    # the demo only (~2 min)
#   SOURCE=worktree ...  copy the working tree (uncommitted changes too) instead of cloning HEAD
#   FRESH_VENV=1 ...     a virtualenv without the system's site-packages (downloads torch)
#   KEEP=1 ...           keep the temporary directory (its path is printed)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CHECK=${CHECK:-all}
WORK=$(mktemp -d)
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$WORK"' EXIT; fi
say() { echo "== bare clone check: $*" >&2; }
mkdir "$WORK/empty"
DEST="$WORK/empty/anchorspec"
if [ "${SOURCE:-clone}" = worktree ]; then
  mkdir "$DEST"
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
     | tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$DEST"
else
  git clone -q "$REPO" "$DEST"
fi
say "copied into $DEST"
if [ -n "${FRESH_VENV:-}" ]; then
  python3 -m venv "$WORK/venv"
else
  python3 -m venv --system-site-packages "$WORK/venv"  # torch already here: no 200 MB download
fi
export PATH="$WORK/venv/bin:$PATH" ANCHORSPEC_HOME="$WORK/home" PYTHON="$WORK/venv/bin/python3"
cd "$DEST"
if [ -e ../shared ]; then say "FAILED: ../shared exists beside the copy"; exit 1; fi
status=0
if [ "$CHECK" = all ] || [ "$CHECK" = demo ]; then
  say "bash scripts/demo.sh (log: $WORK/demo.log)"
  if bash scripts/demo.sh >"$WORK/demo.log" 2>&1 \
      && grep -q "outputs identical to plain: " "$WORK/demo.log" \
      && grep -q "x plain" "$WORK/demo.log"; then
    grep -A8 "^== result" "$WORK/demo.log" >&2  # through the float32 check's line
    say "demo OK"
  else
    tail -20 "$WORK/demo.log" >&2
    say "demo FAILED"
    status=1
  fi
fi
if [ "$CHECK" = all ] || [ "$CHECK" = ci ]; then
  say "bash .ci/run (log: $WORK/ci.log)"
  if bash .ci/run >"$WORK/ci.log" 2>&1; then
    tail -3 "$WORK/ci.log" >&2
    say "tests OK"
  else
    tail -30 "$WORK/ci.log" >&2
    say "tests FAILED"
    status=1
  fi
fi
exit $status
