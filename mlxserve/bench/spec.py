"""`mlxserve bench spec`: speculative decoding for a lone request, in-process.

One request at a time (the lone path, where speculation runs), greedy, on
chat prompts of two kinds: code and JSON edits, whose answer repeats most of
the prompt (what prompt lookup is for), and free writing, where nothing
repeats (what it must not slow down). Each prompt runs through an engine per
mode (off, ngram, draft with --draft-model), interleaved; the report gives
decode tok/s (the tokens after the first over the time from the first token
to the last: prefill is the same in every mode), the speed-up over off, the
acceptance rate, and whether the tokens equal those of decoding without
speculation (they must).

GPU mode with dummy weights: `--model dummy:qwen3-4b:q4 --draft-model
dummy:qwen3-4b:q4` (the same seed: the draft equals the model, every draft
token is accepted; random weights repeat nothing, so n-gram speculation
measures its cost when it does not hit).
"""

from __future__ import annotations

import asyncio
import datetime
import sys
import time

from mlxserve.bench.engine import MODEL_HELP, _parse_model

FUNCTION = '''def summarize_orders(orders, currency="EUR"):
    """Totals per customer, skipping cancelled orders."""
    totals = {}
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        customer = order["customer_id"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            amount = convert(amount, order["currency"], currency)
        totals[customer] = totals.get(customer, 0) + amount
    result = []
    for customer, total in sorted(totals.items()):
        result.append({"customer_id": customer, "total": round(total, 2), "currency": currency})
    return result
'''

CONFIG = '''{
  "service": "billing-api",
  "version": "2.4.1",
  "environment": "staging",
  "port": 8080,
  "database": {"host": "db.internal", "port": 5432, "name": "billing", "pool_size": 10},
  "cache": {"enabled": true, "ttl_seconds": 300, "backend": "redis"},
  "features": {"invoices_v2": false, "tax_engine": "legacy", "refunds": true},
  "log_level": "info",
  "owners": ["payments-team", "platform-team"]
}'''

CLASS = '''class RetryPolicy:
    def __init__(self, attempts=3, backoff=0.5, max_backoff=8.0):
        self.attempts = attempts
        self.backoff = backoff
        self.max_backoff = max_backoff

    def delays(self):
        delay = self.backoff
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * 2, self.max_backoff)

    def run(self, fn, *args, **kwargs):
        last_error = None
        for delay in [0.0, *self.delays()]:
            time.sleep(delay)
            try:
                return fn(*args, **kwargs)
            except TransientError as e:
                last_error = e
        raise last_error
'''

PROMPTS = {
    "edit": [
        ("rename", "Rewrite this function with the variable `totals` renamed to `per_customer`. "
                   "Reply with the code only.\n\n```python\n" + FUNCTION + "```"),
        ("json", "Return this JSON with \"log_level\" changed to \"debug\". Reply with the JSON only.\n\n"
                 "```json\n" + CONFIG + "\n```"),
        ("default", "Rewrite this class with the default `attempts` changed from 3 to 5. "
                    "Reply with the code only.\n\n```python\n" + CLASS + "```"),
    ],
    "free": [
        ("story", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
        ("explain", "Explain in plain prose, without code, how a hash map handles collisions."),
    ],
}


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="Speculative decoding (n-gram, draft model) vs none, one request at a time.")
    p.add_argument("--model", default="default", help=MODEL_HELP.replace("Comma-separated models", "The model"))
    p.add_argument("--draft-model", default=None,
                   help="Also run with this draft model (same forms as --model; dummy:SHAPE takes --model's seed).")
    p.add_argument("--modes", default=None, help="Comma-separated: off, ngram, draft (default: off,ngram[,draft]).")
    p.add_argument("--kinds", default="edit,free", help="Prompt kinds: edit (code and JSON edits), free (writing).")
    p.add_argument("--max-tokens", type=int, default=128, help="Output tokens per request at most (EOS ends sooner).")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="Default: the engine's.")
    p.add_argument("--ngram-size", type=int, default=None, help="Default: the engine's.")
    p.add_argument("--repeats", type=int, default=1, help="Interleaved passes; the best of each is kept.")
    p.add_argument("--dtype", default=None)
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--rerender", metavar="JSON", help="Only write the markdown of an earlier result again.")
    p.set_defaults(func=lambda a: rerender(a.rerender) if a.rerender else run(a))


