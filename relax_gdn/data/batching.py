"""Dynamic batching: samples -> global batches -> packed micro-batches -> this rank's CP shard.

Three steps, each deterministic from the sample order so every rank computes the same answer
without communication:

1. :func:`global_batches`: a seeded shuffle per epoch, cut into global batches of
   ``global_batch_size`` samples.
2. :func:`plan_micro_batches`: split one global batch over DP ranks into micro-batches whose
   padded token count fits ``train.max_tokens_per_gpu x cp`` (first-fit-decreasing by length,
   then tokens balanced over DP ranks with the SAME number of micro-batches on every rank).
3. :func:`make_micro_batch`: pack one micro-batch, pad each document to a multiple of ``2·cp``,
   build the GLOBAL padded ``cu_seqlens`` (device tensor + host copy) and cut every per-token
   tensor to this CP rank's zigzag shard (docs/design/LAYOUTS.md §1).

Loss accounting: a label position belongs to exactly one document and each global position
to exactly one CP rank's shard, and each sample to exactly one DP rank's micro-batch, so summing
``loss_mask`` over all CP and DP ranks counts every loss token once. ``MicroBatch.num_loss_tokens``
is that count for the whole micro-batch; the loop divides the summed per-token loss of a step by
the step's global total.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from relax_gdn.data.sample import Sample, check_sample
from relax_gdn.layout import ROUTE_STRATEGIES, attach_host_cu_seqlens, prebuild_routes, thd_rank_indices
from relax_gdn.layout.partition import check_cp, padded_length
from relax_gdn.layout.route import upload_rows

if TYPE_CHECKING:  # importing Megatron-Core costs seconds; only make_micro_batch needs it
    from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class MicroBatch:
    """This rank's zigzag shard of one packed micro-batch."""

    tokens: torch.Tensor  # [1, t_local] int64
    # [1, t_local] int64: next token of the same document; pad_id where none (also the input of the
    # multi-token-prediction layer: each position's next token)
    labels: torch.Tensor
    loss_mask: torch.Tensor  # [1, t_local] float32: 1 where the label counts; 0 on padding/prompt/doc ends
    position_ids: torch.Tensor  # [1, t_local] int64: GLOBAL position within its (padded) document
    packed_seq_params: PackedSeqParams  # thd; cu_seqlens(_padded) = global padded boundaries (one tensor)
    num_loss_tokens: int  # loss tokens of the WHOLE micro-batch (all CP ranks)
    num_real_tokens: int  # non-padding tokens of the whole micro-batch
    num_samples: int
    cp_size: int
    seq_lengths: list[int]  # unpadded document lengths (FLOPs: sum L^2 / sum L)
    # multi-token prediction (make_micro_batch(mtp=True), else None): [1, t_local] the label of the
    # next position of the same document (the token two ahead), pad_id where none; and its loss mask
    mtp_labels: torch.Tensor | None = None
    mtp_loss_mask: torch.Tensor | None = None

    @property
    def num_padded_tokens(self) -> int:
        """Global tokens the model processes, padding included (this rank holds 1/cp of them)."""
        return self.tokens.shape[1] * self.cp_size


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_max_tokens_per_gpu(max_tokens_per_gpu) -> int:
    """``train.max_tokens_per_gpu`` must be an even integer >= 2.

    Why even: every document is padded to a multiple of ``2·cp``, so a micro-batch holds a whole
    number of ``2·cp`` units; with an even value the limit ``max_tokens_per_gpu·cp`` is itself a
    whole number of units, and each rank's share (total / cp) never exceeds ``max_tokens_per_gpu``.
    """
    if not _is_int(max_tokens_per_gpu) or max_tokens_per_gpu < 2 or max_tokens_per_gpu % 2:
        hint = ""
        if _is_int(max_tokens_per_gpu) and max_tokens_per_gpu >= 2:
            hint = f" (e.g. {max_tokens_per_gpu + 1})"
        raise ValueError(
            f"train.max_tokens_per_gpu={max_tokens_per_gpu!r} must be an even integer >= 2{hint}: it is the "
            "per-GPU token budget of a micro-batch, and documents are padded to multiples of 2*cp"
        )
    return int(max_tokens_per_gpu)


