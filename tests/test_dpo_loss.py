"""losses.py without running train_dpo.py: each loss type against numbers worked out by hand, reward accuracy per
pair, response lengths, and packed == padded for the per-sequence log-probs, the loss and the gradients."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from losses import dpo_loss, pair_stats
from model import Transformer, config_from_preset
from packing import make_batch, shared_prefixes, target_counts

# Two pairs of fixed sequence log-prob sums, and response lengths in tokens.
PC, PR = [-10.0, -20.0], [-12.0, -18.0]  # policy chosen, rejected
RC, RR = [-11.0, -19.0], [-11.5, -19.5]  # reference chosen, rejected
LC, LR = [4.0, 5.0], [2.0, 8.0]
BETA = 0.5
# On sums:  h = (pc - rc) - (pr - rr) = (1 + 0.5, -1 - 1.5) = (1.5, -2.5)
# Averaged: h = (-10/4 + 11/4) - (-12/2 + 11.5/2) = 0.25 + 0.25 = 0.5;  (-20/5 + 19/5) - (-18/8 + 19.5/8) = -0.3875
# simpo (no reference, averaged): h = -10/4 + 12/2 = 3.5;  -20/5 + 18/8 = -1.75
# -logsigmoid(z) = log(1 + e^-z); the values below were computed with Python's math module.
CASES = [
    # loss_type, label_smoothing, gamma, expected losses, expected rewards (chosen, rejected)
    ("sigmoid", 0.0, 0.0, [0.38687100611489994, 1.501929081345373], ([0.5, -0.5], [-0.25, 0.75])),
    # 0.8 * log(1 + e^-0.75) + 0.2 * log(1 + e^0.75), and the same at z = -1.25
    ("sigmoid", 0.2, 0.0, [0.5368710061149, 1.2519290813453732], ([0.5, -0.5], [-0.25, 0.75])),
    # (h - 1/(2 beta))^2 on averaged log-probs: (0.5 - 1)^2, (-0.3875 - 1)^2
    ("ipo", 0.0, 0.0, [0.25, 1.92515625], ([0.125, -0.1], [-0.125, 0.09375])),
    # relu(1 - beta h): 1 - 0.75, 1 + 1.25
    ("hinge", 0.0, 0.0, [0.25, 2.25], ([0.5, -0.5], [-0.25, 0.75])),
    # log(1 + e^-0.25), log(1 + e^0.19375)
    ("dpo_norm", 0.0, 0.0, [0.5759394198788436, 0.7947072422026157], ([0.125, -0.1], [-0.125, 0.09375])),
    # z = beta h - gamma = 1.75 - 0.3, -0.875 - 0.3; rewards beta * policy average: 0.5 * (-2.5, -4), 0.5 * (-6, -2.25)
    ("simpo", 0.0, 0.3, [0.21072296466975976, 1.4441251883565682], ([-1.25, -2.0], [-3.0, -1.125])),
    ("simpo", 0.1, 0.3, [0.3557229646697597, 1.326625188356568], ([-1.25, -2.0], [-3.0, -1.125])),
]


@pytest.mark.parametrize("loss_type, label_smoothing, gamma, expected, rewards", CASES)
def test_loss_types_match_hand_computed_values(loss_type, label_smoothing, gamma, expected, rewards):
    t = lambda x: torch.tensor(x, dtype=torch.float64)
    losses, rewards_c, rewards_r = dpo_loss(t(PC), t(PR), t(RC), t(RR), t(LC), t(LR), loss_type, BETA,
                                            label_smoothing, gamma)
    # float64 in, so only the last bits of the hand values' own rounding can differ
    torch.testing.assert_close(losses, t(expected), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards_c, t(rewards[0]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards_r, t(rewards[1]), rtol=1e-12, atol=1e-12)


def test_gradient_of_sigmoid_loss_is_the_textbook_one():
    # d/d pc of -logsigmoid(beta h) = -beta * sigmoid(-beta h): at h = 1.5, beta = 0.5 -> -0.5 / (1 + e^0.75)
    pc = torch.tensor([-10.0], dtype=torch.float64, requires_grad=True)
    one = lambda x: torch.tensor([x], dtype=torch.float64)
    losses, _, _ = dpo_loss(pc, one(-12.0), one(-11.0), one(-11.5), one(4.0), one(2.0), "sigmoid", BETA)
    losses.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.5 / (1 + math.exp(0.75)), rel=1e-12)


def test_reward_accuracy_is_per_pair_not_a_comparison_of_means():
    # Pair 0's chosen reward is far above its rejected one; pairs 1-3 have it slightly below. The mean chosen
    # reward (1.75 beta units) beats the mean rejected one (0), yet only 1 pair in 4 prefers chosen.
    pc = torch.tensor([0.0, -11.0, -11.0, -11.0])
    pr = torch.tensor([-10.0, -10.0, -10.0, -10.0])
    ref = torch.full((4,), -10.0)  # the reference scores both sides alike
    ones = torch.ones(4)
    losses, rewards_c, rewards_r = dpo_loss(pc, pr, ref, ref, ones, ones, "sigmoid", 1.0)
    assert rewards_c.mean() > rewards_r.mean()
    stats = pair_stats(losses, rewards_c, rewards_r, pc, pr)
    assert stats["reward_accuracy"].item() / 4 == 0.25  # summed over pairs: divided by the pair count
    # and the other way round: the means say "rejected", three pairs in four say "chosen"
    pc2 = torch.tensor([-20.0, -9.0, -9.0, -9.0])
    losses2, rewards_c2, rewards_r2 = dpo_loss(pc2, pr, ref, ref, ones, ones, "sigmoid", 1.0)
    assert rewards_c2.mean() < rewards_r2.mean()
    assert pair_stats(losses2, rewards_c2, rewards_r2, pc2, pr)["reward_accuracy"].item() / 4 == 0.75
    # sums of the other statistics, for exact means after an all-reduce
    names = ("rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")
    torch.testing.assert_close(torch.stack([stats[k] for k in names]),
                               torch.stack([rewards_c.sum(), rewards_r.sum(), pc.sum(), pr.sum()]))


# -----------------------------------------------------------------------------
# packed == padded


def preference_data(rng, n_pairs, vocab):
    """A data dict as data/prepare.py writes it: pair p = sequences 2p (chosen), 2p+1 (rejected), sharing a prompt;
    loss_mask 1 on the responses only."""
    ids, masks, offsets = [], [], [0]
    for _ in range(n_pairs):
        prompt = rng.integers(0, vocab, rng.integers(3, 12)).tolist()
        for _side in range(2):
            response = rng.integers(0, vocab, rng.integers(1, 9)).tolist()
            ids += prompt + response
            masks += [0] * len(prompt) + [1] * len(response)
            offsets.append(len(ids))
    return dict(ids=np.array(ids, np.uint16), offsets=np.array(offsets, np.int64), loss_mask=np.array(masks, np.uint8))


def padded_sequence_logps(net, data, examples):
    """The plain (B, L) computation: right-padded rows, full logits, log_softmax, gather, mask, sum. Our model takes
    one stream, so each padded row goes through it as one sequence (causal: the padding after a row's end cannot
    change the positions before it)."""
    offsets = data["offsets"]
    rows = [torch.from_numpy(data["ids"][offsets[e]:offsets[e + 1]].astype(np.int64)) for e in examples]
    masks = [torch.from_numpy(data["loss_mask"][offsets[e]:offsets[e + 1]].astype(bool)) for e in examples]
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)], mask[i, :len(r)] = r, m
    logits = torch.stack([net(ids[i]) for i in range(len(rows))])  # (B, L, V)
    logp = F.log_softmax(logits.float(), dim=-1)[:, :-1]  # position t predicts token t + 1
    token_logp = logp.gather(2, ids[:, 1:, None]).squeeze(2)  # (B, L - 1)
    target = mask[:, 1:]  # the first token of a row is never a target
    return (token_logp * target).sum(1)  # (B,)


@pytest.mark.parametrize("shared", [False, True], ids=["whole", "prefix-shared"])
def test_packed_equals_padded_logps_loss_and_gradients(monkeypatch, shared):
    # a small head chunk so that the chunked path really runs over several chunks
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 7)
    torch.manual_seed(0)
    net = Transformer(config_from_preset("tiny"))
    data = preference_data(np.random.default_rng(0), n_pairs=5, vocab=500)
    pairs = [3, 0, 4, 1]  # packed in this order, not the data order
    mb = make_batch(data, pairs, group_size=2, prefix=shared_prefixes(data) if shared else None)
    assert (mb.kv is not None) == shared  # the pairs do share prompts
    ref = torch.randn(len(pairs), 2) - 30.0  # any fixed reference log-probs
    lengths = torch.tensor([[float(data["loss_mask"][data["offsets"][e]:data["offsets"][e + 1]][1:].sum())
                             for e in (2 * p, 2 * p + 1)] for p in pairs])
    assert torch.equal(torch.tensor(target_counts(data).reshape(-1, 2), dtype=torch.float32)[pairs], lengths)

    def loss_from(pc, pr):
        losses, _, _ = dpo_loss(pc, pr, ref[:, 0], ref[:, 1], lengths[:, 0], lengths[:, 1], "sigmoid", 0.1, 0.1)
        return losses.mean()

    # packed: one forward over the whole micro-batch, per-sequence sums by index_add_ over sequence ids
    logps = net(**mb.inputs(), logprobs=True)
    pc, pr = mb.pair_sums(logps)
    packed_loss = loss_from(pc, pr)
    packed_loss.backward()
    packed_grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    net.zero_grad()

    examples = [e for p in pairs for e in (2 * p, 2 * p + 1)]
    padded = padded_sequence_logps(net, data, examples)  # (2P,)
    padded_loss = loss_from(padded[0::2], padded[1::2])
    padded_loss.backward()

    # float32; the two paths sum the same terms in a different order (chunks, packed rows): ~1e-6 relative on
    # log-prob sums of ~-100, so 1e-4 absolute is tight; gradients alike, relative to their scale
    torch.testing.assert_close(pc, padded[0::2].detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(pr, padded[1::2].detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=0)
    for k, p in net.named_parameters():
        scale = p.grad.abs().max().item() + 1e-12
        torch.testing.assert_close(packed_grads[k] / scale, p.grad / scale, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("mode", ["adapters_off", "live"])
def test_a_reference_computed_on_each_microbatch_precomputes_only_the_val_split(monkeypatch, mode):
    """Training reads a live or adapters_off reference on each micro-batch: only the val split's sums are computed
    before training (a forward over the whole train split was computed and thrown away)."""
    import types
    from contextlib import nullcontext

    import reference
    model = Transformer(config_from_preset("toy"))
    computed = []
    monkeypatch.setattr(reference, "split_logps", lambda m, data, *a, **k: computed.append(data) or torch.zeros(1, 2))
    monkeypatch.setattr(reference, "build_model", lambda *a, **k: (model, None))
    train, val = {"offsets": np.arange(9)}, {"offsets": np.arange(5)}
    run = types.SimpleNamespace(config=dict(microbatch_tokens=64, parallel="ddp", seed=0), model=model,
                                raw_model=model, autocast=nullcontext(), device="cpu", cp=None, train_data=train,
                                val_data=val,
                                loader=types.SimpleNamespace(lengths=np.ones(4), prefix=None), start={}, world_size=1,
                                dtype="float32")
    ref = reference.Reference.build(mode, run, key="k")
    assert computed == [val] and ref.model is model and ref.val.shape == (1, 2)
