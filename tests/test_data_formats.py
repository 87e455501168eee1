"""data/prepare.py on data as people download it: Parquet files, shard folders, split folders and globs give
token files identical to the same records as JSONL; HH-RLHF transcripts become a shared prompt and two replies;
bad Parquet input is one line naming the file (and row), with nothing written; peek_kind tells SFT from DPO."""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")  # optional at run time: only Parquet input needs it
import pyarrow.parquet as pq  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data.prepare as prepare_module  # noqa: E402
import data.records as records_module  # noqa: E402
from data.prepare import parse, peek_kind, prepare  # noqa: E402
from data.records import DataError, data_files  # noqa: E402
from nanopack.tokenizer import Tokenizer  # noqa: E402

TOK = Tokenizer.byte_level()
WORDS = "the a cat sat on mat why how café 東京 🙂 answer is four 2+2 yes no".split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def conversation(rng, turns):
    """Alternating user/assistant messages ending with the assistant, sometimes after a system message."""
    messages = [dict(role="system", content=text(rng, 5))] if rng.random() < 0.3 else []
    return messages + [dict(role=("user", "assistant")[i % 2], content=text(rng, 12)) for i in range(2 * turns)]


def hh(messages):
    """Messages -> one HH-RLHF transcript string."""
    return "".join(f"\n\nHuman: {m['content']}" if m["role"] == "user" else f"\n\nAssistant: {m['content']}"
                   for m in messages)


def records(schema, n=40, seed=0):
    """n records in the layout of a downloaded dataset, extra columns included."""
    rng, out = random.Random(seed), []
    for i in range(n):
        conv = [m for m in conversation(rng, rng.randint(1, 3)) if schema != "hh" or m["role"] != "system"]
        prompt, good, bad = conv[:-1], conv[-1], dict(role="assistant", content=text(rng, 12) + " (worse)")
        out.append({
            "tulu": lambda: dict(id=f"tulu_{i}", messages=conv, source="synthetic"),  # Tulu 3 SFT mixture
            "ultrafeedback": lambda: dict(prompt=prompt[-1]["content"], prompt_id=f"{i:08x}", chosen=conv,
                                          rejected=prompt + [bad], messages=conv, score_chosen=8.0,
                                          score_rejected=float(i % 7)),  # ultrafeedback_binarized
            "strings": lambda: dict(prompt=prompt[-1]["content"], chosen=good["content"], rejected=bad["content"]),
            "hh": lambda: dict(chosen=hh(conv), rejected=hh(prompt + [bad])),  # Anthropic HH-RLHF
        }[schema]())
    return out


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def write_parquet(path, rows, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
    return str(path)


def token_files(out_dir):
    """-> ({file name: array}, meta without the input paths) of a prepared folder."""
    arrays = {f: np.load(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir)) if f.endswith(".npy")}
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = {k: v for k, v in json.load(f).items() if k not in ("source", "val_source", "data_split")}
    return arrays, meta


def assert_same_token_files(a, b):
    (arrays_a, meta_a), (arrays_b, meta_b) = token_files(a), token_files(b)
    assert list(arrays_a) == list(arrays_b) == [f"{s}_{n}.npy" for s in ("train", "val")
                                                 for n in ("ids", "mask", "offsets")]
    for name in arrays_a:
        assert arrays_a[name].dtype == arrays_b[name].dtype and np.array_equal(arrays_a[name], arrays_b[name]), name
    assert meta_a == meta_b


def assert_nothing_written(out_dir):
    assert not os.path.exists(os.path.join(out_dir, "meta.json"))
    assert not os.path.isdir(out_dir) or not [f for f in os.listdir(out_dir) if f.endswith(".tmp")]


# --------------------------------------------------------------------------------------------------
# Parquet (one file, shards, a glob, a split folder) == the same records as JSONL

