"""``python -m exec_program CODE``: ``python -c CODE`` as a module, so that a launch can fork its ranks from
an interpreter that imported torch once (``LaunchConfig(preload=...)`` forks ``-m MODULE`` commands only).
Run from ``tests/`` (the launch's ``cwd``)."""

import sys

if __name__ == "__main__":
    code = sys.argv[1]
    sys.argv = ["-c", *sys.argv[2:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
