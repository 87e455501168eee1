"""
The losses on log-probs, pure functions of tensors (tests/test_dpo_loss.py, tests/test_train_rl.py):
  dpo_loss          the DPO family: sigmoid (DPO), ipo, hinge, dpo_norm, simpo, apo_zero, robust, bco_pair
                    (train_dpo.py; online DPO in train_rl.py), tested against TRL (docs/dpo.md: which setting)
  preference_loss   the step's loss from dpo_loss's: the mean over pairs, plus an SFT term (sft_weight)
  group_advantages  GRPO's group-normalised rewards of k replies per prompt
  policy_loss       GRPO's per-token clipped policy loss (+ a KL estimate to a reference)
  pair_stats        named per-pair statistics (rewards, reward accuracy, log-probs), summed, for exact means
A pair p is sequences 2p (chosen) and 2p+1 (rejected); mb.pair_sums(per-target values) -> (chosen (P,), rejected (P,)).
"""
import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "dpo_norm", "simpo", "apo_zero", "robust", "bco_pair")
STATS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "logps_chosen", "logps_rejected")


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, len_chosen, len_rejected,
             loss_type, beta, label_smoothing=0.0, gamma=0.0, shift=0.0):
    """-> per-pair losses (P,) and rewards beta * (policy - reference) (chosen (P,), rejected (P,)) from per-sequence
    log-prob sums; per response token for ipo (TRL's convention), dpo_norm and simpo (which has no reference).
    shift: bco_pair's reward shift (the running mean of the rewards, kept by the caller)."""
    pc, pr, rc, rr = policy_chosen, policy_rejected, ref_chosen, ref_rejected
    if loss_type in ("ipo", "dpo_norm", "simpo"):
        pc, pr, rc, rr = pc / len_chosen, pr / len_rejected, rc / len_chosen, rr / len_rejected
    if loss_type == "simpo":
        rc, rr = torch.zeros_like(rc), torch.zeros_like(rr)
    rewards_c, rewards_r = beta * (pc - rc), beta * (pr - rr)  # the implicit rewards, each side's own
    h = (pc - rc) - (pr - rr)  # how much more than the reference the policy prefers chosen over rejected
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "apo_zero":  # each reward against 0, not against the other's: chosen up, rejected down (APO)
        losses = (1 - torch.sigmoid(rewards_c)) + torch.sigmoid(rewards_r)
    elif loss_type == "bco_pair":  # a binary classifier of each side's reward, its boundary at the shift (BCO)
        losses = -F.logsigmoid(rewards_c - shift) - F.logsigmoid(-(rewards_r - shift))
    elif loss_type == "robust":  # unbiased under labels flipped with probability label_smoothing (rDPO)
        eps, z = label_smoothing, beta * h
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    else:  # sigmoid, dpo_norm, simpo: logistic, with a margin gamma for simpo
        z = beta * h - (gamma if loss_type == "simpo" else 0.0)
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, rewards_c.detach(), rewards_r.detach()


def preference_loss(losses, policy_chosen, num_pairs, num_chosen_targets, sft_weight):
    """The pairs' share of a step's loss: their summed losses / the step's pairs, plus sft_weight x their chosen NLL per
    target token of the step's chosen responses (RPO; TRL's loss_type=[..., 'sft'], loss_weights=[1, sft_weight])."""
    return losses.sum() / num_pairs - sft_weight * policy_chosen.sum() / num_chosen_targets


def group_advantages(rewards):
    """(G, k) rewards of k replies per prompt -> GRPO's advantages: each reward less its group's mean, over the group's
    standard deviation (0 where all k are equal: such a group teaches nothing)."""
    centred = rewards - rewards.mean(1, keepdim=True)
    return centred / rewards.std(1, keepdim=True).clamp(min=1e-6)


def policy_loss(logps, old_logps, advantages, clip_eps, ref_logps=None, kl_coef=0.0):
    """(K,) PPO's clipped objective, ratios to the sampling policy (old_logps; logps.detach() on a batch's first
    update: only the gradient counts), plus kl_coef times the k3 estimate of KL(policy || reference)."""
    ratio = torch.exp(logps - old_logps)
    losses = -torch.min(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    if kl_coef:
        log_ratio = ref_logps - logps
        losses = losses + kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
    return losses


def pair_stats(losses, rewards_chosen, rewards_rejected, policy_chosen, policy_rejected):
    """Sums over pairs, by name (STATS), for exact means over steps and ranks; reward_accuracy compares per pair."""
    values = (losses, rewards_chosen, rewards_rejected, (rewards_chosen > rewards_rejected).float(), policy_chosen,
              policy_rejected)
    return {k: v.detach().sum() for k, v in zip(STATS, values)}
