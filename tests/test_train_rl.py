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
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import kernels
import model as M
from conftest import ROOT, as_args, checkpoint_weights, run_script, step_metrics
from losses import dpo_loss, group_advantages, policy_loss
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


@pytest.mark.parametrize("model_kw", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [2, 3, 8])
def test_grpo_and_online_dpo_losses_equal_each_reply_alone(monkeypatch, k, shape, model_kw):
    """The token-level GRPO loss (a second update: ratios away from 1, some clipped; KL to a reference) and the
    online-DPO loss of (best, worst), with every parameter gradient, on the shared layout and on each sequence alone."""
    monkeypatch.setattr(kernels, "LOSS_CHUNK", 5)
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=VOCAB, **model_kw))
    prompts, replies, _ = make_groups(shape, k)
    data = group_data(prompts, replies)
    rewards = torch.randint(0, 3, (3, k)).double()
    if shape == "replies that begin alike":  # replies 0 and 1 are the same reply: the same reward
        rewards[:, 1] = rewards[:, 0]
    advantages = group_advantages(rewards).flatten().float()
    n_tokens = int(sum(len(r) for group in replies for r in group))
    groups = [2, 0, 1]
    alone_old = [x.detach() + 0.3 * torch.randn_like(x) for x in token_logps_alone(net, data)]  # the sampler's
    alone_ref = [x.detach() + 0.1 * torch.randn_like(x) for x in alone_old]

    def grpo_alone():
        logps = token_logps_alone(net, data)
        return sum(policy_loss(lp, old, advantages[i], 0.2, ref, 0.05).sum()
                   for i, (lp, old, ref) in enumerate(zip(logps, alone_old, alone_ref))) / n_tokens

    def grpo_packed(prefix):
        mb = make_batch(data, groups, group_size=k, prefix=prefix)
        seqs = (mb.units[:, None] * k + torch.arange(k)).flatten()  # the batch's sequences, in batch order
        old, ref = torch.cat([alone_old[s] for s in seqs]), torch.cat([alone_ref[s] for s in seqs])
        logps = net(**mb.inputs(), logprobs=True)
        return policy_loss(logps, old, advantages[seqs][mb.seq_ids], 0.2, ref, 0.05).sum() / n_tokens

    best, worst = rewards.argmax(1), rewards.argmin(1)
    pair_ref = torch.randn(3, 2)

    def online_dpo(sums):  # sums (3, k) in data order
        rows = torch.arange(3)
        losses, _, _ = dpo_loss(sums[rows, best], sums[rows, worst], pair_ref[:, 0], pair_ref[:, 1], None, None,
                                "sigmoid", 0.5)
        return losses.sum()

    def grads(loss):
        net.zero_grad()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters()}

    assert any((torch.exp(a - b) - 1).abs().max() > 0.2 for a, b in zip(token_logps_alone(net, data), alone_old))
    expected = grads(grpo_alone())
    for prefix in (shared_prefixes(data, k), None):
        assert_close_runs(grads(grpo_packed(prefix)), expected)
        mb = make_batch(data, groups, group_size=k, prefix=prefix)
        sums = mb.group_sums(net(**mb.inputs(), logprobs=True), k)[torch.tensor(groups).argsort()]
        alone = torch.stack([lp.sum() for lp in token_logps_alone(net, data)]).view(3, k)
        assert_close_runs(grads(online_dpo(sums)), grads(online_dpo(alone)))


def test_group_advantages_and_the_policy_loss():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 0.0]])
    adv = group_advantages(rewards)
    for g in range(3):
        r = rewards[g]
        want = (r - r.mean()) / r.std() if r.std() > 0 else torch.zeros(4)  # torch's std: unbiased, as TRL's
        torch.testing.assert_close(adv[g], want)
    logps = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    a = torch.tensor([1.0, -1.0, 2.0])
    first = policy_loss(logps, logps.detach(), a, 0.2)  # a batch's first update: the ratio is 1
    torch.testing.assert_close(first, -a)
    first.sum().backward()
    torch.testing.assert_close(logps.grad, -a)  # REINFORCE: -A d logp
    old = logps.detach() - torch.tensor([0.5, 0.5, -0.5])  # ratios e^0.5 (beyond 1.2) and e^-0.5 (below 0.8)
    clipped = policy_loss(logps.detach(), old, a, 0.2)  # the pessimistic side: clipped only where it gains
    torch.testing.assert_close(clipped, -torch.tensor([1.2, -np.exp(0.5), 2 * np.exp(-0.5)]).float())
    ref = logps.detach() + 0.3
    kl = policy_loss(logps.detach(), logps.detach(), torch.zeros(3), 0.2, ref, 2.0)
    torch.testing.assert_close(kl, torch.full((3,), 2.0 * (np.exp(0.3) - 0.3 - 1)).float())


# ---- the script ---------------------------------------------------------------------------------------------------
REWARD = "tests.rl_rewards:distinct_characters"


