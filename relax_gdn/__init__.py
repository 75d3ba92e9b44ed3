"""relax-gdn: Qwen3.5 (Gated DeltaNet hybrid) SFT on Megatron-Core with fast context parallelism."""

__version__ = "0.1.0"
