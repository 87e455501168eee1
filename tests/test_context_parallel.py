"""Context parallelism (context.py): a CP group's ranks each compute a slice of one micro-batch's token stream.

The slices, checked in one process: every row of the stream lands on exactly one rank with its token, RoPE position
and target; every query sees exactly the keys it sees unsplit (the Megatron / LLaMA-Factory bug class: positions or
keys of the wrong sequence); the stream is padded by fewer than cp rows; the head-tail split balances attention.
The computation, under torchrun with gloo (tests/context_check.py): loss, per-sequence sums and every gradient equal
one process. The scripts: train_sft.py, train_dpo.py and train_rl.py with --context_parallel=2 take one process's
steps, resume across CP degrees, and train a sequence (a pair, a group) one GPU's microbatch_tokens refuses.
"""
import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT, as_args, run_script, step_metrics
from nanopack.context import ContextParallel
from context_check import MODELS, RL, SFT, SHARED, batch
from nanopack.hf import SafetensorsFolder
from packing import make_batch
from test_lora_train import args as lora_args, assert_same_run as assert_same_lora_run
from test_train_dpo import assert_same_run as assert_same_dpo_run, common_args as dpo_args, pairs  # noqa: F401
from test_train_rl import args as rl_args, assert_same_run as assert_same_rl_run
from test_train_sft import assert_same_run


def slices(mb, size):
    """Every rank's slice of mb, its input_ids replaced by row + 1 (0: padding) so that a slice names its rows."""
    tagged = replace(mb, input_ids=torch.arange(1, mb.input_ids.numel() + 1))
    return [ContextParallel(size, r).split(tagged) for r in range(size)]


def visible_keys(mb):
    """For each row of an unsplit batch, the rows it attends to (bottom-right causal over its segment's keys)."""
    cu = mb.cu_seqlens.tolist()
    kv_index, cu_k = (torch.arange(cu[-1]), cu) if mb.kv is None else (mb.kv[0], mb.kv[1].tolist())
    out = {}
    for i in range(len(cu) - 1):
        q_len, k_len = cu[i + 1] - cu[i], cu_k[i + 1] - cu_k[i]
        for j in range(q_len):
            out[cu[i] + j] = kv_index[cu_k[i]:cu_k[i] + k_len - q_len + j + 1].tolist()
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("case", [c for c in list(SFT) + list(SHARED) if c != "filler"])
def test_slices_carry_rows_positions_targets_and_keys(case, size):
    mb = batch(case, seed=0)
    parts = slices(mb, size)
    T, T_local = mb.input_ids.numel(), parts[0].input_ids.numel()
    assert all(p.input_ids.numel() == T_local for p in parts) and T_local == -(-T // size)  # padding < size rows
    gathered = torch.cat([p.input_ids for p in parts]) - 1  # gathered row -> unsplit row (-1: padding)
    assert sorted(gathered[gathered >= 0].tolist()) == list(range(T))  # every row once
    assert sum(p.num_tokens for p in parts) == mb.num_tokens and sum(p.num_padding for p in parts) == size * T_local - T
    want_keys, triples, n_targets = visible_keys(mb), set(), 0
    for p in parts:
        rows = p.input_ids - 1
        real = rows >= 0
        assert torch.equal(p.position_ids[real], mb.position_ids[rows[real]])  # RoPE positions are the unsplit ones
        if mb.target_rows is None:
            assert torch.equal(p.targets[real], mb.targets[rows[real]])
            assert torch.equal(p.seq_ids[real], mb.seq_ids[rows[real]])
        else:
            triples |= set(zip(rows[p.target_rows].tolist(), p.targets.tolist(), p.seq_ids.tolist()))
        n_targets += p.num_target_tokens
        cu, cu_k = p.cu_seqlens.tolist(), p.kv[1].tolist()
        for i in range(len(cu) - 1 - (p.num_padding > 0)):  # the padding's segment is last
            q_len, keys = cu[i + 1] - cu[i], gathered[p.kv[0][cu_k[i]:cu_k[i + 1]]]
            for j in range(q_len):  # bottom-right: query j of the piece sees its first len(keys) - q_len + j + 1 keys
                assert keys[:len(keys) - q_len + j + 1].tolist() == want_keys[int(rows[cu[i] + j])]
    if mb.target_rows is not None:
        assert triples == set(zip(mb.target_rows.tolist(), mb.targets.tolist(), mb.seq_ids.tolist()))
    assert n_targets == mb.num_target_tokens


def attention_work(mb):
    """(query, key) pairs a slice scores: sum over its query segments of Lq (2 Lk - Lq + 1) / 2."""
    q, k = np.diff(mb.cu_seqlens.numpy()), np.diff(mb.kv[1].numpy())
    return float((q * (2 * k - q + 1) / 2).sum())


@pytest.mark.parametrize("size", [2, 4, 8])
def test_head_tail_split_balances_attention(size):
    """One 4096-token sequence: a contiguous split gives the last rank (2 size - 1) / size times the mean attention
    work (1.75 at cp=4); head-tail chunks leave each rank within 1% of the mean (rounding of chunk lengths)."""
    data = dict(ids=np.zeros(4096, np.int64), loss_mask=np.ones(4096, np.uint8), offsets=np.array([0, 4096]))
    work = [attention_work(p) for p in slices(make_batch(data, [0]), size)]
    assert sum(work) == 4096 * 4097 / 2 and max(work) / np.mean(work) < 1.01, work


def launch(nproc, size, cases):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          os.path.join(ROOT, "tests", "context_check.py"), str(size), *cases],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nproc,size", [(2, 2), (4, 4), (4, 2)], ids=["cp2", "cp4", "dp2xcp2"])
def test_context_parallel_equals_one_process(nproc, size):
    """Loss, per-sequence log-prob sums and every gradient, each case on four models (GQA, sliding window, MHA with
    biases, activation checkpointing), the GRPO family's aggregations and ratio levels among them: see
    tests/context_check.py for the tolerances."""
    cases = list(SFT) + list(SHARED) + list(RL)
    stdout = launch(nproc, size, cases)
    assert stdout.count("ok ") == len(MODELS) * len(cases), stdout


