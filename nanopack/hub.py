"""
Hugging Face hub names: `--init_from=Qwen/Qwen2.5-0.5B-Instruct`,
`--data=HuggingFaceH4/ultrafeedback_binarized`, each optionally `@revision` (a branch, tag or
commit; a dataset may add `/config` or `/folder`) -> the snapshot folder huggingface_hub keeps in
its cache, holding only what a run reads; from there on a name is a folder. A path that exists wins.
Each name's commit goes into the run's config ("hub") and its first lines; a resumed run reads those
commits. Downloads, the cache and its locks, HF_HUB_OFFLINE, HF_ENDPOINT and tokens are
huggingface_hub's own.
"""
import glob
import json
import os
import re

# the files a folder is read for, its splits
from data.records import DATA_EXTENSIONS as READABLE, split_name
from nanopack.parallel import fail, print0

# config keys that may name a model repo (sample.py's model, a distillation teacher)
MODEL_KEYS = ("init_from", "tokenizer", "model", "teacher")
# ... a dataset repo, and the key naming its split
DATA_KEYS = {"data": "data_split", "val_data": "val_split"}
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json",
                   "chat_template.jinja")
INDEX = "model.safetensors.index.json"
NAME = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?P<sub>(/[\w.=-]+)*)(@(?P<revision>.+))?")
# a local file that is not there
PATH_LIKE = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".gz", ".pt", ".py")
# fake_step.py sets it: a plan reads config.json and the tokenizer, no weights (data as a run does)
PLAN = False


class RepoError(ValueError):
    """A repo that holds nothing nanopack can read the way it is asked to."""


class CacheMiss(FileNotFoundError):
    """Offline, a file or commit the run reads is not in the cache."""


def parse(value, dataset=False):
    """`org/name[/config][@revision]` -> (repo, config or folder, revision); None for a path that
    exists or a string that is not a name (it stays what it was, and whatever reads it says so)."""
    if not isinstance(value, str) or os.path.exists(value):
        return None
    return spelt_as_name(value, dataset)


def spelt_as_name(value, dataset=False):
    """parse's answer for a value, whether or not a path of that name exists."""
    if value.startswith((".", "/", "~")) or value.split("@")[0].endswith(PATH_LIKE):
        return None
    m = NAME.fullmatch(value)
    if not m or (m["sub"] and not dataset) or "--" in m["repo"] or ".." in m["repo"]:
        return None
    return m["repo"], m["sub"].strip("/") or None, m["revision"]


def resolve(values, reads=None):
    """configure()'s hook -> ({key: local folder} for each hub name among values' keys, {key:
    'org/name@commit'}), a line printed for each. On resume values['hub'] holds the run's own pins:
    read again, whatever the branches say now (a snapshot gone from the cache is fetched again at
    its commit, as far as the run reads it: a model's weights with reads['weights'], a dataset with
    reads['data'])."""
    names = {k: p for k in (*MODEL_KEYS, *DATA_KEYS) if k in values
             and (p := parse(values[k], k in DATA_KEYS))}
    recorded = values.get("hub") or {}
    if not names and not recorded:
        return {}, {}
    try:
        import huggingface_hub  # noqa: F401  (optional: only a run given a name needs it)
    except ImportError:
        fail(f"{', '.join(names) or 'the resumed run'} names a Hugging Face hub repo; reading it "
             "needs huggingface_hub: pip install huggingface_hub (or pass a local folder)")
    # one progress bar a node: the other ranks wait on the cache's lock
    if int(os.environ.get("LOCAL_RANK", 0)):
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    folders, pins, listings = {}, dict(recorded), {}
    reads = reads or dict(weights=True, data=True)
    for key, pin in recorded.items():
        repo, sub, commit = parse(pin, key in DATA_KEYS)
        if key in DATA_KEYS and not reads["data"]:
            print0(f"hub: {key} is {pin}, as the run recorded it (its prepared copy is read)")
            continue
        if not os.path.isdir(os.path.join(storage(repo, kind_of(key)), "snapshots", commit)):
            fetch_key(key, repo, sub, commit, values, listings, weights=reads["weights"])
        print0(f"hub: {key} is {pin}, as the run recorded it")
    for key, (repo, sub, revision) in names.items():
        folders[key], commit, files, size = fetch_key(key, repo, sub, revision, values, listings)
        pins[key] = f"{repo}{'/' + sub if sub else ''}@{commit}"
        where = folders[key]
        # the split's own files (a list): read as one split
        if key in DATA_KEYS and not os.path.isdir(where):
            folders[DATA_KEYS[key]], where = None, os.path.commonpath(where.split(","))
        print0(f"hub: {key}={values[key]} is commit {commit}: {len(files)} file(s), "
               f"{size / 1e6:,.2f} MB, in {where}")
    return folders, pins


