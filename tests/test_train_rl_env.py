"""Multi-turn RL (train_rl.py --env / --tools): trajectories from the engine, each turn reading only the observation
into its reply's live KV cache; the trained tokens are the trajectory as sampled plus the observations as rendered,
observations with no loss and exactly zero gradient, the sampler's log-probs equal to the trainer's; the script with
an environment takes the same steps with prefix sharing off, split micro-batches, DDP x2 and FSDP2 x2, and a resumed
run equals the straight one; an environment that raises is one line naming it, the record and the turn.

A random model never stops, and a reply that does not stop ends its trajectory: stopping_folder's tiny model gives
its stop token ~15% at every position (a shared direction added to every embedding, the stop token's head row along
it), so trajectories take several turns. tests/rl_envs.py's Chatty rewards each reply's distinct characters."""
import math
import os
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import model as M
from conftest import run_script, step_metrics, stop_after_first_step
from nanopack.env import Multiturn, observation_ids
from nanopack.generate import generate
from nanopack.hf import save_pretrained
from nanopack.rollout import Rollouts, sampled_tokens
from nanopack.tokenizer import get_tokenizer
from packing import IGNORE_INDEX, group_data, make_batch
from test_train_rl import args, assert_same_run

CHATTY = "tests.rl_envs:Chatty"


def stopping_model(p_stop=0.15):
    """A tiny random model whose stop token has probability ~p_stop at every position."""
    tok = get_tokenizer("byte")
    torch.manual_seed(0)
    net = M.Transformer(M.config_from_preset("tiny", vocab_size=tok.vocab_size))
    with torch.no_grad():
        emb = net.embed_tokens.weight
        c = torch.randn(emb.shape[1])
        emb += 4 * emb.norm(dim=1).mean() * c / c.norm()  # every residual stream shares a direction
        h = net.hidden_states(torch.randint(0, tok.vocab_size, (512,)))
        u = h.mean(0) / h.mean(0).norm()
        logit = math.log(p_stop * (tok.vocab_size - 1) / (1 - p_stop))
        net.head_weight()[tok.eos_id] = u * logit / (h @ u).median()
    return net, tok


@pytest.fixture(scope="module")
def stopping_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("stopping") / "hf")
    save_pretrained(stopping_model()[0], folder)
    return folder


def env_args(out_dir, folder, **kw):
    cfg = dict(init_from=folder, env=CHATTY, max_turns=3, max_new_tokens=60, k=3)
    cfg.update(kw)
    return args(out_dir, **cfg)


def run(a, nproc=1, check=True):
    return run_script("train_rl.py", a, nproc, check)


