"""Public constructors keep real annotations at run time, so CLI tools that read signatures (jsonargparse, as
LightningCLI does) can build parsers from the Trainer, callbacks, loggers, strategies and plugins."""

from __future__ import annotations

import importlib
import inspect
import typing

import pytest

jsonargparse = pytest.importorskip("jsonargparse")

_PACKAGES = (
    "phalanx",
    "phalanx.callbacks",
    "phalanx.loggers",
    "phalanx.profilers",
    "phalanx.strategies",
    "phalanx.plugins",
    "phalanx.accelerators",
)


def _public_classes() -> list[type]:
    found: dict[str, type] = {}
    for package in _PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[key] for key in sorted(found)]


PUBLIC_CLASSES = _public_classes()


def test_the_table_covers_the_public_api() -> None:
    names = {cls.__name__ for cls in PUBLIC_CLASSES}
    assert {
        "Trainer",
        "ModelCheckpoint",
        "EarlyStopping",
        "DDPStrategy",
        "FSDPStrategy",
        "DeepSpeedStrategy",
        "CSVLogger",
    } <= names
    assert len(PUBLIC_CLASSES) >= 30


@pytest.mark.parametrize("cls", PUBLIC_CLASSES, ids=lambda cls: cls.__name__)
def test_constructor_annotations_resolve_at_run_time(cls: type) -> None:
    signature = inspect.signature(cls, eval_str=True)
    unresolved = {name: p.annotation for name, p in signature.parameters.items() if isinstance(p.annotation, str)}
    assert not unresolved, f"{cls.__name__} keeps string annotations: {unresolved}"
    typing.get_type_hints(cls.__init__)  # the other way tools read them; raises NameError on a TYPE_CHECKING-only name


@pytest.mark.parametrize("cls", PUBLIC_CLASSES, ids=lambda cls: cls.__name__)
def test_jsonargparse_builds_a_parser(cls: type) -> None:
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "obj", fail_untyped=False)
    defaults = parser.get_defaults()
    for name, parameter in inspect.signature(cls).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.default is parameter.empty:
            continue
        assert f"obj.{name}" in defaults, f"{cls.__name__}({name}=...) is missing from the parser"


# (class, command line, attribute -> expected value after instantiation): values arrive typed, not as strings.
CONFIGS = [
    ("Trainer", ["--obj.max_epochs=3", "--obj.limit_train_batches=0.5", "--obj.logger=false"], {"max_epochs": 3}),
    (
        "ModelCheckpoint",
        ["--obj.monitor=val_loss", "--obj.save_top_k=2", "--obj.mode=max"],
        {"monitor": "val_loss", "save_top_k": 2, "mode": "max"},
    ),
    (
        "EarlyStopping",
        ["--obj.monitor=val_loss", "--obj.patience=7", "--obj.mode=max", "--obj.min_delta=0.5"],
        {"patience": 7, "min_delta": 0.5},
    ),
    ("CSVLogger", ["--obj.save_dir={tmp}", "--obj.name=run"], {"name": "run"}),
    ("DDPStrategy", ["--obj.find_unused_parameters=true"], {}),
]


@pytest.mark.parametrize(("class_name", "argv", "expected"), CONFIGS, ids=[row[0] for row in CONFIGS])
def test_a_command_line_instantiates_with_typed_values(
    class_name: str, argv: list[str], expected: dict, tmp_path
) -> None:
    cls = next(cls for cls in PUBLIC_CLASSES if cls.__name__ == class_name)
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "obj", fail_untyped=False)
    config = parser.parse_args([arg.format(tmp=tmp_path) for arg in argv])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    obj = instantiate(config).obj
    assert isinstance(obj, cls)
    for attribute, value in expected.items():
        assert getattr(obj, attribute) == value
        assert type(getattr(obj, attribute)) is type(value)
