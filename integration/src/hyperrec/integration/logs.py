"""``python -m hyperrec.integration.logs``: the event-log reader from the shell.

::

    python -m hyperrec.integration.logs example events.csv      # a small synthetic log
    python -m hyperrec.integration.logs prepare events.parquet --cache prepared/ \
        --set rating_threshold=4 --set label_column=rating

``prepare`` is worth running once ahead of a multi-process job on a large log: the job
then finds the preparation through ``data.cache_dir`` instead of rank 0 preparing it
while the other ranks wait.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from hyperrec.integration.config import EventLogConfig, _parse_value
from hyperrec.integration.eventlog import prepare_event_log, write_example_log

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m hyperrec.integration.logs``: write an example log, or prepare a log.

    ``example PATH``: :func:`write_example_log` (``.csv`` or ``.parquet``).
    ``prepare PATH --cache DIR [--set FIELD=VALUE ...]``: :func:`prepare_event_log` once,
    ahead of a multi-process job (which then finds the preparation through
    ``data.cache_dir``); prints the split sizes and vocabulary sizes.
    """

    p = argparse.ArgumentParser(prog="python -m hyperrec.integration.logs")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("example", help="write a small synthetic log in the documented format")
    ex.add_argument("path")
    ex.add_argument("--users", type=int, default=500)
    ex.add_argument("--events-per-user", type=int, default=40)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--rating", action="store_true", help="a 1-5 rating instead of a label")
    pr = sub.add_parser("prepare", help="prepare a log for training (sort, split, vocabulary)")
    pr.add_argument("path")
    pr.add_argument("--cache", required=True, help="the directory to write (data.cache_dir)")
    pr.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an EventLogConfig field, e.g. --set rating_threshold=4")  # fmt: skip
    args = p.parse_args(argv)
    try:
        if args.command == "example":
            out = write_example_log(args.path, users=args.users,
                                    events_per_user=args.events_per_user, seed=args.seed,
                                    rating=args.rating)  # fmt: skip
            print(f"wrote {out}")
            return 0
        fields = {f.name: f for f in dataclasses.fields(EventLogConfig)}
        kw: dict[str, Any] = {}
        for item in args.set:
            key, sep, raw = item.partition("=")
            key = key.strip().removeprefix("data.")
            if not sep or key not in fields:
                raise ValueError(f"--set {item!r}: EventLogConfig has no field {key!r}")
            kw[key] = _parse_value(raw.strip(), fields[key].type, key)
        info = prepare_event_log(EventLogConfig(path=args.path, **kw), args.cache)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in info.items() if k != "key"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