async def _one(engine, prompt, params):
    """(token ids, time of each token)."""
    from mlxserve.engine.request import Request

    tokens, stamps = [], []
    async for out in engine.submit(Request(list(prompt), params)):
        now = time.perf_counter()
        tokens += out.new_token_ids
        stamps += [now] * len(out.new_token_ids)
    return tokens, stamps


def _load(spec: dict, dtype, draft: str | None):
    from mlxserve.models.load import load, load_draft

    loaded = load(spec["source"], load_format=spec["load_format"], quantize_bits=spec["quantize_bits"], dtype=dtype)
    if draft:
        d = _parse_model(draft)
        load_draft(loaded, d["source"] or "default", load_format=d["load_format"], quantize_bits=d["quantize_bits"],
                   dtype=dtype)
    return loaded


def bench(args) -> dict:
    import dataclasses

    from mlxserve.config import EngineConfig
    from mlxserve.engine.engine import AsyncEngine
    from mlxserve.engine.request import SamplingParams
    from mlxserve.models.chat import render_chat

    spec = _parse_model(args.model)
    print(f"== {spec['label']}: loading", file=sys.stderr, flush=True)
    loaded = _load(spec, args.dtype, args.draft_model)
    modes = (args.modes or "off,ngram" + (",draft" if args.draft_model else "")).split(",")
    tuning = {k: v for k, v in (("num_draft_tokens", args.num_draft_tokens), ("ngram_size", args.ngram_size))
              if v is not None}
    plain = dataclasses.replace(loaded, draft=None)
    engines = {}
    for mode in modes:
        # No prefix cache: every pass prefills its prompt the same way, and only decoding differs.
        cfg = EngineConfig(prefix_cache=False, speculative=None if mode == "off" else mode, **tuning)
        engines[mode] = AsyncEngine(loaded if mode == "draft" else plain, cfg).start(wait_warmup=True)
    cfg = EngineConfig(**tuning)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    try:
        prompts = [(kind, name, render_chat(loaded.tokenizer, [{"role": "user", "content": text}]))
                   for kind in args.kinds.split(",") for name, text in PROMPTS[kind]]
        for mode, engine in engines.items():  # warm-up: kernels, allocator
            asyncio.run(_one(engine, prompts[0][2][:32], SamplingParams(temperature=0, max_tokens=4)))
        for kind, name, prompt in prompts:
            print(f"   {kind}/{name} ({len(prompt)} prompt tokens)", file=sys.stderr, flush=True)
            best = {m: None for m in modes}
            for _ in range(args.repeats):
                for mode, engine in engines.items():
                    before = engine.speculation.stats.as_dict() if engine.speculation else None
                    tokens, stamps = asyncio.run(_one(engine, prompt, params))
                    rate = (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(tokens) > 1 else 0.0
                    got = {"tokens": tokens, "tok_s": rate}
                    if before is not None:
                        after = engine.speculation.stats.as_dict()
                        got.update({k: after[k] - before[k] for k in ("draft_tokens", "accepted_tokens",
                                                                     "verify_passes", "emitted_tokens")})
                    if best[mode] is None or rate > best[mode]["tok_s"]:
                        best[mode] = got
                    print(f"      {mode}: {len(tokens)} tokens, {rate:.2f} tok/s", file=sys.stderr, flush=True)
            ref = best[modes[0]]["tokens"]
            rows.append({"kind": kind, "name": name, "prompt_tokens": len(prompt), "output_tokens": len(ref),
                         "modes": {m: {**{k: v for k, v in r.items() if k != "tokens"}, "same": r["tokens"] == ref}
                                   for m, r in best.items()}})
    finally:
        for engine in engines.values():
            engine.stop()
    return {"label": spec["label"], "name": loaded.name, "draft": args.draft_model, "modes": modes,
            "num_draft_tokens": cfg.num_draft_tokens, "ngram_size": cfg.ngram_size,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}


def passes(row: dict, mode: str) -> int:
    """Forward passes the model ran to decode the row's tokens after the first (one per token
    without speculation; a verify pass emits several). Unlike tok/s, no load on the machine moves it."""
    m = row["modes"][mode]
    return row["output_tokens"] - 1 - m.get("emitted_tokens", 0) + m.get("verify_passes", 0)


def _acceptance(r: dict) -> str:
    return f"{r['accepted_tokens'] / r['draft_tokens']:.0%}" if r.get("draft_tokens") else "-"


def summary(result: dict) -> dict:
    """Per kind and mode: decode tok/s over all its prompts (tokens / time), speed-up, acceptance."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["kind"] == kind]
        for mode in result["modes"]:
            tokens = sum(r["output_tokens"] - 1 for r in rows)
            seconds = sum((r["output_tokens"] - 1) / r["modes"][mode]["tok_s"] for r in rows)
            drafted = sum(r["modes"][mode].get("draft_tokens", 0) for r in rows)
            accepted = sum(r["modes"][mode].get("accepted_tokens", 0) for r in rows)
            out[(kind, mode)] = {"tok_s": tokens / seconds, "draft_tokens": drafted, "accepted_tokens": accepted,
                                 "passes_per_token": sum(passes(r, mode) for r in rows) / tokens}
        for mode in result["modes"]:
            out[(kind, mode)]["speedup"] = out[(kind, mode)]["tok_s"] / out[(kind, result["modes"][0])]["tok_s"]
    return out


def report_text(result: dict, info: dict, command: str) -> str:
    from mlxserve.bench import report

    modes = result["modes"]
    md = [report.header("Speculative decoding benchmark", info, command), ""]
    draft = f", draft model {result['draft']}" if result["draft"] else ""
    md.append(f"Model {result['label']} ({result['name']}){draft}; one request at a time (the lone path), greedy, "
              f"at most {result['max_tokens']} output tokens (EOS ends sooner), prefix cache off; "
              f"{result['num_draft_tokens']} draft tokens per pass, n-gram size {result['ngram_size']}; best of "
              f"{result['repeats']} interleaved pass(es). Decode tok/s: the tokens after the first over the time "
              "from the first to the last (prefill is the same in every mode). Passes: the model's forward passes "
              "for those tokens (a verify pass checks the drafts and emits several; its cost grows with its "
              "length). Acceptance: draft tokens equal to the model's own. Same: the tokens equal those "
              "without speculation.\n")
    if "load_average" in info:
        md.append(f"Load average (1 min) at the start and end of the run: {info['load_average']}.\n")
    s = summary(result)
    md.append(report.table(["prompts", "mode", "decode tok/s", "vs off", "passes per token", "acceptance"],
                           [[kind, mode, v["tok_s"], f"{v['speedup']:.2f}x", f"{v['passes_per_token']:.2f}",
                             _acceptance(v)] for (kind, mode), v in s.items()]))
    md.append("")
    headers = ["prompt", "prompt tokens", "output tokens"]
    for mode in modes:
        headers += [f"{mode} tok/s", f"{mode} passes"] + ([] if mode == "off" else [
            f"{mode} vs off", f"{mode} acceptance", f"{mode} same"])
    lines = []
    for r in result["rows"]:
        off = r["modes"][modes[0]]["tok_s"]
        line = [f"{r['kind']}/{r['name']}", r["prompt_tokens"], r["output_tokens"]]
        for mode in modes:
            m = r["modes"][mode]
            line += [m["tok_s"], passes(r, mode)] + ([] if mode == "off" else [
                f"{m['tok_s'] / off:.2f}x", _acceptance(m), "yes" if m["same"] else "NO"])
        lines.append(line)
    md.append(report.table(headers, lines))
    return "\n".join(md) + "\n"


def _load_average() -> str:
    import os

    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"


def run(args) -> int:
    from mlxserve.bench import report

    info = report.machine()
    start = _load_average()  # a shared machine's other work moves tok/s (not the passes)
    result = bench(args)
    info["load_average"] = f"{start}, {_load_average()} ({info['cores']} cores)"
    info["command"] = "mlxserve bench spec " + " ".join(sys.argv[3:])
    info["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    text = report_text(result, info, info["command"])
    print(text)
    report.write_result("spec", info, text, result, None, args.out_dir)
    return 0


def rerender(json_path) -> None:
    """Write an earlier result's markdown again from its JSON (e.g. after the report gained a column)."""
    from pathlib import Path

    from mlxserve.bench import report

    data = report.load_json(json_path)
    info = data["info"]
    md = Path(json_path).with_suffix(".md")
    old = md.read_text().splitlines() if md.is_file() else []
    # Results written before the JSON kept them: the date and command from the markdown.
    for key in ("date", "command"):
        line = next((x for x in old if x.startswith(f"- {key}: ")), None)
        if key not in info and line:
            info[key] = line.split(": ", 1)[1].strip("`")
    md.write_text(report_text(data["results"], info, info.get("command", "mlxserve bench spec")))
