"""Records as users download them (issue 40): Parquet tool calls and tool schemas without the keys Arrow filled with
null (JSONL keeps the nulls written); a glob or a list of files is one split; .jsonl.gz, .json.gz, JSON arrays and
.json JSON Lines read as the same records; a file that is not text named as what it is; bad records counted in one
pass, one error naming the first few, or skipped with bad_records='skip' and counted in meta.json."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from data.dataset import check_kind, prepare_data  # noqa: E402
from data.prepare import DataError, data_files, load, prepare  # noqa: E402
from nanopack.tokenizer import Tokenizer  # noqa: E402

TOK = Tokenizer.byte_level()


def chat(i):
    return {"messages": [{"role": "user", "content": f"What is {i}+1?"}, {"role": "assistant", "content": str(i + 1)}]}


def write_lines(path, lines, opener=open):
    """lines: dicts (dumped as JSON) or strings, one a line."""
    with opener(path, "wt") as f:
        f.writelines((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return str(path)


def token_files(out_dir):
    """-> {file name: array} of a prepared folder's token files."""
    return {f: np.load(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir)) if f.endswith(".npy")}


def assert_same_token_files(a, b):
    files_a, files_b = token_files(a), token_files(b)
    assert list(files_a) == list(files_b) and all(np.array_equal(files_a[f], files_b[f]) for f in files_a)


KW = dict(tokenizer=TOK, val_fraction=0, verbose=False)


# ---- 2: Parquet nulls are absent keys; JSONL keeps the nulls written ---------------------------------------------
def tool_tokenizer():
    """Byte-level tokens with Qwen2.5's real chat template: it writes tools and tool-call arguments with tojson."""
    with open(os.path.join(ROOT, "tests", "templates", "qwen2_5.jinja"), encoding="utf-8") as f:
        source = f.read()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]
    return Tokenizer("qwen2.5-bytes", r"\s+|\S+", {bytes([b]): b for b in range(256)},
                     {s: 256 + i for i, s in enumerate(specials)}, "model",
                     chat_template=(source, {"eos_token": "<|im_end|>"}, "qwen2_5.jinja"))


def tool_row(name, arguments):
    """A conversation calling `name` with `arguments` (a dict), its tool schema listing those arguments."""
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in arguments}, "required": list(arguments)}
    return {"messages": [{"role": "user", "content": f"Use {name}."},
                         {"role": "assistant", "tool_calls": [{"type": "function",
                                                               "function": {"name": name, "arguments": arguments}}]},
                         {"role": "tool", "content": "done"}, {"role": "assistant", "content": "Done."}],
            "tools": [{"type": "function", "function": {"name": name, "parameters": schema}}]}


