"""The CUDA attention branches without a GPU: flash_attn_varlen_func and torch's varlen_attn are replaced by a
recording stand-in that checks every argument the real kernel needs (dtypes, int32 cu_seqlens on q's device,
max_seqlen as the host int it must be, causal window, GQA flag, shapes and strides) and returns the exact SDPA
result, so a wrong call in model.varlen_attention fails here, and the whole model runs through the branch.
"""

import inspect
from dataclasses import replace

import pytest
import torch

import model as M
from conftest import next_token_targets

LENS = [5, 17, 1, 33, 9]


def check_call(q, k, v, cu_q, cu_k, max_q, max_k, config, shared):
    assert q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape
    assert q.shape[1:] == (config.n_head, config.head_dim) and k.shape[1:] == (config.n_kv_head, config.head_dim)
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)  # the kernels' dtypes
    assert all(t.stride(-1) == 1 for t in (q, k, v))  # the kernels need a contiguous head dimension
    for cu, T in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
        assert cu.dtype == torch.int32 and cu.device == q.device and cu.is_contiguous()
        assert cu[0] == 0 and cu[-1] == T and bool((cu[1:] >= cu[:-1]).all())
    lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    # prefix sharing: as many key segments as query segments, each query segment the tail of its key segment
    # (bottom-right causal); some longer (a rejected rest sees the prompt too). Otherwise the same boundaries.
    assert len(lens_q) == len(lens_k) and all(lk >= lq for lq, lk in zip(lens_q, lens_k))
    assert (lens_k != lens_q) == shared
    assert type(max_q) is int and type(max_k) is int and max_q == max(lens_q) and max_k == max(lens_k)


# torch's varlen_attn keywords by release: 2.10/2.11 is_causal (K/V heads = query heads), then window_size, then
# enable_gqa (GQA in the kernel)
VARLEN_RELEASES = {"torch_varlen": {"window_size", "enable_gqa"}, "torch_varlen_window": {"window_size"},
                   "torch_varlen_is_causal": {"is_causal"}}
KINDS = ["flash_attn", *VARLEN_RELEASES]


def stand_in(kind, config, calls, shared=False):
    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *args, **kw):
        gqa_in_kernel = kind in ("flash_attn", "torch_varlen")
        check_call(q, k, v, cu_q, cu_k, max_q, max_k, config if gqa_in_kernel else
                   replace(config, n_kv_head=config.n_head), shared)
        left = -1 if config.sliding_window is None else config.sliding_window - 1
        if kind == "flash_attn":  # flash_attn_varlen_func(..., dropout_p, softmax_scale, causal, window_size, ...)
            assert not args and kw == dict(causal=True, window_size=(left, 0)), kw
        elif kind == "torch_varlen":  # keywords only after the positions, causal = (-1, 0)
            assert not args and kw == dict(window_size=(left, 0), enable_gqa=config.n_head != config.n_kv_head), kw
        elif kind == "torch_varlen_window":
            assert not args and kw == dict(window_size=(left, 0)), kw
        else:  # no window in this release: a sliding-window model never reaches it
            assert not args and kw == dict(is_causal=True) and config.sliding_window is None, kw
        calls.append(kind)
        return M.grouped_sdpa(q, k, v, cu_q, config.sliding_window, cu_k)
    return fake


def use_stand_in(monkeypatch, kind, fn):
    monkeypatch.setattr(M, "flash_attn_varlen_func" if kind == "flash_attn" else "varlen_attn", fn)
    monkeypatch.setattr(M, "VARLEN_KEYWORDS", VARLEN_RELEASES.get(kind, set()))
    monkeypatch.setitem(M._ATTN_BACKEND, "cpu", "flash_attn" if kind == "flash_attn" else "torch_varlen")


