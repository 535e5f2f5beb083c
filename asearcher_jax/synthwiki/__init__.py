"""SynthWiki: a procedural encyclopedia (world, k-hop questions, world tokenizer, scripted
expert) for offline experiments whose answers are known exactly."""
