"""Records say how to make a result again: `asearcher` records its own arguments, every
--gin_param included and shell-quoted, while its subcommand runs; a pipeline called from Python
falls back to its recipe's command."""

import shlex

from asearcher_jax import main
from asearcher_jax.apps import invocation


def test_a_subcommand_sees_its_command_line(monkeypatch):
  seen = []
  monkeypatch.setattr(
    main, "configure", lambda *a: lambda: seen.append(invocation.command("the recipe")) or 0
  )
  argv = ["demo", "--gin_param=demo.run.text='hi there'"]
  assert main.main(argv) == 0
  assert seen == [shlex.join(["asearcher", *argv])]
  assert shlex.split(seen[0])[1:] == argv  # the quoting survives a shell
  assert invocation.command("the recipe") == "the recipe"  # nothing leaks past the command


def test_outside_asearcher_the_recipe_command_stands():
  assert invocation.command("asearcher x --gin_file y.gin") == "asearcher x --gin_file y.gin"
  with invocation.recorded(["sft", "--gin_param=a.b=1"]):
    assert invocation.command("default") == "asearcher sft --gin_param=a.b=1"
  assert invocation.command("default") == "default"
