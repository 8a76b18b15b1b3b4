"""Benchmarks: `python -m jaxquant bench <scenario> [options]` (docs/measuring.md).

Each scenario is a module here with a `SCENARIO` dict: `help` (one line),
`add_arguments(parser, cpu)` (its options, with defaults sized for the platform:
realistic model shapes on a GPU, small ones on a CPU), `run(args, out)` (prints
its tables through `out`, returns (rows, copy bandwidth)), `xlabel` (the swept
size, for --plot) and optionally `env` (environment defaults it needs set before
JAX starts). Adding a scenario is one module and one entry in SCENARIOS.
The runtime `import jaxquant` does not import this package.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> module (imported when the command line is built).
SCENARIOS = {"qmm": "jaxquant.bench.qmm", "norm": "jaxquant.bench.norm",
             "moe": "jaxquant.bench.moe", "decode": "jaxquant.bench.decode",
             "prefill": "jaxquant.bench.prefill", "model": "jaxquant.bench.model"}


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """A command-line mistake: one line on stderr (and where to read more), exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser(cpu: bool | None = None) -> argparse.ArgumentParser:
    from jaxquant.bench import harness

    if cpu is None:
        cpu = harness.on_cpu()
    p = Parser(
        prog="python -m jaxquant bench",
        description="Time jaxquant's kernels against the jnp reference and dense products "
                    "in one process, on the same inputs. Tables go to stdout, one progress "
                    "line per case to stderr. Defaults are sized for this machine "
                    f"({'CPU: small shapes' if cpu else 'GPU: model-sized shapes'}).",
        epilog="'python -m jaxquant bench <scenario> --help' explains a scenario's options.")
    sub = p.add_subparsers(dest="scenario", required=True, metavar="scenario",
                           title="scenarios")
    for name, module in SCENARIOS.items():
        scenario = importlib.import_module(module).SCENARIO
        doc = importlib.import_module(module).__doc__
        q = sub.add_parser(name, help=scenario["help"], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        scenario["add_arguments"](q, cpu)
    return p


# Under every table on a CPU: how far to trust it, and the layout names the rows use.
CPU_NOTE = ("# On a CPU shared with other work, times vary 1.5-2x from run to run: compare "
            "rows of one run, and rerun before reading a gap under 2x. Layouts: canonical = "
            "the exchange layout every backend reads (docs/formats.md); prepacked = a kernel "
            "layout, the same bits permuted for one kernel (jq.prepack).")


def main(argv=None, out=print) -> int:
    from jaxquant.bench import harness

    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((a for a in argv if not a.startswith("-")), None)
    if name in SCENARIOS:  # before parser() starts JAX
        for key, value in importlib.import_module(SCENARIOS[name]).SCENARIO.get("env",
                                                                                {}).items():
            os.environ.setdefault(key, value)
    p = parser()
    args = p.parse_args(argv)
    harness.check_common(p, args)
    scenario = importlib.import_module(SCENARIOS[args.scenario]).SCENARIO
    recorder = harness.TableRecorder(out) if args.json_out else None
    rows, bw = scenario["run"](args, recorder or out)
    if recorder is not None:
        command = "python -m jaxquant bench " + " ".join(
            a for a in argv if not a.startswith("--json-out") and a != args.json_out)
        n = harness.write_json(args.json_out, recorder.records(args.scenario), command)
        harness.progress(f"{args.json_out}: {n} entries")
    if harness.on_cpu():
        out(CPU_NOTE)
    if args.plot:
        harness.plot(rows, bw, args.plot, scenario["xlabel"])
        harness.progress(f"plot written to {args.plot}")
    return 0
