"""QA sets in the formats the community ships, read into one schema with stable ids.

Readers accept what people actually have on disk: ASearcher's test-data layout
(`{data_dir}/{name}/{split}.jsonl` with `question` and `answer` or `gt`) and training sets
(`question`, `answer`, `source`, `aug_answer`, `qid`: nothing dropped), FlashRAG rows
(`golden_answers`), verl rows (`prompt` messages, `reward_model.ground_truth`, `extra_info`) in
JSON lines or in Parquet (Search-R1's merged `test.parquet`: one file for its seven sets, a row's
`data_source` naming its set),
HotpotQA / 2Wiki / MuSiQue records (`_id`, `answer`, `answer_aliases`), TriviaQA (`answer.aliases`),
FRAMES (`Prompt`/`Question`, `Answer`), Bamboogle (CSV or JSON), StrategyQA (boolean answers) and
xbench's encrypted CSV (decrypted in memory only; such examples are marked `sensitive` so nothing
downstream stores or prints their text). Files may be gzip-compressed.

Every problem is a `DatasetError` naming the file and the line, because a 7,000-line file with one
bad row is otherwise a needle in a haystack.
"""

from __future__ import annotations

import ast
import base64
import csv
import dataclasses
import gzip
import io
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from asearcher_jax import storage
from asearcher_jax.errors import AsearcherError

_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "qa"

# Shipped sets (see DATA_LICENSES.md): name -> file under asearcher_jax/assets/qa.
SHIPPED: dict[str, str] = {
  "hotpotqa_train100": "hipporag_hotpotqa_train100.json.gz",
  "hotpotqa_dev300": "agenticrag_hotpotqa_dev_head300.jsonl.gz",
  "bamboogle": "agenticrag_bamboogle_test.jsonl.gz",
  "nq300": "agenticrag_nq_test_head300.jsonl.gz",
  "nq17": "flashrag_nq_test16.jsonl.gz",
  "musique300": "agenticrag_musique_dev_head300.jsonl.gz",
  "2wiki500": "simpledeepsearcher_2wiki500.json.gz",
  "frames": "simpledeepsearcher_frames.json.gz",
  "strategyqa": "fireact_strategyqa_dev.json.gz",
  "xbench_deepsearch_2505": "xbench_deepsearch_2505.encrypted.csv.gz",
  "xbench_deepsearch_2510": "xbench_deepsearch_2510.encrypted.csv.gz",
}

# Field names tried in order; dotted names reach into nested objects.
_ID_FIELDS = ("id", "_id", "qid", "question_id", "extra_info.index", "Unnamed: 0")
_QUESTION_FIELDS = ("question", "Question", "Prompt", "query", "extra_info.question", "prompt")
_ANSWER_FIELDS = (
  "golden_answers",
  "answers",
  "answer",
  "Answer",
  "gt",
  "extra_info.answer",
  "reward_model.ground_truth",
)
_ALIAS_FIELDS = ("answer_aliases", "aliases", "aug_answer")

# The seven sets Search-R1 evaluates on, by the names its `data_source` column and FlashRAG's
# dataset directories (RUC-NLPIR/FlashRAG_datasets: `{name}/{split}.jsonl`) both use.
SEARCH_R1_SOURCES = (
  "nq",
  "triviaqa",
  "popqa",
  "hotpotqa",
  "2wikimultihopqa",
  "musique",
  "bamboogle",
)