@pytest.mark.parametrize("layout", ["file", "shards", "glob"])
@pytest.mark.parametrize("schema", ["tulu", "ultrafeedback", "strings", "hh"])
def test_parquet_gives_the_same_token_files_as_jsonl(tmp_path, schema, layout):
    rows = records(schema)
    kw = dict(tokenizer=TOK, val_fraction=0.2, seed=3, verbose=False)  # the val draw must line up record by record
    meta = prepare(write_jsonl(tmp_path / "all.jsonl", rows), str(tmp_path / "from_jsonl"), **kw)
    assert meta["kind"] == ("sft" if schema == "tulu" else "dpo") and meta["counts"]["val"]["examples"] > 0
    shards = tmp_path / "data"
    shards.mkdir()
    if layout == "file":
        source = write_parquet(shards / "train.parquet", rows)
    else:  # unequal shards of several row groups each, read in name order
        for k, (a, b) in enumerate([(0, 15), (15, 16), (16, 40)]):
            write_parquet(shards / f"train-{k:05d}-of-00003.parquet", rows[a:b])
        source = str(shards) if layout == "shards" else str(shards / "train-*.parquet")
        assert len(data_files(source)) == 3 and pq.ParquetFile(data_files(source)[2]).num_row_groups == 4
    prepare(source, str(tmp_path / "from_parquet"), **kw)
    assert_same_token_files(tmp_path / "from_jsonl", tmp_path / "from_parquet")


def test_split_folder_and_val_input(tmp_path):
    train, test = records("ultrafeedback", 30, seed=1), records("ultrafeedback", 12, seed=2)
    folder = tmp_path / "ultrafeedback_binarized" / "data"
    folder.mkdir(parents=True)
    write_parquet(folder / "train_prefs-00001-of-00002.parquet", train[20:])
    write_parquet(folder / "train_prefs-00000-of-00002.parquet", train[:20])
    write_parquet(folder / "test_prefs-00000-of-00001.parquet", test)
    kw = dict(tokenizer=TOK, verbose=False)
    # several splits and none chosen, or a split that is not there: one error listing the splits, nothing written
    for split, message in ((None, "several splits"), ("train", "no split 'train'")):
        with pytest.raises(DataError, match=rf"data: {message} among its files; found 'test_prefs', 'train_prefs' "
                                            r"— choose one with data_split"):
            prepare(str(folder), str(tmp_path / "out"), data_split=split, **kw)
        assert not os.path.exists(tmp_path / "out")
    with pytest.raises(DataError, match="picks a split inside a folder"):
        data_files(str(folder / "test_prefs-00000-of-00001.parquet"), data_split="test_prefs")
    # train from one split, val from the other: the same files as the two splits written as JSONL
    meta = prepare(str(folder), str(tmp_path / "pq"), data_split="train_prefs",
                   val_input=str(folder / "test_prefs-*.parquet"), **kw)
    assert meta["counts"]["train"]["examples"] == 30 and meta["counts"]["val"]["examples"] == 12
    assert meta["val_fraction"] is None and meta["val_source"].endswith("test_prefs-*.parquet")
    prepare(write_jsonl(tmp_path / "train.jsonl", train), str(tmp_path / "js"),
            val_input=write_jsonl(tmp_path / "test.jsonl", test), **kw)
    assert_same_token_files(tmp_path / "pq", tmp_path / "js")
    # and the train split alone equals the train records with nothing held out
    prepare(str(tmp_path / "train.jsonl"), str(tmp_path / "all"), val_fraction=0, **kw)
    a, b = token_files(tmp_path / "pq")[0], token_files(tmp_path / "all")[0]
    assert all(np.array_equal(a[f"train_{n}.npy"], b[f"train_{n}.npy"]) for n in ("ids", "mask", "offsets"))


