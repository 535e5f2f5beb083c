"""`asearcher SUBCOMMAND --help`, generated from the code so it cannot drift from it.

A subcommand is a keyword-only function; its parameters are documented in its docstring's
`Args:` section and its nested config dataclasses document each field with the comment above it
(or an `Attributes:` docstring entry). The help lists every gin-bindable name (`index.build_index.k1`,
`engine.EngineConfig.max_slots`) with its default and that one-line meaning, plus the gin files
the subcommand reads by default. The one-line summaries of `asearcher --help` are the modules' first docstring
lines, read from source without importing it, so the global help stays fast.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Param:
  """One bindable name: `selector.name`, its default (as gin would write it) and its meaning."""

  selector: str
  name: str
  default: str
  meaning: str


def summary(target: str) -> str:
  """The first sentence of the subcommand module's docstring (read from source, not imported),
  without its "`asearcher name ARGS`:" prefix."""
  spec = importlib.util.find_spec(target.split(":")[0])
  if spec is None or spec.origin is None:
    return ""
  doc = (ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or "").strip()
  paragraph = " ".join(doc.split("\n\n")[0].split())
  paragraph = re.sub(r"^`asearcher [\w-]+[^`]*`: ", "", paragraph)
  m = re.match(r"(.+?[.?!])(\s|$)", paragraph)
  return m.group(1) if m else paragraph


def _short_selector(obj: Any, names: dict[str, str] | None = None) -> str:
  """How a binding names an object: the name its module is imported under (`names`, from
  `module_names`; else the module's last component), then its qualified name."""
  module = (names or {}).get(obj.__module__) or obj.__module__.rsplit(".", 1)[-1]
  return f"{module}.{obj.__qualname__}"


_IMPORT = re.compile(r"\s*from\s+([\w.]+)\s+import\s+(\w+)(?:\s+as\s+(\w+))?\s*(?:#.*)?$")


def file_imports(gin_files: list[Path]) -> list[tuple[str, str]]:
  """(module, name it is bound to) for each `from a.b import c [as d]` of the gin files, in
  reading order (gin's dynamic registration imports are all of this form)."""
  out = []
  for path in gin_files:
    for line in path.read_text().splitlines():
      m = _IMPORT.match(line)
      if m and m.group(1) != "__gin__":
        out.append((f"{m.group(1)}.{m.group(2)}", m.group(3) or m.group(2)))
  return out


def module_names(fn: Callable[..., Any], imports: list[tuple[str, str]]) -> dict[str, str]:
  """Module -> the name a binding writes it under, for the subcommand's module and the module of
  every config class reachable from it: the name the gin files import it under where they do
  (so a flag and a file name one configurable alike, e.g. `commands.sft` in gin/runs/sft.gin),
  else its last component, else (that name taken by another module) its last two joined."""
  names: dict[str, str] = {}
  taken: dict[str, str] = {}
  for module, name in imports:
    names.setdefault(module, name)
    taken.setdefault(name, module)
  for module in dict.fromkeys([fn.__module__, *(c.__module__ for c in builders(fn))]):
    if module in names:
      continue
    name = module.rsplit(".", 1)[-1]
    if taken.get(name, module) != module:
      name = "_".join(module.split(".")[-2:])
    names[module] = name
    taken[name] = module
  return names


def _docstring_entries(doc: str | None, section: str) -> dict[str, str]:
  """`name: text` entries of a Google-style docstring section (continuations joined)."""
  entries: dict[str, str] = {}
  if not doc:
    return entries
  lines = inspect.cleandoc(doc).splitlines()
  try:
    start = next(i for i, line in enumerate(lines) if line.strip() == f"{section}:")
  except StopIteration:
    return entries
  current = None
  indent = None
  for line in lines[start + 1 :]:
    if not line.strip():
      continue
    width = len(line) - len(line.lstrip())
    m = re.match(r"\s*(\w+(?:(?:, | / )\w+)*)( \(.*?\))?: (.*)", line)
    if indent is None:
      indent = width
    if width < indent or (width == 0 and not m):
      break
    if m and width == indent:
      current = re.split(r", | / ", m.group(1))  # "a, b: text" documents both
      for name in current:
        entries[name] = m.group(3).strip()
    elif current is not None:
      for name in current:
        entries[name] += " " + line.strip()
  return entries


def _field_comments(cls: type) -> dict[str, str]:
  """Per dataclass field: the `#` comment lines just above it (or trailing it), else its entry
  in the class docstring's `Attributes:` section."""
  out = _docstring_entries(cls.__doc__, "Attributes")
  try:
    lines, _ = inspect.getsourcelines(cls)
  except (OSError, TypeError):
    return out
  tree = ast.parse(textwrap.dedent("".join(lines)))
  body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
  group, group_end = "", -2  # a comment above consecutive fields speaks of all of them
  for node in body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    i = node.lineno - 1  # 0-based line of the field in `lines`
    above = []
    j = i - 1
    while j >= 0 and lines[j].strip().startswith("#"):
      above.insert(0, lines[j].strip().lstrip("#").strip())
      j -= 1
    trailing = lines[i].split("  # ", 1)[1].strip() if "  # " in lines[i] else ""
    if above:
      group = " ".join(above)
    elif group_end != i - 1:
      group = ""  # a blank line or other code ends the group
    text = " ".join(above) or trailing or group
    if text:
      out[node.target.id] = text
    group_end = (node.end_lineno or node.lineno) - 1
  return out


def _first_sentence(text: str, width: int = 100) -> str:
  text = " ".join(text.split())
  end = text.find(". ")
  text = text if end < 0 else text[: end + 1]
  return text if len(text) <= width else text[: width - 3] + "..."


def _dataclass_types(annotation: Any) -> Iterator[type]:
  """Project config dataclasses inside an annotation (`X`, `X | None`, `tuple[X, ...]`)."""
  if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
    if annotation.__module__.startswith("asearcher_jax."):
      yield annotation
    return
  for arg in typing.get_args(annotation):
    yield from _dataclass_types(arg)


def _hints(obj: Any) -> dict[str, Any]:
  try:
    return typing.get_type_hints(obj)
  except Exception:  # an annotation that names a type only imported for type checkers
    return {}


def _format_default(value: Any, names: dict[str, str] | None = None) -> str:
  if value is inspect.Parameter.empty or value is dataclasses.MISSING:
    return "(required)"
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return f"@{_short_selector(type(value), names)}()"
  return repr(value)


def _default(f: dataclasses.Field) -> Any:
  if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return f.default


def builders(fn: Callable[..., Any]) -> dict[type, tuple[Any, str]]:
  """Each config dataclass reachable from a subcommand's parameters (in the order first met) ->
  the (function or class, parameter) that first holds one: a class's own bindings take effect
  only where gin builds it, i.e. where that parameter is bound to `@Class()`."""
  found: dict[type, tuple[Any, str]] = {}
  queue: list[tuple[type, Any, str]] = []
  hints = _hints(fn)
  for name, p in inspect.signature(fn).parameters.items():
    queue += [(c, fn, name) for c in _dataclass_types(hints.get(name))]
    if dataclasses.is_dataclass(p.default) and not isinstance(p.default, type):
      queue.append((type(p.default), fn, name))
  while queue:
    cls, owner, field = queue.pop(0)
    if cls in found:
      continue
    found[cls] = (owner, field)
    cls_hints = _hints(cls)
    for f in dataclasses.fields(cls):
      if f.init:
        queue += [(c, cls, f.name) for c in _dataclass_types(cls_hints.get(f.name))]
  return found


def parameters(fn: Callable[..., Any], names: dict[str, str] | None = None) -> list[Param]:
  """Every bindable name of a subcommand: its own keyword arguments, then the fields of each
  config dataclass reachable from them (each class once, in the order first met), named as
  `names` (from `module_names`) says."""
  selector = _short_selector(fn, names)
  meanings = _docstring_entries(fn.__doc__, "Args")
  out = [
    Param(selector, n, _format_default(p.default, names), _first_sentence(meanings.get(n, "")))
    for n, p in inspect.signature(fn).parameters.items()
  ]
  for cls in builders(fn):
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
      if f.init:
        out.append(Param(_short_selector(cls, names), f.name, _format_default(_default(f), names),
                         _first_sentence(comments.get(f.name, ""))))  # fmt: skip
  return out


def _built(gin_files: list[Path], imports: list[tuple[str, str]]) -> set[tuple[str, str]]:
  """(module, qualified name) of each configurable the gin files reference as `@name.Qual`."""
  by_name = {name: module for module, name in reversed(imports)}  # the first import wins
  out = set()
  for path in gin_files:
    for ref in re.findall(r"@(?:[\w.]+/)?([\w.]+)", path.read_text()):
      alias, _, qualname = ref.partition(".")
      if alias in by_name:
        out.add((by_name[alias], qualname))
  return out


def command_help(name: str, target: str, gin_files: list[Path], repo_root: Path,
                 *, default: bool = True,
                 bound: dict[tuple[str, str], str] | None = None) -> str:  # fmt: skip
  """The full `asearcher NAME --help` text, naming each parameter as a binding must write it with
  `gin_files` read (the subcommand's defaults unless `default` is False). `bound`: the values
  those files bind, by (the selector's last two names, parameter); each is shown in place of
  the code's default (which follows it in the meaning), so `train RECIPE --help` shows the
  recipe's run, not the smoke run's."""
  module_name, fn_name = target.split(":")
  fn = getattr(importlib.import_module(module_name), fn_name)
  doc = inspect.cleandoc(fn.__doc__ or "").split("\n\nArgs:")[0].strip()
  lines = [f"usage: asearcher {name} [--gin_file FILE]... [--gin_param BINDING]... "
           "[--print_config] [--log_level LEVEL]", "", doc, ""]  # fmt: skip
  if gin_files:
    shown = [str(p.relative_to(repo_root)) if p.is_relative_to(repo_root) else str(p)
             for p in gin_files]  # fmt: skip
    label = "default gin files (used when no --gin_file is given)" if default else "gin files"
    lines.append(f"{label}: " + ", ".join(shown))
  else:
    lines.append("default gin files: none (every parameter keeps the default below)")
  lines += ["", "parameters (bind with --gin_param='SELECTOR.NAME = VALUE' or in a gin file):"]
  imports = file_imports(gin_files)
  names = module_names(fn, imports)
  built, owners = _built(gin_files, imports), builders(fn)
  params = parameters(fn, names)
  bound = bound or {}
  for i, p in enumerate(params):
    value = bound.get((".".join(p.selector.split(".")[-2:]), p.name))
    if value is not None and value != p.default:
      meaning = f"(default {p.default}) {p.meaning}".rstrip()
      params[i] = dataclasses.replace(p, default=value, meaning=meaning)
  width = min(max(len(f"{p.selector}.{p.name} = {p.default}") for p in params), 60)
  classes = {_short_selector(c, names): c for c in owners}
  for i, p in enumerate(params):
    cls = classes.get(p.selector)
    first = cls is not None and params[i - 1].selector != p.selector
    if first and (cls.__module__, cls.__qualname__) not in built:
      owner, field = owners[cls]
      lines.append(
        f"  ({p.selector}.* take effect once gin builds it: also bind "
        f"{_short_selector(owner, names)}.{field} = @{p.selector}())"
      )
    head = f"{p.selector}.{p.name} = {p.default}"
    if len(head) > width:
      lines.append(f"  {head}")
      if p.meaning:
        lines.append(f"  {'':{width}}  {p.meaning}")
    else:
      lines.append(f"  {head:{width}}  {p.meaning}".rstrip())
  return "\n".join(lines)


def gin_includes(path: Path, search: tuple[Path, ...]) -> list[Path]:
  """`path` and the files it includes (recursively, in reading order), resolved like gin does."""
  out = [path]
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise OSError(f"{path}: not UTF-8 text (byte {e.start})") from None
  for line in text.splitlines():
    m = re.match(r"\s*include\s+['\"](.+)['\"]", line)
    if not m:
      continue
    for base in search:
      candidate = Path(m.group(1)) if Path(m.group(1)).is_absolute() else base / m.group(1)
      if candidate.is_file():
        out += [p for p in gin_includes(candidate, search) if p not in out]
        break
  return out
