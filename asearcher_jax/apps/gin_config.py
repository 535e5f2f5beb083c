"""Parses and checks a subcommand's gin configuration before anything runs.

Every configuration mistake becomes one `ConfigError` line naming where it was made (file:line,
or the `--gin_param` flag): a gin syntax error, an unknown module, selector or parameter, a value
of the wrong type for the parameter's annotation, a value a config dataclass rejects (its
`__post_init__`), a required parameter left unbound. Types are checked against the annotations,
and bound config dataclasses are built once, here, so a typo costs no model load.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import json
import re
import subprocess
import sys
import tokenize
import types
import typing
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import gin
import gin.config
import gin.resource_reader

from asearcher_jax.apps import cli_help
from asearcher_jax.errors import AsearcherError


class ConfigError(Exception):
  """A configuration mistake, as one line that names where it was made."""


def check_elsewhere(
  argvs: Sequence[Sequence[str]], *, cwd: str | Path | None = None, timeout_s: float = 600.0
) -> list[str | None]:
  """Several `asearcher` command lines (argv without the program) checked in one child process
  (`asearcher --check-each`: the imports paid once, ~3 s, then ~20 ms each), so the caller
  (a sweep, the launcher) keeps its own gin state and loads no jax: for each, None or the line
  `--check` would end with. Raises AsearcherError when the checker itself fails."""
  lines = "".join(json.dumps(list(a)) + "\n" for a in argvs)
  try:
    out = subprocess.run([sys.executable, "-m", "asearcher_jax.main", "--check-each"],
                         input=lines, capture_output=True, text=True, timeout=timeout_s,
                         cwd=cwd)  # fmt: skip
  except subprocess.TimeoutExpired:
    raise AsearcherError(
      f"checking {len(argvs)} configurations took over {timeout_s:.0f} s"
    ) from None
  results = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
  if len(results) != len(argvs):
    last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
    raise AsearcherError(f"checking {len(argvs)} configurations failed: {last}")
  return results


MACRO = "gin.macro"  # the selector gin binds a macro's value under, scoped by its name

_LOCATION = re.compile(r'In file "(?P<file>[^"]+)", line (?P<line>\d+)')


def _one_line(e: BaseException) -> str:
  text = str(e).strip()
  if isinstance(e, tokenize.TokenError) and e.args:
    text = str(e.args[0])
  first = text.splitlines()[0] if text else type(e).__name__
  return first.rstrip(".") + _nearest(first)


_NO_PARAMETER = re.compile(
  r"Configurable '(?P<selector>[^']+)' doesn't have a parameter named '(?P<name>[^']+)'"
)
_NO_ATTRIBUTE = re.compile(
  r"Couldn't resolve selector \S+; <module '(?P<module>[^']+)'.* has no attribute (?P<name>\w+)"
)
_NO_CONFIGURABLE = re.compile(r"No configurable matching '(?P<selector>[^']+)'")


def _close(name: str, candidates: Collection[str]) -> str:
  found = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
  return f" (did you mean {found[0]!r}?)" if found else ""


def _nearest(message: str) -> str:
  """The nearest known name to an unknown parameter, selector or module attribute gin refused
  (difflib), as ` (did you mean 'x'?)`, or "" when nothing is close."""
  if m := _NO_PARAMETER.search(message):
    names: set[str] = set()
    for selector in gin.config._REGISTRY.matching_selectors(m.group("selector")):
      obj = gin.config._REGISTRY[selector].wrapped
      with contextlib.suppress(TypeError, ValueError):
        names |= set(inspect.signature(obj).parameters)
      if dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    return _close(m.group("name"), names)
  if m := _NO_ATTRIBUTE.search(message):
    module = sys.modules.get(m.group("module"))
    return (
      _close(m.group("name"), [a for a in dir(module) if not a.startswith("_")]) if module else ""
    )
  if m := _NO_CONFIGURABLE.search(message):
    wanted = m.group("selector").rsplit(".", 1)[-1]
    return _close(wanted, {s.rsplit(".", 1)[-1] for s in gin.config._REGISTRY})
  return ""


def _where(e: BaseException, source: str) -> str:
  """file:line from gin's location note or a SyntaxError, else the source being parsed."""
  m = _LOCATION.search(str(e))
  if m:
    return f"{m.group('file')}:{m.group('line')}"
  if isinstance(e, SyntaxError) and e.lineno:
    return f"{e.filename or source}:{e.lineno}"
  if isinstance(e, tokenize.TokenError) and len(e.args) > 1:
    return f"{source}:{e.args[1][0] - 1}"  # reported at the line after the open bracket ends
  return source


