"""``hicache storage info|clear|bump-epoch SPEC``: inspect and retire a third tier.

A tier (``file:DIR`` or ``mooncake://HOST:PORT?metadata=URL``) is shared by every
process that opens it. ``info`` prints its epoch and, where the backend can count
them, the pages and bytes it holds; ``clear`` removes every page (the epoch stays);
``bump-epoch`` advances the epoch, so that no cache opened from then on reads a page
stored before (after the model's weights changed in place: docs/storage.md). The
library side is :meth:`hicache.storage.StorageBackend.epoch` / ``bump_epoch`` /
``usage`` / ``clear``.

A directory that does not exist is an error here, never created; a store that
cannot be reached or read is one line on stderr and exit status 2, like a bad spec.
"""

from __future__ import annotations

import argparse
import json
import os

from hicache.cli.args import UsageError, add_json, user_input

_SPEC_HELP = "the tier: file:DIR or mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="storage_command", required=True,
                                metavar="{info,clear,bump-epoch}")
    info = sub.add_parser("info", help="epoch, pages and bytes of a tier",
                          description="Print a tier's epoch, and the pages and bytes it holds "
                          "(all processes' writes) where the backend can count them.")
    info.add_argument("spec", help=_SPEC_HELP)
    add_json(info)
    clear = sub.add_parser("clear", help="remove every page of a tier (the epoch stays)",
                           description="Remove every page of a tier, for every process "
                           "sharing it. The epoch stays.")
    clear.add_argument("spec", help=_SPEC_HELP)
    clear.add_argument("--yes", action="store_true",
                       help="confirm: the pages of every process sharing the tier go")
    add_json(clear)
    bump = sub.add_parser("bump-epoch", help="retire every page stored so far (weights changed)",
                          description="Advance the tier's epoch: caches that open the tier from "
                          "now on salt their keys with it and read no page stored before. "
                          "Running caches keep their epoch until they reset with new_epoch.")
    bump.add_argument("spec", help=_SPEC_HELP)
    add_json(bump)


def _open(spec: str):
    from hicache.storage import make_storage

    if spec.startswith("file:") and spec[len("file:"):] and not os.path.isdir(spec[5:]):
        raise UsageError(f"{spec}: no such directory (a tier is never created here)")
    try:
        with user_input():  # the spec's form, named by the library
            return make_storage(spec, page_nbytes=1)  # no page is moved: any page size opens it
    except ImportError as exc:  # an optional backend that is not installed: say which
        raise UsageError(str(exc)) from None


def _report(args: argparse.Namespace, fields: dict, text: str) -> None:
    if args.json:
        print(json.dumps({"spec": args.spec, **fields}))
    else:
        print(text)


def run(args: argparse.Namespace) -> int:
    from hicache.storage import StorageError

    if args.storage_command == "clear" and not args.yes:
        raise UsageError(f"clear removes every page of {args.spec} for every process sharing "
                         "it; pass --yes to confirm")
    try:
        with _open(args.spec) as store:
            if args.storage_command == "info":
                usage, epoch = store.usage(), store.epoch()
                pages, nbytes = (None, None) if usage is None else usage
                text = f"{args.spec}\n  epoch  {epoch}"
                if usage is None:
                    text += "\n  pages  ? (this backend cannot count its pages)"
                else:
                    text += f"\n  pages  {pages}\n  bytes  {nbytes}"
                _report(args, {"epoch": epoch, "pages": pages, "bytes": nbytes}, text)
            elif args.storage_command == "clear":
                num = store.clear()
                epoch = store.epoch()
                _report(args, {"pages_removed": num, "epoch": epoch},
                        f"{args.spec}: removed {num} pages; epoch stays {epoch}")
            else:
                epoch = store.bump_epoch()
                _report(args, {"epoch": epoch},
                        f"{args.spec}: epoch {epoch - 1} -> {epoch}; caches opened from now on "
                        "read no page stored before")
    except StorageError as exc:
        raise UsageError(str(exc)) from None
    return 0
