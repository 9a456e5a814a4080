"""Serving: the engine (requests, pages, scheduler, prefix cache) over the model's paged KV cache.

engine.py   Engine: submit / step / cancel / run / stats, the scheduler and the jitted step program
pages.py    PageBook: reference counts, free pages and the prefix cache's hashed page chain (host state)
"""

from causal_lm.serve.engine import Engine, EngineError, Event, RequestResult

__all__ = ["Engine", "EngineError", "Event", "RequestResult"]
