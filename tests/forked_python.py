"""`python -c CODE` / `python -m MODULE ARGS` for the tests, each in a process of its own,
forked from a server that imported jax, numpy and jaxquant once (about a second of
import per run otherwise) before JAX touched a device, so that the code can still choose
its host devices (`jax.config.update("jax_num_cpu_devices", 8)`) or its environment.
Used by tests/test_docs.py (the docs' blocks) and tests/test_main.py (the command line).
On Linux; elsewhere each run is a plain subprocess (FORK below).

    with ForkedPython(env, cwd) as py:
        p = py.run(["-m", "jaxquant", "--help"], timeout=60)   # .returncode .stdout .stderr

The child runs as the interpreter would (__name__ == "__main__", a fresh namespace,
sys.argv as python sets it, the server's environment and working directory); its
stdout and stderr are files, its exit status the return code. Server protocol (stdin /
stdout, a JSON object per line): {"args": [...], "timeout": s} in, {"returncode",
"stdout", "stderr"} out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback


# Fork after the imports on Linux only: macOS's system frameworks (Metal, which
# jaxquant.metal loads there) are not safe to use in a forked child, and Windows has no
# fork; there each run is a plain subprocess.
FORK = hasattr(os, "fork") and sys.platform.startswith("linux")


class ForkedPython:
    def __init__(self, env: dict, cwd):
        self.env, self.cwd, self.proc = env, cwd, None
        if FORK:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.forked_python"],
                                         cwd=cwd, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def run(self, args, timeout=120) -> subprocess.CompletedProcess:
        if self.proc is None:
            try:
                return subprocess.run([sys.executable, *args], cwd=self.cwd, env=self.env,
                                      capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                return subprocess.CompletedProcess(args, -9, e.stdout or "",
                                                   f"(killed after {timeout} s)")
        self.proc.stdin.write(json.dumps({"args": list(args), "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return subprocess.CompletedProcess(args, r["returncode"], r["stdout"], r["stderr"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _child(args) -> int:
    import runpy

    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            raise ValueError(f"args must start with -c or -m: {args!r}")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the traceback is the child's stderr
        traceback.print_exc()
        return 1


def _run(args, timeout) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = _child(args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                rc = -9
                break
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        return {"returncode": rc, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace") +
                ("" if rc != -9 else f"\n(killed after {timeout} s)")}


def main():
    import jax  # noqa: F401 - imported once, before the forks
    import jax.numpy  # noqa: F401
    import numpy  # noqa: F401

    import jaxquant  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(_run(req["args"], req["timeout"])), flush=True)


if __name__ == "__main__":
    main()
