"""plan_items (CuTeDSL): chunk n's lists cut into items of cut m, one CTA per (n, m) (kernels_src/plan_lists,
ItemsConfig). Thread t owns a contiguous run of lists, so that a block-wide scan of the runs' item counts gives
each list the index of its first item; the items of a list are its entries in runs of `entries`, list-major, the
order sparse_plan._cut_batched gives them.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from kernels_src.plan_lists.kernel import exclusive_scan


class PlanItems:
    def __init__(self, config):
        self.block_size = config.block_size
        self.threads = config.threads
        self.warps = config.threads // 32
        self.traced = {"smem_bytes": 0}

    @cute.jit
    def __call__(self, lists: cute.Tensor, items: cute.Tensor, item_count: cute.Tensor, seqlen: cutlass.Int32,
                 queries: cutlass.Int32, lists_per_block: cutlass.Int32, entries0: cutlass.Int32,
                 entries1: cutlass.Int32, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            s_warp: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, self.warps], 16]

        self.traced["smem_bytes"] = SharedStorage.size_in_bytes()
        self.kernel(lists, items, item_count, seqlen, queries, lists_per_block, entries0, entries1,
                    SharedStorage).launch(grid=(lists.shape[0], items.shape[0], 1), block=(self.threads, 1, 1),
                                          smem=self.traced["smem_bytes"], stream=stream)

    @cute.kernel
    def kernel(self, lists, items, item_count, seqlen: cutlass.Int32, queries: cutlass.Int32,
               lists_per_block: cutlass.Int32, entries0: cutlass.Int32, entries1: cutlass.Int32,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        n, m, _ = cute.arch.block_idx()
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        s_warp = storage.s_warp.get_tensor(cute.make_layout(self.warps))
        size = entries0
        if m == 1:
            size = entries1
        qc = n % cute.ceil_div(seqlen, queries)
        nb = cute.ceil_div(cutlass.min(seqlen, (qc + 1) * queries), self.block_size)
        n_lists = lists_per_block * nb
        per = cute.ceil_div(n_lists, self.threads)
        l0 = tidx * per
        l1 = cutlass.min(n_lists, l0 + per)
        mine = cutlass.Int32(0)
        for l in cutlass.range(l0, l1, unroll=1):
            mine += cute.ceil_div(cutlass.Int32(lists[n, 1, l]), size)
        w, total = exclusive_scan(s_warp, mine, self.warps, self.warps)
        for l in cutlass.range(l0, l1, unroll=1):
            count = cutlass.Int32(lists[n, 1, l])
            start = cutlass.Int32(lists[n, 0, l])
            bp = l // nb
            j = l - bp * nb
            for first in cutlass.range(0, count, size, unroll=1):
                items[m, n, w, 0] = bp
                items[m, n, w, 1] = j
                items[m, n, w, 2] = start + first
                items[m, n, w, 3] = cutlass.min(size, count - first)
                w += 1
        for r in cutlass.range(total + tidx, items.shape[2], self.threads, unroll=1):
            for f in cutlass.range_constexpr(4):
                items[m, n, r, f] = cutlass.Int32(0)
        if tidx == 0:
            item_count[m, n] = total
