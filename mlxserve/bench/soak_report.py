"""`mlxserve bench soak`'s result as markdown and a PNG, from the result dict alone (so
`--replot` can redraw one from its JSON)."""

from __future__ import annotations

from types import SimpleNamespace

from mlxserve.bench import report

MiB = 2**20


def markdown(result: dict, info: dict, command: str) -> str:
    v, t, s, after = result["verdict"], result["totals"], result["server"], result["after"]
    args = SimpleNamespace(**result["settings"])
    images = (f"{args.image_rate:.0%} with a synthetic PNG of {args.image_px} px ({args.image_repeat:.0%} of them "
              "one sent before), before or after the text at random" if result["images"]
              else "no images (a text-only model)")
    md = [report.header("Soak test", info, command),
          f"Server: {s.get('command') or s['url']}; model {s['model']}"
          + "".join(f"; {k} {s[k]}" for k in ("version", "backend", "device") if s.get(k))
          + f"; RSS from {s['rss']}.\n",
          f"{args.streams} streamed chat requests in flight for {result['duration_s'] / 60:.1f} min: prompts of "
          f"{args.prompt_len} random words ({args.prefix_reuse:.0%} beginning with most of an earlier prompt), "
          f"max_tokens {args.max_tokens} (EOS ignored), {args.abort_rate:.0%} abandoned by the client after a random "
          f"number of chunks, {images}. Samples every {args.interval:g} s; latencies are over the requests that "
          "ended in each interval (TTFT: send to first content, aborted requests included; end-to-end: completed "
          "requests). Errors: statuses other than 200"
          + (f" and {args.expected_status}" if args.expected_status else "")
          + ", error events, broken or unfinished streams; the client's own aborts are not errors.\n",
          f"## Verdict: {v['outcome']}\n",
          f"After the warm-up (the first {args.warmup:.0%}, {v['warmup_s'] / 60:.1f} min), a memory series is flat "
          f"when the least-squares line through its samples moves by at most {args.tolerance:.0%} of their mean "
          "over the rest of the run (slope-based: the KV of whatever is in flight at a sample is noise around the "
          "line; a leak is a steady climb). Max vs min is shown beside it.\n"]
    for name, ok in v["checks"].items():
        md.append(f"- {name}: {'yes' if ok else 'not measured' if ok is None else 'NO'}")
    md.append("")
    rows = [memory_row(label, v["memory"][key]) for key, label in (
        ("rss_bytes", "server RSS"), ("mlx_active_bytes", "MLX active memory"),
        ("mlx_other_bytes", "MLX active minus cache bytes (not judged)"))]
    md += [report.table(["after warm-up", "samples", "first MiB", "last MiB", "min MiB", "max MiB", "slope MiB/min",
                         "fitted change", "max vs min"], rows), ""]
    lat = v.get("latency") or {}
    if lat.get("flat") is not None:
        md += [f"TTFT p99 per interval after the warm-up: {lat['first']:,.0f} ms first, {lat['last']:,.0f} ms last, "
               f"{lat['min']:,.0f}-{lat['max']:,.0f} ms; the fitted line moves by {lat['fitted_change']:+.1%} "
               f"(passes unless it rises by more than {getattr(args, 'latency_tolerance', 0.25):.0%}).", ""]
    crash = result.get("crash")
    if crash:
        share = crash["share_on_disk"]
        md += ["## kill -9 under load\n",
               f"At the last sample under load {crash['on_disk_at_kill']} of the {crash['memory_blocks']} blocks in "
               f"memory were on disk ({'-' if share is None else f'{share:.1%}'}); the disk tier held "
               f"{crash['disk_blocks_at_kill']} blocks. The server was killed with SIGKILL right after it and started "
               f"again on the same folder: its disk tier found {crash['disk_blocks_after_restart']} blocks.", ""]
    finished = after.get("finished", {})
    md += ["## Requests\n",
           f"- ended: {t['requests']} ({t['ok']} completed, {t['aborted']} aborted by the client, {t['refused']} "
           f"refused, {t['errors']} errors); {t['cut_at_end']} still running at the end were cancelled and not counted",
           f"- prompts extending an earlier one: {t['prefix_reuse']}; with an image: {t['with_image']} "
           f"({t['repeated_image']} repeats)",
           f"- the server's count of finished requests by reason: {finished or 'not available'}",
           f"- after the run: {after.get('running', '-')} running, {after.get('waiting', '-')} waiting, "
           f"{after.get('in_use_blocks', '-')} cache blocks in use; prefix-cache hit rate "
           + (f"{after['prefix_hit_rate']:.1%}" if after.get("prefix_hit_rate") is not None else "-")
           + f", {after.get('prefix_evictions', '-')} evictions"]
    if after.get("vision_cache"):
        vc = after["vision_cache"]
        md.append(f"- vision cache: {vc.get('hits')} hits, {vc.get('misses')} misses, {vc.get('evictions')} evictions")
    md += [f"- error: {n} x {msg}" for msg, n in t["error_messages"]]
    if result.get("crash"):
        md.append("- the server was killed with SIGKILL under load (--kill): no drain, no exit status")
    elif "exit_code" in s:
        logged = s["logged_errors"]
        md.append(f"- the server's exit status after SIGINT: {s['exit_code']}; lines it logged at ERROR or as a "
                  f"traceback: {len(logged)}" + (f" (first: `{logged[0]}`)" if logged else ""))
    md += ["", "## Over time\n", sample_table(result["samples"]), ""]
    return "\n".join(md)


