"""train_rl.py: GRPO's and online DPO's losses and gradients on the shared group layout equal each reply alone; the
script as users launch it (python and torchrun, gloo on CPU): micro-batch split, DDP x2 and FSDP2 x2 take the steps of
one process, prefix_sharing=False the same, resume equals the straight run bit for bit, SIGTERM saves, and a reward
function that raises, returns NaN or text or cannot be found is one line naming it, with nothing saved (rewards.py
alone: tests/test_rewards.py).

The script runs use a scratch model, whose built-in answers are all wrong (every reward 0, nothing to learn), with
tests/rl_rewards.py's reward: how many distinct characters a reply has, which differs between sampled replies. Replies
are drawn from per-reply generators seeded by (seed, step, prompt, reply), so every way of running samples the same
replies; tolerances as in test_train_dpo.py (float32, only the order of sums differs).
"""
import json
import os
import sys

import numpy as np
import pytest
import torch

from nanopack import kernels
import model as M
from conftest import as_args, checkpoint_weights, run_script, step_metrics, stop_after_first_step
from losses import dpo_loss, group_advantages, loss_weights, policy_loss
from packing import group_data, make_batch, shared_prefixes
from test_groups import MODELS, SHAPES, assert_close_runs, make_groups

VOCAB = 300


def token_logps_alone(net, data):
    """Each sequence alone, full logits: the log-prob of each of its trained tokens, concatenated in data order."""
    out = []
    for s, t in zip(data["offsets"][:-1], data["offsets"][1:]):
        ids = torch.from_numpy(data["ids"][s:t].astype(np.int64))
        logp = torch.log_softmax(net(ids).float(), -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
        out.append(logp[torch.from_numpy(data["loss_mask"][s + 1:t] != 0)])
    return out


# (loss_aggregation, importance_sampling_level, clip_mode) and each reply's loss written out: the paper's formula
OBJECTIVES = {
    "dapo: token mean, token ratios": ("token_mean", "token", "ppo"),
    "gspo: reply mean, a ratio per reply": ("reply_mean", "sequence", "ppo"),
    "dr_grpo + cispo: constant": ("constant", "token", "cispo"),
}
CLIP_LOW, CLIP_HIGH, KL, MAX_NEW = 0.2, 0.28, 0.05, 30


def reply_loss(objective, logp, old, ref, advantage):
    """One reply's summed loss as the papers write it (KL's k3 estimate per token), before the step's normaliser."""
    aggregation, level, mode = OBJECTIVES[objective]
    kl = KL * (torch.exp(ref - logp) - (ref - logp) - 1)
    if level == "sequence":  # GSPO: s = exp(mean log-ratio), -min(s A, clip(s) A) on each token
        s = torch.exp((logp - old).mean())
        policy = -torch.min(s * advantage, s.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * advantage) * torch.ones_like(logp)
    elif mode == "cispo":  # MiniMax-M1: -sg(clip(r)) A log p
        policy = -torch.exp(logp - old).clamp(1 - CLIP_LOW, 1 + CLIP_HIGH).detach() * advantage * logp
    else:
        r = torch.exp(logp - old)
        policy = -torch.min(r * advantage, r.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * advantage)
    total = (policy + kl).sum()
    return total / len(logp) if aggregation == "reply_mean" else total


@pytest.mark.parametrize("model_kw", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [2, 3, 8])
def test_policy_losses_and_online_dpo_equal_each_reply_alone(monkeypatch, k, shape, model_kw):
    """The GRPO family's aggregations, ratio levels and clip modes (a second update: ratios away from 1, some clipped;
    KL to a reference) and the online-DPO loss of (best, worst), with every parameter gradient, on the shared layout
    and laid out whole, against each sequence alone."""
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 5)
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB, **model_kw))
    prompts, replies, _ = make_groups(shape, k)
    data = group_data(prompts, replies)
    rewards = torch.randint(0, 3, (3, k)).double()
    if shape == "replies that begin alike":  # replies 0 and 1 are the same reply: the same reward
        rewards[:, 1] = rewards[:, 0]
    advantages = group_advantages(rewards).flatten().float()
    groups = [2, 0, 1]
    alone_logps = token_logps_alone(net, data)  # forward once: each objective backpropagates through it (retained)
    alone_old = [x.detach() + 0.3 * torch.randn_like(x) for x in alone_logps]  # the sampler's
    lengths = torch.tensor([float(len(x)) for x in alone_old])  # trained tokens: a lone reply's first is none
    alone_ref = [x.detach() + 0.1 * torch.randn_like(x) for x in alone_old]
    normaliser = dict(token_mean=lengths.sum(), reply_mean=len(lengths), constant=len(lengths) * MAX_NEW)
    batches = {name: make_batch(data, groups, group_size=k, prefix=prefix)
               for name, prefix in (("shared", shared_prefixes(data, k)), ("whole", None))}
    packed_logps = {name: net(**mb.inputs(), logprobs=True) for name, mb in batches.items()}

    def alone(objective):
        total = sum(reply_loss(objective, lp, old, ref, advantages[i])
                    for i, (lp, old, ref) in enumerate(zip(alone_logps, alone_old, alone_ref)))
        return total / normaliser[OBJECTIVES[objective][0]]

    def packed(objective, name):
        aggregation, level, mode = OBJECTIVES[objective]
        mb = batches[name]
        seqs = (mb.units[:, None] * k + torch.arange(k)).flatten()  # the batch's sequences, in batch order
        old, ref = torch.cat([alone_old[s] for s in seqs]), torch.cat([alone_ref[s] for s in seqs])
        weights = loss_weights(lengths, aggregation, normaliser[aggregation])
        return policy_loss(packed_logps[name], old, mb.seq_ids, advantages[seqs], weights[seqs], lengths[seqs],
                           CLIP_LOW, CLIP_HIGH, mode, mb.sequence_sums if level == "sequence" else None, ref, KL)[0]

    best, worst = rewards.argmax(1), rewards.argmin(1)
    pair_ref = torch.randn(3, 2)

    def online_dpo(sums):  # sums (3, k) in data order
        rows = torch.arange(3)
        losses, _, _ = dpo_loss(sums[rows, best], sums[rows, worst], pair_ref[:, 0], pair_ref[:, 1], None, None,
                                "sigmoid", 0.5)
        return losses.sum()

    def grads(loss):
        net.zero_grad()
        loss.backward(retain_graph=True)
        return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters()}

    assert any((torch.exp(a - b) - 1).abs().max() > 0.2 for a, b in zip(alone_logps, alone_old))
    alone_sums = torch.stack([lp.sum() for lp in alone_logps]).view(3, k)
    for objective in OBJECTIVES:
        expected = grads(alone(objective))
        for name in batches:
            assert_close_runs(grads(packed(objective, name)), expected)
    for name, mb in batches.items():
        sums = mb.group_sums(packed_logps[name], k)[torch.tensor(groups).argsort()]
        assert_close_runs(grads(online_dpo(sums)), grads(online_dpo(alone_sums)))


