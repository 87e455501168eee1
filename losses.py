"""
The losses on log-probs, pure functions of tensors (tests/test_dpo_loss.py, tests/test_train_rl.py):
  dpo_loss          the DPO family: sigmoid (DPO), ipo, hinge, dpo_norm, simpo, apo_zero, robust,
                    bco_pair (train_dpo.py; online DPO in train_rl.py), tested against TRL
  preference_loss   the step's loss from dpo_loss's: the mean over pairs, plus an SFT term
  group_advantages  the GRPO family's advantages: rewards less their group's mean, scaled (or not)
  policy_loss       the GRPO family's loss on a micro-batch: PPO's or CISPO's clip of a ratio per
                    token or per reply (GSPO), weighted per token, + a KL estimate to a reference
  RL_OBJECTIVES     train_rl.py's objective by name: grpo_objective (the GRPO family),
                    distill_objective (on-policy distillation: the teacher's per-token advantage)
                    or online_dpo_objective
  pair_stats        named per-pair statistics (rewards, reward accuracy, log-probs), summed
A pair p is sequences 2p (chosen) and 2p+1 (rejected);
mb.pair_sums(per-target values) -> (chosen (P,), rejected (P,)).
"""
import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "dpo_norm", "simpo", "apo_zero", "robust", "bco_pair")
STATS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy",
         "logps_chosen", "logps_rejected")


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, len_chosen, len_rejected,
             loss_type, beta, label_smoothing=0.0, gamma=0.0, shift=0.0):
    """-> per-pair losses (P,) and rewards beta * (policy - reference) (chosen (P,), rejected (P,))
    from per-sequence log-prob sums; per response token for ipo (TRL's convention), dpo_norm and
    simpo (which has no reference). shift: bco_pair's reward shift (RewardShift.value)."""
    pc, pr, rc, rr = policy_chosen, policy_rejected, ref_chosen, ref_rejected
    if loss_type in ("ipo", "dpo_norm", "simpo"):
        pc, pr, rc, rr = pc / len_chosen, pr / len_rejected, rc / len_chosen, rr / len_rejected
    if loss_type == "simpo":
        rc, rr = torch.zeros_like(rc), torch.zeros_like(rr)
    # the implicit rewards, each side's own
    rewards_c, rewards_r = beta * (pc - rc), beta * (pr - rr)
    # how much more than the reference the policy prefers chosen over rejected
    h = (pc - rc) - (pr - rr)
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "apo_zero":
        # APO: each reward against 0, not against the other's
        losses = (1 - torch.sigmoid(rewards_c)) + torch.sigmoid(rewards_r)
    elif loss_type == "bco_pair":
        # BCO: a binary classifier of each side's reward, its boundary at the shift
        losses = -F.logsigmoid(rewards_c - shift) - F.logsigmoid(-(rewards_r - shift))
    elif loss_type == "robust":
        # rDPO: unbiased under labels flipped with probability label_smoothing
        eps, z = label_smoothing, beta * h
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    else:
        # sigmoid, dpo_norm, simpo: logistic, with a margin gamma for simpo
        z = beta * h - (gamma if loss_type == "simpo" else 0.0)
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, rewards_c.detach(), rewards_r.detach()


class RewardShift:
    """bco_pair's reward shift: the mean of every reward (chosen and rejected, all ranks) of the
    steps before this one, constant within a step so that micro-batches and ranks take one big
    batch's step."""

    def __init__(self, reward_sum=0.0, count=0):
        self.reward_sum, self.count = reward_sum, count

    @property
    def value(self):
        return self.reward_sum / self.count if self.count else 0.0

    def update(self, reward_sum, count):
        """A step's rewards: their sum over every rank, and how many there were."""
        self.reward_sum, self.count = self.reward_sum + reward_sum, self.count + count

    def state_dict(self):
        # the checkpoint's "bco_rewards" pair, as saved before this was an object
        return (self.reward_sum, self.count)



def preference_loss(losses, policy_chosen, num_pairs, num_chosen_targets, sft_weight):
    """The pairs' share of a step's loss: their summed losses / the step's pairs, plus sft_weight x
    their chosen NLL per chosen target token of the step (RPO; TRL's loss_type=[..., 'sft'])."""
    return losses.sum() / num_pairs - sft_weight * policy_chosen.sum() / num_chosen_targets


