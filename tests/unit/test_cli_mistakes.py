"""The command line's answer to the cheap mistakes a user makes: each is one line naming where
it was made and what to write instead, found before anything loads; never a traceback, never
a binding silently ignored."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import socket

import gin
import pytest
from aiohttp import web

from asearcher_jax import http_guard, main
from asearcher_jax.apps import gin_config, wiring
from asearcher_jax.data.qa import DatasetError, load_training_qa
from asearcher_jax.errors import AsearcherError
from asearcher_jax.rl.episodes import read_episodes
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.views import runs


@pytest.fixture(autouse=True)
def _clear_gin():
  yield
  gin.clear_config()


def config_error(subcommand: str, files: list[str], params: list[str]) -> str:
  with pytest.raises(gin_config.ConfigError) as e:
    main.configure(subcommand, files, params)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_help_names_parameters_as_the_default_gin_files_import_them():
  """gin/runs/sft.gin imports the subcommand's module as `commands` (its `sft` is the library
  package), so the help says `commands.sft.*`, and that name binds."""
  text = main._help("sft", [])
  assert "commands.sft.out_dir = 'runs/sft'" in text and "  sft.sft." not in text
  fn = main.configure("sft", [], ['commands.sft.trajectories = "t.jsonl"'])
  assert gin.query_parameter("commands.sft.trajectories") == "t.jsonl"
  assert callable(fn)


def test_a_class_nothing_builds_is_an_error_that_names_what_to_bind():
  """config.ModelConfig is reachable from sft's signature (a default instance), but the default
  gin files never build it: its bindings would be ignored. The help says so, the binding is an
  error naming the parameter to bind, and binding that too is accepted."""
  assert "(config.ModelConfig.* take effect once gin builds it: also bind loading.PolicyConfig" in (
    main._help("sft", [])
  )
  flags = ['commands.sft.trajectories = "t.jsonl"', 'config.ModelConfig.remat_policy = "full"']
  line = config_error("sft", [], flags)
  assert line.startswith("""--gin_param='config.ModelConfig.remat_policy = "full"': """)
  assert "nothing builds config.ModelConfig" in line
  assert "also bind loading.PolicyConfig.model = @config.ModelConfig()" in line
  main.configure("sft", [], [*flags, "loading.PolicyConfig.model = @config.ModelConfig()"])
  assert gin.query_parameter("config.ModelConfig.remat_policy") == "full"


def test_a_macro_nothing_uses_is_an_error():
  line = config_error("inspect", [], ['run_dir = "runs/x"'])
  assert line.startswith("--gin_param='run_dir = \"runs/x\"': run_dir = 'runs/x' binds a gin macro")
  # A macro the gin files use is a binding (gin/runs/sft.gin reads %TRAJECTORIES), and one an
  # included file defines may be left unused by a flag that binds over its one use.
  main.configure("sft", [], ['TRAJECTORIES = "t.jsonl"'])
  recipe = "gin/experiments/asearcher_local_qwen2_5_7b.gin"  # includes gin/runs/train_remote.gin
  main.configure(
    "train", [recipe], ['WEIGHTS_DIR = "w"', 'train_config.RemoteEnginesConfig.weights_dir = "v"']
  )


def test_another_subcommands_gin_file_is_named():
  line = config_error("train", ["gin/experiments/quickstart.gin"], [])
  assert "nothing here binds train.train; it configures quickstart.quickstart" in line


def test_a_subcommand_no_gin_file_configures_runs_on_its_defaults():
  """`plan` has no default gin file: gin never registers it, and its defaults run."""
  fn = main.configure("plan", [], [])
  assert (fn.__module__, fn.__qualname__) == ("asearcher_jax.apps.plan", "plan")
  assert not isinstance(gin.config._INVERSE_REGISTRY.get(fn), gin.config.Configurable)


def test_paths_under_a_file_and_files_for_directories(tmp_path):
  (tmp_path / "afile").write_text("x")
  under = f'index.build_index.index_dir = "{tmp_path}/afile/index"'
  line = config_error("index", [], [under])
  assert line.startswith(f"--gin_param={under!r}: index.build_index.index_dir: ")
  assert f"lies under '{tmp_path}/afile', which is a file, not a directory" in line
  line = config_error("index", [], [f'index.build_index.index_dir = "{tmp_path}/afile"'])
  assert line.endswith(f"'{tmp_path}/afile' is a file, not a directory")


def test_ports_and_unquoted_strings():
  line = config_error("serve-retrieval", [], ["server.RetrievalServerConfig.port = 99999"])
  assert line.endswith(
    "server.RetrievalServerConfig.port: 99999 is not a port (0-65535; 0: any free one)"
  )
  line = config_error("plan", [], ["plan.plan.chip = v5p"])
  assert "v5p is not a value: a string needs quotes" in line
  assert """--gin_param='plan.plan.chip="v5p"'""" in line
  # What a shell leaves of --gin_param=x.y="a/b.jsonl" or =["a"] without single quotes.
  line = config_error("train", [], ["commands.train.questions=runs/q.jsonl"])
  assert """--gin_param='commands.train.questions="runs/q.jsonl"'""" in line
  line = config_error("eval", [], ["commands.EvalData.datasets=[nosuch]"])
  assert "[nosuch] is not a value: each string in it needs quotes" in line
  line = config_error("long-horizon", [], ['long_horizon.run_dir = "x"'])
  assert "'long_horizon' was not provided by an import statement" in line  # the help's name: lh.


def test_flags_of_the_command_line_itself(capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    main.main(["plan", "--log_level", "bogus"])
  assert e.value.code == 2 and "invalid choice: 'BOGUS'" in capsys.readouterr().err
  (tmp_path / "afile").write_text("x")
  assert main.main(["plan", "--operative_config", f"{tmp_path}/afile/op.gin"]) == 2
  (err,) = capsys.readouterr().err.strip().splitlines()
  assert err == (
    f"asearcher plan: config error: --operative_config={tmp_path}/afile/op.gin: "
    f"{tmp_path}/afile is a file, not a directory"
  )
  assert main.main(["plan", "--operative_config="]) == 2  # was silently not written
  assert "--operative_config= needs a file path" in capsys.readouterr().err


def _raise_not_a_directory() -> int:
  raise NotADirectoryError(20, "Not a directory", "/x/afile/out")


def test_an_os_error_at_run_time_is_one_line(capsys, monkeypatch):
  monkeypatch.setitem(main.SUBCOMMANDS, "plan", f"{__name__}:_raise_not_a_directory")
  monkeypatch.setenv("ASEARCHER_COMPILE_CACHE", "off")
  assert main.main(["plan"]) == 1
  (err,) = capsys.readouterr().err.strip().splitlines()
  assert err.startswith("asearcher plan: error: [Errno 20] Not a directory: '/x/afile/out'")


def test_a_port_in_use_names_the_address():
  async def go():
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      s.listen()
      port = s.getsockname()[1]
      runner = web.AppRunner(web.Application())
      await runner.setup()
      with pytest.raises(AsearcherError, match=f"cannot listen on 127.0.0.1:{port}: address"):
        await asyncio.wait_for(http_guard.listen(runner, "127.0.0.1", port), 30)

  asyncio.run(go())


def test_training_questions_file_mistakes_name_the_file_and_line(tmp_path):
  with pytest.raises(DatasetError, match=r"cannot read QA file .*nope\.jsonl"):
    load_training_qa(tmp_path / "nope.jsonl")
  with pytest.raises(DatasetError, match="is a directory, not a QA file"):
    load_training_qa(tmp_path)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "q", "answer": "a"}\n{bad\n')
  with pytest.raises(DatasetError, match=r"bad.jsonl:2: broken JSON line"):
    load_training_qa(bad)
  keyless = tmp_path / "keyless.json"
  keyless.write_text('[\n{"question": "q", "answer": "a"},\n{"q": "x", "answer": "a"}\n]')
  with pytest.raises(DatasetError, match=r"keyless.json:3: no 'question' string"):
    load_training_qa(keyless)
  assert [x.question for x in load_training_qa(keyless, limit=1)] == ["q"]


def test_corrupt_episode_exports_name_the_file(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  path = run / "episodes.jsonl.gz"
  path.write_bytes(gzip.compress(b'{"group_id": 1}\n{bad\n'))
  with pytest.raises(AsearcherError, match=r"episodes.jsonl.gz:2: not an episode record"):
    read_episodes(path)
  path.write_bytes(gzip.compress(b'{"group_id": 1}\n') + gzip.compress(b'{"a": "\xff"}\n'))
  with pytest.raises(AsearcherError, match=r"episodes.jsonl.gz: after line 1: not UTF-8"):
    read_episodes(path)
  path.write_bytes(gzip.compress(b'{"group_id": 1}\n') + b"not gzip at all")  # was: no episodes
  with pytest.raises(AsearcherError, match=r"episodes.jsonl.gz: after line 1: not gzip data"):
    read_episodes(path)
  torn = gzip.compress(b'{"group_id": 1}\n') + gzip.compress(b'{"group_id": 2}\n')[:-9]
  path.write_bytes(torn)
  assert read_episodes(path) == [{"group_id": 1}]  # a member a crash cut short: skipped
  path.write_bytes(gzip.compress(json.dumps({"group_id": 1, "episode": 0}).encode() + b"\n"))
  with pytest.raises(AsearcherError, match="episode record 1: no 'trajectory' field"):
    runs.RunDir(run).episodes  # noqa: B018
  path.unlink()
  snap = run / "eval" / "cfg" / "ds" / "run0" / "Q1.json"  # an evaluation snapshot
  snap.parent.mkdir(parents=True)
  (run / "eval" / "cfg" / "config.json").write_text("{}")
  for body, message in (('"trajectory"', r"Q1.json: not an evaluation snapshot \(a JSON object\)"),
                        ('{"trajectory": {"turns": []}}', r"Q1.json: not an evaluation snapshot "
                                                          r"this version reads \(TypeError")):  # fmt: skip
    snap.write_text(body)
    with pytest.raises(AsearcherError, match=message):
      runs.RunDir(run).episodes  # noqa: B018


def test_the_trainers_own_retrieval_server_keeps_its_client_settings(monkeypatch, tmp_path):
  """A recipe binds the client (`concurrency`) without an address: the program still starts its
  own server, and the client it talks to it with keeps the recipe's settings."""
  seen = {}
  monkeypatch.setattr(wiring, "make_toolbox", lambda **kw: seen.update(kw))
  tools = wiring.ToolsConfig(local=LocalRetrievalConfig(concurrency=128))
  assert tools.own_server
  wiring.toolbox(tools, addr_dir=tmp_path)
  assert seen["local"] == LocalRetrievalConfig(concurrency=128, addr_dir=str(tmp_path))
  remote = wiring.ToolsConfig(local=LocalRetrievalConfig(addresses=("10.0.0.2:8000",)))
  assert not remote.own_server
  wiring.toolbox(remote, addr_dir=tmp_path)
  assert seen["local"].addresses == ("10.0.0.2:8000",) and seen["local"].addr_dir is None


