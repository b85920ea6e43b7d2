"""The disk tier survives kill -9 while it writes: the crash drill of `mlxserve bench crash`,
two rounds (the benchmark runs ten). Each round starts the real server (`mlxserve serve`,
tiny random-weight qwen3) on the same folder, replays the last round's prompts, sends new
ones and SIGKILLs the server while their blocks are being written."""

from mlxserve.bench import crash
from mlxserve.cli import build_parser


def test_a_server_killed_while_its_disk_tier_writes_restarts_sound(tmp_path):
    args = build_parser().parse_args(["bench", "crash", "--rounds", "2", "--out-dir", str(tmp_path / "out")])
    assert args.func is crash.run
    logs = tmp_path / "logs"
    logs.mkdir()
    result = crash.drill(args, tmp_path / "kv", logs)
    rounds = result["rounds"]
    server_logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}" for f in logs.glob("*.log"))
    assert [r["round"] for r in rounds] == [1, 2, "final"] and not any("error" in r for r in rounds), \
        (rounds, server_logs)
    for r in rounds:
        assert r["tmp_after_start"] == []  # a start deletes what a killed writer left
        assert not any(r["dropped"].values())  # no file under a block's name was damaged
        assert not r.get("replay_mismatches") and not r.get("new_mismatches")  # greedy = uncached
    for r in rounds[:-1]:
        assert r["written_at_kill"] >= 1  # killed while its blocks were being written
    for r in rounds[1:]:
        assert r["replay_cached_tokens"] > 0  # what was written before the kill came back
    assert result["files_checked"] > 0 and result["damaged_files"] == []
    assert result["ok"]