def recorded_as(value, pin, name=None):
    """Whether a value given again on resume names the recorded pin: the same repo, at no revision,
    that commit, or the revision the run was started with (name: as given then; the run reads its
    commit, wherever the branch is now)."""
    given, saved, started = parse(value, True), pin and parse(pin, True), name and parse(name, True)
    if not (given and saved) or given[:2] != saved[:2]:
        return False
    # main: the revision a name without one reads
    return given[2] in (None, saved[2]) or bool(started) and given[2] == (started[2] or "main")


def check_same_on_all_ranks(pins):
    """Every rank resolved each name to the same commit (a branch pushed to while the ranks started
    would split them); the processes resolve before the process group exists, so this is checked
    once it does."""
    import torch.distributed as dist
    if not pins or not dist.is_initialized():
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, pins)
    for rank, theirs in enumerate(every):
        for key in pins:
            if theirs.get(key) != every[0].get(key):
                fail(f"hub: {key} is {every[0].get(key)} on rank 0 but {theirs.get(key)} on rank "
                     f"{rank} (pushed to while the ranks started): pin it, "
                     f"--{key}={every[0].get(key)}")


def kind_of(key):
    return "dataset" if key in DATA_KEYS else "model"


def fetch_key(key, repo, sub, revision, values, listings, weights=True):
    """-> (local folder, commit, files read, their bytes) for config key `key` naming repo (sub: a
    dataset's config or folder) at revision (weights: a model's too); a failure is one line naming
    the repo."""
    weights = weights and key != "tokenizer" and not PLAN
    if kind_of(key) == "model":
        def choose(files, read):
            return "", model_files(files, read, weights=weights, config=key != "tokenizer")
    else:
        def choose(files, read):
            return dataset_files(f"{repo}{'/' + sub if sub else ''}", sub,
                                 values.get(DATA_KEYS[key]), DATA_KEYS[key],
                                 files, read)
    try:
        return fetch(repo, kind_of(key), revision, listings, choose)
    except Exception as e:
        # the hub client's errors (HTTP, network, cache), each one line naming the repo
        line = explain(e, repo, kind_of(key), revision)
        if line is None:
            raise
        fail(f"hub: {key}={values.get(key, repo)!r}: {line}")