class DatasetError(AsearcherError):
  """A QA file is missing, unreadable or holds a bad record; the message names file and line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QAExample:
  """One question, whatever file it came from.

  Attributes:
    id: stable id: the record's own id when it has one, else its 0-based row index.
    question: the question text.
    answers: gold answers and aliases (any of them counts as correct), never empty.
    dataset: name of the set it belongs to (keys results and reports).
    source: "file:line" it was read from.
    sensitive: decrypted in memory from an encrypted file (xbench): never store or print the
      question, the answers or anything derived from them.
  One record type serves evaluation and training alike (`load_training_qa`).
  """

  id: str
  question: str = dataclasses.field(repr=False)
  answers: tuple[str, ...] = dataclasses.field(repr=False)
  dataset: str
  source: str = ""
  sensitive: bool = False
  # Training extras (ASearcher's QA files): alternative answers blended into the reward, whether
  # the question is "valid-instructed" (answering "invalid" is penalised), and its kind (SynthWiki
  # "chain-2", HotpotQA type-level) for the curriculum.
  aug_answers: tuple[str, ...] = ()
  valid_inst: bool = False
  bucket: str = ""
  # The record's own `source` field (ASearcher's 35k sets and SimpleDeepSearcher rows: the upstream
  # set a question came from), kept for per-source reports; "" when the record has none.
  origin: str = ""


def _open_text(path: Path) -> str:
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DatasetError(f"cannot read QA file {path}: {e.strerror or e}") from None
  if path.suffix == ".gz":
    try:
      raw = gzip.decompress(raw)
    except (OSError, EOFError) as e:
      raise DatasetError(f"{path}: not a valid gzip file ({e})") from None
  try:
    return raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise DatasetError(f"{path}: not UTF-8 text ({e})") from None


def _base_suffix(path: Path) -> str:
  """The format suffix with any .gz stripped: '.jsonl', '.json' or '.csv'."""
  return Path(path.name.removesuffix(".gz")).suffix.lower()


def _line_of(text: str, pos: int, cache: list[int]) -> int:
  """1-based line of character `pos`; `cache` holds (last_pos, last_line) for linear scans."""
  last_pos, last_line = cache
  line = last_line + text.count("\n", last_pos, pos)
  cache[:] = [pos, line]
  return line


def _iter_jsonl(path: Path, text: str) -> Iterator[tuple[int, Any]]:
  for n, line in enumerate(storage.jsonl_lines(text), 1):
    if not line.strip():
      continue
    try:
      yield n, json.loads(line)
    except json.JSONDecodeError as e:
      raise DatasetError(f"{path}:{n}: broken JSON line ({e.msg} at column {e.colno})") from None


def _iter_json_array(path: Path, text: str) -> Iterator[tuple[int, Any]]:
  """Records of a top-level JSON list, each with the line it starts on."""
  decoder = json.JSONDecoder()
  cache = [0, 1]

  def skip(pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
      pos += 1
    return pos

  def fail(pos: int, what: str) -> DatasetError:
    return DatasetError(f"{path}:{_line_of(text, pos, cache)}: broken JSON ({what})")

  pos = skip(0)
  if pos >= len(text) or text[pos] != "[":
    if text[pos : pos + 1] == "{":
      raise DatasetError(
        f"{path}:1: expected a JSON list of records (or JSON lines), got an object"
      )
    raise fail(pos, "expected '['")
  pos = skip(pos + 1)
  if text[pos : pos + 1] == "]":
    return
  while True:
    try:
      obj, end = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as e:
      raise DatasetError(f"{path}:{e.lineno}: broken JSON ({e.msg} at column {e.colno})") from None
    yield _line_of(text, pos, cache), obj
    pos = skip(end)
    if text[pos : pos + 1] == ",":
      pos = skip(pos + 1)
    elif text[pos : pos + 1] == "]":
      if skip(pos + 1) < len(text):
        raise fail(skip(pos + 1), "trailing data after the list")
      return
    else:
      raise fail(pos, "expected ',' or ']' between records")


def xor_decrypt(ciphertext_b64: str, key: str) -> str:
  """xbench's scheme: base64, then XOR with the row's canary (UTF-8 bytes, cycled)."""
  data = base64.b64decode(ciphertext_b64)
  k = key.encode("utf-8")
  return bytes(b ^ k[i % len(k)] for i, b in enumerate(data)).decode("utf-8")


def _iter_csv(path: Path, text: str) -> Iterator[tuple[int, Any]]:
  reader = csv.DictReader(io.StringIO(text))
  try:
    for row in reader:
      line = reader.line_num
      if "canary" in row and row.get("canary"):
        try:
          row = {
            **row,
            "prompt": xor_decrypt(row.get("prompt") or "", row["canary"]),
            "answer": xor_decrypt(row.get("answer") or "", row["canary"]),
            "__sensitive__": True,
          }
        except (ValueError, UnicodeDecodeError):
          raise DatasetError(f"{path}:{line}: cannot decrypt the row with its canary") from None
      yield line, row
  except csv.Error as e:
    raise DatasetError(f"{path}:{reader.line_num}: broken CSV ({e})") from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
  """Rows of a Parquet file as dicts (nested structs and lists as Python ones), numbered from 1.

  pyarrow (requirements.txt) is imported here only, so the other formats never pay for it.
  """
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
  try:
    table = pq.read_table(path)
  except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
    raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
  yield from enumerate(table.to_pylist(), 1)


def _get(row: Mapping[str, Any], dotted: str) -> Any:
  cur: Any = row
  for part in dotted.split("."):
    if not isinstance(cur, Mapping) or part not in cur:
      return None
    cur = cur[part]
  return cur


def _answer_list(value: Any) -> list[str]:
  """A gold value (string, list, bool, number, {"target": [...]}, {"aliases": ...}) as strings."""
  if value is None:
    return []
  if isinstance(value, bool):  # StrategyQA; the metrics map yes/no
    return ["yes" if value else "no"]
  if isinstance(value, int | float):
    return [str(value)]
  if isinstance(value, str):
    s = value.strip()
    if s.startswith("[") and s.endswith("]"):  # SimpleDeepSearcher writes "['a', 'b']"
      try:
        parsed = ast.literal_eval(s)
      except (ValueError, SyntaxError):
        parsed = None
      if isinstance(parsed, list):
        return _answer_list(parsed)
    return [value] if s else []
  if isinstance(value, Mapping):  # Search-R1 {"target": [...]}, TriviaQA {"value", "aliases"}
    out: list[str] = []
    for key in ("target", "value", "normalized_value", "aliases"):
      out += _answer_list(value.get(key))
    return out
  if isinstance(value, list | tuple):
    return [a for v in value for a in _answer_list(v)]
  return []


def _question(row: Mapping[str, Any]) -> str | None:
  for name in _QUESTION_FIELDS:
    value = _get(row, name)
    if isinstance(value, str) and value.strip():
      return value.strip()
    if name == "prompt" and isinstance(value, list):  # verl: chat messages, last user turn
      users = [
        m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"
      ]
      if users and isinstance(users[-1], str) and users[-1].strip():
        return users[-1].strip()
  return None


def _dedup(items: list[str]) -> tuple[str, ...]:
  seen: dict[str, None] = {}
  for a in items:
    a = str(a).strip()
    if a:
      seen.setdefault(a, None)
  return tuple(seen)


def _record_id(row: Mapping[str, Any], index: int) -> str:
  """The record's own id (`id`, `_id`, ASearcher's `qid`, ...), else its 0-based row index."""
  raw_id = next((_get(row, n) for n in _ID_FIELDS if _get(row, n) not in (None, "")), None)
  return str(raw_id) if raw_id is not None else str(index)


def _origin(row: Mapping[str, Any]) -> str:
  value = row.get("source")
  return value.strip() if isinstance(value, str) else ""


def parse_record(row: Any, *, where: str, index: int, dataset: str) -> QAExample:
  """One record in any supported format; `where` ("file:line") goes into every error."""
  if not isinstance(row, Mapping):
    raise DatasetError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
  question = _question(row)
  if question is None:
    raise DatasetError(
      f"{where}: missing field 'question' (looked for {', '.join(_QUESTION_FIELDS)})"
    )
  answers: list[str] = []
  for name in _ANSWER_FIELDS:
    answers = _answer_list(_get(row, name))
    if answers:
      break
  else:
    raise DatasetError(f"{where}: missing field 'answer' (looked for {', '.join(_ANSWER_FIELDS)})")
  for name in _ALIAS_FIELDS:
    answers += _answer_list(_get(row, name))
  return QAExample(
    id=_record_id(row, index),
    question=question,
    answers=_dedup(answers),
    dataset=dataset,
    source=where,
    sensitive=bool(row.get("__sensitive__")),
    origin=_origin(row),
  )


def load_qa_file(
  path: str | Path, *, name: str | None = None, data_source: str | None = None
) -> list[QAExample]:
  """All records of a .jsonl / .json / .csv file (optionally .gz) or a .parquet file, ids checked
  for duplicates; a gs:// file is read from the local cache (`storage.local_copy`).
  `data_source`: only the rows whose `data_source` is that (Search-R1's merged files hold every
  set, their ids restarting at test_0 in each)."""
  path = Path(storage.local_copy(path, what="questions"))
  dataset = name or data_source or path.name.split(".")[0]
  suffix = _base_suffix(path)
  text = "" if suffix == ".parquet" else _open_text(path)
  if suffix == ".parquet":
    if path.name.endswith(".gz"):
      raise DatasetError(f"{path}: Parquet compresses itself; give the .parquet file")
    records = _iter_parquet(path)
  elif suffix == ".jsonl":
    records = _iter_jsonl(path, text)
  elif suffix == ".json":
    stripped = text.lstrip()
    # Some ".json" files are JSON lines in disguise; a list starts with "[".
    records = _iter_json_array(path, text) if stripped.startswith("[") else _iter_jsonl(path, text)
  elif suffix == ".csv":
    records = _iter_csv(path, text)
  else:
    raise DatasetError(
      f"{path}: unknown QA file type {suffix!r} (want .jsonl, .json, .csv or .parquet)"
    )
  if data_source is not None:
    records = ((n, r) for n, r in records if _source_of(r, f"{path}:{n}") == data_source)
  out: list[QAExample] = []
  first_line: dict[str, int] = {}
  for index, (line, row) in enumerate(records):
    ex = parse_record(row, where=f"{path}:{line}", index=index, dataset=dataset)
    if ex.id in first_line:
      raise DatasetError(
        f"{path}:{line}: duplicate id {ex.id!r} (first on line {first_line[ex.id]})"
      )
    first_line[ex.id] = line
    out.append(ex)
  if not out:
    if data_source is not None:
      raise DatasetError(f"{path}: no rows with data_source {data_source!r}")
    raise DatasetError(f"{path}: no records")
  return out


def _source_of(row: Any, where: str) -> str:
  if not isinstance(row, Mapping) or not isinstance(row.get("data_source"), str):
    raise DatasetError(f"{where}: no 'data_source' string (a Search-R1 row names its set there)")
  return row["data_source"]


def load_search_r1(path: str | Path, source: str) -> list[QAExample]:
  """One of Search-R1's sets out of its merged file (`scripts/data_process/qa_search_test_merge.py`
  writes every set into one `test.parquet`: FlashRAG's columns `id`, `question` (with a '?'
  appended when missing), `golden_answers`, plus `data_source`, `prompt` (the templated chat
  message), `ability`, `reward_model.ground_truth.target` and `extra_info.{split,index}`)."""
  return load_qa_file(path, name=source, data_source=source)


def load_asearcher_layout(data_dir: str | Path, name: str, split: str = "test") -> list[QAExample]:
  """ASearcher's test-data layout and FlashRAG's (RUC-NLPIR/FlashRAG_datasets): both are
  `{data_dir}/{name}/{split}.jsonl` (or `.json`, `.parquet`)."""
  base = Path(data_dir) / name
  for suffix in (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet"):
    path = base / f"{split}{suffix}"
    if path.exists():
      return load_qa_file(path, name=name)
  raise DatasetError(f"no {split}.jsonl or {split}.json in {base}")


def dataset_problem(
  spec: str, *, data_dir: str | Path | None = None, split: str = "test"
) -> str | None:
  """Why `load_dataset` would refuse `spec` before reading a record (`asearcher eval --check`
  asks before any model loads), or None when it names a shipped set, a file, a directory under
  `data_dir` or a set of Search-R1's merged `{data_dir}/{split}.parquet`."""
  if spec in SHIPPED or storage.is_url(spec) or Path(spec).is_file():
    return None
  if data_dir is not None and (Path(data_dir) / spec).is_dir():
    return None
  merged = Path(data_dir) / f"{split}.parquet" if data_dir is not None else None
  if merged is not None and spec in SEARCH_R1_SOURCES and merged.is_file():
    return None
  where = f" or a directory under {data_dir}" if data_dir is not None else ""
  return f"unknown dataset {spec!r}: not a shipped set ({', '.join(SHIPPED)}), a file{where}"


