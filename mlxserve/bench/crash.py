"""`mlxserve bench crash`: kill -9 a server while its disk tier writes, restart it, check it.

A drill of what the disk tier promises after a crash. A reference server
with the prefix cache off answers every prompt first. Then each round starts
`mlxserve serve --disk-cache-dir` on the same folder and
- checks that it starts and that no temporary file is left (a start deletes
  those of writers that died),
- replays the previous round's prompts (their blocks read back from disk:
  greedy answers must equal the reference's),
- sends new prompts (a shared prefix, read back, plus new tokens, written),
- and, once some of their block files exist, kills the server with SIGKILL
  while the rest are being written, aimed at a write in flight.
A last start checks the last round. At the end every block file left in the
folder is read and checked (blockfile.read_block): a kill must never leave a
damaged file under a block's name.

Prompts go as token ids to /v1/completions, so answers depend on nothing but
the tokens; the model is a tiny random-weight one by default, which keeps a
round to a few seconds plus the server's start.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mlxserve.bench.local import ChildServer, checkout_env, free_port

START_TIMEOUT_S = 180  # a cold start on a loaded 2-core machine imports MLX, mlx-lm and FastAPI
REQUEST_TIMEOUT_S = 120
KILL_WAIT_S = 10  # how long a round waits for its first block files before killing anyway
WRITES_PAUSED_S = 0.3  # no new block file for this long: the round's writes are (nearly) done


def add_parser(sub) -> None:
    p = sub.add_parser("crash", help="Disk tier crash drill: kill -9 while writing, restart, check.")
    p.add_argument("--model", default="qwen3-tiny", help="Model source (default: the tiny test shape).")
    p.add_argument("--load-format", default="dummy", help="'dummy' (random weights) or any --load-format.")
    p.add_argument("--rounds", type=int, default=10, help="Kill-and-restart rounds.")
    p.add_argument("--prompts", type=int, default=4, help="New prompts per round (sent together).")
    p.add_argument("--shared-len", type=int, default=128, help="Tokens every prompt starts with.")
    p.add_argument("--prompt-len", type=int, default=512, help="Tokens of each prompt after the shared ones.")
    p.add_argument("--max-tokens", type=int, default=8, help="Greedy tokens per answer.")
    p.add_argument("--block-size", type=int, default=32, help="Prefix-cache block size of the servers.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks")
    p.set_defaults(func=run)


class Server(ChildServer):
    """`mlxserve serve` in a child process, running the same code as this process, and the
    drill's requests to it."""

    stop_grace = 60.0

    def __init__(self, args, log_path: Path, *extra: str):
        port = free_port()
        command = [sys.executable, "-m", "mlxserve.cli", "serve", args.model, "--load-format", args.load_format,
                   "--port", str(port), "--log-level", "warning", "--block-size", str(args.block_size),
                   "--max-num-seqs", str(max(args.prompts, 1)), *extra]
        super().__init__(command, port, checkout_env(), log=log_path)

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, int]]:
        """(text, cached tokens) of each prompt, greedy, sent together."""
        def one(client, prompt):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            body = r.json()
            return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

        from concurrent.futures import ThreadPoolExecutor

        with httpx.Client(base_url=self.base_url, timeout=REQUEST_TIMEOUT_S) as client:
            with ThreadPoolExecutor(max(len(prompts), 1)) as pool:
                return list(pool.map(lambda p: one(client, p), prompts))

    def stats(self) -> dict:
        return httpx.get(self.base_url + "/v1/cache/stats", timeout=30).json()["prefix_cache"]


def _blocks(folder: Path) -> set[str]:
    return {f.name for f in folder.glob("*.safetensors")}


def _tmps(folder: Path) -> list[str]:
    return sorted(f.name for f in folder.glob("*.tmp"))


