"""The host cost of an eager flash_msa_func forward + backward, on any machine (no GPU): configuration (a), B = 1,
CPU tensors, two setups.

  api:     the ops' bodies replaced by empty outputs of the right shapes: what is timed is flash_msa_func's checks
           and views, the op layer (torch.library's custom ops or the eager fast path), the KL mean and the autograd
           engine.
  runtime: the whole host path down to the launch: the CUDA kernel backend's Python (flash_msa_rt.ops.kernels,
           select, sparse_fwd, sparse_bwd, sparse_plan with the plan kernels' route), the loader's cached launch
           (launch signature, packed-params lookup) with only the driver call (cuLaunchKernelEx) a no-op; on CPU
           tensors, the arch taken as sm90a. The torch ops then run on the CPU: at a small S (default 256: the same
           chunks, plans and launches as 8K) their cost is mostly dispatch, as on the GPU where they are enqueued.

Per setup and op layer: us per fwd + bwd step (the best of --rounds rounds: other load on the machine only adds),
exclusive time per layer (the best of three passes each), the torch ops of one forward and of one backward
(top-level aten ops under the profiler: views, allocations, others, and the layer that called them), kernel launches
and packed-params misses (a miss packs params and may encode TMA descriptors: tens of us on the GPU machine; on the
CPU the allocator rarely hands back the same pointers, on the GPU the caching allocator mostly does).

    python benchmarks/host_api_cpu.py [--seqlen 256] [--setups api,runtime] [--kl-value exact]
        [--paths eager,custom_op] [--profile]

--paths custom_op runs the torch.library custom ops (what torch.compile and export see) by declaring the eager fast
path unusable for the run (flash_msa_rt.ops.eager.usable; a benchmark-only patch, restored after).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_msa_rt import api, loader  # noqa: E402
from flash_msa_rt.ops import dispatch, kernels, library, select, sparse_bwd, sparse_fwd, sparse_plan  # noqa: E402
from flash_msa_rt.ops.backends import Backend, register_backend, unregister_backend  # noqa: E402

try:
    from flash_msa_rt.ops import eager
except ImportError:  # a tree without the eager fast path: the custom ops only
    eager = None

CONFIG_A = dict(H=16, Hk=2, Hp=4, Hpk=1, D=128)
VIEWS = {"view", "_unsafe_view", "as_strided", "slice", "select", "reshape", "expand", "transpose", "permute",
         "unsqueeze", "squeeze", "narrow", "split", "split_with_sizes", "detach", "alias", "t", "flatten",
         "broadcast_to", "unflatten", "view_as", "expand_as", "contiguous", "lift_fresh"}
ALLOCS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


class _Patches:
    """setattr that remembers the old values; undone in reverse order."""

    def __init__(self):
        self._old = []

    def set(self, obj, name, value):
        self._old.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self):
        for obj, name, value in reversed(self._old):
            setattr(obj, name, value)
        self._old.clear()


class Layers:
    """Exclusive wall time per layer: wrap(fn, layer) charges fn's time, less that of the wrapped calls inside it,
    to layer; the rest of a step is charged to `base`. Under the profiler each wrapped call is also a
    record_function range named after its layer, so torch ops can be attributed to it."""

    def __init__(self, base: str):
        self.time = defaultdict(float)
        self.stack = [base]
        self.last = time.perf_counter()
        self.annotate = False

    def reset(self):
        self.time.clear()
        self.last = time.perf_counter()

    def wrap(self, fn, layer: str):
        def wrapped(*args, **kwargs):
            now = time.perf_counter()
            self.time[self.stack[-1]] += now - self.last
            self.stack.append(layer)
            self.last = now
            try:
                if self.annotate:
                    with torch.profiler.record_function(f"layer:{layer}"):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                now = time.perf_counter()
                self.time[self.stack.pop()] += now - self.last
                self.last = now

        wrapped.__wrapped__ = fn
        return wrapped

    def close(self):
        now = time.perf_counter()
        self.time[self.stack[-1]] += now - self.last
        self.last = now


# --- setup "api": empty op bodies ----------------------------------------------------------------------------------

def _empty_impl(op, device, dtype, **config):
    """dispatch.implementation with bodies that only allocate their outputs."""
    if op == "select_blocks":
        return lambda qp, kp, K, bs, scale, cu=None, **kw: torch.empty(qp.shape[0], qp.shape[2], qp.shape[1], K,
                                                                        dtype=torch.int32)
    if op in ("msa_forward", "msa_kl"):
        def forward(qp, kp, q, *rest, **kw):
            B, S, H, _ = q.shape
            stats = (torch.empty(B, H, S), torch.empty(B, qp.shape[2], S), torch.empty(B, qp.shape[2], S))
            return stats[1:] if op == "msa_kl" else (torch.empty_like(q), *stats)
        return forward
    if op == "msa_backward":
        return lambda qp, kp, q, k, v, *rest, **kw: tuple(torch.empty_like(t) for t in (qp, kp, q, k, v))
    raise KeyError(op)


@contextlib.contextmanager
def empty_bodies(layers: Layers):
    patches = _Patches()
    patches.set(dispatch, "implementation", lambda *a, **kw: layers.wrap(_empty_impl(*a, **kw), "backend"))
    try:
        yield SimpleNamespace(launches=Counter(), misses=Counter())
    finally:
        patches.undo()


# --- setup "runtime": the kernel backend down to a no-op driver call ----------------------------------------------

class NoLaunchKernel(loader.Kernel):
    """A loader.Kernel whose hot path (Kernel.__call__: launch signature, packed-params cache, stream) is the real
    one; a cache miss makes a stand-in Packed (counted) and the driver call is a no-op (counted)."""

    def __init__(self, op: str, stats):
        self.entry = SimpleNamespace(op=op)
        self.device_index = 0
        self._func = op
        self._arg_names = None
        self._packed = OrderedDict()
        self._stats = stats

    def __call__(self, stream=None, **args):
        if self._arg_names is None:  # the manifest's params: here the names the launcher passes
            self._arg_names = tuple(args)
        return super().__call__(stream, **args)

    def _prepare(self, key, args):
        self._stats.misses[self.entry.op] += 1
        packed = SimpleNamespace(config=SimpleNamespace(hStream=None), address=0)
        if key is not None:
            self._packed[key] = packed
            if len(self._packed) > loader.POINTER_CACHE_SIZE:
                self._packed.popitem(last=False)
        return packed


@contextlib.contextmanager
def runtime_without_launches(layers: Layers, arch: str = "sm90a"):
    """The CUDA kernel backend registered for CPU tensors (its supports() and first-use guard skipped: they are
    per-process, not per-call), arch taken as `arch`, kernels loaded as NoLaunchKernel, the driver launch a no-op,
    and the plan kernels' route taken (sparse_plan.lists_on_device asks is_cuda)."""
    stats = SimpleNamespace(launches=Counter(), misses=Counter())
    patches = _Patches()
    kernel_call = loader.Kernel.__call__
    patches.set(loader.Kernel, "__call__", layers.wrap(kernel_call, "loader"))

    def get_kernel(op, config, device):  # loader.get_kernel's hot path: one dict lookup per call
        request = (op, tuple(config.items()), 0)
        kernel = loader._by_request.get(request)
        if kernel is None:
            kernel = loader._by_request[request] = NoLaunchKernel(op, stats)
        return kernel

    def launch(cfg, func, address):
        stats.launches[func] += 1

    for module in (loader, select, sparse_fwd, sparse_bwd):
        patches.set(module, "get_kernel", get_kernel)
    patches.set(loader, "current_stream", lambda index: 0)
    patches.set(loader.driver, "launch", layers.wrap(launch, "driver"))
    for module in (select, sparse_fwd, sparse_bwd, kernels):
        patches.set(module, "arch_of", lambda device: arch)
    lists_on_device = sparse_plan.lists_on_device
    patches.set(sparse_plan, "lists_on_device", lambda sel, *a: lists_on_device(
        SimpleNamespace(is_cuda=True, shape=sel.shape), *a))
    for name in ("chunk_plans", "sparse_plan", "recut"):
        patches.set(sparse_plan, name, layers.wrap(getattr(sparse_plan, name), "plan"))
    for module in (sparse_fwd, sparse_bwd):
        for name in ("chunk_plans", "sparse_plan", "recut"):
            if hasattr(module, name):
                patches.set(module, name, getattr(sparse_plan, name))
    ops = {op: layers.wrap(fn, "backend") for op, fn in kernels.KERNELS.ops.items()}
    register_backend(Backend("kernels-on-cpu", "cpu", supports=lambda problem: None, ops=ops))
    try:
        yield stats
    finally:
        unregister_backend("kernels-on-cpu")
        patches.undo()
        loader._by_request.clear()


