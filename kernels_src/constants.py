"""Numbers and type names every kernel module shares (device side: imports cutlass).

The softmax and KL math runs in log2 units (exp2 / log2 are MUFU instructions): scores are scaled by LOG2E on the
way in, and lse values leave as natural logs through LN2.
"""

import math

import cutlass

# The config's dtype name -> the CuTeDSL element type of q, k, v and the outputs.
# "e4m3": float8 e4m3 (fp8 selection's quantised proxy operands, kernels_src/select/NOTES.md).
DTYPES = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16, "e4m3": cutlass.Float8E4M3FN}

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The smallest normal fp32: log2's argument clamp where a value is either a sum of normal exp2.ftz results or 0.
FLT_MIN = 1.1754943508222875e-38

WARPGROUP_THREADS = 128  # the threads of one warpgroup (wgmma's issuing unit)
