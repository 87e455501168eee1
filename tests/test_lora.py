"""lora.py against peft on the same Hugging Face models and adapter weights, and its exports read back by
transformers and peft; QLoRA (torchao NF4) on CPU.

Tolerances: float32 throughout. Our LoRA and peft's compute the same products in the same order, so logits agree to
rounding: 1e-5 of the logits' scale (~6 with test_model's large init); a summed loss to 1e-5 relative; each adapter
gradient, a sum over tokens taken in another order, to 1e-5 of its own largest entry. A merged weight W + s B A
reorders the sums of W x + s B (A x): 1e-5 of the logits' scale again."""
import copy
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from nanopack import lora
from nanopack.hf import from_pretrained, save_pretrained
from model import Transformer, config_from_preset
from test_model import hf_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
RANK, ALPHA = 4, 8.0


def peft_name(name):
    return f"base_model.model.model.{name}.default.weight"  # peft's adapter named "default", in memory


def assert_close_to_scale(got, expected, tol=1e-5):
    scale = expected.abs().max()
    torch.testing.assert_close(got / scale, expected / scale, atol=tol, rtol=0)


def lora_pair(kind, tmp_path, targets=lora.TARGETS, dropout=0.0):
    """(our model with adapters, peft's model) on the same base weights, with the same random nonzero A and B."""
    base = hf_model(kind)
    base.save_pretrained(tmp_path / kind)
    ours = lora.add_adapters(from_pretrained(str(tmp_path / kind)), RANK, ALPHA, dropout, targets)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=list(targets))
    theirs = peft.get_peft_model(base, config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in lora.adapter_parameters(ours):
            p.normal_(0, 0.3)  # B nonzero: the adapters change the logits, so the comparison can fail
            theirs.get_parameter(peft_name(name)).copy_(p)
    return ours, theirs.float()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # GQA with its own head; q/k/v biases with tied embeddings
def test_forward_and_gradients_equal_peft(kind, tmp_path):
    ours, theirs = lora_pair(kind, tmp_path)
    ids = torch.randint(0, 203, (24,))
    targets = torch.cat([ids[1:], torch.tensor([-100])])  # the next token; none after the last
    loss, n = ours(ids, targets=targets)
    (loss / n).backward()
    ref = torch.nn.functional.cross_entropy(theirs(ids[None]).logits[0, :-1], ids[1:], reduction="sum")
    (ref / n).backward()
    torch.testing.assert_close(loss, ref, atol=0, rtol=1e-5)
    with torch.no_grad():
        assert_close_to_scale(ours(ids), theirs(ids[None]).logits[0])
    trained = lora.adapter_parameters(ours)
    assert len(trained) == 2 * 7 * 2  # layers x targets x (A, B)
    for name, p in trained:
        g = theirs.get_parameter(peft_name(name)).grad
        scale = g.abs().max().item()
        assert scale > 0, name  # B != 0: every adapter gets a gradient
        torch.testing.assert_close(p.grad / scale, g / scale, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_dropout_on_the_adapter_input_as_peft(tmp_path):
    ours, theirs = lora_pair("llama", tmp_path, dropout=0.3)
    ours.train(), theirs.train()
    ids = torch.randint(0, 203, (24,))
    torch.manual_seed(5)  # the same masks: both draw one per adapted layer, in the order the block calls them
    got = ours(ids)
    torch.manual_seed(5)
    assert_close_to_scale(got, theirs(ids[None]).logits[0])
    with torch.no_grad():
        assert not torch.allclose(got, ours.eval()(ids))  # the dropout acted


def test_only_the_adapters_train():
    torch.manual_seed(0)
    model = Transformer(config_from_preset("tiny"))
    q, names = model.layers[0].self_attn.q_proj, set(model.state_dict())
    w = q.weight
    lora.add_adapters(model, RANK, ALPHA, targets=("q_proj", "down_proj"))
    assert model.layers[0].self_attn.q_proj is q and q.weight is w  # the same module and Parameter: no copy
    adapters = dict(lora.adapter_parameters(model))
    assert sorted(adapters) == sorted(f"layers.{i}.{m}.{ab}" for i in range(2) for ab in ("lora_A", "lora_B")
                                      for m in ("self_attn.q_proj", "mlp.down_proj"))
    assert set(model.state_dict()) == names | set(adapters)  # the base's names are unchanged: HF I/O sees them
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    assert set(dict(lora.base_parameters(model))) | set(adapters) == set(dict(model.named_parameters()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in adapters.values()}
    # peft's initialisation: A kaiming-uniform (bound 1/sqrt(in_features)), B zero
    assert q.lora_A.shape == (RANK, 64) and q.lora_B.shape == (64, RANK) and q.scale == ALPHA / RANK
    assert 0.5 < q.lora_A.abs().max().item() * 64 ** 0.5 <= 1 and not q.lora_B.any()
    loss, n = model(torch.randint(0, 512, (20,)), targets=torch.randint(0, 512, (20,)))
    loss.backward()
    assert all((p.grad is not None) == (name in adapters) for name, p in model.named_parameters())


@pytest.mark.slow
def test_step_zero_is_the_base_and_adapters_off_is_the_base():
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
    with pytest.raises(RuntimeError, match="inside"), lora.adapters_disabled(model):
        raise RuntimeError("inside")
    assert all(m.enabled for m in lora.adapted(model))  # back on after an exception too


def test_built_on_meta_then_placed_equals_built_in_place():
    torch.manual_seed(0)
    direct = lora.add_adapters(Transformer(config_from_preset("tiny")), RANK, ALPHA)
    with torch.device("meta"):  # as before FSDP2's fully_shard: nothing allocated, nothing initialised
        model = lora.add_adapters(Transformer(config_from_preset("tiny")), RANK, ALPHA)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in lora.base_parameters(model):  # as load_hf_weights fills the base
            p.copy_(direct.get_parameter(name))
    lora.init_adapters(model)
    for name, t in direct.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(dict(lora.adapter_parameters(model)))


@pytest.mark.slow
def test_merged_and_peft_exports_load_with_equal_logits(tmp_path):
    targets = ("q_proj", "v_proj", "down_proj")
    ours, theirs = lora_pair("llama", tmp_path, targets=targets)
    ids = torch.randint(0, 203, (30,))
    with torch.no_grad():
        expected = ours(ids)
        state = lora.merged_state_dict(ours)
        assert set(state) == set(dict(lora.base_parameters(ours)))  # the base's names, no lora_ entries
        plain = Transformer(ours.config)
        plain.load_state_dict(state)
        assert_close_to_scale(plain(ids), expected)
        save_pretrained(ours, str(tmp_path / "merged"), state=state)
        assert_close_to_scale(from_pretrained(str(tmp_path / "merged"))(ids), expected)
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
        assert_close_to_scale(hf_merged(ids[None]).logits[0], expected)
        lora.save_adapter(ours, str(tmp_path / "adapter"), str(tmp_path / "llama"), RANK, ALPHA, 0.0, list(targets))
        saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
        names = peft.get_peft_model_state_dict(theirs)  # peft's own names and shapes for these adapters
        assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in names.items()}
        base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama")).float()
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        assert_close_to_scale(loaded(ids[None]).logits[0], expected)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "llama") and config["r"] == RANK
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"


def test_unknown_targets_are_named_with_the_layers_that_exist():
    c = dict(lora_rank=RANK, lora_alpha=None, lora_dropout=0.0, lora_targets="q_proj,qproj,mlp", quantize_base="")
    with pytest.raises(ValueError, match="no layer is called 'qproj', 'mlp'; a block's linear layers are q_proj,k_"):
        lora.check_settings(c)
    lora.check_settings(dict(c, lora_targets="q_proj,v_proj"))


def test_a_lora_setting_without_lora_rank_is_refused():
    """lora_alpha / lora_dropout / lora_targets mean nothing at lora_rank=0: refused in one line, not ignored."""
    c = dict(lora_rank=0, lora_alpha=None, lora_dropout=0.1, lora_targets=",".join(lora.TARGETS), quantize_base="")
    with pytest.raises(ValueError, match=r"lora_dropout=0.1; it is set but lora_rank=0 .* set lora_rank"):
        lora.check_settings(c)
    lora.check_settings(dict(c, lora_rank=8))
    lora.check_settings(dict(c, lora_dropout=0.0))


def test_quantize_base_without_torchao_says_how_to_install(monkeypatch):
    model = lora.add_adapters(Transformer(config_from_preset("tiny")), RANK, ALPHA)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # an import of it now fails, as if absent
    with pytest.raises(ImportError, match=r"^quantize_base='nf4' needs torchao: pip install torchao$"):
        lora.quantize_base(model)


def qlora_pair():
    """(a toy model with nonzero adapters and its base in NF4, the same model in float32 with the NF4-rounded base
    weights, the same one with its original float32 base weights, the names NF4 could not take)."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    original = lora.add_adapters(Transformer(config_from_preset("toy", n_layer=2)), 8, 16.0)
    with torch.no_grad():
        for m in lora.adapted(original):
            m.lora_B.normal_(0, 0.02)
    model, rounded = copy.deepcopy(original), copy.deepcopy(original)
    kept = lora.quantize_base(model)
    with torch.no_grad():
        for m, r in zip(lora.adapted(model), lora.adapted(rounded)):
            r.weight.copy_(lora.dense(m.weight))
    return model, rounded, original, kept


@pytest.mark.slow
def test_nf4_base_forward_and_backward_are_the_rounded_float_layer():
    model, rounded, _, _ = qlora_pair()
    q, ref = model.layers[0].self_attn.q_proj, rounded.layers[0].self_attn.q_proj
    assert type(q.weight).__name__ == "NF4Tensor" and isinstance(q.weight, torch.nn.Parameter)
    assert not q.weight.requires_grad
    x = torch.randn(10, 128, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = q(x), ref(x_ref)
    assert torch.equal(y, y_ref)  # F.linear dequantises the NF4 weight, then the same matmul
    (y * y).sum().backward()
    (y_ref * y_ref).sum().backward()
    for got, want in ((x.grad, x_ref.grad), (q.lora_A.grad, ref.lora_A.grad), (q.lora_B.grad, ref.lora_B.grad)):
        assert got.abs().max() > 0
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)  # the same products, maybe summed in another order
    assert q.weight.grad is None


@pytest.mark.slow
def test_qlora_on_cpu_rounds_the_base_and_trains(capsys):
    model, rounded, original, kept = qlora_pair()
    # toy: k/v weights (64 x 128 = 8192 values) do not fill NF4's 64 x 256 blocks and stay float32, said in one line
    assert sorted({k.rsplit(".", 1)[1] for k in kept}) == ["k_proj", "v_proj"] and len(kept) == 4
    assert all(model.get_parameter(f"{k}.weight").dtype == torch.float32 for k in kept)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("quantize_base:")]
    assert len(said) == 1 and "4 weight(s) stay in torch.float32" in said[0] and kept[0] in said[0]
    ids = torch.randint(0, 512, (256,))
    with torch.no_grad():
        got, want, before = model(ids), rounded(ids), original(ids)
    assert torch.equal(got, want)  # the NF4 base is the float base with rounded weights, and nothing else
    weight_err = max(((lora.dense(m.weight) - r.weight).norm() / r.weight.norm()).item()
                     for m, r in zip(lora.adapted(model), lora.adapted(original)) if m.weight is not r.weight)
    logit_err = ((got - before).norm() / before.norm()).item()
    gap, scale = (got - before).abs().max().item(), before.abs().max().item()
    print(f"NF4 base vs float base: max logit gap {gap:.4f} (logits' scale {scale:.2f}); relative rms: "
          f"logits {logit_err:.3f}, weights {weight_err:.3f}")
    # 4-bit codes with one scale per 64 values round a Gaussian weight by ~1/10 of its rms; a random network passes
    # relative weight noise on to its logits at about the same relative size: twice that would not be rounding
    assert 0 < weight_err < 0.15 and 0 < logit_err < 2 * weight_err
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss, n = model(ids, targets=ids.roll(-1))
        (loss / n).backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss / n).item())
    assert losses[-1] < losses[0] - 0.5, losses
    with torch.no_grad():  # the merged export of a QLoRA model: NF4 dequantised, then W + s B A
        plain = Transformer(model.config)
        plain.load_state_dict(lora.merged_state_dict(model))
        assert_close_to_scale(plain(ids), model(ids))
