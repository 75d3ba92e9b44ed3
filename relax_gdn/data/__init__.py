"""SFT data: tokenizers and loss masks, sources (jsonl / parquet / `datasets` on disk / embedded
synthetic), dynamic batching under ``train.max_tokens_per_gpu``, CP padding + zigzag sharding,
``PackedSeqParams`` with host cu_seqlens and optional route prebuild.

Typical use on one rank (same calls, same answers on every rank)::

    tokenizer = load_tokenizer(None)                       # or a local HF tokenizer directory
    data = synthetic_math_dataset(2000, tokenizer, seed=0)  # or load_sft_dataset(path, tokenizer)
    epoch, batch = global_batch_at_step(data.samples, global_batch_size=64, seed=0, step=step)
    plan = plan_micro_batches(batch, max_tokens_per_gpu=4096, cp_size=cp, dp_size=dp)
    for samples in plan[dp_rank]:
        mb = make_micro_batch(samples, cp_size=cp, cp_rank=cp_rank, device=device,
                              pad_id=tokenizer.pad_id, route_strategy="prebuild", cp_group=cp_group)
"""

from relax_gdn.data.batching import (
    MicroBatch,
    check_max_tokens_per_gpu,
    global_batch_at_step,
    global_batches,
    make_micro_batch,
    padded_length,
    plan_micro_batches,
)
from relax_gdn.data.sample import SKIP_REASONS, Sample, SFTDataset, SkipCounts
from relax_gdn.data.sources import (
    DEFAULT_PROMPT_FIELD,
    DEFAULT_RESPONSE_FIELD,
    MESSAGES_FIELD,
    RECORD_FORMATS,
    SOURCE_FORMATS,
    load_sft_dataset,
    read_located_records,
    tokenize_records,
)
from relax_gdn.data.synthetic import (
    LengthProfile,
    length_matched_samples,
    length_stats,
    synthetic_math_dataset,
    synthetic_math_records,
)
from relax_gdn.data.tokenizer import ROLES, ByteChatTokenizer, HFChatTokenizer, SFTTokenizer, load_tokenizer

__all__ = [
    "DEFAULT_PROMPT_FIELD",
    "DEFAULT_RESPONSE_FIELD",
    "MESSAGES_FIELD",
    "RECORD_FORMATS",
    "ROLES",
    "SKIP_REASONS",
    "SOURCE_FORMATS",
    "ByteChatTokenizer",
    "HFChatTokenizer",
    "LengthProfile",
    "MicroBatch",
    "SFTDataset",
    "SFTTokenizer",
    "Sample",
    "SkipCounts",
    "check_max_tokens_per_gpu",
    "global_batch_at_step",
    "global_batches",
    "length_matched_samples",
    "length_stats",
    "load_sft_dataset",
    "load_tokenizer",
    "make_micro_batch",
    "padded_length",
    "plan_micro_batches",
    "read_located_records",
    "synthetic_math_dataset",
    "synthetic_math_records",
    "tokenize_records",
]