def fetch(repo, kind, revision, listings, choose):
    """-> (local folder, commit, the files choose(files, read) picks, their bytes), downloaded once:
    one process at a time holds the repo's lock in the cache (on a shared filesystem, one for all
    nodes), the others then find the files there. Offline (HF_HUB_OFFLINE=1): the cached snapshot,
    never the network."""
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.utils import WeakFileLock
    offline, stored = constants.HF_HUB_OFFLINE, storage(repo, kind)
    # a repo named twice (data, val_data) is read at one commit
    if (kind, repo, revision) not in listings:
        if offline:
            listings[kind, repo, revision] = cached_listing(stored, revision)
        else:
            info = HfApi().repo_info(repo, repo_type=kind, revision=revision, files_metadata=True)
            listings[kind, repo, revision] = info.sha, {s.rfilename: s.size or 0
                                                        for s in info.siblings or []}
    commit, files = listings[kind, repo, revision]
    folder = os.path.join(stored, "snapshots", commit)
    def download(name):
        return hf_hub_download(repo, name, repo_type=kind, revision=commit)
    sub, wanted = choose(files, (lambda name: os.path.join(folder, name)) if offline else download)
    missing = [f for f in wanted if f not in files]
    if missing:  # offline only: the hub lists the repo's files, the cache only those downloaded
        raise CacheMiss(f"the cached snapshot {commit} lacks {', '.join(missing[:3])}")
    if not offline:
        os.makedirs(os.path.join(constants.HF_HUB_CACHE, ".locks"), exist_ok=True)
        lock = os.path.join(constants.HF_HUB_CACHE, ".locks",
                            os.path.basename(stored) + ".nanopack.lock")
        with WeakFileLock(lock):
            folder = snapshot_download(repo, repo_type=kind, revision=commit,
                                       allow_patterns=[glob.escape(f) for f in wanted])
        # the ref a later offline run by this name reads, as snapshot_download writes it
        if revision != commit:
            ref = os.path.join(stored, "refs", revision or "main")
            os.makedirs(os.path.dirname(ref), exist_ok=True)
            with open(f"{ref}.{os.getpid()}.tmp", "w") as f:
                f.write(commit)
            os.replace(f.name, ref)
    where = ",".join(os.path.join(folder, f)
                     for f in sub) if isinstance(sub, list) else os.path.join(folder, sub)
    return where if sub else folder, commit, wanted, sum(files[f] for f in wanted)


def storage(repo, kind):
    """The cache's folder of a repo, as the client names it: $HF_HUB_CACHE/models--org--name
    (datasets--org--name)."""
    from huggingface_hub import constants
    return os.path.join(constants.HF_HUB_CACHE, f"{kind}s--{repo.replace('/', '--')}")


def cached_listing(storage, revision):
    """Offline -> (commit, {file: bytes}) of the cached snapshot: refs/<branch or tag> names the
    commit."""
    ref = os.path.join(storage, "refs", revision or "main")
    commit = open(ref).read().strip() if os.path.isfile(ref) else revision
    folder = os.path.join(storage, "snapshots", str(commit))
    if not os.path.isdir(folder):
        raise CacheMiss("")
    return commit, {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
                    for d, _, names in os.walk(folder) for f in names}


def model_files(files, read, weights=True, config=True):
    """The files a run reads from a model repo: config.json, generation_config.json, the
    tokenizer's, and the safetensors its index names (or model.safetensors); never *.bin, *.pth,
    original/ or GGUF."""
    wanted = [f for f in (*(CONFIG_FILES if config else ()), *TOKENIZER_FILES) if f in files]
    if config and "config.json" not in files:
        raise RepoError("no config.json at its root: not a Hugging Face model")
    if not config and not {"tokenizer.json", "tokenizer.model"} & set(files):
        raise RepoError("no tokenizer.json or tokenizer.model at its root: no tokenizer to read")
    if not weights:
        return wanted
    if INDEX in files:
        with open(read(INDEX)) as f:
            return wanted + [INDEX] + sorted(set(json.load(f)["weight_map"].values()))
    if "model.safetensors" in files:
        return wanted + ["model.safetensors"]
    from huggingface_hub import constants
    # the cache holds what was downloaded, and plan.py downloads no weights
    if constants.HF_HUB_OFFLINE:
        raise CacheMiss("the cached snapshot holds no weights: they were never downloaded (plan.py "
                        "reads config.json and the tokenizer only)")
    others = sorted(f for f in files
                    if f.endswith((".bin", ".pth", ".gguf", ".pt", ".safetensors")))[:3]
    raise RepoError(f"no safetensors weights (model.safetensors or {INDEX}) at its root"
                    + (f", only {', '.join(others)}" if others else "")
                    + "; nanopack reads safetensors only: "
                    "convert the weights (transformers' save_pretrained writes them) and pass the "
                    "folder")


