"""Embedded data: nothing to download, deterministic from a seed.

* :func:`synthetic_math_records` / :func:`synthetic_math_dataset`: multi-step arithmetic word
  problems with a worked, step-by-step solution. The number of steps is long-tailed, so sample
  lengths vary ~10x and packing is exercised; the solution text is templated and copies numbers
  from the problem, so a tiny model's loss drops visibly within a few dozen steps.
* :func:`length_matched_samples`: random-token samples whose lengths follow a parameterised
  long-tailed distribution (:class:`LengthProfile`), for throughput benchmarks that need "a
  synthetic set with the same length distribution" as OpenMathReasoning without the data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from relax_gdn.data.sample import Sample, SFTDataset
from relax_gdn.data.sources import DEFAULT_PROMPT_FIELD, DEFAULT_RESPONSE_FIELD, tokenize_records
from relax_gdn.data.tokenizer import SFTTokenizer, next_token_loss_mask

_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena")
_ITEMS = ("apples", "marbles", "coins", "stickers", "books", "pencils", "shells", "cards")
_VALUE_CAP = 10_000  # keeps numbers short: multiplications only while the value is below this


def _operation(rng: random.Random, value: int) -> tuple[str, str, int]:
    """One step: (phrase for the problem, worked line for the solution, new value)."""
    kinds = ["add", "add", "sub", "mul", "div"]
    while True:
        kind = rng.choice(kinds)
        if kind == "add":
            k = rng.randint(1, 50)
            return f"gets {k} more", f"{value} + {k} = {value + k}", value + k
        if kind == "sub" and value > 1:
            k = rng.randint(1, value - 1)
            return f"gives away {k}", f"{value} - {k} = {value - k}", value - k
        if kind == "mul" and value < _VALUE_CAP:
            k = rng.randint(2, 4)
            return f"multiplies them by {k}", f"{value} * {k} = {value * k}", value * k
        if kind == "div":
            divisors = [k for k in (2, 3, 4, 5) if value % k == 0 and value // k > 0]
            if divisors:
                k = rng.choice(divisors)
                phrase = f"splits them into {k} equal piles and keeps one"
                return phrase, f"{value} / {k} = {value // k}", value // k


def _num_steps(rng: random.Random, min_steps: int, max_steps: int, mean_extra_steps: float) -> int:
    # Exponential tail above the minimum: most problems are short, a few are very long.
    return min(max_steps, min_steps + int(rng.expovariate(1.0 / mean_extra_steps)))


def synthetic_math_records(
    num_samples: int,
    *,
    seed: int = 0,
    min_steps: int = 1,
    max_steps: int = 20,
    mean_extra_steps: float = 6.0,
    prompt_field: str = DEFAULT_PROMPT_FIELD,
    response_field: str = DEFAULT_RESPONSE_FIELD,
) -> list[dict[str, str]]:
    """``num_samples`` word problems as records ``{prompt_field: ..., response_field: ...}``.

    Same ``seed`` -> same records (Python's ``random.Random`` is stable across platforms).
    With the byte tokenizer a sample is ~150 tokens plus ~90 per step (20 steps: ~1,900).
    """
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be a positive integer")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(
            f"need 1 <= min_steps <= max_steps, got min_steps={min_steps}, max_steps={max_steps}"
        )
    rng = random.Random(seed)
    records = []
    for _ in range(num_samples):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(2, 60)
        start = value
        phrases, lines = [], [f"{name} starts with {start} {item}."]
        for step in range(1, _num_steps(rng, min_steps, max_steps, mean_extra_steps) + 1):
            phrase, worked, value = _operation(rng, value)
            phrases.append(phrase)
            lines.append(f"Step {step}: {name} {phrase}: {worked}.")
        problem = (
            f"{name} has {start} {item}. In order, {name} "
            + ", then ".join(phrases)
            + f". How many {item} does {name} have at the end?"
        )
        lines.append(f"Answer: {value}")
        records.append({prompt_field: problem, response_field: "\n".join(lines)})
    return records


def synthetic_math_dataset(
    num_samples: int,
    tokenizer: SFTTokenizer,
    *,
    seed: int = 0,
    max_sample_tokens: int | None = None,
    **kwargs,
) -> SFTDataset:
    """The embedded default SFT set, tokenized. ``kwargs`` go to :func:`synthetic_math_records`;
    samples longer than ``max_sample_tokens`` are skipped and counted like any source's."""
    records = synthetic_math_records(num_samples, seed=seed, **kwargs)
    samples, counts = tokenize_records(
        records,
        tokenizer,
        prompt_field=DEFAULT_PROMPT_FIELD,
        response_field=DEFAULT_RESPONSE_FIELD,
        max_sample_tokens=max_sample_tokens,
    )
    if not samples:
        raise ValueError(
            f"the synthetic set has no sample within max_sample_tokens={max_sample_tokens} "
            f"({counts.summary()}): raise data.max_sample_tokens or lower max_steps"
        )
    return SFTDataset(samples=samples, source=f"synthetic_math(seed={seed})", counts=counts)


@dataclass(frozen=True)
class LengthProfile:
    """A long-tailed sample-length distribution: log-normal total length, clipped to
    ``[min_tokens, max_tokens]``; ``mean_tokens`` is the mean before clipping.

    The defaults approximate OpenMathReasoning-style long chain-of-thought SFT (mean a few
    thousand tokens, a tail past 10k); measure the real set and pass its numbers (or its exact
    lengths via ``length_matched_samples(lengths=...)``) when it is available.
    """

    mean_tokens: float = 3000.0
    sigma: float = 0.8  # log-space spread: 0.8 puts p99 near 5x the median
    min_tokens: int = 128
    max_tokens: int = 16384
    prompt_tokens: int = 96  # median prompt length; the rest of the sample is the response

    def __post_init__(self) -> None:
        if not (self.mean_tokens > 0 and self.sigma >= 0 and 2 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"bad LengthProfile {self}: need mean_tokens > 0, sigma >= 0, 2 <= min_tokens <= max_tokens"
            )
        if not 1 <= self.prompt_tokens < self.min_tokens:
            raise ValueError(f"LengthProfile.prompt_tokens={self.prompt_tokens} must be in [1, min_tokens)")

    def sample_lengths(self, num_samples: int, seed: int = 0) -> list[int]:
        rng = np.random.default_rng(seed)
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2  # mean of a log-normal is exp(mu + s^2/2)
        raw = rng.lognormal(mu, self.sigma, size=num_samples)
        return np.clip(np.rint(raw), self.min_tokens, self.max_tokens).astype(np.int64).tolist()


def length_matched_samples(
    num_samples: int,
    *,
    vocab_size: int,
    seed: int = 0,
    profile: LengthProfile | None = None,
    lengths: list[int] | None = None,
    eos_id: int | None = None,
) -> list[Sample]:
    """Random-token SFT samples with lengths from ``profile`` (or exactly ``lengths``).

    Content is uniform random ids (the loss does not fall; this is for throughput), a prompt of
    ~``profile.prompt_tokens`` without loss, then the response with loss, ending in ``eos_id``
    when given. Deterministic from ``seed``.
    """
    profile = profile or LengthProfile()
    if lengths is None:
        lengths = profile.sample_lengths(num_samples, seed)
    elif len(lengths) != num_samples:
        raise ValueError(f"got {len(lengths)} lengths for num_samples={num_samples}")
    rng = np.random.default_rng([seed, 1])  # a stream independent of the lengths'
    samples = []
    for sample_id, length in enumerate(lengths):
        length = int(length)
        if length < 2:
            raise ValueError(f"sample {sample_id}: length {length} < 2 cannot hold a prompt and a response")
        prompt = int(min(length - 1, max(1, rng.lognormal(math.log(profile.prompt_tokens), 0.5))))
        ids = rng.integers(0, vocab_size, size=length).tolist()
        if eos_id is not None:
            ids[-1] = eos_id
        samples.append(
            Sample(
                input_ids=ids,
                loss_mask=next_token_loss_mask([False] * prompt + [True] * (length - prompt)),
                sample_id=sample_id,
            )
        )
    return samples


def length_stats(lengths: list[int]) -> dict[str, float]:
    """Summary of a length distribution (to compare a synthetic set with a real one)."""
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0}
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
        "s_eff": float((arr**2).sum() / arr.sum()),  # sum L^2 / sum L: what attention FLOPs see
    }