def memory_row(label: str, m: dict) -> list:
    if m["flat"] is None:
        return [label, m.get("samples", 0), m["why"]] + [""] * 6
    return [label, m["samples"], m["first"] / MiB, m["last"] / MiB, m["min"] / MiB, m["max"] / MiB,
            m["slope_bytes_per_min"] / MiB, f"{m['fitted_change']:+.1%}", f"{m['spread']:.1%}"]


def sample_table(samples: list[dict], most: int = 40) -> str:
    """At most `most` evenly spaced samples (the JSON has them all), the last always among them."""
    step = max(1, -(-len(samples) // most))
    shown = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])

    def mib(v):
        return "-" if v is None else v / MiB

    return report.table(
        ["min", "RSS MiB", "MLX active MiB", "MLX kept MiB", "prefix cache MiB", "vision cache MiB", "ended",
         "aborted", "errors", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 s", "e2e p99 s", "blocks on disk / in memory"],
        [[f"{s['t'] / 60:.2f}", mib(s["rss_bytes"]), mib(s["mlx_active_bytes"]), mib(s["mlx_cache_bytes"]),
          mib(s["prefix_cache_bytes"]), mib(s["vision_cache_bytes"]), s["requests"], s["aborted"], s["errors"],
          s["ttft_p50_ms"], s["ttft_p99_ms"], s["e2e_p50_s"], s["e2e_p99_s"],
          "-" if s.get("memory_blocks_on_disk") is None else f"{s['memory_blocks_on_disk']} / {s['memory_blocks']}"]
         for s in shown])


def replot(json_path) -> None:
    report.replot(json_path, plot)


def plot(result: dict, png, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] / 60 for s in samples]

    def series(key, scale=1.0):
        return [s[key] / scale if s.get(key) is not None else float("nan") for s in samples]

    fig, axes = plt.subplots(5, 1, figsize=(9, 14), sharex=True)
    ax = axes[0]
    for key, label in (("rss_bytes", "server RSS"), ("mlx_active_bytes", "MLX active"),
                       ("mlx_other_bytes", "MLX active minus caches"), ("mlx_cache_bytes", "MLX freed, kept for reuse")):
        ax.plot(t, series(key, MiB), marker=".", label=label)
    ax.set_ylabel("MiB")
    ax = axes[1]
    for key, label in (("prefix_cache_bytes", "prefix cache"), ("vision_cache_bytes", "vision cache")):
        ax.plot(t, series(key, MiB), marker=".", label=label)
    ax.set_ylabel("cache MiB")
    ax = axes[2]
    ax.plot(t, series("ttft_p50_ms"), marker=".", label="TTFT p50")
    ax.plot(t, series("ttft_p99_ms"), marker=".", label="TTFT p99")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax = axes[3]
    ax.plot(t, series("e2e_p50_s"), marker=".", label="end-to-end p50")
    ax.plot(t, series("e2e_p99_s"), marker=".", label="end-to-end p99")
    ax.set_ylabel("s")
    ax = axes[4]
    ax.plot(t, series("ok"), marker=".", label="completed")
    ax.plot(t, series("aborted"), marker=".", label="aborted by the client")
    ax.plot(t, series("errors"), marker="x", color="red", label="errors")
    ax.set_ylabel("requests per interval")
    ax.set_xlabel("minutes")
    warmup = result["verdict"]["warmup_s"] / 60
    for ax in axes:
        ax.axvspan(0, warmup, color="grey", alpha=0.15, lw=0)  # left out of the verdict
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"soak, {result['server']['model']}: {result['verdict']['outcome']}, "
                 f"{info.get('backend')} ({info.get('device')}); warm-up shaded", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