def dataset_files(name, sub, split, split_key, files, read):
    """-> (the folder data_files(folder, split) reads, or else the split's files, read as one split
    as `datasets` reads them; the files to download) for one split of a dataset repo, found as
    `datasets` finds them: the README's `configs:`, else the .parquet / .jsonl files by file (or the
    Parquet conversion's folder) name."""
    from huggingface_hub import constants
    configs = card_configs(read("README.md")) if "README.md" in files else {}
    named = [c for c in configs if c != "__default__"]
    if sub and named and sub not in configs and not any(f.startswith(f"{sub}/") for f in files):
        raise RepoError(f"no config {sub!r} ({', '.join(named)}): name one, e.g. "
                        f"--data={name[:-len(sub)]}{named[0]}")
    config = sub if sub in configs else None if sub else default_config(configs, name)
    under = (sub or "") if config is None else configs[config] if isinstance(configs[config],
                                                                             str) else None
    if under is None:  # the config names each split's files
        by_split = {s: sorted(f for f in files if any(glob_match(p, f) for p in ps))
                    for s, ps in configs[config].items()}
    else:
        by_split = folder_splits(name, under, files)
    asked = by_split.get(split) if split is not None else [f for fs in by_split.values()
                                                           for f in fs]
    if constants.HF_HUB_OFFLINE and not asked and (under is not None or split in by_split):
        # the cache holds only what was downloaded: a split never read online is not there
        raise CacheMiss("the cached snapshot holds no file of "
                        f"{f'the split {split!r}' if split else 'its data'}")
    if not any(by_split.values()):
        raise RepoError(unreadable(name, files, configs))
    if split is None and len(by_split) > 1:
        raise RepoError(f"several splits ({', '.join(sorted(by_split))}): choose one with "
                        f"--{split_key}")
    if split is not None and split not in by_split:
        raise RepoError(f"no split {split!r}; its splits: {', '.join(sorted(by_split))}")
    picked = by_split[split if split is not None else next(iter(by_split))]
    if not picked or not all(f.endswith(READABLE) for f in picked):
        raise RepoError(unreadable(name, picked or files, configs))
    folder = os.path.dirname(picked[0])
    read_there = sorted(f for f in files if os.path.dirname(f) == folder and f.endswith(READABLE)
                        and (split is None or split_name(f) == split))
    # data_files(folder, split) reads the same files, all of one split by name; or else the split's
    # own list is read
    whole = read_there == picked and len({split_name(f) for f in picked}) == 1
    return folder if whole else picked, ["README.md"] * ("README.md" in files) + picked


def folder_splits(name, under, files):
    """-> {split: files} of the record files under a folder, split by file name as data_files splits
    them; a file named by its shard number alone (the Parquet conversion's
    <config>/<split>/0000.parquet) by its folder's name."""
    by_split = {}
    for f in sorted(f for f in files if f.startswith(f"{under}/" if under else "")
                    and f.endswith(READABLE)):
        by_split.setdefault(split_name(f) or os.path.basename(os.path.dirname(f)), []).append(f)
    folders = sorted({os.path.dirname(f) for fs in by_split.values() for f in fs})
    # one split's in several configs
    if any(len({os.path.dirname(f) for f in fs}) > 1 for fs in by_split.values()):
        raise RepoError(f"record files in {len(folders)} folders ({', '.join(folders[:5])}): name "
                        f"one, e.g. {name}/{folders[0]}")
    return by_split


def unreadable(name, files, configs):
    formats = sorted({os.path.splitext(f)[1] or f for f in files
                      if not f.endswith((".md", ".gitattributes"))})
    what = ("a loading script (its .py), which needs `datasets`"
            if any(f.endswith(".py") for f in files) else
            f"no .parquet or .jsonl records ({', '.join(formats[:5]) or 'no files'})")
    if configs:
        what += f"; its configs: {', '.join(c for c in configs if c != '__default__')}"
    return (what + ": download its data by hand, or read the hub's Parquet conversion, "
            f"--data={'/'.join(name.split('/')[:2])}/<config>/<split>@refs/convert/parquet")


