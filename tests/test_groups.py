"""Groups of k replies to one prompt (RL; a DPO pair is k = 2): packing.group_data lays them out, make_batch with
prefix=shared_prefixes(data, k) computes the prompt once (`prompt | reply 1 | ... | reply k`, every reply attending to
the prompt through model.py's key stream), and per-reply log-prob sums and every parameter gradient of a loss over
them equal the whole layout (each reply with its own copy of the prompt) and each sequence run alone (full logits).
"""
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanopack import kernels
import model as M
from nanopack.reference import split_logps
from packing import group_data, make_batch, pack, shared_prefixes

VOCAB = 300
# group shapes: (prompt length range, reply length range); each case packs 3 groups into one micro-batch
SHAPES = {
    "prompt longer than replies": ((25, 40), (1, 6)),
    "replies longer than prompt": ((1, 5), (10, 25)),
    "1-token replies": ((3, 12), (1, 1)),
    "mixed with lone sequences": None,  # group 1 has no prompt: its replies share nothing, each laid out alone
    "replies that begin alike": None,  # replies 0 and 1 identical, all k start with the same 3 tokens
}
MODELS = {"gqa": dict(), "window": dict(sliding_window=6)}  # window 6: shorter than most prompts


def make_groups(shape, k, seed=0):
    """-> prompts (3 lists), replies (3 lists of k lists), and what each sequence must share with the one before it
    in its group (counted here token by token: at most all of the one before, and all of itself but a token)."""
    rng = np.random.default_rng(seed)
    (p_lo, p_hi), (r_lo, r_hi) = SHAPES[shape] or ((4, 15), (3, 9))
    prompts, replies, expected = [], [], []
    for g in range(3):
        P = 0 if shape == "mixed with lone sequences" and g == 1 else int(rng.integers(p_lo, p_hi + 1))
        group = [rng.integers(0, VOCAB, int(rng.integers(r_lo, r_hi + 1))).tolist() for _ in range(k)]
        for j, reply in enumerate(group):  # distinct first tokens: the group shares exactly its prompt
            reply[0] = (g * 17 + j) % VOCAB
        if shape == "replies that begin alike" and k > 1:
            group = [[5, 6, 7] + r for r in group]
            group[1] = list(group[0])  # two identical replies: the second shares all of the first but a token
        prompts.append(rng.integers(0, VOCAB, P).tolist())
        replies.append(group)
        seqs = [prompts[-1] + r for r in group]
        for j, seq in enumerate(seqs):
            n = 0
            while j and n < min(len(seq) - 1, len(seqs[j - 1])) and seq[n] == seqs[j - 1][n]:
                n += 1
            expected.append(n)
    return prompts, replies, expected


def alone_logps(net, data):
    """Each sequence alone through the model, full logits, log_softmax, gather, mask, sum: (N,)."""
    out = []
    for s, t in zip(data["offsets"][:-1], data["offsets"][1:]):
        ids = torch.from_numpy(data["ids"][s:t].astype(np.int64))
        mask = torch.from_numpy(data["loss_mask"][s:t].astype(bool))
        logp = F.log_softmax(net(ids).float(), dim=-1)[:-1].gather(1, ids[1:, None]).squeeze(1)
        out.append((logp * mask[1:]).sum())
    return torch.stack(out)


def loss_and_grads(net, logps, advantages):
    """A REINFORCE-style loss, each reply weighted by its own advantage: a swapped reply would show."""
    net.zero_grad()
    (-(advantages * logps).sum()).backward()
    return {k: p.grad.clone() for k, p in net.named_parameters()}


def assert_close_runs(a, b):
    # float32: the shared layout computes the same terms, but a later reply's attention runs as an (R x P+R) block and
    # the prompt's gradient arrives as k summed contributions, so only rounding differs: measured <= 1.5e-5 on sums of
    # up to ~-145 and <= 1.1e-6 of a gradient's largest entry, so ~10x that; a wrong key, position or row moves a
    # log-prob by ~1e-2 at least with random weights.
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-5)
    for k in ga:
        scale = ga[k].abs().max() + 1e-12
        torch.testing.assert_close(ga[k] / scale, gb[k] / scale, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("model_kw", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_group_layout_equals_whole_and_alone(monkeypatch, k, shape, model_kw):
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 5)  # the LM head's chunk loop runs over several chunks
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB, **model_kw))
    prompts, replies, expected = make_groups(shape, k)
    data = group_data(prompts, replies)
    prefix = shared_prefixes(data, k)
    assert prefix.tolist() == expected
    groups = [2, 0, 1]  # not the data order
    advantages = torch.randn(3, k)
    runs = {}
    for name, p in (("shared", prefix), ("whole", None)):
        mb = make_batch(data, groups, group_size=k, prefix=p)
        sums = mb.group_sums(net(**mb.inputs(), logprobs=True), k)  # (3, k), row i = group groups[i]
        runs[name] = (sums.detach(), loss_and_grads(net, sums, advantages))
        if name == "shared":  # the shared tokens really are computed once
            assert mb.num_tokens == int(np.diff(data["offsets"]).sum() - prefix.sum())
            assert (mb.kv is not None) == bool(prefix.any())
    alone = alone_logps(net, data).view(3, k)[groups]
    runs["alone"] = (alone.detach(), loss_and_grads(net, alone, advantages))
    assert_close_runs(runs["shared"], runs["alone"])
    assert_close_runs(runs["whole"], runs["alone"])


def test_group_data_layout_and_masks():
    """Group g's reply j is sequence g*k + j, `prompt + reply`, trained on its reply tokens (or as masks say)."""
    prompts, replies = [[1, 2, 3], [4]], [[[7, 8], [9]], [[10, 11, 12], [13, 14]]]
    data = group_data(prompts, replies, masks=[[[1, 1], [1]], [[1, 0, 1], [0, 1]]])
    assert data["offsets"].tolist() == [0, 5, 9, 13, 16]
    assert data["ids"].tolist() == [1, 2, 3, 7, 8, 1, 2, 3, 9, 4, 10, 11, 12, 4, 13, 14]
    assert data["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1, 0, 0, 1]
    assert shared_prefixes(data, 2).tolist() == [0, 3, 0, 1]
    assert group_data([], [])["offsets"].tolist() == [0]


@pytest.mark.parametrize("k", [1, 3])
def test_split_logps_packs_whole_groups(k):
    """dpo.split_logps with group_size=k: groups packed by token budget (several micro-batches), (U, k) sums equal to
    each sequence alone."""
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB))
    prompts, replies, _ = make_groups("prompt longer than replies", k, seed=1)
    data = group_data(prompts * 2, replies * 2)  # 6 groups
    prefix = shared_prefixes(data, k)
    lengths = (np.diff(data["offsets"]) - prefix).reshape(-1, k).sum(1)  # each prompt once
    budget = int(lengths.max())  # tight: a group counted with its prompt more than once would not fit
    assert len(pack(lengths, budget)) > 1
    got = split_logps(net, data, budget, torch.device("cpu"), nullcontext(), prefix, group_size=k)
    with torch.no_grad():
        torch.testing.assert_close(got, alone_logps(net, data).view(-1, k), atol=1e-4, rtol=1e-5)
