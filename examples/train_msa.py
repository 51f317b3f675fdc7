"""End-to-end MSA training example: a byte-level transformer on the Python standard library's source.

One command trains the same model twice from the same initial weights on the same batches:
  msa    MiniMax Sparse Attention through flash_msa_rt: `--warmup-steps` steps of flash_msa_warmup_func (dense
         main attention, proxy trained by KL), then flash_msa_func (main attention over the proxy's top-k blocks)
  dense  the baseline: dense causal attention through torch SDPA
and writes metrics.json, metrics.png and checkpoints into --out, then prints a summary table.

    python examples/train_msa.py                      # CPU preset: a few minutes on 2 cores
    python examples/train_msa.py --preset gpu         # 32K tokens per sequence, bf16, block 128, top_k 2048
    python examples/train_msa.py --resume runs/msa/checkpoints/msa_step000100.pt

Loss = LM loss + kl_coef * proxy KL. See examples/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO)):  # sibling modules, and the source tree's flash_msa_rt when not installed
    if p not in sys.path:
        sys.path.insert(0 if p == str(HERE) else len(sys.path), p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from corpus import load_corpus  # noqa: E402
from msa_metrics import proxy_recall  # noqa: E402
from msa_model import ByteLM, ModelConfig, dense_attend, msa_attend  # noqa: E402

RUNS = ("msa", "dense")
# proxy_recall's means over the layers: the run's own recall and coverage, and both selection precisions' recall
# with their set agreement on the same proxy
RECALL_KEYS = ("recall", "coverage", "recall_bf16", "recall_fp8", "agreement")


@dataclass
class TrainConfig:
    # data and schedule
    seq_len: int = 1024
    batch_size: int = 2
    steps: int = 100
    warmup_steps: int = 30  # MSA warmup mode (dense main attention) before sparse mode
    lr: float = 3e-3
    lr_warmup: int = 10  # linear learning-rate warmup, then cosine to lr_min_ratio * lr
    lr_min_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    kl_coef: float = 1.0
    # "deferred": the forward skips the KL pass and the backward writes the KL value into each layer's metric
    # (logged as "kl"); "exact": kl_loss carries it from the forward; "auto": resolved_kl_value. The gradients are
    # the same in both modes.
    kl_value: str = "auto"
    # The sparse steps' selection scores: "bf16" (the inputs' precision) or "fp8" (e4m3 proxy scores, docs/msa-
    # semantics.md "Selection precision"); recall is measured for both either way (recall_bf16, recall_fp8).
    select_precision: str = "bf16"
    # Issue 58's options on the MSA runs: a learned sink logit per head and layer (gpt-oss-style models; the
    # dense baseline stays plain softmax), and the number of recent blocks every query always selects.
    sinks: bool = False
    local_blocks: int = 1
    seed: int = 0
    max_corpus_bytes: int | None = None
    # torch.compile of the model's training forward (its backward compiles with it): "auto" is on for CUDA and off
    # on the CPU, where the run is bound by the pure-PyTorch reference's math, not by Python overhead, and inductor's
    # C++ compilation of each graph (tens of seconds per graph and mode on the 2-core machine) outweighs a few-minute
    # run; "on" / "off" force it. Compare tokens/s of a run with --compile on and one with --compile off.
    compile: str = "auto"
    # MSA
    block_size: int = 64
    top_k: int = 256  # tokens, a multiple of block_size
    # model
    d_model: int = 256
    n_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    proxy_heads: int = 2
    proxy_kv_heads: int = 1
    proxy_dim: int = 64
    rope_base: float = 10000.0
    # machine
    device: str = "cpu"
    dtype: str = "float32"  # or bfloat16 (autocast; attention inputs in bf16)
    # bookkeeping
    runs: tuple[str, ...] = RUNS
    recall_every: int = 10
    recall_queries: int = 128
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 50
    keep_checkpoints: int = 2

    def model_config(self) -> ModelConfig:
        return ModelConfig(d_model=self.d_model, n_layers=self.n_layers, heads=self.heads, kv_heads=self.kv_heads,
                           head_dim=self.head_dim, proxy_heads=self.proxy_heads, proxy_kv_heads=self.proxy_kv_heads,
                           proxy_dim=self.proxy_dim, rope_base=self.rope_base, sinks=self.sinks)

    def validate(self) -> None:
        if self.top_k % self.block_size or self.top_k < self.block_size:
            raise ValueError(f"top_k = {self.top_k} must be a positive multiple of block_size = {self.block_size}")
        if self.warmup_steps < 0 or self.steps < 1:
            raise ValueError(f"steps = {self.steps} must be >= 1 and warmup_steps = {self.warmup_steps} >= 0")
        if self.kl_value not in ("auto", "exact", "deferred"):
            raise ValueError(f"kl_value = {self.kl_value!r}; supported: 'auto', 'exact', 'deferred' (the run logs the "
                             f"KL)")
        if self.select_precision not in ("bf16", "fp8"):
            raise ValueError(f"select_precision = {self.select_precision!r}; supported: 'bf16', 'fp8'")
        if not 1 <= self.local_blocks <= self.top_k // self.block_size:
            raise ValueError(f"local_blocks = {self.local_blocks}; supported: 1 <= local_blocks <= top_k // block_size "
                             f"= {self.top_k // self.block_size}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile = {self.compile!r}; supported: 'auto', 'on', 'off'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype = {self.dtype!r}; supported: 'float32', 'bfloat16'")
        bad = [r for r in self.runs if r not in RUNS]
        if bad or not self.runs:
            raise ValueError(f"runs = {self.runs!r}; choose from {RUNS}")
        self.model_config()  # validates the head layout


PRESETS: dict[str, dict] = {
    # 2-core CPU, pure-PyTorch reference path: 16 blocks of 64 per sequence, 4 selected, so sparse mode drops
    # up to 3/4 of the keys of late queries.
    "cpu": {},
    # One H200: 32K tokens per sequence, 256 blocks of 128, 16 selected (2048 tokens). Kernels when built.
    "gpu": dict(seq_len=32768, batch_size=1, steps=600, warmup_steps=150, lr=1e-3, lr_warmup=50, block_size=128,
                top_k=2048, d_model=1024, n_layers=8, heads=8, kv_heads=2, head_dim=128, proxy_heads=2,
                proxy_kv_heads=1, proxy_dim=128, rope_base=500000.0, device="cuda", dtype="bfloat16",
                recall_every=25, recall_queries=256, eval_every=150, eval_batches=4, ckpt_every=150),
    # CI: seconds on a CPU.
    "tiny": dict(seq_len=256, batch_size=2, steps=6, warmup_steps=2, lr=3e-3, lr_warmup=2, block_size=64,
                 top_k=128, d_model=64, n_layers=1, heads=2, kv_heads=1, head_dim=64, proxy_heads=1,
                 proxy_kv_heads=1, proxy_dim=64, recall_every=2, recall_queries=32, eval_every=3, eval_batches=1,
                 ckpt_every=3, max_corpus_bytes=1 << 20),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="base configuration")
    p.add_argument("--out", type=Path, default=None, help="output dir (default examples/runs/<preset>)")
    p.add_argument("--resume", type=Path, default=None,
                   help="checkpoint to continue from; its config is used (only --out and --no-plot may change)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallelism over N processes (launch with torchrun --nproc-per-node N; gloo on CPU, "
                        "NCCL on GPUs): the MSA run only, each sequence sharded (examples/train_cp.py)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "runs":
            p.add_argument(flag, default=None, help=f"comma-separated subset of {','.join(RUNS)}")
        elif f.type in (bool, "bool"):
            p.add_argument(flag, action="store_const", const=True, default=None, help=f"default {f.default!r}")
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
            kind = int if f.name == "max_corpus_bytes" else kind
            p.add_argument(flag, type=kind, default=None, help=f"default {f.default!r} (cpu preset)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> TrainConfig:
    values = dict(PRESETS[args.preset])
    for f in fields(TrainConfig):
        v = getattr(args, f.name)
        if v is not None:
            values[f.name] = tuple(r.strip() for r in v.split(",") if r.strip()) if f.name == "runs" else v
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg


# --- helpers -----------------------------------------------------------------------------------------------

def git_state() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD") or None
    # Tracked files that differ from the commit (the measured code is the commit plus these edits).
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()] if commit else []
    return {"commit": commit, "dirty": bool(dirty), "dirty_paths": dirty}


def resolved_kl_value(cfg: TrainConfig) -> str:
    """cfg.kl_value, "auto" made "deferred" where MSA runs on the kernels (the forward skips the KL pass) and "exact"
    on the reference, whose KL pass alone is its whole forward again: 40 steps of the cpu preset took 57.0 s
    deferred against 44.9 s exact on the 2-core CPU (commit 0b47ea0)."""
    if cfg.kl_value != "auto":
        return cfg.kl_value
    return "deferred" if msa_backend(cfg) == "kernels" else "exact"


def resolved_compile(cfg: TrainConfig) -> bool:
    """cfg.compile, "auto" on for CUDA only (TrainConfig.compile says why)."""
    return cfg.compile == "on" or cfg.compile == "auto" and torch.device(cfg.device).type == "cuda"


def msa_backend(cfg: TrainConfig) -> str:
    """Which implementation flash_msa_rt will pick for this run's sparse forward (printed before training; the
    summary reports the backends that actually ran, observed_backends)."""
    try:
        from flash_msa_rt.ops import dispatch

        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        config = {"head_dim": cfg.head_dim, "proxy_head_dim": cfg.proxy_dim, "block_size": cfg.block_size,
                  "group": cfg.heads // cfg.proxy_heads, "kv_group": cfg.heads // cfg.kv_heads, "varlen": False}
        impl = dispatch.implementation("msa_forward", torch.device(cfg.device), dtype, **config)
        return next((b.name for b in dispatch.backends() if b.ops.get("msa_forward") is impl), "unknown")
    except Exception as e:  # an internal module may move; the run does not depend on this
        return f"unknown ({type(e).__name__}: {e})"


def recording_backends():
    """Context manager recording {op: {backend}} of every MSA op the run dispatches (flash_msa_rt.selftest's
    record); a no-op recorder when the installed flash_msa_rt predates it."""
    try:
        from flash_msa_rt.selftest import resolved_backends

        return resolved_backends()
    except ImportError:
        return nullcontext({})


def backend_label(observed: dict) -> str:
    """'kernels', 'reference', or both with the ops that ran on the reference."""
    names = {n for ns in observed.values() for n in ns}
    if not names:
        return "unknown"
    if "reference" not in names:
        return ", ".join(sorted(names))
    if names == {"reference"}:
        return "reference"
    on_ref = sorted(op for op, ns in observed.items() if "reference" in ns)
    return f"{', '.join(sorted(names - {'reference'}))} + reference ({', '.join(on_ref)})"


def backend_note(label: str, device: str) -> str:
    """What to expect from the backend that ran (printed with the summary and shown on the plot)."""
    if label == "reference":
        return ("MSA ran on the pure-PyTorch reference (flash_msa_rt.reference), slow by design: exact float32 "
                f"math, query chunks scored against their whole causal prefix, on {device}; its tokens/s says "
                "nothing about the kernels (on an H200 the kernels' sparse steps ran at 1.71x dense: "
                "examples/README.md)")
    if "reference" in label:
        return f"MSA ran partly on the slow pure-PyTorch reference ({label}): its tokens/s is not the kernels'"
    return f"MSA ran on the AOT kernels ({label})"


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.lr_warmup:
        return cfg.lr * (step + 1) / cfg.lr_warmup
    frac = (step - cfg.lr_warmup) / max(1, cfg.steps - cfg.lr_warmup)
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def step_generator(cfg: TrainConfig, stream: int, index: int) -> torch.Generator:
    """Independent, reproducible random stream per (seed, purpose, index): stream 0 train batches, 1 val
    batches, 2 recall queries."""
    return torch.Generator().manual_seed((cfg.seed * 7919 + stream) * 1_000_003 + index)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def empty_run_metrics() -> dict:
    return {
        "history": {k: [] for k in ("step", "mode", "lm_loss", "kl", "loss", "tokens_per_s", "lr")},
        "recall": {"step": [], "recall": [], "coverage": [], "per_layer": []},
        "val": {"step": [], "val_loss": []},
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- training ----------------------------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: TrainConfig, corpus, out: Path, progress: bool):
        self.cfg, self.corpus, self.out, self.progress = cfg, corpus, out, progress
        self.device = torch.device(cfg.device)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16"
                         else nullcontext())
        self.kl_value = resolved_kl_value(cfg) if "msa" in cfg.runs else "exact"
        self.compiled = resolved_compile(cfg)
        self.checkpoints: list[Path] = []  # the checkpoints this process wrote and kept, in order

    def mode(self, run: str, step: int) -> str:
        if run == "dense":
            return "dense"
        return "warmup" if step < self.cfg.warmup_steps else "sparse"

    def attend_fn(self, mode: str, kl_metrics: list | None = None):
        cfg = self.cfg
        inner = dense_attend if mode == "dense" else msa_attend(mode, cfg.top_k, cfg.block_size, self.kl_value,
                                                                kl_metrics, cfg.select_precision,
                                                                cfg.local_blocks)

        def attend(*tensors):
            # Attention runs outside autocast: it receives the bf16 (or fp32) tensors exactly as produced.
            with torch.autocast(self.device.type, enabled=False):
                return inner(*tensors)

        return attend

    def new_model(self):
        torch.manual_seed(self.cfg.seed)  # same initial weights for every run
        model = ByteLM(self.cfg.model_config()).to(self.device)
        opt = torch.optim.AdamW(model.param_groups(self.cfg.weight_decay), lr=self.cfg.lr, betas=(0.9, 0.95))
        return model, opt

    @torch.no_grad()
    def evaluate(self, model, attend) -> float:
        cfg, losses = self.cfg, []
        for i in range(cfg.eval_batches):
            x, y = self.corpus.batch("val", cfg.batch_size, cfg.seq_len, step_generator(cfg, 1, i), self.device)
            with self.autocast:
                logits, _ = model(x, attend)
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        return sum(losses) / len(losses)

    def measure_recall(self, sinks, step: int) -> dict:
        cfg, per_layer = self.cfg, []
        for layer, captured in enumerate(sinks):
            (qp, kp, q, k), = captured
            gen = step_generator(self.cfg, 2, step * 1000 + layer)
            per_layer.append(proxy_recall(qp, kp, q, k, top_k=cfg.top_k, block_size=cfg.block_size,
                                          num_queries=cfg.recall_queries, generator=gen,
                                          select_precision=cfg.select_precision))
        mean = {key: sum(r[key] for r in per_layer) / len(per_layer) for key in RECALL_KEYS}
        return {**mean, "per_layer": [r["recall"] for r in per_layer]}

    def save(self, run: str, step: int, model, opt, metrics: dict, finished: dict) -> Path:
        ckpt_dir = self.out / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        path = ckpt_dir / f"{run}_step{step:06d}.pt"
        state = {"run": run, "step": step, "config": asdict(self.cfg), "model": model.state_dict(),
                 "optimizer": opt.state_dict(), "rng": rng_state(self.device), "metrics": metrics,
                 "finished_runs": finished}
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint under the real name
        self.checkpoints.append(path)
        old = sorted(ckpt_dir.glob(f"{run}_step*.pt"))[:-self.cfg.keep_checkpoints or None]
        for p in old if self.cfg.keep_checkpoints > 0 else []:
            p.unlink()
            if p in self.checkpoints:
                self.checkpoints.remove(p)
        return path

    def train(self, run: str, finished: dict, resume: dict | None = None) -> dict:
        cfg = self.cfg
        model, opt = self.new_model()
        # The training forward, compiled where cfg.compile says (the flash_msa_rt ops are custom ops: one graph).
        forward = torch.compile(model) if self.compiled else model
        metrics, start = empty_run_metrics(), 0
        if resume is not None:
            model.load_state_dict(resume["model"])
            opt.load_state_dict(resume["optimizer"])
            metrics, start = resume["metrics"], resume["step"]
            set_rng_state(resume["rng"])
        h = metrics["history"]
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=start, desc=run, unit="step", dynamic_ncols=True)
        for step in range(start, cfg.steps):
            mode = self.mode(run, step)
            kl_metrics = []  # one per layer: the KL value, written by the forward ("exact") or backward ("deferred")
            attend = self.attend_fn(mode, kl_metrics)
            lr = lr_at(cfg, step)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = self.corpus.batch("train", cfg.batch_size, cfg.seq_len, step_generator(cfg, 0, step),
                                     self.device)
            want_recall = run == "msa" and (step % cfg.recall_every == 0 or step == cfg.steps - 1)
            sinks = model.set_capture(want_recall)

            sync(self.device)
            t0 = time.perf_counter()
            with self.autocast:  # recall steps run eager: the capture hooks keep tensors from inside the forward
                logits, kl = (model if want_recall else forward)(x, attend)
            lm = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss = lm + cfg.kl_coef * kl if mode != "dense" else lm
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            # The model's kl is the mean over layers; in "deferred" mode its value is 0 and the layers' metrics hold
            # the KL after the backward. .item() syncs: the timing is complete.
            lm_v = lm.item()
            kl_v = torch.stack(kl_metrics).mean().item() if kl_metrics else kl.item()
            loss_v = lm_v + cfg.kl_coef * kl_v if mode != "dense" else lm_v
            dt = time.perf_counter() - t0
            model.set_capture(False)

            h["step"].append(step)
            h["mode"].append(mode)
            h["lm_loss"].append(lm_v)
            h["kl"].append(kl_v if mode != "dense" else None)
            h["loss"].append(loss_v)
            h["tokens_per_s"].append(cfg.batch_size * cfg.seq_len / dt)
            h["lr"].append(lr)
            if want_recall:
                r = self.measure_recall(sinks, step)
                for key in (*RECALL_KEYS, "per_layer"):
                    metrics["recall"].setdefault(key, []).append(r[key])
                metrics["recall"]["step"].append(step)
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                metrics["val"]["step"].append(done)
                metrics["val"]["val_loss"].append(self.evaluate(model, self.attend_fn(mode)))  # no KL value asked
            if done % cfg.ckpt_every == 0 or done == cfg.steps:
                self.save(run, done, model, opt, metrics, finished)
            if bar is not None:
                post = {"mode": mode, "loss": f"{lm_v:.3f}", "tok/s": f"{h['tokens_per_s'][-1]:.0f}"}
                if mode != "dense":
                    post["kl"] = f"{kl_v:.3f}"
                if metrics["recall"]["step"]:
                    post["recall"] = f"{metrics['recall']['recall'][-1]:.3f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
        if bar is not None:
            bar.close()
        metrics["compiled"] = self.compiled
        metrics["summary"] = summarize(run, metrics)
        return metrics


# --- summary -----------------------------------------------------------------------------------------------

def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def summarize(run: str, m: dict) -> dict:
    h = m["history"]
    tail = h["lm_loss"][-10:]
    # The first step of a process pays one-off costs (allocations, kernel loading); leave it out of throughput.
    tps = {mode: _median([t for t, md in zip(h["tokens_per_s"][1:], h["mode"][1:]) if md == mode])
           for mode in ("warmup", "sparse", "dense")}
    main_mode = "dense" if run == "dense" else ("sparse" if tps["sparse"] is not None else "warmup")
    s = {
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "final_train_loss_steps": len(tail),
        "val_loss": m["val"]["val_loss"][-1] if m["val"]["val_loss"] else None,
        "tokens_per_s": tps[main_mode],
        "tokens_per_s_mode": main_mode,
        "compiled": m.get("compiled", False),  # tokens/s with torch.compile (TrainConfig.compile)
    }
    if run == "msa":
        kls = [v for v in h["kl"] if v is not None]
        s["tokens_per_s_warmup"] = tps["warmup"]
        s["final_kl"] = kls[-1] if kls else None
        s["final_recall"] = m["recall"]["recall"][-1] if m["recall"]["recall"] else None
        s["final_coverage"] = m["recall"]["coverage"][-1] if m["recall"]["coverage"] else None
        for key in ("recall_bf16", "recall_fp8", "agreement"):  # both selection precisions on the final proxy
            s[f"final_{key}"] = m["recall"][key][-1] if m["recall"].get(key) else None
    return s


def format_summary(metrics: dict) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    rows = [("run", "train loss", "val loss", "tokens/s", "proxy KL", "recall", "coverage")]
    for name, run in metrics["runs"].items():
        s = run["summary"]
        rows.append((name, f(s["final_train_loss"], ".4f"), f(s["val_loss"], ".4f"),
                     f(s["tokens_per_s"], ",.0f") + f" ({s['tokens_per_s_mode']}"
                     + (", compiled)" if s.get("compiled") else ", eager)"), f(s.get("final_kl"), ".4f"),
                     f(s.get("final_recall"), ".3f"), f(s.get("final_coverage"), ".3f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    kl_value = metrics.get("kl_value")
    if kl_value:
        lines.append(f"proxy KL: kl_value={kl_value!r} ("
                     + ("written by the backward into kl_metric; the forward skips the KL pass" if kl_value == "deferred"
                        else "kl_loss holds it after the forward") + "; the gradients are the same in both modes)")
    runs = metrics["runs"]
    if "msa" in runs and "dense" in runs:
        a, b = runs["msa"]["summary"], runs["dense"]["summary"]
        parts = []
        if a["val_loss"] is not None and b["val_loss"] is not None:
            parts.append(f"val loss MSA - dense = {a['val_loss'] - b['val_loss']:+.4f}")
        if a["tokens_per_s"] and b["tokens_per_s"]:
            parts.append(f"throughput MSA / dense = {a['tokens_per_s'] / b['tokens_per_s']:.2f}x")
        lines.append("; ".join(parts))
    cfg = metrics["config"]
    s = runs.get("msa", {}).get("summary", {})
    if s.get("final_recall_bf16") is not None:
        lines.append(f"selection: select_precision={cfg.get('select_precision', 'bf16')!r}; on the final proxy recall "
                     f"bf16 {s['final_recall_bf16']:.4f}, fp8 {s['final_recall_fp8']:.4f}, same set on "
                     f"{s['final_agreement']:.1%} of (proxy head, query) rows")
    if metrics.get("msa_backend_note"):
        lines.append(metrics["msa_backend_note"])
    lines.append(f"{metrics['device']}, MSA backend: {metrics['msa_backend']}; S = {cfg['seq_len']}, "
                 f"block {cfg['block_size']}, top_k {cfg['top_k']} ({cfg['top_k'] // cfg['block_size']} of "
                 f"{-(-cfg['seq_len'] // cfg['block_size'])} blocks); wall time {metrics['wall_time_s']:.1f} s, "
                 f"load average {metrics['load_average']['start']} -> {metrics['load_average']['end']}")
    return "\n".join(lines)


# --- entry point -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    t_start = time.perf_counter()
    resume = None
    if args.resume is not None:
        given = [f"--{f.name.replace('_', '-')}" for f in fields(TrainConfig) if getattr(args, f.name) is not None]
        if given:
            raise SystemExit(f"--resume continues with the checkpoint's config; drop {' '.join(given)} "
                             f"(only --out, --no-plot and --no-progress may be given with it)")
        resume = torch.load(args.resume, map_location="cpu", weights_only=False)
        cfg = TrainConfig(**{**resume["config"], "runs": tuple(resume["config"]["runs"])})
        cfg.validate()
    else:
        cfg = build_config(args)
    out = args.out if args.out is not None else HERE / "runs" / args.preset  # examples/.gitignore ignores runs/
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"device {cfg.device!r} asked for, but torch sees no CUDA device (try --preset cpu)")

    corpus = load_corpus(max_bytes=cfg.max_corpus_bytes)
    if args.cp > 1:
        return _main_cp(args, argv, cfg, corpus, out)
    trainer = Trainer(cfg, corpus, out, progress=not args.no_progress)
    metrics = {
        **git_state(),
        "command": shlex.join(["python", "examples/train_msa.py", *argv]),
        "resumed_from": str(args.resume) if args.resume else None,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads)"),
        "msa_backend": msa_backend(cfg) if "msa" in cfg.runs else None,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "config": asdict(cfg),
        "kl_value": trainer.kl_value,  # the mode the MSA run used (config's "auto" resolved)
        "corpus": corpus.info,
        # Other processes on a shared machine slow the steps down; the load average says how busy it was.
        "load_average": {"start": _loadavg()},
    }
    if metrics["msa_backend"] is not None:
        print(f"MSA backend: {metrics['msa_backend']}. {backend_note(metrics['msa_backend'], metrics['device'])}",
              flush=True)
    finished: dict = dict(resume["finished_runs"]) if resume else {}
    for run in cfg.runs:
        if run in finished:
            continue
        state = resume if resume is not None and resume["run"] == run else None
        recorder = recording_backends() if run == "msa" else nullcontext({})
        with recorder as observed:
            finished[run] = trainer.train(run, finished, state)
        if run == "msa" and observed:  # what ran, not what was predicted
            metrics["msa_backends"] = {op: sorted(ns) for op, ns in sorted(observed.items())}
            metrics["msa_backend"] = backend_label(observed)
    if metrics["msa_backend"] is not None:
        metrics["msa_backend_note"] = backend_note(metrics["msa_backend"], metrics["device"])
    metrics["runs"] = {r: finished[r] for r in cfg.runs}
    metrics["wall_time_s"] = time.perf_counter() - t_start
    metrics["load_average"]["end"] = _loadavg()

    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    if not args.no_plot:
        from plot_metrics import plot

        plot(metrics, out / "metrics.png")
    print(format_summary(metrics))
    written = [out / "metrics.json"] + ([] if args.no_plot else [out / "metrics.png"]) + trainer.checkpoints
    print(wrote_line(out, written))
    return metrics


def wrote_line(out: Path, files: list[Path]) -> str:
    """The closing line: every file the run wrote (checkpoints included), their total size, the folder."""
    total = sum(f.stat().st_size for f in files if f.exists())
    names = ", ".join(str(f.relative_to(out)) if f.is_relative_to(out) else str(f) for f in files)
    return f"wrote {len(files)} file{'s' if len(files) != 1 else ''} ({total / 1e6:.1f} MB) in {out}: {names}"


def _main_cp(args, argv, cfg, corpus, out: Path) -> dict:
    """--cp N under torchrun: the MSA run with each sequence sharded over N processes; rank 0 writes
    cp_metrics.json (the history, the same fields as metrics.json's) and prints the losses."""
    import torch.distributed as dist

    from train_cp import train_cp

    if args.resume is not None:
        raise SystemExit("--cp: resuming is not supported; start the run again")
    cuda = torch.device(cfg.device).type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_*
    try:
        if dist.get_world_size() != args.cp:
            raise SystemExit(f"--cp {args.cp} but the process group has {dist.get_world_size()} processes; launch "
                             f"with torchrun --nproc-per-node {args.cp}")
        if cuda:
            cfg = replace(cfg, device=f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
            torch.cuda.set_device(torch.device(cfg.device))
        trainer = Trainer(cfg, corpus, out, progress=False)
        history = train_cp(trainer)
        result = {**git_state(), "command": shlex.join(["torchrun", f"--nproc-per-node={args.cp}",
                                                         "examples/train_msa.py", *argv]),
                  "cp": args.cp, "scheme": "zigzag", "config": asdict(cfg), "kl_value": trainer.kl_value,
                  "history": history}
        if dist.get_rank() == 0:
            (out / "cp_metrics.json").write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {out / 'cp_metrics.json'} (kl_value={trainer.kl_value!r}, {args.cp} ranks)")
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
