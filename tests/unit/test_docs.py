"""README.md and docs/*.md name only things that exist, so the docs cannot drift from the tree.

Checked: every repository path they mention (files, folders, `{a,b}` alternatives and `*` globs;
gin files too, except on the pages of dated history, which may name a file since removed), every
`asearcher <subcommand>`, every gin selector `<alias>.<name>.<field>` (the alias as some gin file
imports it, the name an attribute of that module, the field a parameter or config field), and
every relative link. Also: the README stays a front page (at most 12 KB, the two commands CI runs
first, a link to every docs page), every gin file's header says what it requires and which
`asearcher` command runs it, and every `--gin_param` an example shows binds (README, docs, gin
headers, docstrings).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from asearcher_jax import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
# Dated history: what was run, with the files of its day (docs/experiments/ is not in DOCS).
HISTORY = {ROOT / "docs" / "measurements.md"}
# The recipes, and the overlays of the extensions in examples/ (docs/extending.md).
GIN_FILES = sorted([*(ROOT / "gin").rglob("*.gin"), *(ROOT / "examples").rglob("*.gin")])
README_MAX_BYTES = 12 * 1024
# The README's first lines after the title, exactly: CI and users run them as written.
README_COMMANDS = (
  "bash scripts/run.sh quickstart   # set up .venv if missing, then the main job: SynthWiki -> "
  "warm start -> async RL -> report",
  "bash scripts/run.sh test         # set up .venv if missing, then lint and run the whole test "
  "suite (CI runs this)",
)

# A path starts at a top-level entry of the repository, or inside the package as the design notes
# write them (`serving/driver.py`); a trailing `::name` (a function in that file) is dropped.
_TOP = "asearcher_jax|gin|tests|benchmarks|scripts|docs|launch|notebooks|harness|examples|apps|model|serving|rl|agent|tools|data|evaluation|synthwiki|synthesis|sft|testing"
PATH_RE = re.compile(
  rf"(?<![\w./-])((?:{_TOP})/[\w./{{}},*-]*[\w}}*/])(?:::\w+)?"
  r"|(?<![\w./-])((?:README|DATA_LICENSES)\.md|requirements(?:-nodeps)?\.txt|\.importlinter|pyproject\.toml)"
)
SUBCOMMAND_RE = re.compile(r"(?:^|[`/\s(])asearcher ([a-z][a-z_-]*)")
SELECTOR_RE = re.compile(r"\b([a-z_]+)\.([A-Za-z_]+)\.([a-z_]+|\*)")
GIN_IMPORT_RE = re.compile(
  r"^from ((?:asearcher_jax|examples)[\w.]*) import (\w+)(?: as (\w+))?$", re.M
)
# `[text](target)` and `![alt](target)`; a target with a scheme is not the repository's.
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")


def _expand(path: str) -> list[str]:
  """`a/{b,c}.py` -> [`a/b.py`, `a/c.py`] (one level of braces, as the docs write them)."""
  m = re.search(r"\{([^{}]*)\}", path)
  if not m:
    return [path]
  return [
    q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end() :])
  ]


def _exists(path: str) -> bool:
  for base in (ROOT, ROOT / "asearcher_jax"):
    if "*" in path:
      if any(base.glob(path.rstrip("/"))):
        return True
    elif (base / path).exists():
      return True
  return False


def _paths(text: str) -> set[str]:
  found = set()
  for m in PATH_RE.finditer(text):
    found.update(_expand((m.group(1) or m.group(2)).rstrip(".,")))
  return found


def _is_gin_file(path: str) -> bool:
  return path.startswith("gin/") and path.endswith(".gin")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_the_docs_name_exists(doc):
  history = doc in HISTORY
  missing = sorted(
    p for p in _paths(doc.read_text()) if not (history and _is_gin_file(p)) and not _exists(p)
  )
  assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", [d for d in DOCS if d not in HISTORY], ids=lambda p: p.name)
def test_every_gin_file_the_docs_name_exists(doc):
  """A page that tells a user what to run names only gin files that are there (a recipe replaced
  by overlays must be renamed on every page, not only in the tree)."""
  missing = sorted(p for p in _paths(doc.read_text()) if _is_gin_file(p) and not _exists(p))
  assert not missing, f"{doc.name} names gin files that do not exist: {missing}"


def _links(doc: Path) -> list[str]:
  return [t for t in LINK_RE.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
  broken = sorted(
    t for t in _links(doc) if t.split("#")[0] and not (doc.parent / t.split("#")[0]).exists()
  )
  assert not broken, f"{doc.name} links to paths that do not exist: {broken}"


def test_the_readme_is_a_front_page():
  """At most 12 KB; the two commands CI and users run are the first lines after the title,
  exactly; every docs page is linked from it (what moved off the front page is one click away)."""
  text = README.read_text()
  size = len(text.encode())
  assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"
  lines = text.splitlines()
  assert lines[0].startswith("# ") and lines[1] == "" and lines[2] == "```bash", lines[:3]
  assert tuple(lines[3:5]) == README_COMMANDS and lines[5] == "```", lines[3:6]
  linked = {(ROOT / t.split("#")[0]).resolve() for t in _links(README)}
  unlinked = sorted(p.name for p in PAGES if p.resolve() not in linked)
  assert not unlinked, f"README.md links no docs page {unlinked}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_subcommand_the_docs_name_exists(doc):
  named = set(SUBCOMMAND_RE.findall(doc.read_text()))
  unknown = sorted(named - set(main.SUBCOMMANDS) - set(main.WRAPPERS))
  assert not unknown, f"{doc.name} names subcommands main.py does not have: {unknown}"


def _gin_aliases() -> dict[str, set[str]]:
  aliases: dict[str, set[str]] = {}
  for path in GIN_FILES:
    for package, name, alias in GIN_IMPORT_RE.findall(path.read_text()):
      aliases.setdefault(alias or name, set()).add(f"{package}.{name}")
  return aliases


def _fields(obj: object) -> set[str]:
  if dataclasses.is_dataclass(obj):
    return {f.name for f in dataclasses.fields(obj)}
  return set(inspect.signature(obj).parameters)


def _selector_ok(modules: set[str], name: str, field: str) -> bool:
  for module in modules:
    obj = getattr(importlib.import_module(module), name, None)
    if obj is not None and (field == "*" or field in _fields(obj)):
      return True
  return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_gin_selector_the_docs_name_binds_something(doc):
  aliases = _gin_aliases()
  bad = sorted(
    f"{a}.{n}.{f}"
    for a, n, f in set(SELECTOR_RE.findall(doc.read_text()))
    if a in aliases and not _selector_ok(aliases[a], n, f)
  )
  assert not bad, f"{doc.name} names gin selectors that bind nothing: {bad}"


def test_the_checks_see_what_the_docs_name():
  """Guards the regexes: known paths, subcommands, selectors and links of the pages are found."""
  text = "\n".join(d.read_text() for d in DOCS if d not in HISTORY)
  paths = _paths(text)
  assert {"asearcher_jax/apps/", "gin/overlays/local_tiny.gin", "docs/measurements.md"} <= paths
  assert "asearcher_jax/serving/request.py" in paths  # from serving/{request,...}.py
  assert "gin/experiments/asearcher_local_qwen2_5_14b.gin" in paths  # from ..._{7b,14b}.gin
  assert "launch/specs/local_tiny.toml" in paths
  assert {"examples/python_tool/tool.py", "examples/python_tool/train.gin"} <= paths
  assert ("python_tool", "PythonToolConfig", "timeout_s") in SELECTOR_RE.findall(text)
  assert {"train", "serve-model", "warm-start", "quickstart"} <= set(SUBCOMMAND_RE.findall(text))
  assert ("loading", "PolicyConfig", "*") in SELECTOR_RE.findall(text)
  assert ("mesh", "ServingMeshConfig", "tensor") in SELECTOR_RE.findall(text)
  assert {"docs/commands.md", "docs/images/trajectory_inspector.png"} <= set(_links(README))
  assert not _exists("asearcher_jax/no_such_module.py")
  assert not _exists("gin/experiments/no_such_recipe.gin")
  assert not _selector_ok({"asearcher_jax.model.loading"}, "PolicyConfig", "no_such_field")
  assert not _selector_ok({"asearcher_jax.apps.quickstart"}, "SynthWikiRL", "no_such_field")


def test_every_run_sh_job_the_docs_name_exists():
  """`bash scripts/run.sh JOB`: JOB is one of the script's own jobs (`test`, `test-fast`) or a
  subcommand it hands to `asearcher`."""
  script = (ROOT / "scripts" / "run.sh").read_text()
  own = {
    label.strip()
    for case in re.findall(r"^\s*([\w|\s-]+)\)\s*$", script, re.M)
    for label in case.split("|")
  } - {"*"}
  named = {
    (doc.name, job)
    for doc in DOCS
    for job in re.findall(r"bash scripts/run\.sh ([a-z][\w-]*)", doc.read_text())
  }
  assert {"test", "quickstart"} <= {job for _, job in named}, named
  unknown = sorted((d, j) for d, j in named if j not in own and j not in main.SUBCOMMANDS)
  assert not unknown, f"jobs scripts/run.sh does not have: {unknown}"


@pytest.mark.parametrize("path", GIN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_gin_header_says_what_it_requires_and_how_to_run_it(path):
  header = []
  for line in path.read_text().splitlines():
    if not line.startswith("#"):
      break
    header.append(line)
  text = "\n".join(header)
  assert "Requires" in text and "asearcher " in text, (
    f"{path.relative_to(ROOT)}: the header names what it requires and the command that runs it"
  )
  for sub in SUBCOMMAND_RE.findall(text):
    assert sub in main.SUBCOMMANDS, f"{path.relative_to(ROOT)}: unknown subcommand {sub!r}"


# `asearcher SUB [--gin_file F | F.gin]... --gin_param=B ...` as the docs, gin headers and
# docstrings write it (backslash continuations joined, in comments too).
_COMMAND_RE = re.compile(
  r"asearcher ([a-z-]+)((?: +(?:--gin_file[ =]\S+|--gin_param[ =](?:'[^']*'|\"[^\"]*\"|\S+)"
  r"|\S+\.gin))+)"
)
# What a flag that cannot bind says (the name is wrong), against a value a config refuses or a
# required parameter left out (the example's placeholders).
_UNBINDABLE = (
  "not provided by an import", "Couldn't resolve", "doesn't have a parameter",
  "No configurable matching", "nothing builds", "macro nothing uses", "is not a value",
  "not MODULE", "Unable to open",
)  # fmt: skip


def _documented_commands() -> list[tuple[str, str, list[str], list[str]]]:
  sources = [*DOCS, *GIN_FILES, *sorted((ROOT / "asearcher_jax").rglob("*.py"))]
  found = []
  for path in sources:
    text = re.sub(r"\\\s*\n\s*#?\s*", " ", path.read_text())
    for m in _COMMAND_RE.finditer(text):
      if m.group(1) not in main.SUBCOMMANDS:
        continue
      files, params = [], []
      args = iter(re.findall(r"'[^']*'|\"[^\"]*\"|\S+", m.group(2)))
      for a in args:
        a = a.strip("`")
        flag, _, value = a.partition("=")
        if flag in ("--gin_file", "--gin_param") and not value:
          value = next(args, "")
        value = value.strip("`")
        if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
          value = value[1:-1]
        if flag == "--gin_file":
          files.append(value)
        elif flag == "--gin_param":
          params.append(value)
        elif a.endswith(".gin"):
          files.append(a)
      if params:
        found.append((str(path.relative_to(ROOT)), m.group(1), files, params))
  return found


def test_every_documented_gin_param_binds():
  """A `--gin_param` the docs show names something that binds with the files the example reads
  (the placeholders' values may be refused: only the names are checked)."""
  import gin

  from asearcher_jax.apps.gin_config import ConfigError

  examples = _documented_commands()
  assert len(examples) >= 30, examples  # the README's, the gin headers', the docstrings'
  wrong = []
  for where, sub, files, params in examples:
    try:
      main.configure(sub, files, params)
    except ConfigError as e:
      if any(k in str(e) for k in _UNBINDABLE):
        wrong.append(f"{where}: asearcher {sub} {files} {params}: {e}")
    finally:
      gin.clear_config()
  assert not wrong, "\n".join(wrong)
