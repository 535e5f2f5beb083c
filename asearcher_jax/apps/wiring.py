"""The pieces every program that runs agents puts together: the policy, the in-process generation
client, the agents' ToolBox (local retrieval or the web, under the record/replay cache and the cost
budget) and the local retrieval server.

Configs here are frozen and gin-bindable (`apps` is the only layer that composes the others);
the runtime objects they describe are built by the functions below and passed on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal, Protocol

from jax.sharding import Mesh

from asearcher_jax import storage
from asearcher_jax.model import sharding
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.loading import load_policy
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools import registry as tool_registry
from asearcher_jax.tools.access import FetchConfig, JinaConfig
from asearcher_jax.tools.budget import BudgetConfig
from asearcher_jax.tools.cache import CacheConfig
from asearcher_jax.tools.search import LocalRetrievalConfig, SerperConfig
from asearcher_jax.tools.toolbox import ToolBox, ToolBoxConfig, make_toolbox

log = logging.getLogger(__name__)


# --- policy ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
  """A loaded policy and its tokenizer.

  Attributes:
    module: the NNX transformer (its parameters are the policy's).
    tokenizer: the tokenizer it speaks.
    description: one line for the log.
    pretrained: loaded from a checkpoint (False: a random init, which never writes <answer>).
  """

  module: Transformer
  tokenizer: Tokenizer
  description: str
  pretrained: bool


def policy(
  *,
  model_dir: str | None = None,
  model: ModelConfig | None = None,
  tokenizer_dir: str | None = None,
  seed: int = 0,
  mesh: Mesh | None = None,
) -> Policy:
  """A Hugging Face checkpoint (`model_dir`; with `mesh`, read straight into its shardings),
  else a random `model` (default qwen2-tiny) of init `seed`; the tokenizer from
  `tokenizer_dir`, else the checkpoint's, else Qwen2's."""
  # Only a checkpoint is read into the mesh; a random policy starts whole (eager init) on every
  # process, so one- and multi-process runs begin from bit-identical weights.
  layout = None
  if mesh is not None and model_dir is not None:
    layout = lambda _cfg: (mesh, sharding.DEFAULT_RULES)  # noqa: E731
  module, tokenizer, what = load_policy(model_dir, model, tokenizer_dir, seed, layout=layout)
  log.info("policy: %s", what)
  return Policy(
    module=module, tokenizer=tokenizer, description=what, pretrained=model_dir is not None
  )


# --- generation ------------------------------------------------------------------------------


def in_process_generation(
  p: Policy, engine: EngineConfig, driver: DriverConfig
) -> tuple[Engine, Driver]:
  """The policy in the in-process engine (its own copy of the parameters) and the driver that
  agents call as their generation client (logprobs, versions, weight updates, aborts)."""
  eng = Engine.from_model(p.module, p.tokenizer, engine)
  return eng, Driver(eng, driver)


# --- tools -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolsConfig:
  """Which tools the agents get, and how tool calls are cached and paid for."""

  # "local": BM25 retrieval (search + page access) on a local server; "web": Serper search with
  # the Jina reader or direct page fetching (`web_access`); "none": agents without tools.
  kind: Literal["local", "web", "none"] = "local"
  # How the web setting reads pages: "jina" (the reader) or "direct" (fetch + HTML to markdown).
  web_access: Literal["jina", "direct"] = "jina"
  # Where the local servers are and how the client tries them; None, or one naming neither
  # addresses nor addr_dir: the program's own server (started on 127.0.0.1, announced in an
  # address directory of its run), with this client's other settings.
  local: LocalRetrievalConfig | None = None
  # Serper search (API key from $SERPER_API_KEY), the Jina reader and direct fetching.
  serper: SerperConfig = dataclasses.field(default_factory=SerperConfig)
  jina: JinaConfig = dataclasses.field(default_factory=JinaConfig)
  fetch: FetchConfig = dataclasses.field(default_factory=FetchConfig)
  # Record/replay cache of tool calls ("off", "read-write", "replay-only").
  cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
  # Prices of paid calls and the spending limit.
  budget: BudgetConfig = dataclasses.field(default_factory=BudgetConfig)
  # More tools beside search and access (not with kind "none"): registered names,
  # "module:Class" strings (a tool outside the package, built with its defaults), or Tool
  # instances (gin: `[@my_tool.MyTool()]`).
  extra: tuple[Any, ...] = ()

  def __post_init__(self):
    if self.kind not in ("local", "web", "none"):
      raise ValueError(f"tools kind must be 'local', 'web' or 'none', got {self.kind!r}")
    if self.web_access not in ("jina", "direct"):
      raise ValueError(f"web_access must be 'jina' or 'direct', got {self.web_access!r}")
    if self.kind == "none" and self.extra:
      raise ValueError("tools kind 'none' gives the agents no ToolBox, so no extra tools either")
    for spec in self.extra:  # an unknown name or an unimportable class fails here, in one line
      if isinstance(spec, str):
        tool_registry.resolve(spec)

  @property
  def own_server(self) -> bool:
    """The program starts the local retrieval server itself."""
    local = self.local
    return self.kind == "local" and (local is None or not (local.addresses or local.addr_dir))


def toolbox(
  config: ToolsConfig, *, view: ToolBoxConfig | None = None, addr_dir: str | Path | None = None
) -> ToolBox | None:
  """The agents' ToolBox (None for kind "none"); `view` is what the agent sees (documents per
  search, page chunking: `AsearcherAgentConfig.toolbox_config()`), `addr_dir` where the
  program's own retrieval server announces itself."""
  common = dict(cache=config.cache, budget=config.budget, config=view, tools=config.extra)
  if config.kind == "none":
    return None
  if config.kind == "web":
    return make_toolbox(
      search="serper", access=config.web_access, serper=config.serper, jina=config.jina,
      fetch=config.fetch, **common,
    )  # fmt: skip
  local = config.local or LocalRetrievalConfig()
  if config.own_server:
    local = dataclasses.replace(local, addr_dir=str(addr_dir) if addr_dir else None)
  return make_toolbox(search="local", access="local", local=local, **common)


