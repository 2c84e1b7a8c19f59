"""`SignatureSpy`: stands where a vLLM object would, checking each call against the real class.

Every attribute rljob touches is looked up on the real class (AttributeError: vLLM has no such
method), every call is bound to the real method's signature with the exact arguments passed
(TypeError: a keyword vLLM does not take), recorded, and answered as the real method would be called
(a coroutine for `async def`, an async generator for `async def ... yield`) with a canned result,
or with what a result function returns: an awaitable or an async generator to model a call over time.
It checks the shape of each call, not what vLLM does with it (no GPU here).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    method: str
    arguments: dict[str, Any]


@dataclass
class SignatureSpy:
    cls: type
    results: dict[str, Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        real = getattr(self.cls, name)  # AttributeError: the installed vLLM has no such attribute
        signature = inspect.signature(real)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)  # TypeError: not a call vLLM takes
            arguments = dict(bound.arguments)
            arguments.pop(next(iter(signature.parameters)), None)  # self
            self.calls.append(Call(name, arguments))
            result = self.results.get(name)
            value = result(arguments) if callable(result) else result
            if inspect.isasyncgenfunction(real):
                if inspect.isasyncgen(value):  # a result that behaves over time (a pause, an abort)
                    return value

                async def stream() -> Any:
                    for item in value if isinstance(value, list) else [value]:
                        yield item

                return stream()
            if inspect.iscoroutinefunction(real):

                async def answer() -> Any:
                    return await value if inspect.isawaitable(value) else value

                return answer()
            return value

        return call

    def called(self, method: str) -> list[dict[str, Any]]:
        return [c.arguments for c in self.calls if c.method == method]
