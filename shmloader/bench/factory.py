"""The user's code that compare's command line names: `package.module:callable` or
`path/to/file.py:callable`, and the dataset its factory returns.

A file is imported under its own name, with its folder first on sys.path as when Python
runs a script, so that it can import the modules beside it, and so that workers started
with spawn or forkserver (which get that sys.path) can import it by that name too.
"""

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch.utils.data

from .errors import InputError, user_trace

FORMS = "package.module:callable or path/to/file.py:callable"


def load_callable(spec: str, option: str) -> Callable[..., Any]:
    """The callable that `spec` names; InputError, naming `option`, for anything else."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise InputError(f"{option} {spec!r} names no callable: write {FORMS}")
    module = (
        _import_file(where, option)
        if where.endswith(".py") or "/" in where
        else _import_module(where, option)
    )
    target: Any = module
    for part in name.split("."):  # module:Class.method
        if not hasattr(target, part):
            public = sorted(
                n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n))
            )
            raise InputError(
                f"{option} {spec!r}: {module.__name__} has no attribute {name!r}; its callables are: "
                f"{', '.join(public) or 'none'}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise InputError(
            f"{option} {spec!r} is {_describe(target)}, not a callable: name a function or class"
        )
    return target


def _import_module(name: str, option: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name + ".").startswith(
            error.name + "."
        ):  # it, not one it imports
            raise InputError(
                f"{option}: no module named {name!r} can be imported from {Path.cwd()}; install its "
                "package, run from the folder that holds it, or give a path ending in .py"
            ) from None
        raise InputError(f"{option}: importing {name!r} failed: {error}", user_trace()) from None
    except Exception as error:
        raise InputError(
            f"{option}: importing {name!r} raised {type(error).__name__}: {error}", user_trace()
        ) from None


def _import_file(path: str, option: str) -> Any:
    file = Path(path).resolve()
    if not file.is_file():
        raise InputError(f"{option}: there is no file {path!r} (from {Path.cwd()})")
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == file:
            return loaded
        raise InputError(
            f"{option}: {path} would be imported as {name!r}, but a module of that name is already "
            f"imported (from {getattr(loaded, '__file__', 'a built-in')}): rename the file"
        )
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:  # no import loader takes its suffix
        raise InputError(f"{option}: {path} cannot be imported: name a .py file")
    sys.path.insert(0, str(file.parent))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]
        if not isinstance(error, Exception):
            raise
        raise InputError(
            f"{option}: importing {path} raised {type(error).__name__}: {error}", user_trace()
        ) from None
    return module


def keyword_arguments(text: str, option: str) -> dict[str, Any]:
    """A JSON object of keyword arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{option} is not JSON ({error}): write a JSON object, e.g. "
            f"""'{{"root": "/data", "train": true}}'"""
        ) from None
    if not isinstance(value, dict):
        raise InputError(
            f"{option} is a JSON {type(value).__name__}, not an object of keyword arguments: "
            f"""write e.g. '{{"root": "/data"}}'"""
        )
    return value


def make_dataset(spec: str, kwargs: dict[str, Any]) -> Any:
    """Call the factory that `spec` names with `kwargs`; the dataset it returns, checked to
    be one torch's DataLoader takes."""
    factory = load_callable(spec, "--dataset")
    call = call_text(spec, kwargs)
    try:
        dataset = factory(**kwargs)
    except Exception as error:
        hint = " (check --dataset-args)" if isinstance(error, TypeError) else ""
        raise InputError(
            f"--dataset: {call} raised {type(error).__name__}: {error}{hint}", user_trace()
        ) from None
    # torch's DataLoader takes any Dataset, and as a map-style one any object with both.
    if isinstance(dataset, torch.utils.data.Dataset) or all(
        hasattr(dataset, a) for a in ("__getitem__", "__len__")
    ):
        return dataset
    hint = (
        " (an iterator: return an IterableDataset whose __iter__ yields its samples)"
        if hasattr(dataset, "__next__")
        else ""
    )
    raise InputError(
        f"--dataset: {call} returned {_describe(dataset)}, not a Dataset{hint}: the factory must return a "
        "torch.utils.data.Dataset (map-style, with __getitem__ and __len__) or an IterableDataset"
    )


def call_text(spec: str, kwargs: dict[str, Any]) -> str:
    """The factory's call as Python would write it."""
    return f"{spec}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
