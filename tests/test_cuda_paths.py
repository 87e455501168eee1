"""The CUDA attention branches without a GPU: flash_attn_varlen_func and torch's varlen_attn are replaced by a
recording stand-in that checks every argument the real kernel needs (dtypes, int32 cu_seqlens on q's device,
max_seqlen as the host int it must be, causal window, GQA flag, shapes and strides) and returns the exact SDPA
result, so a wrong call in model.varlen_attention fails here, and the whole model runs through the branch.
"""

import inspect

import pytest
import torch

import model as M
from conftest import next_token_targets

LENS = [5, 17, 1, 33, 9]


def check_call(q, k, v, cu_q, cu_k, max_q, max_k, config):
    T = q.shape[0]
    assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape and k.shape[0] == T
    assert q.shape[1:] == (config.n_head, config.head_dim) and k.shape[1:] == (config.n_kv_head, config.head_dim)
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)  # the kernels' dtypes
    assert all(t.stride(-1) == 1 for t in (q, k, v))  # the kernels need a contiguous head dimension
    for cu in (cu_q, cu_k):
        assert cu.dtype == torch.int32 and cu.device == q.device and cu.is_contiguous()
        assert cu[0] == 0 and cu[-1] == T and bool((cu[1:] >= cu[:-1]).all())
    assert cu_q is cu_k or torch.equal(cu_q, cu_k)
    lens = (cu_q[1:] - cu_q[:-1]).tolist()
    assert type(max_q) is int and type(max_k) is int and max_q == max_k == max(lens)


def stand_in(kind, config, calls):
    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *args, **kw):
        check_call(q, k, v, cu_q, cu_k, max_q, max_k, config)
        left = -1 if config.sliding_window is None else config.sliding_window - 1
        if kind == "flash_attn":  # flash_attn_varlen_func(..., dropout_p, softmax_scale, causal, window_size, ...)
            assert not args and kw == dict(causal=True, window_size=(left, 0)), kw
        else:  # torch.nn.attention.varlen.varlen_attn: keywords only after the positions, causal = (-1, 0)
            assert not args and kw == dict(window_size=(left, 0), enable_gqa=config.n_head != config.n_kv_head), kw
        calls.append(kind)
        return M.sdpa_per_sequence(q, k, v, cu_q, config.sliding_window)
    return fake


@pytest.mark.parametrize("kind", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=7), dict(n_kv_head=4, qkv_bias=True)],
                         ids=["gqa", "window", "mha+bias"])
def test_cuda_branch_is_called_right(monkeypatch, kind, kw):
    torch.manual_seed(0)
    model = M.Transformer(M.config_from_preset("tiny", vocab_size=100, **kw)).to(torch.bfloat16)
    ids = torch.randint(0, 100, (sum(LENS),))
    pos = torch.cat([torch.arange(n) for n in LENS])
    cu = torch.tensor([0] + LENS).cumsum(0).to(torch.int32)
    targets = next_token_targets(ids, cu)
    calls = []
    fn = stand_in(kind, model.config, calls)
    monkeypatch.setattr(M, "flash_attn_varlen_func" if kind == "flash_attn" else "varlen_attn", fn)
    monkeypatch.setitem(M._ATTN_BACKEND, "cpu", kind)
    loss, n = model(ids, pos, cu, max(LENS), targets=targets)
    loss.backward()
    assert calls == [kind] * model.config.n_layer  # every layer went through the branch
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setitem(M._ATTN_BACKEND, "cpu", "sdpa")
    monkeypatch.setattr(M, "attention_backend", lambda device, dtype: "sdpa")  # bf16 through the same SDPA math
    loss_ref, _ = model(ids, pos, cu, max(LENS), targets=targets)
    loss_ref.backward()
    assert torch.equal(loss, loss_ref)  # the stand-in returned SDPA's result: the rest of the model is the same
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)


def test_torch_varlen_signature_is_the_one_we_call():
    """varlen_attn changed its signature across releases (2.9: is_causal; 2.12: window_size, enable_gqa)."""
    if M.varlen_attn is None:
        pytest.skip("torch.nn.attention.varlen is not in this torch")
    params = inspect.signature(M.varlen_attn).parameters
    assert {"window_size", "enable_gqa"} <= set(params), list(params)
