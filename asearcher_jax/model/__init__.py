"""The policy: Qwen-family transformer (NNX), KV cache, HF checkpoints in and out, sharding rules,
packed batches and the jitted steps."""