def expected_calls(kind, config):  # a release without window_size runs a sliding-window model on SDPA
    return [] if kind == "torch_varlen_is_causal" and config.sliding_window else [kind] * config.n_layer


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
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
    use_stand_in(monkeypatch, kind, stand_in(kind, model.config, calls))
    loss, n = model(ids, pos, cu, max(LENS), targets=targets)
    loss.backward()
    assert calls == expected_calls(kind, model.config)  # every layer went through the branch
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setitem(M._ATTN_BACKEND, "cpu", "sdpa")
    monkeypatch.setattr(M, "attention_backend", lambda device, dtype: "sdpa")  # bf16 through the same SDPA math
    loss_ref, _ = model(ids, pos, cu, max(LENS), targets=targets)
    loss_ref.backward()
    assert torch.equal(loss, loss_ref)  # the stand-in returned SDPA's result: the rest of the model is the same
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)


def test_torch_varlen_signature_is_one_we_call():
    """The installed torch's varlen_attn takes the keywords of one of the releases the stand-ins above check."""
    if M.varlen_attn is None:
        pytest.skip("torch.nn.attention.varlen is not in this torch")
    params = set(inspect.signature(M.varlen_attn).parameters)
    assert any(keys <= params and (keys == {"is_causal"}) != ("window_size" in params)
               for keys in VARLEN_RELEASES.values()), params


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=6)], ids=["gqa", "window"])
def test_cuda_branch_prefix_shared(monkeypatch, kind, kw):
    """DPO pairs with shared prompts: the kernel gets the separate key stream (cu_seqlens_k, max_seqlen_k)."""
    from packing import make_batch, shared_prefixes
    from test_prefix_sharing import CASES, VOCAB, pairs_data
    torch.manual_seed(0)
    model = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB, **kw)).to(torch.bfloat16)
    spec = CASES["mixed with unshared pairs"] + CASES["prompt longer than responses"]
    data = pairs_data(spec)
    mb = make_batch(data, range(len(spec)), group_size=2, prefix=shared_prefixes(data))
    calls = []
    use_stand_in(monkeypatch, kind, stand_in(kind, model.config, calls, shared=True))
    pc, pr = mb.pair_sums(model(**mb.inputs(), logprobs=True))
    (pc - pr).sum().backward()
    assert calls == expected_calls(kind, model.config)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(M, "attention_backend", lambda device, dtype: "sdpa")  # bf16 through the same SDPA math
    pc_ref, pr_ref = mb.pair_sums(model(**mb.inputs(), logprobs=True))
    (pc_ref - pr_ref).sum().backward()
    assert torch.equal(pc, pc_ref) and torch.equal(pr, pr_ref)
    # the CPU path reads k[kv_index] in its own gather, a kernel's K/V were gathered before it: a prompt row's
    # gradient sums its replies' in another order, so up to bf16 rounding (a wrong key stream moves it by ~100%)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=2e-2 * g.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_kernels_align_causal_at_the_bottom_right(monkeypatch):
    """On a GPU: the real varlen kernels with cu_seqlens_k != cu_seqlens_q (a query segment that is the tail of a
    longer key segment) equal the SDPA fallback's explicit bottom-right mask, window and GQA included."""
    torch.manual_seed(0)
    lens_q, lens_k = [5, 17, 1, 30], [5, 40, 9, 30]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens_q), 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for window in (None, 7):
        ref = M.grouped_sdpa(q.float(), k.float(), v.float(), cu_q, window, cu_k)
        for name in [n for n in ("flash_attn", "torch_varlen") if (M.flash_attn_varlen_func if n == "flash_attn"
                                                                   else M.varlen_attn) is not None]:
            monkeypatch.setitem(M._ATTN_BACKEND, "cuda", name)
            out = M.varlen_attention(q, k, v, cu_q, max(lens_q), window, cu_k, max(lens_k))
            # bf16 inputs, float32 reference: one bf16 rounding of an average of values ~1: 2e-2
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0, msg=lambda m: f"{name} {window}: {m}")
