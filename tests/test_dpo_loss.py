"""losses.py without running train_dpo.py: each loss type against numbers worked out by hand and against TRL's own
code, reward accuracy per pair, response lengths, and packed == padded for the per-sequence log-probs, the loss and
the gradients."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanopack import kernels
from losses import dpo_loss, pair_stats, preference_loss
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

    from nanopack import reference, startup
    model = Transformer(config_from_preset("toy"))
    computed = []
    monkeypatch.setattr(reference, "split_logps", lambda m, data, *a, **k: computed.append(data) or torch.zeros(1, 2))
    monkeypatch.setattr(startup, "build_model", lambda *a, **k: (model, None))
    train, val = {"offsets": np.arange(9)}, {"offsets": np.arange(5)}
    run = types.SimpleNamespace(config=dict(microbatch_tokens=64, parallel="ddp", seed=0), autocast=nullcontext(),
                                device="cpu", cp=None, world_size=1, dtype="float32")
    loader = types.SimpleNamespace(lengths=np.ones(4), prefix=None)
    ref = reference.Reference.build(mode, run, "k", model, model, None, dict(start={}), (train, val), loader)
    assert computed == [val] and ref.model is model and ref.val.shape == (1, 2)


# -----------------------------------------------------------------------------
# against TRL's own code: DPOTrainer._compute_loss (trl 1.16) on the same per-token log-probs


def trl_dpo_loss(chosen_tokens, rejected_tokens, ref_chosen, ref_rejected, loss_types, loss_weights, beta,
                 label_smoothing, tmp_path):
    """TRL's DPOTrainer._compute_loss on given per-token log-probs (lists of (n_i,) tensors, one per pair): a stand-in
    model returns them as its fused LM head's `log_probs`, a stand-in trainer carries what DPOTrainer.__init__ takes
    from its DPOConfig, reference log-probs precomputed. -> (loss, TRL's logged metrics, d loss / d each token's
    log-prob, chosen sequences' tokens then rejected ones')."""
    import types
    from collections import defaultdict

    from trl import DPOConfig, DPOTrainer
    rows = chosen_tokens + rejected_tokens  # TRL's batch: all chosen, then all rejected
    L = max(len(t) for t in rows) + 1  # position 0 is the prompt's: never a completion token
    completion_mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, t in enumerate(rows):
        completion_mask[i, 1:1 + len(t)] = 1
    leaf = torch.cat(rows).detach().clone().requires_grad_(True)
    # per-token log-probs as the fused head returns them: 0 off the completion (its labels are -100)
    log_probs = torch.zeros(len(rows), L - 1, dtype=leaf.dtype).masked_scatter(completion_mask[:, 1:].bool(), leaf)
    zeros = torch.zeros(len(rows), L - 1, dtype=leaf.dtype)
    model = lambda **kw: types.SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros,
                                               is_top1=zeros.bool())
    args = DPOConfig(output_dir=str(tmp_path), loss_type=loss_types, loss_weights=loss_weights, beta=beta,
                     label_smoothing=label_smoothing, bf16=False, report_to=[])
    trainer = types.SimpleNamespace(
        args=args, beta=args.beta, loss_types=args.loss_type, loss_weights=args.loss_weights or [1.0] * len(loss_types),
        ld_alpha=args.ld_alpha, f_divergence_type=args.f_divergence_type, label_smoothing=args.label_smoothing,
        use_weighting=args.use_weighting, precompute_ref_logps=True, aux_loss_enabled=False,
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1, accelerator=types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x))
    inputs = dict(input_ids=torch.zeros(len(rows), L, dtype=torch.long), completion_mask=completion_mask,
                  attention_mask=torch.ones_like(completion_mask), ref_chosen_logps=ref_chosen,
                  ref_rejected_logps=ref_rejected)
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), {k: v[0] for k, v in trainer._metrics["train"].items()}, leaf.grad


# ours -> TRL 1.16's loss_type; label_smoothing; whether TRL logs the same rewards (it logs beta * the log-ratio
# sums for every loss; ours are per response token for ipo and dpo_norm, whose losses are)
TRL_EQUALS = [
    ("sigmoid", "sigmoid", 0.0, True),
    ("hinge", "hinge", 0.0, True),
    ("ipo", "ipo", 0.0, False),
    ("dpo_norm", "sigmoid_norm", 0.0, False),
    ("apo_zero", "apo_zero", 0.0, True),
    ("robust", "robust", 0.0, True),
    ("robust", "robust", 0.2, True),
    ("bco_pair", "bco_pair", 0.0, True),
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # DPOConfig's own deprecations, not ours
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sft_weight", [0.0, 0.3])
@pytest.mark.parametrize("ours, theirs, label_smoothing, same_rewards", TRL_EQUALS)
def test_each_loss_equals_trls(tmp_path, ours, theirs, label_smoothing, same_rewards, sft_weight, dtype):
    """Loss, gradient w.r.t. every token's log-prob and the logged rewards; sft_weight composes as TRL's
    loss_type=[x, 'sft'], loss_weights=[1, sft_weight] (rpo_alpha before TRL 1.0)."""
    gen = torch.Generator().manual_seed(0)
    P, beta = 6, 0.5
    lengths = torch.randint(1, 9, (2, P), generator=gen)
    # per-token log-probs of a middling model; the reference's sums near the policy's, on either side
    tokens = [[-3 * torch.rand(int(n), generator=gen, dtype=dtype) for n in side] for side in lengths]
    policy = [torch.stack([t.sum() for t in side]) for side in tokens]
    ref = [p.detach() + 2 * torch.randn(P, generator=gen, dtype=dtype) for p in policy]
    loss_trl, metrics, grad_trl = trl_dpo_loss(*tokens, *ref, [theirs] + ["sft"] * (sft_weight > 0),
                                               [1.0] + [sft_weight] * (sft_weight > 0), beta, label_smoothing, tmp_path)

    leaves = [[t.clone().requires_grad_(True) for t in side] for side in tokens]
    pc, pr = (torch.stack([t.sum() for t in side]) for side in leaves)
    losses, rewards_c, rewards_r = dpo_loss(pc, pr, *ref, *lengths.to(dtype), ours, beta, label_smoothing)
    loss = preference_loss(losses, pc, P, int(lengths[0].sum()), sft_weight)
    loss.backward()
    grad = torch.cat([t.grad for side in leaves for t in side])
    # float64: the same formulas on the same numbers, summed in another order, agree to ~1e-15; float32 (how a run
    # computes): ~1e-7 relative per operation on log-prob sums of ~-10 and losses of ~1, a few dozen operations deep
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.detach(), loss_trl, **tol)
    torch.testing.assert_close(grad, grad_trl, **tol)
    assert grad.abs().max() > 1e-3  # the gradient is not vacuous
    if same_rewards:
        for name, ours_value in (("rewards/chosen", rewards_c.mean()), ("rewards/rejected", rewards_r.mean()),
                                 ("rewards/margins", (rewards_c - rewards_r).mean()),
                                 ("rewards/accuracies", (rewards_c > rewards_r).float().mean())):
            assert ours_value.item() == pytest.approx(metrics[name], rel=tol["rtol"], abs=tol["atol"]), name


@pytest.mark.filterwarnings("ignore::FutureWarning")  # DPOConfig's own deprecations, not ours
def test_bco_pair_shift_equals_trls_bco_pair_on_shifted_log_ratios(tmp_path):
    """bco_pair's shift d (the running mean of the rewards, train_dpo.py) moves each side's boundary: ours at d equals
    TRL's bco_pair with every log-ratio less d / beta. TRL 1.16 keeps no running mean (d = 0, the test above); TRL
    0.8-0.x's `self.running` mean entered exactly here."""
    gen = torch.Generator().manual_seed(1)
    P, beta, d = 5, 0.5, 0.7
    tokens = [[-3 * torch.rand(int(n), generator=gen, dtype=torch.float64) for n in torch.randint(1, 9, (P,))]
              for _side in range(2)]
    policy = [torch.stack([t.sum() for t in side]) for side in tokens]
    ref = [p + 2 * torch.randn(P, generator=gen, dtype=torch.float64) for p in policy]
    loss_trl, _, grad_trl = trl_dpo_loss(*tokens, *(r + d / beta for r in ref), ["bco_pair"], None, beta, 0.0, tmp_path)
    pc, pr = (p.clone().requires_grad_(True) for p in policy)
    ones = torch.ones(P, dtype=torch.float64)
    losses, _, _ = dpo_loss(pc, pr, *ref, ones, ones, "bco_pair", beta, shift=d)
    loss = losses.mean()
    loss.backward()
    grad = torch.cat([g.repeat_interleave(torch.tensor([len(t) for t in side]))  # d sum / d token = 1
                      for g, side in zip((pc.grad, pr.grad), tokens)])
    # float64; TRL adds d / beta to the reference, then multiplies by beta: rounding of ~1e-16 relative
    torch.testing.assert_close(loss.detach(), loss_trl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_trl, rtol=1e-12, atol=1e-12)
    unshifted, _, _ = dpo_loss(pc, pr, *ref, ones, ones, "bco_pair", beta)
    assert (unshifted.mean() - loss).abs() > 1e-2  # the shift matters


