"""The host-sync counter stays out of the way: off unless asked, the sync debug mode restored to
what it was, and the other warnings it had to record issued again through the process's filters."""

from __future__ import annotations

import warnings

import pytest
import torch

from relax_gdn.config import RunConfig
from relax_gdn.train.metrics import SYNC_WARNING, HostSyncCounter


def test_counting_is_off_unless_asked():
    assert RunConfig().logging.count_host_syncs is False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with HostSyncCounter(enabled=False) as counter:
            warnings.warn(f"x {SYNC_WARNING}", UserWarning)
    assert counter.count == 0 and len(seen) == 1  # nothing recorded, nothing swallowed


def test_sync_warnings_are_counted_and_the_others_obey_the_filters():
    counter = HostSyncCounter(enabled=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="a known third-party notice")
        for _ in range(2):  # the same warning twice per block, the block twice: shown once
            with counter:
                warnings.warn(f"cudaStreamSynchronize {SYNC_WARNING}", UserWarning)
                warnings.warn("a known third-party notice", DeprecationWarning)
                for _ in range(2):
                    warnings.warn("something the user should see", RuntimeWarning)
    assert counter.count == 2 and sum(counter.locations.values()) == 2  # counts add up over blocks
    shown = [str(w.message) for w in seen]
    assert shown == ["something the user should see"], shown  # the ignore filter applied


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sync_debug_mode_is_restored_to_what_it_was():
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = torch.ones(4, device="cuda")
        with HostSyncCounter(enabled=True) as counter:
            assert torch.cuda.get_sync_debug_mode() == 1  # warn inside
            x.sum().item()
        assert counter.count >= 1
        assert torch.cuda.get_sync_debug_mode() == 2  # error, as before
    finally:
        torch.cuda.set_sync_debug_mode("default")
