"""losses.py's GRPO family without running train_rl.py: each preset of train_rl.py's `loss` equals TRL's GRPOTrainer
(its own _compute_loss, on the same weights, prompts, replies, old and reference log-probs and rewards), loss and every
gradient; CISPO and the advantages against their formulas; the presets as --help prints them are the ones tested."""
import subprocess
import sys
import types
from collections import defaultdict
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from conftest import ROOT
from losses import clipped_objective, group_advantages, loss_weights, policy_loss
from packing import group_data, make_batch, shared_prefixes

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

VOCAB, EOS, PAD = 256, 2, 0  # 256: no padded vocab rows, so every parameter has the shape of its HF twin
G, K, PROMPT, MAX_NEW = 3, 4, 5, 6  # groups, replies per group, prompt tokens (all alike: TRL pads no prompt), cap
# train_rl.py's presets (checked against its --help below) and TRL's settings for each: loss_type, epsilon (low),
# epsilon_high (for cispo TRL's is the weight's cap: 1 + ours), importance_sampling_level, mask_truncated_completions
GRPO = dict(loss_aggregation="reply_mean", scale_rewards="group", clip_eps=0.2, clip_eps_high=0.2,
            importance_sampling_level="token", clip_mode="ppo", mask_truncated=False, dynamic_sampling=False)
PRESETS = dict(
    grpo=(GRPO, "grpo"),
    dapo=(dict(GRPO, loss_aggregation="token_mean", clip_eps_high=0.28, mask_truncated=True, dynamic_sampling=True),
          "dapo"),
    dr_grpo=(dict(GRPO, loss_aggregation="constant", scale_rewards="none"), "dr_grpo"),
    gspo=(dict(GRPO, clip_eps=3e-4, clip_eps_high=4e-4, importance_sampling_level="sequence"), "grpo"),
    cispo=(dict(GRPO, loss_aggregation="token_mean", clip_eps=1.0, clip_eps_high=4.0, clip_mode="cispo"), "cispo"),
)
NORMALISER = dict(reply_mean=lambda lengths: lengths.numel(), token_mean=lambda lengths: lengths.sum().item(),
                  constant=lambda lengths: lengths.numel() * MAX_NEW)  # over the step's replies, as train_rl.py


def samples(seed=0):
    """G groups of K replies to prompts of PROMPT tokens: some stopped (EOS last), some cut at MAX_NEW (truncated), a
    group whose rewards are all equal; the sampler's and the reference's log-probs are set per test."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, PROMPT).tolist() for _ in range(G)]
    replies = []
    for g in range(G):
        group = []
        for j in range(K):
            n = int(rng.integers(1, MAX_NEW + 1))
            reply = rng.integers(3, VOCAB, n).tolist()
            reply[0] = 3 + 10 * g + j  # distinct first tokens: the group shares exactly its prompt
            if (g + j) % 3:  # the others run on to MAX_NEW with no stop token
                reply[-1] = EOS
            else:
                reply += rng.integers(3, VOCAB, MAX_NEW - n).tolist()
            group.append(reply)
        replies.append(group)
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0], [0.0, 3.0, 0.0, 1.0]], dtype=torch.float64)
    return prompts, replies, rewards


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random Llama as transformers builds it, its head fused at each sampling temperature tested
    (TRL scores at the one it sampled at), and ours loaded from its folder: the same weights."""
    from nanopack.hf import from_pretrained
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.1)
    folder = str(tmp_path_factory.mktemp("llama"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    from trl.trainer.utils import add_fused_lm_head
    hf_models = {}
    for temperature in (1.0, 0.7):
        hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        # as GRPOTrainer.__init__ does
        add_fused_lm_head(hf, temperature, outputs=("log_probs", "entropy"))
        hf_models[temperature] = hf
    return hf_models, from_pretrained(folder, dtype=torch.float32).train()


def trl_loss(model, inputs, loss_type, eps_low, eps_high, level, beta):
    """TRL's GRPOTrainer._compute_loss itself, on a stand-in trainer carrying the fields it reads (one process, no
    gradient accumulation, no vLLM, no entropy masking or bonus)."""
    from trl import GRPOTrainer
    accelerator = types.SimpleNamespace(num_processes=1, is_main_process=True, autocast=nullcontext,
                                        reduce=lambda x, reduction: x, gather=lambda x: x)
    me = types.SimpleNamespace(
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, importance_sampling_level=level, beta=beta,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, model=model, current_gradient_accumulation_steps=1, max_completion_length=MAX_NEW,
        accelerator=accelerator, _metrics=defaultdict(lambda: defaultdict(list)),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1, report_to=[]))
    me._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, me)
    return GRPOTrainer._compute_loss(me, model, inputs), me._metrics["train"]