def _kill_while_writing(server: Server, folder: Path, before: set[str], send, target: int) -> tuple[dict, list | None]:
    """Run `send()` (the round's new prompts) while watching the folder and, once `target`
    (>= 1: something comes back) of this round's block files exist, SIGKILL the server in the
    middle of a write: it is stopped (SIGSTOP) at once and, if it has a file of the folder open
    for writing, killed as it stands; if not (between two writes) it runs on for a moment and is
    stopped again.
    Killed anyway once the writes pause for WRITES_PAUSED_S, or after KILL_WAIT_S. (What the
    folder held then, and the answers if they came back.)"""
    import threading

    answers: list = []
    sender = threading.Thread(target=lambda: answers.append(_try(send)), daemon=True)
    sender.start()
    deadline = time.monotonic() + KILL_WAIT_S
    seen, changed, tries = -1, time.monotonic(), 0
    while time.monotonic() < deadline:
        new = sum(1 for n in os.listdir(folder) if n.endswith(".safetensors") and n not in before)
        if new != seen:
            seen, changed = new, time.monotonic()
        if new >= target:
            tries += 1
            server.proc.send_signal(signal.SIGSTOP)
            if _writing(server.proc.pid, folder):
                break  # frozen mid-write: kill it there
            server.proc.send_signal(signal.SIGCONT)
            if time.monotonic() - changed > WRITES_PAUSED_S:
                break
        time.sleep(0.0002)
    server.kill()  # SIGKILL ends a stopped process too
    row = {"kill_target": target, "tries": tries, "tmp_at_kill": len(_tmps(folder)),
           "written_at_kill": len(_blocks(folder) - before)}
    sender.join(REQUEST_TIMEOUT_S)
    got = answers[0] if answers else None
    return row, (got if isinstance(got, list) else None)


def _writing(pid: int, folder: Path) -> bool:
    """Whether process `pid` has a file in `folder` open for writing (Linux: /proc), or, where
    that cannot be seen, whether a temporary file is there (a write between open and rename)."""
    fds = Path(f"/proc/{pid}/fd")
    if not fds.is_dir():
        return bool(_tmps(folder))
    inside = str(folder.resolve()) + os.sep
    for fd in fds.iterdir():
        try:
            if os.readlink(fd).startswith(inside):
                flags = next(line for line in Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().splitlines()
                             if line.startswith("flags:"))
                if int(flags.split()[1], 8) & (os.O_WRONLY | os.O_RDWR):
                    return True
        except (OSError, StopIteration, ValueError):  # closed meanwhile
            continue
    return False


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - killed before they came back
        return e


def drill(args, folder: Path, log_dir: Path, progress=None) -> dict:
    """Run the rounds; a dict of what each round saw and whether every check held."""
    rng = random.Random(args.seed)
    shared = [rng.randrange(1000, 30000) for _ in range(args.shared_len)]
    prompts = [shared + [rng.randrange(1000, 30000) for _ in range(args.prompt_len)]
               for _ in range(args.rounds * args.prompts)]
    say = progress or (lambda _msg: None)
    say("reference answers (prefix cache off)")

    def start():
        return Server(args, log_dir / f"round-{len(rounds) + 1}.log", "--disk-cache-dir", str(folder))

    rounds: list[dict] = []
    folder.mkdir(parents=True, exist_ok=True)
    first = start()  # starts beside the reference server: the drill waits for one start less
    ref_server = Server(args, log_dir / "reference.log", "--no-prefix-cache")
    try:
        ref_server.wait_healthy(START_TIMEOUT_S)
        reference = [text for text, _ in ref_server.complete(prompts, args.max_tokens)]
    except BaseException:
        first.kill()
        raise
    finally:
        ref_server.stop()
    for r in range(args.rounds + 1):
        last = r == args.rounds
        say(f"round {r + 1}/{args.rounds}" if not last else "final start")
        row = {"round": r + 1 if not last else "final", "tmp_before_start": len(_tmps(folder))}
        server, first = first or start(), None
        try:
            row["start_s"] = server.wait_healthy(START_TIMEOUT_S)
            row["tmp_after_start"] = _tmps(folder)
            check = []
            if r:  # the previous round's prompts: their blocks written before the kill come back
                check = list(range((r - 1) * args.prompts, r * args.prompts))
                answers = server.complete([prompts[i] for i in check], args.max_tokens)
                row["replay_cached_tokens"] = sum(c for _, c in answers)
                row["replay_mismatches"] = [i for i, (text, _) in zip(check, answers) if text != reference[i]]
            disk = server.stats()["disk"]  # what this start deleted, and what the replay dropped
            row["dropped"], row["abandoned_tmp"] = disk["dropped"], disk["abandoned_tmp"]
            if last:
                server.stop()
            else:
                new = list(range(r * args.prompts, (r + 1) * args.prompts))
                send = lambda: server.complete([prompts[i] for i in new], args.max_tokens)  # noqa: E731
                killed, answers = _kill_while_writing(server, folder, _blocks(folder), send,
                                                      target=1 + rng.randrange(args.prompts * 4))
                row.update(killed)
                row["answered_before_kill"] = answers is not None
                if answers is not None:
                    row["new_mismatches"] = [i for i, (text, _) in zip(new, answers) if text != reference[i]]
        except Exception as e:  # noqa: BLE001 - a failed round is a result of the drill
            row["error"] = f"{type(e).__name__}: {e}".split("\n", 1)[0]  # run() prints the servers' logs
            server.kill()
        finally:
            if server.proc.poll() is None:
                server.kill()
        rounds.append(row)
        if "error" in row:
            break
    damaged = _check_files(folder)
    ok = not damaged and all(_round_ok(row) for row in rounds) and len(rounds) == args.rounds + 1
    return {"rounds": rounds, "files_checked": len(_blocks(folder)), "damaged_files": damaged, "ok": ok}


