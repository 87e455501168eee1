"""
Records as people download them -> (where, record) pairs, where = 'file:line' or 'file:row N' for
every message.

A file, a glob or a comma-separated list of them is one split; a folder's files form splits by name
(less the shard number). JSON Lines or a JSON array (.jsonl, .json), gzipped or not, read as a
stream; Parquet a row group at a time. Records that fail to read, parse or render are counted by
BadRecords: one error naming the first few, or left out.
"""
import codecs
import glob
import gzip
import json
import os
import re
import sys
import time
import zlib

# longest first: split_name strips one
DATA_EXTENSIONS = (".parquet", ".jsonl.gz", ".jsonl", ".json.gz", ".json")
BAD_RECORDS = ("error", "skip")
NAMED = 5  # bad records named in an error or a summary; the rest are counted
JSON_SPACE = re.compile(r"[ \t\r\n]*")
# characters: a JSON array element still unparsed past this is malformed, not unfinished
ELEMENT_LIMIT = 64 << 20
NOT_TEXT = {  # magic bytes -> what the file is, what to do
    b"(\xb5/\xfd": ("zstd-compressed", "decompress it (zstd -d)"),
    b"BZh": ("bzip2-compressed", "decompress it (bunzip2)"),
    b"\xfd7zXZ\x00": ("xz-compressed", "decompress it (unxz)"),
    b"PK\x03\x04": ("a zip archive", "unzip it"),
}


class DataError(ValueError):
    """Bad input data. The message reads '{path}:{line}: {what} — {how to fix}'."""


class BadRecords:
    """Records that fail to read, parse or render: counted, the first NAMED kept. policy 'error':
    one DataError at the end naming them (raise_error); 'skip': left out, counted in meta.json."""

    def __init__(self, policy="error"):
        if policy not in BAD_RECORDS:
            raise DataError(f"bad_records={policy!r}; choose one of {', '.join(BAD_RECORDS)}")
        self.policy, self.count, self.named = policy, 0, []

    def add(self, error):
        self.count += 1
        if len(self.named) < NAMED:
            self.named.append(str(error))

    def raise_error(self, source, usable=True):
        """Raise the one error that names them; source: the input; usable: some records are good (so
        'skip' helps)."""
        if self.count == 1:
            raise DataError(self.named[0]
                            + " (1 bad record; --bad_records=skip would leave it out)" * usable)
        how = ", and no good one"
        if usable:
            how = ": fix or delete them, or pass --bad_records=skip to leave them out (counted)"
        named = " ".join(f"({i}) {m}" for i, m in enumerate(self.named, 1))
        raise DataError(f"{source}: {self.count:,} bad records{how}; the first {len(self.named)}: "
                        f"{named}")


def split_name(path):
    """'data/train_prefs-00000-of-00002.parquet' -> 'train_prefs': the file name less its extension
    and shard number."""
    name = os.path.basename(path)
    return re.sub(r"[-_]?\d+(-of-\d+)?$", "", name[:len(name) - len(extension(name))])


def extension(path):
    """'.jsonl.gz' for 'a.jsonl.gz': a data extension whole, else the last one."""
    return next((e for e in DATA_EXTENSIONS if path.endswith(e)), os.path.splitext(path)[1])


def folder_files(path, data_split, key):
    """A folder's data files of one split (data_split, or the only one there)."""
    files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.endswith(DATA_EXTENSIONS)
                   and os.path.isfile(f))
    if not files:
        raise DataError(f"{path}: no .parquet, .jsonl or .json file (gzipped or not) in this "
                        "folder — pass the folder that holds the shards (often its data/ "
                        "subfolder)")
    splits = {}
    for f in files:
        splits.setdefault(split_name(f), []).append(f)
    if ((data_split is not None and data_split not in splits)
            or (data_split is None and len(splits) > 1)):
        found = ", ".join(map(repr, sorted(splits)))
        way_out = (f", or read all of them as one split: a glob '{os.path.join(path, '*')}' "
                   "or a comma-separated list")
        problem = f"no split {data_split!r}" if data_split else "several splits"
        raise DataError(f"{path}: {problem} among its files; found {found} — choose one with {key}"
                        + way_out * (data_split is None))
    return splits[data_split] if data_split is not None else files