def _check_positive_int(name: str, value) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def _split_in_two(items: list[int], padded: list[int]) -> tuple[list[int], list[int]]:
    """Split a bin's samples into two bins of balanced tokens (longest first, to the lighter half)."""
    halves, loads = ([], []), [0, 0]
    for i in sorted(items, key=lambda i: (-padded[i], i)):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += padded[i]
    return halves


def plan_micro_batches(
    samples: list[Sample], *, max_tokens_per_gpu: int, cp_size: int, dp_size: int = 1
) -> list[list[list[Sample]]]:
    """Deterministic plan ``[dp_rank][micro_batch_index] -> samples`` for one global batch.

    * Capacity: each micro-batch's padded total (every document padded to a multiple of
      ``2·cp_size``) is <= ``max_tokens_per_gpu * cp_size``, i.e. <= ``max_tokens_per_gpu`` per rank.
    * Packing: samples sorted by padded length (longest first, ties by position), first-fit-
      decreasing into micro-batches.
    * Equal counts: every DP rank gets the same number of micro-batches (DDP's gradient sync and
      accumulation must match). When the count is not a multiple of ``dp_size``, the micro-batch
      with the most samples is split in two (balanced by tokens) until it is. Only if no
      micro-batch can be split (fewer samples than needed) is an EMPTY micro-batch ``[]`` added;
      :func:`make_micro_batch` turns it into a padding-only micro-batch without loss tokens.
    * Balance: micro-batches go, heaviest first, to the DP rank with the fewest tokens so far
      among those with room; each rank's list is ordered heaviest first.
    * Within a micro-batch, samples keep their order in ``samples``.

    Every sample appears exactly once. A sample longer than the capacity raises ``ValueError``.
    """
    max_tokens_per_gpu = check_max_tokens_per_gpu(max_tokens_per_gpu)
    cp_size = _check_positive_int("cp_size (parallel.cp)", cp_size)
    dp_size = _check_positive_int("dp_size", dp_size)
    capacity = max_tokens_per_gpu * cp_size
    padded = _padded_lengths(samples, max_tokens_per_gpu, cp_size)
    bins, loads = _first_fit_decreasing(padded, capacity)
    _split_to_multiple(bins, loads, padded, dp_size)
    assignment = _assign_to_ranks(bins, loads, dp_size, no_sample=len(samples))
    return [[[samples[i] for i in sorted(bins[b])] for b in assignment[rank]] for rank in range(dp_size)]


def _padded_lengths(samples: list[Sample], max_tokens_per_gpu: int, cp_size: int) -> list[int]:
    """Every sample's length padded to a multiple of ``2·cp_size``; a sample above the micro-batch
    limit raises ``ValueError``."""
    capacity = max_tokens_per_gpu * cp_size
    padded = []
    for s in samples:
        check_sample(s)
        p = padded_length(len(s), cp_size)
        if p > capacity:
            raise ValueError(
                f"sample {s.sample_id} has {len(s)} tokens ({p} after padding to a multiple of "
                f"2*cp={2 * cp_size}), above the micro-batch limit train.max_tokens_per_gpu * cp = "
                f"{max_tokens_per_gpu} * {cp_size} = {capacity}: raise train.max_tokens_per_gpu or "
                f"parallel.cp, or drop over-long samples at the source (data.max_sample_tokens <= {capacity})"
            )
        padded.append(p)
    return padded