@pytest.mark.parametrize("loss_type, label_smoothing, expected", [
    ("sigmoid", 0.0, math.log(2)),
    ("apo_zero", 0.0, 1.0),  # (1 - sigmoid(0)) + sigmoid(0)
    ("robust", 0.0, math.log(2)),
    ("robust", 0.3, math.log(2)),  # (0.7 - 0.3) log 2 / (1 - 0.6)
    ("bco_pair", 0.0, 2 * math.log(2)),  # shift 0: no step before the first
    ("ipo", 0.0, 1.0),  # (0 - 1 / (2 beta))^2, beta 0.5
    ("hinge", 0.0, 1.0),
])
def test_first_step_values(loss_type, label_smoothing, expected):
    """At step 1 the policy is the reference: every pair's loss is the one at zero rewards, whatever the log-probs."""
    policy = torch.tensor([[-12.0, -30.0], [-3.0, -7.5]], dtype=torch.float64)
    lens = torch.tensor([4.0, 9.0], dtype=torch.float64)
    losses, rewards_c, rewards_r = dpo_loss(policy[:, 0], policy[:, 1], policy[:, 0], policy[:, 1], lens, lens,
                                            loss_type, 0.5, label_smoothing)
    torch.testing.assert_close(losses, torch.full((2,), expected, dtype=torch.float64), rtol=1e-15, atol=1e-15)
    assert rewards_c.abs().max() == rewards_r.abs().max() == 0


