"""Every closed set of string options the recipe accepts, each defined once as a ``Literal``.

The config schema annotates its fields with these types, ``relax_gdn.config.validate`` checks
values against them, and the modules that act on an option (layout, gdn, model) import the
tuple from here. A leaf module (like :mod:`relax_gdn.errors`): it imports nothing, so checking a
configuration never pulls in torch or Megatron-Core.
"""

from __future__ import annotations

from typing import Literal, get_args

CPMode = Literal["headwise", "chunkwise", "all_gather"]
RouteStrategy = Literal[
    "lazy_cache", "prebuild"
]  # zigzag<->contiguous routes: built on first use / by the data side
SwapTransport = Literal[
    "auto", "all_to_all", "peer_memory"
]  # auto: peer_memory when the CP group is on one host
KernelBackend = Literal["auto", "fla", "torch"]  # auto: FLA on CUDA, the pure-torch reference elsewhere
ModelPreset = Literal["qwen3_5_9b", "qwen3_5_9b_reduced", "qwen3_5_tiny"]
SpecProvider = Literal["auto", "local", "te"]  # auto: Transformer Engine specs where it imports
# relax_gdn.model.attention.CPDotProductAttention; relax_gdn.model.attention_kernels says what each runs
CoreAttentionBackend = Literal["auto", "varlen", "sdpa", "flex", "fa4"]
ModelAttentionBackend = Literal["auto", "te", "varlen", "sdpa", "flex", "fa4"]  # te: Transformer Engine's
# mixed: the first recompute.full_layers layers recomputed whole, the others selective (relax_gdn.model.recompute)
RecomputeGranularity = Literal["full", "mixed", "selective", "none"]
# what recompute.granularity=selective recomputes (relax_gdn.model.recompute says what each is)
RecomputeModule = Literal["core_attn", "mlp_act", "gdn_core"]
DataSource = Literal["synthetic", "jsonl", "parquet", "hf_disk"]
RecordFormat = Literal[
    "auto", "messages", "prompt_response"
]  # auto: a `messages` field -> messages, per file
Precision = Literal["auto", "bf16", "fp32"]  # auto: bf16 on CUDA, fp32 on CPU
Device = Literal["auto", "cuda", "cpu"]
# none: gradients computed and reduced (DDP), no update and no optimizer state: benchmarks of models
# whose optimizer state does not fit (the full 9B on one GPU)
OptimizerName = Literal["adam", "none"]
LRSchedule = Literal["cosine", "linear", "constant"]
# how the GPU distributed optimizer's state is checkpointed (relax_gdn.train.optimizer says what each costs)
OptimizerCheckpointSharding = Literal["dp_reshardable", "fully_reshardable"]
WandbMode = Literal["online", "offline", "disabled"]
# a step whose loss or grad norm is not finite: stop the run (nothing saved) or skip its update
NonfinitePolicy = Literal["stop", "skip"]
# model.fp8.recipe: torchao's float8 training recipes (relax_gdn.model.fp8.options says what each casts how)
FP8Recipe = Literal["tensorwise", "rowwise", "rowwise_gw_hp"]
# model.lora.targets: Hugging Face module names (what PEFT's target_modules say) and named groups of
# them (relax_gdn.model.lora_options.LORA_GROUPS says what each group holds)
LoRATarget = Literal[
    "all_linear",
    "gdn",
    "attention",
    "mlp",
    "gdn_in_proj",
    "gdn_out_proj",
    "attention_qkv",
    "attention_o",
    "mlp_fc1",
    "mlp_fc2",
    "embedding",
    "output",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "embed_tokens",
    "lm_head",
]

CP_MODES: tuple[str, ...] = get_args(CPMode)
ROUTE_STRATEGIES: tuple[str, ...] = get_args(RouteStrategy)
SWAP_TRANSPORTS: tuple[str, ...] = get_args(SwapTransport)
KERNEL_BACKENDS: tuple[str, ...] = get_args(KernelBackend)
MODEL_PRESETS: tuple[str, ...] = get_args(ModelPreset)
SPEC_PROVIDERS: tuple[str, ...] = get_args(SpecProvider)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(CoreAttentionBackend)
MODEL_ATTENTION_BACKENDS: tuple[str, ...] = get_args(ModelAttentionBackend)
RECOMPUTE_GRANULARITIES: tuple[str, ...] = get_args(RecomputeGranularity)
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)
DATA_SOURCES: tuple[str, ...] = get_args(DataSource)
RECORD_FORMATS: tuple[str, ...] = get_args(RecordFormat)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DEVICES: tuple[str, ...] = get_args(Device)
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
LR_SCHEDULES: tuple[str, ...] = get_args(LRSchedule)
OPTIMIZER_CHECKPOINT_SHARDINGS: tuple[str, ...] = get_args(OptimizerCheckpointSharding)
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)
NONFINITE_POLICIES: tuple[str, ...] = get_args(NonfinitePolicy)
LORA_TARGETS: tuple[str, ...] = get_args(LoRATarget)
FP8_RECIPES: tuple[str, ...] = get_args(FP8Recipe)


def choice_problem(key: str, value: object, allowed: tuple[str, ...]) -> str | None:
    """The one wording for a value outside its choices (None when it is one of them)."""
    if value in allowed:
        return None
    return f"{key}={value!r} is not one of {list(allowed)}"
