"""Where a decode step's (and a prefill's) time goes: `python -m jaxquant bench model
--profile`.

A few decode steps (or one prefill) run under
`jax.profiler.trace(create_perfetto_trace=True)`; the trace's device events (GPU
kernels on their streams; XLA CPU thunks on the CPU, where there is no device
timeline) of the traced program are matched by
their `hlo_op` to the compiled HLO (opcode, result bytes, custom-call target,
and the Python function that emitted it, from the HLO's stack frames) and put
in classes:

  copies      copy / dynamic-slice / transpose-only fusions and memcpy kernels:
              data moved, not computed (a layer's slice of a stacked weight is
              one: it means the layer loop copies weights)
  attention   ops emitted by the model's attention / RoPE code
  norms       RMSNorm kernels and ops
  qmm         jaxquant's quantized matmul kernels (custom calls, or the ops'
              reference lowering where no kernel runs)
  dense mm    cuBLAS / XLA dots and jaxquant's float-weight products (gather_matmul,
              ragged_matmul: the float GEMV and float experts): bf16 weights
  moe glue    router, top-k, activation, combine
  collectives all-reduce / all-gather / all-to-all ... (NCCL kernels) of a sharded run
  other       every other fusion (residual adds, embedding, head argmax, ...)

Per decode step (per prefill) it reports kernels (and per layer), time per class, the span
from the first kernel to the last, the time some kernel runs (union of the
intervals) and the gaps between (span - busy: launch and host gaps).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re

CLASSES = ("copies", "attention", "norms", "qmm", "dense mm", "moe glue", "collectives",
           "other")

# ops that move data without computing; a fusion of only these is a copy
_MOVES = {"copy", "dynamic-slice", "slice", "bitcast", "select", "transpose", "reshape",
          "broadcast", "concatenate", "copy-start", "copy-done"}
# ops that only run others (the CPU runtime times a while loop around its body's ops)
_CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
# collectives across the devices of a mesh (their -start / -done halves too)
_COLLECTIVES = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|"
                          r"collective-permute|collective-broadcast)(-start|-done)?$")
_XLA_TARGETS = ("__cublas", "__cudnn", "TopK", "Sharding", "SPMD", "__gpu$xla.gpu.ext")
# jaxquant's products of float weights (their kernels are named after the op)
_FLOAT_PRODUCTS = r"gather_matmul|ragged_matmul"
_ATTENTION_FUNCS = {"attention", "rope"}
_MOE_FUNCS = {"route", "moe_mlp", "expert_gather", "expert_ragged", "_expert_act",
              "_split_gate_up"}
# (not primitive.py: every jaxquant op's reference lowering may name Op.bind, norms too)
_QMM_FILES = ("jaxquant/ops/qmm.py", "jaxquant/ops/dequantize.py", "jaxquant/quantize.py",
              "jaxquant/formats.py", "jaxquant/pallas/", "jaxquant/quantized_array.py")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
             "s4": 1, "u4": 1, "f4e2m1fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8}


@dataclasses.dataclass(frozen=True)
class HloOp:
    """What the compiled HLO says about one instruction."""
    opcode: str
    nbytes: int                 # of its result
    target: str = ""            # custom_call_target
    kernel: str = ""            # a Triton (Pallas) call's kernel name
    function: str = ""          # the Python function that emitted it ("" unknown)
    file: str = ""


def _table(text, name, pattern):
    start = text.find(f"\n{name}\n")
    out = {}
    if start < 0:
        return out
    for line in text[start + len(name) + 2:].splitlines():
        m = re.match(pattern, line)
        if not m:
            break
        out[int(m.group(1))] = m.groups()[1:]
    return out


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]", shape):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        total += n * _ITEMSIZE.get(dtype, 4)
    return total


def hlo_index(text: str) -> dict[str, HloOp]:
    """instruction name -> HloOp, from a compiled module's text (`compiled.as_text()`)."""
    files = _table(text, "FileNames", r'(\d+) "(.*)"')
    funcs = _table(text, "FunctionNames", r'(\d+) "(.*)"')
    locs = _table(text, "FileLocations", r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+)")
    frames = _table(text, "StackFrames", r"(\d+) \{file_location_id=(\d+)")
    out = {}
    inst = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+) = (?P<shape>.+?) "
                      r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
    for line in text.splitlines():
        m = inst.match(line)
        if not m:
            continue
        rest = m.group("rest")
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        kernel = re.search(r'\bname\\?"?\s*[=:]\s*\\?"([^"\\]+)', rest) if target else None
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        function = file = ""
        if frame and int(frame.group(1)) in frames:
            loc = locs.get(int(frames[int(frame.group(1))][0]))
            if loc:
                file = files.get(int(loc[0]), ("",))[0]
                function = funcs.get(int(loc[1]), ("",))[0].replace(".<locals>", "")
        out[m.group("name")] = HloOp(m.group("op"), _shape_bytes(m.group("shape")),
                                     target.group(1) if target else "",
                                     kernel.group(1) if kernel else "", function, file)
    return out


