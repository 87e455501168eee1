"""train_dpo.py end to end, as users launch it: plain python and torchrun (gloo on CPU).

Each run is a subprocess with log_interval=1, so metrics.jsonl has every step's exact means. Tolerances as in
test_train_sft.py: float32 throughout; different micro-batch splits, world sizes or reference modes only change the
order in which the same numbers are summed (~1e-7 relative per addition), so step means agree to 1e-5 relative and
parameters after a few AdamW steps to 1e-4 absolute.
"""

import json
import math
import os
import shutil

import pytest
import torch

from conftest import as_args, builtin_data, checkpoint_weights, run_script, step_metrics

STEP_METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
                "logps_rejected")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "pairs", "dpo", n_train=96, n_val=16)


def run(args, nproc=1, check=True):
    return run_script("train_dpo.py", args, nproc, check)


def common_args(out_dir, data, **kw):
    # A high learning rate and beta so that a few steps move the rewards well away from zero; a constant learning
    # rate so that a run cut short and resumed has the same schedule as one straight run; label smoothing and an
    # SFT term so that both of their normalisations are checked too.
    cfg = dict(out_dir=out_dir, data=data, init_from="scratch", preset="tiny", batch_size=16, microbatch_tokens=8192,
               max_iters=5, learning_rate=1e-2, min_lr=1e-2, warmup_iters=0, beta=1.0, label_smoothing=0.1,
               sft_weight=0.5, log_interval=1, eval_interval=0, eval_examples=0, seed=7)
    cfg.update(kw)
    return as_args(**cfg)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pairs):
    """One process, one micro-batch per step, cached reference: what every other way of running must equal."""
    out_dir = str(tmp_path_factory.mktemp("baseline"))
    out = run(common_args(out_dir, pairs))
    assert "saved as" in out.stdout  # the reference log-probs were computed and written
    assert abs(steps(out_dir)[-1]["rewards_chosen"]) > 1e-2  # the policy has moved away from the reference
    return out_dir


steps, params = step_metrics, checkpoint_weights


def assert_same_run(a, b, exact=False):
    """Every step's means and gradient norm agree: the sharp check that each step's gradient is the one-big-batch
    gradient. Tolerance 1e-5 relative, and 1e-6 of the log-prob sums in absolute terms: rewards and losses are
    differences of float32 sums of ~-50 whose rounding (~1e-7 relative per addition, summed in another order)
    is ~1e-6 of the sums, which is large next to a small margin. Parameters after 5 AdamW steps to 1e-3
    absolute only: Adam's first steps move each parameter by about lr (1e-2) whatever the size of its gradient,
    so a parameter whose gradient is rounding noise can drift by a good part of lr between two correct runs.
    reward_accuracy counts pairs: at step 1 the policy is the reference, every margin is 0 up to rounding, and
    which side of 0 it falls on depends on how the forward was packed: step 1's accuracy is not compared."""
    sa, sb = steps(a), steps(b)
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa, sb):
        scale = abs(x["logps_chosen"]) + abs(x["logps_rejected"])
        for key in STEP_METRICS + ("grad_norm",):
            tol = dict(rel=0, abs=0) if exact else dict(rel=1e-5, abs=1e-6 * scale)
            if key == "reward_accuracy" and x["iter"] == 1 and not exact:
                continue
            assert x[key] == pytest.approx(y[key], **tol), (key, x["iter"])
    pa, pb = params(a), params(b)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=0 if exact else 1e-3, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
def test_accumulation_equals_one_big_batch(tmp_path, pairs, baseline):
    many = str(tmp_path / "many")
    run(common_args(many, pairs, microbatch_tokens=512))
    assert_same_run(baseline, many)
    from data.prepare import load
    from packing import PackedLoader
    data, _ = load(pairs, "train")
    assert len(next(PackedLoader(data, 16, 512, seed=7, group_size=2)).microbatches) >= 4  # really several


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, pairs, baseline, parallel):
    # 1024 tokens per micro-batch: each rank packs its share into a few micro-batches, not always as many as the
    # other rank, so the filler micro-batches are exercised too
    dist2 = str(tmp_path / "dist")
    run(common_args(dist2, pairs, microbatch_tokens=1024, parallel=parallel), nproc=2)
    assert_same_run(baseline, dist2)