def group_advantages(rewards, scale="group", batch_std=None):
    """(G, k) rewards of k replies per prompt -> advantages: each reward less its group's mean, over
    the group's std (scale='group'), the step's (batch_std, all ranks) or none, + 1e-4 (TRL's)."""
    centred = rewards - rewards.mean(1, keepdim=True)
    if scale == "none":
        return centred
    return centred / ((rewards.std(1, keepdim=True) if scale == "group" else batch_std) + 1e-4)


def clipped_objective(ratio, advantages, clip_low, clip_high, clip_mode, logps=None):
    """Per token or per reply: PPO's -min(r A, clip(r) A) (no gradient where the clip bites), or
    CISPO's -sg(clip(r)) A log p (every gradient kept, its weight clipped);
    clip(r) = clamp(r, 1 - low, 1 + high)."""
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    if clip_mode == "cispo":
        return -clipped.detach() * advantages * logps
    return -torch.min(ratio * advantages, clipped * advantages)


def clip_counts(ratio, advantages, clip_low, clip_high, clip_mode):
    """-> (tokens clipped low, high): where PPO's clip takes the gradient away, or CISPO's clips
    the weight."""
    low, high = ratio < 1 - clip_low, ratio > 1 + clip_high
    if clip_mode == "ppo":
        low, high = low & (advantages < 0), high & (advantages > 0)
    return low.float().sum(), high.float().sum()


def policy_loss(logps, old_logps, seq_ids, advantages, weights, lengths, clip_low, clip_high,
                clip_mode="ppo", reply_sums=None, ref_logps=None, kl_coef=0.0,
                token_advantages=None, is_weights=None):
    """The GRPO family on a micro-batch's K trained tokens -> (its share of the step loss,
    (ratio sum, tokens clipped low, high)). Per reply (S,): advantages, weights (each of its
    tokens' share of the step loss), lengths (its trained tokens); seq_ids (K,) each token's reply.
    Ratios to the sampling policy (old_logps), one per token, or with reply_sums (per token ->
    (S,) sums) one per reply, exp of its mean log-ratio (GSPO); each token's loss times is_weights
    (K,) (the sampler/trainer correction, as TRL); + kl_coef x k3 KL to ref_logps.
    token_advantages (K,): added to each token's (per-token ratios only)."""
    log_ratio = logps - old_logps
    a, w = advantages[seq_ids], weights[seq_ids]
    if token_advantages is not None:
        a = a + token_advantages
    if reply_sums is None:
        ratio = torch.exp(log_ratio)
        losses, per_reply = clipped_objective(ratio, a, clip_low, clip_high, clip_mode, logps), 0.0
    else:
        # (S,)
        reply_ratio = torch.exp(reply_sums(log_ratio) / lengths.clamp(min=1))
        ratio = reply_ratio[seq_ids]
        if clip_mode == "cispo":
            # the weight carries no gradient: a per-token loss
            losses = clipped_objective(ratio, a, clip_low, clip_high, clip_mode, logps)
            per_reply = 0.0
        else:
            # the value from the tokens (a CP slice holds some), the gradient from whole replies
            reply_losses = clipped_objective(reply_ratio, advantages, clip_low, clip_high,
                                             clip_mode)
            # each reply's loss counted once per token, each token at its correction's weight
            counts = lengths if is_weights is None else reply_sums(is_weights)
            per_reply = (weights * counts * reply_losses).sum()
            losses, per_reply = reply_losses.detach()[seq_ids], per_reply - per_reply.detach()
    if is_weights is not None:
        losses = losses * is_weights
    if kl_coef:
        log_ref = ref_logps - logps
        losses = losses + kl_coef * (torch.exp(log_ref) - log_ref - 1)
    clipped = clip_counts(ratio.detach(), a, clip_low, clip_high, clip_mode)
    stats = torch.stack([ratio.detach().sum(), *clipped])
    return (w * losses).sum() + per_reply, stats


def sampler_mismatch(trainer_logps, sampler_logps):
    """Per sampled token -> (the k3 estimate of KL(sampler || trainer), the ratio p_trainer /
    p_sampler): what the sampler saw against what the trainer recomputes. float64: in float32
    exp(r) - r - 1 cancels to 0 for the ~1e-7 log-ratios of one function computed two ways."""
    log_r = trainer_logps.double() - sampler_logps.double()
    return log_r.exp() - log_r - 1, log_r.exp()


