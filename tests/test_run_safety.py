"""Never lose a run: what a user sees when something goes wrong, for both training scripts.

A NaN step is skipped and never reaches a checkpoint; a resumed run continues with its own config; a fresh run
does not overwrite one; SIGTERM saves and exits cleanly and the resumed run equals the straight one, bit for bit
(the same ops in the same order); every bad setting is one `config error:` line before any work is done.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, as_args, builtin_data, checkpoint_weights, run_script, step_metrics

SFT = dict(preset="tiny", batch_size=16, microbatch_tokens=2048, max_iters=4, warmup_iters=0, log_interval=1,
           eval_interval=0, eval_examples=0, seed=7)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "builtin", "sft", n_train=400, n_val=40)


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "pairs", "dpo", n_train=64, n_val=8)


metrics, weights = step_metrics, checkpoint_weights


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_sft.py", "train_dpo.py"])
def test_nan_steps_are_skipped_and_never_saved(tmp_path, sft_data, dpo_data, script):
    """The reported case: a learning rate that blows the weights up, eval_interval not a multiple of log_interval."""
    out_dir = str(tmp_path / "run")
    cfg = dict(SFT, out_dir=out_dir, data=sft_data if script == "train_sft.py" else dpo_data, learning_rate=1e30,
               max_iters=20, log_interval=10, eval_interval=3)
    if script == "train_dpo.py":
        cfg.update(init_from="scratch", batch_size=8)
    out = run_script(script, as_args(**cfg), check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "update skipped, weights unchanged (3 in a row" in out.stdout
    assert "stopping: 3 steps in a row had a non-finite loss or gradient norm" in out.stderr
    if os.path.exists(os.path.join(out_dir, "ckpt.pt")):  # written at iter 3 only if weights and val loss were finite
        assert all(torch.isfinite(t).all() for t in weights(out_dir).values())
        assert "NOT written" not in out.stdout
    else:
        assert "not finite: checkpoint NOT written" in out.stdout
    assert not os.path.exists(os.path.join(out_dir, "hf"))  # no export from a run that stopped this way


@pytest.mark.slow
def test_sigterm_saves_and_resume_with_only_init_from_equals_the_straight_run(tmp_path, sft_data):
    # non-default values the resumed run can only know from the checkpoint: lr, schedule, logging, weighting
    cfg = dict(SFT, data=sft_data, max_iters=60, learning_rate=3e-3, min_lr=1e-4, warmup_iters=5,
               loss_weighting="sequence", microbatch_tokens=512)
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    run_script("train_sft.py", as_args(**cfg, out_dir=straight))

    proc = subprocess.Popen([sys.executable, "train_sft.py", *as_args(**cfg, out_dir=cut)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = os.path.join(cut, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(log) and os.path.getsize(log) > 0) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-2000:]  # 143: not done
    assert "stopped by SIGTERM after iter" in stdout and "continue with --init_from=resume" in stdout
    stopped_at = len(metrics(cut))
    assert 1 <= stopped_at < 60

    out = run_script("train_sft.py", [f"--out_dir={cut}", "--init_from=resume"])
    assert "resume: overriding" not in out.stdout
    a, b = metrics(straight), metrics(cut)
    assert [m["iter"] for m in b] == list(range(1, 61))  # appended to, never truncated
    for x, y in zip(a, b):
        assert (x["iter"], x["loss"], x["grad_norm"], x["lr"]) == (y["iter"], y["loss"], y["grad_norm"], y["lr"])
    for k, t in weights(straight).items():
        assert torch.equal(t, weights(cut)[k]), k


@pytest.mark.slow
def test_resume_restores_the_config_and_names_what_changes(tmp_path, sft_data):
    out_dir = str(tmp_path / "run")
    run_script("train_sft.py", as_args(**dict(SFT, out_dir=out_dir, data=sft_data, learning_rate=1e-3, max_iters=2)))
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3",
                                      "--learning_rate=2e-3"])
    assert "resume: overriding max_iters 2 -> 3" in out.stdout
    assert "resume: overriding learning_rate 0.001 -> 0.002" in out.stdout
    from nanopack.run import lr_at
    assert metrics(out_dir)[-1]["lr"] == pytest.approx(lr_at(2, 3, 2e-3, 5e-4, 0), rel=1e-9)  # and trains with it
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--batch_size=8"], check=False)
    assert out.returncode != 0 and "batch_size=8 differs from the run being resumed (batch_size=16)" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_fresh_run_does_not_overwrite_a_run(tmp_path, sft_data):
    out_dir = str(tmp_path / "run")
    run_script("train_sft.py", as_args(**dict(SFT, out_dir=out_dir, data=sft_data, max_iters=2)))
    before = [open(os.path.join(out_dir, f), "rb").read() for f in ("ckpt.pt", "metrics.jsonl")]
    out = run_script("train_sft.py", as_args(**SFT, out_dir=out_dir, data=sft_data), check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "already holds a run (ckpt.pt); continue it with --init_from=resume" in out.stderr
    assert before == [open(os.path.join(out_dir, f), "rb").read() for f in ("ckpt.pt", "metrics.jsonl")]
    run_script("train_sft.py", as_args(**dict(SFT, out_dir=out_dir, data=sft_data, max_iters=1, overwrite=True)))
    assert [m["iter"] for m in metrics(out_dir)] == [1]  # started over: a fresh log


@pytest.mark.slow
def test_an_empty_val_split_says_so(tmp_path):
    path = tmp_path / "chats.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text((json.dumps(line) + "\n") * 20)
    out_dir = str(tmp_path / "run")
    out = run_script("train_sft.py", as_args(**dict(SFT, out_dir=out_dir, data=str(path), max_iters=2, val_fraction=0.0)))
    assert "has no val examples: evaluation reports no val loss" in out.stdout
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        assert "val loss 0" not in out.stdout and "val_loss" not in f.read()


def long_example_jsonl(tmp_path, n_chars):
    path = tmp_path / "long.jsonl"
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    long = {"messages": [{"role": "user", "content": "x" * n_chars}, {"role": "assistant", "content": "ok"}]}
    path.write_text("\n".join(json.dumps(r) for r in [short, long, short]) + "\n")
    return str(path)


def model_folder(tmp_path, damage):
    """A real-looking Hugging Face folder of the tiny preset, damaged one way."""
    from nanopack.hf import save_pretrained
    from model import Transformer, config_from_preset
    folder = tmp_path / "hf"
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261)), str(folder))
    if damage == "noconfig":
        os.remove(folder / "config.json")
    elif damage == "badjson":
        (folder / "config.json").write_text('{"model_type": "llama",\n  "vocab_size": 261,,\n}')
    elif damage == "badtokenizer":  # a SentencePiece-style (not byte-level BPE) tokenizer.json
        (folder / "tokenizer.json").write_text('{"model": {"type": "Unigram", "vocab": []}, "added_tokens": []}')
    elif damage == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    return str(folder)


def a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file")


def pairs_jsonl(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(dict(prompt="Hi?", chosen="Hello.", rejected="Go away.")) + "\n")
    return str(path)


PLACES = {"@file": a_file, "@pairs": pairs_jsonl, "@long": lambda t: long_example_jsonl(t, 3000),
          "@medium": lambda t: long_example_jsonl(t, 1000), **{f"@{d}": (lambda t, d=d: model_folder(t, d))
                                                             for d in ("noconfig", "badjson", "truncated", "badtokenizer")}}


BAD = [  # (script, arguments, what the one line must say)
    ("train_sft.py", "--batch_size=0", "config error: batch_size=0; it must be at least 1"),
    ("train_sft.py", "--log_interval=0", "config error: log_interval=0; it must be at least 1"),
    ("train_sft.py", "--max_iters=-5", "config error: max_iters=-5; it must be at least 0"),
    ("train_sft.py", "--learning_rate=-0.1", "config error: learning_rate=-0.1; it must be a finite number greater"),
    ("train_sft.py", "--learning_rate=1e400", "config error: learning_rate=inf; it must be a finite number greater"),
    ("train_sft.py", "--batch_size=None", "batch_size=None is of type NoneType, but batch_size must be of type int"),
    ("train_sft.py", "--max_iters=True", "max_iters=True is of type bool, but max_iters must be of type int"),
    ("train_sft.py", "--seed=-1", "config error: seed=-1; it must be in [0, 2**32)"),
    ("train_sft.py", "--min_lr=0.1", "config error: min_lr=0.1; it must be in [0, learning_rate] (learning_rate=0.005)"),
    ("train_sft.py", "--dtype=fp16", "dtype='fp16'; choose one of auto, bfloat16, float32; float16 needs loss scaling"),
    ("train_sft.py", "--loss_weighting=tokens", "loss_weighting='tokens'; choose one of token, sequence"),
    ("train_sft.py", "--parallel=zero", "parallel='zero'; choose one of ddp, fsdp"),
    ("train_sft.py", "--preset=huge", "preset='huge'; choose one of tiny, toy"),
    ("train_sft.py", "--data=chats.json", "data error: chats.json: no such file, and no .parquet, .jsonl or .json file (gzipped or not) matches"),
    ("train_sft.py", "--data=missing.jsonl", "data error: missing.jsonl: no such file"),
    ("train_sft.py", "--data_split=train", "data_split='train'; it picks raw records; this data is 'builtin' or"),
    ("train_sft.py", "--data=@pairs", "pairs.jsonl:1 is DPO data but train_sft.py trains SFT (messages); use train_dpo"),
    ("train_dpo.py", "--init_from=scratch --data=@medium", "long.jsonl:1 is SFT data but train_dpo.py trains DPO"),
    ("train_sft.py", "--val_fraction=1.5", "val_fraction=1.5; it must be in [0, 1)"),
    ("train_sft.py", "--out_dir=@file/sub", "cannot write there"),
    ("train_sft.py", "--init_from=@noconfig", "it is neither 'scratch', 'resume', a Hugging Face model folder"),
    ("train_sft.py", "--init_from=@badjson", "config.json: not valid JSON"),
    ("train_sft.py", "--init_from=@truncated", "model.safetensors: incomplete or corrupt safetensors file"),
    ("train_sft.py", "--init_from=@badtokenizer", "tokenizer error: "),
    ("train_sft.py", "--data=@medium --microbatch_tokens=512", "more than microbatch_tokens=512; raise microbatch_tokens"),
    ("train_sft.py", "--data=@long --microbatch_tokens=4096",
     "long.jsonl:2: the example is 3007 tokens, more than max_len=2048 — raise --max_len, or pass "
     "--overlong=truncate (keep the first max_len tokens) or --overlong=skip (max_len is capped at the model's "
     "max_seq_len=2048"),
    ("train_dpo.py", "--init_from=scratch --beta=0", "config error: beta=0.0; it must be a finite number greater"),
    ("train_dpo.py", "--init_from=scratch --reference=frozen", "reference='frozen'; choose one of auto, cached, live, adapters_off"),
    ("train_dpo.py", "--init_from=scratch --loss_type=ipo --label_smoothing=0.1", "label_smoothing=0.1; it must be"),
    ("train_rl.py", "--init_from=scratch --loss=grpo --beta=0.04",
     "config error: beta=0.04 does nothing with loss='grpo': only loss 'online_dpo' reads it "
     "(kl_coef is the KL weight here; beta is online DPO's)"),
    ("train_rl.py", "--init_from=scratch --loss=online_dpo --kl_coef=0.1",
     "config error: kl_coef=0.1 does nothing with loss='online_dpo': "
     "only loss 'grpo', 'dapo', 'dr_grpo', 'gspo', 'cispo' or 'distill' reads it"),
]
if not torch.cuda.is_available():
    BAD.append(("train_sft.py", "--device=cuda", "device='cuda'; this machine has no CUDA GPU"))


@pytest.mark.slow
@pytest.mark.parametrize("script, args, message", BAD)
def test_bad_settings_are_one_line_before_any_work(tmp_path, script, args, message):
    for place, make in PLACES.items():
        if place in args:
            args = args.replace(place, make(tmp_path))
    out_dir = str(tmp_path / "run")
    out = run_script(script, [f"--out_dir={out_dir}", "--preset=tiny", *args.split()], check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip() and "lines (100%)" not in line]  # progress
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-2000:]
    if "--data" not in args and "--init_from" not in args:  # failed before any data was tokenized
        assert not os.path.exists(os.path.join(out_dir, "data"))


@pytest.mark.slow
def test_a_moved_run_folder_resumes_with_its_own_data(tmp_path):
    first, moved = str(tmp_path / "first"), str(tmp_path / "moved")
    run_script("train_sft.py", as_args(**dict(SFT, out_dir=first, max_iters=2)))  # built-in data into first/data
    os.rename(first, moved)
    out = run_script("train_sft.py", [f"--out_dir={moved}", "--init_from=resume", "--max_iters=3"])
    assert f"data: {os.path.join(moved, 'data')}" in out.stdout
    assert [m["iter"] for m in metrics(moved)] == [1, 2, 3]


@pytest.mark.slow
def test_overwrite_removes_the_previous_run_first(tmp_path, sft_data):
    out_dir = str(tmp_path / "run")
    run_script("train_sft.py", as_args(**dict(SFT, out_dir=out_dir, data=sft_data, max_iters=1)))
    assert os.path.exists(os.path.join(out_dir, "ckpt.pt")) and os.path.exists(os.path.join(out_dir, "hf"))
    bad = tmp_path / "bad.jsonl"  # the first line passes the config check (SFT data), the second stops prepare
    bad.write_text(json.dumps(dict(messages=[dict(role="user", content="hi"), dict(role="assistant", content="yo")]))
                   + "\n{not json\n")
    out = run_script("train_sft.py", as_args(**dict(SFT, out_dir=out_dir, data=str(bad), overwrite=True)), check=False)
    assert out.returncode != 0 and "bad.jsonl:2: malformed JSON" in out.stderr
    # the new run failed, and nothing of the old one is left to be taken for its result
    assert not os.path.exists(os.path.join(out_dir, "ckpt.pt")) and not os.path.exists(os.path.join(out_dir, "hf"))


def test_resume_drops_log_rows_past_the_checkpoint(tmp_path):
    """kill -9 after the last checkpoint leaves rows the resumed run will write again: they are dropped."""
    from nanopack.metrics import MetricsLogger
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(dict(iter=i, loss=1.0 / i)) + "\n" for i in range(1, 10)))
    MetricsLogger(str(tmp_path), resume_iter=5).log(dict(iter=6, loss=0.5))
    assert [m["iter"] for m in map(json.loads, path.read_text().splitlines())] == [1, 2, 3, 4, 5, 6]
    MetricsLogger(str(tmp_path))  # a fresh run: a fresh log
    assert path.read_text() == ""


@pytest.mark.slow
def test_non_finite_steps_in_a_row_are_counted_across_a_resume(tmp_path):
    """The count of bad steps in a row, and of skipped steps, is the run's: saved with the checkpoint, so a run stopped
    and resumed between bad steps still stops at max_bad_steps; a checkpoint without them (older) starts at 0."""
    out_dir = str(tmp_path / "run")
    data = builtin_data(tmp_path / "data", "sft", n_train=64, n_val=0)  # no val loss: a NaN run's checkpoint is written
    # learning_rate=1e30: iter 1 updates to huge (finite) weights, every step after it is NaN and skipped
    cfg = dict(SFT, out_dir=out_dir, data=data, batch_size=8, learning_rate=1e30, max_iters=3)
    out = run_script("train_sft.py", as_args(**cfg))
    assert "(2 in a row, at most max_bad_steps=3)" in out.stdout
    assert torch.load(os.path.join(out_dir, "ckpt.pt"))["guard"] == dict(skipped_steps=2, bad_in_a_row=2)
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=4"], check=False)
    assert out.returncode != 0 and "stopping: 3 steps in a row had a non-finite loss" in out.stderr, out.stdout
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"))
    del ckpt["guard"]
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=4"])
    assert "(1 in a row, at most max_bad_steps=3)" in out.stdout
    assert metrics(out_dir)[-1]["skipped_steps"] == 1  # counted from 0 again: the checkpoint had no count


def run_files(out_dir):
    """Every file of a run folder with its bytes: what another script's resume leaves as it was."""
    return {os.path.relpath(os.path.join(d, f), out_dir): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(out_dir) for f in names}