def classify(kernel: str, op_name: str, op: HloOp | None) -> str:
    """The class (CLASSES) of a device event: its kernel's name, the HLO instruction it
    runs (`op_name`, "" where the trace names none) and what the HLO says of that."""
    names = f"{kernel} {op_name} {op.kernel if op else ''}".lower()
    if re.search(r"memcpy|memset", names):
        return "copies"
    # NCCL's kernels, and XLA's own all-reduce kernel: a fusion named after jax's psum
    if re.search(r"nccl|psum|all.reduce|all.gather|reduce.scatter|all.to.all", names) or (
            op is not None and _COLLECTIVES.match(op.opcode)):
        return "collectives"
    if op is None:  # a kernel the HLO does not name (e.g. inside a command buffer)
        if re.search(r"attention|flash|fmha", names):
            return "attention"
        if "norm" in names:
            return "norms"
        if re.search(_FLOAT_PRODUCTS, names):
            return "dense mm"
        if re.search(r"qmv|qmm|jaxquant", names):
            return "qmm"
        if re.search(r"gemm|gemv|cutlass|nvjet|xmma|cublas", names):
            return "dense mm"
        return "other"
    fn = op.function.split(".")[0]
    tokens = {p for p in re.split(r"[_.\s]", op_name or kernel) if p and not p.isdigit()}
    if op.opcode == "fusion":
        parts = tokens - {"fusion", "wrapped", "loop", "input", "computation"}
        if parts and parts <= _MOVES:
            return "copies"
    elif op.opcode in _MOVES:
        return "copies"
    if fn in _ATTENTION_FUNCS or re.search(r"attention|fmha|flash", names + op.target.lower()):
        return "attention"
    if re.search(_FLOAT_PRODUCTS, names):
        return "dense mm"
    if op.opcode == "custom-call" and re.search(r"qmm|qmv|gemv", names + op.target.lower()):
        return "qmm"  # a fused norm + GEMV kernel too: its time is the weight's read
    # a norm's ops are emitted inside Op.bind (the reference lowering): rsqrt tells them
    if "norm" in fn.lower() or "norm" in op.target.lower() or "norm" in names or \
            "rsqrt" in tokens:
        return "norms"
    if op.opcode == "custom-call" and not op.target.startswith(_XLA_TARGETS):
        return "qmm"
    if any(f in op.file for f in _QMM_FILES):
        return "qmm"
    if op.opcode == "dot" or op.target.startswith("__cublas") or re.search(
            r"gemm|cublas|nvjet|cutlass", names) or fn == "linear":
        return "dense mm"
    if fn in _MOE_FUNCS:
        return "moe glue"
    return "other"


@dataclasses.dataclass
class Event:
    name: str
    ts: float   # µs
    dur: float  # µs
    hlo_op: str


