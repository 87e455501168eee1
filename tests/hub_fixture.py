"""A Hugging Face hub on this machine, for tests that never touch the real one: repos built as folders, a hub cache laid
out as huggingface_hub lays it out (models--org--name/{blobs, refs, snapshots/<commit>}), and a local HTTP server
answering the routes the client calls (repo info, tree, HEAD and GET of /resolve/), logging what it was asked for.
huggingface_hub reads HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_ENDPOINT when it is imported: a test sets them for
a subprocess, or patches huggingface_hub.constants in its own process (use_hub)."""
import hashlib
import http.server
import json
import os
import threading
import time
from urllib.parse import unquote, urlparse


def commit_of(folder, salt=""):
    """A 40-hex commit id standing for a folder's files (git's is a sha1 too)."""
    h = hashlib.sha1(salt.encode())
    for path in sorted(files_of(folder)):
        h.update(path.encode() + open(os.path.join(folder, path), "rb").read())
    return h.hexdigest()


def files_of(folder):
    return [os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names]


def lay_out_cache(cache, kind, repo, folder, commit, refs=("main",)):
    """The client's cache for one commit of a repo: each file a blob named by its hash, the snapshot's files relative
    symlinks to them, each ref a file holding the commit."""
    storage = os.path.join(cache, f"{kind}s--{repo.replace('/', '--')}")
    for path in files_of(folder):
        data = open(os.path.join(folder, path), "rb").read()
        blob = os.path.join(storage, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(storage, "snapshots", commit, path)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:
        os.makedirs(os.path.dirname(os.path.join(storage, "refs", ref)), exist_ok=True)
        with open(os.path.join(storage, "refs", ref), "w") as f:
            f.write(commit)
    return os.path.join(storage, "snapshots", commit)


class HubServer:
    """A hub at http://127.0.0.1:<port>: add(kind, repo, folder, revisions) serves a folder as a commit; gated repos
    answer 401 (GatedRepo) to downloads; `drop` repos close the connection on every request; each file's bytes come
    `delay` seconds late (a download long enough to overlap another). `log`: (method, path)."""

    def __init__(self):
        self.repos, self.log, self.gated, self.drop, self.delay = {}, [], set(), set(), 0.0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                server.answer(self, head=True)

            def do_GET(self):
                server.answer(self, head=False)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def add(self, kind, repo, folder, revisions=("main",), salt=""):
        commit = commit_of(folder, salt)
        entry = self.repos.setdefault((kind, repo), dict(refs={}, commits={}))
        entry["commits"][commit] = folder
        entry["refs"].update({r: commit for r in revisions})
        return commit

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def downloads(self):
        """The files whose bytes were asked for (GET of /resolve/), in order."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.log if m == "GET" and "/resolve/" in p]

    def answer(self, h, head):
        url = urlparse(h.path)
        parts = url.path.strip("/").split("/")  # split before unquoting: a revision's slashes come quoted
        self.log.append((h.command, unquote(url.path)))
        api = parts[0] == "api"
        kind = "dataset" if parts[api] == "datasets" else "model"
        parts = parts[api + (kind == "dataset" or api):]
        repo, route = "/".join(parts[:2]), parts[2] if len(parts) > 2 else ""
        revision, name = unquote(parts[3]) if len(parts) > 3 else "main", unquote("/".join(parts[4:]))
        if repo in self.drop:
            h.close_connection = True  # no status line at all: the client sees the connection end
            h.connection.shutdown(2)
            return
        entry = self.repos.get((kind, repo))
        if entry is None:
            return self.error(h, 404, "RepoNotFound", "Repository not found")
        commit = entry["refs"].get(revision, revision if revision in entry["commits"] else None)
        if commit is None:
            return self.error(h, 404, "RevisionNotFound", "Invalid rev id")
        folder = entry["commits"][commit]
        if route in ("", "revision"):
            siblings = [dict(rfilename=f, size=os.path.getsize(os.path.join(folder, f))) for f in files_of(folder)]
            return self.json(h, dict(id=repo, sha=commit, siblings=siblings, private=False))
        if route == "tree":
            return self.json(h, [dict(type="file", path=f, size=os.path.getsize(os.path.join(folder, f)),
                                      oid=hashlib.sha1(open(os.path.join(folder, f), "rb").read()).hexdigest())
                                 for f in files_of(folder)])
        if route != "resolve":
            return self.error(h, 404, None, "no such route")
        if repo in self.gated:
            return self.error(h, 401, "GatedRepo", "Access to model is restricted. Please log in.")
        if not os.path.isfile(os.path.join(folder, name)):
            return self.error(h, 404, "EntryNotFound", "Entry not found")
        data = open(os.path.join(folder, name), "rb").read()
        h.send_response(200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            time.sleep(self.delay)
            h.wfile.write(data)

    def json(self, h, obj):
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def error(self, h, status, code, message):
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Length", "0")
        h.end_headers()


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def model_repo(folder, seed=0, n_layer=2, shard_bytes=None):
    """A SmolLM2-shaped repo, tiny: a byte-level BPE tokenizer.json with ChatML tokens, tokenizer_config.json,
    config.json and model.safetensors (random weights; shard_bytes: shards and their index, as Llama-3.1-8B ships),
    generation_config.json; and the decoys a run never reads: pytorch_model.bin, original/consolidated.00.pth, a GGUF
    file, and with shards a consolidated.safetensors beside them (as Mistral's repos hold one)."""
    import torch
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    from nanopack.hf import save_pretrained
    from model import Transformer, config_from_preset
    from nanopack.tokenizer import bytes_to_unicode
    os.makedirs(os.path.join(folder, "original"))
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(dict(chat_template=CHATML, eos_token="<|im_end|>", bos_token=None, pad_token="<|im_end|>",
                       tokenizer_class="PreTrainedTokenizerFast"), f)
    torch.manual_seed(seed)
    save_pretrained(Transformer(config_from_preset("tiny", vocab_size=258, n_layer=n_layer)), folder,
                    **dict(max_shard_bytes=shard_bytes) if shard_bytes else {})
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(dict(eos_token_id=257), f)
    for decoy in ("pytorch_model.bin", "original/consolidated.00.pth", "model-q4.gguf") + (
            ("consolidated.safetensors",) if shard_bytes else ()):
        with open(os.path.join(folder, decoy), "wb") as f:
            f.write(b"not read" * 100)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("---\nlicense: apache-2.0\n---\nA tiny test model.\n")
    return folder


def chats(n, offset=0):
    return [dict(messages=[dict(role="user", content=f"What is {i}+{i}?"), dict(role="assistant", content=f"{2 * i}")])
            for i in range(offset, offset + n)]


def prefs(n, offset=0):
    """ultrafeedback_binarized's shape: prompt, chosen and rejected conversations, messages equal to chosen."""
    out = []
    for i in range(offset, offset + n):
        user = dict(role="user", content=f"What is {i}+{i}?")
        chosen = [user, dict(role="assistant", content=f"{2 * i}")]
        out.append(dict(prompt=user["content"], chosen=chosen, rejected=[user, dict(role="assistant", content="no")],
                        messages=chosen))
    return out


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def dataset_repos(root):
    """{repo: folder}: chats with data/train and data/test shards (no card); ultrafeedback-shaped prefs whose README
    `configs:` names its splits; two whose one split is a glob or a list of files; RL prompts as JSONL; a repo built by
    a loading script."""
    out = {}
    folder = out["nanopack-test/chats"] = os.path.join(root, "chats")
    write_parquet(os.path.join(folder, "data", "train-00000-of-00001.parquet"), chats(24))
    write_parquet(os.path.join(folder, "data", "test-00000-of-00001.parquet"), chats(4, offset=100))
    folder = out["nanopack-test/prefs"] = os.path.join(root, "prefs")
    for split, n, offset in (("train_prefs", 16, 0), ("test_prefs", 4, 100), ("train_sft", 8, 0)):
        write_parquet(os.path.join(folder, "data", f"{split}-00000-of-00001.parquet"), prefs(n, offset))
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("---\nconfigs:\n- config_name: default\n  data_files:\n" + "".join(
            f"  - split: {s}\n    path: data/{s}-*\n" for s in ("train_prefs", "test_prefs", "train_sft")) +
            "---\nPreference pairs.\n")
    folder = out["nanopack-test/prompts"] = os.path.join(root, "prompts")
    os.makedirs(os.path.join(folder, "data"))
    with open(os.path.join(folder, "data", "train.jsonl"), "w") as f:
        for i in range(8):
            f.write(json.dumps(dict(prompt=f"What is {i}+{i}?", answer=str(2 * i))) + "\n")
    folder = out["nanopack-test/math"] = os.path.join(root, "math")  # gsm8k's shape: two configs, no default
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            write_parquet(os.path.join(folder, config, f"{split}-00000-of-00001.parquet"), chats(4))
    with open(os.path.join(folder, "README.md"), "w") as f:
        splits = "".join(f"  - split: {s}\n    path: {{c}}/{s}-*\n" for s in ("train", "test"))
        f.write("---\nconfigs:\n" + "".join(f"- config_name: {c}\n  data_files:\n" + splits.format(c=c)
                                           for c in ("main", "socratic")) + "---\n")
    folder = out["nanopack-test/converted"] = os.path.join(root, "converted")  # the hub's refs/convert/parquet
    for shard in range(2):
        write_parquet(os.path.join(folder, "default", "train", f"{shard:04d}.parquet"), chats(4, offset=10 * shard))
    for name, card in (("globbed", "  data_files:\n  - split: train\n    path: data/*.jsonl\n"),
                       ("listed", "  data_files: [a.jsonl, b.jsonl]\n")):  # one split as a glob, or a list of files
        folder = out[f"nanopack-test/{name}"] = os.path.join(root, name)
        under = os.path.join(folder, "data" if name == "globbed" else "")
        os.makedirs(under, exist_ok=True)
        for part, offset in (("a", 0), ("b", 10)):
            with open(os.path.join(under, f"{part}.jsonl"), "w") as f:
                f.writelines(json.dumps(c) + "\n" for c in chats(3, offset))
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write("---\nconfigs:\n- config_name: default\n" + card + "---\n")
    folder = out["nanopack-test/scripted"] = os.path.join(root, "scripted")
    os.makedirs(folder)
    with open(os.path.join(folder, "scripted.py"), "w") as f:
        f.write("import datasets\n")
    return out
