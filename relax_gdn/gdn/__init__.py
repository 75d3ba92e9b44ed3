"""Gated DeltaNet: the CP-mode layer on Megatron-Core and its kernel backends (FLA, pure torch)."""
