"""Inputs a user gets wrong or runs into (issue 30), each tried as the user does it, on the command line: a reply that
reaches the model's max_seq_len is kept (sample.py, one prompt and a chat), a DPO line without its prompt, an empty
prompts file for RL, a val folder with several splits (val_split) or one split in two formats, a LoRA rank above the
layers' size, QLoRA on a model NF4 cannot take, val_fraction out of [0, 1); RL's reward time is its own metric.
A mistake is one line on stderr, no traceback, and nothing of a run written (no checkpoint, metrics or export)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from nanopack import lora
from conftest import ROOT, as_args, run_script, step_metrics
from data.prepare import load
from nanopack.generate import generate
from model import ModelConfig, Transformer, config_from_preset
from nanopack.tokenizer import Tokenizer

TOK = Tokenizer.byte_level()
POSITIONS = 40  # the small model's max_seq_len: a chat turn with the byte template is ~20 tokens


def run_cli(args, stdin=None):
    """A script as a user runs it: python <script> args..., optionally typing stdin."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, input=stdin,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def one_line(out, *says):
    """The run failed with one line on stderr saying each of `says`, and no traceback."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for s in says:
        assert s in lines[0], lines[0]
    return lines[0]


def nothing_of_a_run(out_dir):
    return not any(os.path.exists(os.path.join(out_dir, f)) for f in ("ckpt.pt", "metrics.jsonl", "hf", "adapter"))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def chats(n, start=0):
    return [{"messages": [{"role": "user", "content": f"What is {i}+1?"}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(start, start + n)]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A Hugging Face folder of a tiny random model with max_seq_len=40, as a user's short-context model."""
    from nanopack.hf import save_pretrained
    folder = str(tmp_path_factory.mktemp("m40"))
    torch.manual_seed(0)
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=TOK.vocab_size, max_seq_len=POSITIONS)), folder)
    return folder


