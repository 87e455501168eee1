"""Hub names (hub.py): `org/name[@revision]` for models and data resolves to the local snapshot folder, downloading only
what a run reads, one line per failure, the commit recorded with the run and read again on resume. Nothing here touches
the real hub: a hub cache laid out in a temp HF_HOME with HF_HUB_OFFLINE=1, or a local server (tests/hub_fixture.py)
that HF_ENDPOINT points at."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nanopack import hub
from conftest import ROOT, as_args, step_metrics
from hub_fixture import HubServer, dataset_repos, lay_out_cache, model_repo

pytest.importorskip("huggingface_hub")
MODEL = "nanopack-test/tiny-chat"
ROUTED_NOWHERE = "http://127.0.0.1:9"  # the discard port: were anything to reach for the network, it fails at once


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """Two commits of one model repo (different weights), and the dataset repos."""
    root = tmp_path_factory.mktemp("repos")
    shutil.copytree(model_repo(str(root / "model")), root / "bin-only", ignore=shutil.ignore_patterns("*.safetensors"))
    return dict(bin_only=str(root / "bin-only"), model=str(root / "model"),
                model_v2=model_repo(str(root / "model_v2"), seed=1),
                sharded=model_repo(str(root / "sharded"), shard_bytes=100_000), **dataset_repos(str(root / "datasets")))


@pytest.fixture(scope="module")
def server(repos):
    s = HubServer()
    s.add("model", MODEL, repos["model"])
    for name in ("nanopack-test/chats", "nanopack-test/prefs", "nanopack-test/prompts", "nanopack-test/scripted",
                 "nanopack-test/math", "nanopack-test/globbed", "nanopack-test/listed"):
        s.add("dataset", name, repos[name])
    s.add("dataset", "nanopack-test/converted", repos["nanopack-test/converted"], revisions=("refs/convert/parquet",))
    s.add("model", "nanopack-test/sharded", repos["sharded"])
    s.add("model", "nanopack-test/bin-only", repos["bin_only"])
    s.add("model", "nanopack-test/gated", repos["model"])
    s.gated.add("nanopack-test/gated")
    s.add("model", "nanopack-test/dropped", repos["model"])
    s.drop.add("nanopack-test/dropped")
    yield s
    s.close()


@pytest.fixture
def use_hub(tmp_path, monkeypatch):
    """huggingface_hub in this process pointed at a temp cache and at `endpoint` (it reads its environment once, when
    imported: its constants are patched), no token from this machine."""
    from huggingface_hub import constants

    def use(endpoint=ROUTED_NOWHERE, offline=False):
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "home" / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "harnesses.json"), raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        return str(tmp_path / "home" / "hub")
    return use


def offline_env(home):
    return dict(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_ENDPOINT=ROUTED_NOWHERE, HF_HUB_DISABLE_PROGRESS_BARS="1",
                HF_TOKEN="")


def cached(home, repos, commit_of):
    """HF_HOME/hub holding the model (main) and the datasets, each at the commit commit_of gives its folder."""
    cache = os.path.join(home, "hub")
    lay_out_cache(cache, "model", MODEL, repos["model"], commit_of["model"])
    for name in ("nanopack-test/chats", "nanopack-test/prefs", "nanopack-test/prompts"):
        lay_out_cache(cache, "dataset", name, repos[name], commit_of[name])
    return cache


COMMITS = {"model": "a" * 40, "model_v2": "b" * 40, "nanopack-test/chats": "c" * 40, "nanopack-test/prefs": "d" * 40,
           "nanopack-test/prompts": "e" * 40}


def test_names_and_paths(tmp_path, monkeypatch):
    assert hub.parse("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None, None)
    assert hub.parse("meta-llama/Llama-3.1-8B@v1.0") == ("meta-llama/Llama-3.1-8B", None, "v1.0")
    assert hub.parse("openai/gsm8k/main@refs/convert/parquet", dataset=True) == ("openai/gsm8k", "main",
                                                                                  "refs/convert/parquet")
    for path in ("out/sft/hf", "data/chats.jsonl", "/models/x", "~/models/x", "./a/b", "builtin", "scratch", "a--b/c",
                 "data/*.parquet", "out/sft/ckpt.pt"):
        assert hub.parse(path) is None, path  # as today: whatever reads it says it is not there
    monkeypatch.chdir(tmp_path)
    os.makedirs(MODEL)
    assert hub.parse(MODEL) is None  # a local folder of the same name wins
    assert hub.resolve(dict(init_from=MODEL, data="builtin")) == ({}, {})  # nothing imported, nothing fetched


def test_downloads_only_what_a_run_reads(server, use_hub):
    """A model: config, generation config, tokenizer files and the safetensors, never the .bin, original/ or GGUF
    decoys beside them; a dataset: the asked split's shards (and its card), not the other splits'."""
    use_hub(server.endpoint)
    server.log.clear()
    folders, pins = hub.resolve(dict(init_from=MODEL, data="nanopack-test/prefs", data_split="train_prefs",
                                     val_data="nanopack-test/prefs", val_split="test_prefs"))
    assert sorted(server.downloads()) == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
        "README.md", "data/train_prefs-00000-of-00001.parquet", "data/test_prefs-00000-of-00001.parquet"])
    assert sorted(os.listdir(folders["init_from"])) == ["config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]
    commit = pins["init_from"].split("@")[1]
    assert folders["init_from"].endswith(os.path.join("models--nanopack-test--tiny-chat", "snapshots", commit))
    assert folders["data"] == folders["val_data"] and folders["data"].endswith("data")
    server.log.clear()  # again: all in the cache, only the hub's answer of which commit main is
    assert hub.resolve(dict(init_from=MODEL)) == ({"init_from": folders["init_from"]}, {"init_from": pins["init_from"]})
    assert server.downloads() == []


@pytest.mark.parametrize("values, line", [
    (dict(init_from="nanopack-test/gated"), "nanopack-test/gated is gated or needs a login (401): accept its licence "
                                            "on http://127.0.0.1:"),  # the endpoint's page of the repo
    (dict(init_from="nanopack-test/gated"), "/nanopack-test/gated, then log in with `hf auth login` (or set HF_TOKEN)"),
    (dict(init_from="nanopack-test/dropped"), "cannot reach the hub at http://127.0.0.1:"),
    (dict(init_from="nanopack-test/missing"), "no model repo nanopack-test/missing on the hub"),
    (dict(init_from="nanopack-test/bin-only"), "no safetensors weights (model.safetensors or "
                                               "model.safetensors.index.json) at its root, only model-q4.gguf, "
                                               "original/consolidated.00.pth, pytorch_model.bin; nanopack reads "
                                               "safetensors only"),
    (dict(init_from=MODEL + "@v9"), "nanopack-test/tiny-chat has no revision 'v9' (a branch, tag or commit)"),
    (dict(data="nanopack-test/prefs"), "several splits (test_prefs, train_prefs, train_sft): choose one with "
                                       "--data_split"),
    (dict(data="nanopack-test/prefs", data_split="test"), "no split 'test'; its splits: test_prefs, train_prefs"),
    (dict(data="nanopack-test/scripted"), "a loading script (its .py), which needs `datasets`: download its data by "
                                          "hand, or read the hub's Parquet conversion, --data=nanopack-test/scripted/"
                                          "<config>/<split>@refs/convert/parquet"),
    (dict(data="nanopack-test/math"), "configs main, socratic and none is the default: name one, "
                                      "--data=nanopack-test/math/main"),
    (dict(data="nanopack-test/math/main"), "several splits (test, train): choose one with --data_split"),
    (dict(data="nanopack-test/math/Main"), "nanopack-test/math: no config 'Main' (main, socratic): name one, e.g. "
                                           "--data=nanopack-test/math/main"),
])
def test_hub_failures_are_one_line(server, use_hub, values, line):
    use_hub(server.endpoint)
    with pytest.raises(SystemExit) as e:
        hub.resolve(values)
    assert line in e.value.code and "\n" not in e.value.code and e.value.code.startswith("hub: ")


def test_sharded_weights_and_dataset_configs(server, use_hub):
    """A sharded model: the shards its index names, not a consolidated.safetensors beside them; a config named after
    the repo (gsm8k's main); the hub's Parquet conversion, a revision with slashes and a folder a split."""
    use_hub(server.endpoint)
    server.log.clear()
    folders, _ = hub.resolve(dict(init_from="nanopack-test/sharded", data="nanopack-test/math/main", data_split="test",
                                  val_data="nanopack-test/converted/default/train@refs/convert/parquet"))
    with open(os.path.join(folders["init_from"], hub.INDEX)) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 1 and sorted(f for f in server.downloads() if f.endswith("safetensors")) == shards
    assert os.path.basename(folders["data"]) == "main"
    assert os.listdir(folders["data"]) == ["test-00000-of-00001.parquet"]  # the config's asked split only
    assert sorted(os.listdir(folders["val_data"])) == ["0000.parquet", "0001.parquet"]
    from data.prepare import data_files
    assert len(data_files(folders["val_data"])) == 2 and len(data_files(folders["data"], "test")) == 1


@pytest.mark.parametrize("data, split", [("nanopack-test/globbed", None), ("nanopack-test/globbed", "train"),
                                         ("nanopack-test/listed", None), ("nanopack-test/listed", "train"),
                                         ("nanopack-test/converted/default@refs/convert/parquet", "train")])
def test_one_split_as_the_card_or_the_conversion_lays_it_out(server, use_hub, data, split):
    """A README's one split as a glob or a list of files is read as `datasets` reads it: one split, 'train', its files
    and no others; the Parquet conversion's <config>/<split>/NNNN.parquet: the split is the folder."""
    from data.records import data_files, read_records
    use_hub(server.endpoint)
    folders, _ = hub.resolve(dict(data=data, data_split=split))
    assert folders["data_split"] is None  # the run reads the split's own files
    files = data_files(folders["data"], folders["data_split"])
    assert len(list(read_records(files, verbose=False))) == (6 if "converted" not in data else 8)
    assert [os.path.basename(f) for f in files] in (["a.jsonl", "b.jsonl"], ["0000.parquet", "0001.parquet"])


@pytest.mark.slow
def test_prepare_takes_hub_names(tmp_path, repos):
    """data/prepare.py reads --input, --val_input and --tokenizer by hub name, as the scripts do."""
    env = {**os.environ, **offline_env(tmp_path / "home")}
    cached(str(tmp_path / "home"), repos, COMMITS)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data", "prepare.py"), "--input", "nanopack-test/chats",
                        "--data_split", "train", "--val_input", "nanopack-test/chats", "--val_split", "test",
                        "--tokenizer", MODEL, "--out_dir", str(tmp_path / "out")], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    meta = json.load(open(tmp_path / "out" / "meta.json"))
    assert (meta["counts"]["train"]["examples"], meta["counts"]["val"]["examples"]) == (24, 4)
    assert meta["vocab_size"] == 258 and f"hub: tokenizer={MODEL} is commit {'a' * 40}" in r.stdout


