"""Past one node (issue 19): FSDP2 from a model folder builds on the meta device and each rank reads only its own
rows (model.load_hf_weights); the HF export gathers one tensor at a time. Both against the one-process path."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, as_args, builtin_data, run_script, step_metrics
from nanopack.hf import SafetensorsFolder, save_pretrained
from model import Transformer, config_from_preset


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["own head", "tied"])
def test_sharded_load_and_export_equal_one_process(tmp_path, world_size, tied):
    torch.manual_seed(0)
    # vocab 203 -> 256 padded rows: with 4 ranks the last shard of the embedding is partly padding
    model = Transformer(config_from_preset("tiny", vocab_size=203, tie_embeddings=tied))
    save_pretrained(model, str(tmp_path / "hf"), max_shard_bytes=40_000)  # several files: rows come from each
    save_pretrained(model, str(tmp_path / "one"), max_shard_bytes=30_000)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                          os.path.join(ROOT, "tests", "fsdp_check.py"), str(tmp_path / "hf"), str(tmp_path / "export")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.count("ok") == world_size, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "export")) == sorted(os.listdir(tmp_path / "one"))  # same shard plan
    a, b = SafetensorsFolder(str(tmp_path / "export")), SafetensorsFolder(str(tmp_path / "one"))
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
        assert torch.equal(a.read(key), b.read(key)), key


@pytest.mark.slow
def test_fsdp_from_a_model_folder_equals_one_process(tmp_path):
    """train_sft.py from a Hugging Face folder: FSDP2 on 2 ranks (sharded load) takes the steps one process takes."""
    from nanopack.tokenizer import get_tokenizer
    torch.manual_seed(0)
    folder = str(tmp_path / "hf")
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)), folder)
    data = builtin_data(tmp_path / "data", "sft", n_train=64, n_val=8)
    cfg = dict(data=data, init_from=folder, batch_size=16, microbatch_tokens=512, max_iters=3, learning_rate=1e-2,
               warmup_iters=0, log_interval=1, eval_interval=0, eval_examples=0, seed=7)
    run_script("train_sft.py", as_args(out_dir=str(tmp_path / "one"), **cfg))
    run_script("train_sft.py", as_args(out_dir=str(tmp_path / "fsdp"), parallel="fsdp", **cfg), nproc=2)
    one, fsdp = step_metrics(str(tmp_path / "one")), step_metrics(str(tmp_path / "fsdp"))
    assert len(one) == len(fsdp) == 3
    for x, y in zip(one, fsdp):  # float32, the sums in another order: 1e-5 relative (see test_train_sft.py)
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
    a, b = SafetensorsFolder(str(tmp_path / "one" / "hf")), SafetensorsFolder(str(tmp_path / "fsdp" / "hf"))
    for key in a.keys():  # the exports (the FSDP one gathered tensor by tensor) hold the same trained weights
        torch.testing.assert_close(a.read(key), b.read(key), atol=1e-4, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_safetensors_files_read_back(tmp_path, dtype):
    """save_pretrained writes each file's header from the shapes, then the tensors' bytes one at a time: the files
    must read back with safetensors' own loader, every tensor equal, in one file or several."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    torch.manual_seed(0)
    model = Transformer(config_from_preset("tiny", vocab_size=203)).to(dtype)
    for max_shard_bytes in (2**30, 30_000):
        folder = tmp_path / str(max_shard_bytes)
        save_pretrained(model, str(folder), max_shard_bytes=max_shard_bytes)
        tensors = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(folder / name))
                with safe_open(str(folder / name), framework="pt") as f:
                    assert f.metadata() == {"format": "pt"}
        state = model.state_dict()
        assert len(tensors) == len(state)
        for name, t in state.items():
            key = name if name.startswith("lm_head") else "model." + name
            assert tensors[key].dtype == dtype and torch.equal(tensors[key], t[:len(tensors[key])]), key


@pytest.mark.slow
def test_checkpoints_resume_across_world_sizes_and_layouts(tmp_path):
    """A checkpoint is ckpt.pt (small) + a DCP folder of sharded model and optimizer state: a run cut under FSDP2 on
    2 ranks resumes in 1 process, and one cut in 1 process resumes under FSDP2, each taking the straight run's steps."""
    from test_train_sft import assert_same_run
    data = builtin_data(tmp_path / "data", "sft", n_train=64, n_val=8)
    cfg = dict(data=data, preset="tiny", batch_size=16, microbatch_tokens=512, max_iters=4, learning_rate=1e-2,
               min_lr=1e-2, warmup_iters=0, log_interval=1, eval_interval=2, eval_examples=0, seed=7)
    straight = str(tmp_path / "straight")
    run_script("train_sft.py", as_args(out_dir=straight, **cfg))
    for first, then, name in ((2, 1, "fsdp_then_one"), (1, 2, "one_then_fsdp")):
        out_dir = str(tmp_path / name)
        run_script("train_sft.py", as_args(out_dir=out_dir, parallel="fsdp", **dict(cfg, max_iters=2)), nproc=first)
        assert sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt")) == ["ckpt-000002-0", "ckpt.pt"]
        run_script("train_sft.py", as_args(out_dir=out_dir, init_from="resume", parallel="fsdp", max_iters=4), nproc=then)
        assert sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt")) == ["ckpt-000004-0", "ckpt.pt"]
        assert_same_run(straight, out_dir)  # float32, sums in another order across layouts: 1e-5 / 1e-4


@pytest.mark.slow
def test_a_half_written_checkpoint_is_never_the_one_resumed(tmp_path):
    """A kill while a DCP folder is written leaves it half full, but ckpt.pt still names the previous complete one:
    resume uses that, and the next save removes the leftover."""
    data = builtin_data(tmp_path / "data", "sft", n_train=32, n_val=8)
    out_dir = str(tmp_path / "run")
    cfg = dict(out_dir=out_dir, data=data, preset="tiny", batch_size=8, max_iters=2, log_interval=1, eval_interval=2,
               eval_examples=0)
    run_script("train_sft.py", as_args(**cfg))
    half = os.path.join(out_dir, "ckpt-000003-0")
    os.makedirs(half)
    with open(os.path.join(half, "__0_0.distcp"), "wb") as f:
        f.write(b"\0" * 100)  # no .metadata: DCP could not load this folder
    run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=4"])
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 3, 4]  # resumed from iter 2's checkpoint
    assert sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt")) == ["ckpt-000004-0", "ckpt.pt"]


@pytest.mark.slow
def test_live_reference_under_fsdp_from_a_folder_equals_the_cached_one(tmp_path):
    """train_dpo.py from a model folder: FSDP2 on 2 ranks with a live reference (built sharded, each rank reading its
    own rows) takes the steps of one process with the cached reference."""
    from test_train_dpo import assert_same_run, common_args
    from nanopack.tokenizer import get_tokenizer
    torch.manual_seed(0)
    folder = str(tmp_path / "hf")
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=get_tokenizer("byte").vocab_size)), folder)
    pairs = builtin_data(tmp_path / "pairs", "dpo", n_train=48, n_val=8)
    cached, live = str(tmp_path / "cached"), str(tmp_path / "live")
    run_script("train_dpo.py", common_args(cached, pairs, init_from=folder, max_iters=3))
    run_script("train_dpo.py", common_args(live, pairs, init_from=folder, max_iters=3, reference="live",
                                           parallel="fsdp", microbatch_tokens=1024), nproc=2)
    assert_same_run(cached, live)
