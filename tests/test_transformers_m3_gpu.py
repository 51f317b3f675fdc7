"""flash_msa_rt.integrations.transformers on the kernels (bf16, D 128, blocks of 128) against transformers' own M3.

Tolerance: the bf16 model's error against the float32 "sdpa" path of the same weights, per tensor as a relative
Frobenius error, is at most twice the bf16 "sdpa" path's own error plus 1e-3 (what bf16 costs the model either way).
Training mode's selection runs on the kernels in bf16: a near tie may pick another block than the fp32 indexer,
within that tolerance. CPU forms in float32: test_transformers_m3.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.minimax_m3_vl", reason="the [transformers] extra is not installed")

import flash_msa_rt.integrations.transformers as fmt  # noqa: E402
from tests.m3_transformers import m3_config, m3_model  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden=256, heads=8, kv_heads=2, head_dim=128, index_heads=2, index_head_dim=128, block_size=128,
             topk_blocks=3)
S = 1024


def _model(dtype, **kw):
    return m3_model(m3_config(**{**SHAPE, **kw}), dtype=dtype, device="cuda")


def _tokens(B, S, seed=1):
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed)).cuda()


def _step(model, ids, position_ids=None, kl=None):
    model.zero_grad(set_to_none=True)
    logits = model(ids, position_ids=position_ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    if kl is not None:
        loss = loss + kl()
    loss.backward()
    return {"logits": logits.detach().float(),
            **{n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _assert_within_bf16(got, bf16_sdpa, fp32_sdpa, names):
    for n in names:
        limit = 2 * _rel(bf16_sdpa[n], fp32_sdpa[n]) + 1e-3
        assert _rel(got[n], fp32_sdpa[n]) <= limit, f"{n}: {_rel(got[n], fp32_sdpa[n]):.3g} > {limit:.3g}"


def _reference_runs(ids):
    fp32 = _step(_model(torch.float32), ids)
    bf16 = _step(_model(torch.bfloat16), ids)
    return fp32, bf16


@pytest.mark.parametrize("B", [1, 2])
def test_flash_msa_equals_the_sdpa_path_on_the_kernels(B):
    ids = _tokens(B, S)
    fp32, bf16 = _reference_runs(ids)
    got = _step(fmt.use_flash_msa(_model(torch.bfloat16)), ids)
    assert set(got) == set(bf16)
    _assert_within_bf16(got, bf16, fp32, sorted(bf16))


def test_training_sparse_equals_the_sdpa_path_on_the_kernels():
    ids = _tokens(1, S)
    fp32, bf16 = _reference_runs(ids)
    model = _model(torch.bfloat16)
    msa = fmt.enable_msa_training(model, mode="sparse")
    got = _step(model, ids, kl=msa.kl_loss)
    _assert_within_bf16(got, bf16, fp32, sorted(n for n in bf16 if ".indexer." not in n))
    metric = msa.kl_metrics()[0].item()
    assert metric > 0 and metric == metric
    indexer = [n for n in got if ".indexer." in n]
    assert indexer and all(got[n].isfinite().all() and got[n].abs().sum() > 0 for n in indexer)


def test_training_warmup_runs_dense_on_the_kernels():
    ids = _tokens(1, S)
    dense_fp32 = _model(torch.float32)
    dense_fp32.model.layers[0].self_attn.indexer.topk_blocks = S // 128
    dense_bf16 = _model(torch.bfloat16)
    dense_bf16.model.layers[0].self_attn.indexer.topk_blocks = S // 128
    fp32, bf16 = _step(dense_fp32, ids), _step(dense_bf16, ids)
    model = _model(torch.bfloat16)
    fmt.enable_msa_training(model, mode="warmup")
    got = _step(model, ids)
    _assert_within_bf16(got, bf16, fp32, sorted(n for n in bf16 if ".indexer." not in n))


def test_a_packed_batch_equals_each_document_alone_on_the_kernels():
    lengths = (640, 384)
    model = _model(torch.bfloat16)
    fmt.enable_msa_training(model, mode="sparse")
    ids = _tokens(1, sum(lengths), seed=4)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids).logits.float()
        alone = torch.cat([model(part).logits.float() for part in ids.split(lengths, dim=1)], 1)
    assert _rel(packed, alone) <= 1e-2