# ---- 11: a reply stops at max_seq_len and is kept -------------------------------------------------------------
@pytest.mark.parametrize("kv_cache", [True, False])
def test_generate_stops_each_reply_where_the_model_has_no_positions_left(kv_cache):
    """Each reply ends where prompt + reply fill max_seq_len, and is exactly the start of the reply the same weights
    give with room to spare (the positions it used are the same): nothing generated is lost or changed."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64,
                                    max_seq_len=64)).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11] * 10]
    free = generate(model, prompts, 20, temperature=1.0, seed=0, num_samples=2, kv_cache=kv_cache)
    model.config.max_seq_len = 12  # the same weights and RoPE table, 12 positions
    capped = generate(model, prompts, 20, temperature=1.0, seed=0, num_samples=2, kv_cache=kv_cache)
    for i, (a, b) in enumerate(zip(free, capped)):
        assert len(b) == 12 - len(prompts[i // 2]) and b == a[:len(b)]
    assert generate(model, [[1, 2]], 3) == generate(model, [[1, 2]], 3, kv_cache=not kv_cache)  # room: unchanged
    with pytest.raises(ValueError, match="a prompt of 12 tokens leaves no room for a reply: the model reads at most "
                                         "max_seq_len=12 tokens"):
        generate(model, [[1] * 12], 5)


@pytest.mark.slow
def test_sample_keeps_a_reply_cut_at_max_seq_len(small_model):
    from nanopack.hf import from_pretrained
    out = run_cli(["sample.py", f"--model={small_model}", "--prompt=What is 2+2?", "--max_new_tokens=100",
                   "--device=cpu"])
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    ids = TOK.render_prompt([{"role": "user", "content": "What is 2+2?"}])
    reply = generate(from_pretrained(small_model, dtype=torch.float32).eval(), [ids], 100, TOK.stop_ids)[0]
    assert len(ids) + len(reply) == POSITIONS and reply[-1] not in TOK.stop_ids  # the case: cut, not stopped
    text = TOK.decode(reply).replace("\r\n", "\n").replace("\r", "\n")  # as text-mode pipes read it
    assert out.stdout == f"{text}\n(cut: prompt and reply reached the model's max_seq_len={POSITIONS} tokens)\n---\n"


@pytest.mark.slow
def test_a_chat_that_outgrows_the_model_drops_its_oldest_turns(small_model):
    typed = ["hi", "What is 2+2 and more?", "again", "this message alone is longer than forty tokens, far longer", "ok"]
    out = run_cli(["sample.py", f"--model={small_model}", "--max_new_tokens=8", "--device=cpu"], "\n".join(typed))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    said = out.stdout.split("> ")[1:]  # what follows each prompt: one per typed line, then the final empty one
    assert len(said) == len(typed) + 1
    assert "no longer sees the 1 oldest turn(s)" in said[1] and f"max_seq_len={POSITIONS}" in said[1]
    assert said[3].startswith("(the prompt is") and "not sent; write a shorter message" in said[3]
    assert all(s.strip() for s in said[:3] + said[4:5])  # every message that fits got a reply


@pytest.mark.slow
def test_a_prompt_longer_than_the_model_is_one_line(small_model):
    out = run_cli(["sample.py", f"--model={small_model}", "--prompt=" + "x" * 50, "--device=cpu"])
    one_line(out, f"reads at most max_seq_len={POSITIONS}", "shorten the prompt")


# ---- 12: a DPO line must carry its prompt -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_preference_pair_without_its_prompt_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "prefs.jsonl", [{"instruction": "What is 2+2?", "chosen": [
        {"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}])
    out = run_cli(["data/prepare.py", "--input", path, "--out_dir", str(tmp_path / "prepared")])
    one_line(out, "prefs.jsonl:1: the pair has no user turn", "'chosen', 'instruction', 'rejected'",
             "rename 'instruction' to 'prompt'")
    assert not os.path.exists(tmp_path / "prepared" / "meta.json")
    out = run_script("train_dpo.py", as_args(data=path, out_dir=tmp_path / "run", init_from="scratch", preset="tiny"),
                     check=False)
    one_line(out, "data error: ", "rename 'instruction' to 'prompt'")
    assert nothing_of_a_run(tmp_path / "run")


# ---- 13: RL with no prompts -------------------------------------------------------------------------------------
RL = dict(init_from="scratch", preset="tiny", reward="tests.rl_rewards:distinct_characters", k=2, prompts_per_step=2,
          max_new_tokens=4, max_iters=1, eval_examples=2)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["data", "val_data"])
def test_rl_on_a_file_with_no_prompts_is_one_line(tmp_path, which):
    empty, prompts = tmp_path / "empty.jsonl", write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Say hi"}])
    empty.write_text("")
    cfg = dict(RL, out_dir=tmp_path / "run", data=prompts, val_data=prompts)
    cfg[which] = empty
    one_line(run_script("train_rl.py", as_args(**cfg), check=False), f"data error: {empty}: no prompts found")
    assert nothing_of_a_run(tmp_path / "run")


@pytest.mark.slow
def test_rl_prompts_too_long_for_the_model_are_one_line(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x" * 3000}, {"prompt": "y" * 3000}])
    out = run_script("train_rl.py", as_args(**RL, out_dir=tmp_path / "run", data=prompts), check=False)
    one_line(out, "p.jsonl:1: the prompt has", "max_seq_len=2048")
    assert nothing_of_a_run(tmp_path / "run")


# ---- 15: a val folder with several splits; one split in two formats -----------------------------------------------
@pytest.mark.slow
def test_val_split_names_a_split_of_a_val_folder(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", chats(10))
    (tmp_path / "val").mkdir()
    write_jsonl(tmp_path / "val" / "test.jsonl", chats(3, 100))
    write_jsonl(tmp_path / "val" / "dev.jsonl", chats(5, 200))
    val = str(tmp_path / "val")
    out = run_cli(["data/prepare.py", "--input", train, "--val_input", val, "--out_dir", str(tmp_path / "p")])
    one_line(out, "several splits among its files; found 'dev', 'test' — choose one with val_split")
    out = run_cli(["data/prepare.py", "--input", train, "--val_input", val, "--val_split", "test", "--out_dir",
                   str(tmp_path / "p")])
    assert out.returncode == 0, out.stderr
    val_data, meta = load(str(tmp_path / "p"), "val")
    assert meta["counts"]["val"]["examples"] == 3 and meta["val_split"] == "test"
    assert meta["counts"]["train"]["examples"] == 10  # the whole input: val_fraction is not applied beside val_input

    run = str(tmp_path / "run")
    cfg = dict(data=train, val_data=val, init_from="scratch", preset="tiny", max_iters=1, batch_size=4,
               eval_examples=0, out_dir=run)
    one_line(run_script("train_sft.py", as_args(**cfg), check=False), "choose one with val_split")
    run_script("train_sft.py", as_args(**cfg, val_split="test"))
    assert load(os.path.join(run, "data"), "val")[1]["counts"]["val"]["examples"] == 3
    one_line(run_script("train_sft.py", [f"--out_dir={run}", "--init_from=resume", "--val_split=dev"], check=False),
             "val_split='dev' differs from the run being resumed (val_split='test')")
    one_line(run_script("train_sft.py", as_args(**dict(cfg, val_data=None, out_dir=tmp_path / "b"), val_split="test"),
                        check=False), "config error: val_split='test'; it picks a split of a val_data folder")


@pytest.mark.slow
def test_one_split_in_two_formats_is_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", chats(10))
    pq.write_table(pa.Table.from_pylist(chats(10)), str(folder / "train.parquet"))
    out = run_cli(["data/prepare.py", "--input", str(folder), "--out_dir", str(tmp_path / "p")])
    one_line(out, f"the split is there in two formats, {folder}/train.jsonl and {folder}/train.parquet")
    assert not os.path.exists(tmp_path / "p")
    out = run_script("train_sft.py", as_args(data=folder, out_dir=tmp_path / "run", init_from="scratch",
                                             preset="tiny"), check=False)
    one_line(out, "data error: ", "in two formats")
    assert nothing_of_a_run(tmp_path / "run")


# ---- 16: bounds ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lora_rank_is_at_most_the_smallest_adapted_dimension(tmp_path):
    """tiny: d_model 64, k_proj and v_proj 64 -> 32 (GQA): rank 32 is the most."""
    model = Transformer(config_from_preset("tiny"))
    with pytest.raises(ValueError, match=r"lora_rank=33 is more than .* \(layers.0.self_attn.k_proj: 64 -> 32\); "
                                         r"choose at most 32"):
        lora.add_adapters(model, 33, 66.0)
    assert not lora.adapted(model) and all(p.requires_grad for p in model.parameters())  # nothing changed
    assert len(lora.adapted(lora.add_adapters(model, 32, 64.0))) == 14
    data = write_jsonl(tmp_path / "chats.jsonl", chats(10))
    cfg = dict(data=data, out_dir=tmp_path / "run", init_from="scratch", preset="tiny", max_iters=1, batch_size=4)
    one_line(run_script("train_sft.py", as_args(**cfg, lora_rank=1000), check=False),
             "model error: lora_rank=1000 is more than the smallest dimension", "choose at most 32")
    assert nothing_of_a_run(tmp_path / "run")


@pytest.mark.slow
def test_qlora_with_nothing_in_nf4_is_an_error(tmp_path):
    pytest.importorskip("torchao")
    model = lora.add_adapters(Transformer(config_from_preset("tiny")), 8, 16.0)  # no weight holds 64 x 256 values
    with pytest.raises(ValueError, match="none of the 14 adapted weights is a multiple of 16384 values"):
        lora.quantize_base(model)
    assert not any(hasattr(m.weight, "quantized_data") for m in lora.adapted(model))
    data = write_jsonl(tmp_path / "chats.jsonl", chats(10))
    out = run_script("train_sft.py", as_args(data=data, out_dir=tmp_path / "run", init_from="scratch", preset="tiny",
                                             lora_rank=8, quantize_base="nf4", max_iters=1, batch_size=4), check=False)
    line = [x for x in out.stderr.splitlines() if x.startswith("model error")]  # torchao may warn on import
    assert out.returncode != 0 and "Traceback" not in out.stderr and len(line) == 1, out.stderr[-3000:]
    assert "QLoRA would be plain LoRA; drop quantize_base" in line[0]
    assert nothing_of_a_run(tmp_path / "run")


@pytest.mark.slow
def test_rl_reports_the_reward_functions_time_apart(tmp_path):
    """tests.rl_rewards:slow sleeps 0.25 s a call: 4 calls a step are >= 1 s of reward_ms, none of it in gen_ms."""
    out_dir = str(tmp_path / "run")
    run_script("train_rl.py", as_args(**dict(RL, out_dir=out_dir, reward="tests.rl_rewards:slow", eval_examples=0)))
    (m,) = step_metrics(out_dir)
    assert m["reward_ms"] >= 1000 and m["gen_ms"] < 1000, m


@pytest.mark.parametrize("fraction", ["1.5", "1", "-0.1"])
def test_val_fraction_outside_0_1_is_one_line(tmp_path, fraction):
    data = write_jsonl(tmp_path / "chats.jsonl", chats(10))
    out = run_cli(["data/prepare.py", "--input", data, "--out_dir", str(tmp_path / "p"), f"--val_fraction={fraction}"])
    one_line(out, f"val_fraction={float(fraction)} must be in [0, 1)")
    assert not os.path.exists(tmp_path / "p")