# ---- the script ---------------------------------------------------------------------------------------------------
REWARD = "tests.rl_rewards:distinct_characters"


def args(out_dir, **kw):
    # a high constant learning rate, so that steps differ; a second update per batch (ratio clipping) and a KL term
    # (a live reference) so that every part of the loss is in every comparison; DAPO (token mean, dynamic sampling)
    # with a ratio per reply (its sums over a CP group) and the step's reward std (over all ranks); replies kept whole
    # (a scratch model stops few replies by max_new_tokens)
    cfg = dict(out_dir=out_dir, init_from="scratch", preset="tiny", reward=REWARD, k=4, prompts_per_step=6,
               max_new_tokens=6, max_iters=3, learning_rate=3e-3, min_lr=3e-3, warmup_iters=0, kl_coef=0.05,
               updates_per_batch=2, microbatch_tokens=4096, eval_interval=0, eval_examples=0, seed=7, loss="dapo",
               importance_sampling_level="sequence", scale_rewards="batch", mask_truncated=False)
    if kw.get("loss") == "online_dpo":  # the GRPO family's keys: set explicitly, a config error
        for key in ("kl_coef", "importance_sampling_level", "scale_rewards"):
            del cfg[key]
    cfg.update(kw)
    return as_args(**cfg)


def run(a, nproc=1, check=True):
    return run_script("train_rl.py", a, nproc, check)


