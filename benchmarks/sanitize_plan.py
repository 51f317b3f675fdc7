"""The plan kernels (kernels_src/plan_lists) under compute-sanitizer: both scatter CTA sizes, both register widths,
two bitmap windows, a query chunk's boundary inside a 512-row CTA and tiles past S.
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize_plan.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_msa_rt import tuning  # noqa: E402
from flash_msa_rt.ops import sparse_plan as sp  # noqa: E402


def selection(B, Hp, S, K, seed):
    """Each row's own block, then K - 1 distinct random blocks (some past the row's own), a tenth of them -1."""
    g = torch.Generator().manual_seed(seed)
    own = (torch.arange(S) // 128).view(1, 1, S, 1).expand(B, Hp, S, 1)
    score = torch.rand(B, Hp, S, max(K, S // 128 + 2), generator=g).scatter_(-1, own, -1.0)
    rest = score.topk(K - 1, dim=-1).indices
    rest = torch.where(torch.rand(rest.shape, generator=g) < 0.1, -1, rest)
    return torch.cat([own, rest], -1).to(torch.int32).cuda()


def main():
    for threads in (128, 512):  # 128 rows per scatter CTA: an opt-in build variant
        with tuning.override(plan={"scatter_threads": threads}):
            for B, Hp, S, K, heads, queries in ((1, 2, 33_000, 4, 1, 33_000), (2, 4, 2333, 5, 2, 896),
                                                (1, 1, 300, 9, 1, 300), (1, 2, 3000, 20, 2, 1024)):
                sp.chunk_plans(selection(B, Hp, S, K, S + K), 128, 4, heads, queries, ((32, 64), (64, 32)), "size")
    torch.cuda.synchronize()
    print("plan kernels ran")


if __name__ == "__main__":
    main()
