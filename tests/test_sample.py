import torch

from model import ModelConfig, Transformer
from sample import generate


def test_batched_greedy_generation_equals_one_prompt_at_a_time():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64,
                                    max_seq_len=64)).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    got = generate(model, prompts, max_new_tokens=6)
    for prompt, out in zip(prompts, got):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):  # the reference: full forward of this prompt alone, argmax of the last logits
                seq.append(int(model(torch.tensor(seq))[-1].argmax()))
        assert out == seq[len(prompt):]
    # a stop token ends that sequence only, and is returned
    stop = got[1][2]
    stopped = generate(model, prompts, max_new_tokens=6, stop_ids=[stop])
    assert stopped[1] == got[1][:got[1].index(stop) + 1]


def test_sampling_is_seeded_and_respects_top_k():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, ffn_hidden=32, max_seq_len=64))
    runs = [generate(model, [[1, 2]], 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
            for _ in range(2)]
    assert runs[0] == runs[1]
    with torch.no_grad():
        top5 = set(model(torch.tensor([1, 2]))[-1].topk(5).indices.tolist())
    assert runs[0][0][0] in top5


def test_a_checkpoint_brings_its_own_tokenizer(tmp_path):
    """sample.py --model=out/x/ckpt.pt talks with the tokenizer the run trained with (it used to fall back to the
    byte tokenizer)."""
    from dataclasses import asdict
    from test_tokenizer import PRE_TOKENIZERS, train_hf

    from sample import load_model
    pre, _ = PRE_TOKENIZERS["gpt2"]
    _, folder = train_hf(tmp_path, "tok", pre(), merges=100)
    model = Transformer(ModelConfig(vocab_size=400, n_layer=1, n_head=2, d_model=16, ffn_hidden=32, max_seq_len=64))
    torch.save(dict(model=model.state_dict(), model_config=asdict(model.config), tokenizer=str(folder),
                    optimizer={}), tmp_path / "ckpt.pt")
    loaded, tok = load_model(str(tmp_path / "ckpt.pt"), "cpu")
    assert tok.name == str(folder) and tok.vocab_size > 256  # the trained BPE, not the 261-token byte tokenizer
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