def test_values_a_config_class_or_the_command_refuses_are_config_errors(capsys):
  """A config class's own check (`__post_init__`) is one line at the binding (leaf classes are
  built first, so not at the class that references it; 'k' in 'Quickstart' is not the field
  k), and a value the command refuses once it runs is exit 2, like every config mistake."""
  flag = "pipeline.QuickstartEval.temperature=-1.0"
  line = config_error("quickstart", [], [flag])
  assert line.startswith(f"--gin_param={flag!r}: pipeline.QuickstartEval: ")
  assert "temperature must be >= 0" in line
  line = config_error("train", [], ["staleness.StalenessConfig.batch_groups=0"])
  assert line.startswith("--gin_param='staleness.StalenessConfig.batch_groups=0': ")
  assert main.main(["inspect", "--gin_param=inspect.inspect.worst=0"]) == 2
  (err,) = capsys.readouterr().err.strip().splitlines()
  assert err == "asearcher inspect: config error: worst (--worst) must be >= 1, got 0"


def test_bm25_option_names_are_checked_against_what_bm25s_accepts():
  """The stopword names are copied from bm25s (importing it to check would touch jax); each
  must be one bm25s resolves, and a bad stemmer / stopword list / method is a config line."""
  from asearcher_jax.tools.retrieval import index

  bm25s = index._import_bm25s()
  for name in index.STOPWORD_LISTS:
    assert bm25s.tokenization._infer_stopwords(name), name
  for flag, fragment in (
    ('index.BM25Config.stemmer = "klingon"', "not a PyStemmer language"),
    ('index.BM25Config.stopwords = "xx"', "not a bm25s stopword list"),
    ('index.BM25Config.method = "bm26"', "expected one of 'lucene', 'robertson'"),
  ):
    assert fragment in config_error("index", [], [flag])


