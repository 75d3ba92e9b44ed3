"""``messages`` records (multi-turn chat): the loss mask covers exactly the assistant turns as the
chat template renders them (embedded template and local HF tokenizer directories), with and
without a system prompt; jsonl / parquet / saved ``datasets`` sources, auto-detected per file or
forced; malformed records reported with file and line; CP 2 trains and evaluates like CP 1 on
them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_gdn.data import ByteChatTokenizer, load_sft_dataset, load_tokenizer
from relax_gdn.errors import DataError, RecipeError
from tests.distributed import job_runtime
from tests.helpers import MESSAGES_EXAMPLE as EXAMPLE
from tests.helpers import messages_config as messages_cfg

BYTE = ByteChatTokenizer()

pytestmark = pytest.mark.filterwarnings("ignore:The following imports from:DeprecationWarning")

SYSTEM = {"role": "system", "content": "be brief"}
TWO_TURNS = [
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "the answer is four"},
    {"role": "user", "content": "what is four plus four"},
    {"role": "assistant", "content": "eight"},
]


def trained_runs(tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded runs of consecutive trained labels (label of position i is token i + 1)."""
    runs, current = [], []
    for i in range(len(ids) - 1):
        if mask[i]:
            current.append(ids[i + 1])
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


# ---------------------------------------------------------------- the embedded template


@pytest.mark.parametrize("system", [False, True])
def test_embedded_template_trains_exactly_the_assistant_turns(system):
    messages = ([SYSTEM] if system else []) + TWO_TURNS
    ids, mask = BYTE.encode_messages(messages)
    assert len(mask) == len(ids) and mask[-1] is False
    assert BYTE.decode(ids) == (
        ("<|system|>be brief" if system else "")
        + "<|user|>what is two plus two<|assistant|>the answer is four<|end|>"
        + "<|user|>what is four plus four<|assistant|>eight<|end|>"
    )
    assert trained_runs(BYTE, ids, mask) == ["the answer is four<|end|>", "eight<|end|>"]
    # one turn of messages is the prompt/response record
    assert BYTE.encode_messages(TWO_TURNS[:2]) == BYTE.encode_sft(
        "what is two plus two", "the answer is four"
    )


# ---------------------------------------------------------------- HF tokenizer directories

WORDS = [
    "<pad>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "system",
    "user",
    "assistant",
    "what",
    "is",
    "two",
    "plus",
    "four",
    "the",
    "answer",
    "eight",
    "be",
    "brief",
    "tail",
]

# Qwen-like: every turn closed by <|im_end|> and a token after it that is not trained on.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> tail {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# Qwen3-like: the final assistant turn carries an (empty) reasoning block the earlier ones lack.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} "
    "{% if m.role == 'assistant' and loop.last %}<think> </think> {% endif %}{{ m.content }} <|im_end|> tail "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# Re-renders an earlier turn once the conversation goes on: no span can be located.
UNSTABLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} "
    "{% if loop.last %}<|im_end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}tail <|im_start|> assistant {% endif %}"
)


def _hf_tokenizer(directory: Path, template: str):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    )
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = template
    tok.save_pretrained(str(directory))
    return load_tokenizer(directory)


@pytest.mark.parametrize("system", [False, True])
def test_hf_template_trains_exactly_the_assistant_turns(tmp_path, system):
    tok = _hf_tokenizer(tmp_path / "tok", PLAIN_TEMPLATE)
    messages = ([SYSTEM] if system else []) + TWO_TURNS
    ids, mask = tok.encode_messages(messages)
    rendered = tok.hf.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids).split() == rendered.split()  # the template's rendering, token for token
    assert [run.split() for run in trained_runs(tok, ids, mask)] == [
        "the answer is four <|im_end|>".split(),
        "eight <|im_end|>".split(),
    ]
    assert tok.encode_messages(TWO_TURNS[:2]) == tok.encode_sft("what is two plus two", "the answer is four")


def test_hf_template_with_a_final_turn_scaffold_and_an_unstable_template(tmp_path):
    tok = _hf_tokenizer(tmp_path / "reasoning", REASONING_TEMPLATE)
    ids, mask = tok.encode_messages([SYSTEM] + TWO_TURNS)
    # everything after the generation prompt up to the end of turn: what the model must generate
    assert [run.split() for run in trained_runs(tok, ids, mask)] == [
        "the answer is four <|im_end|>".split(),
        "<think> </think> eight <|im_end|>".split(),
    ]
    unstable = _hf_tokenizer(tmp_path / "unstable", UNSTABLE_TEMPLATE)
    with pytest.raises(ValueError, match="renders the turns before assistant turn 1 differently"):
        unstable.encode_messages(TWO_TURNS)