def use_package_paths(search: Sequence[Path]) -> None:
  """Gin looks files up in `search` (the working directory, then the repository root), with
  plain files only: its package-resource reader logs "Path not found" at ERROR for every
  directory a file is not in."""
  for path in search:
    gin.add_config_file_search_path(str(path))
  gin.config._FILE_READERS[:] = [  # gin has no public way to drop a reader
    r for r in gin.config._FILE_READERS if r[0] is not gin.resource_reader.system_path_reader
  ]


def parse(
  files: Sequence[str],
  params: Sequence[str],
  fn: Callable[..., Any],
  extra_modules: Sequence[str] = (),
) -> set[str]:
  """gin.parse_config_files_and_bindings, one source at a time so an error names its source.
  Each `--gin_param` is read with the files' imports plus the subcommand's module and the module
  of every config class its help lists, under the names the help gives them
  (`cli_help.module_names`), so a flag names things as the help and the gin files do; gin alone
  would read it without dynamic registration, where no such name exists; `extra_modules`
  (main's own configs: `distributed`, `compile_cache`) are imported under their last name too.
  Returns the macros the files (and their includes) define."""
  for f in files:
    try:
      gin.parse_config_file(f, skip_unknown=False)
    except Exception as e:  # gin raises whatever its parser or the imports raise
      raise ConfigError(f"{_where(e, f)}: {_one_line(e)}") from None
  file_macros = {scope for scope, selector in gin.config._CONFIG if selector == MACRO}
  statements = [s for s in gin.config._IMPORTS if not s.module.startswith("__gin__")]
  imports = sorted(s.format() for s in statements)  # the files' imports
  known = [(s.module, s.bound_name()) for s in statements if s.is_from]
  names = cli_help.module_names(fn, known)
  for module in extra_modules:
    if module not in names and module.rsplit(".", 1)[-1] not in names.values():
      names[module] = module.rsplit(".", 1)[-1]
  for module, name in names.items():
    if module not in {m for m, _ in known}:
      package, _, last = module.rpartition(".")
      imports.append(f"from {package} import {last}" + (f" as {name}" if name != last else ""))
  head = ["from __gin__ import dynamic_registration", *dict.fromkeys(imports)]
  for p in params:
    try:
      gin.parse_config([*head, p], skip_unknown=False)
    except Exception as e:
      raise ConfigError(f"--gin_param={p!r}: {_flag_message(p, e)}") from None
  try:
    gin.finalize()
  except ValueError as e:  # gin's macro hook: a %NAME nothing defines (message: the whole config)
    m = re.search(r"No bindings specified for '(?:(?P<name>[^']*)/)?gin\.macro'", str(e))
    if m is None:
      raise ConfigError(f"the configuration: {_one_line(e)}") from None
    name = m.group("name") or "?"
    raise ConfigError(f"{_macro_use(name, files, params)}: %{name} is used but nothing defines "
                      f"it (write `{name} = VALUE` in a gin file or --gin_param)") from None  # fmt: skip
  return file_macros


def _macro_use(name: str, files: Sequence[str], params: Sequence[str]) -> str:
  """Where `%name` is written: the flag, else file:line of a file given (or its include)."""
  use = re.compile(rf"%{re.escape(name)}(?![A-Za-z0-9_.])")
  for p in params:
    if use.search(p):
      return f"--gin_param={p!r}"
  for f in files:
    for path in [Path(f), *(Path(d) / f for d in gin.config._LOCATION_PREFIXES)]:
      if path.is_file():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
          if use.search(line.split("#", 1)[0]):
            return f"{path}:{i}"
        break
  return "the configuration"


def _flag_message(param: str, e: BaseException) -> str:
  """gin's message, or what it means where gin's own is a Python unpacking error (a selector of
  one name before the parameter, e.g. `long_horizon.run_dir` for `long_horizon.long_horizon.run_dir`)."""
  selector = param.split("=", 1)[0].strip().split("/")[-1]
  value = param.split("=", 1)[1].strip() if "=" in param else ""
  if "malformed node" in str(e):  # a bare word: quotes the shell ate, or none were written
    if not any(c in value for c in "'\"[](){},"):
      example = f"--gin_param='{selector}=\"{value}\"'"
      return f"{value} is not a value: a string needs quotes, e.g. {example}"
    return (f"{value} is not a value: each string in it needs quotes, and single quotes around "
            f"the whole flag keep the shell from removing them (--gin_param='{selector}=...')")  # fmt: skip
  if isinstance(e, ValueError) and "unpack" in str(e) and selector.count(".") < 2:
    return (f"{selector!r} is not MODULE.FUNCTION.PARAMETER or MODULE.CLASS.FIELD "
            "(`asearcher SUBCOMMAND --help` lists the names)")  # fmt: skip
  return _one_line(e)


