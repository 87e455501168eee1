"""LoRA and QLoRA through train_sft.py / train_dpo.py, as users launch them. Tolerances as in test_train_sft.py and
test_train_dpo.py: float32; another micro-batch split or world size only reorders the same sums (~1e-7 relative
per addition), so step means agree to 1e-5 relative and adapters after a few AdamW steps to 1e-4 absolute."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nanopack import lora
from conftest import as_args, builtin_data, run_script, step_metrics
from nanopack.hf import from_pretrained, save_pretrained
from model import Transformer, config_from_preset


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "sft", "sft", n_train=200, n_val=20)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return builtin_data(tmp_path_factory.mktemp("data") / "pairs", "dpo", n_train=64, n_val=16)


def args(out_dir, data, **kw):
    # constant, high learning rate: a few steps move the adapters well away from zero, and a cut run resumes
    # on the same schedule
    cfg = dict(out_dir=out_dir, data=data, init_from="scratch", preset="tiny", batch_size=16, microbatch_tokens=4096,
               max_iters=4, learning_rate=1e-2, min_lr=1e-2, warmup_iters=0, log_interval=1, eval_interval=0, eval_examples=0,
               seed=7, lora_rank=4, lora_targets="q_proj,v_proj,o_proj,down_proj")
    cfg.update(kw)
    return as_args(**cfg)


def adapter(out_dir):
    return load_file(os.path.join(out_dir, "adapter", "adapter_model.safetensors"))


def assert_same_run(a, b, atol=1e-4):
    sa, sb = step_metrics(a), step_metrics(b)
    assert len(sa) == len(sb) > 0
    for x, y in zip(sa, sb):
        for key in ("loss", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (key, x["iter"])
    wa, wb = adapter(a), adapter(b)
    assert wa.keys() == wb.keys() and len(wa) == 2 * 4 * 2
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, sft_data):
    out_dir = str(tmp_path_factory.mktemp("sft"))
    out = run_script("train_sft.py", args(out_dir, sft_data))
    assert "(LoRA r=4: " in out.stdout and "PEFT adapter" in out.stdout
    return out_dir


@pytest.mark.slow
def test_sft_trains_only_the_adapters_and_both_exports_load(sft_run, tmp_path):
    torch.manual_seed(7)  # the run's scratch base, rebuilt as build_model makes it
    base = Transformer(config_from_preset("tiny", vocab_size=261))
    merged = from_pretrained(os.path.join(sft_run, "hf"))
    for name, p in base.named_parameters():  # nothing but the adapted matrices moved (vocab padding rows aside)
        moved = not torch.equal(p[:261], merged.get_parameter(name)[:261])
        assert moved == name.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight", "down_proj.weight"))
    model = lora.add_adapters(base, 4, 8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.copy_(adapter(sft_run)[f"base_model.model.model.{name}.weight"])
    ids = torch.randint(0, 261, (50,))
    with torch.no_grad():
        expected = model(ids)
        scale = expected.abs().max()
        torch.testing.assert_close(merged(ids) / scale, expected / scale, atol=1e-5, rtol=0)
        peft = pytest.importorskip("peft")
        transformers = pytest.importorskip("transformers")
        with lora.adapters_disabled(model):
            save_pretrained(model, str(tmp_path / "base"), state={k: v for k, v in model.state_dict().items()
                                                                  if "lora_" not in k})
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).float()
        loaded = peft.PeftModel.from_pretrained(hf_base, os.path.join(sft_run, "adapter")).eval()
        torch.testing.assert_close(loaded(ids[None]).logits[0] / scale, expected / scale, atol=1e-5, rtol=0)
    config = json.load(open(os.path.join(sft_run, "adapter", "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, "scratch")


@pytest.mark.slow
def test_sft_micro_batches_equal_one_batch(sft_run, sft_data, tmp_path):
    run_script("train_sft.py", args(str(tmp_path / "many"), sft_data, microbatch_tokens=512))
    assert_same_run(sft_run, str(tmp_path / "many"))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sft_two_processes_equal_one(sft_run, sft_data, tmp_path, parallel):
    out_dir = str(tmp_path / parallel)
    run_script("train_sft.py", args(out_dir, sft_data, microbatch_tokens=1024, parallel=parallel), nproc=2)
    assert_same_run(sft_run, out_dir)


@pytest.mark.slow
def test_sft_resume_equals_the_straight_run(sft_run, sft_data, tmp_path):
    cut = str(tmp_path / "cut")
    run_script("train_sft.py", args(cut, sft_data, max_iters=2))
    from torch.distributed.checkpoint import FileSystemReader
    folder = torch.load(os.path.join(cut, "ckpt.pt"))["weights"]
    keys = FileSystemReader(os.path.join(cut, folder)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(k.endswith(("lora_A", "lora_B")) for k in weights)  # the adapters, not the base
    run_script("train_sft.py", args(cut, sft_data, init_from="resume"))
    assert_same_run(sft_run, cut, atol=0)  # the adapters and their optimizer state come back bit for bit


@pytest.mark.slow
def test_dpo_reference_is_the_base_with_adapters_off(pairs, tmp_path):
    off, cached = str(tmp_path / "off"), str(tmp_path / "cached")
    out = run_script("train_dpo.py", args(off, pairs, learning_rate=1e-3, min_lr=1e-3))
    assert "reference adapters_off" in out.stdout and not os.path.exists(os.path.join(off, "reference"))
    first = step_metrics(off)[0]
    assert first["rewards_chosen"] == 0.0 and first["rewards_rejected"] == 0.0  # step 1: policy == base, exactly
    run_script("train_dpo.py", args(cached, pairs, learning_rate=1e-3, min_lr=1e-3, reference="cached"))
    for a, b in zip(step_metrics(off), step_metrics(cached)):  # the cache: the same base, packed in bigger bins
        scale = abs(a["logps_chosen"]) + abs(a["logps_rejected"])
        for key in ("loss", "rewards_chosen", "rewards_rejected", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6 * scale), key
    many = str(tmp_path / "many")
    run_script("train_dpo.py", args(many, pairs, learning_rate=1e-3, min_lr=1e-3, microbatch_tokens=512))
    assert_same_run(off, many)
    for parallel in ("ddp", "fsdp"):
        out_dir = str(tmp_path / parallel)
        run_script("train_dpo.py", args(out_dir, pairs, learning_rate=1e-3, min_lr=1e-3, microbatch_tokens=1024,
                                        parallel=parallel), nproc=2)
        assert_same_run(off, out_dir)


@pytest.mark.slow
def test_sft_activation_checkpointing_takes_the_same_steps(sft_run, sft_data, tmp_path):
    run_script("train_sft.py", args(str(tmp_path / "ac"), sft_data, activation_checkpointing=True))
    assert_same_run(sft_run, str(tmp_path / "ac"), atol=0)  # the same ops recomputed: bit for bit


@pytest.mark.slow
def test_resume_refuses_another_base(tmp_path, sft_data):
    folder = str(tmp_path / "base")
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261)), folder)
    run_script("train_sft.py", args(str(tmp_path / "run"), sft_data, init_from=folder, tokenizer="byte",
                                    max_iters=1))
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=261, n_layer=3)), folder)  # replaced
    out = run_script("train_sft.py", args(str(tmp_path / "run"), sft_data, init_from="resume", max_iters=2),
                     check=False)
    assert out.returncode != 0 and "is not the base model this LoRA run started from" in out.stderr
    assert "Traceback" not in out.stderr
    out = run_script("train_sft.py", args(str(tmp_path / "run"), sft_data, init_from="resume", lora_rank=8),
                     check=False)
    assert "lora_rank=8 differs from the run being resumed (lora_rank=4)" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arg, message", [
    ("--lora_rank=-1", "lora_rank=-1; it must be at least 0"),
    ("--lora_alpha=0", "lora_alpha=0; it must be a number greater than 0"),
    ("--lora_dropout=1.0", "lora_dropout=1.0; it must be in [0, 1)"),
    ("--lora_targets=qproj", "lora_targets='qproj'; no layer is called 'qproj'; a block's linear layers are q_proj,"),
    ("--quantize_base=nf8", "quantize_base='nf8'; choose '' (the base in dtype) or 'nf4'"),
])
def test_bad_lora_config_is_one_line_and_writes_nothing(tmp_path, sft_data, arg, message):
    out = run_script("train_sft.py", args(str(tmp_path / "run"), sft_data) + [arg], check=False)
    assert out.returncode != 0 and f"config error: {message}" in out.stderr and "Traceback" not in out.stderr
    assert not os.path.exists(os.path.join(tmp_path, "run", "ckpt.pt"))


@pytest.mark.slow
def test_qlora_without_adapters_and_adapters_off_without_lora_are_refused(tmp_path, pairs):
    out = run_script("train_sft.py", args(str(tmp_path / "a"), pairs, lora_rank=0, quantize_base="nf4"), check=False)
    assert "config error: quantize_base='nf4'; a 4-bit base cannot be trained: it needs adapters" in out.stderr
    out = run_script("train_dpo.py", args(str(tmp_path / "b"), pairs, lora_rank=0, reference="adapters_off"),
                     check=False)
    assert "config error: reference='adapters_off'; 'adapters_off' is the base model under the adapters" in out.stderr


@pytest.mark.slow
def test_qlora_sft_runs_on_cpu_and_learns(tmp_path, sft_data):
    pytest.importorskip("torchao")
    out_dir = str(tmp_path / "qlora")
    out = run_script("train_sft.py", args(out_dir, sft_data, preset="toy", quantize_base="nf4", max_iters=6,
                                          lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"))
    assert "weight(s) stay in torch.float32" in out.stdout  # toy's k/v projections do not fill NF4 blocks
    losses = [m["loss"] for m in step_metrics(out_dir)]
    assert losses[-1] < losses[0] - 0.3, losses
    assert os.path.exists(os.path.join(out_dir, "hf", "model.safetensors"))  # merged: dequantised base + B A
    shutil.rmtree(out_dir)