def load_dataset(
  spec: str, *, data_dir: str | Path | None = None, split: str = "test", limit: int | None = None
) -> list[QAExample]:
  """A dataset by shipped name (see SHIPPED), by file path, or by name under `data_dir`: a
  directory `{data_dir}/{spec}/` (ASearcher's and FlashRAG's layout), or a set of Search-R1's
  merged `{data_dir}/{split}.parquet` (spec one of SEARCH_R1_SOURCES).

  `limit` keeps the first N questions (file order), so a subsample is the same on every run.
  """
  if problem := dataset_problem(spec, data_dir=data_dir, split=split):
    raise DatasetError(problem)
  merged = Path(data_dir) / f"{split}.parquet" if data_dir is not None else None
  if spec in SHIPPED:
    examples = load_qa_file(_ASSETS / SHIPPED[spec], name=spec)
  elif storage.is_url(spec) or Path(spec).is_file():
    examples = load_qa_file(spec)
  elif data_dir is not None and (Path(data_dir) / spec).is_dir():
    examples = load_asearcher_layout(data_dir, spec, split)
  else:
    examples = load_search_r1(merged, spec)
  if limit is not None:
    if limit < 1:
      raise DatasetError(f"limit must be >= 1, got {limit}")
    examples = examples[:limit]
  return examples


