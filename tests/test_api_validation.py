"""Every argument check of the public MSA API: the error type and a message naming the argument.

The checks run before any op, so none of these calls reaches the reference (they are fast and need no oracle).
"""

from __future__ import annotations

import pytest
import torch

from flash_msa_rt import api

B, S, H, Hk, Hp, Hpk, D, Dp, BS = 2, 9, 4, 2, 2, 1, 8, 4, 4


def _bhsd(heads, d, dtype=torch.float32):
    return torch.randn(B, heads, S, d, dtype=dtype)


def msa_args(**over):
    args = dict(q_proxy=_bhsd(Hp, Dp), k_proxy=_bhsd(Hpk, Dp), q=_bhsd(H, D), k=_bhsd(Hk, D), v=_bhsd(Hk, D),
                top_k=2 * BS, block_size=BS)
    args.update(over)
    return args


def call_msa(fn=api.flash_msa_func, **over):
    a = msa_args(**over)
    return fn(a.pop("q_proxy"), a.pop("k_proxy"), a.pop("q"), a.pop("k"), a.pop("v"), a.pop("top_k"), **a)


def varlen_args(**over):
    total = 11
    args = dict(q_proxy=torch.randn(total, Hp, Dp), k_proxy=torch.randn(total, Hpk, Dp), q=torch.randn(total, H, D),
                k=torch.randn(total, Hk, D), v=torch.randn(total, Hk, D),
                cu_seqlens=torch.tensor([0, 4, 11], dtype=torch.int32), max_seqlen=7, top_k=BS, block_size=BS)
    args.update(over)
    return args


def call_varlen(fn=api.flash_msa_varlen_func, **over):
    a = varlen_args(**over)
    pos = [a.pop(n) for n in ("q_proxy", "k_proxy", "q", "k", "v", "cu_seqlens", "max_seqlen", "top_k")]
    return fn(*pos, **a)


def strided_head_dim(t):
    """The same values with the head dim at stride 2."""
    wide = torch.stack([t, t], dim=-1)
    return wide[..., 0]