def _first_fit_decreasing(padded: list[int], capacity: int) -> tuple[list[list[int]], list[int]]:
    """Sample indices packed into bins of at most ``capacity`` padded tokens (longest first, ties by
    position, each into the first bin with room), and each bin's load."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(padded)), key=lambda i: (-padded[i], i)):
        for b, load in enumerate(loads):
            if load + padded[i] <= capacity:
                bins[b].append(i)
                loads[b] += padded[i]
                break
        else:
            bins.append([i])
            loads.append(padded[i])
    return bins, loads


def _split_to_multiple(bins: list[list[int]], loads: list[int], padded: list[int], dp_size: int) -> None:
    """In place: split the bin with the most samples in two until the bin count is a multiple of
    ``dp_size`` (at least ``dp_size``); empty bins make up the rest when none can be split."""
    target = max(dp_size, -(-len(bins) // dp_size) * dp_size)
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins += [[] for _ in range(target - len(bins))]
            loads += [0] * (target - len(loads))
            break
        b = max(splittable, key=lambda b: (len(bins[b]), loads[b], -b))
        first, second = _split_in_two(bins[b], padded)
        bins[b], loads[b] = first, sum(padded[i] for i in first)
        bins.append(second)
        loads.append(sum(padded[i] for i in second))


def _assign_to_ranks(
    bins: list[list[int]], loads: list[int], dp_size: int, *, no_sample: int
) -> list[list[int]]:
    """Bin indices per DP rank, the same count on each: heaviest bin first, to the rank with the
    fewest tokens so far among those with room (``no_sample``: the sort key of an empty bin)."""
    per_rank = len(bins) // dp_size
    assignment: list[list[int]] = [[] for _ in range(dp_size)]
    rank_loads = [0] * dp_size
    for b in sorted(range(len(bins)), key=lambda b: (-loads[b], min(bins[b], default=no_sample), b)):
        open_ranks = [r for r in range(dp_size) if len(assignment[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: (rank_loads[r], r))
        assignment[rank].append(b)
        rank_loads[rank] += loads[b]
    return assignment


def make_micro_batch(
    samples: list[Sample],
    *,
    cp_size: int,
    cp_rank: int,
    device: torch.device | str,
    pad_id: int,
    route_strategy: str = "lazy_cache",
    cp_group: dist.ProcessGroup | None = None,
    carries_cp_group: bool = False,
    mtp: bool = False,
) -> MicroBatch:
    """Pack ``samples`` (in order) into this CP rank's zigzag shard.

    Each document is padded at its end to a multiple of ``2·cp_size`` (the padding belongs to the
    document's span in ``cu_seqlens``: causal attention keeps it out of the real tokens, and it
    carries no loss). ``cu_seqlens_q/kv`` and their ``_padded`` twins are ONE int32 device tensor
    of global padded boundaries, with its host copy attached (``attach_host_cu_seqlens``) so no
    layer needs a device->host sync. With ``route_strategy="prebuild"`` and ``cp_size > 1`` the
    zigzag<->contiguous route (one object serves both directions) is built here; ``cp_group``,
    when given, must have ``cp_size`` ranks with this process at ``cp_rank``. ``carries_cp_group``
    (dynamic CP, where each micro-batch runs on its own sub-group): the ``PackedSeqParams`` carry
    ``cp_group`` and ``local_cp_size``, where every layer finds them (``resolve_cp_group``); static
    CP leaves them unset, the layers use the model's CP group.
    ``mtp``: the multi-token-prediction targets too (:func:`pack_mtp_host_arrays`), shifted on the
    whole packed sequence and sharded like the rest, so no CP rank needs another's tokens.
    An empty ``samples`` gives a padding-only micro-batch of ``2·cp_size`` tokens, no loss.
    """
    _check_micro_batch_args(
        samples,
        cp_size=cp_size,
        cp_rank=cp_rank,
        pad_id=pad_id,
        route_strategy=route_strategy,
        cp_group=cp_group,
    )
    lengths = [len(s) for s in samples]
    padded = [padded_length(n, cp_size) for n in lengths] or [2 * cp_size]
    cu_host = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    # CP 1 holds every row in order: no gather
    index = None if cp_size == 1 else thd_rank_indices(cu_host, cp_size, cp_rank, "zigzag").numpy()
    params = _micro_batch_params(
        cu_host,
        max(padded),
        device,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_group=cp_group,
        carries_cp_group=carries_cp_group,
        route_strategy=route_strategy,
    )
    return _sharded(
        samples, padded, cu_host, index, params, cp_size=cp_size, device=device, pad_id=pad_id, mtp=mtp
    )


def _sharded(
    samples: list[Sample],
    padded: list[int],
    cu_host: np.ndarray,
    index: np.ndarray | None,
    params,
    *,
    cp_size: int,
    device,
    pad_id: int,
    mtp: bool,
) -> MicroBatch:
    """The packed host arrays of ``samples`` (each document padded to ``padded``), this rank's rows
    ``index`` of them (None: all) uploaded, with ``params``."""
    tokens, labels, loss_mask = pack_host_arrays(samples, padded, pad_id)
    # Positions restart at 0 in every document; its padding continues them.
    position_ids = np.arange(len(tokens), dtype=np.int64) - np.repeat(cu_host[:-1], padded)

    # Uploads are queued without the host waiting: a plain .to(cuda) of a pageable tensor waits
    # for every kernel queued before it, leaving the GPU idle while the host builds the rest.
    def shard(values: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return upload_rows(values if index is None else values[index], device, dtype).unsqueeze(0)

    mtp_labels, mtp_loss_mask = pack_mtp_host_arrays(samples, padded, pad_id) if mtp else (None, None)
    lengths = [len(s) for s in samples]
    return MicroBatch(
        tokens=shard(tokens),
        labels=shard(labels),
        loss_mask=shard(loss_mask, torch.float32),
        position_ids=shard(position_ids),
        packed_seq_params=params,
        num_loss_tokens=int(loss_mask.sum()),
        num_real_tokens=sum(lengths),
        num_samples=len(samples),
        cp_size=cp_size,
        seq_lengths=lengths,
        mtp_labels=None if mtp_labels is None else shard(mtp_labels),
        mtp_loss_mask=None if mtp_loss_mask is None else shard(mtp_loss_mask, torch.float32),
    )


def _micro_batch_params(
    cu_host: np.ndarray,
    max_len: int,
    device,
    *,
    cp_size: int,
    cp_rank: int,
    cp_group: dist.ProcessGroup | None,
    carries_cp_group: bool,
    route_strategy: str,
):
    """The micro-batch's ``PackedSeqParams``: with its CP group where it carries one (dynamic CP),
    with both routes where the data side builds them (``route_strategy="prebuild"``)."""
    params = _packed_seq_params(cu_host, max_len, device)
    if carries_cp_group:
        if cp_group is None:
            raise ValueError("carries_cp_group=True needs the micro-batch's cp_group")
        params.cp_group, params.local_cp_size = cp_group, cp_size
    if route_strategy == "prebuild" and cp_size > 1:
        prebuild_routes(params, cp_group, cp_size=cp_size, cp_rank=cp_rank)
    return params


def _check_micro_batch_args(
    samples: list[Sample],
    *,
    cp_size: int,
    cp_rank: int,
    pad_id: int,
    route_strategy: str,
    cp_group: dist.ProcessGroup | None,
) -> None:
    """What :func:`make_micro_batch` needs of its arguments; ``ValueError`` names the broken rule."""
    check_cp(cp_size, cp_rank)
    if route_strategy not in ROUTE_STRATEGIES:
        raise ValueError(
            f"unknown route strategy {route_strategy!r}: use one of {ROUTE_STRATEGIES} (gdn.route)"
        )
    if not _is_int(pad_id) or pad_id < 0:
        raise ValueError(f"pad_id={pad_id!r} must be a non-negative token id (the tokenizer's pad_id)")
    group_shape = None if cp_group is None else (dist.get_world_size(cp_group), dist.get_rank(cp_group))
    if group_shape is not None and group_shape != (cp_size, cp_rank):
        raise ValueError(
            f"cp_group has {group_shape[0]} ranks with this process at {group_shape[1]}, "
            f"but cp_size={cp_size}, cp_rank={cp_rank}: pass the CP group this micro-batch runs on"
        )
    for s in samples:
        check_sample(s)


def _mask_values(mask) -> np.ndarray:
    """A sample's loss mask as uint8 (True -> 1). ``bytes()`` of a list of bools or small ints is
    one C loop, about 20x faster than ``np.asarray`` over the list's objects, which at 64k-128k
    tokens per micro-batch was most of the host's packing time."""
    if isinstance(mask, list):
        try:
            return np.frombuffer(bytes(mask), dtype=np.uint8)
        except (TypeError, ValueError):  # not bools / ints in 0..255: the general conversion
            pass
    return np.asarray(mask, dtype=np.float32)