@pytest.mark.slow
def test_resuming_another_scripts_run_is_one_line_and_touches_nothing(tmp_path, sft_data, dpo_data):
    """The reported case: train_rl.py --init_from=resume on an SFT run trained RL from it and
    replaced its files."""
    runs = dict(sft=str(tmp_path / "sft"), dpo=str(tmp_path / "dpo"))
    one_step = dict(SFT, max_iters=1)
    run_script("train_sft.py", as_args(**one_step, out_dir=runs["sft"], data=sft_data))
    run_script("train_dpo.py", as_args(**dict(one_step, out_dir=runs["dpo"], data=dpo_data,
                                              batch_size=8, init_from="scratch")))
    # a ckpt.pt of an older nanopack, which records no script: its keys tell
    old = str(tmp_path / "old")
    shutil.copytree(runs["dpo"], old)
    ckpt = torch.load(os.path.join(old, "ckpt.pt"), weights_only=True)
    ckpt.pop("script", None)
    torch.save(ckpt, os.path.join(old, "ckpt.pt"))
    for made_by, out_dir, script in [("train_sft.py", runs["sft"], "train_rl.py"),
                                     ("train_sft.py", runs["sft"], "train_dpo.py"),
                                     ("train_dpo.py", runs["dpo"], "train_sft.py"),
                                     ("train_dpo.py", runs["dpo"], "train_rl.py"),
                                     ("train_dpo.py", old, "train_sft.py")]:
        before = run_files(out_dir)
        out = run_script(script, [f"--out_dir={out_dir}", "--init_from=resume"], check=False)
        hf = os.path.join(out_dir, "hf")
        assert out.returncode != 0 and out.stderr.strip() == (
            f"config error: {out_dir} holds a {made_by} run; resume it with {made_by}, or start "
            f"{script} from {hf} (--init_from={hf}, in another --out_dir)"), out.stderr[-2000:]
        assert run_files(out_dir) == before


@pytest.mark.slow
def test_a_run_shorter_than_its_warmup_says_so(tmp_path, sft_data):
    """The reported case: warmup_iters=20 (the fine-tuning default) over a 4-step run."""
    out = run_script("train_sft.py", as_args(**dict(SFT, out_dir=tmp_path / "run", data=sft_data,
                                                    warmup_iters=20)))
    assert "note: warmup_iters=20 is at least the run's 4 steps: every step warms up" in out.stdout
    out = run_script("train_sft.py", as_args(**dict(SFT, out_dir=tmp_path / "ok", data=sft_data)))
    assert "warmup_iters" not in out.stdout  # warmup_iters=0