# --- the step ------------------------------------------------------------------------------------------------------

def _wrap_op_layer(layers: Layers, patches: _Patches):
    """Charge the op layer (custom ops or eager Functions, called from the API and from the backward rules) and the
    API's own code to their layers."""
    patches.set(api, "flash_msa_func", layers.wrap(api.flash_msa_func, "api"))
    for name in ("select_blocks", "msa_forward", "msa_kl", "msa_backward"):
        patches.set(library, name, layers.wrap(getattr(library, name), "op layer"))
    if eager is not None:
        for name in dir(eager):
            fn = getattr(eager, name)
            if callable(fn) and not isinstance(fn, type) and getattr(fn, "__module__", "") == eager.__name__ \
                    and not name.startswith("__"):
                patches.set(eager, name, layers.wrap(fn, "op layer"))


def make_step(S: int, kl_value: str):
    c = CONFIG_A
    leaves = [torch.randn(1, S, h, c["D"], dtype=torch.bfloat16).requires_grad_()
              for h in (c["Hp"], c["Hpk"], c["H"], c["Hk"], c["Hk"])]
    dout, coef = torch.randn(1, S, c["H"] * c["D"], dtype=torch.bfloat16), torch.tensor(0.1)
    metric = torch.zeros(()) if kl_value == "deferred" else None

    def forward():
        return api.flash_msa_func(*leaves, top_k=2048, layout="bshd", kl_value=kl_value, kl_metric=metric)

    def backward(out, kl):
        return torch.autograd.grad((out, kl), leaves, (dout, coef))

    return forward, backward


