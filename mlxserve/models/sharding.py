"""Splitting one model across the ranks of an `mx.distributed` group, with mlx-lm's own code.

mlx-lm 0.32 gives some architectures tensor parallelism (`Model.shard(group)`: every
attention and MLP layer split across the ranks, their partial sums added with
`all_sum`) and some pipeline parallelism (`model.model.pipeline(group)`: each rank
keeps a run of layers and passes the hidden state on). Nothing here splits a layer
by hand: `Sharding` only chooses which of the two applies and calls it at the right
point of a load. Pipeline drops the layers a rank does not run before their weights
are made or read (a model too large for one device then fits across several);
tensor parallelism slices the weights once they exist (lazily, for a folder).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxserve.models.files import ModelLoadError

MODES = ("auto", "tensor", "pipeline")


def support(model) -> dict[str, bool]:
    """Which of mlx-lm's two ways this model class has."""
    return {"tensor": callable(getattr(model, "shard", None)),
            "pipeline": callable(getattr(getattr(model, "model", None), "pipeline", None))}


def choose(model, wanted: str, model_type: str) -> str:
    """The mode to split `model` by: `wanted`, or for auto tensor where it has it, else pipeline.
    Raises ModelLoadError naming both ways when the model has neither (or not the one asked)."""
    if wanted not in MODES:
        raise ValueError(f"parallel must be one of {', '.join(MODES)}, not {wanted!r}")
    has = support(model)
    if not any(has.values()):
        raise ModelLoadError(
            f"mlx-lm cannot split a {model_type!r} model across processes: it has neither tensor "
            f"parallelism (Model.shard()) nor pipeline parallelism (model.pipeline()) for this "
            "architecture. Serve it on one device, or pick a model whose mlx-lm class has one of them.")
    if wanted == "auto":
        mode = "tensor" if has["tensor"] else "pipeline"
    elif not has[wanted]:
        other = "pipeline" if wanted == "tensor" else "tensor"
        raise ModelLoadError(
            f"--parallel {wanted}: mlx-lm has no {wanted} parallelism for {model_type!r} models; "
            f"it has {other} parallelism (--parallel {other} or auto).")
    else:
        mode = wanted
    if mode == "pipeline" and on_cuda():
        raise ModelLoadError(
            f"pipeline parallelism cannot run on MLX's CUDA backend: the send and recv that pass the hidden "
            f"state between ranks have no CUDA implementation (MLX 0.32.4, 'Recv has no CUDA implementation' "
            f"on the first step); {'serve it with --parallel tensor' if has['tensor'] else f'mlx-lm has no tensor parallelism for {model_type!r} models either'}.")
    return mode


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here."""
    import mlx.core as mx

    return mx.cuda.is_available() and mx.default_device().type == mx.DeviceType.gpu


@dataclass
class Sharding:
    """How a load splits the model: `group` (an mx.distributed.Group) and the mode asked for.
    `mode` is set once a model is seen (`before_weights`)."""

    group: object
    wanted: str = "auto"
    mode: str | None = field(default=None)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def before_weights(self, model, model_type: str) -> None:
        """Choose the mode; pipeline: drop the layers other ranks run (before weights are made)."""
        self.mode = choose(model, self.wanted, model_type)
        if self.mode == "pipeline":
            model.model.pipeline(self.group)

    def after_weights(self, model) -> None:
        """Tensor parallelism: slice every layer's weights to this rank's part."""
        if self.mode == "tensor":
            model.shard(self.group)

    def describe(self) -> str:
        return f"{self.mode or self.wanted} parallel over {self.size} ranks (this is rank {self.rank})"
