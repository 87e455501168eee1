"""DPO prefix sharing: a pair laid out as `prompt | chosen rest | rejected rest` (packing.make_batch with prefix=),
the rejected rest attending to the prompt through the separate key stream (model.py's kv), gives the same
per-sequence log-prob sums, DPO losses and gradients as the two sequences laid out whole, and as each sequence run
through the model alone with full logits (an independent computation).

Tolerances: float32 throughout. The shared path computes the same terms as the whole one, but a rejected response's
attention runs as an (R x P+R) block instead of inside a (P+R x P+R) one and the prompt's gradient arrives as two
summed contributions, so results differ by float32 rounding only: ~1e-6 relative on log-prob sums of ~-100 (so 1e-4
absolute), gradients ~1e-6 of their largest entry (so 1e-5 relative to it). A wrong mask, position or row moves
these by orders of magnitude more (a wrong key changes a log-prob by ~1e-2 at least with random weights).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanopack import kernels
import model as M
from losses import dpo_loss
from packing import make_batch, shared_prefixes

VOCAB = 300
# (prompt, chosen response, rejected response) lengths, packed in one micro-batch each
CASES = {
    "prompt longer than responses": [(40, 3, 5), (33, 7, 2)],
    "responses longer than prompt": [(2, 30, 41), (5, 25, 9)],
    "single-token responses": [(12, 1, 1), (1, 1, 1), (7, 1, 4)],
    "a pair alone": [(20, 10, 12)],
    "mixed with unshared pairs": [(0, 9, 14), (15, 6, 6), (0, 3, 20)],  # prompt 0: nothing in common
}
MODELS = {
    "gqa": dict(),  # the tiny preset: 4 query heads over 2 key/value heads
    "window": dict(sliding_window=6),  # shorter than most prompts: a rejected query's window ends inside the prompt
    "mha+bias": dict(n_kv_head=4, qkv_bias=True),
}


def pairs_data(spec, seed=0):
    """Pairs with exactly the given shared prefixes: the responses' first tokens differ. Loss on responses only."""
    rng = np.random.default_rng(seed)
    seqs, masks = [], []
    for P, C, R in spec:
        prompt = rng.integers(0, VOCAB, P)
        chosen, rejected = rng.integers(0, VOCAB, C), rng.integers(0, VOCAB, R)
        rejected[0] = (chosen[0] + 1) % VOCAB
        for resp in (chosen, rejected):
            seqs.append(np.r_[prompt, resp])
            masks.append(np.r_[np.zeros(P), np.ones(len(resp))])
    data = dict(ids=np.concatenate(seqs).astype(np.uint16), loss_mask=np.concatenate(masks).astype(np.uint8),
                offsets=np.r_[0, np.cumsum([len(s) for s in seqs])].astype(np.int64))
    # a sequence's first token is never predicted: a prompt-less pair shares nothing, the rest share the prompt
    assert shared_prefixes(data).tolist() == [x for P, _, _ in spec for x in (0, P)]
    return data


def alone_logps(net, data, examples):
    """Each sequence alone through the model, full logits, log_softmax, gather, mask, sum: (2P,)."""
    out = []
    for e in examples:
        s, t = data["offsets"][e], data["offsets"][e + 1]
        ids = torch.from_numpy(data["ids"][s:t].astype(np.int64))
        mask = torch.from_numpy(data["loss_mask"][s:t].astype(bool))
        logp = F.log_softmax(net(ids).float(), dim=-1)[:-1].gather(1, ids[1:, None]).squeeze(1)
        out.append((logp * mask[1:]).sum())
    return torch.stack(out)


def loss_and_grads(net, pc, pr):
    ref = torch.linspace(-60.0, -20.0, len(pc))  # any fixed reference log-probs
    lengths = torch.ones(len(pc))
    losses, _, _ = dpo_loss(pc, pr, ref, ref.flip(0), lengths, lengths, "sigmoid", 0.1)
    net.zero_grad()
    losses.mean().backward()
    return losses.mean().detach(), {k: p.grad.clone() for k, p in net.named_parameters()}