def data_files(path, data_split=None, key="data_split"):
    """A file, a folder of shards, a glob, or a comma-separated list of files and globs -> the files
    to read, in order (a glob's in name order). A folder's split is data_split (key: the setting
    that names it, for messages)."""
    if os.path.isdir(path):
        files = folder_files(path, data_split, key)
    elif data_split is not None:
        raise DataError(f"{path}: {key}={data_split!r} picks a split inside a folder, and this is "
                        f"a file, a pattern or a list — pass the folder, or drop {key}")
    else:
        files = []
        for part in [path] if os.path.exists(path) else [p.strip() for p in path.split(",")
                                                         if p.strip()]:
            if os.path.isdir(part) or os.path.isfile(part):
                files += folder_files(part, None, key) if os.path.isdir(part) else [part]
                continue
            # a pattern naming its extension ('*.txt') takes what it names
            ext = os.path.splitext(part)[1]
            named = ext and not re.search(r"[*?\[]", ext)
            found = sorted(f for f in glob.glob(part) if os.path.isfile(f)
                           and (named or f.endswith(DATA_EXTENSIONS)))
            if not found:
                raise DataError(f"{part}: no such file, and no .parquet, .jsonl or .json file "
                                "(gzipped or not) matches it as a pattern — check the path")
            files += found
    by_name = {}
    for f in files:  # e.g. train.jsonl beside train.parquet: the same records twice
        other = by_name.setdefault(f[:len(f) - len(extension(f))], f)
        if other != f:
            raise DataError(f"{path}: the split is there in two formats, {other} and {f} (the same "
                            "records twice?) — read one of them")
    return files


def not_text(head):
    """The first bytes of a file -> why it is not UTF-8 text (what it is, what to do), or None."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(head) > 1 and b"\x00" not in head[::2]
                                                       # UTF-16 ASCII
                                                       and head[1::2].count(0) > len(head) // 4):
        return "is UTF-16 text, not UTF-8 — re-encode it (iconv -f utf-16 -t utf-8)"
    for magic, (what, how) in NOT_TEXT.items():
        if head.startswith(magic):
            return f"is {what}, not text — {how}"
    if b"\x00" in head:
        return ("is binary data (NUL bytes), not JSON text — pass a .jsonl, .json or .parquet file "
                "(gzipped or not); is it the file you meant?")
    return None


def json_record(line, where):
    """One JSON Lines line (bytes) -> its record, None for a blank line, or the DataError that says
    why it is none."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        if b"\x00" in line:
            return DataError(f"{where}: NUL bytes in the line: binary data, not JSON text — delete "
                             "the line (a file damaged where it was written or copied?)")
        return DataError(f"{where}: invalid UTF-8 byte {line[e.start:e.start + 1]!r} at byte "
                         f"{e.start + 1} of the line — re-encode the file as UTF-8 (iconv -f "
                         "latin1 -t utf-8)")
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        # every line of a pretty-printed file would be bad: one error for the file
        if text.strip() == "{":
            raise DataError(f"{where}: a JSON object written over several lines — write one "
                            "record a line (JSON Lines), or make the file a JSON array "
                            "[{...}, {...}]") from None
        return DataError(f"{where}: malformed JSON ({e.msg} at column {e.pos + 1}) — each line "
                         "must be one complete JSON object; fix or delete this line")
    if not isinstance(record, dict):
        return DataError(f"{where}: the line is a JSON {type(record).__name__}, not an object — "
                         f"write one {{\"messages\": ...}} or {{\"chosen\", \"rejected\"}} object "
                         "per line")
    return record


def json_lines(f, path):
    """Yield (line number, record or DataError) per non-blank line of binary stream f."""
    for lineno, line in enumerate(f, 1):
        record = json_record(line.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else line,
                             f"{path}:{lineno}")
        if record is not None:
            yield lineno, record


