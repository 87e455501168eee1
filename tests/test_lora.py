"""lora.py against peft on the same Hugging Face models and adapter weights, and its exports read back by
transformers and peft. float32 throughout: our LoRA and peft's compute the same products in the same order up to
the packed-vs-batched attention path, so logits agree to rounding (~1e-6 of logits of magnitude ~10: 1e-4 abs)."""
import json

import pytest
import torch

import lora
from hf import from_pretrained, save_pretrained
from model import Transformer, config_from_preset
from test_model import hf_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
RANK, ALPHA = 4, 8.0


def peft_name(name):
    return f"base_model.model.model.{name}.default.weight"  # peft's adapter named "default", in memory


def lora_pair(kind, tmp_path, targets=lora.TARGETS):
    """(our model with adapters, peft's model) on the same base weights, with the same random nonzero A and B."""
    base = hf_model(kind)
    base.save_pretrained(tmp_path / kind)
    ours = lora.add_adapters(from_pretrained(str(tmp_path / kind)), RANK, ALPHA, targets=targets)
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets)))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.normal_(0, 0.3)  # B nonzero: the adapters change the logits, so the comparison can fail
                theirs.get_parameter(peft_name(name)).copy_(p)
    return ours, theirs.float()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # GQA with its own head; q/k/v biases with tied embeddings
def test_forward_and_gradients_equal_peft(kind, tmp_path):
    ours, theirs = lora_pair(kind, tmp_path)
    ids = torch.randint(0, 203, (24,))
    targets = torch.cat([ids[1:], torch.tensor([-100])])  # the next token; none after the last
    loss, n = ours(ids, targets=targets)
    (loss / n).backward()
    ref = torch.nn.functional.cross_entropy(theirs(ids[None]).logits[0, :-1], ids[1:], reduction="sum")
    (ref / n).backward()
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours(ids), theirs(ids[None]).logits[0], atol=1e-4, rtol=0)
    trained = [(n, p) for n, p in ours.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 7 * 2 and all(n.endswith(("lora_A", "lora_B")) for n, _ in trained)
    for name, p in trained:
        g = theirs.get_parameter(peft_name(name)).grad
        scale = g.abs().max().item()
        torch.testing.assert_close(p.grad / scale, g / scale, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_step_zero_is_the_base_and_adapters_off_is_the_base(tmp_path):
    torch.manual_seed(0)
    base = Transformer(config_from_preset("tiny"))
    ids = torch.randint(0, 512, (40,))
    expected = base(ids)
    model = lora.add_adapters(base, RANK, ALPHA)
    assert torch.equal(model(ids), expected)  # B = 0
    with torch.no_grad():
        for m in lora.adapted(model):
            m.lora_B.normal_()
    assert not torch.allclose(model(ids), expected)
    with lora.adapters_disabled(model):
        assert torch.equal(model(ids), expected)
    assert not torch.allclose(model(ids), expected)  # back on


def test_merged_and_peft_exports_load_with_equal_logits(tmp_path):
    ours, theirs = lora_pair("llama", tmp_path, targets=("q_proj", "v_proj", "down_proj"))
    ids = torch.randint(0, 203, (30,))
    with torch.no_grad():
        expected = ours(ids)
        save_pretrained(ours, str(tmp_path / "merged"), state=lora.merged_state_dict(ours))
        merged = from_pretrained(str(tmp_path / "merged"))
        # (W + s B A) x vs W x + s B (A x): the same sums in another order, 1e-5 of the logits' scale (~20)
        scale = expected.abs().max()
        torch.testing.assert_close(merged(ids) / scale, expected / scale, atol=1e-5, rtol=0)
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
        torch.testing.assert_close(hf_merged(ids[None]).logits[0], expected, atol=1e-4, rtol=1e-5)
        lora.save_adapter(ours, str(tmp_path / "adapter"), str(tmp_path / "llama"), RANK, ALPHA, 0.0,
                          ["q_proj", "v_proj", "down_proj"])
        base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama")).float()
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        torch.testing.assert_close(loaded(ids[None]).logits[0], expected, atol=1e-4, rtol=1e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "llama") and config["r"] == RANK


def test_unknown_target_names_the_layers():
    with pytest.raises(ValueError, match="no layer is called 'qproj'; a block's linear layers are q_proj, k_proj"):
        lora.add_adapters(Transformer(config_from_preset("tiny")), RANK, ALPHA, targets=("qproj",))


def test_qlora_on_cpu_rounds_the_base_and_trains():
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = lora.add_adapters(Transformer(config_from_preset("toy", n_layer=2)), 8, 16.0)
    ids = torch.randint(0, 512, (256,))
    with torch.no_grad():
        before = model(ids)
    kept = lora.quantize_base(model)
    # toy: k/v weights (64 x 128 = 8192 values) do not fill NF4's 64 x 256 blocks and stay float32
    assert sorted({k.rsplit(".", 1)[1] for k in kept}) == ["k_proj", "v_proj"]
    assert type(model.layers[0].self_attn.q_proj.weight).__name__ == "NF4Tensor"
    with torch.no_grad():
        gap = (model(ids) - before).abs().max().item()
    print(f"NF4 base vs float base: max logit gap {gap:.4f}, logits' scale {before.abs().max().item():.2f}")
    # 4-bit rounding of N(0, 0.02) weights moves each by ~5% of its size; the logits (~1) move by a few 1e-2
    assert 0 < gap < 0.1 * before.abs().max().item()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss, n = model(ids, targets=ids.roll(-1))
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss / n).item())
    assert losses[-1] < losses[0] - 0.5, losses