def assert_close_runs(a, b):
    (pa, la, ga), (pb, lb, gb) = a, b
    torch.testing.assert_close(pa, pb, atol=1e-4, rtol=0)
    torch.testing.assert_close(la, lb, atol=1e-6, rtol=0)
    for k in ga:
        scale = ga[k].abs().max() + 1e-12
        torch.testing.assert_close(ga[k] / scale, gb[k] / scale, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("model_kw", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("case", list(CASES))
def test_shared_equals_whole_and_alone(monkeypatch, case, model_kw):
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 5)  # the LM head's chunk loop runs over several chunks
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB, **model_kw))
    data = pairs_data(CASES[case])
    pairs = list(range(len(CASES[case])))[::-1]  # not the data order
    runs = {}
    for name, prefix in (("shared", shared_prefixes(data)), ("whole", None)):
        mb = make_batch(data, pairs, group_size=2, prefix=prefix)
        pc, pr = mb.pair_sums(net(**mb.inputs(), logprobs=True))
        runs[name] = (torch.stack([pc, pr]).detach(), *loss_and_grads(net, pc, pr))
        if name == "shared":  # the prompt really is computed once
            assert mb.num_tokens == sum(P + C + R for P, C, R in CASES[case]) and mb.kv is not None
    alone = alone_logps(net, data, [e for p in pairs for e in (2 * p, 2 * p + 1)])
    runs["alone"] = (torch.stack([alone[0::2], alone[1::2]]).detach(), *loss_and_grads(net, alone[0::2], alone[1::2]))
    assert_close_runs(runs["shared"], runs["alone"])
    assert_close_runs(runs["whole"], runs["alone"])


def test_window_reaches_into_the_prompt():
    """Bottom-right causal with a sliding window, checked against a mask written from positions: a rejected
    query at position p sees keys of its own sequence at positions p-W+1..p, the prompt's included."""
    torch.manual_seed(0)
    P, R, W, H, D = 9, 4, 5, 2, 8
    q = torch.randn(R, H, D, dtype=torch.float64)
    k, v = torch.randn(P + R, H, D, dtype=torch.float64), torch.randn(P + R, H, D, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, R], dtype=torch.int32), torch.tensor([0, P + R], dtype=torch.int32)
    out = M.grouped_sdpa(q, k, v, cu_q, W, cu_k)
    q_pos, k_pos = torch.arange(P, P + R)[:, None], torch.arange(P + R)[None, :]
    sees = (k_pos <= q_pos) & (k_pos > q_pos - W)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~sees, -torch.inf).softmax(-1), v)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)  # float64: the same sums up to rounding


@pytest.mark.parametrize("R,P", [(1, 4), (3, 9), (64, 200), (200, 1), (0, 4)])  # 0: the kernel divides by it
def test_bottom_right_attention_on_cpu(R, P):
    """Queries that are the last R of P + R keys (a reply after its prompt, a branch after its trunk, a CP slice), no
    window: model.BottomRight's two flash calls merged by log-sum-exp, forward and every gradient, against softmax over
    a mask written from positions, float64 (the same sums up to rounding)."""
    torch.manual_seed(R)
    H, D = 2, 8
    q = torch.randn(R, H, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(P + R, H, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, R], dtype=torch.int32), torch.tensor([0, P + R], dtype=torch.int32)
    sees = torch.arange(P + R)[None, :] <= torch.arange(P, P + R)[:, None]
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~sees, -torch.inf).softmax(-1), v)
    out = M.grouped_sdpa(q, k, v, cu_q, None, cu_k)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_flops_count_the_shared_layout():
    """FLOPs per micro-batch: the trunk's matmuls over the tokens computed (P + C + R), attention over the pairs
    of (query, key) actually scored, which for a rejected rest of R queries over P + R keys is R (2P + R) / 2."""
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB))
    data = pairs_data([(40, 3, 5)])
    shared = make_batch(data, [0], group_size=2, prefix=shared_prefixes(data))
    whole = make_batch(data, [0], group_size=2)
    cfg = net.config
    per_layer_pair = 6 * cfg.n_head * cfg.head_dim  # fwd + bwd FLOPs per (query, key) pair scored, causal halved

    def total(mb):
        lens = np.diff(mb.cu_seqlens.numpy())
        return net.flops_per_token(lens, mb.num_target_tokens, mb.key_lengths()) * mb.num_tokens

    saved_tokens = 40  # the prompt, once
    saved_pairs = (45 ** 2) - 5 * (2 * 45 - 5)  # whole rejected: 45^2 / 2 pairs; shared: 5 * (2*45 - 5) / 2
    trunk = 6 * (net.num_params() - net.embed_tokens.weight.numel() - net.lm_head.weight.numel())  # untied head
    expected = trunk * saved_tokens + cfg.n_layer * per_layer_pair * saved_pairs
    assert total(whole) - total(shared) == pytest.approx(expected, rel=1e-12)
