"""Supervised training of policies: SFT on expert agent trajectories (`asearcher sft`)."""

from asearcher_jax.sft.sft import SFTConfig, SFTResult, SFTTrainer, sft_loss

__all__ = ["SFTConfig", "SFTResult", "SFTTrainer", "sft_loss"]
