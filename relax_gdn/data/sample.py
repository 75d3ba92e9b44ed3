"""One tokenized SFT sample, and a dataset of them with the account of what was skipped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Why a source record did not become a sample. Counted, never silently dropped.
SKIP_REASONS = (
    "unparsable",  # a jsonl line that is not a JSON object
    "missing_field",  # the prompt or response field is absent (or None)
    "not_string",  # the field holds something other than a string
    "empty",  # the field is an empty / whitespace-only string
    "too_long",  # tokenized length above max_sample_tokens
    "bad_messages",  # messages: not a list of {role, content} turns, or a misplaced system turn
    "no_assistant_turn",  # messages: nothing to train on
)
MAX_REPORTED_RECORDS = 5  # skipped records shown with their file and line; the rest are counted


@dataclass
class Sample:
    """One tokenized SFT sample."""

    input_ids: list[int]
    loss_mask: list[bool]  # True where the NEXT-token label counts (response tokens)
    sample_id: int

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        # The last position has no next token inside the document, so it never counts.
        return sum(self.loss_mask[: len(self.input_ids) - 1])

    @property
    def num_mtp_loss_tokens(self) -> int:
        """Positions whose token two ahead is a target of the multi-token-prediction loss: position
        i predicts token i + 2, counted where the prediction of token i + 2 counts (mask[i + 1])."""
        return sum(self.loss_mask[1 : len(self.input_ids) - 1])


def check_sample(sample: Sample) -> None:
    """Shape rules a packer relies on; a violation is a bug upstream, so it names the sample."""
    n = len(sample.input_ids)
    if n == 0:
        raise ValueError(f"sample {sample.sample_id} has no tokens; drop empty samples at the source")
    if len(sample.loss_mask) != n:
        raise ValueError(
            f"sample {sample.sample_id}: loss_mask has {len(sample.loss_mask)} entries but input_ids has "
            f"{n}; they must be aligned position by position"
        )


@dataclass
class SkipCounts:
    """How many records of a source were kept, and how many were skipped for which reason."""

    total: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_fields: list[str] | None = None  # fields of the first readable record, for error messages
    examples: list[str] = field(default_factory=list)  # "where: reason (detail)" of the first few skipped

    def skip(self, reason: str, where: str | None = None, detail: str = "") -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; known: {SKIP_REASONS}")
        self.skipped[reason] += 1
        if where is not None and len(self.examples) < MAX_REPORTED_RECORDS:
            self.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    def report_lines(self) -> list[str]:
        """The first skipped records with their file and line, then how many more there are."""
        more = self.num_skipped - len(self.examples)
        tail = [f"... and {more} more skipped record(s)"] if more > 0 and self.examples else []
        return self.examples + tail

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def as_dict(self) -> dict[str, int]:
        """Flat counts for logging: total, kept and one entry per reason (zeros included)."""
        return {"total": self.total, "kept": self.kept, **{r: self.skipped.get(r, 0) for r in SKIP_REASONS}}

    def summary(self) -> str:
        reasons = ", ".join(f"{r}={n}" for r, n in self.skipped.items() if n) or "none"
        return f"{self.kept}/{self.total} records kept; skipped: {reasons}"


@dataclass
class SFTDataset:
    """Tokenized samples of one source plus where they came from and what was skipped."""

    samples: list[Sample]
    source: str
    counts: SkipCounts

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> list[int]:
        return [len(s) for s in self.samples]