def test_checking_a_configuration_touches_no_jax_backend():
  """A trainer process checks its configuration before `jax.distributed.initialize`, which must
  come before any backend exists: building the bound config classes may import jax, never run
  on it (BM25Config once imported bm25s, whose import runs a jax op)."""
  import subprocess
  import sys

  code = (
    "from asearcher_jax import main\n"
    "main.configure('train', ['gin/experiments/asearcher_local_qwen2_5_7b.gin',"
    " 'gin/overlays/recipe_tiny.gin'], [])\n"
    "main.configure('index', [], [])\n"
    "from jax._src import xla_bridge\n"
    "print('backends', sorted(xla_bridge._backends))\n"
  )
  root = __file__.rsplit("/tests/", 1)[0]
  out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=240)  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "backends []"


def test_several_command_lines_are_checked_in_one_process(capsys, monkeypatch):
  """`check_each` answers for each argv what `--check` would end with (None when fine); the
  `--check-each` form reads JSON argv lists from stdin and writes one JSON line for each."""
  recipe = "--gin_file=gin/experiments/asearcher_local_qwen2_5_7b.gin"
  argvs = [
    ["plan", recipe],
    ["plan", recipe, "--gin_param=plan_memory.TrainerShape.chips='many'"],
    ["serve-model", recipe, "--gin_param=openai_api.OpenAIServerConfig.port=70000"],
    ["bogus"],
  ]
  results = main.check_each(argvs)
  assert results[0] is None
  assert results[1].startswith("asearcher plan: config error: --gin_param=")
  assert "TrainerShape.chips" in results[1] and "expected int" in results[1]
  assert results[2].startswith("asearcher serve-model: config error: ") and "70000" in results[2]
  assert "invalid choice: 'bogus'" in results[3]
  capsys.readouterr()
  monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(a) + "\n" for a in argvs)))
  assert main.main(["--check-each"]) == 2
  assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == results
  monkeypatch.setattr("sys.stdin", io.StringIO('["plan"]\n{"not": "an argv"}\n'))
  assert main.main(["--check-each"]) == 2
  assert "stdin line 2 is not a JSON list of strings" in capsys.readouterr().err


