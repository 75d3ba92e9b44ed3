"""Host time of building one long micro-batch, by length and CP size (CPU only, no model).

    python -m relax_gdn.bench.batching [--lengths 8192,32768,65536,131072] [--cp 1,2,4] [--repeats 7]

Random-token samples of the 9B's vocabulary with log-normal lengths (mean a quarter of the
micro-batch, 1k up to the micro-batch or 64k), packed first-fit; per length the micro-batch with
the most documents. Per micro-batch, medians
of ``--repeats`` interleaved runs, milliseconds:

* ``pack``: the samples' token lists and loss masks into the packed host arrays, as
  ``relax_gdn.data.batching.pack_host_arrays`` does it, beside the per-sample ``np.asarray`` of the
  loss mask it replaced (``before``, kept here only for this comparison);
* ``micro-batch``: all of ``make_micro_batch`` (rank 0; routes prebuilt at CP > 1), on CPU tensors
  (the pinned uploads of a GPU run are not included);
* ``attention plan``: the CP attention's per-micro-batch plan (varlen segments, the dense index)
  and, separately, FlexAttention's block mask (only with ``model.attention_backend=flex``; its tile
  classes are host numpy, torch's ``BlockMask.from_kv_blocks`` runs where the tensors are, here on
  the CPU, on a GPU as device ops);
* ``gdn``: GDN's boundary checks and FLA's chunk indices (host in, host out).

The whole of it is a few tens of milliseconds at 128k tokens against seconds of GPU work per
micro-batch: the host's packing is not what leaves a 64k step's GPU idle (``bench.train_e2e
--profile`` names the host ops behind the longest gaps, and ``alloc_retries`` counts the caching
allocator's stalls).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch

VOCAB = 248_320


def _pack_before(samples, padded, pad_id):
    """The packing of ``make_micro_batch`` before ``pack_host_arrays``: each loss mask converted
    with ``np.asarray`` over its list of bools (kept here for the side-by-side only)."""
    total = sum(padded)
    tokens = np.full(total, pad_id, dtype=np.int64)
    labels = np.full(total, pad_id, dtype=np.int64)
    loss_mask = np.zeros(total, dtype=np.float32)
    start = 0
    for sample, p in zip(samples, padded):
        n = len(sample)
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        tokens[start : start + n] = ids
        labels[start : start + n - 1] = ids[1:]
        loss_mask[start : start + n - 1] = np.asarray(sample.loss_mask[: n - 1], dtype=np.float32)
        start += p
    return tokens, labels, loss_mask


def micro_batch_samples(tokens: int, seed: int):
    """Samples of one packed micro-batch of at most ``tokens`` (first-fit, longest first)."""
    from relax_gdn.data import LengthProfile, length_matched_samples, plan_micro_batches

    profile = LengthProfile(
        mean_tokens=tokens / 4,
        sigma=0.8,
        min_tokens=min(1024, tokens),
        max_tokens=min(tokens, 65536),
        prompt_tokens=96,
    )
    count = 16
    lengths = [min(n, tokens) for n in profile.sample_lengths(count, seed)]
    samples = length_matched_samples(
        count, vocab_size=VOCAB, seed=seed, profile=profile, lengths=lengths, eos_id=1
    )
    plan = plan_micro_batches(samples, max_tokens_per_gpu=tokens, cp_size=1)
    return max(plan[0], key=lambda mb: (len(mb), sum(len(s) for s in mb)))  # the most documents


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(tokens: int, cp: int, repeats: int, seed: int) -> dict:
    from relax_gdn.data import make_micro_batch, padded_length
    from relax_gdn.data.batching import pack_host_arrays
    from relax_gdn.layout import resolve_cu_seqlens
    from relax_gdn.model.attention import zigzag_attention_plan

    samples = micro_batch_samples(tokens, seed)
    padded = [padded_length(len(s), cp) for s in samples]
    cpu = torch.device("cpu")
    times: dict[str, list[float]] = {
        k: [] for k in ("before", "pack", "micro_batch", "plan", "flex_mask", "gdn")
    }
    for _ in range(repeats):  # interleaved: the machine's load moves every column alike
        times["before"].append(_ms(lambda: _pack_before(samples, padded, 0)))
        times["pack"].append(_ms(lambda: pack_host_arrays(samples, padded, 0)))
        start = time.perf_counter()
        mb = make_micro_batch(
            samples,
            cp_size=cp,
            cp_rank=0,
            device=cpu,
            pad_id=0,
            route_strategy="prebuild" if cp > 1 else "lazy_cache",
        )
        times["micro_batch"].append((time.perf_counter() - start) * 1e3)
        psp, local = mb.packed_seq_params, mb.tokens.shape[1]
        times["gdn"].append(
            _ms(functools.partial(_gdn_host, psp, local * cp, cp, resolve_cu_seqlens))
        )  # caches
        plan = functools.partial(zigzag_attention_plan, psp, local, cp, 0, cpu)
        times["plan"].append(_ms(lambda plan=plan: (plan().varlen, plan().dense)))
        times["flex_mask"].append(_ms(lambda plan=plan: plan().flex_block_mask))
    return {
        "tokens": tokens,
        "cp": cp,
        "documents": len(samples),
        "real_tokens": sum(len(s) for s in samples),
        **{k: statistics.median(v) for k, v in times.items() if v},
    }


def _gdn_host(psp, total: int, cp: int, resolve_cu_seqlens) -> None:
    resolved = resolve_cu_seqlens(psp, total, cp)
    try:
        from fla.ops.utils import prepare_chunk_indices
    except ImportError:  # FLA absent: the checks alone
        return
    prepare_chunk_indices(torch.from_numpy(resolved.host), 64)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="8192,32768,65536,131072")
    parser.add_argument("--cp", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(
        f"{'tokens':>8}{'cp':>4}{'docs':>6}{'pack before':>13}{'pack':>8}{'speed-up':>10}{'micro-batch':>13}"
        f"{'attn plan':>11}{'flex mask':>11}{'gdn':>7}   (host ms per micro-batch, medians)"
    )
    for tokens in (int(x) for x in args.lengths.split(",")):
        for cp in (int(x) for x in args.cp.split(",")):
            r = measure(tokens, cp, args.repeats, args.seed)
            rows.append(r)
            print(
                f"{tokens:>8}{cp:>4}{r['documents']:>6}{r['before']:>13.2f}{r['pack']:>8.2f}"
                f"{r['before'] / r['pack']:>9.1f}x{r['micro_batch']:>13.2f}{r['plan']:>11.2f}"
                f"{r['flex_mask']:>11.2f}{r['gdn']:>7.2f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    from relax_gdn.runtime import Runtime

    with Runtime():  # every process-wide change of the benchmark, undone when it ends
        main()
