"""The deferred KL value (kl_metric) of a backward over a pack (flash_msa_rt.ops.packed): each call hands back its KL
rows through a sink (the kernels' kl_rows_out) instead of writing its own mean, and kl_metric becomes one mean over
the pack's real rows, so a pack keeps the proxy backward's fused KL value (docs/kl-modes.md)."""

from __future__ import annotations

import torch


class PackKL:
    """A backward's kl_metric (deferred KL mode) over a pack run as several calls, or as padded ones: each call
    hands back its KL rows (the impl's kl_rows_out) rather than writing its own mean, and the metric becomes the
    mean over the pack's real rows (flash_msa_rt.api's kl_loss: the sum over (p, token) over Hp * total), so the
    backward's fused KL value serves packs as it serves one sequence."""

    def __init__(self, kl_metric: torch.Tensor | None, total: int):
        self.kl_metric, self.total, self.sums, self.heads = kl_metric, total, [], 0
        # the stream that reads the sums (a call may run on a side stream: SideStreams)
        cuda = kl_metric is not None and kl_metric.is_cuda
        self.main = torch.cuda.current_stream(kl_metric.device) if cuda else None

    @classmethod
    def take(cls, kwargs: dict, total: int) -> PackKL:
        """The op's kl_metric, taken out of kwargs (None: nothing to do)."""
        return cls(kwargs.pop("kl_metric", None), total)

    def call_kwargs(self, kwargs: dict, keep: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                    rows: tuple[int, int] | None = None) -> dict:
        """kwargs of one call whose real rows are `keep` (indices among its flattened count * length rows: an eager
        padded batch), `valid` ((count, length) bool: the device plan, no host read) or `rows` ((first, count) of
        one sequence's front-padded rows: separate key offsets), all of them without any. The call's rows are
        summed as it returns (in call order: deterministic)."""
        if self.kl_metric is None:
            return kwargs
        return dict(kwargs, kl_rows_out=_RowsSum(self, keep, valid, rows))

    def written(self, out):
        """out, after the mean of the calls' rows went into kl_metric (NaN where no call handed rows back: an impl
        that ignores kl_rows_out must not pass for a KL of 0)."""
        if self.kl_metric is not None:
            if self.sums:
                self.kl_metric.copy_(torch.stack(self.sums).sum() / max(self.heads * self.total, 1))
            else:
                self.kl_metric.fill_(float("nan"))
        return out


class _RowsSum(list):
    """kl_rows_out of one call: append((count, Hp, length) rows) adds the real rows' sum to the pack's."""

    def __init__(self, pack: PackKL, keep: torch.Tensor | None, valid: torch.Tensor | None,
                 rows: tuple[int, int] | None):
        super().__init__()
        self.pack, self.keep, self.valid, self.rows = pack, keep, valid, rows

    def append(self, rows: torch.Tensor) -> None:
        count, heads, length = rows.shape
        if self.keep is not None:
            rows = rows.transpose(0, 1).reshape(heads, count * length).index_select(1, self.keep)
        elif self.valid is not None:  # a padded row's value may be anything (NaN included): where, not a product
            rows = torch.where(self.valid[:, None, :], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        elif self.rows is not None:
            rows = rows.narrow(2, *self.rows)
        total = rows.sum(dtype=torch.promote_types(rows.dtype, torch.float32))
        if self.pack.main is not None:
            total.record_stream(self.pack.main)
        self.pack.sums.append(total)
        self.pack.heads = heads
