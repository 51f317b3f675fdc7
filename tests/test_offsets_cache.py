"""flash_msa_rt.ops.offsets: a device tensor of packed offsets is read on the host once per version, so a packed
step synchronises once for its validation and not again in each op (tested with the read counted and the device
check made to treat CPU tensors as device ones: no GPU here)."""

import gc

import pytest
import torch

from flash_msa_rt.ops import offsets


@pytest.fixture
def counted(monkeypatch):
    reads = []

    def read(cu):
        reads.append(id(cu))
        return cu.to("cpu", torch.int64)

    monkeypatch.setattr(offsets, "_read", read)
    monkeypatch.setattr(offsets, "_on_host", lambda cu: False)
    yield reads
    offsets._HOST.clear()


def test_one_read_per_tensor_and_version(counted):
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert offsets.host_offsets(cu) == (0, 3, 10)
    assert offsets.host_offsets(cu) == (0, 3, 10)
    assert len(counted) == 1, "a second read of the same tensor is served from the host copy"
    cu[1] = 5  # an in-place write bumps the version: read again
    assert offsets.host_offsets(cu) == (0, 5, 10) and len(counted) == 2
    other = cu.clone()  # another tensor with the same values is read on its own
    assert offsets.host_offsets(other) == (0, 5, 10) and len(counted) == 3


def test_a_freed_tensor_leaves_nothing_behind(counted):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    offsets.host_offsets(cu)
    assert len(offsets._HOST) == 1
    del cu
    gc.collect()
    assert not offsets._HOST


def test_inference_tensors_are_read_every_time(counted):
    with torch.inference_mode():
        cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    assert offsets.host_offsets(cu) == (0, 2, 9) == offsets.host_offsets(cu)
    assert len(counted) == 2 and not offsets._HOST


def test_host_tensors_are_read_every_time(monkeypatch):
    reads = []
    monkeypatch.setattr(offsets, "_read", lambda cu: reads.append(1) or cu.to("cpu", torch.int64))
    cu = torch.tensor([0, 1], dtype=torch.int32)
    offsets.host_offsets(cu)
    offsets.host_offsets(cu)
    assert len(reads) == 2 and not offsets._HOST