def resolved(value: Any) -> Any:
  """A bound value with its `%MACRO`s replaced by their values (recursively, in lists, tuples
  and dicts); `@x.Y()` references stay references."""
  if isinstance(value, gin.config.ConfigurableReference):
    if value.configurable.selector == MACRO:
      return resolved(gin.query_parameter(f"%{value.scoped_selector.split('/')[0]}"))
    return value
  if isinstance(value, list | tuple):
    return type(value)(resolved(v) for v in value)
  if isinstance(value, dict):
    return {k: resolved(v) for k, v in value.items()}
  return value


def bindings() -> Iterator[tuple[str, str, Any]]:
  """(full selector, parameter, value with macros resolved) of every unscoped binding of the
  parsed configuration, macros themselves left out."""
  for (scope, selector), bound in gin.config._CONFIG.items():
    if scope or selector.startswith("gin."):
      continue
    for name, value in bound.items():
      yield selector, name, resolved(value)


def bound_values() -> dict[tuple[str, str], str]:
  """What the parsed configuration binds, as `asearcher SUBCOMMAND --help` shows it: keyed by
  (the selector's last two names, parameter), the value as a gin file writes it."""
  out = {}
  for selector, name, value in bindings():
    text = str(value) if isinstance(value, gin.config.ConfigurableReference) else repr(value)
    out[(".".join(selector.split(".")[-2:]), name)] = text
  return out


# --- checks after parsing -------------------------------------------------------------------------