def agent_view(agent_config: Any) -> ToolBoxConfig | None:
  """What an agent's config says its tools show (None: the ToolBox defaults)."""
  view = getattr(agent_config, "toolbox_config", None)
  return view() if callable(view) else None


# --- retrieval server ------------------------------------------------------------------------


class CoroutineRunner(Protocol):
  """An event loop on another thread (the rollout controller's)."""

  def run_coroutine(self, coro: Coroutine, timeout: float) -> Any: ...

  def add_closer(self, close: Any) -> None: ...


def start_retrieval_server(loop: CoroutineRunner, index_dir: str | None, addr_dir: Path) -> Any:
  """The BM25 retrieval server on `loop` (127.0.0.1, a free port, an address file in
  `addr_dir`), stopped with the loop; `index_dir` None: the shipped corpus's index (built once)."""
  from asearcher_jax.apps.index import default_index_dir
  from asearcher_jax.tools.retrieval.corpus import default_corpus_paths
  from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
  from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig

  # a gs:// index is served from the local cache (faiss and tantivy read local files)
  out = Path(storage.local_copy(index_dir, what="index")) if index_dir else default_index_dir()
  if index_dir is None:
    build_index_dir(corpus=default_corpus_paths(), index_dir=out, show_progress=False)
  for stale in addr_dir.glob("Host*_IP*.txt"):  # a killed run's server is gone
    stale.unlink(missing_ok=True)
  server = RetrievalServer(load_index(out), RetrievalServerConfig(port=0, addr_dir=str(addr_dir)))
  loop.run_coroutine(server.start(), 30)
  loop.add_closer(server.stop)
  return server
