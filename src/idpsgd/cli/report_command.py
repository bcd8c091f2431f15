"""The ``report`` command: the readable HTML report of a run folder."""

from __future__ import annotations

from .registry import arguments, command, register_text


def _args(p):
    p.add_argument("dir", help="a run folder (holding report.json)")
    p.add_argument(
        "--include-private",
        action="store_true",
        help="add the private sections (per-example figures, exact statistics); written to "
        "DIR/private/report.html with mode 0600",
    )


@command("report", "write the readable, self-contained HTML report of a run folder")
@arguments(_args)
def report_cmd(args):
    from ..analysis.report import move_public_seed, write_report
    from ..runfolder import RunFolder

    folder = RunFolder(args.dir, flag="dir", resume=True)
    moved = move_public_seed(folder)  # a report.json of an earlier version held the seed
    path = write_report(folder, include_private=args.include_private)
    return {
        "report": str(path),
        "private": args.include_private,
        **({"moved": "the seed, from report.json to private/seed.json"} if moved else {}),
    }


register_text(report_cmd, lambda r: f"report: {r['report']}" + (f" (moved {r['moved']})" if r.get("moved") else ""))