def _resolve(selector: str) -> Any:
  """The object a full gin selector names: the registered configurable's (a dynamically
  registered one is keyed by its import alias, 'pkg.alias.Class'), else by import."""
  configurable = gin.config._REGISTRY.get(selector)
  if configurable is not None:
    return configurable.wrapped
  parts = selector.split(".")
  for i in range(len(parts) - 1, 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      obj = getattr(obj, attr, None)
    return obj
  return None


def locate(selector: str, name: str, files: Sequence[str], params: Sequence[str]) -> str:
  """Where `selector.name` (a macro: `name` alone, `selector` "") was bound last: the
  --gin_param flag, else file:line."""
  tail = selector.split(".") if selector else []

  def matches(written: str) -> bool:
    w = written.split("/")[-1].split(".")
    return w[-1] == name and tail[-len(w) + 1 :] == w[:-1]

  for p in reversed(params):
    if matches(p.split("=", 1)[0].strip()):
      return f"--gin_param={p!r}"
  found = None
  for f in files:
    path = next((Path(b) / f for b in gin.config._LOCATION_PREFIXES
                 if (Path(b) / f).is_file()), Path(f))  # fmt: skip
    if not path.is_file():
      continue
    for i, line in enumerate(path.read_text().splitlines(), 1):
      m = re.match(r"\s*([\w./]+)\s*=", line)
      if m and matches(m.group(1)):
        found = f"{f}:{i}"
  return found or "the configuration"


def _type_ok(value: Any, annotation: Any) -> bool:
  """Whether a bound value fits an annotation (gin references and macros are not checked)."""
  if annotation in (Any, object, inspect.Parameter.empty) or isinstance(
    value,
    gin.config.ConfigurableReference | gin.config._UnknownConfigurableReference,
  ):
    return True
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    return any(_type_ok(value, a) for a in args)
  if annotation is None or annotation is type(None):
    return value is None
  if origin is typing.Literal:
    return value in args
  if annotation is float:
    return isinstance(value, int | float) and not isinstance(value, bool)
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if origin in (tuple, list, collections.abc.Sequence):
    if isinstance(value, str) or not isinstance(value, list | tuple):
      return False
    if origin is tuple and args and args[-1] is not Ellipsis:
      return len(args) == len(value) and all(map(_type_ok, value, args))
    return not args or all(_type_ok(v, args[0]) for v in value)
  if origin in (dict, collections.abc.Mapping):
    return isinstance(value, dict)
  if isinstance(annotation, type):
    return isinstance(value, annotation)
  return True  # TypeVars, callables, protocols: not ours to judge


def _hints(obj: Any) -> dict[str, Any]:
  try:
    return typing.get_type_hints(obj)
  except Exception:
    return {}


def check(fn: Callable[..., Any], files: Sequence[str], params: Sequence[str],
          roots: Collection[str] = (), file_macros: Collection[str] = ()) -> None:  # fmt: skip
  """Type-checks every binding, checks its paths, builds every bound config dataclass once (its
  own checks run), checks that each binding reaches `fn` or one of `roots` ("module:qualname":
  what the caller builds through gin, and other subcommands, whose bindings a recipe shared by
  two processes holds) and that the subcommand's required parameters are bound."""
  config = dict(gin.config._CONFIG)  # ({(scope, selector): {name: value}})
  # Classes whose bindings reference no other configurable are built first, so a bad value is
  # reported at its own binding, not at the class that references its class.
  leaves_first = sorted(
    config.items(), key=lambda kv: any(True for v in kv[1].values() for _ in _references(v))
  )
  for (_, selector), bindings in leaves_first:
    obj = _resolve(selector)
    if obj is None or selector.startswith("gin."):
      continue
    hints = _hints(obj)
    short = ".".join(selector.split(".")[-2:])
    for name, value in bindings.items():
      if name in hints and not _type_ok(value, hints[name]):
        where = locate(selector, name, files, params)
        raise ConfigError(
          f"{where}: {short}.{name} = {value!r}: expected {_type_name(hints[name])}"
        )
      if problem := _value_problem(name, value):
        raise ConfigError(f"{locate(selector, name, files, params)}: {short}.{name}: {problem}")
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
      try:
        gin.get_configurable(obj)()
      except TypeError as e:
        if "required" in str(e):
          continue  # fields without defaults come from the code that builds it
        raise ConfigError(_at(e, selector, bindings, files, params, short)) from None
      except (ValueError, AsearcherError) as e:  # its own checks (`__post_init__`)
        raise ConfigError(_at(e, selector, bindings, files, params, short)) from None
  target = f"{fn.__module__}.{fn.__qualname__}"
  # gin keys a dynamically registered function by the alias its file imported it under
  # ('from asearcher_jax.apps import sweep as sweeping' -> 'asearcher_jax.apps.sweeping.sweep'),
  # so match by the object, or by the name where the alias path does not resolve.
  bound: set[str] = set()
  for (scope, selector), bindings in config.items():
    if scope or selector.rsplit(".", 1)[-1] != fn.__name__:
      continue
    if selector == target or _resolve(selector) in (fn, None):
      bound |= set(bindings)
  short = ".".join(target.split(".")[-2:])
  others = _functions_bound(config, fn)
  # A subcommand that reads other subcommands' recipes (`asearcher compile RECIPE.gin`) marks
  # itself `reads_recipes`: a file that binds only those is what it is given.
  if files and not bound and others and not getattr(fn, "reads_recipes", False):
    raise ConfigError(
      f"{', '.join(files)}: nothing here binds {short}; it configures {', '.join(others)} "
      "(another subcommand's gin file?)"
    )
  _check_reached(fn, roots, config, files, params, file_macros)
  for name, p in inspect.signature(fn).parameters.items():
    if p.default is inspect.Parameter.empty and name not in bound:
      raise ConfigError(
        f"{short}.{name} is required: bind it, e.g. --gin_param='{short}.{name} = ...'"
      )


def _reference_objects(value: Any) -> Iterator[gin.config.ConfigurableReference]:
  """Every `@x.Y()` / `%MACRO` in a bound value, in lists and dicts too."""
  if isinstance(value, gin.config.ConfigurableReference):
    yield value
  elif isinstance(value, list | tuple | set):
    for v in value:
      yield from _reference_objects(v)
  elif isinstance(value, dict):
    for v in value.values():
      yield from _reference_objects(v)


def _references(value: Any) -> Iterator[str]:
  """What a bound value references: a configurable's selector, or a macro's name as
  'NAME/gin.macro'."""
  for ref in _reference_objects(value):
    selector = ref.configurable.selector
    yield f"{ref.scoped_selector.split('/')[0]}/{selector}" if selector == MACRO else selector


def _scopes_referenced(value: Any) -> Iterator[str]:
  """The scopes a bound value's references enter (`@train/x.Y()` enters 'train')."""
  for ref in _reference_objects(value):
    if ref.configurable.selector != MACRO:
      yield from ref.scoped_selector.split("/")[:-1]


def _check_reached(fn: Callable[..., Any], roots: Collection[str], config: dict,
                   files: Sequence[str], params: Sequence[str],
                   file_macros: Collection[str]) -> None:  # fmt: skip
  """Every binding must be used: a class nothing builds through gin from the subcommand (or a
  root) would keep its defaults whatever is bound (a default instance in a signature is not
  gin's), and a macro nothing references (`run_dir = ...` for `inspect.inspect.run_dir = ...`)
  binds nothing; either is an error naming what to write instead."""
  start = {
    c.selector
    for obj, c in gin.config._INVERSE_REGISTRY.items()
    if obj is fn or f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}" in roots
  }
  key = {(scope, sel): f"{scope}/{sel}" if sel == MACRO else sel for scope, sel in config}
  reached, todo = set(start), list(start)
  while todo:
    found = todo.pop()
    for k, bindings in config.items():
      if key[k] == found:
        new = {r for v in bindings.values() for r in _references(v)} - reached
        reached |= new
        todo += new
  owners = cli_help.builders(fn)
  names = {s.module: s.bound_name() for s in gin.config._IMPORTS if s.is_from}
  entered = {x for b in config.values() for v in b.values() for x in _scopes_referenced(v)}
  for (scope, selector), bindings in config.items():
    unused = [part for part in scope.split("/") if part and part not in entered]
    if selector != MACRO and unused and bindings:
      name = next(iter(bindings))
      raise ConfigError(
        f"{locate(selector, name, files, params)}: {scope}/"
        f"{'.'.join(selector.split('.')[-2:])}.{name} is bound in scope "
        f"{unused[0]!r}, which no `@{unused[0]}/...` reference enters, so it would be ignored"
      )
    if key[(scope, selector)] in reached or not bindings:
      continue
    if selector == MACRO and scope not in file_macros:
      # A flag's macro nothing uses (a file's may be left unused by a flag binding over it).
      raise ConfigError(
        f"{locate('', scope, files, params)}: {scope} = {bindings.get('value')!r} binds a gin "
        "macro nothing uses; a parameter is written SELECTOR.NAME (`--help` lists them)"
      )
    if selector.startswith("gin."):
      continue
    obj = _resolve(selector)
    short = ".".join(selector.split(".")[-2:])
    name = next(iter(bindings))
    hint = ""
    if obj in owners:
      owner, field = owners[obj]
      owner_name = names.get(owner.__module__, owner.__module__.rsplit(".", 1)[-1])
      hint = f": also bind {owner_name}.{owner.__qualname__}.{field} = @{short}()"
    raise ConfigError(
      f"{locate(selector, name, files, params)}: {short}.{name} is bound but nothing builds "
      f"{short} through gin, so it would be ignored{hint}"
    )