def test_offline_split_never_downloaded(tmp_path, repos, use_hub):
    """Offline, a split the cache lacks (only another was read online) is the cache's gap, not the repo's."""
    cache = use_hub(offline=True)
    shutil.copytree(repos["nanopack-test/prefs"], tmp_path / "prefs",
                    ignore=shutil.ignore_patterns("test_prefs-*"))
    lay_out_cache(cache, "dataset", "nanopack-test/prefs", str(tmp_path / "prefs"), COMMITS["nanopack-test/prefs"])
    shutil.copytree(repos["nanopack-test/chats"], tmp_path / "chats", ignore=shutil.ignore_patterns("test-*"))
    lay_out_cache(cache, "dataset", "nanopack-test/chats", str(tmp_path / "chats"), COMMITS["nanopack-test/chats"])
    for name, split in (("nanopack-test/prefs", "test_prefs"), ("nanopack-test/chats", "test")):
        with pytest.raises(SystemExit) as e:
            hub.resolve(dict(data=name, data_split=split))
        assert f"the cached snapshot holds no file of the split '{split}') and HF_HUB_OFFLINE=1 forbids " \
               f"downloading: run once online" in e.value.code
    assert hub.resolve(dict(data="nanopack-test/chats", data_split="train"))[0]["data"].endswith("data")