def trace_file(trace_dir: str) -> str:
    """The newest perfetto_trace.json.gz under trace_dir."""
    found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    return max(found, key=os.path.getmtime)


def trace_events(path: str) -> list[dict]:
    """Every event of a perfetto trace (.json.gz), as the trace's dicts."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def trace_names(events: list[dict]) -> tuple[dict, dict]:
    """The trace's process names by pid and thread names by (pid, tid)."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, threads


def device_events(path: str, module: str | None = None) -> tuple[list[Event], str]:
    """The device events of the perfetto trace at `path`: device_events_of its events."""
    return device_events_of(trace_events(path), module)


def device_events_of(events: list[dict], module: str | None = None
                     ) -> tuple[list[Event], str]:
    """The device events of a perfetto trace's events (GPU kernels and memcpys on their
    streams; without a device timeline, the XLA CPU ops), of `module` where events name
    theirs. Of a program on several GPUs (a mesh), the first GPU's only: its step is the
    mesh's, and the devices' kernels would overlap in one timeline.
    Returns (events sorted by start, "gpu" or "cpu")."""
    procs, threads = trace_names(events)
    devices = {pid: n for pid, n in procs.items() if n.startswith("/device:")}
    device_pids = {min(devices, key=lambda pid: _device_order(devices[pid]))} if devices else set()
    streams = {k for k, n in threads.items() if k[0] in device_pids
               and n.lower().startswith("stream")}
    # the trace's summary lines of a device repeat its kernels: never counted
    summaries = {k for k, n in threads.items() if re.search(r"XLA|Steps|Modules|Ops", n)}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if device_pids:
        kind = "gpu"
        lines = streams or {k for k in threads if k[0] in device_pids} - summaries
        keep = [e for e in spans if (e["pid"], e["tid"]) in lines]
    else:
        kind = "cpu"
        keep = [e for e in spans if "hlo_op" in e.get("args", {})]
    if module is not None and any("hlo_module" in e.get("args", {}) for e in keep):
        keep = [e for e in keep
                if e.get("args", {}).get("hlo_module", module).startswith(module)]
    out = [Event(e["name"], float(e["ts"]), float(e["dur"]), e.get("args", {}).get("hlo_op", ""))
           for e in keep]
    return sorted(out, key=lambda e: e.ts), kind


