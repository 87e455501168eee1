"""
data/prepare.py throughput and memory, Parquet vs JSONL, on synthetic UltraFeedback-like rows (the
ultrafeedback_binarized layout: a prompt string, chosen/rejected message lists of a ~160-word user turn and a
~250-word assistant reply, messages == chosen, ids and scores). Byte-level tokenizer, CPU only.

    python bench/bench_prepare.py                 # 200k rows
    python bench/bench_prepare.py --rows 5000     # a quick smoke run

Each format is prepared in its own subprocess, so the memory columns are per format:
  rows/s     rows read, checked, tokenized and written per second (the whole prepare() call)
  peak RSS   the process's peak resident memory (ru_maxrss). It includes the pages of the token files, which
             prepare maps to write the final .npy files, so it grows with the output for every format
  peak anon  the peak of anonymous memory (RssAnon, sampled every 50 ms): the Python heap, Arrow buffers,
             the writer's buffers. This is the figure that must not grow with the input file
"""
import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = ("the of and to in is that for it as with was on be by this are or at from but not have an they which you "
         "one were all we when your can said there use each how their if will up other about out many then them "
         "these so some would make like him into time has look two more write go see number no way could people "
         "my than first water been call who oil its now find long down day did get come made may part answer "
         "explain because function return value model training gradient preference response").split()


def rows(n, seed=0):
    """n ultrafeedback_binarized-like rows, generated from one pool of words (fast, deterministic)."""
    rng = random.Random(seed)
    pool = [rng.choice(WORDS) for _ in range(1 << 20)]

    def text(words):
        start = rng.randrange(len(pool) - 2 * words)
        return " ".join(pool[start:start + rng.randint(words // 2, 3 * words // 2)])

    for i in range(n):
        prompt = text(160)
        user = dict(content=prompt, role="user")
        chosen, rejected = [user, dict(content=text(250), role="assistant")], [user, dict(content=text(250),
                                                                                           role="assistant")]
        yield dict(prompt=prompt, prompt_id=f"{i:064x}", chosen=chosen, rejected=rejected, messages=chosen,
                   score_chosen=float(rng.randint(5, 10)), score_rejected=float(rng.randint(1, 5)))


def write_inputs(n, folder, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq
    jsonl, parquet = os.path.join(folder, "train.jsonl"), os.path.join(folder, "train_prefs-00000-of-00001.parquet")
    chunk, writer = [], None
    with open(jsonl, "w") as f:
        for row in rows(n):
            f.write(json.dumps(row) + "\n")
            chunk.append(row)
            if len(chunk) == row_group_size:
                table = pa.Table.from_pylist(chunk)
                writer = writer or pq.ParquetWriter(parquet, table.schema)
                writer.write_table(table, row_group_size=row_group_size)
                chunk = []
    if chunk:
        table = pa.Table.from_pylist(chunk)
        writer = writer or pq.ParquetWriter(parquet, table.schema)
        writer.write_table(table)
    writer.close()
    return dict(jsonl=jsonl, parquet=parquet)


def measure(path, out_dir):
    """In a subprocess: prepare(path) -> one JSON line with rows/s, peak RSS and peak anonymous memory."""
    from data.prepare import prepare
    peak_anon, done = [0], threading.Event()

    def sample():  # RssAnon leaves out file-backed pages (the memory-mapped token files)
        while not done.wait(0.05):
            with open("/proc/self/status") as f:
                anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
            peak_anon[0] = max(peak_anon[0], anon)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.time()
    meta = prepare(path, out_dir, "byte", max_len=1 << 20, val_fraction=0, verbose=False)
    seconds = time.time() - t0
    done.set()
    n = meta["counts"]["train"]["examples"]
    print(json.dumps(dict(rows=n, seconds=seconds, rows_per_s=n / seconds, tokens=meta["counts"]["train"]["tokens"],
                          peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          peak_anon_mib=peak_anon[0] / 1024)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--row_group_size", type=int, default=1000, help="rows per Parquet row group")
    p.add_argument("--dir", default=None, help="where the inputs and outputs go (default: a temporary folder)")
    p.add_argument("--measure", nargs=2, metavar=("INPUT", "OUT_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(*args.measure)
        sys.exit(0)
    folder = args.dir or tempfile.mkdtemp(prefix="bench_prepare_")
    os.makedirs(folder, exist_ok=True)
    t0 = time.time()
    inputs = write_inputs(args.rows, folder, args.row_group_size)
    print(f"{args.rows:,} rows written in {time.time() - t0:.0f} s: " + ", ".join(
        f"{fmt} {os.path.getsize(path) / 2**20:,.0f} MiB" for fmt, path in inputs.items()))
    print(f"{'format':<9} {'rows':>9} {'rows/s':>8} {'seconds':>8} {'tokens':>14} {'peak RSS MiB':>13} "
          f"{'peak anon MiB':>14}")
    for fmt, path in inputs.items():
        out = os.path.join(folder, f"out_{fmt}")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", path, out],
                           capture_output=True, text=True, check=True)
        m = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{fmt:<9} {m['rows']:>9,} {m['rows_per_s']:>8,.0f} {m['seconds']:>8.1f} {m['tokens']:>14,} "
              f"{m['peak_rss_mib']:>13,.0f} {m['peak_anon_mib']:>14,.0f}")
        shutil.rmtree(out)
    if not args.dir:
        shutil.rmtree(folder)
