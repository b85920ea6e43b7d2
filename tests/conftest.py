"""Shared fixtures: tiny random-weight models of real architectures, loaded once per session."""

import asyncio
import functools

import pytest

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX is imported


@functools.lru_cache(maxsize=None)
def tiny_model(shape: str):
    from mlxserve.models.load import load

    return load(shape, load_format="dummy", progress=False)


@pytest.fixture(scope="session")
def tiny():
    """tiny("qwen3-tiny") -> LoadedModel, built once per session."""
    return tiny_model


def run_async(coro):
    return asyncio.run(coro)