def test_parquet_tool_calls_carry_only_their_own_keys(tmp_path):
    """Arrow gives both rows both rows' argument keys and schema properties, the other's as null; `datasets` and
    to_parquet write them so. Read back, each row renders as written: the same token files as the JSONL, no null."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [tool_row("weather", {"city": "Paris"}), tool_row("clock", {"tz": "CET", "format": "24h"})]
    table = pa.Table.from_pylist(rows)
    assert table.to_pylist()[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == dict(
        city="Paris", tz=None, format=None)  # the case: the merge is in the file
    pq.write_table(table, str(tmp_path / "tools.parquet"))
    tok = tool_tokenizer()
    prepare(str(tmp_path / "tools.parquet"), str(tmp_path / "pq"), **dict(KW, tokenizer=tok))
    prepare(write_lines(tmp_path / "tools.jsonl", rows), str(tmp_path / "js"), **dict(KW, tokenizer=tok))
    assert_same_token_files(tmp_path / "pq", tmp_path / "js")
    data, _ = load(str(tmp_path / "pq"), "train")
    text = tok.decode(data["ids"][:data["offsets"][1]].tolist())
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in text and "null" not in text
    # JSONL keeps a null the user wrote: it is rendered, as transformers renders it
    explicit = tool_row("weather", {"city": "Paris"})
    explicit["messages"][1]["tool_calls"][0]["function"]["arguments"]["tz"] = None
    prepare(write_lines(tmp_path / "explicit.jsonl", [explicit]), str(tmp_path / "ex"), **dict(KW, tokenizer=tok))
    data, _ = load(str(tmp_path / "ex"), "train")
    assert '"arguments": {"city": "Paris", "tz": null}' in tok.decode(data["ids"].tolist())


# ---- 6: a glob or a list of files is one split; a folder's error offers one -----------------------------------------
def test_a_glob_or_a_list_of_differently_named_files_is_one_split(tmp_path):
    (tmp_path / "d").mkdir()
    a = write_lines(tmp_path / "d" / "data_a.jsonl", [chat(i) for i in range(6)])
    b = write_lines(tmp_path / "d" / "data_b.jsonl", [chat(i) for i in range(6, 10)])
    glob_ = str(tmp_path / "d" / "data_*.jsonl")
    assert data_files(glob_) == [a, b] and data_files(f"{b},{a}") == [b, a] and data_files(f"{a}, {glob_}") == [a, a, b]
    # a folder keeps its split-by-name rule, and its error offers a way out that works
    with pytest.raises(DataError) as e:
        data_files(str(tmp_path / "d"))
    offered = f"{tmp_path / 'd'}/*"
    assert str(e.value) == (f"{tmp_path / 'd'}: several splits among its files; found 'data_a', 'data_b' — choose "
                            f"one with data_split, or read all of them as one split: a glob '{offered}' or a "
                            f"comma-separated list")
    assert data_files(offered) == [a, b]
    all_lines = write_lines(tmp_path / "all.jsonl", [chat(i) for i in range(10)])
    prepare(all_lines, str(tmp_path / "one"), **KW)
    for source in (offered, f"{a},{b}"):
        assert prepare(source, str(tmp_path / "two"), **KW)["counts"]["train"]["examples"] == 10
        assert_same_token_files(tmp_path / "one", tmp_path / "two")
    check_kind(f"{a},{b}", None, None, None, "sft")  # what train_sft.py checks first: no SystemExit
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        data_files(f"{a},{tmp_path / 'nope.jsonl'}")
    with pytest.raises(DataError, match="picks a split inside a folder, and this is a file, a pattern or a list"):
        data_files(f"{a},{b}", data_split="data_a")


# ---- 7: gzip, JSON arrays, .json JSON Lines; not-text named -------------------------------------------------------
def test_gzip_json_arrays_and_json_lines_read_as_the_same_records(tmp_path):
    rows = [chat(i) for i in range(12)]
    prepare(write_lines(tmp_path / "plain.jsonl", rows), str(tmp_path / "plain"), **KW)
    with open(tmp_path / "array.json", "w") as f:  # alpaca_data.json's layout: an indented array
        json.dump(rows, f, indent=4)
    with gzip.open(tmp_path / "array.json.gz", "wt") as f:
        json.dump(rows, f)
    sources = [write_lines(tmp_path / "lines.jsonl.gz", rows, gzip.open), write_lines(tmp_path / "lines.json", rows),
               str(tmp_path / "array.json"), str(tmp_path / "array.json.gz")]
    for source in sources:
        prepare(source, str(tmp_path / "out"), **KW)
        assert_same_token_files(tmp_path / "plain", tmp_path / "out")
    # a folder and a glob pick them up, as splits by name
    (tmp_path / "shards").mkdir()
    write_lines(tmp_path / "shards" / "train-00000-of-00002.jsonl.gz", rows[:5], gzip.open)
    with open(tmp_path / "shards" / "train-00001-of-00002.json", "w") as f:
        json.dump(rows[5:], f)
    assert len(data_files(str(tmp_path / "shards"))) == len(data_files(str(tmp_path / "shards" / "train-*"))) == 2
    prepare(str(tmp_path / "shards"), str(tmp_path / "out"), **KW)
    assert_same_token_files(tmp_path / "plain", tmp_path / "out")


def not_text(path, case):
    rows = [json.dumps(chat(i)) for i in range(30)]
    if case == "gzip, line 3 malformed":
        write_lines(path, rows[:2] + ["{not json"] + rows[2:], gzip.open)
    elif case == "gzip cut short":
        write_lines(path, rows, gzip.open)
        path.write_bytes(path.read_bytes()[:-60])
    elif case == "zstd":
        path.write_bytes(b"(\xb5/\xfd" + bytes(range(256)))
    elif case == "binary":
        path.write_bytes(np.arange(1000, dtype=np.int64).tobytes())
    elif case == "UTF-16":
        path.write_bytes("\n".join(rows).encode("utf-16"))
    elif case == "latin-1 line":
        path.write_bytes(("\n".join(rows[:3]) + '\n{"messages": "caf\xe9"}\n').encode("latin-1"))
    elif case == "array, element not an object":
        path.write_text("[\n" + ",\n".join(rows[:2] + ["  42"]) + "\n]")
    elif case == "array, malformed":
        path.write_text("[\n" + ",\n".join(rows[:3]) + ",\n  {\"messages\": [}\n]")
    elif case == "array cut short":
        path.write_text("[\n" + ",\n".join(rows[:3]) + ",\n")
    elif case == "pretty-printed object":
        path.write_text(json.dumps(chat(0), indent=2))


NOT_TEXT = {  # case -> regex the one-line error must match
    "gzip, line 3 malformed": r"x\.jsonl\.gz:3: malformed JSON \(Expecting property name enclosed in double quotes at "
                              r"column 2\) — each line",
    "gzip cut short": r"x\.jsonl\.gz:\d+: the gzip data is damaged or cut short \(.*\) — download the file again",
    "zstd": r"x\.jsonl\.gz: is zstd-compressed, not text — decompress it \(zstd -d\)",
    "binary": r"x\.jsonl\.gz: is binary data \(NUL bytes\), not JSON text",
    "UTF-16": r"x\.jsonl\.gz: is UTF-16 text, not UTF-8 — re-encode it \(iconv -f utf-16 -t utf-8\)",
    "latin-1 line": r"x\.jsonl\.gz:4: invalid UTF-8 byte b'\\xe9' .* \(iconv -f latin1 -t utf-8\)",
    "array, element not an object": r"x\.jsonl\.gz:4: an element of the array is a JSON int, not an object",
    "array, malformed": r"x\.jsonl\.gz:5: malformed JSON \(Expecting value\) — the file is read as one JSON array",
    "array cut short": r"x\.jsonl\.gz:5: malformed JSON \(Expecting value\)",
    "pretty-printed object": r"x\.jsonl\.gz:1: a JSON object written over several lines — write one record a line",
}


@pytest.mark.parametrize("case", list(NOT_TEXT))
def test_what_is_not_json_text_is_named(tmp_path, case):
    """Whatever its name (x.jsonl.gz here), a file is read by its first bytes; iconv is offered for text only."""
    path = tmp_path / "x.jsonl.gz"
    not_text(path, case)
    with pytest.raises(DataError) as e:
        prepare(str(path), str(tmp_path / "out"), **KW)
    assert e.match(NOT_TEXT[case]) and "\n" not in str(e.value)
    assert ("iconv" in str(e.value)) == (case in ("UTF-16", "latin-1 line"))
    assert not os.path.exists(tmp_path / "out" / "meta.json")


# ---- 9: bad records: counted in one pass; one error naming the first few, or skipped --------------------------------
BAD = {2: '{"messages": [{"role": "user", "content": "hi"}',  # line -> a bad line, and why
       5: json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}),
       8: json.dumps({"text": "hello"})}
WHY = {2: "malformed JSON", 5: r"messages\[1\] is an empty assistant turn", 8: "expected 'messages'"}


def with_bad_lines(path, n=10):
    lines = [BAD.get(i) or json.dumps(chat(i)) for i in range(1, n + 1)]
    return write_lines(path, lines), [chat(i) for i in range(1, n + 1) if i not in BAD]


def test_bad_records_are_one_error_naming_them_or_skipped_and_counted(tmp_path):
    path, good = with_bad_lines(tmp_path / "chats.jsonl")
    with pytest.raises(DataError) as e:
        prepare(path, str(tmp_path / "out"), **KW)
    assert e.match(rf"^{path}: 3 bad records: fix or delete them, or pass --bad_records=skip to leave them out "
                   rf"\(counted\); the first 3: \(1\) {path}:2: {WHY[2]} .* \(2\) {path}:5: {WHY[5]} .* \(3\) "
                   rf"{path}:8: {WHY[8]}")
    assert not os.path.exists(tmp_path / "out" / "meta.json")
    meta = prepare(path, str(tmp_path / "out"), bad_records="skip", **KW)
    assert (meta["bad_records"], meta["bad_records_skipped"], len(meta["bad_records_named"])) == ("skip", 3, 3)
    assert meta["bad_records_named"][0].startswith(f"{path}:2: malformed JSON (Expecting ',' delimiter at column 49)")
    prepare(write_lines(tmp_path / "good.jsonl", good), str(tmp_path / "good"), **KW)
    assert_same_token_files(tmp_path / "out", tmp_path / "good")


def test_a_file_of_bad_records_is_counted_not_collected(tmp_path):
    lines = ["{not json"] * 3000 + [json.dumps(chat(1))]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=r"bad\.jsonl: 3,000 bad records: .*the first 5: \(1\) .*bad\.jsonl:1: .* "
                                        r"\(5\) .*bad\.jsonl:5: malformed JSON") as e:
        prepare(path, str(tmp_path / "out"), **KW)
    assert "(6)" not in str(e.value) and "bad.jsonl:6:" not in str(e.value)
    meta = prepare(path, str(tmp_path / "out"), bad_records="skip", **KW)
    assert meta["bad_records_skipped"] == 3000 and len(meta["bad_records_named"]) == 5
    assert meta["counts"]["train"]["examples"] == 1
    with pytest.raises(DataError, match=r"bad\.jsonl: 3,000 bad records, and no good one; the first 5"):
        prepare(write_lines(path, lines[:-1]), str(tmp_path / "none"), bad_records="skip", **KW)


def test_bad_records_from_the_command_line_and_the_train_scripts_config(tmp_path):
    path, good = with_bad_lines(tmp_path / "chats.jsonl")
    cli = [sys.executable, os.path.join(ROOT, "data", "prepare.py"), "--input", path, "--out_dir", str(tmp_path / "p")]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith(f"error: {path}: 3 bad records") and "Traceback" not in r.stderr
    r = subprocess.run(cli + ["--bad_records=skip"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"bad records: 3 skipped (--bad_records skip), the first 3:\n  {path}:2: malformed JSON" in r.stdout
    # train_sft.py / train_dpo.py: the key reaches prepare through prepare_data
    c = dict(data=path, max_len=4096, overlong="error", val_fraction=0.0, seed=0, data_split=None, val_data=None,
             val_split=None, bad_records="skip")
    meta = json.load(open(os.path.join(prepare_data(c, str(tmp_path / "run"), TOK, "sft", 2048), "meta.json")))
    assert meta["bad_records_skipped"] == 3 and meta["counts"]["train"]["examples"] == len(good)
    with pytest.raises(SystemExit, match=rf"data error: {path}: 3 bad records"):
        prepare_data(dict(c, bad_records="error"), str(tmp_path / "run2"), TOK, "sft", 2048)