def test_offline_lines_say_what_is_missing(tmp_path, repos, use_hub, monkeypatch):
    """Offline: a model cached as plan.py left it (config and tokenizer, no weights) says the weights were never
    downloaded; a two-part relative path that is not there says so first."""
    cache = use_hub(offline=True)
    shutil.copytree(repos["model"], tmp_path / "planned", ignore=shutil.ignore_patterns("*.safetensors", "*.bin",
                                                                                       "*.pth", "*.gguf"))
    lay_out_cache(cache, "model", MODEL, str(tmp_path / "planned"), COMMITS["model"])
    monkeypatch.chdir(tmp_path)
    for values, line in ((dict(init_from=MODEL), "holds no weights: they were never downloaded (plan.py reads "
                                                 "config.json and the tokenizer only)) and HF_HUB_OFFLINE=1 forbids "
                                                 "downloading: run once online"),
                         (dict(data="data/chats"), "hub: data='data/chats': no such local path, and data/chats@main "
                                                   "is not in the hub cache"),
                         (dict(init_from="out/x"), "hub: init_from='out/x': no such local path, and out/x@main")):
        with pytest.raises(SystemExit) as e:
            hub.resolve(values)
        assert line in e.value.code and "convert the weights" not in e.value.code


@pytest.mark.slow
def test_an_empty_local_folder_spelt_as_a_hub_name(tmp_path):
    """The local folder wins over the hub name, and the line says so, and that it lacks config.json."""
    os.makedirs(tmp_path / MODEL)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_sft.py"), f"--init_from={MODEL}", "--device=cpu",
                        f"--out_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, **offline_env(tmp_path / "home")})
    assert r.returncode == 1 and r.stderr.strip() == (
        f"config error: init_from='{MODEL}' is a local folder, read before any hub name, and it holds no config.json: "
        f"pass a Hugging Face model folder, or move that folder away to read the hub repo of that name")


