"""The persistent compilation cache every `asearcher` command turns on (`compile_cache.py`):
which directory it names, that a second real process reads what the first compiled (and gets the
same results), that "off" writes nothing, and that a mistake is one line with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asearcher_jax import compile_cache
from asearcher_jax.compile_cache import CompileCacheConfig

REPO = Path(__file__).resolve().parents[2]
T = 240  # seconds: bound on each subprocess

# One process as `main.py` starts one: the cache enabled from the config and this environment,
# then a program compiled and run. Prints JAX's own events: programs found in the cache (hits)
# and written to it ("misses": JAX counts a miss when it writes the entry).
CHILD = """
import json, sys
import jax, jax.numpy as jnp
from asearcher_jax import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
cfg = compile_cache.CompileCacheConfig(**json.loads(sys.argv[1]))
where = compile_cache.enable(cfg)
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) * 3.0 + jnp.arange(x.shape[0]))
y = f(jnp.linspace(-1.0, 1.0, 48).reshape(6, 8))
print(json.dumps({
  "where": where,
  "hits": events.count("/jax/compilation_cache/cache_hits"),
  "misses": events.count("/jax/compilation_cache/cache_misses"),
  "y": [float(v) for v in y],
}))
"""


def child(cfg: dict, env: dict[str, str]) -> dict:
  base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMP", "JAX_PERS"))}
  base.pop(compile_cache.ENV_DIR, None)
  out = subprocess.run(
    [sys.executable, "-c", CHILD, json.dumps(cfg)],
    env={**base, "PYTHONPATH": str(REPO), **env},
    capture_output=True,
    text=True,
    timeout=T,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def entries(path: Path) -> list[Path]:
  return [p for p in path.rglob("*-cache")] if path.exists() else []


def test_which_directory_each_setting_names(tmp_path):
  home = {"ASEARCHER_HOME": str(tmp_path / "home")}
  default = CompileCacheConfig()
  assert default.resolved_dir(home) == str(tmp_path / "home" / "jax_cache")
  assert default.resolved_dir({}) == str(Path.home() / ".cache" / "asearcher_jax" / "jax_cache")
  assert default.resolved_dir({**home, "JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
  both = {**home, "JAX_COMPILATION_CACHE_DIR": "/j", compile_cache.ENV_DIR: "/ours"}
  assert default.resolved_dir(both) == "/ours"
  assert CompileCacheConfig(dir="/bound").resolved_dir(both) == "/bound"  # gin wins
  for off in ("off", "OFF", "", " off "):
    assert default.resolved_dir({compile_cache.ENV_DIR: off}) is None
    assert CompileCacheConfig(dir=off).resolved_dir(both) is None
  assert CompileCacheConfig(dir="gs://bucket/cache").resolved_dir({}) == "gs://bucket/cache"
  assert CompileCacheConfig(dir="~/c").resolved_dir({}) == str(Path.home() / "c")


def test_bad_values_are_refused():
  with pytest.raises(ValueError, match="min_compile_s must be >= 0"):
    CompileCacheConfig(min_compile_s=-1.0)
  with pytest.raises(ValueError, match="max_size_gb must be > 0"):
    CompileCacheConfig(max_size_gb=0)


@pytest.mark.slow
def test_a_second_process_reads_back_what_the_first_compiled(tmp_path):
  cache = tmp_path / "cache"
  first = child({"dir": str(cache)}, {})
  assert first["where"] == str(cache)
  assert first["misses"] >= 1 and first["hits"] == 0
  written = entries(cache)
  assert written, "the first process wrote nothing"  # a 0.05 s compile too: min_compile_s 0
  second = child({"dir": str(cache)}, {})
  assert second["hits"] >= 1 and second["misses"] == 0
  assert second["y"] == first["y"]
  assert sorted(entries(cache)) == sorted(written)  # nothing compiled, nothing written
  # The environment names it when the config does not, as for every `asearcher` command.
  third = child({}, {compile_cache.ENV_DIR: str(cache)})
  assert third["where"] == str(cache) and third["hits"] >= 1 and third["misses"] == 0


@pytest.mark.slow
def test_off_writes_nothing_and_jax_own_variable_keeps_jax_settings(tmp_path):
  home = tmp_path / "home"
  off = child({}, {compile_cache.ENV_DIR: "off", "ASEARCHER_HOME": str(home)})
  assert off["where"] is None and off["hits"] == off["misses"] == 0
  assert not home.exists()
  # Only JAX's variable set (the test suite's way): its directory, with JAX's own 1 s threshold,
  # so this 0.05 s program is looked up but not written.
  jaxs = tmp_path / "jax"
  kept = child({}, {"JAX_COMPILATION_CACHE_DIR": str(jaxs), "ASEARCHER_HOME": str(home)})
  assert kept["where"] == str(jaxs) and kept["misses"] == 0
  assert jaxs.is_dir() and entries(jaxs) == [] and not home.exists()  # JAX opened it, wrote none


def test_a_directory_that_cannot_be_made_is_one_line(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(ValueError) as err:
    compile_cache.enable(CompileCacheConfig(dir=str(blocker / "cache")), env={})
  message = str(err.value)
  assert len(message.splitlines()) == 1
  assert str(blocker / "cache") in message and "ASEARCHER_COMPILE_CACHE" in message


def test_command_line_mistakes_are_one_line_with_exit_2(tmp_path):
  """The cache is configured before the subcommand runs: a bad value bound in gin, or a
  directory that cannot be made, stops `asearcher` with one line (and no compile); so does a
  bad `DistributedConfig` value, configured the same way."""
  env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
  env["ASEARCHER_HOME"] = str(tmp_path / "home")  # were a case to run, nothing of the user's
  (tmp_path / "bad.gin").write_text(
    "from __gin__ import dynamic_registration\n"
    "from asearcher_jax.apps import index\n"
    "from asearcher_jax import compile_cache\n"
    "index.build_index.force = False\n"
    "compile_cache.CompileCacheConfig.min_compile_s = -2.0\n"
  )
  (tmp_path / "pod.gin").write_text(
    "from __gin__ import dynamic_registration\n"
    "from asearcher_jax.apps import index\n"
    "from asearcher_jax import distributed\n"
    "index.build_index.force = False\n"
    "distributed.DistributedConfig.num_processes = 0\n"
  )
  (tmp_path / "file").write_text("x")
  cases = [
    # The process bootstrap beside it: a bad bound value used to fall back to the defaults.
    (["index", "--gin_file", "pod.gin"], {}, "num_processes must be >= 1"),
    (["index", "--gin_file", "bad.gin"], {}, "min_compile_s must be >= 0"),
    (["index", "--gin_file", "ok.gin"], {compile_cache.ENV_DIR: str(tmp_path / "file" / "c")}, "cannot be made"),
  ]  # fmt: skip
  (tmp_path / "ok.gin").write_text(
    "from __gin__ import dynamic_registration\nfrom asearcher_jax.apps import index\n"
    "index.build_index.force = False\n"
  )
  for args, extra, fragment in cases:
    out = subprocess.run(
      [sys.executable, "-m", "asearcher_jax.main", *args],
      cwd=tmp_path,
      env={**env, **extra},
      capture_output=True,
      text=True,
      timeout=T,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("asearcher index: config error: ") and fragment in lines[0]


def test_benchmarks_use_the_cache_only_when_asked(tmp_path):
  """Benchmarks report cold compiles unless $ASEARCHER_COMPILE_CACHE names a cache (a short
  accelerator lease carrying an earlier call's compiles)."""
  assert compile_cache.enable_if_asked({"ASEARCHER_HOME": str(tmp_path)}) is None
  assert not (tmp_path / "jax_cache").exists()
  code = "from asearcher_jax import compile_cache; print(compile_cache.enable_if_asked())"
  out = subprocess.run(
    [sys.executable, "-c", code],
    env={
      "PYTHONPATH": str(REPO),
      "JAX_PLATFORMS": "cpu",
      compile_cache.ENV_DIR: str(tmp_path / "c"),
    },
    capture_output=True,
    text=True,
    timeout=T,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == str(tmp_path / "c") and (tmp_path / "c").is_dir()
