"""train_sft.py end to end, as users launch it: plain python and torchrun (gloo on CPU).

Each run is a subprocess with log_interval=1, so metrics.jsonl has every step's exact loss. Tolerances:
float32 throughout; different micro-batch splits or world sizes only change the order in which token losses
and gradients are summed (~1e-7 relative per addition), so losses agree to 1e-5 relative and parameters
after a few AdamW steps to 1e-4 absolute (Adam divides by sqrt(v), which can magnify a rounding-level
difference on a parameter whose gradient is near zero, but not past that).
"""

import json
import os

import pytest
import torch

from conftest import as_args, builtin_data, checkpoint_weights, run_script


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "builtin", "sft", n_train=400, n_val=40)


def run(args, nproc=1, check=True):
    return run_script("train_sft.py", args, nproc, check)


def common_args(out_dir, data, **kw):
    cfg = dict(out_dir=out_dir, data=data, preset="tiny", batch_size=16, microbatch_tokens=2048, max_iters=4,
               learning_rate=1e-2, warmup_iters=0, log_interval=1, eval_interval=0, eval_examples=0, seed=7)
    cfg.update(kw)
    return as_args(**cfg)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [m["loss"] for m in map(json.loads, f) if "loss" in m]


params = checkpoint_weights


def assert_same_run(a, b, param_atol=1e-4):
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert x == pytest.approx(y, rel=1e-5)
    pa, pb = params(a), params(b)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=param_atol, rtol=0, msg=lambda m: f"{k}: {m}")


def test_accumulation_equals_one_big_batch(tmp_path, sft_data):
    one = str(tmp_path / "one")
    many = str(tmp_path / "many")
    run(common_args(one, sft_data, microbatch_tokens=4096))
    run(common_args(many, sft_data, microbatch_tokens=256))
    assert_same_run(one, many)
    # and the small budget really did split each step into several micro-batches
    from data.prepare import load
    from packing import PackedLoader
    data, _ = load(sft_data, "train")
    assert len(next(PackedLoader(data, 16, 256, seed=7)).microbatches) >= 4


@pytest.mark.slow
def test_sequence_loss_weighting_is_exact_under_accumulation(tmp_path, sft_data):
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    run(common_args(one, sft_data, microbatch_tokens=4096, loss_weighting="sequence"))
    run(common_args(many, sft_data, microbatch_tokens=256, loss_weighting="sequence"))
    assert_same_run(one, many)
    tok = str(tmp_path / "tok")
    run(common_args(tok, sft_data, microbatch_tokens=4096))
    assert losses(tok)[1] != pytest.approx(losses(one)[1], rel=1e-5)  # the option does change the objective
    # and the logged loss is the mean over examples of each example's mean token loss (the initial weights at iter 1)
    from data.prepare import load
    from model import Transformer, config_from_preset
    from packing import PackedLoader, make_batch
    data, _ = load(sft_data, "train")
    torch.manual_seed(7)
    model = Transformer(config_from_preset("tiny", vocab_size=261))
    per_example = []
    for e in next(PackedLoader(data, 16, 4096, seed=7)).microbatches[0].units.tolist():
        mb = make_batch(data, [e])
        with torch.no_grad():
            loss_sum, n = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, targets=mb.targets)
        per_example.append((loss_sum / n).item())
    assert losses(one)[0] == pytest.approx(sum(per_example) / len(per_example), rel=1e-5)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, sft_data, parallel):
    single, dist2 = str(tmp_path / "single"), str(tmp_path / "dist")
    run(common_args(single, sft_data, microbatch_tokens=512))
    run(common_args(dist2, sft_data, microbatch_tokens=512, parallel=parallel), nproc=2)
    assert_same_run(single, dist2)


def test_resume_continues_exactly(tmp_path, sft_data):
    # constant learning rate, so a run cut at iteration 3 and resumed to 6 has the same schedule as one run of 6
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    run(common_args(straight, sft_data, max_iters=6, min_lr=1e-2, microbatch_tokens=512))
    run(common_args(cut, sft_data, max_iters=3, min_lr=1e-2, microbatch_tokens=512))
    run(common_args(cut, sft_data, max_iters=6, min_lr=1e-2, microbatch_tokens=512, init_from="resume"))
    assert_same_run(straight, cut, param_atol=0)  # same ops in the same order: bit for bit


@pytest.mark.slow
def test_default_run_learns_and_exports(tmp_path):
    """The default command, shortened: the toy model on the built-in data; loss falls clearly, and the
    exported Hugging Face folder loads in transformers with the same logits."""
    out_dir = str(tmp_path / "run")
    out = run([f"--out_dir={out_dir}", "--max_iters=30", "--log_interval=10", "--eval_examples=10"])
    ls = losses(out_dir)
    assert ls[-1] < 0.5 * ls[0], ls
    assert "val accuracy" in out.stdout and "done: checkpoint" in out.stdout
    with open(os.path.join(out_dir, "hf", "config.json")) as f:  # what generation tools stop on
        exported = json.load(f)
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (256, 260)
    transformers = pytest.importorskip("transformers")
    from nanopack.hf import from_pretrained
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "hf")).float().eval()
    ours = from_pretrained(os.path.join(out_dir, "hf")).eval()
    ids = torch.randint(0, 260, (40,))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids[None]).logits[0], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arg, message", [
    ("--learning_rat=0.1", "unknown config key 'learning_rat'"),
    ("--batch_size=lots", "batch_size='lots' is of type str, but batch_size must be of type int"),
    ("--init_from=/no/such/folder", "init_from='/no/such/folder'; it is neither"),
    ("--init_from=resume", "does not exist"),
])
def test_config_errors_are_one_clear_message(tmp_path, arg, message):
    out = run([f"--out_dir={tmp_path}", arg], check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr  # one message, not a stack trace
