"""Every config/*.py preset starts and takes a step, on a scaled-down stand-in: the preset's own keys, with the
model folder replaced by a tiny random Hugging Face model of the same architecture, the built-in data, one step.
A preset that cannot start (a key the script lacks, a value check fails, a budget the data cannot use) fails here.
"""

import glob
import os

import pytest

from conftest import ROOT, run_script, step_metrics

PRESETS = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))
ARCH = {"qwen2.5": dict(arch="qwen2", qkv_bias=True, tie_embeddings=True), "llama": dict(arch="llama"),
        "smollm2": dict(arch="llama", tie_embeddings=True)}


def stand_in(folder, preset):
    """A tiny random model of the preset's architecture, saved as a Hugging Face folder."""
    from nanopack.hf import save_pretrained
    from model import Transformer, config_from_preset
    family = next(k for k in ARCH if k in os.path.basename(preset))
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261, **ARCH[family])), str(folder))
    return str(folder)


def test_there_are_presets():
    assert len(PRESETS) >= 6 and all(any(k in p for k in ARCH) for p in PRESETS)


def test_dpo_presets_fit_their_longest_pair():
    """A DPO micro-batch holds whole pairs: chosen + rejected, each up to max_len (data/prepare.py)."""
    import runpy
    for preset in PRESETS:
        cfg = runpy.run_path(preset)
        if os.path.basename(preset).startswith("dpo_") and "max_len" in cfg:
            assert cfg["microbatch_tokens"] >= 2 * cfg["max_len"], preset


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_preset_starts_and_steps(tmp_path, preset):
    script = "train_dpo.py" if os.path.basename(preset).startswith("dpo_") else "train_sft.py"
    out_dir = str(tmp_path / "run")
    out = run_script(script, [preset, f"--out_dir={out_dir}", f"--init_from={stand_in(tmp_path / 'hf', preset)}",
                              "--tokenizer=byte", "--data=builtin", "--max_iters=1", "--eval_examples=0"])
    assert [m["iter"] for m in step_metrics(out_dir)] == [1]
    assert "done: checkpoint" in out.stdout