def json_array(f, path):
    """Yield (line number, record or DataError) per element of the JSON array binary stream f holds,
    one element in memory at a time. A malformed array is a DataError raised: nothing after it can
    be found."""
    utf8, decode = codecs.getincrementaldecoder("utf-8-sig")(), json.JSONDecoder().raw_decode
    # buf[pos:]: text not yet read; line: the line of buf[pos]
    buf, pos, line, eof = "", 0, 1, False

    def more():
        nonlocal buf, pos, eof
        # doubling: an element of any size in linear time
        chunk = f.read(max(1 << 20, len(buf) - pos))
        eof = not chunk
        try:
            buf, pos = buf[pos:] + utf8.decode(chunk, final=eof), 0
        except UnicodeDecodeError as e:
            near = line + buf.count("\n", pos) + chunk[:e.start].count(b"\n")
            raise DataError(f"{path}:{near}: invalid UTF-8 byte {chunk[e.start:e.start + 1]!r} — "
                            "re-encode the file as UTF-8 (iconv -f latin1 -t utf-8)") from None

    def next_char():  # past whitespace: the next character, "" at the end
        nonlocal pos, line
        while True:
            end = JSON_SPACE.match(buf, pos).end()
            line, pos = line + buf.count("\n", pos, end), end
            if pos < len(buf) or eof:
                return buf[pos:pos + 1]
            more()

    def malformed(what, at):
        at_line = line + buf.count("\n", pos, at)
        return DataError(f"{path}:{at_line}: {what} — the file is read as one JSON array of "
                         f"records, [{{...}}, {{...}}]; fix it there (an editor or python -m "
                         "json.tool shows where)")

    next_char()
    pos += 1  # the '[' the caller saw
    if next_char() == "]":
        pos += 1
    else:
        while True:
            while True:  # decode the element, reading on while it may be unfinished
                try:
                    element, end = decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                except json.JSONDecodeError as e:
                    if eof or len(buf) - pos > ELEMENT_LIMIT:
                        raise malformed(f"malformed JSON ({e.msg})", e.pos) from None
                more()
            yield line, element if isinstance(element, dict) else DataError(
                f"{path}:{line}: an element of the array is a JSON {type(element).__name__}, not "
                f"an object — the array must hold {{\"messages\": ...}} or {{\"chosen\", "
                f"\"rejected\"}} objects")
            line, pos = line + buf.count("\n", pos, end), end
            c = next_char()
            if c == "]":
                pos += 1
                break
            if c != ",":
                raise malformed(f"expected ',' or ']' after an element, found {buf[pos:pos + 20]!r}"
                                if c else
                                "the array ends without its ']' (a file cut short?)", pos)
            pos += 1
            if next_char() == "]":
                raise malformed("a ',' before the closing ']'", pos)
    if next_char():
        raise malformed(f"text after the array's closing ']': {buf[pos:pos + 20]!r}", pos)


def read_json(path, bad=None):
    """Yield (where, record, fraction of the file read) from a JSON Lines file or a JSON array,
    gzipped or not (told by its first bytes, whatever its name). bad: a BadRecords that counts bad
    lines (None: raise the first)."""
    size = max(os.path.getsize(path), 1)
    with open(path, "rb") as raw:
        packed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw, mode="rb") if packed else raw
        lineno = 0
        try:
            head = f.read(4096)
            problem = not_text(head)
            if problem:
                raise DataError(f"{path}: {'its gzip content ' if packed else ''}{problem}")
            f.seek(0)
            array = head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
            for lineno, record in (json_array if array else json_lines)(f, path):
                if not isinstance(record, DataError):
                    yield f"{path}:{lineno}", record, raw.tell() / size
                elif bad is None:
                    raise record
                else:
                    bad.add(record)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise DataError(f"{path}:{lineno + 1}: the gzip data is damaged or cut short ({e}) — "
                            "download the file again") from None


