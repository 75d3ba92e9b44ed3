"""relax_gdn.data on CPU: tokenizers, sources, synthetic sets, planning, packing and CP sharding.

The packed-shard checks rebuild the global sequence from every rank's shard with the zigzag
rule written out here (chunk r and 2W-1-r of each document), independently of relax_gdn.layout.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_gdn.data import (
    SKIP_REASONS,
    ByteChatTokenizer,
    HFChatTokenizer,
    LengthProfile,
    Sample,
    global_batch_at_step,
    global_batches,
    length_matched_samples,
    length_stats,
    load_sft_dataset,
    load_tokenizer,
    make_micro_batch,
    plan_micro_batches,
    synthetic_math_dataset,
    synthetic_math_records,
)
from relax_gdn.layout import build_route, get_route, host_cu_seqlens

BYTE = ByteChatTokenizer()

# Megatron-Core's import chain warns about its own cyclic imports; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The following imports from:DeprecationWarning")


def _sample(length: int, sample_id: int, prompt: int | None = None, seed: int = 0) -> Sample:
    """A sample with distinct token ids and loss on the labels after ``prompt`` tokens."""
    prompt = length // 3 if prompt is None else prompt
    rng = np.random.default_rng([seed, sample_id])
    ids = rng.integers(0, 250, size=length).tolist()
    loss_mask = [i + 1 >= prompt for i in range(length - 1)] + [False]
    return Sample(input_ids=ids, loss_mask=loss_mask, sample_id=sample_id)


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_response_only_loss():
    ids, mask = BYTE.encode_sft("What is 2+2? ü", "It is 4.")
    assert BYTE.decode(ids) == "<|user|>What is 2+2? ü<|assistant|>It is 4.<|end|>"
    assert len(mask) == len(ids) and mask[-1] is False
    labels_trained = [ids[i + 1] for i in range(len(ids) - 1) if mask[i]]
    assert BYTE.decode(labels_trained) == "It is 4.<|end|>"
    assert max(ids) < BYTE.vocab_size and BYTE.vocab_size % 8 == 0
    assert BYTE.eos_id == ids[-1] and BYTE.pad_id not in ids
    assert isinstance(load_tokenizer(None), ByteChatTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteChatTokenizer)


def _save_tiny_hf_tokenizer(directory: Path, chat_template: str | None) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="building a local HF tokenizer needs `tokenizers`")
    transformers = pytest.importorskip("transformers", reason="loading an HF tokenizer needs `transformers`")
    words = [
        "<pad>",
        "<unk>",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "what",
        "is",
        "two",
        "plus",
        "four",
        "the",
        "answer",
        "\n",
    ]
    vocab = {w: i for i, w in enumerate(words)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(directory))


# A Qwen-like template: a trailing token after the end-of-turn token must not be trained on.
_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> answer {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def test_hf_tokenizer_directory_uses_chat_template(tmp_path):
    _save_tiny_hf_tokenizer(tmp_path / "tok", _TEMPLATE)
    tok = load_tokenizer(tmp_path / "tok")
    assert isinstance(tok, HFChatTokenizer)
    ids, mask = tok.encode_sft("what is two plus two", "the answer is four")
    assert tok.decode(ids).split() == (
        "<|im_start|> user what is two plus two <|im_end|> answer <|im_start|> assistant "
        "the answer is four <|im_end|> answer".split()
    )
    trained = [ids[i + 1] for i in range(len(ids) - 1) if mask[i]]
    assert tok.decode(trained).split() == "the answer is four <|im_end|>".split()
    assert tok.eos_id == tok.hf.convert_tokens_to_ids("<|im_end|>") and tok.pad_id == 0
    assert tok.vocab_size == 14


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    _save_tiny_hf_tokenizer(tmp_path / "plain", chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path / "plain")


# ---------------------------------------------------------------- sources

GOOD = [
    {"problem": "1+1?", "generated_solution": "2"},
    {"problem": "2+2?", "generated_solution": "4", "extra": 1},
]
BROKEN = [
    {"problem": "no solution"},  # missing_field
    {"problem": "x", "generated_solution": None},  # missing_field
    {"problem": 3, "generated_solution": "3"},  # not_string
    {"problem": "x", "generated_solution": "   "},  # empty
    {"problem": "long", "generated_solution": "y" * 500},  # too_long at max_sample_tokens=64
]


def _write_jsonl(path: Path, records, extra_lines=()) -> Path:
    with path.open("w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
        for line in extra_lines:
            fh.write(line + "\n")
    return path


def _write_parquet(path: Path, records) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_jsonl_round_trip_skips_and_counts_broken_records(tmp_path):
    records = GOOD[:1] + BROKEN + GOOD[1:]
    path = _write_jsonl(tmp_path / "d.jsonl", records, extra_lines=["{not json", "[1, 2]", ""])
    data = load_sft_dataset(path, BYTE, max_sample_tokens=64)
    assert [s.sample_id for s in data.samples] == [0, 6]  # ids are positions in the source
    assert data.samples[0].input_ids == BYTE.encode_sft("1+1?", "2")[0]
    assert data.counts.as_dict() == {
        "total": 9,
        "kept": 2,
        "unparsable": 2,
        "missing_field": 2,
        "not_string": 1,
        "empty": 1,
        "too_long": 1,
        "bad_messages": 0,
        "no_assistant_turn": 0,
    }
    assert set(data.counts.as_dict()) - {"total", "kept"} == set(SKIP_REASONS)
    # a too-long record says how long it is, the limit, and the key that sets the limit
    (too_long,) = [line for line in data.counts.report_lines() if ": too_long" in line]
    length = len(BYTE.encode_sft("long", "y" * 500)[0])
    assert too_long == (
        f"{path}:6: too_long ({length} tokens > 64 allowed (data.max_sample_tokens; when null, "
        "train.max_tokens_per_gpu x CP size))"
    )


def test_parquet_round_trip_custom_fields_and_directories(tmp_path):
    records = [{"q": f"{i}+1?", "a": str(i + 1)} for i in range(5)]
    _write_parquet(tmp_path / "part-0.parquet", records[:3])
    _write_parquet(tmp_path / "part-1.parquet", records[3:])
    one = load_sft_dataset(tmp_path / "part-0.parquet", BYTE, prompt_field="q", response_field="a")
    assert [BYTE.decode(s.input_ids) for s in one.samples][1] == "<|user|>1+1?<|assistant|>2<|end|>"
    both = load_sft_dataset(tmp_path, BYTE, prompt_field="q", response_field="a")
    assert len(both) == 5 and both.counts.kept == 5 and both.counts.num_skipped == 0
    first_two = load_sft_dataset(tmp_path, BYTE, prompt_field="q", response_field="a", max_samples=2)
    assert first_two.counts.kept == 2


def test_unusable_sources_raise_naming_path_field_and_fix(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*data\.path"):
        load_sft_dataset(tmp_path / "missing.jsonl", BYTE)
    with pytest.raises(ValueError, match="no usable record.*no records"):
        load_sft_dataset(_write_jsonl(tmp_path / "empty.jsonl", []), BYTE)
    wrong = _write_jsonl(tmp_path / "wrong.jsonl", [{"question": "a", "answer": "b"}] * 3)
    with pytest.raises(ValueError, match=r"wrong\.jsonl.*missing_field=3.*'question'.*data\.prompt_field"):
        load_sft_dataset(wrong, BYTE)
    _write_parquet(tmp_path / "wrong.parquet", [{"question": "a", "answer": "b"}])
    with pytest.raises(ValueError, match=r"no field\(s\) \['problem', 'generated_solution'\].*'question'"):
        load_sft_dataset(tmp_path / "wrong.parquet", BYTE)
    with pytest.raises(ValueError, match="max_sample_tokens=4"):
        load_sft_dataset(_write_jsonl(tmp_path / "ok.jsonl", GOOD), BYTE, max_sample_tokens=4)
    with pytest.raises(ValueError, match="suffix"):
        load_sft_dataset(_write_jsonl(tmp_path / "d.txt", GOOD), BYTE)


def test_saved_datasets_directory_is_read(tmp_path):
    import datasets

    datasets.Dataset.from_list(GOOD + BROKEN[:1]).save_to_disk(str(tmp_path / "saved"))
    data = load_sft_dataset(tmp_path / "saved", BYTE)
    assert data.counts.kept == 2 and data.counts.skipped["missing_field"] == 1
    # a saved DatasetDict: the split is chosen by data.split
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GOOD[:1]), "test": datasets.Dataset.from_list(GOOD)}
    ).save_to_disk(str(tmp_path / "splits"))
    assert load_sft_dataset(tmp_path / "splits", BYTE).counts.kept == 1
    assert load_sft_dataset(tmp_path / "splits", BYTE, split="test").counts.kept == 2
    with pytest.raises(ValueError, match=r"has splits \['train', 'test'\], not 'validation'.*data.split"):
        load_sft_dataset(tmp_path / "splits", BYTE, split="validation")


# ---------------------------------------------------------------- synthetic sets


def test_synthetic_math_set_is_deterministic_with_varied_lengths():
    a = synthetic_math_records(300, seed=7)
    assert a == synthetic_math_records(300, seed=7) and a != synthetic_math_records(300, seed=8)
    data = synthetic_math_dataset(300, BYTE, seed=7)
    lengths = data.lengths()
    assert max(lengths) > 5 * min(lengths)  # packing sees very different sizes
    record = a[0]
    assert record["generated_solution"].splitlines()[-1].startswith("Answer: ")
    # Every worked step is correct arithmetic, so the task is learnable.
    for line in (ln for r in a for ln in r["generated_solution"].splitlines() if ln.startswith("Step")):
        expr, result = line.rsplit(": ", 1)[1].rstrip(".").split(" = ")
        assert eval(expr.replace("/", "//")) == int(result)  # noqa: S307 - our own generated text
    capped = synthetic_math_dataset(300, BYTE, seed=7, max_sample_tokens=400)
    assert max(capped.lengths()) <= 400 and capped.counts.skipped["too_long"] == 300 - len(capped)


def test_length_matched_samples_follow_the_profile():
    profile = LengthProfile(mean_tokens=3000, sigma=0.8, min_tokens=128, max_tokens=16384)
    samples = length_matched_samples(800, vocab_size=1000, seed=3, profile=profile, eos_id=999)
    again = length_matched_samples(800, vocab_size=1000, seed=3, profile=profile, eos_id=999)
    assert [s.input_ids for s in samples[:20]] == [s.input_ids for s in again[:20]]
    stats = length_stats([len(s) for s in samples])
    assert 2500 < stats["mean"] < 3300 and stats["p99"] > 3 * stats["p50"]  # long-tailed
    assert 128 <= min(len(s) for s in samples) and max(len(s) for s in samples) <= 16384
    assert all(s.input_ids[-1] == 999 and not s.loss_mask[0] and s.loss_mask[-2] for s in samples[:50])
    exact = length_matched_samples(3, vocab_size=50, lengths=[10, 20, 30])
    assert [len(s) for s in exact] == [10, 20, 30]


# ---------------------------------------------------------------- planning


def _padded(n: int, cp: int) -> int:
    return -(-n // (2 * cp)) * (2 * cp)


@pytest.mark.parametrize("cp,dp", [(1, 1), (2, 2), (4, 3)])
def test_plan_respects_capacity_uses_every_sample_once_equal_counts(cp, dp):
    samples = synthetic_math_dataset(200, BYTE, seed=1, max_sample_tokens=1024).samples
    plan = plan_micro_batches(samples, max_tokens_per_gpu=1024, cp_size=cp, dp_size=dp)
    assert len(plan) == dp and len({len(rank) for rank in plan}) == 1
    seen = [s.sample_id for rank in plan for mb in rank for s in mb]
    assert sorted(seen) == sorted(s.sample_id for s in samples)
    for rank in plan:
        for mb in rank:
            assert sum(_padded(len(s), cp) for s in mb) <= 1024 * cp
    again = plan_micro_batches(samples, max_tokens_per_gpu=1024, cp_size=cp, dp_size=dp)
    ids = lambda p: [[[s.sample_id for s in mb] for mb in rank] for rank in p]  # noqa: E731
    assert ids(plan) == ids(again)
    loads = [sum(len(s) for mb in rank for s in mb) for rank in plan]
    assert max(loads) - min(loads) <= 1024 * cp  # balanced within one micro-batch's worth


def test_plan_splits_then_pads_with_empty_micro_batches_for_equal_counts():
    few = [_sample(10, i) for i in range(3)]  # all fit one micro-batch
    plan = plan_micro_batches(few, max_tokens_per_gpu=64, cp_size=1, dp_size=2)
    assert [len(r) for r in plan] == [1, 1] and sorted(len(r[0]) for r in plan) == [1, 2]
    plan = plan_micro_batches(few[:1], max_tokens_per_gpu=64, cp_size=1, dp_size=3)
    assert [len(r) for r in plan] == [1, 1, 1] and sorted(len(r[0]) for r in plan) == [0, 0, 1]


def test_plan_rejects_over_long_samples_and_bad_budgets():
    message = r"sample 7 has 130 tokens.*32 \* 2 = 64.*train\.max_tokens_per_gpu.*max_sample_tokens"
    with pytest.raises(ValueError, match=message):
        plan_micro_batches([_sample(10, 1), _sample(130, 7)], max_tokens_per_gpu=32, cp_size=2)
    for bad in (0, 7, 8.0, True, "8192", None):
        with pytest.raises(ValueError, match="train.max_tokens_per_gpu"):
            plan_micro_batches([_sample(4, 0)], max_tokens_per_gpu=bad, cp_size=1)
    with pytest.raises(ValueError, match="cp_size"):
        plan_micro_batches([_sample(4, 0)], max_tokens_per_gpu=8, cp_size=0)


# ---------------------------------------------------------------- packing and CP shards


def _unshard_zigzag(shards: list[torch.Tensor], cu: list[int], cp: int) -> torch.Tensor:
    """Global packed tensor from every rank's [1, t_local] shard: per document, rank r stored
    chunk r then chunk 2cp-1-r."""
    out, offsets = [], [0] * cp  # read position in each rank's shard
    for start, end in zip(cu, cu[1:]):
        chunk = (end - start) // (2 * cp)
        pieces = [None] * (2 * cp)
        for r in range(cp):
            local = shards[r][0, offsets[r] : offsets[r] + 2 * chunk]
            pieces[r], pieces[2 * cp - 1 - r] = local[:chunk], local[chunk:]
            offsets[r] += 2 * chunk
        out += pieces
    assert all(offsets[r] == shards[r].shape[1] for r in range(cp))
    return torch.cat(out)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_make_micro_batch_shards_reassemble_the_padded_pack(cp):
    samples = [_sample(13, 0, prompt=5), _sample(8, 1, prompt=2), _sample(1, 2, prompt=0), _sample(21, 3)]
    pad = 999
    batches = [make_micro_batch(samples, cp_size=cp, cp_rank=r, device="cpu", pad_id=pad) for r in range(cp)]
    psp = batches[0].packed_seq_params
    cu = psp.cu_seqlens_q.tolist()
    assert psp.cu_seqlens_q.dtype == torch.int32 and psp.qkv_format == "thd"
    assert cu == [0] + np.cumsum([_padded(len(s), cp) for s in samples]).tolist()
    assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu, cu[1:]))
    assert psp.max_seqlen_q == psp.max_seqlen_kv == max(b - a for a, b in zip(cu, cu[1:]))
    for field in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(psp, field).tolist() == cu
    # The host copy is attached (the same array back each time), so layers never sync.
    host = host_cu_seqlens(psp, psp.cu_seqlens_q)
    assert host.tolist() == cu and host_cu_seqlens(psp, psp.cu_seqlens_q) is host

    tokens, labels, mask, pos = expected = ([], [], [], [])
    for s in samples:
        n, p = len(s), _padded(len(s), cp)
        tokens += s.input_ids + [pad] * (p - n)
        labels += s.input_ids[1:] + [pad] * (p - n + 1)
        mask += [float(m) for m in s.loss_mask[: n - 1]] + [0.0] * (p - n + 1)
        pos += list(range(p))
    for name, want in zip(("tokens", "labels", "loss_mask", "position_ids"), expected):
        shards = [getattr(b, name) for b in batches]
        assert all(t.shape == (1, cu[-1] // cp) for t in shards)
        assert _unshard_zigzag(shards, cu, cp).tolist() == want, name
    assert batches[0].tokens.dtype == batches[0].labels.dtype == batches[0].position_ids.dtype == torch.int64
    assert batches[0].loss_mask.dtype == torch.float32

    total_loss_tokens = sum(s.num_loss_tokens for s in samples)
    assert sum(int(b.loss_mask.sum()) for b in batches) == total_loss_tokens
    for b in batches:
        assert b.num_loss_tokens == total_loss_tokens and b.num_real_tokens == 43 and b.num_samples == 4
        assert b.seq_lengths == [13, 8, 1, 21] and b.cp_size == cp and b.num_padded_tokens == cu[-1]


def test_empty_micro_batch_is_padding_without_loss():
    b = make_micro_batch([], cp_size=2, cp_rank=1, device="cpu", pad_id=0)
    assert b.tokens.shape == (1, 2) and b.num_loss_tokens == 0 and b.num_real_tokens == 0
    assert b.loss_mask.sum() == 0 and b.seq_lengths == []
    assert b.packed_seq_params.cu_seqlens_q.tolist() == [0, 4]


def test_make_micro_batch_validates_inputs():
    s = [_sample(6, 0)]
    with pytest.raises(ValueError, match="cp_rank"):
        make_micro_batch(s, cp_size=2, cp_rank=2, device="cpu", pad_id=0)
    with pytest.raises(ValueError, match="route strategy"):
        make_micro_batch(s, cp_size=2, cp_rank=0, device="cpu", pad_id=0, route_strategy="eager")
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        make_micro_batch([Sample([1, 2, 3], [True, False], 5)], cp_size=1, cp_rank=0, device="cpu", pad_id=0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_prebuild_attaches_the_route_layers_will_use(cp):
    samples = [_sample(11, 0), _sample(30, 1)]
    for rank in range(cp):
        lazy = make_micro_batch(samples, cp_size=cp, cp_rank=rank, device="cpu", pad_id=0)
        assert not getattr(lazy.packed_seq_params, "_relax_gdn_routes", None)  # built later, in the layer
        b = make_micro_batch(
            samples, cp_size=cp, cp_rank=rank, device="cpu", pad_id=0, route_strategy="prebuild"
        )
        psp = b.packed_seq_params
        stored = getattr(psp, "_relax_gdn_routes", None)
        if cp == 1:
            assert not stored  # nothing to convert with one rank
            continue
        assert len(stored) == 1  # one route object serves both directions
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a missing prebuilt route would warn
            forward = get_route(psp, psp.cu_seqlens_q, cp, rank, "zigzag", "contiguous", strategy="prebuild")
            backward = get_route(psp, psp.cu_seqlens_q, cp, rank, "contiguous", "zigzag", strategy="prebuild")
        assert next(iter(stored.values())).cu_seqlens is psp.cu_seqlens_q
        reference = build_route(psp.cu_seqlens_q.tolist(), cp, rank, "zigzag", "contiguous")
        assert forward.send_splits == reference.send_splits and forward.recv_splits == reference.recv_splits
        assert backward.send_splits == reference.recv_splits


# ---------------------------------------------------------------- global batches


def test_global_batches_are_deterministic_shuffles_per_epoch():
    samples = [_sample(5, i) for i in range(23)]
    ids = lambda batches: [[s.sample_id for s in b] for b in batches]  # noqa: E731
    e0 = global_batches(samples, 5, seed=1, epoch=0)
    assert len(e0) == 4 and all(len(b) == 5 for b in e0) and len({i for b in ids(e0) for i in b}) == 20
    assert ids(e0) == ids(global_batches(samples, 5, seed=1, epoch=0))
    assert ids(e0) != ids(global_batches(samples, 5, seed=1, epoch=1))
    assert ids(e0) != ids(global_batches(samples, 5, seed=2))
    assert sum(map(len, global_batches(samples, 5, seed=1, drop_last=False))) == 23
    epoch, batch = global_batch_at_step(samples, 5, seed=1, step=6)
    assert epoch == 1 and ids([batch]) == ids(global_batches(samples, 5, seed=1, epoch=1)[2:3])
    with pytest.raises(ValueError, match="global_batch_size=30 is larger than the dataset"):
        global_batches(samples, 30, seed=1)