# ---------------------------------------------------------------- sources


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_messages_are_detected_per_file_or_forced(tmp_path):
    _write_jsonl(
        tmp_path / "a_chat.jsonl",
        [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:2], "system": "be brief"}],
    )
    _write_jsonl(tmp_path / "b_pairs.jsonl", [{"problem": "1+1?", "generated_solution": "2"}])
    both = load_sft_dataset(tmp_path, BYTE)
    assert [BYTE.decode(s.input_ids) for s in both.samples] == [
        BYTE.decode(BYTE.encode_messages(TWO_TURNS)[0]),
        BYTE.decode(BYTE.encode_messages([SYSTEM] + TWO_TURNS[:2])[0]),
        "<|user|>1+1?<|assistant|>2<|end|>",
    ]
    forced = load_sft_dataset(tmp_path / "a_chat.jsonl", BYTE, record_format="messages")
    assert forced.counts.kept == 2
    with pytest.raises(
        DataError,
        match=r"a_chat\.jsonl.*expected the field\(s\) \['problem', "
        r"'generated_solution'\].*missing_field=2",
    ):
        load_sft_dataset(tmp_path / "a_chat.jsonl", BYTE, record_format="prompt_response")


def test_parquet_and_saved_datasets_hold_messages(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": TWO_TURNS}, {"messages": [SYSTEM] + TWO_TURNS[:2]}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    expected = [BYTE.encode_messages(r["messages"])[0] for r in records]
    for path in (tmp_path / "chat.parquet", tmp_path / "saved"):
        assert [s.input_ids for s in load_sft_dataset(path, BYTE).samples] == expected


def test_malformed_records_are_reported_with_file_and_line(tmp_path):
    bad = [
        {"messages": "hello"},  # line 2: not a list
        {"messages": [{"role": "user", "content": "no answer"}]},  # line 3
        "{broken json",  # line 4
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},  # line 5
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},  # line 6
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "system", "content": "late"},
                {"role": "assistant", "content": "y"},
            ]
        },  # line 7
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},  # line 8
    ]
    path = _write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}] + bad + [{"messages": TWO_TURNS[:2]}]
    )
    data = load_sft_dataset(path, BYTE)
    assert (
        data.counts.kept == 2
        and data.counts.num_skipped == 7
        and [s.sample_id for s in data.samples] == [0, 8]
    )
    lines = data.counts.report_lines()
    assert lines == [
        f"{path}:2: bad_messages ('messages' is not a non-empty list of turns)",
        f"{path}:3: no_assistant_turn (no assistant turn to train on)",
        f"{path}:4: unparsable (not a JSON object)",
        f"{path}:5: bad_messages (turn 1 has role 'robot'; the roles are ['system', 'user', 'assistant'])",
        f"{path}:6: not_string (turn 1 (user): content is not a string)",
        "... and 2 more skipped record(s)",
    ]


def test_turn_problems_count_turns_from_one_and_name_what_is_wrong(tmp_path):
    user = {"role": "user", "content": "x"}
    bad = [
        {"messages": [user, {"role": "assistant", "content": "y"}, {"role": "tool", "content": "z"}]},
        {"messages": [user, "not a turn", {"role": "assistant", "content": "y"}]},
        {"messages": [user, {"role": "system", "content": "late"}, {"role": "assistant", "content": "y"}]},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}] + bad)
    assert load_sft_dataset(path, BYTE).counts.report_lines() == [
        f"{path}:2: bad_messages (turn 3 has role 'tool'; the roles are ['system', 'user', 'assistant'])",
        f"{path}:3: bad_messages (turn 2 is a str, not a {{role, content}} object)",
        f"{path}:4: bad_messages (turn 2 is a system turn; a system prompt comes first, once)",
    ]


def test_a_file_without_usable_records_is_one_recipe_error(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "x"}]}] * 3)
    with pytest.raises(RecipeError) as info:
        load_sft_dataset(path, BYTE)
    message = str(info.value)
    assert str(path) in message and "'messages'" in message and "no_assistant_turn=3" in message
    assert f"{path}:1: no_assistant_turn" in message


def test_the_example_chat_file_loads():
    data = load_sft_dataset(EXAMPLE, BYTE)
    assert len(data) == 24 and data.counts.num_skipped == 0
    turns = [
        sum(1 for m in json.loads(line)["messages"] if m["role"] == "assistant")
        for line in EXAMPLE.read_text().splitlines()
    ]
    assert {1, 2, 3} <= set(turns)
    for sample, n in zip(data.samples, turns):
        assert len(trained_runs(BYTE, sample.input_ids, sample.loss_mask)) == n


# ---------------------------------------------------------------- CP 2 = CP 1 on messages data


def _two_process_messages_cases() -> dict:
    import torch

    from relax_gdn.train import run_training

    torch.set_num_threads(1)
    # a quarter of the conversations held out and evaluated after every step
    cfg = dict(eval__every_steps=1, eval__holdout_fraction=0.25)
    return {
        f"cp{cp}": run_training(messages_cfg(parallel__cp=cp, **cfg), None, runtime=job_runtime()).records
        for cp in (1, 2)
    }


@pytest.fixture(scope="module")
def pair(gloo):
    return gloo(_two_process_messages_cases, 2)


def test_cp2_equals_cp1_on_messages_data_training_and_eval_loss(pair):
    for rank_records in pair:
        cp1, cp2 = rank_records["cp1"], rank_records["cp2"]  # CP 1 runs as DP 2 on the same samples
        assert [r["loss_tokens"] for r in cp1] == [r["loss_tokens"] for r in cp2]
        for a, b in zip(cp1, cp2):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
            assert b["eval/loss"] == pytest.approx(a["eval/loss"], rel=1e-5)
            assert b["eval/loss_tokens"] == a["eval/loss_tokens"] > 0
