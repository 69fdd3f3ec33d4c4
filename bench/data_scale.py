#!/usr/bin/env python3
"""Data at scale (issue 11): tokenization rows/s, cached start-up, and peak memory while training on a
text corpus far larger than a process should hold.

Two measurements:

``tokenize``  ``datasets.map`` (memfit's encoding, ``memfit.data.arrow.encode_dataset``) over a
              ``.txt`` corpus with 1 and 2 processes, each from a fresh cache: documents (rows) per
              second. The ``text`` builder's own read (and memfit's cut into documents) is timed apart.
``train``     ``memfit train --model tiny`` (byte tokenizer) a few steps in a subprocess, twice: with a
              fresh ``datasets`` cache (tokenize + pack + train) and again with the cache warm (the
              start-up of a second run). The process tree's memory is sampled from ``/proc`` every
              0.2 s: peak RSS (all of it), peak anonymous RSS (the heap: what cannot be paged back to
              the file) and, from ``wait4``, the largest process's ``ru_maxrss`` (what
              ``/usr/bin/time -v`` prints). ``data_s`` is the time until memfit prints its preamble
              (data read, tokenized, packed and the unigram baseline computed).

Memory-mapped Arrow pages that a process reads count in its RSS as file-backed pages (``RssFile``);
the kernel drops them under memory pressure, so the anonymous figure is the one that must stay
bounded. Make the corpus first (outside the repository):

    python scripts/make_corpus.py --bytes 2e9 --out /tmp/corpus-2g
    python bench/data_scale.py train --data /tmp/corpus-2g/stories.txt --num-proc 2 --out -
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/*/stat's parent ids)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _status_kib(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0])
    except OSError:
        pass
    return fields


class TreeMemory:
    """Peak RSS and anonymous RSS of a process tree, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak_rss = self.peak_anon = self.peak_file = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            rss = anon = file = 0
            for pid in _tree(self.pid):
                st = _status_kib(pid)
                rss, anon, file = rss + st.get("VmRSS", 0), anon + st.get("RssAnon", 0), file + st.get("RssFile", 0)
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss * 1024), max(self.peak_anon, anon * 1024)
            self.peak_file = max(self.peak_file, file * 1024)
            time.sleep(self.every_s)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def train_once(data: str, cache: Path, *, num_proc: int, steps: int, output: Path) -> dict:
    """One ``memfit train`` subprocess: wall time, data-phase time, peak memory."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "memfit", "train", "--model", "tiny", "--data", data, "--max-steps", str(steps),
           "--num-proc", str(num_proc), "--eval-fraction", "0.0002", "--eval-every", str(steps), "--samples", "0",
           "--save-every", "0", "--output", str(output), "--overwrite", "--threads", "1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mem = TreeMemory(proc.pid)
    data_s, lines = None, []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if data_s is None and line.startswith("model tiny"):
            data_s = time.perf_counter() - t0
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    mem.close()
    if status != 0:
        raise SystemExit("memfit train failed:\n" + "\n".join(lines[-30:]))
    return {"wall_s": round(wall, 2), "data_s": round(data_s, 2) if data_s else None,
            "peak_rss_bytes": mem.peak_rss, "peak_anon_bytes": mem.peak_anon, "peak_file_bytes": mem.peak_file,
            "ru_maxrss_bytes": usage.ru_maxrss * 1024, "tail": lines[-12:]}


def cmd_train(args) -> dict:
    data = Path(args.data)
    cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="memfit-scale-cache-", dir="/tmp"))
    out = {"data": str(data), "data_bytes": data.stat().st_size, "num_proc": args.num_proc, "steps": args.steps,
           "cache": str(cache)}
    try:
        output = Path(tempfile.mkdtemp(prefix="memfit-scale-run-", dir="/tmp"))
        out["first"] = train_once(str(data), cache, num_proc=args.num_proc, steps=args.steps, output=output)
        out["cache_bytes"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        out["second"] = train_once(str(data), cache, num_proc=args.num_proc, steps=args.steps, output=output)
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    return out


def cmd_tokenize(args) -> dict:
    """rows/s of memfit's datasets.map encoding with 1..N processes, each from a fresh cache."""
    sys.path.insert(0, str(ROOT / "src"))
    import datasets

    from memfit.data.arrow import encode_dataset
    from memfit.data.dataset import byte_tokenizer
    from memfit.data.formats import Fields

    datasets.disable_progress_bars()
    results = {"data": args.data, "data_bytes": Path(args.data).stat().st_size, "runs": []}
    for num_proc in args.num_proc_list:
        cache = Path(tempfile.mkdtemp(prefix="memfit-tok-cache-", dir="/tmp"))
        datasets.config.HF_DATASETS_CACHE = cache
        try:
            from memfit.data.sources import load_parts

            t0 = time.perf_counter()
            (part,) = load_parts(args.data)
            read_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            encoded = encode_dataset(part.ds, byte_tokenizer(), fmt="text", fields=Fields(), train_on_prompt=False,
                                     num_proc=num_proc, where=args.data)
            map_s = time.perf_counter() - t0
            tokens = sum(int(n) for batch in encoded.select_columns(["length"]).iter(batch_size=100_000)
                         for n in batch["length"])
            results["runs"].append({"num_proc": num_proc, "documents": len(encoded), "tokens": tokens,
                                    "read_and_split_s": round(read_s, 2), "map_s": round(map_s, 2),
                                    "rows_per_s": round(len(encoded) / map_s), "tokens_per_s": round(tokens / map_s),
                                    "bytes_per_s": round(results["data_bytes"] / map_s),
                                    "bytes_per_s_with_read": round(results["data_bytes"] / (read_s + map_s))})
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    tok = sub.add_parser("tokenize", help="rows/s of datasets.map with 1 and 2 processes")
    tok.add_argument("--data", required=True)
    tok.add_argument("--num-proc", dest="num_proc_list", type=int, nargs="+", default=[1, 2])
    tr = sub.add_parser("train", help="memfit train twice (fresh cache, warm cache): peak memory, start-up")
    tr.add_argument("--data", required=True)
    tr.add_argument("--num-proc", type=int, default=1)
    tr.add_argument("--steps", type=int, default=3)
    tr.add_argument("--cache", default=None, help="datasets cache folder (default: a fresh one under /tmp)")
    tr.add_argument("--keep-cache", action="store_true")
    for p in (tok, tr):
        p.add_argument("--out", default="-", help="JSON file, or - for stdout")
    args = parser.parse_args()
    result = cmd_tokenize(args) if args.what == "tokenize" else cmd_train(args)
    text = json.dumps(result, indent=2)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