def test_a_macro_nothing_defines_names_where_it_is_used(tmp_path):
  """gin's own error is a traceback that prints the whole configuration."""
  assert config_error("train", [], ["commands.train.model=%NOT_DEFINED"]) == (
    "--gin_param='commands.train.model=%NOT_DEFINED': %NOT_DEFINED is used but nothing defines "
    "it (write `NOT_DEFINED = VALUE` in a gin file or --gin_param)"
  )
  f = tmp_path / "x.gin"
  f.write_text("from __gin__ import dynamic_registration\nfrom asearcher_jax.apps import train as "
               "commands\n# %NOT_DEFINED in a comment\ncommands.train.model = %NOT_DEFINED\n")  # fmt: skip
  assert config_error("train", [str(f)], []).startswith(f"{f}:4: %NOT_DEFINED is used but")


def test_help_with_a_bad_gin_file_and_gin_files_after_flags(capsys, tmp_path):
  """`--help FILE` reads the file for its names: a missing, directory or non-UTF-8 file is one
  line (was a traceback, or silently the defaults' help); a gin file may follow the flags."""
  bad = tmp_path / "latin1.gin"
  bad.write_bytes(b"# caf\xe9\n")
  for gin_file, message in ((tmp_path / "none.gin", "no such gin file"),
                            (tmp_path, "a directory, not a gin file"),
                            (bad, "latin1.gin: not UTF-8 text (byte 5)")):  # fmt: skip
    assert main.main(["train", "--help", f"--gin_file={gin_file}"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("asearcher train: config error: ") and message in err
  assert main.main(["demo", "--check", "gin/runs/demo.gin"]) == 0  # was "unrecognized arguments"
  assert "asearcher demo: configuration ok" in capsys.readouterr().out


def test_flags_bind_mains_own_configs():
  """The README's `compile_cache.CompileCacheConfig.dir` and a pod's `distributed.*` flags bind
  with any subcommand (they were "not provided by an import statement")."""
  main.configure("plan", [], ['compile_cache.CompileCacheConfig.dir="/tmp/cache"'])
  assert main.compile_cache_config().dir == "/tmp/cache"
  main.configure("plan", [], ["distributed.DistributedConfig.num_processes=2"])
  assert main.distributed_config().num_processes == 2
  assert "doesn't have a parameter named 'dirr'" in config_error(
    "plan", [], ['compile_cache.CompileCacheConfig.dirr="/tmp/cache"']
  )


def test_inspect_refuses_what_would_print_nothing(tmp_path, capsys):
  """`--width 0` printed nothing with exit 0, `limit=-1` all rows but one, `inspect ""` scanned
  the working directory, a file was "does not exist"."""
  (tmp_path / "afile").write_text("x")
  for argv, code, message in (
    ([str(tmp_path), "--width", "0"], 2, "config error: width (--width) must be >= 20 columns"),
    ([""], 1, "error: no run directory given (an empty path)"),
    ([str(tmp_path / "afile")], 1, "afile' is a file, not a run directory"),
  ):
    assert main.main(["inspect", *argv]) == code
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert message in err
  assert main.main(["inspect", f'--gin_param=inspect.inspect.run_dir="{tmp_path}"',
                    "--gin_param=inspect.inspect.limit=-1"]) == 2  # fmt: skip
  assert "limit must be >= 1, got -1" in capsys.readouterr().err


def test_an_unknown_agent_is_found_by_the_check():
  known = "['asearcher', 'reasoning', 'search_r1'] or 'module:Class'"
  assert f"agent must be one of {known}, got 'nosuch'" in (
    config_error(
      "train",
      ["gin/experiments/asearcher_local_qwen2_5_7b.gin"],
      ['train_config.AgentChoice.name="nosuch"'],
    )
  )


def test_a_binding_in_a_scope_nothing_enters_is_an_error():
  """gin keeps `scope/x.Y.z` for a `@scope/x.Y()` reference; with none it is silently ignored.
  The search-r1 recipe's scoped LogNormals (`searches/...`) are entered, so they pass."""
  assert config_error("train", [], ["myscope/train_config.TrainConfig.train_steps=3"]) == (
    "--gin_param='myscope/train_config.TrainConfig.train_steps=3': myscope/train_config."
    "TrainConfig.train_steps is bound in scope 'myscope', which no `@myscope/...` reference "
    "enters, so it would be ignored"
  )
  main.configure("plan", ["gin/experiments/search_r1_qwen2_5_7b.gin"], [])