def test_offline_reads_the_cache_and_never_the_network(tmp_path, repos, use_hub):
    cache = use_hub(offline=True)
    with pytest.raises(SystemExit, match=r"nanopack-test/tiny-chat@main is not in the hub cache .* HF_HUB_OFFLINE=1 "
                                         r"forbids downloading: run once online, or unset HF_HUB_OFFLINE"):
        hub.resolve(dict(init_from=MODEL))
    lay_out_cache(cache, "model", MODEL, repos["model"], COMMITS["model"], refs=("main",))
    lay_out_cache(cache, "model", MODEL, repos["model_v2"], COMMITS["model_v2"], refs=("v2",))
    for revision, commit in (("", "a"), ("@v2", "b"), ("@" + "b" * 40, "b")):  # a branch, a tag, a commit
        folders, pins = hub.resolve(dict(init_from=MODEL + revision))
        assert pins["init_from"] == f"{MODEL}@{commit * 40}"
        assert folders["init_from"] == os.path.join(cache, "models--nanopack-test--tiny-chat", "snapshots", commit * 40)


SMALL = dict(max_iters=1, batch_size=4, microbatch_tokens=512, eval_interval=0, eval_examples=0, log_interval=1)


@pytest.mark.slow
def test_two_processes_download_a_repo_once(tmp_path, server):
    """Two processes resolving one name at once (two ranks, or two nodes on a shared filesystem): one downloads while
    the other waits on the cache's lock, then finds every file there; each file crosses the network once."""
    env = dict(os.environ, HF_HOME=str(tmp_path / "home"), HF_ENDPOINT=server.endpoint, HF_TOKEN="",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    # no torch to import: seconds
    code = ("import sys, types\n"
            "sys.modules['nanopack.parallel'] = types.SimpleNamespace(fail=sys.exit, print0=print)\n"
            f"from nanopack import hub; print(hub.resolve(dict(init_from={MODEL!r}))[0]['init_from'])")
    server.log.clear()
    server.delay = 0.3  # each file: the first process holds the lock while the second starts
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(env, LOCAL_RANK=str(rank)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        server.delay = 0.0
    assert all(p.returncode == 0 for p in procs), outs
    folders = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(folders) == 1 and sorted(os.listdir(folders.pop())) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(server.downloads()) == ["config.json", "generation_config.json", "model.safetensors",
                                          "tokenizer.json", "tokenizer_config.json"]  # once each
    heads = [p for m, p in server.log if m == "HEAD"]
    assert len(heads) == 5, heads  # and asked about once each: by the process that held the lock


def test_ranks_that_resolved_different_commits_stop(monkeypatch):
    """Each process resolves its names before the process group exists: a branch pushed to in between splits them,
    and setup stops at its first collective with one line, instead of training ranks on different bytes."""
    import torch.distributed as dist
    pins = {"init_from": f"{MODEL}@{'a' * 40}"}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [
        obj, {"init_from": f"{MODEL}@{'b' * 40}"}]))
    with pytest.raises(SystemExit, match=f"hub: init_from is {MODEL}@a{{40}} on rank 0 but {MODEL}@b{{40}} on rank 1 "
                                         r"\(pushed to while the ranks started\): pin it, --init_from="):
        hub.check_same_on_all_ranks(pins)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, obj]))
    hub.check_same_on_all_ranks(pins)