def assert_same_run(a, b, exact=False, rel=1e-5):
    sa, sb = step_metrics(a), step_metrics(b)
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa, sb):
        assert (x["reward_mean"], x["groups_trained"], x["reply_tokens"]) == (
            y["reward_mean"], y["groups_trained"], y["reply_tokens"])  # the same samples
        for key in ("loss", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=0 if exact else rel, abs=0 if exact else 1e-6), key
    pa, pb = checkpoint_weights(a), checkpoint_weights(b)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=0 if exact else 1e-3, rtol=0)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("rl_baseline"))
    out = run(args(out_dir))
    s = step_metrics(out_dir)
    assert all(m["groups_trained"] == 6 and m["reward_std"] > 0 for m in s), out.stdout[-2000:]
    assert s[0]["tokens"] < s[0]["tokens_unshared"]  # each prompt computed once
    return out_dir


@pytest.mark.slow
def test_microbatch_split_and_no_sharing_equal_the_baseline(tmp_path, baseline):
    split = str(tmp_path / "split")
    run(args(split, microbatch_tokens=240))  # one or two groups per micro-batch
    assert_same_run(baseline, split)
    whole = str(tmp_path / "whole")
    run(args(whole, prefix_sharing=False))
    assert_same_run(baseline, whole)
    assert step_metrics(whole)[0]["tokens"] == step_metrics(whole)[0]["tokens_unshared"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, baseline, parallel):
    out_dir = str(tmp_path / parallel)
    run(args(out_dir, parallel=parallel, microbatch_tokens=240), nproc=2)  # 6 prompts: 3 per rank, fillers too
    assert_same_run(baseline, out_dir)


@pytest.mark.slow
def test_sigterm_saves_and_resume_equals_the_straight_run(tmp_path, baseline):
    cut = str(tmp_path / "cut")
    stdout = stop_after_first_step([sys.executable, "train_rl.py", *args(cut, max_iters=3)], cut)
    assert "stopped by SIGTERM after iter" in stdout
    assert len(step_metrics(cut)) < 3
    run([f"--out_dir={cut}", "--init_from=resume"])
    assert_same_run(baseline, cut, exact=True)  # the same samples and the same ops in the same order


@pytest.mark.slow
def test_online_dpo_starts_at_log_2_and_learns_its_pairs(tmp_path):
    """The policy is the reference at the first update: log 2; the third update on the same pairs prefers the
    chosen replies (the logged loss is the step's last update's). The loss of a later step, on fresh pairs, is noise
    at this size (step 6 of seeds 7-9: 0.38-0.84; over 16 steps it falls to 0.13-0.46 as the reward rises)."""
    losses = []
    for updates in (1, 3):
        out_dir = str(tmp_path / f"odpo{updates}")
        run(args(out_dir, loss="online_dpo", updates_per_batch=updates, beta=1.0, max_iters=1))
        losses.append(step_metrics(out_dir)[0]["loss"])
    assert losses[0] == pytest.approx(np.log(2), abs=1e-5)
    assert losses[1] < np.log(2) - 0.01, losses


@pytest.mark.parametrize("reward, message", [
    ("tests.rl_rewards:raises", "reward tests.rl_rewards:raises raised ZeroDivisionError"),
    ("tests.rl_rewards:nan", "reward tests.rl_rewards:nan returned nan for prompt builtin:train:"),
    ("tests.rl_rewards:as_string", "reward tests.rl_rewards:as_string returned '1' (a str) for prompt builtin:train:"),
    ("no_such_module:f", "reward='no_such_module:f': No module named 'no_such_module'"),
])
@pytest.mark.slow
def test_a_bad_reward_is_one_line_and_nothing_is_saved(tmp_path, reward, message):
    out = run(args(str(tmp_path), reward=reward), check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(tmp_path, "ckpt.pt"))


