"""Test doubles that behave like the real components, for testing an agent or a tool of one's own:
a scripted generation client that speaks the engine's token contract, a recording client, the
token-exactness check, in-memory tool providers behind a real `ToolBox`, and a scripted OpenAI
server with its toy world for synthesis (`synth_scripted`, `synth_toyworld`).

The project's own crash, fault and abuse harnesses and benchmark workloads are not here: they
live in harness/ at the repository root, which is not installed."""

from asearcher_jax.testing.checks import assert_token_exact
from asearcher_jax.testing.fake_tools import FakeAccess, FakeSearch, fake_toolbox
from asearcher_jax.testing.recording_client import RecordingClient
from asearcher_jax.testing.scripted_client import RecordedCall, ScriptedClient

__all__ = [
  "FakeAccess",
  "FakeSearch",
  "RecordedCall",
  "RecordingClient",
  "ScriptedClient",
  "assert_token_exact",
  "fake_toolbox",
]
