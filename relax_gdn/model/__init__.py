"""Qwen3.5 assembly on Megatron-Core: specs, the CP + THD attention core that needs no Transformer
Engine, norms, checkpoint import."""
