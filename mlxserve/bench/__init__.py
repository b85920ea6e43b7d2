"""Benchmarks: `mlxserve bench engine | serve | prefix | multimodal | grammar | spec`."""


def add_bench_parsers(parser) -> None:
    from mlxserve.bench import engine, grammar, multimodal, prefix, serve, spec

    sub = parser.add_subparsers(dest="bench", required=True)
    engine.add_parser(sub)
    serve.add_parser(sub)
    prefix.add_parser(sub)
    multimodal.add_parser(sub)
    grammar.add_parser(sub)
    spec.add_parser(sub)