def _functions_bound(config: dict, fn: Callable[..., Any]) -> list[str]:
  """The other `asearcher_jax.apps` functions the configuration binds (unscoped), as
  'module.function' (what a gin file meant for another subcommand configures)."""
  return sorted(
    f"{obj.__module__.rsplit('.', 1)[-1]}.{obj.__name__}"
    for (scope, sel) in config
    if not scope
    and inspect.isfunction(obj := _resolve(sel))
    and obj is not fn
    and obj.__module__.startswith("asearcher_jax.apps.")
  )


def _value_problem(name: str, value: Any) -> str:
  """Why a bound value can never work, or "": a port (`port`, `*_port`) outside 0-65535, a
  path under a regular file, a directory parameter (`*_dir`) that is a regular file."""
  if (name == "port" or name.endswith("_port")) and isinstance(value, int):
    return "" if 0 <= value <= 65535 else f"{value} is not a port (0-65535; 0: any free one)"
  if not isinstance(value, str | Path) or not str(value).strip():
    return ""
  if isinstance(value, str) and ("\n" in value or "://" in value or len(value) > 4096):
    return ""
  path = Path(value).expanduser()
  for parent in path.parents:
    if parent.is_file():
      return f"{str(value)!r} lies under {str(parent)!r}, which is a file, not a directory"
  if name.endswith("dir") and path.is_file():
    return f"{str(value)!r} is a file, not a directory"
  return ""


def _at(e: Exception, selector: str, bindings: dict, files: Sequence[str],
        params: Sequence[str], short: str) -> str:  # fmt: skip
  """One line for a value a config class rejected, at the binding its message names."""
  message = _one_line(e)
  named = (n for n in bindings if re.search(rf"\b{re.escape(n)}\b", message))
  name = next(named, next(iter(bindings), ""))
  return f"{locate(selector, name, files, params)}: {short}: {message}"


def _type_name(annotation: Any) -> str:
  if typing.get_origin(annotation) is typing.Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
  return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
