"""`mlxserve serve | generate | chat | shapes | bench` — parses, builds config, calls in."""

from __future__ import annotations

import argparse
import sys

import mlxserve  # noqa: F401 - preloads OpenBLAS before anything imports MLX
from mlxserve.config import (
    EngineConfig,
    ModelConfig,
    PoolConfig,
    ServerConfig,
    add_arguments,
    from_namespace,
    served_models,
)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="Output tokens at most.")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling(ns):
    from mlxserve import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                          top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed)


def _llm(ns):
    from mlxserve import LLM

    model_cfg = from_namespace(ModelConfig, ns)
    engine_cfg = from_namespace(EngineConfig, ns)
    return LLM(model_cfg.model, load_format=model_cfg.load_format, dtype=model_cfg.dtype,
               quantize=model_cfg.quantize, dummy_seed=model_cfg.dummy_seed, draft_model=model_cfg.draft_model,
               **vars(engine_cfg))


def cmd_serve(ns) -> int:
    import logging
    import os

    from mlxserve.api.server import serve

    model_cfg, engine_cfg = from_namespace(ModelConfig, ns), from_namespace(EngineConfig, ns)
    server_cfg, pool_cfg = from_namespace(ServerConfig, ns), from_namespace(PoolConfig, ns)
    try:
        models = served_models(model_cfg.model, model_cfg, engine_cfg, server_cfg, pool_cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mlxserve.engine.collectives import init_group, launched
    from mlxserve.engine.ranks import launch_command, serve_ranks, without_flag

    if server_cfg.distributed and not launched():  # start every host's rank through mlx.launch
        try:
            cmd = launch_command(server_cfg.distributed, engine_cfg.distributed_backend,
                                 without_flag(ns.argv[1:], "--distributed"))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        os.execv(cmd[0], cmd)
    if init_group(engine_cfg.distributed_backend) is not None:  # one of several processes (mlx.launch)
        code = serve_ranks(models, server_cfg, pool_cfg, serve)
    else:
        code = serve(models, server_cfg, pool_cfg)
    # The server has stopped and its engine thread has ended (queued disk writes included).
    # Leave without the interpreter's teardown: MLX's, after a thread used it, aborts now and
    # then with "terminate called without an active exception" (ml-explore/mlx#3126), which
    # turned a clean shutdown's 0 into 134 in about 1 of 10 runs here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_generate(ns) -> int:
    with _llm(ns) as llm:
        out = llm.generate(ns.prompt, _sampling(ns))[0]
    print(out.text)
    return 0


def cmd_chat(ns) -> int:
    with _llm(ns) as llm:
        out = llm.chat([{"role": "user", "content": ns.message}], _sampling(ns))[0]
    print(out.text)
    return 0


def cmd_convert(ns) -> int:
    from mlxserve.models.load import load, save_folder

    loaded = load(ns.model, load_format=ns.load_format, dtype=ns.dtype,
                  quantize_bits=ns.quantize, seed=ns.dummy_seed)
    print(save_folder(loaded, ns.out_dir))
    return 0


def cmd_shapes(ns) -> int:
    from mlxserve.models.shapes import list_shapes

    for name, description in list_shapes():
        print(f"{name:20s} {description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="Serve models over the OpenAI and Anthropic HTTP APIs: "
                       "`serve A B C` (or --config FILE) serves several, loaded on demand.")
    add_arguments(p, ModelConfig, EngineConfig, ServerConfig, PoolConfig, positional="many")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="Complete a prompt and print the text.")
    p.add_argument("prompt", help="The prompt text.")
    add_arguments(p, ModelConfig, EngineConfig, positional=False)
    _sampling_args(p)
    p.set_defaults(func=cmd_generate, warmup=0.0)  # one request: a warm-up would only delay it

    p = sub.add_parser("chat", help="Send one chat message (with the model's chat template) and print the answer.")
    p.add_argument("message")
    add_arguments(p, ModelConfig, EngineConfig, positional=False)
    _sampling_args(p)
    p.set_defaults(func=cmd_chat, warmup=0.0)

    p = sub.add_parser("convert", help="Write any model source (GGUF, dummy, ...) as a plain MLX folder.")
    add_arguments(p, ModelConfig, exclude={"draft_model"})
    p.add_argument("--out-dir", required=True, help="The MLX folder to write.")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("shapes", help="List the named model shapes for --load-format dummy.")
    p.set_defaults(func=cmd_shapes)

    p = sub.add_parser("bench", help="Benchmarks: engine, serve, prefix, multimodal, grammar, soak, spec, warmup.")
    from mlxserve.bench import add_bench_parsers

    add_bench_parsers(p)
    return parser


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # --distributed passes them on to every rank
    if ns.command in ("serve", "generate", "chat", "bench"):
        from mlxserve._blas import check_cpu_blas, check_cuda_backend

        for warning in (check_cuda_backend(), check_cpu_blas()):
            if warning:
                print(f"warning: {warning}", file=sys.stderr)
    return ns.func(ns) or 0


if __name__ == "__main__":
    sys.exit(main())