def card_configs(readme):
    """The README's `configs:` -> {config name: {split: [file patterns]}, or its data_dir};
    '__default__': the one marked default."""
    from huggingface_hub import metadata_load
    configs = {}
    for c in (metadata_load(readme) or {}).get("configs") or []:
        name, data = c.get("config_name", "default"), c.get("data_files")
        if data is None:
            configs[name] = c.get("data_dir", "").strip("/")
            continue
        if isinstance(data, list) and data and isinstance(data[0], dict):
            data = {d["split"]: d["path"] for d in data}
        elif not isinstance(data, dict):  # a pattern or a list of them: one split, train
            data = {"train": data}
        configs[name] = {s: [p] if isinstance(p, str) else list(p) for s, p in data.items()}
        if c.get("default"):
            configs["__default__"] = name
    return configs


def default_config(configs, name):
    named = [c for c in configs if c != "__default__"]
    if not named:
        return None
    default = configs.get("__default__") or ("default" if "default" in named else named[0]
                                             if len(named) == 1
                                             else None)
    if default is None:
        raise RepoError(f"configs {', '.join(named)} and none is the default: name one, "
                        f"--data={name}/{named[0]}")
    return default


def glob_match(pattern, path):
    """`datasets`' file patterns: * and ? within a folder, ** across folders."""
    regexes = {r"\*\*/": "(.*/)?", r"\*\*": ".*", r"\*": "[^/]*", r"\?": "[^/]"}
    regex = re.sub(r"\\\*\\\*/|\\\*\\\*|\\\*|\\\?", lambda m: regexes[m[0]],
                   re.escape(pattern.lstrip("/")))
    return re.fullmatch(regex, path) is not None


def explain(e, repo, kind, revision):
    """The hub client's exception -> one line naming the repo and what to do; None: not the hub's (a
    bug: raised)."""
    from huggingface_hub import constants, errors
    page = f"{constants.ENDPOINT}/{'datasets/' * (kind == 'dataset')}{repo}"
    status = getattr(getattr(e, "response", None), "status_code", None)
    at = f"@{revision}" if revision else ""
    if isinstance(e, RepoError):
        offline = " (HF_HUB_OFFLINE=1: only what the cache holds)" * constants.HF_HUB_OFFLINE
        return f"{repo}{at}: {e}{offline}"
    if isinstance(e, errors.GatedRepoError) or (isinstance(e, errors.HfHubHTTPError)
                                                and status in (401, 403) and
                                                not isinstance(e, errors.RepositoryNotFoundError)):
        return (f"{repo} is gated or needs a login ({status}): accept its licence on {page}, then "
                "log in with `hf auth login` (or set HF_TOKEN)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"no {kind} repo {repo} on the hub (a private one needs `hf auth login` or "
                "HF_TOKEN), and no such local path")
    if isinstance(e, errors.RevisionNotFoundError):
        return (f"{repo} has no revision {revision!r} (a branch, tag or commit): "
                f"see {page}/tree/main")
    if isinstance(e, (CacheMiss, errors.LocalEntryNotFoundError)) and constants.HF_HUB_OFFLINE:
        # nothing of the repo cached: the name may be a relative path mistyped
        path = "" if os.path.isdir(storage(repo, kind)) else "no such local path, and "
        return (f"{path}{repo}@{revision or 'main'} is not in the hub cache "
                f"({constants.HF_HUB_CACHE}{'; ' + str(e) if str(e) else ''}) and HF_HUB_OFFLINE=1 "
                "forbids downloading: run once online, or unset HF_HUB_OFFLINE")
    if isinstance(e, errors.HfHubHTTPError) and status:
        first_line = str(e).splitlines()[0][:120]
        return f"the hub answered {status} for {repo}{at} ({first_line}); try again later"
    network = type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests",
                                                   "urllib3", "ssl")
    if network or isinstance(e, (ConnectionError, TimeoutError, errors.LocalEntryNotFoundError)):
        return (f"cannot reach the hub at {constants.ENDPOINT} for {repo} ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:120]}); check the network, or use the cache with "
                "HF_HUB_OFFLINE=1")
    return None