# ---- train_sft.py end to end ----------------------------------------------------------------------------------------

def long_chats(path, n=24, seed=0):
    """Chats of 40-900 tokens (byte tokenizer): the longest do not fit microbatch_tokens=512, all fit 1024."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = lambda n_words: " ".join(rng.choice(words, n_words))
    with open(path, "w") as f:
        for i in range(n):
            n_words = int(rng.integers(5, 140)) if i % 3 else int(rng.integers(90, 140))
            f.write(json.dumps(dict(messages=[dict(role="user", content=text(n_words // 4)),
                                              dict(role="assistant", content=text(n_words))])) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return long_chats(tmp_path_factory.mktemp("chats") / "long.jsonl")


def sft_args(out_dir, data, **kw):
    cfg = dict(out_dir=out_dir, data=data, preset="tiny", batch_size=6, microbatch_tokens=1024, max_iters=4,
               learning_rate=1e-2, min_lr=1e-2, warmup_iters=0, log_interval=1, eval_interval=2, eval_examples=0,
               val_fraction=0.2, seed=3)
    cfg.update(kw)
    return as_args(**cfg)


@pytest.mark.slow
def test_sft_context_parallel_equals_one_process(tmp_path, chats):
    """A sequence longer than microbatch_tokens is refused in one line that names --context_parallel; with it, two
    ranks of 512 tokens take the steps one process of 1024 takes: losses, val losses, tokens counted once, weights."""
    refused = run_script("train_sft.py", sft_args(str(tmp_path / "no"), chats, microbatch_tokens=512), check=False)
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0 and "more than microbatch_tokens=512" in line and "--context_parallel=2" in line
    one, cp = str(tmp_path / "one"), str(tmp_path / "cp")
    run_script("train_sft.py", sft_args(one, chats))
    run_script("train_sft.py", sft_args(cp, chats, microbatch_tokens=512, context_parallel=2), nproc=2)
    assert_same_run(one, cp)
    a, b = step_metrics(one), step_metrics(cp)
    assert [m["tokens"] for m in a] == [m["tokens"] for m in b]
    val = lambda d: [m["val_loss"] for m in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "val_loss" in m]
    assert len(val(one)) == 2 and val(one) == pytest.approx(val(cp), rel=1e-5)
    x, y = SafetensorsFolder(os.path.join(one, "hf")), SafetensorsFolder(os.path.join(cp, "hf"))
    for key in x.keys():
        torch.testing.assert_close(x.read(key), y.read(key), atol=1e-4, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.slow
def test_sft_resumes_across_context_parallel_degrees(tmp_path, chats):
    """Cut at iter 2 under cp=2 (FSDP2) and resumed in one process, and the reverse: the straight run's steps."""
    straight = str(tmp_path / "straight")
    run_script("train_sft.py", sft_args(straight, chats))
    cp2 = dict(microbatch_tokens=512, context_parallel=2, parallel="fsdp")
    one = dict(microbatch_tokens=1024, context_parallel=1)
    for name, first, then in (("cp_then_one", cp2, one), ("one_then_cp", one, cp2)):
        out_dir = str(tmp_path / name)
        run_script("train_sft.py", sft_args(out_dir, chats, max_iters=2, **first), nproc=first["context_parallel"])
        run_script("train_sft.py", as_args(out_dir=out_dir, init_from="resume", max_iters=4, **then),
                   nproc=then["context_parallel"])
        assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 3, 4]
        assert_same_run(straight, out_dir)