def test_prefix_sharing_equals_whole_pairs(tmp_path, pairs, baseline):
    """The baseline computes each pair's shared prompt once (prefix_sharing, the default); laying out both
    sequences whole gives the same steps (reference cache included), with more tokens computed per step."""
    whole = str(tmp_path / "whole")
    out = run(common_args(whole, pairs, prefix_sharing=False))
    assert "prefix sharing" not in out.stdout
    assert_same_run(baseline, whole)
    assert steps(whole)[0]["tokens"] > steps(baseline)[0]["tokens"]


@pytest.mark.slow
def test_cached_reference_equals_live(tmp_path, pairs, baseline):
    live = str(tmp_path / "live")
    run(common_args(live, pairs, reference="live"))
    assert not os.path.exists(os.path.join(live, "reference"))  # live mode keeps nothing on disk
    # the cache came from differently packed forwards (bigger bins) than the live reference: rounding only
    assert_same_run(baseline, live)


@pytest.mark.slow
def test_cache_is_reused_and_keyed_by_the_weights(tmp_path, pairs, baseline):
    out_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(baseline, "reference"), os.path.join(out_dir, "reference"))
    again = run(common_args(out_dir, pairs))
    assert "reference log-probs: loaded" in again.stdout
    assert_same_run(baseline, out_dir, exact=True)  # the same numbers, read back from disk
    other = run(common_args(out_dir, pairs, max_iters=1, seed=8, overwrite=True))  # scratch weights from another seed: another key
    assert "saved as" in other.stdout
    assert len([f for f in os.listdir(os.path.join(out_dir, "reference")) if f.endswith(".json")]) == 2
    assert steps(out_dir)[0]["ref_cache_seconds"] > 0


# the SFT term stays: it composes with every loss. A third of the baseline's rate: at 1e-2 bco_pair's rewards swing
# by +-10 a step and its steps amplify rounding (1e-7) past the tolerance within 3 steps
BCO = dict(loss_type="bco_pair", label_smoothing=0.0, learning_rate=3e-3, min_lr=3e-3)


@pytest.fixture(scope="module")
def bco_baseline(tmp_path_factory, pairs):
    """The baseline's run with bco_pair, whose reward shift (the mean of the rewards of the steps so far) moves."""
    out_dir = str(tmp_path_factory.mktemp("bco_baseline"))
    run(common_args(out_dir, pairs, **BCO))
    shifts = [m["reward_shift"] for m in steps(out_dir)]
    assert shifts[0] == pytest.approx(0, abs=1e-5) and abs(shifts[-2]) > 0.1  # step 5 used step 4's: far from 0
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("kw, nproc", [
    (dict(microbatch_tokens=512, parallel="ddp"), 2),  # ranks and, on each, several micro-batches
    (dict(microbatch_tokens=1024, parallel="fsdp"), 2),
    (dict(microbatch_tokens=128, context_parallel=2), 2),  # a CP group's two ranks hold the same pairs
], ids=["ddp", "fsdp", "cp"])
def test_bco_pair_shift_is_one_value_on_every_rank(tmp_path, pairs, bco_baseline, kw, nproc):
    """bco_pair's shift comes from the rewards of whole steps, summed over ranks: every rank uses the one value, and
    the steps equal one process's with one micro-batch per step."""
    out_dir = str(tmp_path / "bco")
    run(common_args(out_dir, pairs, **BCO, **kw), nproc=nproc)
    assert_same_run(bco_baseline, out_dir)
    for x, y in zip(steps(bco_baseline), steps(out_dir)):  # the same tolerance as the rewards it averages
        assert x["reward_shift"] == pytest.approx(y["reward_shift"], rel=1e-5, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "bco_pair"])