MSA_CASES = [
    # (id, overrides, error, words the message must contain)
    ("q_not_tensor", dict(q=[1.0]), TypeError, ["q", "torch.Tensor", "list"]),
    ("k_proxy_not_tensor", dict(k_proxy=None), TypeError, ["k_proxy", "NoneType"]),
    ("q_3d", dict(q=torch.randn(B, H, S)), ValueError, ["q", "4 dims", f"{(B, H, S)}"]),
    ("v_5d", dict(v=torch.randn(B, Hk, S, D, 1)), ValueError, ["v", "4 dims"]),
    ("int_dtype", dict(q=torch.ones(B, H, S, D, dtype=torch.int32)), TypeError, ["q", "torch.int32", "supported"]),
    ("fp8_dtype", dict(k=torch.randn(B, Hk, S, D).to(torch.float8_e4m3fn)), TypeError, ["k", "float8"]),
    ("mixed_dtype", dict(v=_bhsd(Hk, D, torch.bfloat16)), TypeError, ["v", "bfloat16", "float32", "one dtype"]),
    ("device_mismatch", dict(k=torch.randn(B, Hk, S, D, device="meta")), ValueError, ["k", "meta", "cpu"]),
    ("head_dim_stride", dict(q=strided_head_dim(_bhsd(H, D))), ValueError, ["q", "unit-stride", "contiguous"]),
    ("batch_mismatch", dict(k=torch.randn(B + 1, Hk, S, D)), ValueError, ["k", "batch 3", "batch 2"]),
    ("seqlen_mismatch", dict(q_proxy=torch.randn(B, Hp, S + 1, Dp)), ValueError, ["q_proxy", "seqlen 10", "9"]),
    ("head_dim_mismatch", dict(v=torch.randn(B, Hk, S, D + 1)), ValueError, ["v", "head_dim 9", "head_dim 8"]),
    ("kv_heads_mismatch", dict(v=torch.randn(B, 1, S, D)), ValueError, ["v", "1 heads", "k has 2"]),
    ("proxy_head_dim_mismatch", dict(k_proxy=torch.randn(B, Hpk, S, Dp + 2)), ValueError, ["k_proxy", "head_dim 6"]),
    ("gqa_divisibility", dict(k=torch.randn(B, 3, S, D), v=torch.randn(B, 3, S, D)), ValueError,
     ["4 heads", "3 heads", "H % Hk"]),
    ("proxy_divisibility", dict(k_proxy=torch.randn(B, 3, S, Dp)), ValueError, ["q_proxy", "2 heads", "k_proxy"]),
    ("main_proxy_divisibility", dict(q_proxy=torch.randn(B, 3, S, Dp), k_proxy=torch.randn(B, 3, S, Dp)),
     ValueError, ["4 heads", "3 heads of q_proxy"]),
    ("empty_seq", dict(q_proxy=torch.randn(B, Hp, 0, Dp), k_proxy=torch.randn(B, Hpk, 0, Dp), q=torch.randn(B, H, 0, D),
                       k=torch.randn(B, Hk, 0, D), v=torch.randn(B, Hk, 0, D)), ValueError, ["seqlen 0", "positive"]),
    ("top_k_not_multiple", dict(top_k=BS + 1), ValueError, ["top_k=5", "multiple of block_size=4"]),
    ("top_k_zero", dict(top_k=0), ValueError, ["top_k=0", "positive multiple"]),
    ("top_k_float", dict(top_k=8.0), TypeError, ["top_k", "int", "float"]),
    ("top_k_bool", dict(top_k=True), TypeError, ["top_k", "bool"]),
    ("block_size_zero", dict(block_size=0, top_k=4), ValueError, ["block_size", "positive int", "0"]),
    ("block_size_str", dict(block_size="128"), ValueError, ["block_size", "'128'"]),
    ("scale_nan", dict(scale=float("nan")), ValueError, ["scale", "nan", "finite and positive"]),
    ("scale_inf", dict(scale=float("inf")), ValueError, ["scale", "inf"]),
    ("scale_negative", dict(scale=-0.5), ValueError, ["scale", "-0.5"]),
    ("scale_zero", dict(scale=0.0), ValueError, ["scale", "0.0"]),
    ("scale_tensor", dict(scale=torch.tensor(0.3)), TypeError, ["scale", "Tensor", "float"]),
    ("layout_unknown", dict(layout="sbhd"), ValueError, ["layout='sbhd'", "'bhsd'", "'bshd'"]),
    ("layout_none", dict(layout=None), ValueError, ["layout=None"]),
    ("kl_metric_not_tensor", dict(kl_metric=0.0), TypeError, ["kl_metric", "float"]),
    ("kl_metric_shape", dict(kl_metric=torch.zeros(1)), ValueError, ["kl_metric", "0-dim", "(1,)"]),
    ("kl_metric_dtype", dict(kl_metric=torch.zeros((), dtype=torch.float64)), ValueError, ["kl_metric", "float64"]),
    ("kl_metric_device", dict(kl_metric=torch.zeros((), device="meta")), ValueError, ["kl_metric", "meta"]),
    ("kl_metric_requires_grad", dict(kl_metric=torch.zeros((), requires_grad=True)), ValueError,
     ["kl_metric", "require grad"]),
    ("cu_seqlens_not_tensor", dict(cu_seqlens=[0, S, 2 * S]), TypeError, ["cu_seqlens", "list"]),
    ("cu_seqlens_int64", dict(cu_seqlens=torch.tensor([0, S, 2 * S])), TypeError, ["cu_seqlens", "int32", "int64"]),
    ("cu_seqlens_2d", dict(cu_seqlens=torch.zeros(1, 3, dtype=torch.int32)), ValueError, ["cu_seqlens", "1-D"]),
    ("cu_seqlens_short", dict(cu_seqlens=torch.zeros(1, dtype=torch.int32)), ValueError, ["cu_seqlens", "2 entries"]),
    ("cu_seqlens_start", dict(cu_seqlens=torch.tensor([1, S, 2 * S], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "start at 0", "18"]),
    ("cu_seqlens_end", dict(cu_seqlens=torch.tensor([0, S, 2 * S - 1], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "end"]),
    ("cu_seqlens_decreasing", dict(cu_seqlens=torch.tensor([0, 5, 3, S, 2 * S], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "non-decreasing"]),
    ("cu_seqlens_row_boundary", dict(cu_seqlens=torch.tensor([0, 5, 2 * S], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "batch-row boundary", "[9]"]),
    ("cu_seqlens_device", dict(cu_seqlens=torch.zeros(3, dtype=torch.int32, device="meta")), ValueError,
     ["cu_seqlens", "meta"]),
    ("document_list_float", dict(document_list=torch.zeros(B, S)), TypeError, ["document_list", "integer"]),
    ("document_list_shape", dict(document_list=torch.zeros(B, S + 1, dtype=torch.int64)), ValueError,
     ["document_list", "(2, 9)", "(2, 10)"]),
    ("document_list_not_tensor", dict(document_list=[[0] * S] * B), TypeError, ["document_list", "list"]),
    ("document_list_and_cu_seqlens", dict(document_list=torch.zeros(B, S, dtype=torch.int64),
                                          cu_seqlens=torch.tensor([0, S, 2 * S], dtype=torch.int32)), ValueError,
     ["document_list", "cu_seqlens", "not both"]),
]


@pytest.mark.parametrize("fn", [api.flash_msa_func, api.flash_msa_warmup_func], ids=["sparse", "warmup"])
@pytest.mark.parametrize("over, error, words", [c[1:] for c in MSA_CASES], ids=[c[0] for c in MSA_CASES])
def test_msa_func_rejects(fn, over, error, words):
    with pytest.raises(error) as info:
        call_msa(fn, **over)
    msg = str(info.value)
    assert msg.startswith(fn.__name__ + ":"), msg
    for w in words:
        assert w in msg, (w, msg)


def test_bshd_layout_messages_name_the_layout():
    with pytest.raises(ValueError, match=r"q must have 4 dims \(batch, seqlen, heads, head_dim\)"):
        call_msa(q=torch.randn(B, S, H), layout="bshd")
    # A bhsd tensor passed as bshd disagrees in seqlen with the others, and the message says which.
    a = msa_args()
    with pytest.raises(ValueError, match="k has seqlen 2 but q has seqlen 9"):
        api.flash_msa_func(*(t.transpose(1, 2) for t in (a["q_proxy"], a["k_proxy"], a["q"])), a["k"],
                           a["v"].transpose(1, 2), 2 * BS, block_size=BS, layout="bshd")


VARLEN_CASES = [
    ("q_4d", dict(q=torch.randn(1, 11, H, D)), ValueError, ["q", "3 dims", "(total_tokens, heads, head_dim)"]),
    ("total_mismatch", dict(k=torch.randn(12, Hk, D)), ValueError, ["k", "total_tokens 12", "11"]),
    ("cu_seqlens_int64", dict(cu_seqlens=torch.tensor([0, 4, 11])), TypeError, ["cu_seqlens", "int32"]),
    ("cu_seqlens_end", dict(cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "11 tokens"]),
    ("cu_seqlens_decreasing", dict(cu_seqlens=torch.tensor([0, 6, 4, 11], dtype=torch.int32)), ValueError,
     ["non-decreasing"]),
    ("max_seqlen_small", dict(max_seqlen=6), ValueError, ["max_seqlen=6", "longest", "7"]),
    ("max_seqlen_float", dict(max_seqlen=7.0), ValueError, ["max_seqlen", "7.0"]),
    ("top_k", dict(top_k=3), ValueError, ["top_k=3"]),
    ("gqa", dict(k=torch.randn(11, 3, D), v=torch.randn(11, 3, D)), ValueError, ["H % Hk"]),
    ("dtype", dict(q_proxy=torch.randn(11, Hp, Dp, dtype=torch.float16)), TypeError, ["q_proxy", "float16"]),
    ("kl_metric", dict(kl_metric=torch.zeros(2)), ValueError, ["kl_metric"]),
]


@pytest.mark.parametrize("fn", [api.flash_msa_varlen_func, api.flash_msa_warmup_varlen_func],
                         ids=["sparse", "warmup"])
@pytest.mark.parametrize("over, error, words", [c[1:] for c in VARLEN_CASES], ids=[c[0] for c in VARLEN_CASES])
def test_varlen_func_rejects(fn, over, error, words):
    with pytest.raises(error) as info:
        call_varlen(fn, **over)
    msg = str(info.value)
    assert msg.startswith(fn.__name__ + ":"), msg
    for w in words:
        assert w in msg, (w, msg)


def _bsa_call(**over):
    a = dict(q=_bhsd(H, D), k=_bhsd(Hk, D), v=_bhsd(Hk, D),
             block_indices=torch.zeros(B, Hk, S, 2, dtype=torch.int32), block_size=BS)
    a.update(over)
    return api.block_sparse_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("block_indices"), **a)


BSA_CASES = [
    ("q_not_tensor", dict(q=1), TypeError, ["q", "int"]),
    ("k_dtype", dict(k=_bhsd(Hk, D, torch.float16)), TypeError, ["k", "float16"]),
    ("v_seqlen", dict(v=torch.randn(B, Hk, S + 2, D)), ValueError, ["v", "seqlen 11"]),
    ("gqa", dict(k=torch.randn(B, 3, S, D), v=torch.randn(B, 3, S, D)), ValueError, ["4 heads", "3 heads"]),
    ("kv_heads", dict(v=torch.randn(B, 1, S, D)), ValueError, ["v", "1 heads"]),
    ("indices_int64", dict(block_indices=torch.zeros(B, Hk, S, 2, dtype=torch.int64)), TypeError,
     ["block_indices", "int32", "int64"]),
    ("indices_float", dict(block_indices=torch.zeros(B, Hk, S, 2)), TypeError, ["block_indices", "float32"]),
    ("indices_3d", dict(block_indices=torch.zeros(B, S, 2, dtype=torch.int32)), ValueError, ["block_indices", "(2, 9, 2)"]),
    ("indices_seqlen", dict(block_indices=torch.zeros(B, Hk, S - 1, 2, dtype=torch.int32)), ValueError,
     ["block_indices", "seqlen=9"]),
    ("indices_heads", dict(block_indices=torch.zeros(B, 3, S, 2, dtype=torch.int32)), ValueError,
     ["block_indices", "3 index heads"]),
    ("indices_empty_k", dict(block_indices=torch.zeros(B, Hk, S, 0, dtype=torch.int32)), ValueError, ["K=0"]),
    ("indices_device", dict(block_indices=torch.zeros(B, Hk, S, 2, dtype=torch.int32, device="meta")), ValueError,
     ["block_indices", "meta"]),
    ("indices_not_tensor", dict(block_indices=[[0]]), TypeError, ["block_indices", "list"]),
    ("block_size", dict(block_size=-4), ValueError, ["block_size", "-4"]),
    ("scale", dict(scale=float("nan")), ValueError, ["scale"]),
    ("layout", dict(layout="BHSD"), ValueError, ["layout='BHSD'"]),
    ("head_dim_stride", dict(v=strided_head_dim(_bhsd(Hk, D))), ValueError, ["v", "unit-stride"]),
]


@pytest.mark.parametrize("over, error, words", [c[1:] for c in BSA_CASES], ids=[c[0] for c in BSA_CASES])
def test_block_sparse_attention_rejects(over, error, words):
    with pytest.raises(error) as info:
        _bsa_call(**over)
    msg = str(info.value)
    assert msg.startswith("block_sparse_attention:"), msg
    for w in words:
        assert w in msg, (w, msg)


def test_block_sparse_attention_rejects_out_of_range_indices():
    """Indices outside [-1, ceil(S / block_size)) are an error, not a crash (the backend checks the values)."""
    idx = torch.zeros(B, Hk, S, 2, dtype=torch.int32)
    idx[1, 0, 4, 1] = 3  # S = 9, block_size 4: blocks 0..2
    with pytest.raises(ValueError, match="block_indices"):
        _bsa_call(block_indices=idx)


SELECT_CASES = [
    ("q_proxy_dtype", dict(q_proxy=torch.ones(B, Hp, S, Dp, dtype=torch.int64)), TypeError, ["q_proxy", "int64"]),
    ("k_proxy_heads", dict(k_proxy=torch.randn(B, 3, S, Dp)), ValueError, ["k_proxy"]),
    ("k_proxy_seqlen", dict(k_proxy=torch.randn(B, Hpk, S + 1, Dp)), ValueError, ["k_proxy", "seqlen 10"]),
    ("top_k", dict(top_k=6), ValueError, ["top_k=6"]),
    ("layout", dict(layout="thd"), ValueError, ["layout='thd'"]),
]


@pytest.mark.parametrize("over, error, words", [c[1:] for c in SELECT_CASES], ids=[c[0] for c in SELECT_CASES])
def test_select_blocks_rejects(over, error, words):
    a = dict(q_proxy=_bhsd(Hp, Dp), k_proxy=_bhsd(Hpk, Dp), top_k=BS, block_size=BS)
    a.update(over)
    with pytest.raises(error) as info:
        api.select_blocks(a.pop("q_proxy"), a.pop("k_proxy"), a.pop("top_k"), **a)
    msg = str(info.value)
    assert msg.startswith("select_blocks:"), msg
    for w in words:
        assert w in msg, (w, msg)


def test_out_of_range_block_index_names_the_public_function_and_argument():
    """Issue 39: the range error named the internal op block_sparse_forward."""
    idx = torch.full((B, Hk, S, 2), -1, dtype=torch.int32)
    idx[1, 0, 7, 1] = 3  # S = 9, block_size 4: blocks 0..2
    with pytest.raises(ValueError) as info:
        api.block_sparse_attention(_bhsd(H, D), _bhsd(Hk, D), _bhsd(Hk, D), idx, BS)
    msg = str(info.value)
    assert msg.startswith("block_sparse_attention: block_indices[1, 0, 7, 1] = 3 is outside [-1, 3)"), msg
    assert "block_sparse_forward" not in msg


@pytest.mark.parametrize("fn", ["flash_msa_func", "block_sparse_attention", "select_blocks"])
def test_bhsd_tensors_passed_as_bshd_get_a_layout_hint(fn):
    """Issue 39: (B, heads, S, D) tensors with layout="bshd" read heads as seqlen; the error says so."""
    qp, kp, q, k, v = _bhsd(Hp, Dp), _bhsd(Hpk, Dp), _bhsd(H, D), _bhsd(Hk, D), _bhsd(Hk, D)
    with pytest.raises(ValueError) as info:
        if fn == "flash_msa_func":
            api.flash_msa_func(qp, kp, q, k, v, BS, layout="bshd", block_size=BS)
        elif fn == "block_sparse_attention":
            api.block_sparse_attention(q, k, v, torch.zeros(B, Hk, H, 1, dtype=torch.int32), BS, layout="bshd")
        else:
            api.select_blocks(qp, kp, BS, layout="bshd", block_size=BS)
    msg = str(info.value)
    assert msg.startswith(f"{fn}: ") and "seqlen" in msg, msg
    assert "layout='bshd'" in msg and "pass layout='bhsd'" in msg, msg


# --- issue 58: sinks, proxy_scale, local_blocks --------------------------------------------------------------------

_NEW_ENTRY_POINTS = [api.flash_msa_func, api.flash_msa_warmup_func]


@pytest.mark.parametrize("fn", _NEW_ENTRY_POINTS)
@pytest.mark.parametrize("sinks, error, words", [
    (torch.zeros(H + 1), ValueError, "shape (5,)"),
    (torch.zeros(1, H), ValueError, "shape (1, 4)"),
    (torch.zeros(H, dtype=torch.float64), ValueError, "torch.float64"),
    (torch.zeros(H, dtype=torch.bfloat16), ValueError, "torch.bfloat16"),
    ([0.0] * H, TypeError, "list"),
])
def test_bad_sinks_are_named(fn, sinks, error, words):
    with pytest.raises(error, match="sinks") as e:
        call_msa(fn, sinks=sinks)
    assert words in str(e.value)


def test_sinks_on_another_device_are_named():
    with pytest.raises(ValueError, match="sinks is on meta but the inputs are on cpu"):
        call_msa(sinks=torch.zeros(H, device="meta"))


@pytest.mark.parametrize("fn", _NEW_ENTRY_POINTS)
@pytest.mark.parametrize("value, error", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError), ("1", TypeError), (True, TypeError)])
def test_bad_proxy_scale_is_named(fn, value, error):
    with pytest.raises(error, match="proxy_scale") as e:
        call_msa(fn, proxy_scale=value)
    assert type(value).__name__ in str(e.value) or repr(value) in str(e.value)


@pytest.mark.parametrize("fn", _NEW_ENTRY_POINTS)
@pytest.mark.parametrize("value, error", [(0, ValueError), (3, ValueError), (-1, ValueError), (1.0, TypeError),
                                          (None, TypeError)])
def test_bad_local_blocks_is_named(fn, value, error):
    with pytest.raises(error, match="local_blocks") as e:
        call_msa(fn, local_blocks=value)  # K = top_k // block_size = 2
    if error is ValueError:
        assert f"local_blocks = {value}" in str(e.value) and "1 <= local_blocks <= K" in str(e.value)


def test_select_blocks_and_block_sparse_check_the_new_arguments():
    a = msa_args()
    with pytest.raises(ValueError, match="select_blocks: local_blocks = 3"):
        api.select_blocks(a["q_proxy"], a["k_proxy"], 2 * BS, block_size=BS, local_blocks=3)
    with pytest.raises(ValueError, match="select_blocks: proxy_scale"):
        api.select_blocks(a["q_proxy"], a["k_proxy"], 2 * BS, block_size=BS, proxy_scale=-2.0)
    idx = torch.zeros(B, 1, S, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_sparse_attention: sinks has shape"):
        api.block_sparse_attention(a["q"], a["k"], a["v"], idx, BS, sinks=torch.zeros(2 * H))


def test_varlen_checks_the_new_arguments():
    with pytest.raises(ValueError, match="flash_msa_varlen_func: local_blocks = 2"):
        call_varlen(local_blocks=2)  # K = 1
    with pytest.raises(ValueError, match="flash_msa_warmup_varlen_func: sinks has shape"):
        call_varlen(api.flash_msa_warmup_varlen_func, sinks=torch.zeros(H + 1))
