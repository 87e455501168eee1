"""The sampler/trainer mismatch (train_rl.py's sampler_kl, sampler_ratio_max, is_correction): the log-probs the engine
keeps for each sampled token against the trainer's on the packed forward, and TRL's importance-sampling corrections of
the gap (its own code, run on the same log-probs)."""
import inspect
import textwrap
import types

import numpy as np
import pytest
import torch

from losses import correction_weights, sampler_mismatch
from nanopack.generate import generate
from nanopack.rollout import sampler_logps
from packing import group_data, make_batch, shared_prefixes
from test_sample import PROMPTS, random_model

K = 3
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trainer_and_sampler(model, temperature, **sampling):
    """k replies to PROMPTS sampled by the engine (with its log-probs), and the trainer's log-probs of the same tokens
    on the packed forward, in the trained tokens' order."""
    replies, logps = generate(model, PROMPTS, 8, num_samples=K, temperature=temperature, seed=4, logprobs=True,
                              **sampling)
    groups = [replies[g * K:(g + 1) * K] for g in range(len(PROMPTS))]
    masks = [[np.ones(len(r)) for r in group] for group in groups]
    data = group_data(PROMPTS, groups, masks)
    mb = make_batch(data, np.arange(len(PROMPTS)), K, shared_prefixes(data, K))
    with torch.no_grad():
        trainer = model(**mb.inputs(), logprobs=True, temperature=temperature)
    logps = [logps[g * K:(g + 1) * K] for g in range(len(PROMPTS))]
    return trainer.double(), sampler_logps(logps, list(range(len(PROMPTS))), masks, mb.units, K).double(), mb


def test_the_mismatch_is_zero_where_sampler_and_trainer_compute_the_same_function():
    """float64 weights: the engine's KV-cache decode and the packed forward agree to float64 rounding, and both are
    returned in float32 (the trainer's log-probs are float32, the sampler's logits are cast to float32): log-ratios
    within a few float32 ulps of ~3 (1e-6), so k3 (~ half the squared log-ratio) below 1e-12 and every ratio within
    1e-5 of 1. At temperature 0.7 with top_k (the log-prob is the full softmax's, as the trainer's)."""
    model = random_model().double()
    trainer, sampler, mb = trainer_and_sampler(model, 0.7, top_k=20)
    k3, ratio = sampler_mismatch(trainer, sampler)
    assert len(k3) == K * 8 * len(PROMPTS)  # every sampled token (no stop token: all run 8)
    assert k3.mean() < 1e-12 and k3.min() >= 0
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    # the metric sees a real gap: scored at another temperature, k3 is orders of magnitude larger
    with torch.no_grad():
        other = model(**mb.inputs(), logprobs=True, temperature=1.0).double()
    assert sampler_mismatch(other, sampler)[0].mean() > 1e-4


def trl_correction(trainer, sampler, mask, mode, cap):
    """TRL's own importance-sampling block (GRPOTrainer._generate_and_score_completions, from `if self.use_vllm and
    self.vllm_importance_sampling_correction:` to the reference model's log-probs), run on padded (B, T) log-probs."""
    from trl import GRPOTrainer
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index("            if self.use_vllm and self.vllm_importance_sampling_correction:")
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    me = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                               vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=cap,
                               vllm_importance_sampling_clip_min=None)
    scope = dict(self=me, torch=torch, math=__import__("math"), old_per_token_logps=trainer,
                 sampling_per_token_logps=sampler, completion_mask=mask, tool_mask=None)
    exec(textwrap.dedent(source[start:end]), scope)
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("mode", MODES)
def test_the_corrections_equal_trls(mode):
    """The same log-probs (a float32 model's, the sampler's perturbed so that some ratios pass the cap, a few
    tokens' sampler log-prob NaN, as TRL's vLLM path allows): TRL's weights per token (or per sequence, on each of
    its tokens) and ours equal to float64 rounding of the same sums in another order (1e-12)."""
    trainer, sampler, mb = trainer_and_sampler(random_model(), 1.0)
    gen = torch.Generator().manual_seed(0)
    sampler = sampler + torch.randn(len(sampler), generator=gen, dtype=torch.float64) * 0.6
    sampler[::17] = float("nan")
    ours = correction_weights(trainer, sampler, mode, 2.0, lambda x: mb.sequence_sums(x)[mb.seq_ids])
    # TRL's layout: one row per reply, right-padded
    lengths = torch.bincount(mb.seq_ids, minlength=mb.num_sequences).tolist()
    width = max(lengths)
    pad = lambda x: torch.stack([torch.nn.functional.pad(piece, (0, width - len(piece)))  # noqa: E731
                                 for piece in x.split(lengths)])
    mask = torch.stack([torch.arange(width) < n for n in lengths]).long()
    theirs = trl_correction(pad(trainer), pad(sampler), mask, mode, 2.0)
    theirs = theirs.expand(-1, width)[mask.bool()]
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    capped = (theirs == 0).any() if mode.endswith("mask") else (theirs == 2.0).any()
    assert capped and (theirs != 1).any()  # the cap acted, and not everywhere