@pytest.mark.parametrize("ours, label_smoothing", [("simpo", 0.0), ("simpo", 0.1), ("sigmoid", 0.1)])
def test_simpo_and_conservative_dpo_equal_trls_cpo_loss(ours, label_smoothing):
    """simpo is TRL's CPOTrainer(loss_type='simpo', cpo_alpha=0) on response-averaged log-probs. TRL 1.16's DPOTrainer
    no longer smooths sigmoid's labels; its CPOTrainer keeps that formula (cDPO), reference-free: ours with a zero
    reference equals it on sums."""
    import types

    from trl.experimental.cpo import CPOTrainer
    gen = torch.Generator().manual_seed(2)
    P, beta, gamma = 6, 0.5, 0.3
    lens = torch.randint(1, 9, (2, P), generator=gen).double()
    policy = -3 * lens * torch.rand(2, P, generator=gen, dtype=torch.float64)
    trainer = types.SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=label_smoothing, simpo_gamma=gamma,
                                    loss_type="simpo" if ours == "simpo" else "sigmoid",
                                    accelerator=types.SimpleNamespace(device="cpu"))
    theirs = policy / lens if ours == "simpo" else policy  # CPOTrainer averages over the response for simpo
    losses_trl, rewards_c_trl, rewards_r_trl = CPOTrainer.cpo_loss(trainer, theirs[0], theirs[1])
    zero = torch.zeros(P, dtype=torch.float64)
    losses, rewards_c, rewards_r = dpo_loss(policy[0], policy[1], zero, zero, lens[0], lens[1], ours, beta,
                                            label_smoothing, gamma)
    # float64: the same formula, TRL divides gamma by beta and multiplies back: ~1e-16 relative
    for a, b in ((losses, losses_trl), (rewards_c, rewards_c_trl), (rewards_r, rewards_r_trl)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
