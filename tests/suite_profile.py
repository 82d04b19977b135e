r"""The test suite's time profile: each test's seconds, per file and per promise, and an
estimate of the wall time on two idle cores.

It runs the suite as `make test` does, with a plugin that records every test's start and end
on its xdist worker, and writes `profile.json` (every test) and `profile.md` (the summary)
into `--out`; with `--file_seconds`, also each file's seconds, which tests/conftest.py reads
to start the slowest files first. Promises come from docs/design/test_promises.md: a test's
time counts under each promise whose row names it or its file.

Example:
    python tests/suite_profile.py --out=runs/test-profile --file_seconds=tests/file_seconds.json
    python tests/suite_profile.py --out=runs/test-profile -- tests/test_data.py -n 0
    python tests/suite_profile.py --out=runs/again --timings=runs/test-profile/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMISES = os.path.join(REPO_ROOT, "docs", "design", "test_promises.md")
PYTEST_ARGS = (
    "-q",
    "-n",
    "2",
    "--dist=loadfile",
    "--no-loadscope-reorder",
    "--timeout=900",
    "-o",
    "faulthandler_timeout=120",
    "tests",
)
TEST_NAME = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


class TimingRecorder:
    """A pytest plugin (in the controller) that keeps each test's phases: worker, start, end."""

    def __init__(self):
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)
        worker = node.gateway.id if node is not None else "main"
        test = self.tests.setdefault(
            report.nodeid, {"nodeid": report.nodeid, "worker": worker, "outcome": "passed"}
        )
        test["start"] = min(test.get("start", report.start), report.start)
        test["stop"] = max(test.get("stop", report.stop), report.stop)
        test["seconds"] = test.get("seconds", 0.0) + report.duration
        if report.failed:
            test["outcome"] = "failed"
        elif report.skipped and test["outcome"] == "passed":
            test["outcome"] = "skipped"


def read_promises(path: str = PROMISES) -> dict[str, list[tuple[str, str | None]]]:
    """{promise: [(test file, test name or None for the whole file), ...]} of the promises
    table: each row's first cell names the promise, its last cell the tests that hold it."""
    promises = {}
    with open(path) as handle:
        for line in handle:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-", " "}:
                continue
            tests = TEST_NAME.findall(cells[-1])
            if tests:
                promises[cells[0]] = [(file, name or None) for file, name in tests]
    return promises


def _holds(nodeid: str, file: str, name: str | None) -> bool:
    test_file, _, rest = nodeid.partition("::")
    return test_file == file and (name is None or rest.split("[")[0] == name)


def estimated_wall_seconds(tests: list[dict], num_workers: int = 2) -> float:
    """Seconds on `num_workers` idle workers that take whole files, longest first, as
    `make test` hands them out (`--dist=loadfile`, files ordered by tests/conftest.py): the
    busiest worker's sum."""
    by_file = collections.Counter()
    for test in tests:
        by_file[test["nodeid"].partition("::")[0]] += test["seconds"]
    loads = [0.0] * num_workers
    for _, seconds in by_file.most_common():
        loads[loads.index(min(loads))] += seconds
    return max(loads)


def summarize(tests: list[dict], promises: dict, top: int = 10) -> dict:
    """The profile of `tests` (each with nodeid, worker, start, stop, seconds)."""
    by_file = collections.Counter()
    counts = collections.Counter()
    for test in tests:
        by_file[test["nodeid"].partition("::")[0]] += test["seconds"]
        counts[test["nodeid"].partition("::")[0]] += 1
    by_promise = {}
    for promise, named in promises.items():
        held = [t for t in tests if any(_holds(t["nodeid"], *n) for n in named)]
        by_promise[promise] = {
            "tests": len(held),
            "seconds": round(sum(t["seconds"] for t in held), 1),
        }
    workers = collections.defaultdict(list)
    for test in tests:
        workers[test["worker"]].append(test)
    ends = {worker: max(t["stop"] for t in held) for worker, held in workers.items()}
    start = min((t["start"] for t in tests), default=0.0)
    total = sum(t["seconds"] for t in tests)
    return {
        "tests": len(tests),
        "failed": sorted(t["nodeid"] for t in tests if t["outcome"] == "failed"),
        "worker_seconds": round(total, 1),
        "wall_seconds": round(max(ends.values(), default=start) - start, 1),
        "tail_seconds": round(max(ends.values(), default=0) - min(ends.values(), default=0), 1),
        "estimated_idle_wall_seconds": round(estimated_wall_seconds(tests), 1),
        "slowest": [
            {"nodeid": t["nodeid"], "seconds": round(t["seconds"], 1)}
            for t in sorted(tests, key=lambda t: -t["seconds"])[:top]
        ],
        "files": [
            {"file": file, "tests": counts[file], "seconds": round(seconds, 1)}
            for file, seconds in by_file.most_common()
        ],
        "promises": by_promise,
    }


def markdown(summary: dict, files: int = 25) -> str:
    """The summary as a page: totals, the slowest tests, the biggest files, each promise."""
    lines = [
        "# Test suite profile",
        "",
        f"- tests: {summary['tests']}, failed: {len(summary['failed'])}",
        f"- worker-seconds: {summary['worker_seconds']}",
        f"- wall seconds: {summary['wall_seconds']} (one worker idle for the last "
        f"{summary['tail_seconds']})",
        f"- estimated wall seconds on 2 idle workers, slowest files first: "
        f"{summary['estimated_idle_wall_seconds']}",
        "",
        "| slowest tests | s |",
        "|---|---|",
        *(f"| `{t['nodeid']}` | {t['seconds']} |" for t in summary["slowest"]),
        "",
        "| file | tests | s | share |",
        "|---|---|---|---|",
    ]
    total = summary["worker_seconds"] or 1
    for row in summary["files"][:files]:
        share = row["seconds"] / total
        lines.append(f"| `{row['file']}` | {row['tests']} | {row['seconds']} | {share:.1%} |")
    lines += ["", "| promise | tests | s |", "|---|---|---|"]
    for promise, held in summary["promises"].items():
        lines.append(f"| {promise} | {held['tests']} | {held['seconds']} |")
    return "\n".join(lines) + "\n"


def run_suite(pytest_args) -> tuple[int, list[dict]]:
    """Runs pytest with `pytest_args` from the repository root; (exit code, tests)."""
    import pytest

    recorder = TimingRecorder()
    os.chdir(REPO_ROOT)
    code = pytest.main(list(pytest_args), plugins=[recorder])
    return int(code), list(recorder.tests.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for profile.json and .md")
    parser.add_argument("--timings", help="a profile.json to summarize instead of running")
    parser.add_argument("--top", type=int, default=10, help="how many slowest tests to list")
    parser.add_argument("--file_seconds", help="a JSON file to write each test file's seconds")
    parser.add_argument("pytest_args", nargs="*", help=f"after --; default {PYTEST_ARGS}")
    args = parser.parse_args(argv)
    code = 0
    if args.timings:
        with open(args.timings) as handle:
            tests = json.load(handle)["all"]
    else:
        code, tests = run_suite(args.pytest_args or PYTEST_ARGS)
    summary = summarize(tests, read_promises(), top=args.top)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.json"), "w") as handle:
        json.dump({**summary, "all": tests}, handle, indent=1)
    with open(os.path.join(args.out, "profile.md"), "w") as handle:
        handle.write(markdown(summary))
    if args.file_seconds:
        with open(args.file_seconds, "w") as handle:
            json.dump({row["file"]: row["seconds"] for row in summary["files"]}, handle, indent=1)
            handle.write("\n")
    print(markdown(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
