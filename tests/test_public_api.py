"""The declared public surface: ``fedswarm.__all__``.

Every name in it resolves, stands there once, names one object no other public
name also names, is not private and carries a docstring of its own; the lazy
names stay lazy (``import fedswarm`` pulls in neither torch nor py-libp2p nor
trio, so that ``peer --help`` stays fast).
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import fedswarm


def test_every_name_resolves_and_is_listed_once() -> None:
    names = fedswarm.__all__
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for name in names:
        assert getattr(fedswarm, name) is not None, name
    # `from fedswarm import *` gives exactly __all__
    ns: dict[str, object] = {}
    exec("from fedswarm import *", ns)
    assert sorted(k for k in ns if k != "__builtins__") == sorted(names)


def test_no_object_is_exported_under_two_names() -> None:
    by_id: dict[int, list[str]] = {}
    for name in fedswarm.__all__:
        by_id.setdefault(id(getattr(fedswarm, name)), []).append(name)
    assert [names for names in by_id.values() if len(names) > 1] == []


def test_no_private_name_is_exported() -> None:
    assert [n for n in fedswarm.__all__ if n.startswith("_")] == []
    for name in fedswarm.__all__:
        obj = getattr(fedswarm, name)
        # the object is itself public where it is defined: its own name is
        # the exported one and its module is not a private one
        assert getattr(obj, "__name__", name) == name, (name, obj)
        module = getattr(obj, "__module__", "fedswarm")
        assert module.split(".")[0] == "fedswarm", (name, module)
        assert not any(part.startswith("_") for part in module.split(".")), (name, module)


def test_the_namespace_holds_no_other_public_name() -> None:
    # beside __all__ only submodules (fedswarm.errors, ...) and private names
    leaked = [n for n in dir(fedswarm)
              if not n.startswith("_") and n not in fedswarm.__all__
              and not inspect.ismodule(getattr(fedswarm, n))]
    assert leaked == []


def test_every_export_has_its_own_docstring() -> None:
    missing = []
    for name in fedswarm.__all__:
        obj = getattr(fedswarm, name)
        doc = inspect.getdoc(obj) or ""
        # a dataclass without a docstring gets its signature as __doc__
        if not doc.strip() or doc.startswith(f"{name}("):
            missing.append(name)
        elif inspect.isclass(obj) and obj.__doc__ is None:
            missing.append(name)  # inherited from a base class only
    assert missing == []


def test_unknown_name_raises_attribute_error() -> None:
    try:
        fedswarm.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("fedswarm.no_such_name resolved")


def test_import_is_light_until_a_name_is_used() -> None:
    code = (
        "import sys, fedswarm\n"
        "heavy = [m for m in ('torch', 'libp2p', 'trio') if m in sys.modules]\n"
        "assert heavy == [], heavy\n"
        "fedswarm.JobRequest\n"
        "assert 'torch' not in sys.modules and 'libp2p' not in sys.modules\n"
        "fedswarm.open_swarm_client\n"
        "assert 'trio' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
