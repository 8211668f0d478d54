"""`python -m workers.check SPEC [--code DIR]`: can the spec's task run as the spec asks?

Imports the task (DIR first on the path), builds it from task_config and checks the
hooks its strategy needs, without starting Ray. Exit 0 when it can, 2 with one line on
stderr when it cannot. The service runs it in a child process so that user code never
runs inside the service; workers.run runs `problem()` before any worker starts.
"""

from __future__ import annotations

import argparse
import sys

from workers.spec import JobSpec, load_spec

EXIT_OK, EXIT_REFUSED = 0, 2


class Refused(ValueError):
    """The spec's task cannot run as the spec asks; retrying would not help."""


def problem(spec: JobSpec, code: str | None = None) -> str | None:
    """Why the spec's task cannot run under its strategy, or None (built-in tasks: None)."""
    if not spec.task:
        return None
    from workers import tasks

    if code and code not in sys.path:
        sys.path.insert(0, code)
    try:
        task = tasks.load(spec)
    except tasks.TaskError as e:
        return str(e)
    except Exception as e:  # the user's factory raised: that is the user's to fix, named as such
        return f"task {spec.task!r}: building it from task_config raised {type(e).__name__}: {e}"
    return tasks.hook_error(spec, task)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.check", description=__doc__)
    parser.add_argument("spec", help="job spec file, YAML or JSON")
    parser.add_argument("--code", help="directory the task's module is imported from")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except (OSError, ValueError) as e:
        print(f"invalid spec {args.spec}: {e}", file=sys.stderr)
        return EXIT_REFUSED
    reason = problem(spec, args.code)
    if reason:
        print(reason, file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
