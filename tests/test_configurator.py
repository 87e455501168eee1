import pytest

from configurator import ConfigError, apply_overrides, configure


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
    (["no_such_file.py"], "config file 'no_such_file.py' cannot be read"),
])
def test_mistakes_are_one_clear_message(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(defaults(), argv)
    with pytest.raises(SystemExit, match="config error"):
        configure(defaults(), argv)


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


def test_a_lora_setting_without_lora_rank_is_refused():
    """lora_alpha / lora_dropout / lora_targets mean nothing at lora_rank=0: refused in one line, not ignored."""
    cfg = lambda: dict(defaults(), lora_rank=0, lora_alpha=None, lora_dropout=0.0, lora_targets="q_proj")
    with pytest.raises(SystemExit, match=r"lora_dropout=0.1 is set but lora_rank=0 .* set lora_rank"):
        configure(cfg(), ["--lora_dropout=0.1"])
    assert configure(cfg(), ["--lora_dropout=0.1", "--lora_rank=8"])["lora_dropout"] == 0.1
    assert configure(cfg(), ["--batch_size=4"])["batch_size"] == 4
