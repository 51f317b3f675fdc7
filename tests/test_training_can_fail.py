"""The seed-style training comparison (tests/training.py, what test_sparse_bwd_gpu and test_warmup_gpu run on the
kernels) can fail: on CPU, a backend registered in front of the reference hands the reference's backward through
with its gradients zeroed, or dk 1% off, and compare_updates rejects the training run; unbiased noise of bf16's
rounding size on every gradient element passes (the tolerance is not merely loose enough for nothing).
"""

from __future__ import annotations

import pytest
import torch

import flash_msa_rt
from flash_msa_rt.ops import dispatch
from flash_msa_rt.ops.backends import Backend, reference_impl
from tests import training

STEPS, S = 10, 300  # shorter than the GPU tests' 700 tokens: the reference on CPU


def _sparse(qp, kp, q, k, v):
    return flash_msa_rt.flash_msa_func(qp, kp, q, k, v, 256, 128 ** -0.5, layout="bshd")


def _warmup(qp, kp, q, k, v):
    return flash_msa_rt.flash_msa_warmup_func(qp, kp, q, k, v, 256, 128 ** -0.5, layout="bshd")


def _zeroed(grads):
    return tuple(torch.zeros_like(g) for g in grads)


def _dk_one_percent_off(grads):
    dqp, dkp, dq, dk, dv = grads
    return dqp, dkp, dq, dk * 1.01, dv


def _bf16_rounding_noise(grads):
    """Each element moved by up to one bf16 ulp (2^-8 relative), independently: what another rounding costs."""
    gen = torch.Generator().manual_seed(3)
    return tuple(g + g * (torch.rand(g.shape, generator=gen, dtype=g.dtype) * 2 - 1) * 2 ** -8 for g in grads)


@pytest.fixture
def backward_hook():
    """hook(op, change): op's backward on CPU is the reference's with its gradients passed through change."""
    names = []

    def hook(op, change):
        def backward(*args, **kwargs):
            return change(reference_impl(op)(*args, **kwargs))

        name = f"test-{op}-{change.__name__}"
        dispatch.register_backend(Backend(name, "cpu", supports=lambda problem: None, ops={op: backward}))
        names.append(name)

    yield hook
    for name in names:
        dispatch.unregister_backend(name)


@pytest.fixture(scope="module")
def reference_updates():
    return {"sparse": training.train(_sparse, "cpu", STEPS, S), "warmup": training.train(_warmup, "cpu", STEPS, S)}


@pytest.mark.parametrize("mode, op", [("sparse", "msa_backward"), ("warmup", "warmup_backward")])
@pytest.mark.parametrize("change, fails", [(_zeroed, True), (_dk_one_percent_off, True),
                                           (_bf16_rounding_noise, False)])
def test_training_comparison_catches_wrong_gradients(mode, op, change, fails, backward_hook, reference_updates):
    backward_hook(op, change)
    got = training.train(_sparse if mode == "sparse" else _warmup, "cpu", STEPS, S)
    want = reference_updates[mode]
    if fails:
        with pytest.raises(AssertionError, match="updates differ"):
            training.compare_updates(got, want)
    else:
        training.compare_updates(got, want)
    if change is _dk_one_percent_off:  # the error shows where it was put, at about its size
        errors = training.update_errors(got, want)
        assert errors["k"] > training.UPDATE_TOL, errors


def test_the_gpu_tests_use_this_comparison():
    """assert_training_matches_reference ends in compare_updates (the function checked above), at UPDATE_TOL."""
    import inspect

    source = inspect.getsource(training.assert_training_matches_reference)
    assert "compare_updates(with_kernels, with_reference)" in source
    assert "routing.assert_ran_on_kernels(ops)" in source
