"""SFT sources on disk: jsonl, parquet, or a ``datasets`` dataset saved with ``save_to_disk``.

Records are dicts with a prompt field and a response field (OpenMathReasoning-mini names by
default: ``problem`` / ``generated_solution``). A broken record is skipped and counted by reason
(:data:`~relax_gdn.data.sample.SKIP_REASONS`); a source that yields nothing usable raises a
:class:`~relax_gdn.errors.DataError` naming the path, the fields and the fix, at load time,
before training starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from relax_gdn.data.sample import Sample, SFTDataset, SkipCounts
from relax_gdn.data.tokenizer import SFTTokenizer
from relax_gdn.errors import DataError

DEFAULT_PROMPT_FIELD = "problem"
DEFAULT_RESPONSE_FIELD = "generated_solution"
SOURCE_FORMATS = ("jsonl", "parquet", "hf_disk")

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


def _jsonl_records(path: Path) -> Iterator[object]:
    for file in _files(path, "*.jsonl"):
        with file.open("r", encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue  # blank lines separate nothing; not a record
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    yield _UNPARSABLE
                    continue
                yield record if isinstance(record, dict) else _UNPARSABLE


def _check_columns(where: str, available: list[str], fields: tuple[str, str]) -> None:
    missing = [f for f in fields if f not in available]
    if missing:
        raise DataError(
            f"data source {where!r} has no field(s) {missing}; its fields are {available}. Set the prompt/"
            "response field names (data.prompt_field / data.response_field) to columns that exist"
        )


def _parquet_records(path: Path, fields: tuple[str, str]) -> Iterator[object]:
    import pyarrow.parquet as pq

    for file in _files(path, "*.parquet"):
        parquet = pq.ParquetFile(file)
        _check_columns(str(file), parquet.schema_arrow.names, fields)
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=list(fields)):
            yield from batch.to_pylist()


def _hf_disk_records(path: Path, fields: tuple[str, str], split: str) -> Iterator[object]:
    import datasets  # imported here: it takes seconds, and only this format needs it

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"data source {str(path)!r} has splits {list(loaded)}, not {split!r}: "
                "set the split (data.split)"
            )
        loaded = loaded[split]
    _check_columns(str(path), list(loaded.column_names), fields)
    yield from loaded.select_columns(list(fields))


def read_records(path: str | os.PathLike, *, fields: tuple[str, str], format: str | None = None,
                 split: str = "train") -> Iterator[object]:
    """Yield every record of the source in storage order (dicts; unreadable jsonl lines as a sentinel
    that the tokenizing loop counts as ``unparsable``). Directories are read file by file, sorted."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(
            f"data source {str(path)!r} does not exist: set the data path (data.path) to a jsonl/parquet "
            "file or directory, or use the embedded synthetic set"
        )
    format = format or detect_format(path)
    if format == "jsonl":
        return _jsonl_records(path)
    if format == "parquet":
        return _parquet_records(path, fields)
    if format == "hf_disk":
        return _hf_disk_records(path, fields, split)
    raise DataError(f"unknown data source format {format!r}: use one of {SOURCE_FORMATS}")


def _check_max_sample_tokens(max_sample_tokens: int | None) -> None:
    if max_sample_tokens is None:
        return
    if not isinstance(max_sample_tokens, int) or isinstance(max_sample_tokens, bool) or max_sample_tokens < 2:
        raise ValueError(
            f"max_sample_tokens={max_sample_tokens!r} must be an integer >= 2 (or None for no limit)"
        )


def _skip_reason(record: object, fields: tuple[str, str]) -> str | None:
    if record is _UNPARSABLE:
        return "unparsable"
    for name in fields:
        value = record.get(name)
        if value is None:
            return "missing_field"
        if not isinstance(value, str):
            return "not_string"
        if not value.strip():
            return "empty"
    return None


def tokenize_records(
    records, tokenizer: SFTTokenizer, *, prompt_field: str, response_field: str,
    max_sample_tokens: int | None = None, max_samples: int | None = None,
) -> tuple[list[Sample], SkipCounts]:
    """Tokenize records into samples (``sample_id`` = the record's index in the source), skipping
    and counting broken ones. Stops after ``max_samples`` kept samples when given."""
    _check_max_sample_tokens(max_sample_tokens)
    fields = (prompt_field, response_field)
    counts, samples = SkipCounts(), []
    for index, record in enumerate(records):
        if max_samples is not None and counts.kept >= max_samples:
            break
        counts.total += 1
        if counts.first_fields is None and isinstance(record, dict):
            counts.first_fields = list(record)
        reason = _skip_reason(record, fields)
        if reason is None:
            input_ids, loss_mask = tokenizer.encode_sft(record[prompt_field], record[response_field])
            if max_sample_tokens is not None and len(input_ids) > max_sample_tokens:
                reason = "too_long"
        if reason is not None:
            counts.skip(reason)
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
            f"no record has both fields {list(fields)} (the first record has {counts.first_fields}): "
            "set data.prompt_field / data.response_field"
        ),
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
) -> SFTDataset:
    """Read, validate and tokenize an SFT source. Raises ``DataError`` (path, fields, fix) when the
    source is missing or yields no usable record; skipped records are in ``dataset.counts``."""
    fields = (prompt_field, response_field)
    for name in fields:
        if not isinstance(name, str) or not name:
            raise DataError(
                f"field name {name!r} must be a non-empty string (data.prompt_field / data.response_field)"
            )
    records = read_records(path, fields=fields, format=format, split=split)
    samples, counts = tokenize_records(
        records, tokenizer, prompt_field=prompt_field, response_field=response_field,
        max_sample_tokens=max_sample_tokens, max_samples=max_samples,
    )
    if not samples:
        raise DataError(
            f"data source {str(path)!r} has no usable record ({counts.summary()}): "
            f"{_unusable_source_fix(counts, fields, max_sample_tokens)}"
        )
    return SFTDataset(samples=samples, source=str(path), counts=counts)
