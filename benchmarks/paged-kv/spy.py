"""Where a server's time goes at a few streams: py-spy on each server while `bench serve` loads it.

    python3 benchmarks/paged-kv/spy.py MODEL_DIR OUT_DIR PY_SPY LABEL[=ARGS]... [--peer-path vllm-mlx=DIR]

Each label is a `bench serve --start` peer (mlxserve, vllm-mlx, mlxserve@VARIANT) with its extra
arguments. Per server: a warm-up load, then a load of 3 x --requests at --streams streams during
which py-spy samples the server three times (threads busy; all threads; the GIL's holder), then
--requests more without py-spy. Writes the collapsed stacks and a summary (per thread: samples
busy, in all, holding the GIL, and the lines they were on) to OUT_DIR/spy.md; prints the summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

from mlxserve.bench.peers import Started, peer_of


def load(url: str, streams: int, requests: int, out_dir: str, output_len: int = 128) -> dict:
    """One `bench serve` level against url; its result's row."""
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([sys.executable, "-m", "mlxserve", "bench", "serve", "--url", url, "--concurrency", str(streams),
                    "--requests", str(requests), "--input-len", "128", "--output-len", str(output_len), "--endpoint",
                    "completions", "--timeout", "120", "--out-dir", out_dir], check=True, capture_output=True)
    newest = max((os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".json")), key=os.path.getmtime)
    with open(newest) as f:
        result = json.load(f)
    return result["results"][0]["rows"][0]


def spy(py_spy: str, pid: int, seconds: float, path: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                             "--format", "raw", "--threads", "--nonblocking", "--subprocesses", "-o", path, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def threads(path: str) -> dict[str, collections.Counter]:
    """Collapsed stacks per thread: {thread: Counter(stack -> samples)}."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    if not os.path.exists(path):
        return out
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        i = next((k for k, f in enumerate(frames) if f.startswith("thread ")), 0)
        name = frames[i]
        out[name][";".join(frames[i + 1:])] += int(n)
    return out


def summary(label: str, base: str) -> str:
    busy, idle, gil = (threads(f"{base}-{kind}.txt") for kind in ("busy", "idle", "gil"))
    lines = [f"### {label}", "", "| thread | samples (idle too) | busy | holding the GIL |", "|---|---|---|---|"]
    names = sorted(idle, key=lambda t: -sum(busy[t].values()) - sum(gil[t].values()))
    for t in names:
        lines.append(f"| {t} | {sum(idle[t].values())} | {sum(busy[t].values())} | {sum(gil[t].values())} |")
    for t in names[:3]:
        for kind, counts in (("busy", busy), ("holding the GIL", gil), ("idle too", idle)):
            total = sum(counts[t].values())
            if not total:
                continue
            leaves = collections.Counter()
            for stack, n in counts[t].items():
                leaves[";".join(stack.split(";")[-2:])] += n
            lines += ["", f"{t}, {kind}: the last two frames, share of {total} samples", ""]
            lines += [f"- {n / total:.1%} {leaf}" for leaf, n in leaves.most_common(12)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("py_spy")
    ap.add_argument("labels", nargs="+")
    ap.add_argument("--peer-path", action="append", default=[])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=6)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    paths = dict(p.split("=", 1) for p in a.peer_path)
    report = []
    for spec in a.labels:
        label, _, args = spec.partition("=")
        peer = peer_of(label)
        extra = ("--warmup 0 " if peer.name == "mlxserve" else "") + args
        with Started(peer, a.model_dir, paths.get(peer.name), extra, timeout=300) as s:
            base = os.path.join(a.out_dir, label.replace("@", "-"))
            load(s.url, a.streams, 2 * a.streams, base + "-load", a.output_len)  # warm
            pid = s.child.proc.pid
            t0 = time.time()
            spies = []

            def sample():
                time.sleep(2)  # the load's first wave under way
                for kind, flags in (("busy", ()), ("idle", ("--idle",)), ("gil", ("--gil",))):
                    p = spy(a.py_spy, pid, a.seconds, f"{base}-{kind}.txt", *flags)
                    p.wait()
                    spies.append(p.returncode)

            th = threading.Thread(target=sample)
            th.start()
            spied = load(s.url, a.streams, a.requests * 3, base + "-load", a.output_len)
            th.join()
            plain = load(s.url, a.streams, a.requests, base + "-load", a.output_len)
            row = lambda r: (f"{r['output_tok_per_s']:.0f} tok/s, ITL p50 {r['itl_p50_ms']:.1f} ms, "
                             f"TTFT p50 {r['ttft_p50_ms']:.0f} ms")
            head = (f"{label} ({args or 'defaults'}): sampled {row(spied)}; unsampled {row(plain)}; "
                    f"py-spy exits {spies}, {time.time() - t0:.0f} s")
            print(head, flush=True)
            report.append(head + "\n\n" + summary(label, base))
    with open(os.path.join(a.out_dir, "spy.md"), "w") as f:
        f.write("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
