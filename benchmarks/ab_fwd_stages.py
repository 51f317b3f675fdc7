"""A/B: sparse_fwd ping-pong with 2 q buffers (1 CTA/SM) vs 1 buffer (2 CTAs/SM), same plan and inputs, one process:
ms of each on one query chunk (at most 16K queries) and whether their outputs are bitwise equal
(results/ab_fwd_stages_8fbc399.log). A variant that is not built prints nan and the error.

    python benchmarks/ab_fwd_stages.py b:65536,a:65536,c:65536 [reps]
"""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_sparse_fwd import spec_problem  # noqa: E402
from benchmarks.common import cuda_time_ms  # noqa: E402
from flash_msa_rt.errors import MissingVariantError  # noqa: E402
from flash_msa_rt.loader import get_kernel  # noqa: E402
from flash_msa_rt.ops import sparse_fwd as sf  # noqa: E402
from flash_msa_rt.ops.sparse_plan import sparse_plan  # noqa: E402

dev = torch.device("cuda")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
for spec in sys.argv[1].split(","):
    x = spec_problem(spec)
    cfg, S, Hk, Hp, D, G, scale, sel = (x[n] for n in ("cfg", "S", "Hk", "Hp", "D", "G", "scale", "sel"))
    q, k, v = x["q"], x["k"], x["v"]
    chunk = min(S, 16384)
    csel = sel[:, :, :chunk].contiguous()
    plan = sparse_plan(csel, 128, chunk, G, sf.TILE_M // G, sf.TILES_PER_ITEM)
    res = {}
    for st in [s for _ in range(reps) for s in (2, 1)]:
        conf = sf.kernel_config(sf.DTYPES[q.dtype], D, 128, G, "wgmma", "pingpong")
        conf["stages"] = st
        try:
            kern = get_kernel("sparse_fwd", conf, dev)
        except MissingVariantError as e:
            res[st] = (float("nan"), None, str(e)[:60])
            continue
        outs = (torch.full((plan.E, G, D), float("nan"), dtype=q.dtype, device=dev),
                torch.full((plan.E, G), float("nan"), dtype=torch.float32, device=dev))
        run = lambda: kern(q=q, k=k, v=v, o_part=outs[0], lse_part=outs[1], scale=scale, hp=Hp,
                           hp_per_hk=Hp // Hk, **sf._plan_args(plan))
        run(); torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        t = cuda_time_ms(run, warmup=2, reps=7)
        res[st] = (min(t, res[st][0]) if st in res and res[st][1] is not None else t, got, "")
    base = res[2]
    eq = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(base[1], res[1][1])) \
        if res[1][1] is not None else None
    print(f"({cfg}) S={S} G={G} chunk {chunk}: s2 {base[0]:.3f} ms  s1 {res[1][0]:.3f} ms  x{base[0] / res[1][0]:.3f}"
          f"  bitwise equal {eq} {res[1][2]}", flush=True)
