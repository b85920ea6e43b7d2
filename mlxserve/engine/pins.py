"""Pinned prefixes of one engine: a prompt's blocks kept in the prefix cache until unpinned.

For agents' fixed system prompts: a pin makes sure the prompt's KV is cached
(prefilling it when its blocks are not), then holds its blocks (the block
pool's pin references) so that no flood of other prompts evicts them. Pinned
bytes stay inside the prefix cache's byte budget: a pin that cannot fit is
refused with the numbers, never squeezed in by growing the budget.

The registry is touched on the MLX thread only (through `engine.on_mlx_thread`,
by name, so that it works with an engine in another process too), as the cache
is; `pin`, `unpin` and `describe` are called from the event loop and return
plain dicts (`Pin.describe()`).
"""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field

from mlxserve.engine.request import Request, SamplingParams

# A prefill pinned nothing because other prompts evicted its blocks before the pin
# took them: tried this many times before giving up (a busy, small cache).
PREFILL_TRIES = 2


class PinError(ValueError):
    """A pin that cannot be made; `status` is the HTTP status it deserves."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # the status survives pickling (an engine process hands it back)
        return type(self), (str(self), self.status)


@dataclass
class Pin:
    id: str
    token_ids: list[int]
    tokens: int  # of token_ids, how many the pinned blocks hold (all, or all but the last)
    blocks: list = field(repr=False, default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def describe(self) -> dict:
        return {"id": self.id, "tokens": self.tokens, "prompt_tokens": len(self.token_ids),
                "blocks": len(self.blocks), "bytes": self.nbytes}


class PrefixPins:
    def __init__(self, engine):
        # A weak reference: engine -> pins -> engine would be a cycle, and an engine in a
        # cycle lives (with its model's arrays) until the collector runs, maybe at interpreter
        # exit, where freeing MLX arrays aborts the process (ml-explore/mlx#3126).
        self._engine = weakref.ref(engine)
        self.pins: dict[str, Pin] = {}  # MLX thread only

    @property
    def engine(self):
        return self._engine()

    def _cache(self):
        pc = self.engine.prefix_cache
        if pc is None:
            raise PinError("the prefix cache is off for this model (--no-prefix-cache), so nothing can be pinned")
        if pc.disabled:
            raise PinError(f"the prefix cache is off for this model: {pc.disabled}")
        return pc

    def _try(self, pin_id: str, token_ids: list[int]) -> dict | None:
        """(MLX thread) The pin, made now if the prompt's blocks are all cached; else None."""
        if pin_id in self.pins:
            return self.pins[pin_id].describe()
        pc = self._cache()
        blocks, n = pc.pin(token_ids)
        # All but the last token is enough: that is all a prompt that ends here restores.
        if n >= len(token_ids) - 1:
            pin = self.pins[pin_id] = Pin(pin_id, list(token_ids), n, blocks)
            return pin.describe()
        pc.unpin(blocks)
        return None

    def _unpin(self, pin_id: str) -> dict | None:
        """(MLX thread)"""
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self._cache().unpin(pin.blocks)
        return pin.describe() if pin is not None else None

    def _describe(self) -> list[dict]:
        """(MLX thread)"""
        return [p.describe() for p in self.pins.values()]

    def _budget(self, token_ids: list[int]) -> dict:
        """(MLX thread) The numbers a refusal quotes: budget, bytes pinned, a per-token estimate."""
        pool = self._cache().pool
        stats = pool.stats()
        per_token = stats["bytes"] / stats["tokens"] if stats["tokens"] else None
        return {"budget": pool.budget, "pinned": stats["pinned_bytes"], "refused": dict(pool.refused),
                "need": None if per_token is None else int(per_token * len(token_ids))}

    async def pin(self, pin_id: str, token_ids: list[int]) -> dict:
        """Pin the prompt's blocks, prefilling it first when they are not all cached; returns
        the pin's `describe()`.

        Raises PinError (400) when the prompt cannot fit the cache's budget beside
        what is pinned already, with the numbers.
        """
        if not token_ids:
            raise PinError("prompt: must contain at least one token")
        call = self.engine.on_mlx_thread
        for _ in range(PREFILL_TRIES):
            pin = await call("pins._try", pin_id, token_ids)
            if pin is not None:
                return pin
            before = await call("pins._budget", token_ids)
            self._check_fits(before, token_ids)
            await self._prefill(token_ids)
            pin = await call("pins._try", pin_id, token_ids)
            if pin is not None:
                return pin
            after = await call("pins._budget", token_ids)
            refused = {k: v - before["refused"].get(k, 0) for k, v in after["refused"].items()}
            if refused.get("no_room") or refused.get("too_big"):
                raise PinError(self._too_big(after, token_ids, "its blocks did not fit"))
        raise PinError(f"could not pin the prompt: other prompts evicted its blocks before they could be "
                       f"pinned ({PREFILL_TRIES} tries); retry, or give the prefix cache more memory", 503)

    def _check_fits(self, numbers: dict, token_ids: list[int]) -> None:
        if numbers["need"] is not None and numbers["pinned"] + numbers["need"] > numbers["budget"]:
            raise PinError(self._too_big(numbers, token_ids, "it does not fit"))

    @staticmethod
    def _too_big(numbers: dict, token_ids: list[int], why: str) -> str:
        need = f"about {numbers['need']} bytes" if numbers["need"] is not None else "more bytes than are free"
        return (f"cannot pin {len(token_ids)} tokens: {why}. Pinning them needs {need}; the prefix "
                f"cache's budget is {numbers['budget']} bytes, of which {numbers['pinned']} are pinned "
                "already. Unpin other prefixes or raise --cache-memory.")

    async def _prefill(self, token_ids: list[int]) -> None:
        """Run the prompt through the engine (one token out): its blocks are stored as any prompt's."""
        request = Request(list(token_ids), SamplingParams(max_tokens=1, temperature=0.0),
                          request_id=f"pin-{uuid.uuid4().hex}")
        async for _ in self.engine.submit(request):
            pass

    async def unpin(self, pin_id: str) -> dict | None:
        """Unpin; returns the pin's describe(), or None if there was none with that id."""
        return await self.engine.on_mlx_thread("pins._unpin", pin_id)

    async def describe(self) -> list[dict]:
        return await self.engine.on_mlx_thread("pins._describe")