def grads(model, loss, names):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if n in names}


@pytest.mark.parametrize("preset, beta, scale_rewards, temperature", [
    *[(p, 0.0, "preset", 1.0) for p in PRESETS], ("grpo", 0.04, "preset", 1.0),
    ("dapo", 0.04, "batch", 1.0), ("gspo", 0.04, "preset", 1.0), ("cispo", 0.0, "batch", 1.0),
    *[(p, 0.04, "preset", 0.7) for p in PRESETS]])
def test_each_preset_equals_trl(models, preset, beta, scale_rewards, temperature):
    """The step as one batch: TRL pads the replies, we pack the groups with their prompt shared, skip the group whose
    rewards are equal (beta 0: it has no loss) yet count it as TRL does. Ratios away from 1 (a batch's later update: the
    sampler's log-probs perturbed), so that the clips act. Replies sampled at temperature 0.7:
    both score the policy at logits / 0.7."""
    hf_models, ours = models
    hf_model = hf_models[temperature]
    knobs, loss_type = PRESETS[preset]
    scale = knobs["scale_rewards"] if scale_rewards == "preset" else scale_rewards
    prompts, replies, rewards = samples()
    flat = [r for group in replies for r in group]
    cut = torch.tensor([knobs["mask_truncated"] and r[-1] != EOS for r in flat])
    lengths = torch.tensor([0 if c else len(r) for r, c in zip(flat, cut.tolist())], dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(len(flat), MAX_NEW, generator=gen) * 0.3 - 3.0  # where the ratios start: perturbed below
    ref = torch.randn(len(flat), MAX_NEW, generator=gen) * 0.3 - 3.0

    # TRL: completions right-padded, the truncated ones masked as _generate_and_score_completions masks them
    completion_ids = torch.tensor([r + [PAD] * (MAX_NEW - len(r)) for r in flat])
    completion_mask = torch.tensor([[1] * len(r) + [0] * (MAX_NEW - len(r)) for r in flat]) * ~cut[:, None]
    advantages_trl = rewards - rewards.mean(1, keepdim=True)  # TRL's formula, (r - group mean) / (std + 1e-4)
    if scale != "none":
        std = trl.trainer.utils.nanstd(rewards, dim=1, keepdim=True) if scale == "group" else \
            trl.trainer.utils.nanstd(rewards)
        advantages_trl = advantages_trl / (std + 1e-4)
    with torch.no_grad():  # the current policy's log-probs, to place old ones near them: ratios of e^N(0, 0.3)
        out = hf_model(input_ids=torch.cat([torch.tensor([p for p in prompts for _ in range(K)]), completion_ids], 1),
                       attention_mask=torch.ones(len(flat), PROMPT + MAX_NEW, dtype=torch.long),
                       labels=torch.cat([torch.full((len(flat), PROMPT), -100), completion_ids], 1), fused_lm_head=True)
        now = out.log_probs[:, -MAX_NEW:]
    old = now + (old + 3.0)
    inputs = dict(prompt_ids=torch.tensor([p for p in prompts for _ in range(K)]),
                  prompt_mask=torch.ones(len(flat), PROMPT, dtype=torch.long), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages_trl.flatten().float(),
                  old_per_token_logps=old, ref_per_token_logps=now + (ref + 3.0) if beta else None,
                  num_items_in_batch=completion_mask.sum())
    eps_high = 1 + knobs["clip_eps_high"] if knobs["clip_mode"] == "cispo" else knobs["clip_eps_high"]
    loss_trl, metrics = trl_loss(hf_model, inputs, loss_type, knobs["clip_eps"], eps_high,
                                 knobs["importance_sampling_level"], beta)

    # ours: the groups that teach (or all, with a KL term), packed, weights from the step's counts
    teach = [g for g in range(G) if rewards[g].max() > rewards[g].min() or beta]
    std = rewards.std() if scale == "batch" else None
    advantages = group_advantages(rewards, scale, std).float()[teach].flatten()
    masks = [[np.ones(len(r)) * (1 - cut[g * K + j].item()) for j, r in enumerate(replies[g])] for g in teach]
    data = group_data([prompts[g] for g in teach], [replies[g] for g in teach], masks)
    mb = make_batch(data, list(range(len(teach))), group_size=K, prefix=shared_prefixes(data, K))
    rows = [g * K + j for g in teach for j in range(K)]
    token = lambda x: torch.cat([x[i, :int(lengths[i])] for i in rows])  # per trained token, in packed order
    weights = loss_weights(lengths[rows], knobs["loss_aggregation"], NORMALISER[knobs["loss_aggregation"]](lengths))
    logps = ours(**mb.inputs(), logprobs=True, temperature=temperature)
    sums = mb.sequence_sums if knobs["importance_sampling_level"] == "sequence" else None
    loss_ours, stats = policy_loss(logps, token(old), mb.seq_ids, advantages, weights, lengths[rows],
                                   knobs["clip_eps"], knobs["clip_eps_high"], knobs["clip_mode"], sums,
                                   token(now + (ref + 3.0)) if beta else None, beta)

    # float32 on both sides, the same terms summed in another order (padded rows vs a packed stream, the prompt's
    # gradient from K replies at once): measured 2e-7 relative on the loss and 4e-7 of a gradient's largest entry, so
    # 1e-5 holds a margin; a wrong weight, mask or ratio moves them by 1e-2 or more
    assert 0 < len(teach) < G or beta
    torch.testing.assert_close(loss_ours, loss_trl, rtol=1e-5, atol=1e-7)
    names = {n for n, _ in ours.named_parameters()}
    hf_grads = grads(hf_model, loss_trl, {("" if n.startswith("lm_head") else "model.") + n for n in names})
    for name, g in grads(ours, loss_ours, names).items():
        want = hf_grads[("" if name.startswith("lm_head") else "model.") + name]
        scale_ = want.abs().max() + 1e-12
        torch.testing.assert_close(g / scale_, want / scale_, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
    if knobs["clip_mode"] == "ppo" and knobs["importance_sampling_level"] == "token":  # TRL's clip ratios, the same
        n = completion_mask.sum().float()  # TRL counts the skipped group's tokens too (never clipped: A = 0)
        assert (stats[1] / n).item() == pytest.approx(metrics["clip_ratio/low_mean"][0], abs=1e-6)
        assert (stats[2] / n).item() == pytest.approx(metrics["clip_ratio/high_mean"][0], abs=1e-6)
        assert stats[1] + stats[2] > 0  # the clips acted


def test_ppo_clip_and_kl_by_hand():
    """A batch's first update (ratio 1) is REINFORCE, -A d log p; later, PPO's clip takes the pessimistic side (clip
    higher: up to 1.28); the KL term is k3 = e^(ref - logp) - (ref - logp) - 1 on each token."""
    logps = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    a, one, ids = torch.tensor([1.0, -1.0, 2.0]), torch.ones(3), torch.arange(3)
    first, stats = policy_loss(logps, logps.detach(), ids, a, one, one, 0.2, 0.28)
    first.backward()
    torch.testing.assert_close(first, -a.sum())
    torch.testing.assert_close(logps.grad, -a)
    assert stats.tolist() == [3.0, 0.0, 0.0]  # ratios sum, none clipped low or high
    old = logps.detach() - torch.tensor([0.5, 0.5, -0.5])  # ratios e^0.5 (beyond 1.28) and e^-0.5 (below 0.8)
    clipped = clipped_objective(torch.exp(logps.detach() - old), a, 0.2, 0.28, "ppo")
    torch.testing.assert_close(clipped, -torch.tensor([1.28, -np.exp(0.5), 2 * np.exp(-0.5)]).float())
    _, stats = policy_loss(logps.detach(), old, ids, a, one, one, 0.2, 0.28)
    assert stats[1:].tolist() == [0.0, 1.0]  # token 0 clipped high (A > 0); token 2's ratio is low but A > 0
    kl, _ = policy_loss(logps.detach(), logps.detach(), ids, torch.zeros(3), one, one, 0.2, 0.28,
                        ref_logps=logps.detach() + 0.3, kl_coef=2.0)
    torch.testing.assert_close(kl, torch.tensor(3 * 2.0 * (np.exp(0.3) - 0.3 - 1)).float())


def test_cispo_is_the_papers_formula_and_group_advantages_trls():
    """CISPO (MiniMax-M1, eq. 4): -sg(clip(r, 1 - low, 1 + high)) A log p for every token, clipped or not; the
    advantages: (r - group mean) / (group std + 1e-4), torch's std unbiased as TRL's nanstd."""
    logps = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = logps.detach() - torch.tensor([0.5, -0.5, 0.0, 2.0])  # ratios e^0.5, e^-0.5, 1, e^2
    a = torch.tensor([1.0, -1.0, 2.0, -0.5])
    loss = clipped_objective(torch.exp(logps - old), a, 0.2, 0.28, "cispo", logps).sum()
    loss.backward()
    weight = torch.tensor([1.28, 0.8, 1.0, 1.28])  # each ratio clipped to [0.8, 1.28]
    torch.testing.assert_close(loss, -(weight * a * logps.detach()).sum())
    torch.testing.assert_close(logps.grad, -weight * a)  # no token loses its gradient
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    for g in range(3):
        r = rewards[g]
        torch.testing.assert_close(group_advantages(rewards)[g], (r - r.mean()) / (r.std() + 1e-4))
        torch.testing.assert_close(group_advantages(rewards, "none")[g], r - r.mean())
    torch.testing.assert_close(group_advantages(rewards, "batch", rewards.std()),
                               (rewards - rewards.mean(1, keepdim=True)) / (rewards.std() + 1e-4))


def test_help_prints_the_presets_tested_here():
    out = subprocess.run([sys.executable, "train_rl.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    printed = {}
    # --loss's section, up to the next key's presets (--env's)
    for line in out.stdout.split("Presets of --loss")[1].split("Presets of --")[0].splitlines()[1:]:
        name, _, keys = line.strip().partition(": ")
        printed[name] = dict(k[2:].split("=", 1) for k in keys.split())
    assert printed.pop("online_dpo") == dict(mask_truncated="False", dynamic_sampling="False")
    # on-policy distillation (tests/test_distill.py): GRPO's knobs, every token counted, every group trained
    distill = dict(GRPO, loss_aggregation="token_mean", dynamic_sampling=False)
    assert printed.pop("distill") == {k: repr(v) for k, v in distill.items()}
    assert printed == {name: {k: repr(v) for k, v in knobs.items()} for name, (knobs, _) in PRESETS.items()}
    default = dict(line[4:].split("  #")[0].split("=", 1) for line in out.stdout.splitlines() if line.startswith("  --"))
    assert default["loss"] == "'dapo'"  # the block's values are the default preset's (TRL's default loss_type)
    assert {k: default[k] for k in PRESETS["dapo"][0]} == printed["dapo"]