@pytest.mark.parametrize("kw, hint", [
    (dict(max_new_tokens=2000, microbatch_tokens=40000), "positions (microbatch_tokens=40000, max_seq_len=2048); "
                                                         "lower max_new_tokens"),
    (dict(microbatch_tokens=64), "raise microbatch_tokens, split it over GPUs with --context_parallel="),
])
@pytest.mark.slow
def test_a_group_that_cannot_fit_names_only_what_helps(tmp_path, kw, hint):
    """Too many positions for the model is not helped by a larger micro-batch or context parallelism: only what can
    help is suggested."""
    out = run(args(str(tmp_path), **kw), check=False)
    assert out.returncode != 0 and hint in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_prompt_records_and_their_fields_reach_several_weighted_rewards(tmp_path):
    """Each reward gets the fields it takes (contains_target: `target` only, not `id` or `answer`), the total is the
    weighted sum of the rewards, each logged; an SFT file is refused before the model loads."""
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Say hi", "target": "hi", "id": 1, "answer": "#### 2"},
             {"messages": [{"role": "user", "content": "Say yo"}], "target": "yo", "id": 2, "answer": 3}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out_dir = str(tmp_path / "run")
    names = ["tests.rl_rewards:contains_target", "tests.rl_rewards:distinct_characters", "math"]
    out = run(args(out_dir, data=path, val_data=path, reward=",".join(names), reward_weights="1,0.5,2", max_iters=1,
                   eval_examples=2, prompts_per_step=2))
    assert "2 train prompts" in out.stdout and "2 held-out prompts" in out.stdout
    assert "(before RL -> after)" in out.stdout
    (step,) = step_metrics(out_dir)
    each = [step[f"rewards/{name}/mean"] for name in names]
    assert each[1] > 0 and step["reward_mean"] == pytest.approx(each[0] + 0.5 * each[1] + 2 * each[2], rel=1e-12)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    out = run(args(str(tmp_path / "bad"), data=path), check=False)
    assert out.returncode != 0 and "prompts.jsonl:1 is SFT data but train_rl.py trains RL" in out.stderr


