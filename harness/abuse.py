"""Clients that misbehave, for the project's HTTP servers: malformed requests derived from each
endpoint's valid body, oversized bodies, slow clients (slowloris) and floods.

The contract checked by the tests and `benchmarks/reliability.py`: a bad request gets a 4xx
(503 when the server sheds load), never a 5xx, never a hang, and the server still answers a
valid request afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections import Counter
from typing import Any

import aiohttp


@dataclasses.dataclass(frozen=True, kw_only=True)
class Endpoint:
  """A POST endpoint and one valid body for it (what malformed bodies are derived from)."""

  path: str
  valid: dict[str, Any]


_WEIRD: list[Any] = [
  None, True, -1, 0, 2**63, -(2**70), 1e308, -0.0, "", "x" * 5000, "\u0000\ud7ff\U0010ffff",
  [], [None], {}, {"a": {"b": [1, {"c": None}]}}, [[[[[[]]]]]], "NaN", ["\u202e", 3.5],
]  # fmt: skip


def malformed(valid: dict[str, Any], rng: random.Random) -> bytes:
  """One bad body: a field dropped, retyped or set to an extreme, an unknown field, the wrong
  top-level type, broken JSON, or bytes that are not UTF-8."""
  kind = rng.randrange(8)
  body = dict(valid)
  key = rng.choice(sorted(body)) if body else "x"
  if kind == 0:
    body.pop(key, None)
  elif kind == 1:
    body[key] = rng.choice(_WEIRD)
  elif kind == 2:
    body[key] = [body.get(key)] * rng.randint(0, 3)
  elif kind == 3:
    body[f"unknown_{rng.randrange(99)}"] = rng.choice(_WEIRD)
  elif kind == 4:
    return json.dumps(rng.choice([[valid], "str", 7, None, [[]]])).encode()
  elif kind == 5:
    text = json.dumps(valid)
    return text[: rng.randrange(len(text))].encode()  # cut short
  elif kind == 6:
    return b"\xff\xfe{" + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
  else:
    depth = rng.randint(50, 3000)
    return b'{"a":' * depth + b"1" + b"}" * depth
  return json.dumps(body).encode()


@dataclasses.dataclass
class AbuseReport:
  """What the server answered."""

  tried: int = 0
  statuses: Counter = dataclasses.field(default_factory=Counter)
  server_errors: int = 0  # 5xx other than 503 (shedding load is allowed)
  hangs: int = 0  # no answer within the timeout
  failures: list[str] = dataclasses.field(default_factory=list)

  def add(self, what: str, status: int | None) -> None:
    self.tried += 1
    if status is None:
      self.hangs += 1
      self.failures.append(f"{what}: no answer")
      return
    self.statuses[status] += 1
    if status >= 500 and status != 503:
      self.server_errors += 1
      self.failures.append(f"{what}: HTTP {status}")


async def _post(
  session: aiohttp.ClientSession, url: str, data: bytes, timeout_s: float, headers=None
) -> int | None:
  try:
    async with asyncio.timeout(timeout_s):
      async with session.post(url, data=data, headers=headers or {}) as r:
        await r.read()
        return r.status
  except TimeoutError:
    return None
  except aiohttp.ClientError:
    return 499  # the server closed the connection on a bad request: not a crash, not a hang


async def malformed_requests(
  base: str, endpoints: list[Endpoint], *, n: int, seed: int = 0, timeout_s: float = 30.0
) -> AbuseReport:
  """`n` malformed bodies per endpoint, one after another."""
  rng = random.Random(seed)
  report = AbuseReport()
  hdr = {"Content-Type": "application/json"}
  async with aiohttp.ClientSession() as s:
    for ep in endpoints:
      for _ in range(n):
        body = malformed(ep.valid, rng)
        report.add(f"{ep.path} {body[:80]!r}", await _post(s, base + ep.path, body, timeout_s, hdr))
  return report


async def flood(
  base: str, ep: Endpoint, *, n: int, concurrency: int, timeout_s: float = 60.0
) -> AbuseReport:
  """`n` valid requests, `concurrency` at a time: each gets 200 or 503, none hangs."""
  report = AbuseReport()
  sem = asyncio.Semaphore(concurrency)
  body = json.dumps(ep.valid).encode()
  conn = aiohttp.TCPConnector(limit=concurrency)
  async with aiohttp.ClientSession(connector=conn) as s:

    async def one() -> None:
      async with sem:
        report.add(ep.path, await _post(s, base + ep.path, body, timeout_s))

    await asyncio.gather(*(one() for _ in range(n)))
  return report


async def oversized(base: str, ep: Endpoint, nbytes: int, timeout_s: float = 30.0) -> int | None:
  """Status for a body of `nbytes` (valid JSON, padded)."""
  body = json.dumps({**ep.valid, "pad": "x" * nbytes}).encode()
  async with aiohttp.ClientSession() as s:
    return await _post(s, base + ep.path, body, timeout_s)


async def slow_client(
  host: str, port: int, path: str, *, body: bool, interval_s: float = 1.0, give_up_s: float = 60.0
) -> tuple[float, bytes]:
  """Sends a request a byte every `interval_s` (headers complete first when `body`); returns
  (seconds until the server answered or closed, what it answered). A server that waits past
  `give_up_s` returns (inf, b"")."""
  payload = b'{"queries": ["a"]}'
  head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
  head += f"Content-Length: {len(payload)}\r\n\r\n"
  reader, writer = await asyncio.open_connection(host, port)
  t0 = time.monotonic()
  try:
    if body:
      writer.write(head.encode())
      trickle = payload
    else:
      trickle = head.encode() + payload
    for b in trickle:
      if time.monotonic() - t0 > give_up_s:
        return float("inf"), b""
      writer.write(bytes([b]))
      try:
        await writer.drain()
        got = await asyncio.wait_for(reader.read(4096), interval_s)
      except TimeoutError:
        continue
      except ConnectionError:
        return time.monotonic() - t0, b""
      return time.monotonic() - t0, got  # answered (or b"": closed)
    return float("inf"), b""
  finally:
    writer.close()