def without_nulls(x):
    """A Parquet row with every null field left out, at any depth (list items kept as they are)."""
    if isinstance(x, dict):
        return {k: without_nulls(v) for k, v in x.items() if v is not None}
    return [without_nulls(v) for v in x] if isinstance(x, list) else x


def read_parquet(path):
    """Yield (where, record, fraction of the file read) per row, where = 'path:row N'; memory: one
    row group. A null field is left out: Arrow gives every row of a column every key any row has
    (tool-call arguments, tools' schemas), filled with null, so a null cannot say more than
    'absent'."""
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow — pip install pyarrow") from None
    row = 0
    with open(path, "rb") as f:
        try:
            pf = pq.ParquetFile(f)
            n = max(pf.metadata.num_rows, 1)
            # not iter_batches: that pre-buffers every row group at once
            for group in range(pf.num_row_groups):
                for batch in pf.read_row_group(group).to_batches(1024):
                    for record in batch.to_pylist():
                        row += 1
                        yield f"{path}:row {row}", without_nulls(record), row / n
        except pyarrow.ArrowException as e:
            at = f"{path}:row {row + 1}" if row else path
            raise DataError(f"{at}: not readable as Parquet ({' '.join(str(e).split())}) — "
                            "download the file again, or check that it is Parquet") from None


def is_parquet(path):
    with open(path, "rb") as f:
        return path.endswith(".parquet") or f.read(4) == b"PAR1"


def parse_fields(spec):
    """The key `fields`: 'theirs:ours,...' or a dict {theirs: ours} -> {their name: the name we
    read}."""
    if not spec:
        return {}
    split = [p.partition(":")[::2] for p in str(spec).split(",")]
    pairs = spec.items() if isinstance(spec, dict) else split
    out = {}
    for theirs, ours in pairs:
        theirs, ours = str(theirs).strip(), str(ours).strip()
        if not theirs or not ours or theirs in out or ours in out.values():
            raise DataError(f"fields={spec!r}: write it as their_field:our_field pairs, "
                            "comma-separated, each name once (e.g. --fields=question:prompt)")
        out[theirs] = ours
    return out


def rename_fields(record, fields, where):
    """A record with its fields renamed by `fields` (parse_fields'); two that would share a name: an
    error."""
    out = {}
    for k, v in record.items():
        name = fields.get(k, k)
        if name in out:
            a, b = [f for f in record if fields.get(f, f) == name]
            spec = ",".join(f"{x}:{y}" for x, y in fields.items())
            raise DataError(f"{where}: the record's {a!r} and {b!r} would both be {name!r} "
                            f"(fields={spec}) — rename only one of them")
        out[name] = v
    return out


def read_records(files, verbose=True, bad=None, fields=None):
    """Yield (where, record) from each file in turn; verbose: progress to stderr every 10 s, a total
    at the end. bad: a BadRecords that counts lines that are not records (None: raise at the first).
    fields: parse_fields', the renames applied to every record."""
    sizes = [os.path.getsize(f) for f in files]
    t0, shown, rows = time.time(), time.time(), 0
    for i, path in enumerate(files):
        for where, record, done in read_parquet(path) if is_parquet(path) else read_json(path, bad):
            rows += 1
            if verbose and time.time() - shown > 10:
                shown = time.time()
                # by bytes, over all the files
                frac = (sum(sizes[:i]) + done * sizes[i]) / max(sum(sizes), 1)
                eta = (shown - t0) * (1 - frac) / max(frac, 1e-9)
                print(f"{where}: {rows:,} rows ({frac:.0%}), {rows / (shown - t0):,.0f} rows/s, "
                      f"ETA {eta // 60:.0f}m{eta % 60:02.0f}s", file=sys.stderr, flush=True)
            try:
                record = rename_fields(record, fields, where) if fields else record
            except DataError as e:
                if bad is None:
                    raise
                bad.add(e)
                continue
            yield where, record
    if verbose:
        print(f"read {rows:,} rows from {len(files)} file(s) in {time.time() - t0:.1f} s")
