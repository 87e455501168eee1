"""
What a first command by hub name downloads (hub.py), and what a cached name adds to start-up, against a local stand-in
of the hub (tests/hub_fixture.py's server: nothing here reaches the network).

    python bench/bench_hub.py

Two stand-in repos with the file lists of HuggingFaceTB/SmolLM2-135M-Instruct and meta-llama/Llama-3.1-8B-Instruct
(their main branches as recalled: names exact, sizes rounded where marked ~). The files are small stand-ins; the bytes
column is the real repo's sizes of the files the server was asked for (its log). A training command reads the model;
plan.py (fake_step) its config and tokenizer. Start-up: hub.resolve() for a cached name, offline and online (one
repo-info call to a server on this machine: add the round trip to huggingface.co), with huggingface_hub's import (the
first call) and without, against a local folder (resolve returns at once; huggingface_hub is not imported).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from hub_fixture import HubServer, model_repo  # noqa: E402

SMOLLM2 = {".gitattributes": 1_519, "README.md": 4_300, "config.json": 861, "generation_config.json": 132,
           "merges.txt": 466_391, "model.safetensors": 269_060_552, "special_tokens_map.json": 655,
           "tokenizer.json": 2_104_556, "tokenizer_config.json": 3_764, "vocab.json": 800_662,
           "onnx/model.onnx": 540_000_000, "onnx/model_fp16.onnx": 270_000_000, "onnx/model_int8.onnx": 136_000_000,
           "onnx/model_q4.onnx": 170_000_000, "onnx/model_quantized.onnx": 136_000_000}  # onnx/: ~
LLAMA31 = {".gitattributes": 1_519, "LICENSE": 7_627, "README.md": 44_000, "USE_POLICY.md": 4_691,
           "config.json": 855, "generation_config.json": 184, "model-00001-of-00004.safetensors": 4_976_698_672,
           "model-00002-of-00004.safetensors": 4_999_802_720, "model-00003-of-00004.safetensors": 4_915_916_176,
           "model-00004-of-00004.safetensors": 1_168_138_808, "model.safetensors.index.json": 23_950,
           "original/consolidated.00.pth": 16_060_617_592, "original/params.json": 199,
           "original/tokenizer.model": 2_183_982, "special_tokens_map.json": 296, "tokenizer.json": 9_085_657,
           "tokenizer_config.json": 55_351}
LLAMA31_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                      rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192, rope_type="llama3"),
                      bos_token_id=128000, eos_token_id=[128001, 128008, 128009], torch_dtype="bfloat16")


def stand_in(folder, files, config=None):
    """A repo with `files`' names: a tiny real model's config, tokenizer and weights where a run reads them (config:
    the real one, for plan.py), a few bytes elsewhere; the index names the shards."""
    tiny = model_repo(os.path.join(folder + "-tiny"))
    os.makedirs(folder)
    shards = sorted(f for f in files if f.endswith(".safetensors") and f.startswith("model-"))
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(folder, name)) or folder, exist_ok=True)
        if os.path.exists(os.path.join(tiny, name)) and not (name == "config.json" and config):
            shutil.copy(os.path.join(tiny, name), os.path.join(folder, name))
        elif name == "model.safetensors.index.json":
            with open(os.path.join(folder, name), "w") as f:
                json.dump(dict(metadata=dict(total_size=sum(files[s] for s in shards)),
                               weight_map={f"tensor.{i}": s for i, s in enumerate(shards)}), f)
        else:
            with open(os.path.join(folder, name), "w") as f:
                f.write(json.dumps(config) if name == "config.json" else f"stand-in for {name}")  # distinct: the
                # cache keeps one blob per content, and would not ask twice for the same bytes
    return folder


def timed(code, env, n=5):
    """The median over n fresh processes of the seconds `code` prints."""
    runs = [float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                 check=True).stdout.split()[-1]) for _ in range(n)]
    return statistics.median(runs)


def main():
    tmp = tempfile.mkdtemp(prefix="bench-hub-")
    server = HubServer()
    repos = {"HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2, "meta-llama/Llama-3.1-8B-Instruct": LLAMA31}
    for i, (name, files) in enumerate(repos.items()):
        server.add("model", name, stand_in(os.path.join(tmp, f"repo{i}"), files, LLAMA31_CONFIG if i else None))
    env = dict(os.environ, HF_ENDPOINT=server.endpoint, HF_HUB_DISABLE_PROGRESS_BARS="1", HF_TOKEN="")
    print("| repo | command | files asked for | bytes | of the repo's |\n|---|---|---|---|---|")
    for name, files in repos.items():
        for command, plan in (("train_*.py --init_from=<name>", False), ("plan.py ... --init_from=<name>", True)):
            server.log.clear()
            home = os.path.join(tmp, f"home-{len(os.listdir(tmp))}")
            subprocess.run([sys.executable, "-c", f"from nanopack import hub; hub.PLAN = {plan}; hub.resolve(dict(init_from="
                            f"{name!r}))"], cwd=ROOT, env=dict(env, HF_HOME=home), check=True, capture_output=True)
            asked = sorted(server.downloads())
            print(f"| {name} | {command} | {', '.join(asked)} | {sum(files[f] for f in asked) / 1e6:,.2f} MB | "
                  f"{sum(files.values()) / 1e6:,.0f} MB |")
    name, home = "meta-llama/Llama-3.1-8B-Instruct", os.path.join(tmp, "home-startup")
    subprocess.run([sys.executable, "-c", f"from nanopack import hub; hub.resolve(dict(init_from={name!r}))"], cwd=ROOT,
                   env=dict(env, HF_HOME=home), check=True, capture_output=True)
    folder = os.path.join(tmp, "repo1")
    clock = "import time, hub; t = time.perf_counter(); {}; print(time.perf_counter() - t)"
    offline, online = dict(env, HF_HOME=home, HF_HUB_OFFLINE="1"), dict(env, HF_HOME=home)
    resolve = f"hub.resolve(dict(init_from={name!r}))"
    again = f"{resolve}; t = time.perf_counter(); {resolve}"  # the lookup alone, huggingface_hub's modules loaded
    rows = [("a local folder", timed(clock.format(f"hub.resolve(dict(init_from={folder!r}))"), online)),
            ("a cached name, HF_HUB_OFFLINE=1 (huggingface_hub's import included)", timed(clock.format(resolve),
                                                                                          offline)),
            ("... the lookup alone", timed(clock.format(again), offline)),
            ("a cached name, online: a server on this machine (import included)", timed(clock.format(resolve), online)),
            ("... the lookup alone (one repo-info call)", timed(clock.format(again), online))]
    print("\n| init_from | start-up added (median of 5 processes) |\n|---|---|")
    for what, seconds in rows:
        print(f"| {what} | {seconds * 1e3:,.1f} ms |")
    server.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