def pack_host_arrays(
    samples: list[Sample], padded: list[int], pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole micro-batch's tokens, labels and loss mask (host arrays), each document followed by
    its padding to ``padded`` tokens: labels are the next token within the document (``pad_id``
    after its last one), the mask is the sample's (float32), 0 on the last token and padding."""
    total = sum(padded)
    tokens = np.full(total, pad_id, dtype=np.int64)
    labels = np.full(total, pad_id, dtype=np.int64)
    loss_mask = np.zeros(total, dtype=np.float32)
    start = 0
    for sample, p in zip(samples, padded):
        n = len(sample)
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        tokens[start : start + n] = ids
        labels[start : start + n - 1] = ids[1:]  # the document's last token has no label in the document
        loss_mask[start : start + n - 1] = _mask_values(sample.loss_mask)[: n - 1]
        start += p
    if samples and tokens.min() < 0:
        raise ValueError("negative token id in a sample: token ids must be in [0, vocab_size)")
    return tokens, labels, loss_mask


def pack_mtp_host_arrays(
    samples: list[Sample], padded: list[int], pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """The multi-token-prediction targets of the whole micro-batch (host arrays, laid out like
    :func:`pack_host_arrays`'): at each position the label of the NEXT position of the same
    document (the token two ahead), ``pad_id`` where that is not in the document; and its loss mask,
    the next position's (0 on a document's last two tokens and on padding). A document's targets
    never come from the next one."""
    total = sum(padded)
    labels = np.full(total, pad_id, dtype=np.int64)
    loss_mask = np.zeros(total, dtype=np.float32)
    start = 0
    for sample, p in zip(samples, padded):
        n = len(sample)
        if n > 2:
            labels[start : start + n - 2] = np.asarray(sample.input_ids[2:], dtype=np.int64)
            loss_mask[start : start + n - 2] = _mask_values(sample.loss_mask)[1 : n - 1]
        start += p
    return labels, loss_mask


def _packed_seq_params(cu_host: np.ndarray, max_seqlen: int, device: torch.device | str) -> PackedSeqParams:
    """THD ``PackedSeqParams`` whose four cu_seqlens are ONE int32 device tensor of the global padded
    boundaries, with its host copy attached."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = upload_rows(cu_host, device, torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    attach_host_cu_seqlens(params, cu, cu_host)
    return params


def global_batches(
    dataset_samples: list[Sample],
    global_batch_size: int,
    seed: int,
    epoch: int = 0,
    *,
    drop_last: bool = True,
) -> list[list[Sample]]:
    """One epoch's global batches: a permutation seeded by ``(seed, epoch)`` cut into batches of
    ``global_batch_size`` samples. Same arguments -> same batches on every rank. The incomplete
    last batch is dropped unless ``drop_last=False``."""
    global_batch_size = _check_positive_int("global_batch_size", global_batch_size)
    if not _is_int(seed) or not _is_int(epoch) or epoch < 0:
        raise ValueError(f"seed={seed!r} and epoch={epoch!r} must be integers (epoch >= 0)")
    n = len(dataset_samples)
    if drop_last and n < global_batch_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is larger than the dataset ({n} samples): lower the "
            "global batch size or use more data"
        )
    order = np.random.default_rng([abs(int(seed)), int(int(seed) < 0), int(epoch)]).permutation(n)
    stop = n - n % global_batch_size if drop_last else n
    starts = range(0, stop, global_batch_size)
    return [[dataset_samples[i] for i in order[b : b + global_batch_size]] for b in starts]


def global_batch_at_step(
    dataset_samples: list[Sample], global_batch_size: int, seed: int, step: int
) -> tuple[int, list[Sample]]:
    """The global batch of training step ``step`` (0-based) over repeated epochs, and its epoch:
    lets a resumed run continue exactly where it stopped without replaying the data."""
    if not _is_int(step) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    per_epoch = len(dataset_samples) // _check_positive_int("global_batch_size", global_batch_size)
    if per_epoch == 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is larger than the dataset "
            f"({len(dataset_samples)} samples): lower the global batch size or use more data"
        )
    epoch, index = divmod(step, per_epoch)
    return epoch, global_batches(dataset_samples, global_batch_size, seed, epoch)[index]