def test_resume_continues_exactly(tmp_path, pairs, request, loss):
    """bco_pair: its running mean of the rewards is saved with the checkpoint and read back, or the resumed steps
    would shift the rewards by another value."""
    kw, straight = (BCO, request.getfixturevalue("bco_baseline")) if loss == "bco_pair" else (
        {}, request.getfixturevalue("baseline"))
    cut = str(tmp_path / "cut")
    run(common_args(cut, pairs, max_iters=2, **kw))
    out = run(common_args(cut, pairs, init_from="resume", **kw))
    assert "reference log-probs: loaded" in out.stdout  # the cache is read back, not recomputed
    assert_same_run(straight, cut, exact=True)  # same ops in the same order: bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, label_smoothing, first_loss", [
    ("ipo", 0.0, (0.0 - 1 / (2 * 1.0)) ** 2),  # the policy is the reference at step 1: h = 0
    ("simpo", 0.0, None),  # reference-free: no cache at all
    ("apo_zero", 0.0, 1.0),  # (1 - sigmoid(0)) + sigmoid(0)
    ("robust", 0.1, math.log(2)),  # (0.9 - 0.1) log 2 / (1 - 0.2)
    ("bco_pair", 0.0, 2 * math.log(2)),  # no steps before the first: shift 0
])
def test_other_loss_types_run(tmp_path, pairs, loss_type, label_smoothing, first_loss):
    out_dir = str(tmp_path / loss_type)
    out = run(common_args(out_dir, pairs, loss_type=loss_type, max_iters=2, label_smoothing=label_smoothing,
                          sft_weight=0.0))
    s = steps(out_dir)
    if first_loss is not None:
        assert s[0]["loss"] == pytest.approx(first_loss, abs=1e-5)
    else:  # no reference: nothing computed up front, and a reward is beta * the mean log-prob per token, below 0
        assert "saved as" not in out.stdout and not os.path.exists(os.path.join(out_dir, "reference"))
        assert s[0]["rewards_chosen"] < 0 and s[0]["rewards_rejected"] < 0
    assert all(m["loss"] == pytest.approx(m["loss"]) for m in s)  # finite


@pytest.mark.slow
def test_default_flow_from_an_sft_folder(tmp_path):
    """The workshop flow, shortened: a Hugging Face folder as train_sft.py leaves it (here a tiny random model),
    then train_dpo.py on the built-in pairs, printing held-out accuracy before and after and exporting a folder."""
    from nanopack.hf import save_pretrained
    from model import Transformer, config_from_preset
    from nanopack.tokenizer import get_tokenizer
    sft = str(tmp_path / "sft_hf")
    torch.manual_seed(0)
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)), sft)
    out_dir = str(tmp_path / "dpo")
    out = run([f"--out_dir={out_dir}", f"--init_from={sft}", "--max_iters=2", "--log_interval=1", "--eval_examples=4"])
    assert "before DPO ->" in out.stdout and "done: checkpoint" in out.stdout, out.stdout[-2000:]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if "val_accuracy" in m]
    assert [m["iter"] for m in evals] == [0, 2] and "val_reward_accuracy" in evals[0]
    assert os.path.exists(os.path.join(out_dir, "hf", "model.safetensors"))


BAD_LINES = {
    "chosen and rejected are identical": {"prompt": "What is 2+2?", "chosen": "4", "rejected": "4"},
    "empty assistant turn": {"prompt": "What is 2+2?", "chosen": "", "rejected": "5"},
    "expected 'messages' (SFT) or 'chosen' and 'rejected'": {"prompt": "What is 2+2?", "chosen": "4"},
}


@pytest.mark.slow
@pytest.mark.parametrize("message", list(BAD_LINES))
def test_bad_preference_data_is_one_clear_message(tmp_path, message):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(BAD_LINES[message]) + "\n")
    out = run([f"--out_dir={tmp_path / 'run'}", "--init_from=scratch", "--preset=tiny", f"--data={path}"], check=False)
    assert out.returncode != 0
    assert "bad.jsonl:2: " in out.stderr and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arg, message", [
    ("--init_from=/no/such/folder", "make the default one with `python train_sft.py`"),
    # a config's pair: the reported case named the default command, not the pair's
    ("config/dpo_qwen2.5_0.5b.py",
     "make this one with `python train_sft.py config/sft_qwen2.5_0.5b.py`"),
    ("--loss_type=kto", "loss_type='kto'; choose one of sigmoid, ipo, hinge, dpo_norm, simpo, apo_zero, robust, "
                        "bco_pair"),
    ("--loss_type=bco_pair --label_smoothing=0.1", "label_smoothing=0.1; it must be 0 for loss_type='bco_pair'"),
    # gamma is SimPO's alone: set with another loss it was accepted and changed nothing
    ("--gamma=1.0", "gamma=1.0 does nothing with loss_type='sigmoid': only loss_type 'simpo' reads it"),
])
def test_config_errors_are_one_clear_message(tmp_path, arg, message):
    out = run([f"--out_dir={tmp_path}", *arg.split()], check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
