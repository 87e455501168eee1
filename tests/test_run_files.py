"""Never lose a run, on disk (issue 30): a LoRA run resumes under DDP; a base whose weights changed is refused; a full
disk stops a save or an export with one line and keeps the last complete checkpoint and export; a damaged run file
is one line naming it, and a last line of metrics.jsonl cut short is dropped."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanopack import checkpoint
from conftest import ROOT, as_args, builtin_data, run_script, step_metrics
from nanopack.hf import fingerprint, save_pretrained
from model import Transformer, config_from_preset
from test_lora_train import args as lora_args, assert_same_run

SFT = dict(preset="tiny", batch_size=16, microbatch_tokens=2048, learning_rate=1e-2, min_lr=1e-2, warmup_iters=0,
           log_interval=1, eval_examples=0, seed=7)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "sft", "sft", n_train=64, n_val=8)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "pairs", "dpo", n_train=32, n_val=8)


def one_line_failure(out):
    """A run that stopped with one line on stderr and no traceback -> that line."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and "Traceback" not in out.stderr and len(lines) == 1, out.stdout[-2000:] + out.stderr
    return lines[0]


def files(folder):
    """{path: sha256} of everything in a folder: what a refused resume must leave as it was."""
    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).digest()
            for d, _, names in os.walk(folder) for f in names}


# ---- 1. a LoRA run resumes under DDP (the default parallel) and FSDP2, SFT and DPO

@pytest.mark.slow
@pytest.mark.parametrize("script, parallel", [("train_sft.py", "ddp"), ("train_sft.py", "fsdp"), ("train_dpo.py", "ddp")])
def test_lora_run_cut_under_torchrun_resumes_as_the_straight_run(tmp_path, sft_data, pairs, script, parallel):
    data = sft_data if script == "train_sft.py" else pairs
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    run_script(script, lora_args(straight, data, parallel=parallel, microbatch_tokens=1024), nproc=2)
    run_script(script, lora_args(cut, data, parallel=parallel, microbatch_tokens=1024, max_iters=2), nproc=2)
    run_script(script, [f"--out_dir={cut}", "--init_from=resume", "--max_iters=4"], nproc=2)
    assert_same_run(straight, cut, atol=0)  # the same ranks, ops and order: the adapters come back bit for bit


# ---- 3. the base a LoRA run started from: its weights, not its file headers

def test_fingerprint_sees_other_weights_of_the_same_shapes_not_other_shards(tmp_path):
    torch.manual_seed(0)
    model = Transformer(config_from_preset("tiny", vocab_size=261))
    save_pretrained(model, str(tmp_path / "base"))
    save_pretrained(model, str(tmp_path / "sharded"), max_shard_bytes=40_000)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight.mul_(1.01)  # one norm's gain, read whole
    save_pretrained(model, str(tmp_path / "norm"))
    torch.manual_seed(1)
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261)), str(tmp_path / "redrawn"))
    base = fingerprint(str(tmp_path / "base"))
    assert fingerprint(str(tmp_path / "sharded")) == base
    assert fingerprint(str(tmp_path / "norm")) != base and fingerprint(str(tmp_path / "redrawn")) != base


@pytest.mark.slow
def test_lora_resume_refuses_a_base_re_exported_with_other_weights(tmp_path, sft_data):
    folder, out_dir = str(tmp_path / "base"), str(tmp_path / "run")
    torch.manual_seed(0)
    base = Transformer(config_from_preset("tiny", vocab_size=261))
    save_pretrained(base, folder)
    run_script("train_sft.py", lora_args(out_dir, sft_data, init_from=folder, tokenizer="byte", max_iters=1))
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"))
    assert ckpt["start"]["weights"] == fingerprint(folder)
    torch.manual_seed(1)
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261)), folder)  # same shapes and headers
    before = files(out_dir)
    line = one_line_failure(run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=2"],
                                       check=False))
    assert f"{folder} is not the base model this LoRA run started from (its weights changed)" in line
    assert files(out_dir) == before
    save_pretrained(base, folder)  # the base restored: the run resumes
    run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=2"])
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2]
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"))
    del ckpt["start"]["weights"]  # a checkpoint of an older nanopack: it recorded the base's headers only
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    line = one_line_failure(run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3"],
                                       check=False))
    assert "is from an older nanopack, which did not record its base's weights" in line


