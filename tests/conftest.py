import json
import os
import random
import signal
import subprocess
import sys
import time

# `pytest -n 2` (README): each worker, and every script it launches, runs torch on one thread; two workers' thread
# pools on two cores spin against each other (two 2-thread runs side by side were ~3x slower than one after the other)
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def seed_everything():
    # every test starts from the same RNG state, whatever ran before it
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def next_token_targets(ids, cu_seqlens):
    """What packing.make_batch builds with every token trained: position t predicts token t+1 of its own
    sequence; a sequence's last position predicts nothing (-100)."""
    targets = torch.nn.functional.pad(ids[1:], (0, 1), value=-100)
    targets[cu_seqlens[1:].long() - 1] = -100
    return targets


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, args, nproc=1, check=True, timeout=600):
    """A training script as users launch it: plain python, or torchrun with nproc processes (gloo on CPU)."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(launcher + [script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def as_args(**cfg):
    return [f"--{k}={v}" for k, v in cfg.items()]


def builtin_data(folder, kind, n_train, n_val):
    """The built-in arithmetic data (chats or preference pairs), small, tokenized with the byte tokenizer."""
    from data.arithmetic import prepare_builtin
    prepare_builtin(str(folder), "byte", kind=kind, n_train=n_train, n_val=n_val, verbose=False)
    return str(folder)


def step_metrics(out_dir):
    """The per-step lines of a run's metrics.jsonl (evaluation lines left out)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def checkpoint_weights(out_dir):
    """The model weights of a run's checkpoint (ckpt.pt and the DCP folder it names), as a state dict."""
    from nanopack.checkpoint import checkpoint_model
    return checkpoint_model(os.path.join(out_dir, "ckpt.pt"))[0].state_dict()


def stop_after_first_step(cmd, out_dir):
    """Start a run, SIGTERM it once its first step is logged -> its stdout; it must stop with a checkpoint (exit 143:
    not done)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    log, deadline = os.path.join(out_dir, "metrics.jsonl"), time.time() + 120
    while not (os.path.exists(log) and os.path.getsize(log) > 0) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-2000:]
    return stdout
