"""Context parallelism on CPU with gloo (flash_msa_rt.distributed): 2 and 3 ranks spawned here, both schemes, odd
S whose chunks do not align with the 128-token blocks, MSA and warmup, float64 and float32, and a packed row
(cu_seqlens: each sequence split over the ranks on its own). Every rank's outputs
and gradients, put back in sequence order, must equal the single-process op on the full sequence (the loss of the
single process: sum over ranks of each rank's loss, kl_loss counted once as the contract says), and kl_loss must be
the whole sequence's KL on every rank."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

B, S, H, Hk, Hp, Hpk, D = 2, 389, 4, 2, 2, 1, 16
TOP_K, COEF = 256, 0.7
PACK = [0, 150, 157, 157, S]  # one row as a pack: 150 tokens, 7 (fewer than 2N chunks), an empty one, 232
CASES = [(scheme, sparse, dtype) for scheme in ("zigzag", "contiguous") for sparse in (True, False)
         for dtype in (torch.float64, torch.float32)]


def _full_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(B, h, S, D, generator=g, dtype=torch.float64).to(dtype) for h in (Hp, Hpk, H, Hk, Hk)]
    dout = torch.randn(B, S, H * D, generator=g, dtype=torch.float64).to(dtype)
    return ins, dout


def _single(sparse, dtype, **kwargs):
    import flash_msa_rt as F

    ins, dout = _full_inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in ins]
    fn = F.flash_msa_func if sparse else F.flash_msa_warmup_func
    out, kl = fn(*leaves, TOP_K, **kwargs)
    ((out * dout).sum() + COEF * kl).backward()
    return out.detach(), kl.detach(), [t.grad for t in leaves]


def _rank(rank, world, port, results, backend="gloo"):
    import warnings

    import torch.distributed as dist

    from flash_msa_rt.distributed import flash_msa_cp_func, flash_msa_warmup_cp_func, shard_sequence, unshard_sequence

    warnings.simplefilter("ignore")
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mine = {}
        for n, (scheme, sparse, dtype) in enumerate(CASES):
            ins, dout = _full_inputs(dtype)
            local = [shard_sequence(t.to(device), seq_dim=2, scheme=scheme).requires_grad_() for t in ins]
            dout_local = shard_sequence(dout.to(device), seq_dim=1, scheme=scheme)
            fn = flash_msa_cp_func if sparse else flash_msa_warmup_cp_func
            metric = torch.zeros((), device=device)
            out, kl = fn(*local, TOP_K, scheme=scheme, kl_metric=metric, seqlen=S if n % 2 else None)
            ((out * dout_local).sum() + COEF * kl).backward()
            mine[n] = tuple(x.cpu() if isinstance(x, torch.Tensor) else [g.cpu() for g in x]
                            for x in (out.detach(), kl.detach(), metric, [t.grad for t in local]))
        deferred = torch.zeros((), device=device)
        ins, dout = _full_inputs(torch.float64)
        ins, dout = [t.to(device) for t in ins], dout.to(device)
        local = [shard_sequence(t, seq_dim=2).requires_grad_() for t in ins]
        out, kl = flash_msa_cp_func(*local, TOP_K, kl_metric=deferred, kl_value="deferred")
        assert kl == 0
        ((out * shard_sequence(dout, seq_dim=1)).sum() + COEF * kl).backward()
        mine["deferred"] = deferred.cpu()
        ins, dout = _full_inputs(torch.float32)  # fp8 selection: the fp8 key blocks lie on the full sequence's grid
        local = [shard_sequence(t.to(device), seq_dim=2).requires_grad_() for t in ins]
        out, kl = flash_msa_cp_func(*local, TOP_K, select_precision="fp8")
        ((out * shard_sequence(dout.to(device), seq_dim=1)).sum() + COEF * kl).backward()
        mine["fp8"] = (out.detach().cpu(), kl.detach().cpu(), [t.grad.cpu() for t in local])
        cu = torch.tensor(PACK, dtype=torch.int32)  # packed sequences: each split over the ranks on its own
        for sparse in (True, False):
            ins, dout = _full_inputs(torch.float64)
            ins, dout = [t[:1].to(device) for t in ins], dout[:1].to(device)
            local = [shard_sequence(t, seq_dim=2, cu_seqlens=cu).requires_grad_() for t in ins]
            fn = flash_msa_cp_func if sparse else flash_msa_warmup_cp_func
            out, kl = fn(*local, TOP_K, cu_seqlens=cu)
            ((out * shard_sequence(dout, seq_dim=1, cu_seqlens=cu)).sum() + COEF * kl).backward()
            mine[("pack", sparse)] = (out.detach().cpu(), kl.detach().cpu(), [t.grad.cpu() for t in local],
                                      torch.equal(unshard_sequence(local[2].detach(), seq_dim=2, cu_seqlens=cu),
                                                  ins[2]))
        try:  # one token over N >= 2 ranks: some rank would hold nothing; every rank says so, none hangs
            flash_msa_cp_func(*(shard_sequence(t[:, :, :1], seq_dim=2) for t in ins), TOP_K, seqlen=1)
            mine["too_short"] = "no error"
        except ValueError as e:
            mine["too_short"] = str(e)
        results[rank] = mine
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unshard(parts, world, scheme, seq_dim):
    from flash_msa_rt.distributed import shard_spans

    full = [None] * S
    for r, part in enumerate(parts):
        at = 0
        for a, b in shard_spans(S, world, r, scheme):
            for t in range(a, b):
                full[t] = part.select(seq_dim, at + t - a)
            at += b - a
    return torch.stack(full, dim=seq_dim)


def _unshard_pack(parts, world, seq_dim):
    from flash_msa_rt.distributed.sharding import pack_spans

    full = [None] * S
    for r, part in enumerate(parts):
        at = 0
        for a, b in pack_spans(PACK, world, r):
            for t in range(a, b):
                full[t] = part.select(seq_dim, at + t - a)
            at += b - a
    return torch.stack(full, dim=seq_dim)


def _single_pack(sparse):
    import flash_msa_rt as F

    ins, dout = _full_inputs(torch.float64)
    leaves = [t[:1].clone().requires_grad_() for t in ins]
    fn = F.flash_msa_func if sparse else F.flash_msa_warmup_func
    out, kl = fn(*leaves, TOP_K, cu_seqlens=torch.tensor(PACK, dtype=torch.int32))
    ((out * dout[:1]).sum() + COEF * kl).backward()
    return out.detach(), kl.detach(), [t.grad for t in leaves]


def _check_against_single_process(world, backend="gloo"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(world, _free_port(), results, backend), nprocs=world, join=True)
    for n, (scheme, sparse, dtype) in enumerate(CASES):
        want_out, want_kl, want_grads = _single(sparse, dtype)
        tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
        what = f"{world} ranks, {scheme}, {'MSA' if sparse else 'warmup'}, {dtype}"
        for r in range(world):
            _, kl, metric, _ = results[r][n]
            torch.testing.assert_close(kl, want_kl, **tol, msg=lambda m: f"{what}: kl_loss on rank {r}: {m}")
            torch.testing.assert_close(metric, want_kl.float(), **tol, msg=lambda m: f"{what}: kl_metric: {m}")
        out = _unshard([results[r][n][0] for r in range(world)], world, scheme, 1)
        torch.testing.assert_close(out, want_out, **tol, msg=lambda m: f"{what}: out: {m}")
        for i, name in enumerate(("q_proxy", "k_proxy", "q", "k", "v")):
            got = _unshard([results[r][n][3][i] for r in range(world)], world, scheme, 2)
            torch.testing.assert_close(got, want_grads[i], **tol, msg=lambda m: f"{what}: d{name}: {m}")
            assert want_grads[i].abs().sum() > 0
    for r in range(world):
        assert "seqlen 1 is too short for" in results[r]["too_short"], results[r]["too_short"]
    want_out, want_kl, want_grads = _single(True, torch.float32, select_precision="fp8")
    assert not torch.allclose(want_out, _single(True, torch.float32)[0]), "fp8 selects other blocks on these inputs"
    tol = dict(rtol=2e-4, atol=2e-5)
    out = _unshard([results[r]["fp8"][0] for r in range(world)], world, "zigzag", 1)
    torch.testing.assert_close(out, want_out, **tol, msg=lambda m: f"{world} ranks, fp8 selection: out: {m}")
    for r in range(world):
        torch.testing.assert_close(results[r]["fp8"][1], want_kl, **tol)
    for i, name in enumerate(("q_proxy", "k_proxy", "q", "k", "v")):
        got = _unshard([results[r]["fp8"][2][i] for r in range(world)], world, "zigzag", 2)
        torch.testing.assert_close(got, want_grads[i], **tol, msg=lambda m: f"{world} ranks, fp8: d{name}: {m}")
    for sparse in (True, False):
        want_out, want_kl, want_grads = _single_pack(sparse)
        what, tol = f"{world} ranks, packed {'MSA' if sparse else 'warmup'}", dict(rtol=1e-9, atol=1e-11)
        for r in range(world):
            torch.testing.assert_close(results[r][("pack", sparse)][1], want_kl, **tol)
            assert results[r][("pack", sparse)][3], f"{what}: unshard_sequence(shard_sequence(x)) != x on rank {r}"
        out = _unshard_pack([results[r][("pack", sparse)][0] for r in range(world)], world, 1)
        torch.testing.assert_close(out, want_out, **tol, msg=lambda m: f"{what}: out: {m}")
        for i, name in enumerate(("q_proxy", "k_proxy", "q", "k", "v")):
            got = _unshard_pack([results[r][("pack", sparse)][2][i] for r in range(world)], world, 2)
            torch.testing.assert_close(got, want_grads[i], **tol, msg=lambda m: f"{what}: d{name}: {m}")
    exact_kl = _single(True, torch.float64)[1]
    for r in range(world):
        torch.testing.assert_close(results[r]["deferred"], exact_kl.float(), rtol=1e-6, atol=0,
                                   msg=lambda m: f"{world} ranks: deferred kl_metric on rank {r}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_call_equals_the_single_process_op(world):
    _check_against_single_process(world)


@pytest.mark.gpu
@pytest.mark.allow_reference  # float64 and float32 cases: the reference on the ranks and the single process alike
def test_nccl_on_two_gpus_equals_the_single_process_op():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL context parallelism needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    _check_against_single_process(2, "nccl")


def test_errors_name_the_argument():
    from flash_msa_rt.distributed import flash_msa_cp_func, shard_spans

    ins, _ = _full_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        flash_msa_cp_func(*ins, TOP_K)
    with pytest.raises(ValueError, match=r"scheme='ring' is not supported; expected one of zigzag, contiguous"):
        flash_msa_cp_func(*ins, TOP_K, scheme="ring")
    assert shard_spans(10, 2, 0) == [(0, 2), (7, 10)] and shard_spans(10, 2, 1) == [(2, 5), (5, 7)]
    assert shard_spans(10, 3, 2, "contiguous") == [(6, 10)]
