"""`launch setup` ships `git archive` of a commit, so uncommitted or untracked work would be left
behind without a word: it refuses such a tree in one line unless --allow-dirty (a temporary git
repository stands in for the checkout; no gcloud command runs)."""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

import pytest

from launch import cli, gcloud

SPEC = Path(__file__).resolve().parents[2] / "launch/specs/v5e.toml"


def _git(repo: Path, *args: str) -> None:
  subprocess.run(
    ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
    check=True, capture_output=True, timeout=30,
  )  # fmt: skip


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
  """A committed repository with an ignored directory, as the checkout `setup` archives."""
  root = tmp_path / "checkout"
  root.mkdir()
  _git(root, "init", "-q")
  (root / ".gitignore").write_text("runs/\n")
  (root / "code.py").write_text("x = 1\n")
  _git(root, "add", "-A")
  _git(root, "commit", "-qm", "first")
  monkeypatch.setattr(gcloud, "REPO", root)
  return root


def _setup(*flags: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(["setup", "--spec", str(SPEC), *flags])
  return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def ran(monkeypatch) -> list:
  """The commands `setup` would run (recorded, never executed)."""
  commands: list = []
  monkeypatch.setattr(gcloud, "run", lambda cmds, dry_run: commands.extend(cmds) or 0)
  return commands


def test_setup_ships_a_clean_tree_and_ignores_ignored_files(repo, ran):
  (repo / "runs").mkdir()
  (repo / "runs" / "metrics.jsonl").write_text("{}\n")  # ignored: not work that could be lost
  assert gcloud.dirty_files(repo) == []
  rc, _, err = _setup()
  assert rc == 0 and not err
  assert ran[0].argv[:2] == ("git", "archive")


@pytest.mark.parametrize("change", ["modified", "untracked", "staged"])
def test_setup_refuses_a_dirty_tree_in_one_line_unless_allowed(repo, ran, change):
  if change == "modified":
    (repo / "code.py").write_text("x = 2\n")
  elif change == "untracked":
    (repo / "new_tool.py").write_text("y = 1\n")
  else:
    (repo / "staged.py").write_text("z = 1\n")
    _git(repo, "add", "staged.py")
  dirty = gcloud.dirty_files(repo)
  assert len(dirty) == 1

  rc, out, err = _setup()
  assert rc == 2 and out == "" and not ran  # refused before any command
  assert err.count("\n") == 1 and err.startswith("launch setup: 1 uncommitted or untracked")
  assert dirty[0] in err and "--allow-dirty" in err

  rc, _, err = _setup("--allow-dirty")
  assert rc == 0 and not err and ran[0].argv[:2] == ("git", "archive")