def test_cli_reads_a_split_folder(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_parquet(folder / "train-00000-of-00001.parquet", records("tulu", 10))
    write_parquet(folder / "test-00000-of-00001.parquet", records("tulu", 4, seed=5))
    cli = [sys.executable, os.path.join(ROOT, "data", "prepare.py"), "--input", str(folder)]
    r = subprocess.run(cli + ["--out_dir", str(tmp_path / "bad")], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"error: {folder}: several splits among its files; found 'test', 'train' — "
                                f"choose one with data_split, or read all of them as one split: a glob "
                                f"'{folder}/*' or a comma-separated list")
    r = subprocess.run(cli + ["--data_split", "train", "--val_input", str(folder / "test-*.parquet"),
                              "--out_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    counts = json.load(open(tmp_path / "out" / "meta.json"))["counts"]
    assert (counts["train"]["examples"], counts["val"]["examples"]) == (10, 4)


@pytest.mark.slow
def test_train_dpo_takes_a_downloaded_split_folder(tmp_path):
    """--data/--data_split/--val_data as a user passes them: the run's token files equal prepare()'s."""
    folder = tmp_path / "ultrafeedback_binarized" / "data"
    folder.mkdir(parents=True)
    write_parquet(folder / "train_prefs-00000-of-00001.parquet", records("ultrafeedback", 24, seed=1))
    write_parquet(folder / "test_prefs-00000-of-00001.parquet", records("ultrafeedback", 6, seed=2))
    run = [sys.executable, os.path.join(ROOT, "train_dpo.py"), "--init_from=scratch", "--preset=tiny",
           f"--out_dir={tmp_path / 'run'}", f"--data={folder}", "--max_iters=2", "--batch_size=4", "--eval_interval=0"]
    r = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().startswith(f"data error: {folder}: several splits among its files")
    r = subprocess.run(run + ["--data_split=train_prefs", f"--val_data={folder}/test_prefs-*.parquet"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    prepare(str(folder), str(tmp_path / "direct"), tokenizer=TOK, max_len=2048,  # tiny: 2048 positions
            data_split="train_prefs", val_input=str(folder / "test_prefs-*.parquet"), verbose=False)
    assert_same_token_files(tmp_path / "run" / "data", tmp_path / "direct")
    os.rename(folder.parent, tmp_path / "moved")  # the records may go: a resumed run reads its own token files
    r = subprocess.run(run[:2] + ["--init_from=resume", f"--out_dir={tmp_path / 'run'}", "--max_iters=3"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and '"iter": 3' in open(tmp_path / "run" / "metrics.jsonl").read(), r.stderr[-3000:]


def test_progress_line_with_rows_per_second_and_eta(tmp_path, monkeypatch, capsys):
    clock = iter(range(0, 10**6, 4))  # 4 s a call: a line every third record
    monkeypatch.setattr(records_module.time, "time", lambda: next(clock))
    prepare(write_parquet(tmp_path / "t.parquet", records("tulu", 12)), str(tmp_path / "out"), TOK)
    out, err = capsys.readouterr()
    progress = [line for line in err.splitlines() if "rows/s" in line]
    assert 2 <= len(progress) <= 4
    assert progress[0].startswith(f"{tmp_path / 't.parquet'}:row ") and " ETA " in progress[0]
    assert "\nread 12 rows from 1 file(s) in " in "\n" + out  # the total on stdout, with prepare's summary


# --------------------------------------------------------------------------------------------------
# HH-RLHF transcripts: the shared turns are the prompt, the last Assistant turns the replies

def user(content):
    return dict(role="user", content=content)


def assistant(content):
    return dict(role="assistant", content=content)


def test_hh_transcripts_split_into_prompt_and_replies():
    one = {"chosen": "\n\nHuman: What is 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: 5"}
    assert parse(one, "x:1") == ("dpo", ([user("What is 2+2?")], [assistant("4")], [assistant("5")]))
    # several turns; newlines inside a turn, a marker without its "\n\n" and a second space are text
    shared = ("\n\nHuman: Hi.\nTwo lines.\n\nAssistant:  Hello, Human: how can I help?\n\nHuman: A poem?"
              "\n\nAssistant:")
    many = {"chosen": shared + " Roses are red.\n\nViolets are blue.", "rejected": shared + " No."}
    prompt = [user("Hi.\nTwo lines."), assistant(" Hello, Human: how can I help?"), user("A poem?")]
    assert parse(many, "x:1") == ("dpo", (prompt, [assistant("Roses are red.\n\nViolets are blue.")],
                                          [assistant("No.")]))


def test_hh_line_trains_the_last_reply_only(tmp_path):
    """The bug this fixes: an HH line used to be one assistant reply per side, Human turns trained."""
    line = {"chosen": "\n\nHuman: q1\n\nAssistant: a1\n\nHuman: q2\n\nAssistant: good",
            "rejected": "\n\nHuman: q1\n\nAssistant: a1\n\nHuman: q2\n\nAssistant: bad"}
    explicit = {"prompt": [user("q1"), assistant("a1"), user("q2")], "chosen": "good", "rejected": "bad"}
    for name, row in (("hh", line), ("explicit", explicit)):
        prepare(write_jsonl(tmp_path / f"{name}.jsonl", [row]), str(tmp_path / name), TOK, val_fraction=0,
                verbose=False)
    assert_same_token_files(tmp_path / "hh", tmp_path / "explicit")
    arrays, _ = token_files(tmp_path / "hh")
    ids, mask, offsets = arrays["train_ids.npy"], arrays["train_mask.npy"], arrays["train_offsets.npy"]
    chosen = slice(offsets[0], offsets[1])
    assert TOK.decode(ids[chosen][mask[chosen] == 1]) == "good<|end|>"
    assert TOK.decode(ids[chosen]) == ("<|bos|><|user|>q1<|end|><|assistant|>a1<|end|><|user|>q2<|end|>"
                                       "<|assistant|>good<|end|>")


Q, A = "\n\nHuman: q", "\n\nAssistant: a"
BAD_HH = {  # name -> (chosen, rejected, regex the message must match after the place)
    "no markers": ("a", "b", r"'chosen' has no '\\n\\nHuman:' / '\\n\\nAssistant:' turns — with no 'prompt', chosen "
                             r"and rejected strings must be HH-RLHF transcripts"),
    "text before the first turn": ("Intro" + Q + A, Q + A + "2",
                                   r"'chosen' has text before its first turn: 'Intro'"),
    "two Human turns": (Q + A, Q + Q + A + "2",
                        r"'rejected' turn 2 is Human's, where turns alternate Human, Assistant"),
    "Assistant first": (A + Q + A, Q + A + "2", r"'chosen' turn 1 is Assistant's"),
    "ends with Human": (Q + A + Q, Q + A + "2", r"'chosen' ends with a Human turn, not the Assistant's reply"),
    "prompts differ": (Q + A, "\n\nHuman: other" + A + "2", r"chosen and rejected differ in a user turn"),
    "earlier turns differ": (Q + A + Q + A, Q + "\n\nAssistant: b" + Q + A + "2",
                             r"chosen and rejected differ in a user turn"),
    "same reply": (Q + A, Q + A, r"chosen and rejected are identical"),
    "empty reply": (Q + "\n\nAssistant:", Q + A, r"chosen\[1\] is an empty assistant turn"),
}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("case", list(BAD_HH))
def test_malformed_hh_is_one_error_naming_the_place(tmp_path, case, fmt):
    chosen, rejected, message = BAD_HH[case]
    rows = [dict(chosen=Q + A, rejected=Q + A + "2"), dict(chosen=chosen, rejected=rejected)]
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"hh.{fmt}", rows)
    with pytest.raises(DataError, match=rf"hh\.{fmt}:{'row ' * (fmt == 'parquet')}2: {message}") as e:
        prepare(path, str(tmp_path / "out"), TOK, verbose=False)
    assert "\n" not in str(e.value)
    assert_nothing_written(tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# bad Parquet files: one line each, naming the file (and row), nothing written

def bad_parquet(case, path):
    good = records("tulu", 12)
    if case == "corrupt":
        path.write_bytes(random.Random(0).randbytes(3000))
    elif case == "zero bytes":
        path.write_bytes(b"")
    elif case == "truncated":
        write_parquet(path, good)
        path.write_bytes(path.read_bytes()[:-200])
    elif case == "no rows":
        pq.write_table(pa.Table.from_pylist(good).slice(0, 0), str(path))
    elif case == "messages as JSON strings":
        write_parquet(path, [dict(r, messages=json.dumps(r["messages"])) for r in good])
    elif case == "chosen as int":
        write_parquet(path, [dict(prompt="q", chosen=i, rejected="b") for i in range(12)])
    elif case == "missing column":
        write_parquet(path, [dict(prompt="q", chosen="a") for _ in range(12)])
    elif case == "bad row in a later row group":
        write_parquet(path, good[:8] + [dict(good[8], messages=[user("q"), assistant(" ")])] + good[9:])


BAD_PARQUET = {  # case -> regex the message must match, after the file's path
    "corrupt": r": not readable as Parquet \(.*\) — download the file again",
    "zero bytes": r": not readable as Parquet \(.*\) — download the file again",
    "truncated": r": not readable as Parquet \(.*\) — download the file again",
    "no rows": r": no examples found — is the file empty\?",
    "messages as JSON strings": r":row 1: 'messages' must be a non-empty list of \{\"role\", \"content\"\} messages, "
                                r"got \"\[\{",
    "chosen as int": r":row 1: 'chosen' must be a non-empty list .* got 0 — fix",
    "missing column": r":row 1: expected 'messages' \(SFT\) or 'chosen' and 'rejected' \(DPO\), got keys "
                      r"\['chosen', 'prompt'\]",
    "bad row in a later row group": r":row 9: messages\[1\] is an empty assistant turn",
}


@pytest.mark.parametrize("case", list(BAD_PARQUET))
def test_bad_parquet_is_one_line_and_writes_nothing(tmp_path, case):
    path = tmp_path / "bad.parquet"
    bad_parquet(case, path)
    with pytest.raises(DataError) as e:
        prepare(str(path), str(tmp_path / "out"), TOK, verbose=False)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    assert e.match(BAD_PARQUET[case])
    assert_nothing_written(tmp_path / "out")


def test_missing_paths_and_pyarrow_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"nope\.parquet: no such file, and no \.parquet, \.jsonl or \.json file "
                                          r"\(gzipped or not\) matches it as a pattern — check the path"):
        prepare(str(tmp_path / "nope.parquet"), str(tmp_path / "out"), TOK, verbose=False)
    (tmp_path / "dataset").mkdir()
    with pytest.raises(DataError, match=r"dataset: no \.parquet, .* in this folder — pass the folder that"):
        prepare(str(tmp_path / "dataset"), str(tmp_path / "out"), TOK, verbose=False)
    assert not os.path.exists(tmp_path / "out")
    path = write_parquet(tmp_path / "t.parquet", records("tulu", 3))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed: its import raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"t\.parquet: reading Parquet needs pyarrow — pip install pyarrow$"):
        prepare(path, str(tmp_path / "out"), TOK, verbose=False)
    assert_nothing_written(tmp_path / "out")


# --------------------------------------------------------------------------------------------------
# peek_kind: SFT or DPO from the first record, before any tokenizing

@pytest.mark.parametrize("schema", ["tulu", "ultrafeedback", "strings", "hh"])
def test_peek_kind(tmp_path, schema, monkeypatch):
    monkeypatch.setattr(prepare_module, "render", None)  # it must not be needed
    rows, kind = records(schema, 5), "sft" if schema == "tulu" else "dpo"
    path = tmp_path / "a.jsonl"
    path.write_text("\n" + json.dumps(rows[0]) + "\n{not json\n")  # only the first record is read
    assert peek_kind(str(path)) == (kind, f"{path}:2")
    assert peek_kind(write_parquet(tmp_path / "b.parquet", rows)) == (kind, f"{tmp_path / 'b.parquet'}:row 1")
    (tmp_path / "split").mkdir()
    write_parquet(tmp_path / "split" / "test-00000-of-00001.parquet", records("tulu", 2))
    write_parquet(tmp_path / "split" / "train-00000-of-00001.parquet", rows)
    assert peek_kind(str(tmp_path / "split"), "train")[0] == kind
    assert peek_kind(str(tmp_path / "split"), "test")[0] == "sft"


def test_peek_kind_names_a_bad_or_missing_first_record(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [dict(chosen="just text", rejected="other")])
    with pytest.raises(DataError, match=r"a\.jsonl:1: 'chosen' has no '\\n\\nHuman:'"):
        peek_kind(path)
    empty = tmp_path / "e.parquet"
    pq.write_table(pa.Table.from_pylist(records("tulu", 2)).slice(0, 0), str(empty))
    with pytest.raises(DataError, match=r"e\.parquet: no examples found"):
        peek_kind(str(empty))