def args(out_dir, **kw):
    # a high constant learning rate, so that steps differ; a second update per batch (ratio clipping) and a KL term
    # (a live reference) so that every part of the loss is in every comparison
    cfg = dict(out_dir=out_dir, init_from="scratch", preset="tiny", reward=REWARD, k=4, prompts_per_step=6,
               max_new_tokens=6, max_iters=3, learning_rate=3e-3, min_lr=3e-3, warmup_iters=0, kl_coef=0.05,
               updates_per_batch=2, microbatch_tokens=4096, eval_interval=0, eval_examples=0, seed=7)
    cfg.update(kw)
    return as_args(**cfg)


def run(a, nproc=1, check=True):
    return run_script("train_rl.py", a, nproc, check)


def assert_same_run(a, b, exact=False):
    sa, sb = step_metrics(a), step_metrics(b)
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa, sb):
        assert (x["reward_mean"], x["groups_trained"], x["reply_tokens"]) == (
            y["reward_mean"], y["groups_trained"], y["reply_tokens"])  # the same samples
        for key in ("loss", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=0 if exact else 1e-5, abs=0 if exact else 1e-6), key
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


def test_microbatch_split_and_no_sharing_equal_the_baseline(tmp_path, baseline):
    split = str(tmp_path / "split")
    run(args(split, microbatch_tokens=240))  # one or two groups per micro-batch
    assert_same_run(baseline, split)
    whole = str(tmp_path / "whole")
    run(args(whole, prefix_sharing=False))
    assert_same_run(baseline, whole)
    assert step_metrics(whole)[0]["tokens"] == step_metrics(whole)[0]["tokens_unshared"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, baseline, parallel):
    out_dir = str(tmp_path / parallel)
    run(args(out_dir, parallel=parallel, microbatch_tokens=240), nproc=2)  # 6 prompts: 3 per rank, fillers too
    assert_same_run(baseline, out_dir)


def test_sigterm_saves_and_resume_equals_the_straight_run(tmp_path, baseline):
    cut = str(tmp_path / "cut")
    proc = subprocess.Popen([sys.executable, "train_rl.py", *args(cut, max_iters=3)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    log, deadline = os.path.join(cut, "metrics.jsonl"), time.time() + 120
    while not (os.path.exists(log) and os.path.getsize(log) > 0) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-2000:]  # 143: not done
    assert "stopped by SIGTERM after iter" in stdout
    assert len(step_metrics(cut)) < 3
    run([f"--out_dir={cut}", "--init_from=resume"])
    assert_same_run(baseline, cut, exact=True)  # the same samples and the same ops in the same order


def test_online_dpo_starts_at_log_2_and_learns_the_reward(tmp_path):
    out_dir = str(tmp_path / "odpo")
    run(args(out_dir, loss="online_dpo", kl_coef=0.0, updates_per_batch=1, beta=1.0, max_iters=6))
    s = step_metrics(out_dir)
    assert s[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # the policy is the reference at step 1
    assert s[-1]["loss"] < s[0]["loss"]


@pytest.mark.parametrize("reward, message", [
    ("tests.rl_rewards:raises", "reward tests.rl_rewards:raises raised ZeroDivisionError"),
    ("tests.rl_rewards:nan", "reward tests.rl_rewards:nan returned nan for prompt builtin:train:"),
    ("tests.rl_rewards:as_string", "reward tests.rl_rewards:as_string returned '1' (a str) for prompt builtin:train:"),
    ("no_such_module:f", "reward='no_such_module:f': No module named 'no_such_module'"),
])
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
def test_a_group_that_cannot_fit_names_only_what_helps(tmp_path, kw, hint):
    """Too many positions for the model is not helped by a larger micro-batch or context parallelism: only what can
    help is suggested."""
    out = run(args(str(tmp_path), **kw), check=False)
    assert out.returncode != 0 and hint in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


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
    from hf import save_pretrained
    from tokenizer import get_tokenizer
    folder = str(tmp_path / "dpo_hf")
    torch.manual_seed(0)
    save_pretrained(M.Transformer(M.config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)), folder)
    out = run([f"--out_dir={tmp_path / 'rl'}", f"--init_from={folder}", "--max_iters=2", "--eval_examples=4",
               "--prompts_per_step=2", "--k=2"])
    assert "held-out, greedy: exact-match accuracy" in out.stdout and "(before RL -> after)" in out.stdout
    assert os.path.exists(os.path.join(tmp_path, "rl", "hf", "model.safetensors"))


def test_a_diverged_run_stops_non_zero_with_no_export(tmp_path):
    """The reported case: lr=1e6 makes every update non-finite, while steps whose groups all tie (nothing to train)
    come between them; they must not reset the count of non-finite updates in a row."""
    out_dir = str(tmp_path / "run")
    out = run(args(out_dir, reward="tests.rl_rewards:many_characters", k=2, prompts_per_step=1, learning_rate=1e6,
                   min_lr=0.0, warmup_iters=5, kl_coef=0.0, updates_per_batch=1, max_iters=12, eval_examples=4,
                   seed=1337), check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "stopping: 3 steps in a row had a non-finite loss or gradient norm" in out.stderr
    s = step_metrics(out_dir)
    first_bad = next(i for i, m in enumerate(s) if m["skipped_steps"])
    assert any(m["groups_trained"] == 0 for m in s[first_bad:]), "the case needs a step with nothing to train"
    assert len(s) < 12 and not os.path.exists(os.path.join(out_dir, "hf"))  # stopped early, nothing exported
