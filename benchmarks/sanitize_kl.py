"""compute-sanitizer target: the resident KL pass in both ping-pong forms (pipelined halves, whole-block products) at
G = 1, 2, 4 on odd S (masked tiles), Hp = 4 over Hk = 2 (two proxy heads per KV head), 1333 queries.

    compute-sanitizer --tool racecheck python benchmarks/sanitize_kl.py
"""
import torch
from flash_msa_rt.ops import sparse_fwd
from flash_msa_rt.ops.select import select_blocks_cuda
from flash_msa_rt.ops.sparse_fwd import msa_forward_cuda
q = torch.randn(2, 1333, 4, 128, device='cuda').to(torch.bfloat16)
sel = select_blocks_cuda(q, q[:, :, :1], 5, 128, 0.1)
for G in (1, 2, 4):
    m = torch.randn(2, 1333, 4 * G, 128, device='cuda').to(torch.bfloat16)
    kv = torch.randn(2, 1333, 2, 128, device='cuda').to(torch.bfloat16)
    for sched in ('pipelined', 'pingpong'):
        sparse_fwd.FORCE_KL_SCHEDULE = sched
        msa_forward_cuda(q, q[:, :, :1], m, kv, kv, sel, 128, 0.1)
torch.cuda.synchronize()
