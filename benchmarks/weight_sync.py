"""Weight sync cost per GB: the weight store on local disk (publish, then a server's load into its
own placement) against the in-process swap, side by side in one run (no arguments; ~1-2 minutes
on 2 CPU cores).

The policy is a ~100M-parameter Qwen2-shaped model (float32 master weights, 0.4 GB), random init.
Each figure is the median of 3 repeats after one warm-up:
  * store_publish: `serving.weights_dir.write_version` at bf16 (the publisher's default): cast on
    device, Orbax/tensorstore write, commit marker, LATEST pointer. Per GB of bytes stored.
  * store_load: `load_version` into the engine's own params (float32, one device), as every
    `serve-model` watcher does, then `update_params` on a real driver. Per GB of bytes stored.
  * in_process_swap: `rl.weight_sync.InProcessWeightSync.publish` (device copy of the params +
    the driver's swap between decode steps; nothing in flight). Per GB of float32 params.
  * store_zstd: the same publish and load with `compress=True`, per GB of bf16 params; with the
    bytes on disk of both.
  * safetensors_f32: the format the store replaced (full float32 HF safetensors per version via
    `model.hf_io`), publish and load, for reference. Per GB written.
  * publish_charged: the trainer's side of `rl.weight_sync.DirectoryWeightPublisher.publish`,
    blocking (`WeightSyncConfig.background=False`, the default: the write happens inside the
    call) against background (a device copy and a hand-off; the write runs on the publisher's
    thread). Each publishes REPEATS + 1 versions with a stand-in train step between them that
    keeps the host idle as a device-bound step does (a sleep as long as one blocking publish);
    the figure is the median time inside `publish` (background: mostly the learner's device
    copy, measured alone as params_copy: on CPU a real 0.4 GB memcpy, on an accelerator an
    asynchronous device op), and the background run's final `flush`.
GB = 1e9 bytes. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax.model import hf_io, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl.weight_sync import (
  DirectoryWeightPublisher,
  InProcessWeightSync,
  WeightSyncConfig,
)
from asearcher_jax.serving import weights_dir as wd
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.tokenizer import Tokenizer

CONFIG = ModelConfig(
  vocab_size=32768, hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12,
  num_kv_heads=4, max_position_embeddings=256,
)  # fmt: skip
REPEATS = 3
GB = 1e9


class Source:
  """`PolicySource` over fixed params: what the learner hands a weight sync."""

  def __init__(self, params: nnx.State) -> None:
    self.params = params
    self.version = 0

  def params_copy(self) -> nnx.State:
    return jax.tree.map(jnp.copy, self.params)


def timed(fn) -> float:
  """Median seconds of `fn` over REPEATS calls after one warm-up call."""
  times = []
  for i in range(REPEATS + 1):
    t0 = time.perf_counter()
    fn(i)
    times.append(time.perf_counter() - t0)
  return statistics.median(times[1:])


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main() -> dict:
  model = transformer.Transformer(CONFIG, rngs=nnx.Rngs(0))
  _, params = nnx.split(model)
  engine = Engine.from_model(
    model, Tokenizer.qwen2(),
    EngineConfig(max_slots=1, max_seq_len=64, prefill_buckets=(64,), decode_rows=(1,)),
  )  # fmt: skip
  driver = Driver(engine, DriverConfig())
  target = engine.load_params().state  # the server's own placement and dtype
  param_bytes = nbytes(params)
  out: dict = {"params_m": round(sum(x.size for x in jax.tree.leaves(params)) / 1e6, 1)}
  out["param_gb_f32"] = round(param_bytes / GB, 3)
  try:
    with tempfile.TemporaryDirectory() as tmp:
      root = os.path.join(tmp, "store")

      def publish(i):
        wd.write_version(root, model, i + 1, dtype="bfloat16")
        wd.prune_versions(root, keep=1, newest=i + 1)

      publish_s = timed(publish)
      latest = wd.read_latest(root)
      stored = json.loads((wd.store_path(root) / latest["path"] / wd.COMMITTED).read_text())
      stored_gb = stored["bytes"] / GB

      def load(i):
        loaded = wd.load_version(wd.store_path(root) / latest["path"], target)
        driver.update_params(loaded, 100 + i, timeout=600)

      load_s = timed(load)

      zroot = os.path.join(tmp, "zstd")
      zpublish_s = timed(
        lambda i: wd.write_version(zroot, model, i + 1, dtype="bfloat16", compress=True)
      )
      zdir = wd.store_path(zroot) / wd.read_latest(zroot)["path"]
      zload_s = timed(lambda i: driver.update_params(wd.load_version(zdir, target), 300 + i))
      z_gb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(zdir) for f in fs) / GB
      plain_gb = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(wd.store_path(root) / latest["path"]) for f in fs
      ) / GB  # fmt: skip

      sync = InProcessWeightSync(driver, WeightSyncConfig())
      source = Source(params)

      def swap(i):
        source.version = 200 + i
        sync.publish(source)

      swap_s = timed(swap)

      hf_dir = os.path.join(tmp, "hf")
      hf_s = timed(lambda _: hf_io.save(model, hf_dir))
      hf_gb = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)) / GB
      hf_load_s = timed(lambda _: jax.block_until_ready(nnx.state(hf_io.load(hf_dir)[0])))

      # The part background publishing still charges: the learner's device copy.
      copy_s = timed(lambda _: jax.block_until_ready(source.params_copy()))
      charged = {}
      graphdef = nnx.split(model)[0]
      for mode in ("blocking", "background"):
        pub = DirectoryWeightPublisher(
          os.path.join(tmp, mode), graphdef,
          config=WeightSyncConfig(keep_versions=1, background=mode == "background"),
        )  # fmt: skip
        times = []
        for i in range(REPEATS + 1):
          source.version = 400 + i
          t0 = time.perf_counter()
          pub.publish(source)
          times.append(time.perf_counter() - t0)
          time.sleep(publish_s)  # the train step: the device busy, the host idle
        t0 = time.perf_counter()
        pub.close()
        charged[mode] = (statistics.median(times[1:]), time.perf_counter() - t0, pub)
  finally:
    driver.close()
  out.update({
    "store_gb_bf16": round(stored_gb, 3),
    "store_publish_s": round(publish_s, 3),
    "store_publish_s_per_gb": round(publish_s / stored_gb, 3),
    "store_load_s": round(load_s, 3),
    "store_load_s_per_gb": round(load_s / stored_gb, 3),
    "store_disk_gb": round(plain_gb, 3),
    "store_zstd_disk_gb": round(z_gb, 3),
    "store_zstd_publish_s_per_gb": round(zpublish_s / stored_gb, 3),
    "store_zstd_load_s_per_gb": round(zload_s / stored_gb, 3),
    "in_process_swap_s": round(swap_s, 3),
    "in_process_swap_s_per_gb": round(swap_s / (param_bytes / GB), 3),
    "safetensors_f32_gb": round(hf_gb, 3),
    "safetensors_f32_publish_s_per_gb": round(hf_s / hf_gb, 3),
    "safetensors_f32_load_s_per_gb": round(hf_load_s / hf_gb, 3),
    "store_publish_plus_load_vs_in_process": round((publish_s + load_s) / swap_s, 1),
    "publish_charged_blocking_s": round(charged["blocking"][0], 3),
    "publish_charged_background_s": round(charged["background"][0], 4),
    "publish_charged_blocking_vs_background": round(
      charged["blocking"][0] / max(charged["background"][0], 1e-9), 1
    ),
    "publish_background_params_copy_s": round(copy_s, 4),
    "publish_background_final_flush_s": round(charged["background"][1], 3),
    "publish_background_written": charged["background"][2].written,
    "publish_background_superseded": charged["background"][2].superseded,
    "device": jax.devices()[0].platform,
    "cores": os.cpu_count(),
  })  # fmt: skip
  return out


if __name__ == "__main__":
  print(json.dumps(main()), flush=True)