@pytest.mark.slow
def test_cached_reference_is_computed_again_for_other_weights_in_the_same_folder(tmp_path, pairs):
    folder, out_dir = str(tmp_path / "base"), str(tmp_path / "run")
    cfg = as_args(out_dir=out_dir, data=pairs, init_from=folder, tokenizer="byte", reference="cached", batch_size=8,
                  max_iters=1, eval_interval=0, eval_examples=0, overwrite=True)
    for seed, says in ((0, "saved as"), (0, "loaded"), (1, "saved as")):  # the cache is keyed by the weights
        torch.manual_seed(seed)
        save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261)), folder)
        out = run_script("train_dpo.py", cfg)
        assert says in out.stdout.split("reference log-probs: ")[1].splitlines()[0], (seed, says)


# ---- 5. a full disk while a checkpoint or an export is written

FULL_DISK = """
import builtins, errno, io, os, runpy, sys
name, at, real_open, opened = os.environ["FULL_FILE"], int(os.environ["FULL_AT"]), io.open, [0]
class Full:  # writes half of what it is given, then fails as a full disk does
    def __init__(self, f): self.f = f
    def write(self, data):
        data = data if isinstance(data, str) else memoryview(data).cast("B")
        self.f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def __getattr__(self, key): return getattr(self.f, key)
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()
def full_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    if ("w" in mode or "a" in mode) and str(file).endswith(name):
        opened[0] += 1
        return Full(f) if opened[0] == at else f
    return f
io.open = builtins.open = full_open  # open() and pathlib (DCP); torch.save to a path and safetensors write in C
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_on_full_disk(script, args, file, at=1):
    """The script with the at-th file written whose name ends with `file` failing half way with ENOSPC."""
    env = dict(os.environ, OMP_NUM_THREADS="1", FULL_FILE=file, FULL_AT=str(at))
    return subprocess.run([sys.executable, "-c", FULL_DISK, script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("file", [".distcp", "ckpt.pt.tmp"])
def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_the_resume_needs_nothing(tmp_path, sft_data, file):
    out_dir = str(tmp_path / "run")
    out = run_on_full_disk("train_sft.py", as_args(out_dir=out_dir, data=sft_data, max_iters=4, eval_interval=2, **SFT),
                           file, at=2)  # the checkpoint of iter 2 is written, iter 4's fails
    line = one_line_failure(out)
    assert line.startswith("No space left on device: the checkpoint of iter 4 could not be written in " + out_dir)
    assert f"free space, then continue with --init_from=resume --out_dir={out_dir}" in line
    assert sorted(os.listdir(out_dir)) == ["ckpt-000002-0", "ckpt.pt", "metrics.jsonl", "run.lock"]  # no partial folder
    assert torch.load(os.path.join(out_dir, "ckpt.pt"))["iter_num"] == 2
    run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume"])
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 3, 4]
    assert sorted(os.listdir(out_dir)) == ["ckpt-000004-0", "ckpt.pt", "hf", "metrics.jsonl", "run.lock"]


@pytest.mark.slow
@pytest.mark.parametrize("file, lora_rank", [("model.safetensors", 0), ("config.json", 0),
                                             ("adapter_model.safetensors", 4)])
def test_a_full_disk_during_the_export_keeps_the_previous_export(tmp_path, sft_data, file, lora_rank):
    out_dir = str(tmp_path / "run")
    run_script("train_sft.py", as_args(out_dir=out_dir, data=sft_data, max_iters=2, eval_interval=0,
                                       lora_rank=lora_rank, **SFT))
    exports = {d: files(os.path.join(out_dir, d)) for d in os.listdir(out_dir) if d in ("hf", "adapter")}
    out = run_on_full_disk("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3"], file)
    line = one_line_failure(out)
    assert line.startswith("No space left on device: the Hugging Face export (a previous one stays as it was) could "
                           "not be written in " + out_dir)
    assert not any(d.endswith(".tmp") for d in os.listdir(out_dir))
    assert {d: files(os.path.join(out_dir, d)) for d in exports} == exports  # the iter-2 export, whole
    assert torch.load(os.path.join(out_dir, "ckpt.pt"))["iter_num"] == 3
    run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume"])  # nothing to train: it exports
    assert all(files(os.path.join(out_dir, d)) != exports[d] for d in exports)


def test_torch_s_short_write_is_a_full_disk_and_other_errors_keep_their_traceback(tmp_path):
    """Under torchrun a full disk can reach us only as torch.save's 'unexpected pos' (its zip writer saw a short
    write), the OSError lost in C++; any other error is a bug."""
    run = SimpleNamespace(out_dir=str(tmp_path), ckpt_path=str(tmp_path / "ckpt.pt"))
    with pytest.raises(SystemExit, match="^No space left on device .a write stopped short.: the checkpoint"):
        checkpoint.stop_writing(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                                "the checkpoint", run)
    with pytest.raises(KeyError):
        checkpoint.stop_writing(KeyError("model.embed_tokens.weight"), "the checkpoint", run)


# ---- 6. damaged run files

@pytest.fixture(scope="module")
def finished(tmp_path_factory, sft_data):
    out_dir = str(tmp_path_factory.mktemp("finished") / "run")
    run_script("train_sft.py", as_args(out_dir=out_dir, data=sft_data, max_iters=2, eval_interval=0, **SFT))
    return out_dir


def cut(path, keep=0.5):
    with open(path, "rb+") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def spoil_first_line(path):
    with open(path, "r+") as f:
        f.write("{,")


def shard(out_dir, name):
    return os.path.join(out_dir, torch.load(os.path.join(out_dir, "ckpt.pt"))["weights"], name)


DAMAGE = {  # what a resume reads, damaged -> what the one line says
    "empty ckpt.pt": (lambda d: cut(os.path.join(d, "ckpt.pt"), 0), "ckpt.pt cannot be read (EOFError"),
    "truncated ckpt.pt": (lambda d: cut(os.path.join(d, "ckpt.pt")), "ckpt.pt cannot be read ("),
    "truncated shard": (lambda d: cut(shard(d, "__0_0.distcp")), "the checkpoint's weights cannot be read ("),
    "missing .metadata": (lambda d: os.remove(shard(d, ".metadata")), "the checkpoint's weights cannot be read (no "),
    "garbage .metadata": (lambda d: open(shard(d, ".metadata"), "w").write("garbage\n"),
                          "the checkpoint's weights cannot be read (its .metadata is damaged: "),
    "damaged metrics line": (lambda d: spoil_first_line(os.path.join(d, "metrics.jsonl")),
                             "metrics.jsonl:1 is not a JSON line ("),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_run_file_is_one_line_and_changes_nothing(tmp_path, finished, damage):
    out_dir = str(tmp_path / "run")
    shutil.copytree(finished, out_dir)
    make, says = DAMAGE[damage]
    make(out_dir)
    before = files(out_dir)
    line = one_line_failure(run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3"],
                                       check=False))
    assert says in line and ("restore" in line or "fix or delete that line" in line), line
    assert files(out_dir) == before


@pytest.mark.slow
def test_a_last_metrics_line_cut_short_is_dropped_and_the_run_resumes(tmp_path, finished):
    out_dir = str(tmp_path / "run")
    shutil.copytree(finished, out_dir)
    with open(os.path.join(out_dir, "metrics.jsonl"), "a+") as f:
        f.seek(0)
        n = len(f.readlines())
        f.write('{"iter": 3, "loss": 1.2')  # what a full disk leaves of a log line
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3"])
    assert f"metrics.jsonl:{n + 1}, the last line, was cut short" in out.stdout and "Traceback" not in out.stderr
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 3]
    assert all(json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl")))


@pytest.mark.slow
def test_resuming_a_context_parallel_run_in_one_process_says_what_to_pass(tmp_path, finished):
    out_dir = str(tmp_path / "run")
    shutil.copytree(finished, out_dir)
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"))
    ckpt["config"]["context_parallel"] = 2  # as `torchrun --nproc_per_node=2 ... --context_parallel=2` saves it
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    line = one_line_failure(run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3"],
                                       check=False))
    assert line.startswith("config error: context_parallel=2 (the value of the run being resumed); it must divide the "
                           "number of processes (1)"), line
    assert line.endswith("to resume it in 1 process, pass --context_parallel=1 and a --microbatch_tokens that holds "
                         "its longest sequence (--microbatch_tokens=4096 does: 2 x 2048)"), line
    run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3", "--context_parallel=1",
                                "--microbatch_tokens=4096"])
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 3]


# ---- 7. a full disk while metrics.jsonl is written

@pytest.mark.slow
def test_a_full_disk_at_start_up_is_one_line_and_leaves_no_empty_file(tmp_path):
    """The write test of out_dir and the log's rewrite on resume: the disk takes the file, then refuses its bytes."""
    from nanopack import metrics
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    write_test = f"import os; os.symlink('/dev/full', '{out_dir}/.write_test_' + str(os.getpid()))"  # ENOSPC on write
    out = subprocess.run([sys.executable, "-c", write_test + "; import runpy, sys; sys.argv = sys.argv[1:]; "
                          "runpy.run_path(sys.argv[0], run_name='__main__')", "train_sft.py", f"--out_dir={out_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = one_line_failure(out)
    assert "cannot write there (No space left on device)" in line, line
    assert os.listdir(out_dir) == []
    (out_dir / "metrics.jsonl").write_text(json.dumps(dict(iter=1, loss=1.0)) + "\n")
    os.symlink("/dev/full", out_dir / "metrics.jsonl.tmp")
    with pytest.raises(SystemExit, match="^No space left on device: .*metrics.jsonl cannot be written; free space"):
        metrics.MetricsLogger(str(out_dir), resume_iter=1)
    assert sorted(os.listdir(out_dir)) == ["metrics.jsonl"]  # the log as it was
    assert json.loads((out_dir / "metrics.jsonl").read_text()) == dict(iter=1, loss=1.0)


@pytest.mark.slow
def test_a_full_disk_while_logging_stops_the_run_after_the_next_step_with_a_checkpoint(tmp_path, sft_data):
    out_dir = str(tmp_path / "run")
    out = run_on_full_disk("train_sft.py", as_args(out_dir=out_dir, data=sft_data, max_iters=8, eval_interval=0,
                                                   **SFT), "metrics.jsonl", at=3)  # iter 3's row
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"No space left on device: {out_dir}/metrics.jsonl could not be written at iter 3: stopping after the " \
           f"next step with a checkpoint" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith(f"stopped after iter 4 by a failure: No space left on device: {out_dir}/metrics.jsonl "
                           f"could not be written from iter 3 on (those rows are missing); checkpoint"), last
    assert torch.load(os.path.join(out_dir, "ckpt.pt"))["iter_num"] == 4  # nothing trained is lost
    out = run_script("train_sft.py", [f"--out_dir={out_dir}", "--init_from=resume"])
    assert "the last line, was cut short" in out.stdout  # half of iter 3's row: dropped
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 5, 6, 7, 8]


# ---- 8. the export moved into place: a kill at any moment leaves a whole export, never a mix

class Killed(BaseException):
    """A kill -9 between two file operations."""


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_kill_while_an_export_moves_in_leaves_one_whole_export(tmp_path, monkeypatch, lora_rank):
    from nanopack import lora
    from nanopack.tokenizer import get_tokenizer
    torch.manual_seed(0)
    model = Transformer(config_from_preset("tiny", vocab_size=261))
    adapters = dict(rank=lora_rank, alpha=8, dropout=0.0, targets=["q_proj", "v_proj"], quantize="") if lora_rank \
        else None
    if adapters:
        lora.add_adapters(model, lora_rank, 8, 0.0, adapters["targets"])
    tok = get_tokenizer("byte")
    run = SimpleNamespace(master=True, out_dir=str(tmp_path), ckpt_path=str(tmp_path / "ckpt.pt"),
                          config={})
    names = ["hf", "adapter"] if lora_rank else ["hf"]

    def export(scale):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        checkpoint.export_hf(run, model, model, tok, dict(init_from="scratch"), adapters)
        return {d: files(os.path.join(tmp_path, d)) for d in names}

    old, new = export(1.0), export(2.0)
    assert old != new
    replace, rmtree = os.replace, shutil.rmtree
    for cut in range(1, 20):
        export(0.5)  # back to the old weights, exported whole
        calls = [0]

        def killed_at_cut(real):
            def op(*args, **kwargs):
                calls[0] += 1
                if calls[0] == cut:
                    raise Killed
                return real(*args, **kwargs)
            return op
        monkeypatch.setattr(os, "replace", killed_at_cut(replace))
        monkeypatch.setattr(shutil, "rmtree", killed_at_cut(rmtree))
        try:
            export(2.0)
            finished = True
        except Killed:
            finished = False
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(shutil, "rmtree", rmtree)
        in_place = {d: files(os.path.join(tmp_path, d)) for d in names if os.path.isdir(os.path.join(tmp_path, d))}
        assert all(v == old[d] for d, v in in_place.items()) or all(v == new[d] for d, v in in_place.items()), cut
        checkpoint.finish_export(str(tmp_path))  # what the next run does at start-up, and every export first
        now = {d: files(os.path.join(tmp_path, d)) for d in names}
        assert now in (old, new), cut
        assert sorted(os.listdir(tmp_path)) == sorted(names), cut
        if finished:
            break
    assert finished and cut > 3  # every operation of the move was cut once