def test_trajectories_train_as_sampled(tmp_path):
    """Rollouts.play on the real engine: each later turn's reply is what generating afresh from the trajectory so far
    gives (greedy: the live cache equals a fresh read), observations are the template's render; packed for training,
    each sequence is prompt + trajectory token for token, trained exactly on the sampled tokens, the observations'
    rows get exactly zero gradient, and the sampler's log-probs equal the trainer's (float32, one model: 1e-4)."""
    net, tok = stopping_model()
    net.eval()
    config = dict(max_new_tokens=60, top_p=1.0, seed=3, k=2, temperature=1.0)
    run_ = SimpleNamespace(autocast=nullcontext(), device=torch.device("cpu"), cp=SimpleNamespace(rank=0))
    rollouts = Rollouts(run_, config, [], None, net, net, tok, False, Multiturn(CHATTY, None, 3))
    messages = [[dict(role="user", content="What is 2+3?")], [dict(role="user", content="Hi.")]]
    prompts = [(tok.render_prompt(m), m, {}, f"record {i}") for i, m in enumerate(messages)]
    trajectories = rollouts.play(prompts, [0, 1], 1, 0.0)
    assert max(t.turns for t in trajectories) > 1 and all(t.observation_tokens for t in trajectories if t.turns > 1)
    for t, (prompt, m, _, _) in zip(trajectories, prompts):
        mask, history, i = np.array(t.mask), list(m), 0
        while i < len(t.ids):  # turn by turn: a reply, then its observation
            end = i + int(np.argmin(np.append(mask[i:], 0)))
            reply = t.ids[i:end]
            assert reply == generate(net, [prompt + t.ids[:i]], 60 - i, tok.stop_ids)[0]
            if end < len(t.ids):
                obs = t.ids[end:end + int(np.argmax(np.append(mask[end:], 1)))]
                text = tok.decode_reply(reply)
                assert obs == observation_ids(tok, history, text, [dict(role="user", content="More.")])[0]
                history += [dict(role="assistant", content=text), dict(role="user", content="More.")]
                end += len(obs)
            i = end
    masks, cut = sampled_tokens(trajectories, trajectories, tok.stop_ids)
    assert cut == [t.truncated for t in trajectories]
    data = group_data([p[0] for p in prompts], [[t.ids] for t in trajectories], [[m] for m in masks])
    for j, (t, p) in enumerate(zip(trajectories, prompts)):
        a, b = data["offsets"][j], data["offsets"][j + 1]
        assert data["ids"][a:b].tolist() == p[0] + t.ids
        assert data["loss_mask"][a:b].tolist() == [0] * len(p[0]) + t.mask
    mb = make_batch(data, np.arange(2), 1)
    h = net.hidden_states(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen).detach().requires_grad_()
    logps = torch.log_softmax(torch.nn.functional.linear(h, net.head_weight()).float()[:, :tok.vocab_size], -1)
    trained = mb.targets != IGNORE_INDEX
    assert trained.sum().item() == sum(t.mask.count(1) for t in trajectories)
    token_logps = logps[trained].gather(1, mb.targets[trained][:, None])[:, 0]
    token_logps.sum().backward()
    # a row predicts the next token: the rows before observation tokens (and the prompts') are never trained
    assert (h.grad[~trained] == 0).all() and (h.grad[trained].abs().sum(1) > 0).all()
    sampler = [x for t in trajectories for x, m in zip(t.logprobs, t.mask) if m]
    assert all(math.isnan(x) for t in trajectories for x, m in zip(t.logprobs, t.mask) if not m)
    torch.testing.assert_close(token_logps.detach(), torch.tensor(sampler), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def env_baseline(tmp_path_factory, stopping_folder):
    out_dir = str(tmp_path_factory.mktemp("rl_env_baseline"))
    out = run(env_args(out_dir, stopping_folder))
    s = step_metrics(out_dir)
    assert all(m["groups_trained"] > 0 for m in s), out.stdout[-2000:]
    assert all(m["turns_mean"] > 1.2 and m["observation_tokens_mean"] > 0 for m in s), s
    assert "turns " in out.stdout and "observations " in out.stdout
    return out_dir


@pytest.mark.slow
def test_env_runs_split_unshared_and_two_processes_equal_one(tmp_path, env_baseline, stopping_folder):
    for name, kw, nproc in [("split", dict(microbatch_tokens=400), 1), ("whole", dict(prefix_sharing=False), 1),
                            ("ddp", dict(parallel="ddp", microbatch_tokens=400), 2),
                            ("fsdp", dict(parallel="fsdp", microbatch_tokens=400), 2)]:
        out_dir = str(tmp_path / name)
        run(env_args(out_dir, stopping_folder, **kw), nproc=nproc)
        print(name)  # which one, if the next line fails
        # the stopping model's activations are ~4x a random model's (its embedding offset): float32 sums in another
        # order differ by ~6e-6 relative in the first step's gradient norm, ~2e-5 after an update at lr 3e-3
        assert_same_run(env_baseline, out_dir, rel=1e-4)


@pytest.mark.slow
def test_env_sigterm_and_resume_equal_the_straight_run(tmp_path, env_baseline, stopping_folder):
    cut = str(tmp_path / "cut")
    stdout = stop_after_first_step([sys.executable, "train_rl.py", *env_args(cut, stopping_folder)], cut)
    assert "stopped by SIGTERM after iter" in stdout
    run([f"--out_dir={cut}", "--init_from=resume"])
    assert_same_run(env_baseline, cut, exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("env, message", [
    ("tests.rl_envs:BrokenAtTurn2", "env BrokenAtTurn2.step raised KeyError: 'score' (builtin:train:"),
    ("tests.rl_envs:NeedsField", "env tests.rl_envs:NeedsField(**fields) raised TypeError:"),
    ("tests.rl_envs:Nope", "env='tests.rl_envs:Nope'"),
])
def test_a_broken_environment_is_one_line_and_nothing_is_saved(tmp_path, stopping_folder, env, message):
    out = run(env_args(str(tmp_path), stopping_folder, env=env, max_iters=1), check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert not os.path.exists(os.path.join(tmp_path, "ckpt.pt"))


@pytest.mark.parametrize("extra, message", [
    (["--env=builtin", "--tools=tests.rl_envs:Chatty"], "tools are the environment ToolEnv; choose one"),
    (["--max_turns=3"], "max_turns=3 does nothing without env or tools"),
    (["--env=builtin", "--loss=online_dpo"], "env='builtin' does nothing with loss='online_dpo'"),
])
def test_multiturn_keys_that_do_nothing_or_clash_are_refused(tmp_path, extra, message):
    out = run([f"--out_dir={tmp_path}", "--init_from=scratch", *extra], check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
