"""What every agent shares: timed LLM calls recorded token for token, timed tool calls with
failure attribution, and the episode wrapper that turns any hang into a recorded finish."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from asearcher_jax.agent import protocol
from asearcher_jax.agent.protocol import Action
from asearcher_jax.agent.trajectory import LLMCall, ToolEvent, Trajectory
from asearcher_jax.serving.types import EngineError, GenerationClient, SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.toolbox import ToolBox, ToolCall, ToolResult

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
  """Timeouts every agent honours (no await without one)."""

  # Seconds one generate call may take (an engine hang becomes an attributed failure).
  llm_timeout_s: float = 600.0
  # Seconds one tool call may take, on top of the ToolBox's own per-call timeout.
  tool_timeout_s: float = 900.0
  # Seconds a whole episode may take; None: no episode-level bound beyond the per-call ones.
  episode_timeout_s: float | None = None


class Agent(abc.ABC):
  """Template method: `run` owns timing and failure handling, subclasses write `_episode`."""

  name = "agent"
  # The agent's frozen config class (what `registry.resolve` checks a config against and builds
  # by default); None: the agent takes no config.
  config_class: type | None = None

  def __init__(
    self,
    *,
    client: GenerationClient,
    tokenizer: Tokenizer,
    toolbox: ToolBox | None,
    sampling: SamplingParams | None = None,
    limits: Limits | None = None,
  ) -> None:
    self.client = client
    self.tokenizer = tokenizer
    self.toolbox = toolbox
    self.sampling = sampling or SamplingParams()
    self.limits = limits or Limits()
    self._t0 = 0.0

  async def run(
    self,
    question: str,
    *,
    qid: str = "",
    answers: Sequence[str] = (),
    aug_answers: Sequence[str] = (),
    valid_inst: bool = False,
  ) -> Trajectory:
    """One episode. Never raises for model output, tool or engine trouble: it is recorded."""
    traj = Trajectory(
      agent=self.name,
      question=question,
      qid=qid,
      answers=[str(a) for a in answers],
      aug_answers=[str(a) for a in aug_answers],
      valid_inst=valid_inst,
      started_at=time.time(),
    )
    self._t0 = time.perf_counter()
    try:
      async with asyncio.timeout(self.limits.episode_timeout_s):
        await self._episode(traj)
    except TimeoutError:
      self.fail(traj, "abort", f"episode: exceeded {self.limits.episode_timeout_s:g} s")
    traj.duration_s = time.perf_counter() - self._t0
    if not traj.finish_reason:
      traj.finish_reason = "eos"
    return traj

  @abc.abstractmethod
  async def _episode(self, traj: Trajectory) -> None:
    """Runs the agent loop, appending calls and tool events to `traj` and setting its finish."""

  def fail(self, traj: Trajectory, reason: str, error: str, *, environment: bool = True) -> None:
    traj.finish_reason = reason
    traj.errors.append(error)
    traj.environment_failure = traj.environment_failure or environment

  async def generate(
    self,
    traj: Trajectory,
    kind: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    stop: Sequence[str] = (),
  ) -> LLMCall | None:
    """One recorded engine call; None (with the trajectory finished) if the engine failed."""
    started = time.perf_counter()
    try:
      async with asyncio.timeout(self.limits.llm_timeout_s):
        result = await self.client.generate(input_ids, self.sampling, max_new_tokens, stop=stop)
    except TimeoutError:
      self.fail(traj, "abort", f"engine: generate exceeded {self.limits.llm_timeout_s:g} s")
      return None
    except EngineError as e:  # known and attributed (a dead server, a failed prefill): one line
      log.warning("generate failed: %s", e)
      self.fail(traj, "abort", f"engine: {type(e).__name__}: {e}")
      return None
    except Exception as e:  # an engine bug fails this episode, attributed, not the rollout
      log.exception("generate failed")
      self.fail(traj, "abort", f"engine: {type(e).__name__}: {e}")
      return None
    call = LLMCall(
      index=len(traj.calls),
      kind=kind,
      input_ids=np.asarray(input_ids, np.int32),
      output_ids=np.asarray(result.tokens, np.int32),
      logprobs=np.asarray(result.logprobs, np.float32),
      versions=np.asarray(result.versions, np.int32),
      stop_reason=result.stop_reason,
      max_new_tokens=max_new_tokens,
      text=self.tokenizer.decode(result.tokens),
      started_s=started - self._t0,
      latency_s=time.perf_counter() - started,
    )
    traj.calls.append(call)
    return call

  async def call_tool(
    self, traj: Trajectory, action: Action
  ) -> tuple[ToolResult | None, ToolEvent]:
    """Executes a tool action; tool trouble is an environment failure, never a raise."""
    event = ToolEvent(
      after_call=len(traj.calls) - 1, name=action.kind, argument=action.argument, text=""
    )
    traj.tools.append(event)
    if self.toolbox is None:
      event.environment_failure = True
      self.fail(traj, "environment_failure", "tool: no toolbox configured")
      return None, event
    started = time.perf_counter()
    try:
      async with asyncio.timeout(self.limits.tool_timeout_s):
        result = await self.toolbox.execute(ToolCall(action.kind, action.argument))
    except TimeoutError:
      event.latency_s = time.perf_counter() - started
      event.environment_failure = True
      self.fail(traj, "environment_failure", f"tool: {action.kind} exceeded the agent timeout")
      return None, event
    event.latency_s = time.perf_counter() - started
    event.stats = dataclasses.asdict(result.stats)
    event.environment_failure = result.stats.environment_failure
    if result.stats.environment_failure:
      traj.environment_failure = True
      traj.errors.append(f"tool: {result.stats.error}")
    return result, event

  def action_tags(self) -> tuple[str, ...]:
    """The tags this agent acts with: its ToolBox's tools (every registered tool when the
    ToolBox does not say), then answer."""
    return protocol.action_tags(getattr(self.toolbox, "tags", None))

  def elapsed(self) -> float:
    return time.perf_counter() - self._t0

  def ends_with_eos(self, call: LLMCall) -> bool:
    return call.output_ids.size > 0 and int(call.output_ids[-1]) in self.tokenizer.stop_token_ids
