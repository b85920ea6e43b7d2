"""Benchmarks: `mlxserve bench engine | decode | serve | http | prefix | multimodal | grammar | exact | crash
| soak | spec | warmup | agent | stall
| paged-attention`."""


def add_bench_parsers(parser) -> None:
    from mlxserve.bench import (agent, crash, decode, engine, exact, grammar, http, multimodal, paged_attention, prefix,
                                serve, soak, spec, stall, warmup)

    sub = parser.add_subparsers(dest="bench", required=True)
    engine.add_parser(sub)
    decode.add_parser(sub)
    serve.add_parser(sub)
    http.add_parser(sub)
    prefix.add_parser(sub)
    multimodal.add_parser(sub)
    grammar.add_parser(sub)
    exact.add_parser(sub)
    crash.add_parser(sub)
    soak.add_parser(sub)
    spec.add_parser(sub)
    warmup.add_parser(sub)
    agent.add_parser(sub)
    stall.add_parser(sub)
    paged_attention.add_parser(sub)
