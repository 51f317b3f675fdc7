"""Does cuDNN's attention take a value head dim of D + Dp (v = [v, k_proxy]) beside q, k of D, forward and
backward, and what does it cost? Warmup's proxy gradient (pi - tau) is linear in tau = mean_g P_g, so its tau terms
are attention products of the main heads: sum_t tau k_p = E_P[k_p] (the forward with v widened by k_p) and
sum_i tau q_p (dV of a backward with v = [v, 0], out = [out, 0], dO = [dO, q_p]); the pi terms come from the
proxy's own attention. This probe checks the widened calls against float32 math and times them beside the plain
ones. Measured at 326f92b (results/probe_cudnn_dv_326f92b.json): correct, but the widened backward costs 2.5x the
plain one ((b) S = 64K: 828 vs 325 ms), as much as the proxy kernel it would replace, so warmup does not use it
(kernels_src/sparse_kl/NOTES.md).

    python benchmarks/probe_cudnn_dv.py [--seqlens 8192,65536] [--configs a,b,c] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import commit, cuda_time_ms  # noqa: E402
from flash_msa_rt.ops import dense_main  # noqa: E402

CONFIGS = {"a": (16, 2, 4, 1), "b": (32, 8, 8, 1), "c": (64, 4, 4, 1)}


def math_attention(q, k, v, scale):
    """(B, S, H, D) causal attention in float32 with lse, GQA by expansion."""
    B, S, H, _ = q.shape
    G = H // k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)))
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    p = (s - lse[..., None]).exp()
    return (p @ vf).transpose(1, 2), lse, p


def check(dtype) -> dict:
    torch.manual_seed(0)
    B, S, H, Hk, D = 2, 1001, 8, 2, 128
    scale = D ** -0.5
    q, k, v, kp = (torch.randn(B, S, h, D, device="cuda", dtype=dtype) for h in (H, Hk, Hk, Hk))
    v_aug = torch.cat([v, kp], -1)
    out, lse = dense_main.dense_forward(q, k, v_aug, scale)
    ref, ref_lse, p = math_attention(q, k, v_aug, scale)
    res = {"fwd_out_err": (out.float() - ref).abs().max().item(), "fwd_lse_err": (lse - ref_lse).abs().max().item()}
    # backward with v = [v, 0], out = [out, 0], dO = [dO, X]: dq, dk as for plain attention, dv = [dv, P^T X]
    do, x = torch.randn_like(q), torch.randn_like(q)
    o_plain = out[..., :D].contiguous()
    dq, dk, dv = dense_main.dense_backward(q, k, torch.cat([v, torch.zeros_like(v)], -1),
                                           torch.cat([o_plain, torch.zeros_like(o_plain)], -1), lse,
                                           torch.cat([do, x], -1), scale)
    G = H // Hk
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    o_ref = math_attention(qf, kf, vf, scale)[0]
    gq, gk, gv = torch.autograd.grad(o_ref, (qf, kf, vf), do.float())
    ptx = (p.transpose(-1, -2) @ x.float().transpose(1, 2))  # (B, H, S, D)
    ptx = ptx.transpose(1, 2).unflatten(2, (Hk, G)).sum(3)
    res.update(dq_err=(dq.float() - gq).abs().max().item(), dk_err=(dk.float() - gk).abs().max().item(),
               dv_err=(dv[..., :D].float() - gv).abs().max().item(),
               ptx_err=(dv[..., D:].float() - ptx).abs().max().item(), ptx_scale=ptx.abs().max().item())
    return res


def timings(config: str, S: int, dtype) -> dict:
    H, Hk, Hp, Hpk = CONFIGS[config]
    B, D = max(1, 131072 // S), 128
    scale = D ** -0.5
    q = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=dtype) for _ in range(2))
    qp = torch.randn(B, S, Hp, D, device="cuda", dtype=dtype)
    kp = torch.randn(B, S, Hpk, D, device="cuda", dtype=dtype)
    v_aug = torch.cat([v, kp.expand(-1, -1, Hk, -1)], -1)
    out, lse = dense_main.dense_forward(q, k, v, scale)
    out_aug, lse_aug = dense_main.dense_forward(q, k, v_aug, scale)
    do = torch.randn_like(q)
    do_aug = torch.cat([do, qp.repeat_interleave(H // Hp, 2)], -1)
    v_bwd = torch.cat([v, torch.zeros_like(v)], -1)
    o_bwd = torch.cat([out, torch.zeros_like(out)], -1)
    outp, lsep = dense_main.dense_forward(qp, kp, kp, scale)
    r = {"config": config, "S": S, "B": B}
    r["fwd_ms"] = cuda_time_ms(lambda: dense_main.dense_forward(q, k, v, scale))
    r["fwd_dv256_ms"] = cuda_time_ms(lambda: dense_main.dense_forward(q, k, v_aug, scale))
    r["bwd_ms"] = cuda_time_ms(lambda: dense_main.dense_backward(q, k, v, out, lse, do, scale))
    r["bwd_dv256_ms"] = cuda_time_ms(lambda: dense_main.dense_backward(q, k, v_bwd, o_bwd, lse_aug, do_aug, scale))
    r["proxy_fwd_ms"] = cuda_time_ms(lambda: dense_main.dense_forward(qp, kp, kp, scale))
    r["proxy_bwd_ms"] = cuda_time_ms(lambda: dense_main.dense_backward(qp, kp, kp, outp, lsep, qp, scale))
    print(json.dumps(r), flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="8192,65536")
    ap.add_argument("--configs", default="a,b,c")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"commit": commit(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "checks": {}, "timings": []}
    for dtype in (torch.bfloat16, torch.float16):
        try:
            result["checks"][str(dtype)] = check(dtype)
        except RuntimeError as e:
            result["checks"][str(dtype)] = {"error": str(e)[:500]}
        print(dtype, result["checks"][str(dtype)], flush=True)
    for c in args.configs.split(","):
        for S in map(int, args.seqlens.split(",")):
            try:
                result["timings"].append(timings(c, S, torch.bfloat16))
            except RuntimeError as e:
                result["timings"].append({"config": c, "S": S, "error": str(e)[:500]})
                print(result["timings"][-1], flush=True)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_cudnn_dv.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
