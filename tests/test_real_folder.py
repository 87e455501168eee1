"""A real-looking Hugging Face folder in, a real-looking folder out: SFT then DPO from a SmolLM2-style folder
(config.json + model.safetensors written by transformers, a byte-level BPE tokenizer.json that lacks single
bytes, tokenizer_config.json with SmolLM2's chat template, generation_config.json), and the exported folders
load back in transformers with the same logits and the same chat-template ids.
"""

import json
import os

import pytest
import torch

from conftest import run_script, step_metrics

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory):
    from test_tokenizer import FAMILIES, PRE_TOKENIZERS, chat_folder, train_hf
    tmp = tmp_path_factory.mktemp("real")
    pre, norm = PRE_TOKENIZERS["smollm2"]
    trained = {"smollm2": train_hf(tmp, "bpe", pre(), norm() if norm else None)}
    template, style, config, extra = FAMILIES["smollm2"]
    folder = chat_folder(trained, tmp / "SmolLM2-tiny", template, style, config, extra, lacks_bytes=True)
    vocab = json.loads((folder / "tokenizer.json").read_text())
    n_vocab = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])]) + 1
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    cfg = transformers.LlamaConfig(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True, bos_token_id=ids["<|im_start|>"],
                                   eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|im_end|>"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder)  # config.json, model.safetensors, generation_config.json
    assert (folder / "generation_config.json").exists()
    return str(folder)


def chats(path, n=40):
    lines = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                           {"role": "assistant", "content": f"{i}+{i} = {2 * i}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def pairs(path, n=40):
    lines = [{"prompt": f"What is {i}+{i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def assert_round_trips(folder, source):
    from nanopack.hf import from_pretrained
    from nanopack.tokenizer import Tokenizer
    ours, theirs = Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(folder)
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4"},
            {"role": "user", "content": " and 3+3?"}]
    assert ours.render_prompt(conv) == theirs.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
    with open(os.path.join(folder, "config.json")) as f, open(os.path.join(source, "config.json")) as g:
        got, want = json.load(f), json.load(g)
    assert {k: got[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == \
        {k: want[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert os.path.exists(os.path.join(folder, "generation_config.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    ids = torch.tensor(ours.render_prompt(conv))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(folder).eval()(ids), hf(ids[None]).logits[0],
                                   atol=1e-4, rtol=0)


def test_sft_then_dpo_from_a_real_looking_folder(tmp_path, smollm2_folder):
    sft_dir, dpo_dir = str(tmp_path / "sft"), str(tmp_path / "dpo")
    out = run_script("train_sft.py", [f"--init_from={smollm2_folder}", f"--data={chats(tmp_path / 'c.jsonl')}",
                                      f"--out_dir={sft_dir}", "--max_iters=2", "--batch_size=8", "--val_fraction=0.2",
                                      "--log_interval=1"])
    assert "fine-tuning a pretrained model: learning_rate=2e-05" in out.stdout  # not the toy model's 5e-3
    assert step_metrics(sft_dir)[0]["lr"] <= 2e-5
    assert_round_trips(os.path.join(sft_dir, "hf"), smollm2_folder)
    out = run_script("train_dpo.py", [f"--init_from={sft_dir}/hf", f"--data={pairs(tmp_path / 'p.jsonl')}",
                                      f"--out_dir={dpo_dir}", "--max_iters=2", "--batch_size=8", "--val_fraction=0.2",
                                      "--log_interval=1"])
    assert "fine-tuning a pretrained model: learning_rate=5e-07, min_lr=5e-08, beta=0.1, sft_weight=0.0" in out.stdout
    assert_round_trips(os.path.join(dpo_dir, "hf"), smollm2_folder)