def _device_order(name: str):
    """'/device:GPU:10 ...' -> ('/device:GPU:', 10): GPU 0 first, 10 after 9."""
    m = re.match(r"(/device:[A-Za-z_]+:)(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


@dataclasses.dataclass
class Breakdown:
    steps: int
    layers: int
    kind: str
    kernels: float                  # per step
    span_us: float                  # per step: first kernel start to last kernel end
    busy_us: float                  # per step: union of the kernels' intervals
    gaps: float                     # per step: idle intervals between kernels
    by_class: dict                  # class -> (kernels per step, µs per step)
    top: list                       # (class, name, calls per step, µs per step), longest first
    copy_bytes: float               # per step, of the copies the HLO names
    copies: list                    # (name, calls per step, bytes each), largest first

    @property
    def gap_us(self) -> float:
        return self.span_us - self.busy_us


def _base_name(name: str) -> str:
    name = re.sub(r"\.\d+$", "", name)
    return name if len(name) <= 70 else name[:67] + "..."


def breakdown(events: list[Event], index: dict[str, HloOp], steps: int, layers: int,
              kind: str) -> Breakdown:
    """Per decode step numbers from the device events of `steps` decode steps."""
    events = [e for e in events if e.hlo_op not in index
              or index[e.hlo_op].opcode not in _CONTAINERS]
    if not events:
        raise ValueError("the trace has no device events of the decode program")
    busy, n_busy, end = 0.0, 0, None
    for e in events:  # union of intervals (events sorted by start)
        if end is None or e.ts > end:
            busy += e.dur
            n_busy += 1
            end = e.ts + e.dur
        elif e.ts + e.dur > end:
            busy += e.ts + e.dur - end
            end = e.ts + e.dur
    span = max(e.ts + e.dur for e in events) - events[0].ts
    by_class = {c: [0, 0.0] for c in CLASSES}
    top = collections.defaultdict(lambda: [0, 0.0])
    copies = collections.defaultdict(lambda: [0, 0])
    copy_bytes = 0
    # a GPU kernel of an XLA fusion is named after the instruction, "." and "-" as "_"
    by_kernel = {re.sub(r"[.\-]", "_", name): op for name, op in index.items()}
    for e in events:
        op = index.get(e.hlo_op) or index.get(e.name) or by_kernel.get(e.name)
        cls = classify(e.name, e.hlo_op, op)
        by_class[cls][0] += 1
        by_class[cls][1] += e.dur
        t = top[(cls, _base_name(e.name))]
        t[0] += 1
        t[1] += e.dur
        if cls == "copies":
            nbytes = op.nbytes if op is not None else 0
            copy_bytes += nbytes
            c = copies[(_base_name(e.hlo_op or e.name), nbytes)]
            c[0] += 1
    per = 1.0 / steps
    return Breakdown(
        steps, layers, kind, len(events) * per, span * per, busy * per, (n_busy - 1) * per,
        {c: (n * per, us * per) for c, (n, us) in by_class.items()},
        sorted(((c, name, n * per, us * per) for (c, name), (n, us) in top.items()),
               key=lambda r: -r[3]),
        copy_bytes * per,
        sorted(((name, n * per, b) for (name, b), (n, _) in copies.items()),
               key=lambda r: -r[1] * r[2]))


def print_breakdown(b: Breakdown, out, title: str, top: int = 12,
                    what: str = "decode steps") -> None:
    """The breakdown as text; `what` the traced program's runs ("decode steps", or
    "prefill": numbers per prefill)."""
    unit = "kernels" if b.kind == "gpu" else "XLA CPU ops"
    per = "step" if what == "decode steps" else what
    out("")
    out(f"# profile: {title}: {b.steps} {what} traced; per {per}: {b.kernels:.0f} {unit} "
        f"({b.kernels / b.layers:.1f} per layer), span {b.span_us / 1e3:.3f} ms, busy "
        f"{b.busy_us / 1e3:.3f} ms, gaps {b.gap_us / 1e3:.3f} ms over {b.gaps:.0f} idle "
        f"intervals ({b.gap_us / max(b.gaps, 1):.1f} µs each)")
    if b.kind == "cpu":
        out("# (CPU: ops of several threads overlap; busy is the time any op runs)")
    out("")
    out(f"| class | per {per} | per layer | ms/{per} | % of op time |")
    out("|---|---:|---:|---:|---:|")
    total = sum(us for _, us in b.by_class.values()) or 1.0
    for cls in CLASSES:
        n, us = b.by_class[cls]
        if n:
            out(f"| {cls} | {n:.1f} | {n / b.layers:.2f} | {us / 1e3:.3f} | "
                f"{100 * us / total:.1f}% |")
    out("")
    out(f"| op / kernel | class | per {per} | µs/{per} | µs each |")
    out("|---|---|---:|---:|---:|")
    for cls, name, n, us in b.top[:top]:
        out(f"| {name} | {cls} | {n:.1f} | {us:.1f} | {us / n:.2f} |")
    n_copy = b.by_class["copies"][0]
    if n_copy:
        biggest = ", ".join(f"{name} ({nb / 1e6:.3g} MB x {n:.3g})"
                            for name, n, nb in b.copies[:4])
        out(f"# COPIES: {n_copy:.1f} per {per} moving {b.copy_bytes / 1e6:.2f} MB "
            f"(by the HLO's result shapes): {biggest}")
    else:
        out("# copies: none")

