"""Write the flag tables of docs/server.md (`kvserve serve`) and docs/scaling.md (`kvserve ray`'s
own flags) from the options' declarations (`EngineArgs`, `ServerConfig`, `RayServeOptions`), so
the docs list every flag with the default and help the CLI has.

    python benchmarks/flag_docs.py           # rewrite the tables after adding or changing an option
    python benchmarks/flag_docs.py --check   # exit 1 if a table is stale (tests/test_cli_options.py)

A table sits between `<!-- flags:NAME ... -->` and `<!-- /flags:NAME -->`; the rest of the page is
written by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tables() -> dict[str, tuple[Path, str]]:
    """name -> (the page, its generated table)."""
    from kvserve.server.config import ServerConfig
    from kvserve.server.flags import flags_table
    from kvserve.server.ray_options import RayClusterOptions, RayOptions

    return {
        "serve": (ROOT / "docs" / "server.md", flags_table(ServerConfig)),
        "ray": (ROOT / "docs" / "scaling.md", flags_table(RayOptions, RayClusterOptions)),
    }


def render(page: str, name: str, table: str) -> str:
    """`page` with its `name` table replaced; ValueError if the page has no markers for it."""
    pattern = re.compile(rf"(<!-- flags:{name} [^\n]*-->\n).*?(<!-- /flags:{name} -->)", re.DOTALL)
    if not pattern.search(page):
        raise ValueError(f"no <!-- flags:{name} ... --> ... <!-- /flags:{name} --> markers")
    return pattern.sub(lambda m: m.group(1) + table + m.group(2), page, count=1)


def stale_pages() -> list[Path]:
    return [
        path
        for name, (path, table) in tables().items()
        if render(path.read_text(), name, table) != path.read_text()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale tables (exit 1)")
    args = parser.parse_args(argv)
    stale = stale_pages()
    if args.check:
        for path in stale:
            print(
                f"{path.relative_to(ROOT)}: the flag table is stale; run python benchmarks/flag_docs.py"
            )
        return 1 if stale else 0
    for name, (path, table) in tables().items():
        path.write_text(render(path.read_text(), name, table))
    print("rewrote", ", ".join(str(p.relative_to(ROOT)) for p in stale) or "nothing (up to date)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