def test_default_flow_from_a_dpo_folder(tmp_path):
    """The workshop's third command, shortened: a Hugging Face folder as train_dpo.py leaves it (a tiny random model),
    the built-in hard split and reward, held-out accuracy before and after, an exported folder."""
    from nanopack.hf import save_pretrained
    from nanopack.tokenizer import get_tokenizer
    folder = str(tmp_path / "dpo_hf")
    torch.manual_seed(0)
    save_pretrained(M.Transformer(M.config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)), folder)
    out = run([f"--out_dir={tmp_path / 'rl'}", f"--init_from={folder}", "--max_iters=2", "--eval_examples=4",
               "--prompts_per_step=2", "--k=2"])
    assert "held-out, greedy: exact-match accuracy" in out.stdout and "(before RL -> after)" in out.stdout
    assert os.path.exists(os.path.join(tmp_path, "rl", "hf", "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_a_run_whose_rewards_never_differ_says_it_trained_nothing(tmp_path, loss):
    """The reported case (issue 40, finding 24): a scratch model gets every built-in answer wrong, so every group's
    rewards are equal. Each step's line and the end say that nothing was trained; dynamic sampling (dapo) samples its
    extra rounds, counted, and then trains what it has (nothing) instead of sampling forever."""
    out_dir = str(tmp_path / "run")
    out = run(args(out_dir, reward="builtin", loss=loss, importance_sampling_level="token", kl_coef=0.0,
                   max_iters=2, max_extra_rounds=1))
    assert out.stdout.count("every group's rewards were equal, nothing learned") == 2, out.stdout[-3000:]
    assert "groups trained: 0 of " in out.stdout and "warning: no group's rewards ever differed" in out.stderr
    assert "UserWarning" not in out.stderr  # no std taken of no group
    s = step_metrics(out_dir)
    rounds = 2 if loss == "dapo" else 1
    assert [(m["groups_trained"], m["groups_sampled"], m["sampling_rounds"], m["loss"]) for m in s] == [
        (0, 6 * rounds, rounds, 0.0)] * 2
    if loss == "dapo":
        assert "(2 rounds; max_extra_rounds reached)" in out.stdout


@pytest.mark.slow
def test_dynamic_sampling_fills_the_step_with_groups_that_teach(tmp_path):
    """k = 2 replies and a reward of 0 or 1 (tests/rl_rewards.py:many_characters): many groups tie. Each step samples
    rounds until it holds prompts_per_step groups whose rewards differ, the first in the prompt stream whatever the
    world size (DDP x2 each scoring its share), and a resume continues the stream where the straight run is (a step
    may use more than prompts_per_step prompts)."""
    cfg = dict(reward="tests.rl_rewards:many_characters", k=2, kl_coef=0.0, importance_sampling_level="token",
               max_iters=3, max_extra_rounds=8)
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    run(args(straight, **cfg))
    s = step_metrics(straight)
    assert all(m["groups_trained"] == 6 for m in s) and any(m["sampling_rounds"] > 1 for m in s)
    assert all(m["groups_sampled"] == 6 * m["sampling_rounds"] for m in s)
    run(args(cut, **dict(cfg, max_iters=2)), nproc=2)
    run([f"--out_dir={cut}", "--init_from=resume", "--max_iters=3"])
    assert_same_run(straight, cut)


@pytest.mark.slow
def test_truncated_replies_leave_the_loss(tmp_path):
    """max_new_tokens=2: a scratch model stops almost no reply so soon. Masked (DAPO's overlong filtering), a step
    whose replies are all cut has nothing to train (gradient 0); unmasked it trains on them."""
    # seed 8: all 24 replies cut (seed 7 stops one of them at its 2nd token)
    cfg = dict(loss="grpo", kl_coef=0.0, updates_per_batch=1, max_new_tokens=2, max_iters=1, seed=8)
    masked, kept = str(tmp_path / "masked"), str(tmp_path / "kept")
    run(args(masked, **cfg, mask_truncated=True))
    run(args(kept, **cfg, mask_truncated=False))
    a, b = step_metrics(masked)[0], step_metrics(kept)[0]
    assert a["truncated"] == b["truncated"] == 1.0 and a["reply_tokens_max"] == 2
    assert a["grad_norm"] == 0.0 and b["grad_norm"] > 0


@pytest.mark.slow
def test_a_diverged_run_stops_non_zero_with_no_export(tmp_path):
    """The reported case: lr=1e6 makes every update non-finite, while steps whose groups all tie (nothing to train)
    come between them; they must not reset the count of non-finite updates in a row."""
    out_dir = str(tmp_path / "run")
    out = run(args(out_dir, reward="tests.rl_rewards:many_characters", k=2, prompts_per_step=1, learning_rate=1e6,
                   min_lr=0.0, warmup_iters=5, kl_coef=0.0, updates_per_batch=1, max_iters=12, eval_examples=4,
                   seed=3, dynamic_sampling=False), check=False)  # steps that tie stay in the run
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "stopping: 3 steps in a row had a non-finite loss or gradient norm" in out.stderr
    s = step_metrics(out_dir)
    first_bad = next(i for i, m in enumerate(s) if m["skipped_steps"])
    assert any(m["groups_trained"] == 0 for m in s[first_bad:]), "the case needs a step with nothing to train"
    assert len(s) < 12 and not os.path.exists(os.path.join(out_dir, "hf"))  # stopped early, nothing exported


@pytest.mark.slow
def test_the_reference_is_scored_at_the_sampling_temperature(tmp_path):
    """The reported case (issue 51): replies sampled at temperature 0.7 are scored at 0.7, the
    policy and the reference alike (as TRL), so at the first update, the policy being the
    reference, the KL term is 0: the step's loss with kl_coef equals the one without. A reference
    scored at 1 moves it by 2e-3 here (a scratch model's logits are nearly flat); scored alike,
    what is left of the loss cancels to 1e-8: 1e-5 tells them apart."""
    cfg = dict(loss="grpo", temperature=0.7, updates_per_batch=1, max_iters=1)
    with_kl, without = str(tmp_path / "kl"), str(tmp_path / "no_kl")
    run(args(with_kl, **cfg, kl_coef=1.0))
    run(args(without, **cfg, kl_coef=0.0))
    a, b = step_metrics(with_kl)[0], step_metrics(without)[0]
    assert a["groups_trained"] > 0 and a["sampled_nll"] == b["sampled_nll"]
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


@pytest.mark.slow
def test_a_large_reward_offset_keeps_the_batch_std(tmp_path):
    """The reported case (issue 51): scale_rewards='batch' on rewards offset by 1e8, whose one-pass
    variance (sum of squares less the squared sum) cancelled to 0: advantages ~5,000x TRL's. An
    offset changes neither the advantages nor the logged reward_std: the run is the plain one's."""
    plain, offset = str(tmp_path / "plain"), str(tmp_path / "offset")
    run(args(plain, max_iters=2))
    run(args(offset, max_iters=2, reward="tests.rl_rewards:distinct_characters_1e8"))
    for a, b in zip(step_metrics(plain), step_metrics(offset), strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"] + 1e8, abs=1e-6)
        # float64 holds 1e8 + r to 1.5e-8, so the centred rewards and their std to ~1e-8
        # relative; the loss and gradient, float32, to 1e-6: 1e-5 holds a margin
        assert b["reward_std"] == pytest.approx(a["reward_std"], rel=1e-6)
        assert (b["loss"], b["grad_norm"]) == pytest.approx((a["loss"], a["grad_norm"]), rel=1e-5)
