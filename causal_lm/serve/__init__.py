"""Serving: the engine (requests, pages, scheduler, prefix cache) over the model's paged KV cache.

engine.py   Engine: submit / step / cancel / run / stats, the scheduler and the jitted step program
loop.py     EngineLoop: the engine as a DecodeLoop (start / step / resume / progress), for `drive`
pages.py    PageBook: reference counts, free pages and the prefix cache's hashed page chain (host state)
"""

from causal_lm.serve.engine import Engine, EngineError, Event, RequestResult
from causal_lm.serve.loop import EngineLoop, EngineState

__all__ = ["Engine", "EngineError", "EngineLoop", "EngineState", "Event", "RequestResult"]