def train(script, home, out_dir, *extra, check=True, **cfg):
    args = as_args(out_dir=out_dir, **cfg)
    env = dict(os.environ, OMP_NUM_THREADS="1", **offline_env(home))
    out = subprocess.run([sys.executable, script, *args, *extra], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_sft_by_name_records_its_commits_and_resumes_on_them(tmp_path, repos):
    """A run by names prints and records each name's commit (the saved config, metrics.jsonl's first line); after main
    moves to a new commit, --init_from=resume (given the same names again) reads the commits the run started from."""
    home, out_dir = tmp_path / "home", str(tmp_path / "run")
    cache = cached(home, repos, COMMITS)
    names = dict(data="nanopack-test/chats", data_split="train", val_data="nanopack-test/chats", val_split="test")
    out = train("train_sft.py", home, out_dir, **dict(SMALL, init_from=MODEL, **names))
    snapshot = os.path.join(cache, "models--nanopack-test--tiny-chat", "snapshots", "a" * 40)
    assert f"hub: init_from={MODEL} is commit {'a' * 40}: 5 file(s)" in out.stdout
    pins = {"init_from": f"{MODEL}@{'a' * 40}", "data": f"nanopack-test/chats@{'c' * 40}",
            "val_data": f"nanopack-test/chats@{'c' * 40}"}
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=False)
    assert ckpt["config"]["hub"] == pins and ckpt["start"]["init_from"] == snapshot
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        assert json.loads(f.readline()) == dict(iter=0, hub=pins)
    lay_out_cache(os.path.join(home, "hub"), "model", MODEL, repos["model_v2"], "b" * 40, refs=("main",))
    out = train("train_sft.py", home, out_dir, **dict(SMALL, init_from="resume", max_iters=2, **names))
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=False)
    assert ckpt["iter_num"] == 2 and ckpt["config"]["hub"] == pins and ckpt["start"]["init_from"] == snapshot
    assert len(step_metrics(out_dir)) == 2
    from nanopack.configurator import configure  # another revision on resume: refused, naming the recorded commit
    with pytest.raises(SystemExit, match=f"data='nanopack-test/chats@v2' differs from the run being resumed "
                                         f"\\(data='nanopack-test/chats@{'c' * 40}'\\)"):
        configure(dict(out_dir="", init_from="", data=""), ["--init_from=resume", f"--out_dir={out_dir}",
                                                           "--data=nanopack-test/chats@v2"])


@pytest.mark.slow
def test_dpo_and_rl_by_name(tmp_path, repos):
    """DPO (LoRA) from a commit with pairs by name (a split the card names), RL from a branch with prompts by name: offline."""
    home = tmp_path / "home"
    cache = cached(home, repos, COMMITS)
    lay_out_cache(cache, "model", MODEL, repos["model_v2"], "b" * 40, refs=("v2",))
    out = train("train_dpo.py", home, str(tmp_path / "dpo"), **SMALL, init_from=f"{MODEL}@{'a' * 40}",
                data="nanopack-test/prefs", data_split="train_prefs", val_data="nanopack-test/prefs",
                val_split="test_prefs", lora_rank=2)
    assert f"hub: data=nanopack-test/prefs is commit {'d' * 40}: 2 file(s)" in out.stdout  # the card and the split
    with open(tmp_path / "dpo" / "adapter" / "adapter_config.json") as f:  # PEFT loads its base by the hub name
        assert json.load(f)["base_model_name_or_path"] == MODEL
    out = train("train_rl.py", home, str(tmp_path / "rl"), init_from=f"{MODEL}@v2", data="nanopack-test/prompts",
                reward="tests.rl_rewards:distinct_characters", k=2, prompts_per_step=2, max_new_tokens=4, max_iters=1,
                eval_interval=0, eval_examples=0)
    assert f"hub: init_from={MODEL}@v2 is commit {'b' * 40}" in out.stdout


