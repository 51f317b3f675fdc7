"""Small calls at every new (D, Dp, Bs) point of the matrix for compute-sanitizer (run under it): through the
public API, each point's selection, forward, KL pass and backward in exact and deferred KL mode at G = 4 (the
warp-specialised backward) and G = 1, the deterministic backward, a packed batch, warmup (blocks of 128) and
block-sparse attention, in bf16 (f16 at one shape), and with attention sinks (the scale_rows variants). Every op
must run on the kernels (it exits 1 otherwise).

    compute-sanitizer --tool racecheck --kernel-name-exclude kns=cudnn python benchmarks/sanitize_matrix.py
    compute-sanitizer --tool initcheck python benchmarks/sanitize_matrix.py --no-warmup
    ... sanitize_matrix.py --points 256:128:64,256:128:128     (a subset of POINTS, D:Dp:Bs)
    ... sanitize_matrix.py --mma sync    (the mma.sync kernels sm100a runs, from the hopper_sync_check set; without
                                          the deterministic backward and warmup, which are wgmma's)

Warmup's main attention is cuDNN's: racecheck and synccheck report hazards inside cuDNN's own sm90 flash kernels
(not ours: exclude them by name), and initcheck cannot see its TMA stores, so the copy of its output reads as
uninitialised (run initcheck with --no-warmup; the warmup proxy kernels run under the other three tools).
"""

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTS = [(64, 64, 128), (64, 64, 64), (128, 64, 64), (128, 128, 64), (256, 128, 64),
          (256, 128, 128)]  # (D, Dp, Bs); (128, 128, 128): run_gpu.sh
SHAPES = [(1, 333, 8, 2, 2, 1), (2, 203, 8, 2, 8, 1)]  # B, S, H, Hk, Hp, Hpk: G = 4 and G = 1


def _leaves(B, S, H, Hk, Hp, Hpk, D, Dp, dtype):
    return [torch.randn(B, h, S, d, device="cuda").to(dtype).requires_grad_()
            for h, d in ((Hp, Dp), (Hpk, Dp), (H, D), (Hk, D), (Hk, D))]


def main():
    from flash_msa_rt import tuning

    sync = "--mma" in sys.argv[1:] and sys.argv[sys.argv.index("--mma") + 1] == "sync"
    with tuning.override(**tuning.every_mma("sync")) if sync else contextlib.nullcontext():
        run(warmup="--no-warmup" not in sys.argv[1:] and not sync, deterministic=not sync)


def run(warmup: bool, deterministic: bool):
    import flash_msa_rt as F

    points = POINTS
    if "--points" in sys.argv[1:]:  # e.g. --points 256:128:64,256:128:128 (a subset, for a short device call)
        text = sys.argv[sys.argv.index("--points") + 1]
        points = [tuple(int(x) for x in p.split(":")) for p in text.split(",")]
    from flash_msa_rt.selftest import on_kernels, resolved_backends

    torch.manual_seed(0)
    missed = []
    for D, Dp, Bs in points:
        for shape in SHAPES:
            for dtype in (torch.bfloat16, torch.float16) if shape is SHAPES[0] else (torch.bfloat16,):
                for kl_value in ("exact", "deferred"):
                    leaves = _leaves(*shape, D, Dp, dtype)
                    metric = torch.zeros((), device="cuda")
                    with resolved_backends() as seen:
                        out, kl = F.flash_msa_func(*leaves, 2 * Bs, block_size=Bs, kl_value=kl_value,
                                                   kl_metric=metric)
                        (out.float().square().mean() + kl).backward()
                    missed.append(on_kernels(seen, ("select_blocks", "msa_forward", "msa_backward")))
        leaves = _leaves(*SHAPES[0], D, Dp, torch.bfloat16)
        sinks = torch.randn(leaves[2].shape[1], device="cuda").requires_grad_()  # the combine's and row kernel's
        for kl_value in ("exact", "deferred"):                                   # scale_rows variants
            out, kl = F.flash_msa_func(*leaves, 2 * Bs, block_size=Bs, kl_value=kl_value, sinks=sinks)
            (out.float().square().mean() + kl).backward()
        if deterministic:
            torch.use_deterministic_algorithms(True)
            out, kl = F.flash_msa_func(*leaves, 2 * Bs, block_size=Bs)
            (out.float().square().mean() + kl).backward()
            torch.use_deterministic_algorithms(False)
        cu = torch.tensor([0, Bs + 17, 333], dtype=torch.int32, device="cuda")
        out, kl = F.flash_msa_func(*leaves, 2 * Bs, block_size=Bs, cu_seqlens=cu)
        (out.float().square().mean() + kl).backward()
        if Bs == 128 and warmup:
            out, kl = F.flash_msa_warmup_func(*leaves, 2 * Bs, block_size=Bs)
            (out.float().square().mean() + kl).backward()
        q, k, v = leaves[2:]
        S, nb = q.shape[2], -(-q.shape[2] // Bs)
        i = torch.arange(S, device="cuda") // Bs
        idx = torch.stack([i, torch.zeros_like(i), (i + 1) % nb], -1).clamp(max=i[:, None]).to(torch.int32)
        with resolved_backends() as seen:
            out = F.block_sparse_attention(q, k, v, idx.view(1, 1, S, 3).expand(1, 2, S, 3).contiguous(),
                                           block_size=Bs)
            out.float().square().mean().backward()
        missed.append(on_kernels(seen, ("block_sparse_forward", "block_sparse_backward")))
    torch.cuda.synchronize()
    missed = [m for m in missed if m is not None]
    print("sanitize_matrix: done" if not missed else f"sanitize_matrix: not on the kernels: {missed}")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
