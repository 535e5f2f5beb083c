#!/usr/bin/env bash
# One entry point that sets up whatever is missing, then runs a job.
#   bash scripts/run.sh demo        # the main job (until `quickstart` exists)
#   bash scripts/run.sh test        # lint + the whole test suite (what CI runs)
#   bash scripts/run.sh test-fast   # lint + every test not marked slow (< 5 min on 2 cores)
#   bash scripts/run.sh <subcommand> [--gin_file ...] [--gin_param ...]
# Needs only python3 (>= 3.11) on PATH. The virtual environment lives in .venv
# and is (re)installed whenever requirements*.txt or pyproject.toml change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.requirements.sha256"
want="$(cat requirements.txt requirements-runtime.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo "[setup] installing requirements into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  "$VENV/bin/python" -m pip install -q --no-deps -r requirements-nodeps.txt
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi

cmd="${1:-demo}"
shift || true
case "$cmd" in
  test | test-fast)
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    "$VENV/bin/lint-imports"
    # Two workers (pytest-xdist): most end-to-end tests wait on their own subprocesses and
    # servers, so two at once fit on two cores. ASEARCHER_TEST_WORKERS=0 runs in one process.
    # The 15 slowest tests are listed at the end: the suite's 20-minute budget is watched per test.
    # Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): else
    # every test process and every process a test starts compiles the package and rewrites the
    # test modules' asserts again (collection 12 s -> 6 s a process; __pycache__ is ignored).
    unset PYTHONDONTWRITEBYTECODE
    # test-fast leaves out the tests marked slow (each > ~10 s: end-to-end runs, processes,
    # servers): the tier to run while editing; the whole suite before submitting.
    tier=()
    [[ "$cmd" == test-fast ]] && tier=(-m "not slow")
    exec "$VENV/bin/python" -m pytest -q -n "${ASEARCHER_TEST_WORKERS:-2}" --dist loadgroup \
      --durations=15 "${tier[@]}" "$@"
    ;;
  *)
    exec "$VENV/bin/asearcher" "$cmd" "$@"
    ;;
esac