def test_sample_and_plan_by_name(server, use_hub, repos, monkeypatch, capsys):
    """sample.py talks to a model by name; plan.py plans one by name from its config.json and tokenizer files alone,
    and data by name from its files, downloaded as a run downloads them: the same step as the same data on disk."""
    import runpy
    import plan
    use_hub(server.endpoint)
    server.log.clear()
    args = [f"--init_from={MODEL}", "--data_split=train", "--batch_size=2", "--microbatch_tokens=256"]
    result = plan.plan_step(os.path.join(ROOT, "train_sft.py"), [*args, "--data=nanopack-test/chats"], device="cpu")
    assert result["by_category"]["parameters"] > 0
    assert sorted(server.downloads()) == ["config.json", "data/train-00000-of-00001.parquet", "generation_config.json",
                                          "tokenizer.json", "tokenizer_config.json"]
    on_disk = plan.plan_step(os.path.join(ROOT, "train_sft.py"),
                             [*args, f"--data={os.path.join(repos['nanopack-test/chats'], 'data')}"], device="cpu")
    assert result["tokens"] == on_disk["tokens"] < 256
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--model={MODEL}", "--prompt=hi", "--max_new_tokens=2",
                                      "--device=cpu"])
    runpy.run_path(os.path.join(ROOT, "sample.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert f"hub: model={MODEL} is commit" in out and out.rstrip().endswith("---")
    assert "model.safetensors" in server.downloads()


@pytest.mark.slow
@pytest.mark.parametrize("script, extra", [
    ("train_sft.py", ["--parallel=fsdp", f"--init_from={MODEL}", "--data=nanopack-test/listed"]),
    ("train_dpo.py", ["--parallel=ddp", f"--init_from={MODEL}", "--data=nanopack-test/prefs",
                      "--data_split=train_prefs"]),
    ("train_sft.py", ["--parallel=ddp", "--init_from=scratch", "--preset=tiny", f"--tokenizer={MODEL}"])])
def test_plan_by_name_on_several_gpus(server, use_hub, script, extra):
    """The headline use: a plan of 8 GPUs of a model by name (its commits compared across ranks in a run: a plan's one
    process has no other rank, and a collective on the fake ranks reads no value)."""
    import plan
    use_hub(server.endpoint)
    result = plan.plan_step(os.path.join(ROOT, script), [*extra, "--batch_size=8", "--microbatch_tokens=256"], gpus=8,
                            device="cpu")
    assert result["by_category"]["parameters"] > 0
    if "--data=nanopack-test/listed" in extra:  # its 6 short chats (the split's own files), not 8 x 256 worst-case tokens
        assert result["tokens"] < 256


@pytest.mark.slow
def test_resume_by_the_start_command_reads_no_weights_and_no_data(tmp_path, server):
    """The reported case: a full fine-tune by names (@main) resumed on a new node by its start
    command plus --init_from=resume was refused (@main is not the recorded commit), and would have
    downloaded the base's weights and the data, though it resumes from its DCP checkpoint and
    out_dir/data. Then offline, no weights cached."""
    out_dir = str(tmp_path / "run")
    names = dict(init_from=f"{MODEL}@main", data="nanopack-test/chats@main", data_split="train",
                 val_data="nanopack-test/chats@main", val_split="test")
    online = dict(os.environ, OMP_NUM_THREADS="1", HF_ENDPOINT=server.endpoint, HF_TOKEN="",
                  HF_HUB_DISABLE_PROGRESS_BARS="1")

    def sft(home, *extra, **env):
        args = [*as_args(out_dir=out_dir, **SMALL, **names), *extra]
        out = subprocess.run([sys.executable, "train_sft.py", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=600, env=dict(online, HF_HOME=str(home), **env))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out
    sft(tmp_path / "node1")
    server.log.clear()
    sft(tmp_path / "node2", "--init_from=resume", "--max_iters=2")
    assert sorted(server.downloads()) == ["config.json", "generation_config.json", "tokenizer.json",
                                          "tokenizer_config.json"]
    sft(tmp_path / "node2", "--init_from=resume", "--max_iters=3", HF_HUB_OFFLINE="1",
        HF_ENDPOINT=ROUTED_NOWHERE)
    assert [m["iter"] for m in step_metrics(out_dir)] == [1, 2, 3]
