import ast
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from nanopack import keys
from nanopack.configurator import ConfigError, apply_overrides, configure, declared, is_key


def defaults():
    return dict(batch_size=32, learning_rate=3e-4, compile=False, init_from="scratch", max_iters=None)


def test_overrides_files_then_arguments(tmp_path):
    preset = tmp_path / "preset.py"
    preset.write_text("batch_size = 64\nlearning_rate = 1  # an int where a float is expected is fine\n")
    cfg = defaults()
    values = apply_overrides(cfg, [str(preset), "--compile=True", "--init_from=resume", "--max_iters=10"])
    assert cfg["batch_size"] == 64 and cfg["learning_rate"] == 1.0 and isinstance(cfg["learning_rate"], float)
    assert cfg["compile"] is True and cfg["init_from"] == "resume" and cfg["max_iters"] == 10
    assert values == cfg


@pytest.mark.parametrize("argv, message", [
    (["--bach_size=3"], "unknown config key 'bach_size'"),
    (["--batch_size=3.5"], "batch_size=3.5 is of type float, but batch_size must be of type int"),
    (["--compile=1"], "compile=1 is of type int, but compile must be of type bool"),
    (["--batch_size"], "write --key=value"),
    (["no_such_file.py"], "argument 'no_such_file.py': no such config file (a .py file), and not --key=value"),
    (["chats.jsonl"], "argument 'chats.jsonl': a config file is a .py file that exists; is it data? pass "
                      "--data=chats.jsonl"),
])
def test_mistakes_are_one_clear_message(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        apply_overrides(defaults(), argv)
    with pytest.raises(SystemExit, match="config error"):
        configure(defaults(), argv)


def test_a_dict_key_takes_a_python_dict_or_json():
    """--chat_template_kwargs as the scripts' docs write it (a Python dict) or as data/prepare.py's (JSON): the same
    dict; text that is neither is one line."""
    for text in ("{'enable_thinking': False}", '{"enable_thinking": false}'):
        assert configure(dict(chat_template_kwargs={}), [f"--chat_template_kwargs={text}"]) == dict(
            chat_template_kwargs=dict(enable_thinking=False))
    with pytest.raises(SystemExit, match=re.escape("chat_template_kwargs='{enable_thinking: no}' is neither a Python "
                                                   "dict ({'enable_thinking': False}) nor JSON")):
        configure(dict(chat_template_kwargs={}), ["--chat_template_kwargs={enable_thinking: no}"])


def test_unknown_key_in_a_config_file_names_the_file(tmp_path):
    preset = tmp_path / "bad.py"
    preset.write_text("learning_rat = 0.1\n")
    with pytest.raises(ConfigError, match=f"config file {preset}: unknown config key 'learning_rat'"):
        apply_overrides(defaults(), [str(preset)])


def test_a_pretrained_start_gets_fine_tuning_values_unless_set(tmp_path, capsys):
    real, ours = tmp_path / "real", tmp_path / "ours"
    real.mkdir()
    ours.mkdir()
    (real / "tokenizer.json").write_text("{}")  # a real checkpoint ships its tokenizer; our toy exports do not
    finetune = dict(learning_rate=2e-5, batch_size=8)
    cfg = configure(defaults(), [f"--init_from={real}", "--batch_size=16"], finetune=finetune)
    assert cfg["learning_rate"] == 2e-5 and cfg["batch_size"] == 16  # what the user set wins
    assert "fine-tuning a pretrained model: learning_rate=2e-05 (defaults for real models" in capsys.readouterr().out
    for start in (str(ours), "scratch"):
        assert configure(defaults(), [f"--init_from={start}"], finetune=finetune)["learning_rate"] == 3e-4


def test_rules_bools_and_strings_as_typed():
    """--compile=true is True (not a crash), --compile=maybe a choice error, a number for a string key its text."""
    cfg = lambda: dict(compile="auto", run_name="x", lr=0.1, min_lr=0.0)
    rules = dict(compile=("auto", True, False), lr="(0, inf)", min_lr="[0, lr]")
    assert configure(cfg(), ["--compile=true", "--run_name=123"], rules=rules) == dict(cfg(), compile=True,
                                                                                      run_name="123")
    for argv, message in ((["--compile=maybe"], "compile='maybe'; choose one of auto, True, False"),
                          (["--lr=0"], "lr=0.0; it must be a finite number greater than 0"),
                          (["--min_lr=0.5"], "min_lr=0.5; it must be in [0, lr] (lr=0.1)")):
        with pytest.raises(SystemExit, match=re.escape(f"config error: {message}")):
            configure(cfg(), argv, rules=rules)


def test_a_key_the_chosen_value_does_not_read_is_one_line(tmp_path):
    """The reported case (issue 51): TRL's GRPO beta is the KL weight, ours online DPO's, so
    --loss=grpo --beta=0.04 trained with no KL term. A key set explicitly (an argument or a
    config file) that the chosen loss does not read is one line naming what reads it."""
    cfg = lambda: dict(loss="grpo", beta=0.1, kl_coef=0.0)
    hint = "kl_coef is the KL weight here; beta is online DPO's"
    read_by = dict(beta=("loss", ("online_dpo",), hint), kl_coef=("loss", ("grpo", "dapo"), ""))
    config_file = tmp_path / "c.py"
    config_file.write_text("beta = 0.04\n")
    beta = (f"beta=0.04 does nothing with loss='grpo': only loss 'online_dpo' reads it ({hint}); "
            "drop beta, or choose such a loss")
    kl = ("kl_coef=0.1 does nothing with loss='online_dpo': only loss 'grpo' or 'dapo' reads it; "
          "drop kl_coef")
    for argv, message in ((["--beta=0.04"], beta), ([str(config_file)], beta),
                          (["--loss=online_dpo", "--kl_coef=0.1"], kl)):
        with pytest.raises(SystemExit, match=re.escape(f"config error: {message}")):
            configure(cfg(), argv, read_by=read_by)
    assert configure(cfg(), ["--kl_coef=0.1"], read_by=read_by)["kl_coef"] == 0.1
    assert configure(cfg(), ["--loss=online_dpo", "--beta=0.2"], read_by=read_by)["beta"] == 0.2


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_sft.py", "train_dpo.py", "train_rl.py", "sample.py"])
def test_help_lists_every_key_with_its_default_and_comment(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr, out.stderr
    keys = [line.split("=")[0].strip() for line in out.stdout.splitlines() if line.startswith("  --")]
    assert "--seed" in keys and len(keys) == len(set(keys)) >= 10
    assert ("--max_new_tokens" in keys) == (script in ("train_rl.py", "sample.py"))
    # the machinery's keys after the script's own, in every training script
    assert ("--wandb_project" in keys) == script.startswith("train_")
    if script == "train_sft.py":
        assert "  --batch_size=32  # examples per optimizer step, all ranks together" in out.stdout
        assert "  # LoRA (0 = full fine-tuning)" in out.stdout  # a comment of the block, as written


def own_keys(script):
    """The keys a training script declares itself: its globals above `config = configure(`."""
    text = open(f"{ROOT}/{script}").read()
    block = text[:text.index("\nconfig = configure(")]
    return {node.targets[0].id for node in ast.parse(block).body if isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name) and is_key(node.targets[0].id, 0)}


@pytest.mark.parametrize("script", ["train_sft.py", "train_dpo.py", "train_rl.py"])
def test_machinery_keys_are_declared_once(script):
    """A training script declares its own keys (at most 42: train_rl.py's GRPO family, online DPO,
    distillation, the sampler correction and environments), none of nanopack/keys.py's, and takes both."""
    own, machinery = own_keys(script), set(declared(keys))
    assert len(own) <= 42 and not own & machinery, (len(own), own & machinery)
    assert "machinery=keys" in open(f"{ROOT}/{script}").read()


def test_a_machinery_key_is_set_by_a_file_or_an_argument_and_checked(tmp_path):
    """The machinery's keys come back in the values, set as the script's own are; the script's
    globals keep only the script's keys."""
    config_file = tmp_path / "c.py"
    config_file.write_text("seed = 7\nbatch_size = 8\n")
    script = defaults()
    values = configure(script, [str(config_file), "--device=cpu", "--max_iters=3"], machinery=keys,
                       rules=keys.RULES)
    assert values["seed"] == 7 and values["device"] == "cpu"
    assert values["wandb_project"] == "nanopack"
    assert script == dict(defaults(), batch_size=8, max_iters=3)
    for argv, message in (
            (["--dtype=float16"], "dtype='float16'; choose one of auto, bfloat16, float32"),
            (["--seed=-1"], "seed=-1; it must be in [0, 2**32)"),
            (["--lora_rnk=4"], "unknown config key 'lora_rnk' (similar: lora_rank, lora_alpha")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            configure(defaults(), argv, machinery=keys, rules=keys.RULES)
