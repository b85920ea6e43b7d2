"""Where a benchmark's numbers go: a table on stdout, markdown + PNG under benchmarks/.

Every result records the commit, the machine and the MLX backend it was
measured on, so numbers from different places are never mixed up.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path


def commit() -> str:
    # A copy of the tree elsewhere (the GPU machine) may carry stale git metadata: let the caller say.
    if os.environ.get("MLXSERVE_COMMIT"):
        return os.environ["MLXSERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout
        return out.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import mlx.core as mx

    from mlxserve import _blas, backend

    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 0
    device = mx.default_device()
    info = {
        "commit": commit(),  # now, when the run starts: the code it measures
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "mlx": mx.__version__,
        "device": str(device),
    }
    if device.type == mx.gpu:
        info["backend"] = backend.name()
        try:
            info["gpu"] = mx.device_info().get("device_name", "")
        except Exception:  # noqa: BLE001 - informational only
            pass
    else:
        info["backend"] = "cpu"
        info["blas"] = _blas.openblas_path or "bundled reference BLAS (slow)"
    return info


def kv_label(kv_bits: int | None) -> str:
    """How the engine holds KV in a run, for a report's model line."""
    if not kv_bits:
        return "unquantized KV"
    from mlxserve.cache.quantized import dequantized_attention

    return f"{kv_bits}-bit KV ({'dequantized' if dequantized_attention() else 'quantized'} attention)"


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:,.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def result_path(kind: str, backend: str, out_dir: str | Path = "benchmarks") -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    path = Path(out_dir) / f"{kind}-{backend}-{stamp}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def header(title: str, info: dict, command: str) -> str:
    # A result written again from its JSON keeps the date it was measured (info["date"]).
    date = info.get("date") or datetime.datetime.now().isoformat(timespec="seconds")
    lines = [f"# {title}", "", f"- commit: `{info.get('commit') or commit()}`", f"- date: {date}",
             f"- command: `{command}`"]
    lines += [f"- {k}: {v}" for k, v in info.items() if k not in ("commit", "date", "command")]
    return "\n".join(lines) + "\n"


def save_json(path: Path, data: dict) -> None:
    import json

    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))


def load_json(path) -> dict:
    import json

    return json.loads(Path(path).read_text())


def plot_or_defer(plot, results, path: Path, info: dict) -> None:
    """Draw the PNG now, or say how to draw it later where matplotlib is missing
    (e.g. a benchmark machine that only got the wheels it needed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"wrote {path}.md and {path}.json; matplotlib is missing here: "
              f"redraw the PNG with --replot {path}.json", file=sys.stderr)
        return
    plot(results, path.with_suffix(".png"), info)
    print(f"wrote {path}.md, {path}.json and {path}.png", file=sys.stderr)


def write_result(kind: str, info: dict, text: str, results, plot, out_dir) -> Path:
    """benchmarks/KIND-BACKEND-STAMP.{md,json,png}: the table, the raw numbers, the plot."""
    path = result_path(kind, info["backend"], out_dir)
    image = f"\n![{kind} benchmark]({path.name}.png)\n" if plot else ""
    path.with_suffix(".md").write_text(text + image)
    save_json(path, {"info": info, "results": results})
    if plot:
        plot_or_defer(plot, results, path, info)
    return path


def replot(json_path, plot) -> None:
    """Redraw the PNG of a result from its JSON (e.g. one measured where matplotlib was missing)."""
    data = load_json(json_path)
    plot(data["results"], Path(json_path).with_suffix(".png"), data["info"])
