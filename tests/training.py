"""A small attention layer trained for a few SGD steps, once on the kernels and once on the reference backend (the
seed-style training tests of the sparse and warmup ops), compared by what training changed.

Ten SGD steps move bf16 parameters by well under 1% of their scale, so comparing the parameters themselves would
pass with every gradient zeroed (issue 40). The projections are therefore kept in float32 (master weights, cast to
bf16 for each step's forward, as mixed-precision training does) and the comparison is of the updates p - p0,
each against its own scale: a zeroed gradient misses by 100% of that scale, a gradient 1% off by about 1%
(tests/test_training_can_fail.py shows both fail, on CPU, through the same compare_updates).
"""

from __future__ import annotations

import torch

# ||update - reference update|| / ||reference update|| per parameter (update_errors). Kernel and reference compute
# the same bf16 steps with other rounding (the kernels round P and dS to bf16; the reference only its outputs),
# and once one update differs, the bf16 casts of the master weights round differently in later steps: on the H200
# the kernels' updates sit 1.0e-3 to 3.1e-3 from the reference's (sparse and warmup, 10 steps, S = 700; two kernel
# runs agree to 6e-6). Unbiased noise of one bf16 ulp on every gradient element costs up to 3.6e-3 (CPU, tests/
# test_training_can_fail.py); dk 1% off costs 1.0e-2 on k, a zeroed gradient 1.0 everywhere. 6e-3 lies between.
UPDATE_TOL = 6e-3

# Layer shape: model width, main heads, KV heads, proxy heads, head dim (proxy key heads 1).
DM, H, HK, HP, D = 256, 4, 1, 1, 128
NAMES = (("q", H), ("k", HK), ("v", HK), ("qp", HP), ("kp", 1))


def train(attention, device, steps: int = 10, S: int = 700, lr: float = 0.5) -> dict[str, torch.Tensor]:
    """attention(q_proxy, k_proxy, q, k, v) -> (out, kl_loss), "bshd" layout, bf16. Trains the q/k/v/proxy
    projections of one layer for `steps` SGD steps on fixed random data; returns each projection's update
    p - p0 in float32."""
    gen = torch.Generator().manual_seed(1)
    weights = {n: (torch.randn(h * D, DM, generator=gen) * DM ** -0.5).to(device).requires_grad_()
               for n, h in NAMES}
    start = {n: w.detach().clone() for n, w in weights.items()}
    x = torch.randn(steps, 1, S, DM, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    opt = torch.optim.SGD(list(weights.values()), lr=lr)
    for step in range(steps):
        def heads(n, h):
            return torch.nn.functional.linear(x[step], weights[n].bfloat16()).view(1, S, h, D)

        out, kl = attention(*(heads(n, h) for n, h in (NAMES[3], NAMES[4], NAMES[0], NAMES[1], NAMES[2])))
        loss = out.float().pow(2).mean() + 0.1 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: (weights[n].detach() - start[n]).cpu() for n in weights}


def update_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: ||got - want|| / ||want|| (Frobenius): the relative error of its update. The norm, not the
    largest element: an update is a sum over tokens and steps, so an element's rounding noise sits at the same
    relative size as the element's own (it does not average away), and the largest of 10^5 elements' noise would
    decide a max-based check; a systematic error moves the norm by its own size."""
    out = {}
    for name, w in want.items():
        scale = w.double().norm().item()
        assert scale > 0, f"{name}: the reference run did not update it (a test that cannot fail)"
        out[name] = (got[name].double() - w.double()).norm().item() / scale
    return out


def compare_updates(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = UPDATE_TOL) -> None:
    """Every parameter's update within tol of its own scale; the failure names each parameter's error."""
    errors = update_errors(got, want)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, (f"updates differ from the reference's by more than {tol:.1e} of their scale: "
                     + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))


def assert_training_matches_reference(attention, ops, steps: int = 10, S: int = 700):
    """On CUDA: train with the kernels (first asserting, from dispatch's record, that every op in `ops` ran on
    them, none on the reference), then with the reference backend alone, and compare the updates."""
    from flash_msa_rt.ops import dispatch, kernels
    from tests import routing

    dispatch.reset_warnings()  # dispatch's record from here on: this run's ops
    with_kernels = train(attention, "cuda", steps, S)
    routing.assert_ran_on_kernels(ops)
    dispatch.unregister_backend(kernels.KERNELS.name)
    try:
        with routing.allowed_reference():
            with_reference = train(attention, "cuda", steps, S)
    finally:
        dispatch.register_backend(kernels.KERNELS)
    compare_updates(with_kernels, with_reference)
