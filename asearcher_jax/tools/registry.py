"""Tools by name: the built-in `search` and `access`, and any tool a user registers or names as
`"module:Class"` (imported on demand, as verl's `class_name: pkg.MyTool` and SkyRL's
`register(id, entry_point=...)` do), so a tool can live outside the package.

Every reader of tool names (the tag protocol, the ToolBox, views, trajectory counters, the
evaluation report) asks this registry; none keeps its own list.
"""

from __future__ import annotations

import importlib
from typing import Any

from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools.base import Tool

# name -> tool class, in registration order (the protocol's extraction order: search, access, ...).
_TOOLS: dict[str, type[Tool]] = {}


def _builtins() -> None:
  """Registers the tools `tools.builtin` declares, first, whichever module a program imported
  first (imported by name: builtin's tools are registry readers' subjects, not its imports)."""
  if "search" in _TOOLS:
    return
  builtin = importlib.import_module("asearcher_jax.tools.builtin")
  for name, cls in builtin.BUILTIN_TOOLS.items():
    _TOOLS.setdefault(name, cls)


def register(name: str, cls: type[Tool] | str) -> type[Tool]:
  """Registers a tool class (or a `"module:Class"` entry point) under `name`; returns the class.

  Registering the same class again is a no-op; another class under a taken name is an error.
  """
  _builtins()
  if isinstance(cls, str):
    cls = load_class(cls, Tool, "tool")
  if not (isinstance(cls, type) and issubclass(cls, Tool)):
    raise AsearcherError(f"tool {name!r}: {cls!r} is not a subclass of tools.base.Tool")
  if not cls.tag:
    raise AsearcherError(f"tool {name!r}: {cls.__name__} sets no tag")
  if name == "answer" or cls.tag == "answer":
    raise AsearcherError(f"tool {name!r}: 'answer' is the protocol's own tag")
  old = _TOOLS.get(name)
  if old is not None and old is not cls:
    raise AsearcherError(f"tool {name!r} is already registered as {old.__module__}.{old.__name__}")
  _TOOLS[name] = cls
  return cls


def load_class(spec: str, base: type, what: str) -> type:
  """The class a `"module:Class"` string names, imported now, checked to subclass `base`."""
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise AsearcherError(f"{what} {spec!r}: expected a registered name or 'module:Class'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise AsearcherError(f"{what} {spec!r}: cannot import {module_name} ({e})") from e
  obj: Any = module
  for part in attr.split("."):
    obj = getattr(obj, part, None)
    if obj is None:
      raise AsearcherError(f"{what} {spec!r}: {module_name} has no {attr}")
  if not (isinstance(obj, type) and issubclass(obj, base)):
    raise AsearcherError(f"{what} {spec!r}: {attr} is not a subclass of {base.__name__}")
  return obj


def resolve(spec: str) -> type[Tool]:
  """A tool class by registered name, or by `"module:Class"` (registered under its tag on first
  use, so views and counters know it from then on)."""
  _builtins()
  if spec in _TOOLS:
    return _TOOLS[spec]
  if ":" not in spec:
    raise AsearcherError(f"tool must be one of {sorted(_TOOLS)} or 'module:Class', got {spec!r}")
  cls = load_class(spec, Tool, "tool")
  if _TOOLS.get(cls.tag) is not cls:
    register(cls.tag, cls)
  return cls


def get(tag: str) -> type[Tool] | None:
  """The registered tool class that writes `tag`, or None (a tag nobody registered)."""
  _builtins()
  for cls in _TOOLS.values():
    if cls.tag == tag:
      return cls
  return None


def tags() -> tuple[str, ...]:
  """Every registered tool's tag, in registration order (built-ins first)."""
  _builtins()
  return tuple(dict.fromkeys(cls.tag for cls in _TOOLS.values()))


def stat_names() -> dict[str, str]:
  """tag -> the name of its per-episode call count in evaluation stats ("searches", ...)."""
  _builtins()
  return {cls.tag: cls.stat_name or f"{cls.tag}_calls" for cls in _TOOLS.values()}


def build(spec: str | Tool) -> Tool:
  """A tool instance: an instance as given, or a class by name / `"module:Class"` built with its
  defaults (a tool that needs arguments is given as an instance, e.g. from gin)."""
  _builtins()
  if isinstance(spec, Tool):
    if _TOOLS.get(spec.tag) is None:
      register(spec.tag, type(spec))
    return spec
  if not isinstance(spec, str):
    raise AsearcherError(f"a tool is a name, 'module:Class' or a Tool, got {type(spec).__name__}")
  return resolve(spec)()