def correction_weights(trainer_logps, sampler_logps, mode, cap, reply_sums=None):
    """TRL's importance-sampling correction of the sampler/trainer mismatch -> (K,) weights (no
    gradient): the ratio exp(trainer - sampler) per token, or (sequence_*) one per reply, exp of
    its summed log-ratio (reply_sums: per token -> (K,) its reply's sum); *_truncate caps it at
    `cap`, *_mask zeroes it above. A NaN sampler log-prob (a token not sampled) counts as 1."""
    log_ratio = torch.nan_to_num((trainer_logps - sampler_logps).detach(), nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = reply_sums(log_ratio)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


def loss_weights(lengths, aggregation, normaliser):
    """(R,) each reply token's share of the step loss: 1 / (its reply's tokens x normaliser) for
    'reply_mean' (normaliser: replies), 1 / normaliser for 'token_mean' (tokens) and 'constant'
    (replies x max_new_tokens)."""
    if aggregation == "reply_mean":
        return 1 / lengths.clamp(min=1) / normaliser
    return torch.ones_like(lengths) / normaliser


# policy_loss's sums, in its order
POLICY_STATS = ("ratio_sum", "clipped_low", "clipped_high")


def grpo_objective(mb, logps, old, replies, settings, token_advantages=None):
    """The GRPO family on a micro-batch of groups of k replies -> (its share of the step loss, its
    sums by name: the loss, ratios, tokens clipped low and high). old: the sampling policy's
    ("sampling") and the reference's ("ref") log-probs of its tokens; replies: (advantages,
    weights, lengths) of each reply of this rank's groups; settings: the config's k, clip_eps,
    clip_eps_high, clip_mode, importance_sampling_level, kl_coef, is_correction, is_cap (with the
    sampler's log-probs in mb.sampler_logps)."""
    k = settings["k"]
    # the batch's replies: group u holds replies u*k .. u*k+k-1
    seqs = (mb.units[:, None] * k + torch.arange(k, device=logps.device)).flatten()
    advantages, weights, lengths = (x[seqs] for x in replies)
    reply_sums = mb.sequence_sums if settings["importance_sampling_level"] == "sequence" else None
    clip = settings["clip_eps"], settings["clip_eps_high"], settings["clip_mode"]
    correction = None
    if settings["is_correction"] != "none":
        per_token = lambda x: mb.sequence_sums(x)[mb.seq_ids]  # noqa: E731
        correction = correction_weights(old["sampling"], mb.sampler_logps,
                                        settings["is_correction"], settings["is_cap"], per_token)
    loss, stats = policy_loss(logps, old["sampling"], mb.seq_ids, advantages, weights, lengths,
                              *clip, reply_sums, old["ref"], settings["kl_coef"], token_advantages,
                              correction)
    # a CP slice holds a share of the tokens: the shares add up
    return loss, dict(loss=loss.detach(), **dict(zip(POLICY_STATS, stats)))


def distill_advantages(teacher_logps, sampling_logps, coef):
    """On-policy distillation's per-token advantage: coef x (log p_teacher - log p_student) of each
    sampled token, both at sampling time: minus the sampled-token estimate of the reverse KL."""
    return coef * (teacher_logps - sampling_logps)


def distill_objective(mb, logps, old, replies, settings):
    """The GRPO family's objective with each reply token's advantage (1 - c) x its reply's group
    advantage + distill_advantages(c) (old["teacher"]: the teacher's log-probs), c = distill_coef:
    1 learns from the teacher alone (the reward still scored, logged and evaluated) -> as
    grpo_objective, and distill_loss: the summed reverse-KL estimate log p_student - log
    p_teacher."""
    c = settings["distill_coef"]
    token_advantages = distill_advantages(old["teacher"], old["sampling"], c)
    replies = (replies[0] * (1 - c), *replies[1:])
    loss, sums = grpo_objective(mb, logps, old, replies, settings, token_advantages)
    return loss, dict(sums, distill_loss=(old["sampling"] - old["teacher"]).sum())


def online_dpo_objective(mb, logps, old, num_pairs, settings):
    """Online DPO on a micro-batch of pairs (each group's best and worst reply) -> (its share of the
    step loss: its pairs' sigmoid DPO losses / the step's pairs, its sums by name: the loss)."""
    pc, pr = mb.pair_sums(logps)
    rc, rr = mb.pair_sums(old["ref"])
    loss = dpo_loss(pc, pr, rc, rr, None, None, "sigmoid", settings["beta"])[0].sum() / num_pairs
    # a CP group's ranks hold the same pairs' sums, so the same loss: its first rank counts it
    first = mb.context is None or mb.context.rank == 0
    return loss, dict(loss=loss.detach() * first)


# train_rl.py's objective by its `loss` key: (the micro-batch loss, its sums' names besides `loss`)
GRPO = (grpo_objective, POLICY_STATS)
RL_OBJECTIVES = dict(grpo=GRPO, dapo=GRPO, dr_grpo=GRPO, gspo=GRPO, cispo=GRPO,
                     distill=(distill_objective, (*POLICY_STATS, "distill_loss")),
                     online_dpo=(online_dpo_objective, ()))


def pair_stats(losses, rewards_chosen, rewards_rejected, policy_chosen, policy_rejected):
    """Sums over pairs, by name (STATS), for exact means over steps and ranks; reward_accuracy
    compares per pair."""
    accuracy = (rewards_chosen > rewards_rejected).float()
    values = (losses, rewards_chosen, rewards_rejected, accuracy, policy_chosen, policy_rejected)
    return {k: v.detach().sum() for k, v in zip(STATS, values)}


# train_rl.py's `loss` names these values for the keys not set explicitly (TRL 1.16's settings,
# the papers' clip ranges)
GRPO = dict(loss_aggregation="reply_mean", scale_rewards="group", clip_eps=0.2, clip_eps_high=0.2,
            importance_sampling_level="token", clip_mode="ppo", mask_truncated=False,
            dynamic_sampling=False)
RL_PRESETS = dict(
    grpo=GRPO,
    dapo=dict(GRPO, loss_aggregation="token_mean", clip_eps_high=0.28, mask_truncated=True,
              dynamic_sampling=True),
    dr_grpo=dict(GRPO, loss_aggregation="constant", scale_rewards="none"),
    gspo=dict(GRPO, clip_eps=3e-4, clip_eps_high=4e-4, importance_sampling_level="sequence"),
    cispo=dict(GRPO, loss_aggregation="token_mean", clip_eps=1.0, clip_eps_high=4.0,
               clip_mode="cispo"),
    # every group trains (the teacher's term differs between tokens), with DAPO's token mean
    distill=dict(GRPO, loss_aggregation="token_mean", dynamic_sampling=False),
    online_dpo=dict(mask_truncated=False, dynamic_sampling=False))
# the GRPO family
GRPO_FAMILY = tuple(RL_PRESETS)[:-1]
# the keys only one kind of train_rl.py's `loss` reads: set explicitly with the other, a
# config error
GRPO_ONLY = ("loss_aggregation", "scale_rewards", "clip_eps", "clip_eps_high",
             "importance_sampling_level", "clip_mode", "is_correction", "is_cap")
RL_READ_BY = {key: ("loss", GRPO_FAMILY, "") for key in GRPO_ONLY}
# the teacher's per-token advantage is per token: no ratio per reply
RL_READ_BY["importance_sampling_level"] = ("loss", tuple(x for x in GRPO_FAMILY if x != "distill"),
                                             "")
for key in ("teacher", "distill_coef"):
    RL_READ_BY[key] = ("loss", ("distill",), "on-policy distillation")
RL_READ_BY["kl_coef"] = ("loss", GRPO_FAMILY, "beta weighs online DPO's reference")
# multi-turn: a trajectory's observation tokens are masked out, which online DPO's pairs are not
for key in ("env", "tools"):
    RL_READ_BY[key] = ("loss", GRPO_FAMILY, "a trajectory trains through the GRPO family's masks")
RL_READ_BY["max_turns"] = (("env", "tools"), None, "a single-turn run takes one reply")
RL_READ_BY["beta"] = ("loss", ("online_dpo",),
                      "kl_coef is the KL weight here; beta is online DPO's")