DEFAULT_TRAINING_QA = Path(__file__).resolve().parents[1] / "assets" / "qa"
DEFAULT_TRAINING_QA = DEFAULT_TRAINING_QA / "hipporag_hotpotqa_train100.json.gz"


def load_training_qa(
  path: str | Path | None = None, *, limit: int | None = None
) -> list[QAExample]:
  """RL questions from a .json / .json.gz list or .jsonl(.gz) file: HotpotQA's, SynthWiki's and
  ASearcher's released training sets (`ASearcher-Base-35k.jsonl`: `question`, `answer` (a list),
  `source`, `aug_answer` (a list), `qid`). Default: the shipped HotpotQA-100.

  Alternative answers (`aug_answer`, or `aug_answers`) stay apart from the gold answers because
  the reward blends them at a lower weight; the record's id (`qid`, `id`, `_id`, ...) is kept so
  logs and replays name the question the way the released data does (duplicates are allowed:
  group keys come from the data cursor, not the id).
  A gs:// file is read from the local cache (`storage.local_copy`).
  """
  path = Path(storage.local_copy(path, what="questions")) if path else DEFAULT_TRAINING_QA
  if path.is_dir():
    raise DatasetError(f"{path} is a directory, not a QA file (.json / .jsonl, optionally .gz)")
  text = _open_text(path)
  stem = path.name.removesuffix(".gz")
  lines = _iter_jsonl(path, text) if stem.endswith(".jsonl") else _iter_json_array(path, text)
  items = []
  for i, (line, r) in enumerate(lines):
    if limit is not None and i >= limit:
      break
    if not isinstance(r, dict):
      raise DatasetError(f"{path}:{line}: a record must be a JSON object, got {type(r).__name__}")
    if not isinstance(r.get("question"), str):
      raise DatasetError(f"{path}:{line}: no 'question' string in the record")
    answers = _dedup(_answer_list(r.get("answers", r.get("answer"))))
    if not answers:
      raise DatasetError(f"{path}:{line}: no 'answer' (str) or 'answers' (list) in the record")
    aug = _answer_list(r.get("aug_answer")) + _answer_list(r.get("aug_answers"))
    items.append(
      QAExample(
        id=_record_id(r, i),
        question=str(r["question"]),
        answers=answers,
        dataset=stem.split(".")[0],
        source=f"{path}:{line}",
        aug_answers=_dedup(aug),
        bucket=_bucket(r),
        origin=_origin(r),
      )
    )
  if not items:
    raise DatasetError(f"no questions in {path}")
  return items


def _bucket(record: dict) -> str:
  """The curriculum bucket of a QA record: its `bucket` field, else what the common formats say
  about the kind of question (SynthWiki: kind and hops; HotpotQA: type and level)."""
  if record.get("bucket"):
    return str(record["bucket"])
  return "-".join(str(record[k]) for k in ("kind", "hops", "type", "level") if k in record)