# ---- train_dpo.py and train_rl.py end to end ------------------------------------------------------------------------

def evaluations(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" not in m]


@pytest.mark.slow
def test_dpo_context_parallel_equals_one_process(tmp_path, pairs):
    """A pair longer than microbatch_tokens is refused in one line naming --context_parallel; with it, two ranks take
    one process's steps (tolerances: test_train_dpo.py), with a pair's prompt shared (reference cached: the cache and
    the val loss computed under CP) and laid out whole (reference live, FSDP2)."""
    refused = run_script("train_dpo.py", dpo_args(str(tmp_path / "no"), pairs, microbatch_tokens=128), check=False)
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0 and "more than microbatch_tokens=128" in line and "--context_parallel=2" in line
    one = str(tmp_path / "one")
    run_script("train_dpo.py", dpo_args(one, pairs))
    cached = lambda d: [np.load(os.path.join(d, "reference", f))
                        for f in sorted(os.listdir(os.path.join(d, "reference"))) if f.endswith(".npy")]
    for name, kw in (("shared", dict(microbatch_tokens=128)),  # pairs of up to 219 tokens, their prompt once
                     ("whole", dict(microbatch_tokens=256, prefix_sharing=False, reference="live", parallel="fsdp"))):
        out_dir = str(tmp_path / name)
        run_script("train_dpo.py", dpo_args(out_dir, pairs, context_parallel=2, **kw), nproc=2)
        assert_same_dpo_run(one, out_dir)
        a, b = evaluations(one), evaluations(out_dir)
        assert len(a) == len(b) == 2
        for x, y in zip(a, b):  # val loss, reward accuracy and margin over the val split, at iter 0 and at the end
            assert x == pytest.approx(y, rel=1e-5, abs=1e-6), name
    for x, y in zip(cached(one), cached(str(tmp_path / "shared"))):  # the reference log-probs, train and val
        np.testing.assert_allclose(x, y, rtol=1e-5)


@pytest.mark.slow
def test_dpo_resumes_from_context_parallel_into_one_process(tmp_path, pairs):
    """LoRA, so that the reference is the policy with its adapters off: cut at iter 2 under cp=2, resumed in one
    process, the straight one-process run's steps and adapters (tolerances: test_lora_train.py)."""
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    lr = dict(learning_rate=1e-3, min_lr=1e-3)
    run_script("train_dpo.py", lora_args(straight, pairs, **lr))
    run_script("train_dpo.py", lora_args(cut, pairs, max_iters=2, microbatch_tokens=128, context_parallel=2, **lr),
               nproc=2)
    out = run_script("train_dpo.py", as_args(out_dir=cut, init_from="resume", max_iters=4, microbatch_tokens=4096,
                                             context_parallel=1))
    assert "reference adapters_off" in out.stdout
    assert [m["iter"] for m in step_metrics(cut)] == [1, 2, 3, 4]
    assert_same_lora_run(straight, cut)


@pytest.mark.slow
@pytest.mark.parametrize("loss, parallel", [("grpo", "ddp"), ("online_dpo", "fsdp")])
def test_rl_context_parallel_equals_one_process(tmp_path, loss, parallel):
    """A group (prompt once, k replies) longer than microbatch_tokens is refused naming --context_parallel; with it,
    two ranks (generating the same replies, training on slices) take one process's steps: GRPO's reply mean with a
    ratio per reply (its sums over the group), a second update and a KL term to a live reference; online DPO (best and worst reply, their prompt shared) cut at iter 2 and
    resumed in one process."""
    kw = dict(loss=loss) if loss == "grpo" else dict(loss=loss, updates_per_batch=1, beta=1.0)
    if loss == "grpo":
        refused = run_script("train_rl.py", rl_args(str(tmp_path / "no"), microbatch_tokens=120), check=False)
        line = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode != 0 and "microbatch_tokens=120" in line and "--context_parallel=2" in line
    one, cp = str(tmp_path / "one"), str(tmp_path / "cp")
    run_script("train_rl.py", rl_args(one, **kw))
    cut = dict(max_iters=2) if loss == "online_dpo" else {}
    run_script("train_rl.py", rl_args(cp, microbatch_tokens=120, context_parallel=2, parallel=parallel, **kw, **cut),
               nproc=2)
    if cut:
        run_script("train_rl.py", as_args(out_dir=cp, init_from="resume", max_iters=3, microbatch_tokens=4096,
                                          context_parallel=1))
    assert_same_rl_run(one, cp)
    assert [m["tokens"] for m in step_metrics(one)] == [m["tokens"] for m in step_metrics(cp)]  # counted once
