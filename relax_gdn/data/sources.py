"""SFT sources on disk: jsonl, parquet, or a ``datasets`` dataset saved with ``save_to_disk``.

Two record formats (:data:`RECORD_FORMATS`), chosen per file (``auto``: a ``messages`` field
present means ``messages``) or forced:

* ``prompt_response``: a prompt field and a response field (OpenMathReasoning-mini names by
  default: ``problem`` / ``generated_solution``), one user turn and one assistant turn;
* ``messages``: a list of ``{"role", "content"}`` turns (roles system/user/assistant, a system
  turn only first; a top-level ``system`` string is prepended as one), at least one assistant
  turn; rendered with the tokenizer's chat template, loss on the assistant turns only.

A broken record is skipped and counted by reason (:data:`~relax_gdn.data.sample.SKIP_REASONS`),
the first few with their file and line (or row) in ``counts.examples``; a source that yields
nothing usable raises :class:`DataError` naming the path, the fields it expected and the
fix, at load time, before training starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from relax_gdn.choices import RECORD_FORMATS
from relax_gdn.data.sample import Sample, SFTDataset, SkipCounts
from relax_gdn.data.tokenizer import ROLES, SFTTokenizer
from relax_gdn.errors import DataError

DEFAULT_PROMPT_FIELD = "problem"
DEFAULT_RESPONSE_FIELD = "generated_solution"
SOURCE_FORMATS = ("jsonl", "parquet", "hf_disk")
MESSAGES_FIELD = "messages"
SYSTEM_FIELD = "system"  # optional top-level system prompt of a messages record

# what sets the longest sample kept (relax_gdn.config.schema.RunConfig.sample_token_limit)
SAMPLE_LIMIT_KEYS = "data.max_sample_tokens; when null, train.max_tokens_per_gpu x CP size"

_UNPARSABLE = object()  # a record slot that could not be read as a dict
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
_PARQUET_BATCH_ROWS = 1024


def detect_format(path: Path) -> str:
    """The source format of ``path`` from its suffix or, for a directory, from what it holds."""
    if path.is_dir():
        if any((path / marker).exists() for marker in _HF_DISK_MARKERS):
            return "hf_disk"
        if any(path.rglob("*.parquet")):
            return "parquet"
        if any(path.rglob("*.jsonl")):
            return "jsonl"
        raise DataError(
            f"data source directory {str(path)!r} holds no dataset: expected a `datasets` save_to_disk "
            "directory (dataset_info.json / state.json), *.parquet or *.jsonl files"
        )
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise DataError(
        f"cannot tell the format of data source {str(path)!r} from its suffix {suffix!r}: use a .jsonl or "
        ".parquet file, a directory of them, or a `datasets` save_to_disk directory "
        f"(formats: {SOURCE_FORMATS})"
    )


def _files(path: Path, pattern: str) -> list[Path]:
    return sorted(path.rglob(pattern)) if path.is_dir() else [path]


def _file_format(record_format: str, has_messages: bool) -> str:
    if record_format == "auto":
        return "messages" if has_messages else "prompt_response"
    return record_format


def _jsonl_records(path: Path, record_format: str) -> Iterator[tuple[str, str, object]]:
    for file in _files(path, "*.jsonl"):
        file_format = None if record_format == "auto" else record_format
        with file.open("r", encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue  # blank lines separate nothing; not a record
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = _UNPARSABLE
                if not isinstance(record, dict):
                    record = _UNPARSABLE
                elif file_format is None:  # auto: the file's first object decides
                    file_format = _file_format(record_format, MESSAGES_FIELD in record)
                yield f"{file}:{number}", file_format or "prompt_response", record


def _fields(record_format: str, prompt_response: tuple[str, str], available: list[str]) -> list[str]:
    if record_format == "messages":
        return [MESSAGES_FIELD] + ([SYSTEM_FIELD] if SYSTEM_FIELD in available else [])
    return list(prompt_response)


def _check_columns(where: str, available: list[str], fields: list[str]) -> None:
    missing = [f for f in fields if f not in available]
    if missing:
        raise DataError(
            f"data source {where!r} has no field(s) {missing}; its fields are {available}. Set the prompt/"
            "response field names (data.prompt_field / data.response_field) to columns that exist, or give "
            f"it a {MESSAGES_FIELD!r} column of {{role, content}} turns (data.format=auto|messages)"
        )


def _parquet_records(
    path: Path, record_format: str, fields: tuple[str, str]
) -> Iterator[tuple[str, str, object]]:
    import pyarrow.parquet as pq

    for file in _files(path, "*.parquet"):
        parquet = pq.ParquetFile(file)
        names = parquet.schema_arrow.names
        file_format = _file_format(record_format, MESSAGES_FIELD in names)
        columns = _fields(file_format, fields, names)
        _check_columns(str(file), names, columns)
        row = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
            for record in batch.to_pylist():
                row += 1
                yield f"{file} row {row}", file_format, record


def _hf_disk_records(
    path: Path, record_format: str, fields: tuple[str, str], split: str
) -> Iterator[tuple[str, str, object]]:
    import datasets  # imported here: it takes seconds, and only this format needs it

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"data source {str(path)!r} has splits {list(loaded)}, not {split!r}: "
                "set the split (data.split)"
            )
        loaded = loaded[split]
    names = list(loaded.column_names)
    file_format = _file_format(record_format, MESSAGES_FIELD in names)
    columns = _fields(file_format, fields, names)
    _check_columns(str(path), names, columns)
    for row, record in enumerate(loaded.select_columns(columns), start=1):
        yield f"{path} [{split}] row {row}", file_format, record


def read_located_records(
    path: str | os.PathLike,
    *,
    fields: tuple[str, str],
    format: str | None = None,
    split: str = "train",
    record_format: str = "auto",
) -> Iterator[tuple[str, str, object]]:
    """Yield ``(where, record format, record)`` for every record of the source in storage order:
    ``where`` is ``file:line`` (jsonl) or ``file row N``; unreadable jsonl lines are a sentinel
    that the tokenizing loop counts as ``unparsable``. Directories are read file by file, sorted."""
    if record_format not in RECORD_FORMATS:
        raise DataError(f"data.format={record_format!r} is not one of {RECORD_FORMATS}")
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(
            f"data source {str(path)!r} does not exist: set the data path (data.path) to a jsonl/parquet "
            "file or directory, or use the embedded synthetic set"
        )
    format = format or detect_format(path)
    if format == "jsonl":
        return _jsonl_records(path, record_format)
    if format == "parquet":
        return _parquet_records(path, record_format, fields)
    if format == "hf_disk":
        return _hf_disk_records(path, record_format, fields, split)
    raise DataError(f"unknown data source format {format!r}: use one of {SOURCE_FORMATS}")


def _check_max_sample_tokens(max_sample_tokens: int | None) -> None:
    if max_sample_tokens is None:
        return
    if not isinstance(max_sample_tokens, int) or isinstance(max_sample_tokens, bool) or max_sample_tokens < 2:
        raise ValueError(
            f"max_sample_tokens={max_sample_tokens!r} must be an integer >= 2 (or None for no limit)"
        )


def _prompt_response_problem(record: dict, fields: tuple[str, str]) -> tuple[str, str] | None:
    for name in fields:
        value = record.get(name)
        if value is None:
            return "missing_field", f"no {name!r} field"
        if not isinstance(value, str):
            return "not_string", f"{name!r} is a {type(value).__name__}, not a string"
        if not value.strip():
            return "empty", f"{name!r} is empty"
    return None


def _messages_problem(record: dict) -> tuple[str, str] | None:
    turns = record.get(MESSAGES_FIELD)
    if turns is None:
        return "missing_field", f"no {MESSAGES_FIELD!r} field"
    if not isinstance(turns, (list, tuple)) or not turns:
        return "bad_messages", f"{MESSAGES_FIELD!r} is not a non-empty list of turns"
    system = record.get(SYSTEM_FIELD)
    if system is not None and not isinstance(system, str):
        return "not_string", f"{SYSTEM_FIELD!r} is a {type(system).__name__}, not a string"
    for number, turn in enumerate(turns, start=1):  # counted from 1, as a person counts turns
        if not isinstance(turn, dict):
            return "bad_messages", f"turn {number} is a {type(turn).__name__}, not a {{role, content}} object"
        if turn.get("role") not in ROLES:
            return "bad_messages", f"turn {number} has role {turn.get('role')!r}; the roles are {list(ROLES)}"
        if not isinstance(turn.get("content"), str):
            return "not_string", f"turn {number} ({turn['role']}): content is not a string"
        if turn["role"] == "system" and (number > 1 or system is not None):
            return "bad_messages", f"turn {number} is a system turn; a system prompt comes first, once"
    if not any(turn["role"] == "assistant" for turn in turns):
        return "no_assistant_turn", "no assistant turn to train on"
    if any(turn["role"] == "assistant" and not turn["content"].strip() for turn in turns):
        return "empty", "an assistant turn is empty"
    return None


def _conversation(record: dict) -> list[dict]:
    """The turns of a valid messages record ({role, content} only; the system field prepended)."""
    turns = [{"role": t["role"], "content": t["content"]} for t in record[MESSAGES_FIELD]]
    system = record.get(SYSTEM_FIELD)
    return ([{"role": "system", "content": system}] if system else []) + turns


def tokenize_records(
    records,
    tokenizer: SFTTokenizer,
    *,
    prompt_field: str,
    response_field: str,
    max_sample_tokens: int | None = None,
    max_samples: int | None = None,
    record_format: str = "prompt_response",
) -> tuple[list[Sample], SkipCounts]:
    """Tokenize records into samples (``sample_id`` = the record's index in the source), skipping
    and counting broken ones. Stops after ``max_samples`` kept samples when given.

    ``records``: dicts in ``record_format`` ("messages" or "prompt_response"), or the
    ``(where, record format, record)`` triples of :func:`read_located_records` (then each
    skipped record is reported with its ``where``)."""
    _check_max_sample_tokens(max_sample_tokens)
    fields = (prompt_field, response_field)
    counts, samples = SkipCounts(), []
    for index, item in enumerate(records):
        if max_samples is not None and counts.kept >= max_samples:
            break
        where, fmt, record = item if isinstance(item, tuple) else (f"record {index}", record_format, item)
        counts.total += 1
        if counts.first_fields is None and isinstance(record, dict):
            counts.first_fields = list(record)
        if record is _UNPARSABLE:
            problem = ("unparsable", "not a JSON object")
        elif fmt == "messages":
            problem = _messages_problem(record)
        else:
            problem = _prompt_response_problem(record, fields)
        if problem is None:
            if fmt == "messages":
                input_ids, loss_mask = tokenizer.encode_messages(_conversation(record))
            else:
                input_ids, loss_mask = tokenizer.encode_sft(record[prompt_field], record[response_field])
            if max_sample_tokens is not None and len(input_ids) > max_sample_tokens:
                problem = (
                    "too_long",
                    f"{len(input_ids)} tokens > {max_sample_tokens} allowed ({SAMPLE_LIMIT_KEYS})",
                )
        if problem is not None:
            counts.skip(problem[0], where=where, detail=problem[1])
            continue
        samples.append(Sample(input_ids=input_ids, loss_mask=loss_mask, sample_id=index))
        counts.kept += 1
    return samples, counts


def _unusable_source_fix(counts: SkipCounts, fields: tuple[str, str], max_sample_tokens: int | None) -> str:
    if counts.total == 0:
        return "the source holds no records; point data.path at a non-empty file"
    worst = counts.skipped.most_common(1)[0][0]
    return {
        "unparsable": "the file is not JSON lines (one JSON object per line)",
        "missing_field": (
            f"no record has the fields {list(fields)} or {MESSAGES_FIELD!r} (the first record has "
            f"{counts.first_fields}): set data.prompt_field / data.response_field, or data.format"
        ),
        "bad_messages": f"{MESSAGES_FIELD!r} must be a list of {{role, content}} turns, roles {list(ROLES)}",
        "no_assistant_turn": "every conversation needs at least one assistant turn (the trained text)",
        "not_string": f"the fields {list(fields)} do not hold strings: pick text fields",
        "empty": f"the fields {list(fields)} are empty strings",
        "too_long": (
            f"every record is longer than max_sample_tokens={max_sample_tokens}: raise data.max_sample_tokens"
        ),
    }[worst]


def load_sft_dataset(
    path: str | os.PathLike,
    tokenizer: SFTTokenizer,
    *,
    prompt_field: str = DEFAULT_PROMPT_FIELD,
    response_field: str = DEFAULT_RESPONSE_FIELD,
    max_sample_tokens: int | None = None,
    max_samples: int | None = None,
    format: str | None = None,
    split: str = "train",
    record_format: str = "auto",
) -> SFTDataset:
    """Read, validate and tokenize an SFT source. Raises :class:`DataError` (path, fields,
    fix) when the source is missing or yields no usable record; skipped records are in
    ``dataset.counts`` (``counts.report()`` says which, with file and line)."""
    fields = (prompt_field, response_field)
    for name in fields:
        if not isinstance(name, str) or not name:
            raise DataError(
                f"field name {name!r} must be a non-empty string (data.prompt_field / data.response_field)"
            )
    records = read_located_records(
        path, fields=fields, format=format, split=split, record_format=record_format
    )
    samples, counts = tokenize_records(
        records,
        tokenizer,
        prompt_field=prompt_field,
        response_field=response_field,
        max_sample_tokens=max_sample_tokens,
        max_samples=max_samples,
    )
    if not samples:
        expected = {
            "auto": f"{list(fields)} or {MESSAGES_FIELD!r}",
            "messages": repr(MESSAGES_FIELD),
            "prompt_response": str(list(fields)),
        }[record_format]
        raise DataError(
            f"data source {str(path)!r} has no usable record (expected the field(s) {expected}; "
            f"{counts.summary()}): {_unusable_source_fix(counts, fields, max_sample_tokens)}"
            + "".join(f"\n  {line}" for line in counts.report_lines())
        )
    return SFTDataset(samples=samples, source=str(path), counts=counts)