def top_level_ops(prof) -> tuple[Counter, Counter]:
    """(by kind, by layer) counts of the aten ops called outside any other aten op."""
    kinds, by_layer = Counter(), Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent, layer = e.cpu_parent, "api / autograd"
        nested = False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            if parent.name.startswith("layer:") and layer == "api / autograd":
                layer = parent.name[len("layer:"):]
            parent = parent.cpu_parent
        if nested:
            continue
        name = e.name[len("aten::"):]
        kinds["view" if name in VIEWS else "alloc" if name in ALLOCS else "other"] += 1
        by_layer[layer] += 1
    return kinds, by_layer


def measure(setup: str, path: str, S: int, kl_value: str, rounds: int, steps: int, profile: bool) -> dict:
    layers = Layers("api / autograd")
    patches = _Patches()
    if path == "custom_op" and eager is not None:  # (a tree without the eager path runs the custom ops only)
        patches.set(eager, "usable", lambda *tensors: False)
    elif path == "eager" and eager is None:
        raise SystemExit("--paths eager: this tree has no flash_msa_rt.ops.eager")
    _wrap_op_layer(layers, patches)
    env = empty_bodies if setup == "api" else runtime_without_launches
    forward, backward = make_step(S, kl_value)
    try:
        with env(layers) as stats:
            for _ in range(20):
                backward(*forward())
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(steps):
                    backward(*forward())
                times.append((time.perf_counter() - t0) / steps * 1e6)
            stats.launches.clear()
            stats.misses.clear()
            per_layer = {}
            for _ in range(3):
                layers.reset()
                for _ in range(steps):
                    backward(*forward())
                layers.close()
                for name, seconds in layers.time.items():
                    per_layer[name] = min(per_layer.get(name, float("inf")), seconds / steps * 1e6)
            per_layer = dict(sorted(per_layer.items(), key=lambda kv: -kv[1]))
            launches = sum(stats.launches.values()) / (3 * steps)
            misses = dict(stats.misses)
            layers.annotate = True
            ops = {}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = forward()
            ops["forward"] = top_level_ops(prof)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                backward(*out)
            ops["backward"] = top_level_ops(prof)
            layers.annotate = False
            if profile:
                cp = cProfile.Profile()
                cp.enable()
                for _ in range(100):
                    backward(*forward())
                cp.disable()
                pstats.Stats(cp).sort_stats("cumulative").print_stats(40)
    finally:
        patches.undo()
    return dict(setup=setup, path=path, S=S, kl_value=kl_value, us_per_step=min(times),
                us_per_step_median=statistics.median(times),
                us_per_layer=per_layer, launches_per_step=launches, packed_misses=misses,
                ops={phase: {"total": sum(k.values()), "by_kind": dict(k), "by_layer": dict(lay)}
                     for phase, (k, lay) in ops.items()})


def report(r: dict) -> None:
    print(f"\n(a) B=1 S={r['S']} kl_value={r['kl_value']} setup={r['setup']} path={r['path']}: "
          f"{r['us_per_step']:.1f} us per fwd + bwd step (best round; median {r['us_per_step_median']:.1f})")
    print("  exclusive us per layer: " + ", ".join(f"{k} {v:.1f}" for k, v in r["us_per_layer"].items()))
    for phase, o in r["ops"].items():
        print(f"  {phase}: {o['total']} torch ops ({', '.join(f'{k} {v}' for k, v in sorted(o['by_kind'].items()))};"
              f" by layer: {', '.join(f'{k} {v}' for k, v in sorted(o['by_layer'].items()))})")
    if r["setup"] == "runtime":
        print(f"  kernel launches per step: {r['launches_per_step']:.0f}; packed-params misses over the timed "
              f"steps: {r['packed_misses'] or 'none'}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--setups", default="api,runtime")
    p.add_argument("--paths", default="eager,custom_op" if eager is not None else "custom_op")
    p.add_argument("--kl-value", default="exact", choices=("exact", "deferred", "none"))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile", action="store_true", help="print the cProfile of 100 steps per setup")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the CPU ops are tiny: intra-op threads would only add noise
    for setup in args.setups.split(","):
        for path in args.paths.split(","):
            report(measure(setup, path, args.seqlen, args.kl_value, args.rounds, args.steps, args.profile))


if __name__ == "__main__":
    main()