def _round_ok(row: dict) -> bool:
    return ("error" not in row and not row["tmp_after_start"] and not row.get("replay_mismatches")
            and not row.get("new_mismatches") and not any(row["dropped"].values()))


def _check_files(folder: Path) -> list[str]:
    """The block files in `folder` that fail to read back whole and sound."""
    from mlxserve.cache.blockfile import read_block

    bad = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            read_block(path)
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            bad.append(f"{path.name}: {e}")
    return bad


def report_text(result: dict, args) -> str:
    from mlxserve.bench import report

    rows = []
    for row in result["rounds"]:
        rows.append([row["round"], f"{row.get('start_s', 0):.1f}", row["tmp_before_start"],
                     len(row.get("tmp_after_start", [])), row.get("abandoned_tmp", "-"),
                     row.get("written_at_kill", "-"), row.get("tmp_at_kill", "-"),
                     row.get("replay_cached_tokens", "-"),
                     len(row.get("replay_mismatches", [])) + len(row.get("new_mismatches", [])),
                     sum(row.get("dropped", {}).values()), row.get("error", "")])
    killed = [r for r in result["rounds"] if "written_at_kill" in r]
    cut = sum(1 for r in killed if r["tmp_at_kill"])
    lines = [
        f"{args.rounds} rounds; {args.prompts} prompts of {args.shared_len} shared + {args.prompt_len} new "
        f"tokens per round, {args.max_tokens} greedy tokens each, block size {args.block_size}, "
        f"model {args.model} ({args.load_format}). Each round starts the server on the same folder, "
        "replays the last round's prompts, sends new ones, and SIGKILLs the server once a random 1 to "
        f"{args.prompts * 4} of their block files exist, aimed at a write in flight (stopped with SIGSTOP "
        "until it is caught with a file of the folder open for writing, while the writes go on). 'start s': launch to "
        "healthy (round 1 starts beside the reference server). 'tmp left by kill': temporary files right "
        "after the kill (a write cut short); 'abandoned': those the next start deleted. Mismatches: "
        "answers that differ from the reference server's (prefix cache off).\n",
        report.table(["round", "start s", "tmp before start", "tmp after start", "abandoned",
                      "blocks written before kill", "tmp left by kill", "replay cached tokens",
                      "mismatches", "dropped files", "error"], rows),
        "",
        f"Result: {'PASS' if result['ok'] else 'FAIL'}. Kills that cut a write short: {cut} of {len(killed)}. "
        f"Block files left at the end, all read back and checked: {result['files_checked']}, "
        f"damaged: {len(result['damaged_files'])}.",
    ]
    lines += [f"- {d}" for d in result["damaged_files"]]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from mlxserve.bench import report

    info = report.machine()
    with tempfile.TemporaryDirectory(prefix="mlxserve-crash-") as tmp:
        folder, logs = Path(tmp) / "kv", Path(tmp) / "logs"
        logs.mkdir()
        result = drill(args, folder, logs, progress=lambda m: print(f"   {m}", file=sys.stderr, flush=True))
        if not result["ok"]:  # the servers' logs say why; they go with the temporary folder
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
    command = "mlxserve bench crash " + " ".join(sys.argv[3:])
    text = report.header("Disk tier crash drill", info, command) + "\n" + report_text(result, args)
    print(text)
    report.write_result("crash", info, text, result, None, args.out_dir)
    return 0 if result["ok"] else 1
