"""Imports point one way: config <- model <- decode <- train <- commands / experiments / bench.

Read from the source with `ast` (nothing is imported), so the test also sees imports inside functions: those hide
cycles, and are allowed only for optional or heavy third-party packages named below, each for a reason.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "causal_lm"

# What each part of the package may import from the rest of it (besides itself).
ALLOWED = {
    "config": set(),
    "notes": set(),
    "compile_cache": set(),
    "malloc": set(),
    "parallel": {"config"},
    "model": {"config"},
    "data": {"config"},
    "decode": {"config", "model", "parallel"},
    "serve": {"config", "model", "decode", "parallel"},
    "interop": {"config", "model", "data"},
    "train": {"config", "model", "data", "decode", "parallel", "interop", "serve"},  # GRPO samples via the engine
    "experiments": {"config", "model", "data", "decode", "parallel", "interop", "train", "serve"},
    "bench": {"config", "model", "data", "decode", "parallel", "interop", "train", "serve", "compile_cache"},
    "commands": {
        "config",
        "model",
        "data",
        "decode",
        "parallel",
        "interop",
        "train",
        "serve",
        "experiments",
        "bench",
        "compile_cache",
    },
    "device_check": {"config", "model", "data", "decode", "parallel", "interop", "train", "bench", "compile_cache"},
    "cli": {"config", "commands", "compile_cache", "malloc"},
    "__init__": {"config", "model", "data", "decode", "parallel", "interop", "train", "serve"},
}

# Third-party packages a function may import locally, and why.
LOCAL_IMPORTS_ALLOWED = {
    "torch": "optional (interop extra, benchmark peer)",
    "transformers": "optional (interop extra)",
    "safetensors": "optional (interop extra)",
    "gguf": "optional (GGUF files)",
    "cffi": "optional (llama.cpp's library, the bench llama-cpp peer)",
    "jinja2": "optional (chat templates)",
    "ml_dtypes": "only for bfloat16 checkpoints",
    "matplotlib": "the backend must be chosen before pyplot is imported; only plots need it",
    "tensorboardX": "seconds to import; only a training run writes events",
    "orbax": "seconds to import; only checkpoint reads and writes need it",
    "datasets": "seconds to import; only corpus loading needs it",
    "pyarrow": "comes with datasets; only corpus loading needs it",
    "tqdm": "only an interactive training run draws a bar",
    "tokenizers": "only tokenizer.json tokenizers need it",
    "pydoc_data": "the built-in corpus, read only when it is the corpus",
    "jax.experimental.pallas": "half a second to import; only attention_impl=splash (a TPU) runs its kernel",
}


def _part(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    if rel.parts == ("__init__.py",):
        return "__init__"
    return rel.parts[0].removesuffix(".py")


def _imports(path: pathlib.Path):
    """(module imported, line, inside a function?) for every import statement of the file."""
    tree = ast.parse(path.read_text())
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            local.update(id(sub) for sub in ast.walk(node) if isinstance(sub, ast.Import | ast.ImportFrom))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in local, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno, id(node) in local, tuple(a.name for a in node.names)


FILES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(PACKAGE)) for p in FILES])
def test_imports_point_one_way(path):
    part = _part(path)
    bad = []
    for module, line, in_function, names in _imports(path):
        top = module.split(".")[0]
        if top == "causal_lm":
            # `from causal_lm import parallel` imports the part `parallel`; `import causal_lm.x.y` the part `x`
            targets = [module.split(".")[1]] if "." in module else [n if n in ALLOWED else "__init__" for n in names]
            if in_function:
                bad.append(f"line {line}: {module} imported inside a function (hides a cycle)")
            for target in targets:
                if target != part and target != "notes" and target not in ALLOWED[part]:  # notes: anyone may note
                    bad.append(f"line {line}: {part} may not import causal_lm.{target}")
            private = [n for n in names if n.startswith("_") and targets != [part]]
            if private:
                bad.append(f"line {line}: private {private} of {module} used from {part}")
        elif (
            in_function
            and top not in LOCAL_IMPORTS_ALLOWED
            and top not in ("importlib",)
            and not any(module.startswith(k + ".") for k in LOCAL_IMPORTS_ALLOWED)
        ):
            bad.append(f"line {line}: {module} imported inside a function")
    assert not bad, "\n".join(bad)


def test_the_rules_cover_every_part():
    assert {_part(p) for p in FILES} <= set(ALLOWED)


def test_the_check_catches_a_violation(tmp_path, monkeypatch):
    """The test can fail: a model file importing train, and a function-local import of the package, are reported."""
    bad = PACKAGE / "model" / "_layering_probe.py"
    bad.write_text("from causal_lm.train import state\n\n\ndef f():\n    from causal_lm.config import Config\n")
    try:
        with pytest.raises(AssertionError, match="model may not import causal_lm.train") as e:
            test_imports_point_one_way(bad)
        assert "imported inside a function" in str(e.value)
    finally:
        bad.unlink()
