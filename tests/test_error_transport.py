"""Every error class of ours survives the trip between processes (rules/errors.py).

A helper process reports an error as a JSON record (``error_record``); the
process that reads it raises the same class with the same message
(``rebuild_error``). The record names the class's module, so a module that
moved, or a record written by hand, would silently become a plain
``TransferError``: this test rebuilds every class in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys

import spark_dilation
from spark_dilation.errors import TransferError
from spark_dilation.transfer.rules.errors import error_record, rebuild_error
from spark_dilation.transfer.rules.registry import LaneRegistry, cannot_heal_record


def _our_error_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(spark_dilation.__path__, "spark_dilation."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("spark_dilation."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def _record(cls: type[BaseException]) -> dict[str, str]:
    error = cls.__new__(cls)  # some take structured arguments; the message is what travels
    BaseException.__init__(error, f"a {cls.__name__} from a helper")
    try:
        return error_record(error)
    except AttributeError:  # a __str__ of its own (Interrupted): a real one
        return error_record(cls())


def test_every_error_class_is_rebuilt_as_itself_in_another_process() -> None:
    classes = _our_error_classes()
    assert len(classes) > 40  # the walk found our modules (transfer, dilation, wormhole, ...)
    records = [_record(cls) for cls in classes]
    script = (
        "import json, sys\n"
        "from spark_dilation.transfer.rules.errors import rebuild_error\n"
        "for record in json.loads(sys.stdin.read()):\n"
        "    e = rebuild_error(record)\n"
        "    print(json.dumps([type(e).__module__, type(e).__qualname__, str(e)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(records),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(out) == len(classes)
    wrong = []
    for cls, line in zip(classes, out, strict=True):
        module, name, message = json.loads(line)
        if issubclass(cls, Exception):
            expected = [cls.__module__, cls.__qualname__, f"a {cls.__name__} from a helper"]
        else:  # KeyboardInterrupt's kin: never raised as such in another process
            expected = [TransferError.__module__, TransferError.__qualname__, message]
            assert cls.__name__ in message
        if [module, name, message] != expected:
            wrong.append((cls, module, name, message))
    assert wrong == []


def test_records_the_registry_writes_itself_rebuild_as_their_class() -> None:
    from spark_dilation.transfer.rules.errors import CannotHealError

    assert type(rebuild_error(cannot_heal_record(3, ["m1"]))) is CannotHealError
    registry = LaneRegistry(1)
    for _ in range(3):
        registry.hosting_failed(0, "no python", now=0.0)
    assert type(rebuild_error(registry.lanes[0].error or {})) is TransferError


def test_a_class_that_is_not_ours_becomes_a_transfer_error_that_names_it() -> None:
    error = rebuild_error({"type": "ValueError", "module": "builtins", "message": "bad"})
    assert type(error) is TransferError
    assert str(error) == "bad (ValueError in a spark-dilation helper process)"
