"""Checkpoint files are untrusted input (docs/checkpoints.md, "Validation"): every
broken or hostile file gives one `jq.io.CheckpointError` (a ValueError) whose message
names the file, never another exception, a hang or unbounded memory.

- one regression test per hostile case found by hand (GGUF counts, offsets, alignment,
  overlap, relabelled types, missing keys, truncation; safetensors header lengths,
  truncation, duplicate names, the index; config.json syntax, types, ranges and
  agreement with the tensors; GPTQ g_idx, compressed-tensors patterns; 0 heads / 0
  groups) and the command line's one-line error;
- seeded fuzzing: valid tiny files of each kind corrupted at random offsets and values
  (bytes flipped, truncated, lengths inflated, JSON fields changed or retyped): each
  load either raises CheckpointError naming the file or loads what an independent
  reader (the `safetensors` / `gguf` packages, numpy) reads, within a time bound per
  case; the binary readers run in a child process under an address-space limit.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.io import CheckpointError
from jaxquant.io.gguf import GGML_TYPES
from jaxquant.io.gguf_file import GGUFReader
from jaxquant.io.safetensors import SafetensorsFile
from jaxquant.models import checkpoint
from jaxquant.models.config import from_hf
from tests.test_models import (GPT_OSS, LLAMA, MIXTRAL, _dense_mlps, _gpt_oss_tensors,
                               _hf_common, _mixtral_tensors, _write)

pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ_CASES = 60          # per kind; each a few milliseconds
CASE_SECONDS = 2.0       # the most one corrupted load may take


def names_file(err: BaseException, path) -> bool:
    return os.fspath(path) in str(err)


def raises_naming(path, fn, *args, **kw):
    """fn(*args, **kw) must raise CheckpointError naming `path`; returns the message."""
    with pytest.raises(CheckpointError) as e:
        fn(*args, **kw)
    assert names_file(e.value, path), str(e.value)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------
# Tiny valid checkpoints.


def llama_dir(path, shards=2, **config):
    rng = np.random.default_rng(7)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    _write(path, dict(LLAMA, **config), t, shards=shards)
    return t


def gguf_file(path, layers=2):
    """A tiny llama GGUF (test_gguf's writer: gguf.GGUFWriter, Q4_0 / Q8_0 / F32)."""
    tg = pytest.importorskip("tests.test_gguf")
    cfg = tg.tiny("llama", num_layers=layers)
    tg.write_model(path, "llama", cfg, {})
    return cfg


def write_gguf(path, fields: list, tensors: list, alignment=32, version=3, counts=None,
               data_size=None):
    """A GGUF file written by hand (so that hostile values can be written): fields as
    (key, type, raw value bytes), tensors as (name, dims, type number, offset); the data
    section holds data_size bytes (default: up to the end of the last F32 tensor)."""
    n_t, n_f = counts or (len(tensors), len(fields))
    out = b"GGUF" + struct.pack("<IQQ", version, n_t, n_f)
    for key, vtype, raw in fields:
        out += gstr(key) + struct.pack("<I", vtype) + raw
    for name, dims, ttype, offset in tensors:
        out += gstr(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset)
    out += b"\0" * (-len(out) % alignment)
    if data_size is None:
        data_size = max([o + 4 * math.prod(d) for _, d, _, o in tensors] or [0])
    with open(path, "wb") as f:
        f.write(out + (bytes(range(256)) * (data_size // 256 + 1))[:data_size])


def u32(v):
    return struct.pack("<I", v)


def gstr(x):
    return struct.pack("<Q", len(x)) + x.encode()


# ---------------------------------------------------------------------------
# GGUF: the hostile cases.


def test_gguf_reader_reads_what_gguf_py_reads(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    gguf_file(path)
    ours, ref = GGUFReader(path, GGML_TYPES), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert list(a.shape) == list(b.shape) and a.tensor_type == int(b.tensor_type)
        assert np.array_equal(a.data, np.ascontiguousarray(b.data).view(np.uint8).reshape(-1))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            got, want = ours.fields[key], field.contents()
            assert (np.array_equal(got, want) if isinstance(got, np.ndarray) else got == want)


@pytest.mark.parametrize("case", ["array_count", "tensor_count", "field_count", "string_len",
                                  "dims_huge", "n_dims", "unknown_type", "value_type"])
def test_gguf_counts_and_lengths_bounded_by_the_file(tmp_path, case):
    """Counts of 2**32 - 1 and 2**40 and lengths of 2**60 fail at once (before any
    allocation): each needs more bytes than the file has."""
    path = tmp_path / "h.gguf"
    arch = ("general.architecture", 8, gstr("llama"))
    ok_t = [("t", [32], 0, 0)]
    if case == "array_count":  # an array of uint32 with 2**40 elements
        write_gguf(path, [arch, ("a", 9, u32(4) + struct.pack("<Q", 1 << 40))], ok_t)
    elif case == "tensor_count":
        write_gguf(path, [arch], ok_t, counts=(2 ** 32 - 1, 1))
    elif case == "field_count":
        write_gguf(path, [arch], ok_t, counts=(1, 2 ** 40))
    elif case == "string_len":
        write_gguf(path, [("general.architecture", 8, struct.pack("<Q", 1 << 60) + b"x")], ok_t)
    elif case == "dims_huge":
        write_gguf(path, [arch], [("t", [32, 2 ** 40], 0, 0)], data_size=128)
    elif case == "n_dims":
        write_gguf(path, [arch], [("t", [1] * 9, 0, 0)])
    elif case == "unknown_type":
        write_gguf(path, [arch], [("t", [32], 77, 0)])
    else:
        write_gguf(path, [arch, ("v", 13, b"\0" * 8)], ok_t)
    t0 = time.perf_counter()
    raises_naming(path, GGUFReader, path, GGML_TYPES)
    assert time.perf_counter() - t0 < CASE_SECONDS


@pytest.mark.parametrize("case,match", [
    ("past_end", "past the end"), ("wraps", "past the end"), ("misaligned", "alignment"),
    ("overlap", "overlap"), ("relabelled", "overlap"), ("truncated", "past the end")])
def test_gguf_tensor_offsets_checked(tmp_path, case, match):
    """Offsets that run past the data (or wrap round 2**64), misaligned offsets,
    overlapping tensors and a type relabelled so a tensor would read into the next one
    are refused; before, each loaded garbage silently."""
    path = tmp_path / "o.gguf"
    arch = [("general.architecture", 8, gstr("llama"))]
    a = ("a", [64], 0, 0)  # F32 [64]: 256 bytes
    if case == "past_end":
        write_gguf(path, arch, [a, ("b", [64], 0, 512)], data_size=600)
    elif case == "wraps":
        write_gguf(path, arch, [a, ("b", [64], 0, 2 ** 64 - 64)], data_size=512)
    elif case == "misaligned":
        write_gguf(path, arch, [a, ("b", [64], 0, 260)])
    elif case == "overlap":
        write_gguf(path, arch, [a, ("b", [64], 0, 128)])
    elif case == "relabelled":  # 128 bytes of F16 relabelled F32: a would read into b
        write_gguf(path, arch, [("a", [64], 0, 0), ("b", [32], 0, 128)], data_size=256)
    else:
        write_gguf(path, arch, [a, ("b", [64], 0, 256)])
        os.truncate(path, os.path.getsize(path) - 10)
    assert match in raises_naming(path, GGUFReader, path, GGML_TYPES)


def patch_gguf(path, key, value: bytes | None = None, vtype=None, rename=None):
    """Edit one metadata entry of a GGUF file in place (same-size values): its value
    bytes, its type number, or its name (to remove it, as far as a reader can tell)."""
    raw = bytearray(open(path, "rb").read())
    k = key.encode()
    at = raw.index(struct.pack("<Q", len(k)) + k) + 8
    if rename is not None:
        assert len(rename) == len(key)
        raw[at:at + len(k)] = rename.encode()
    at += len(k)
    if vtype is not None:
        raw[at:at + 4] = struct.pack("<I", vtype)
    if value is not None:
        raw[at + 4:at + 4 + len(value)] = value
    open(path, "wb").write(bytes(raw))


def _llama_gguf(tmp_path, name="m.gguf"):
    path = tmp_path / name
    gguf_file(path)
    return path


def test_gguf_block_count_must_match_the_tensors(tmp_path):
    for n, why in ((1, "extra layers"), (3, "missing layers"), (2 ** 32 - 1, "block_count")):
        path = _llama_gguf(tmp_path, f"b{n}.gguf")
        patch_gguf(path, "llama.block_count", u32(n))
        t0 = time.perf_counter()
        assert why in raises_naming(path, checkpoint.load, path)
        assert time.perf_counter() - t0 < CASE_SECONDS


def test_gguf_missing_and_mistyped_keys(tmp_path):
    cases = [(dict(rename="llama.attention.head_counX"), "head_count"),
             (dict(value=struct.pack("<f", 0.0)), "freq_base"),
             (dict(value=struct.pack("<f", float("nan"))), "freq_base"),
             (dict(vtype=6), "embedding_length"),       # uint32 -> float32: no integer
             (dict(value=u32(0)), "head_count"),        # 0 heads: no ZeroDivisionError
             (dict(value=u32(128)), "shape")]           # hidden 128 over 64-wide tensors
    keys = ["llama.attention.head_count", "llama.rope.freq_base", "llama.rope.freq_base",
            "llama.embedding_length", "llama.attention.head_count", "llama.embedding_length"]
    for i, ((edit, why), key) in enumerate(zip(cases, keys)):
        path = _llama_gguf(tmp_path, f"k{i}.gguf")
        patch_gguf(path, key, **edit)
        assert why in raises_naming(path, checkpoint.load, path)


# ---------------------------------------------------------------------------
# safetensors and the index.


def test_safetensors_header_length_truncation_and_duplicates(tmp_path):
    t = llama_dir(tmp_path, shards=1)
    file = tmp_path / "model-00001-of-00001.safetensors"
    good = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 1 << 60) + good[8:])
    assert "header length" in raises_naming(file, checkpoint.load, tmp_path)
    file.write_bytes(good[:len(good) - 100])
    raises_naming(file, checkpoint.load, tmp_path)
    file.write_bytes(good)
    dup = tmp_path / "extra.safetensors"
    jq.io.save_safetensors(dup, {"model.norm.weight": t["model.norm.weight"]})
    msg = raises_naming(file, checkpoint.load, tmp_path)
    assert os.fspath(dup) in msg and "model.norm.weight" in msg


def test_safetensors_reader_refuses_bad_offsets_and_overlap(tmp_path):
    def file_with(header: dict, data: bytes):
        h = json.dumps(header).encode()
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(h)) + h + data)
        return path
    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for header, match in (
            ({"a": a, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "overlap"),
            ({"a": dict(a, data_offsets=[0, 16])}, "data_offsets"),
            ({"a": dict(a, shape=[3])}, "needs 12"),
            ({"a": dict(a, dtype="F99")}, "dtype"),
            ({"a": dict(a, shape=[-1])}, "shape"),
            ({"a": dict(a, data_offsets=[8, 0])}, "data_offsets"),
            ([1, 2], "object")):
        path = file_with(header, bytes(16))
        assert match in raises_naming(path, SafetensorsFile, path)


def test_index_entries_inside_the_directory(tmp_path):
    llama_dir(tmp_path)
    index = tmp_path / checkpoint.INDEX
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    wmap = {}
    for f in files:
        wmap.update({n: f for n in SafetensorsFile(tmp_path / f).names()})
    index.write_text(json.dumps({"weight_map": wmap}))
    checkpoint.load(tmp_path, layout="canonical")  # a consistent index loads
    name = "model.norm.weight"
    for bad in ("../" + wmap[name], "/etc/passwd", files[0] if wmap[name] != files[0] else files[1]):
        index.write_text(json.dumps({"weight_map": dict(wmap, **{name: bad})}))
        raises_naming(index, checkpoint.load, tmp_path)
    index.write_text('{"weight_map": ')
    assert "JSON" in raises_naming(index, checkpoint.load, tmp_path)


# ---------------------------------------------------------------------------
# config.json against its own rules and the tensors.


@pytest.mark.parametrize("edit,match", [
    ({"num_hidden_layers": 1}, "extra layers"),
    ({"num_hidden_layers": 2 ** 33}, "num_hidden_layers"),
    ({"num_hidden_layers": 2 ** 33, "model_type": "mistral", "sliding_window": 4},
     "num_hidden_layers"),
    ({"num_hidden_layers": 3}, "missing layers"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"tie_word_embeddings": True}, "lm_head"),
    ({"rope_theta": 0}, "rope_theta"), ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_theta": float("nan")}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"hidden_size": 128}, "shape"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 3, "head_dim": None}, "divide"),
    ({"vocab_size": "64"}, "vocab_size"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"quantization_config": [1]}, "quantization_config"),
])
def test_config_refusals(tmp_path, edit, match):
    llama_dir(tmp_path, **edit)
    t0 = time.perf_counter()
    msg = raises_naming(tmp_path, checkpoint.load, tmp_path, layout="canonical")
    assert match in msg, msg
    assert time.perf_counter() - t0 < 30


def test_tied_checkpoint_with_a_stored_copy_of_the_embedding_loads(tmp_path):
    """A tied model whose exporter also wrote lm_head.weight (equal to the embedding)
    loads as transformers loads it; a head that differs stays refused (above)."""
    rng = np.random.default_rng(3)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    _write(tmp_path / "copy", dict(LLAMA, tie_word_embeddings=True), t)
    del t["lm_head.weight"]
    _write(tmp_path / "plain", dict(LLAMA, tie_word_embeddings=True), t)
    cfg_a, a = checkpoint.load(tmp_path / "copy", layout="canonical")
    cfg_b, b = checkpoint.load(tmp_path / "plain", layout="canonical")
    assert cfg_a.tie_embeddings and "lm_head" not in a
    np.testing.assert_array_equal(np.asarray(a["embed"]), np.asarray(b["embed"]))


def test_config_json_cut_short_names_the_file(tmp_path):
    llama_dir(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text()[:40])
    assert "JSON" in raises_naming(cfg, checkpoint.load, tmp_path)


def test_float_weight_stored_as_int_is_refused(tmp_path):
    rng = np.random.default_rng(7)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    t["model.layers.1.mlp.up_proj.weight"] = np.zeros((128, 64), np.int32)
    _write(tmp_path, LLAMA, t)
    msg = raises_naming(tmp_path, checkpoint.load, tmp_path)
    assert "up_proj" in msg and "int32" in msg


def test_gpt_oss_checkpoint_still_loads_and_refuses_a_relabelled_expert(tmp_path):
    rng = np.random.default_rng(1)
    t = _gpt_oss_tensors(rng)
    _write(tmp_path, GPT_OSS, t)
    checkpoint.load(tmp_path, layout="canonical")
    t["model.layers.0.mlp.experts.down_proj_scales"] = t[
        "model.layers.0.mlp.experts.down_proj_scales"].astype(np.int16)
    _write(tmp_path, GPT_OSS, t)
    assert "down_proj" in raises_naming(tmp_path, checkpoint.load, tmp_path)


# ---------------------------------------------------------------------------
# Importer arguments.


def test_gptq_g_idx_range_checked_before_bincount():
    bits, k, n, groups = 4, 128, 8, 4
    qweight = np.zeros((k * bits // 32, n), np.int32)
    qzeros = np.zeros((groups, n * bits // 32), np.int32)
    scales = np.ones((groups, n), np.float16)
    g_idx = (np.arange(k) // 32).astype(np.int32)
    g_idx[5] = 2 ** 31 - 1   # np.bincount would ask for 16 GiB
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="g_idx"):
        jq.io.from_gptq(qweight, qzeros, scales, g_idx, bits=bits)
    assert time.perf_counter() - t0 < 1
    with pytest.raises(ValueError, match="groups"):  # 0 groups: no ZeroDivisionError
        jq.io.from_gptq(qweight, np.zeros((0, 1), np.int32), np.ones((0, n), np.float16),
                        bits=bits)
    with pytest.raises(ValueError):
        jq.io.from_awq(np.zeros((k, 1), np.int32), np.zeros((0, 1), np.int32),
                       np.ones((0, 8), np.float16))


@pytest.mark.parametrize("pattern", ["re:(.*.*)*X", "re:(a+)+$", "re:(x|xy)*z",
                                     "re:.*.*.*.*X", "re:" + "a" * 2000])
def test_compressed_tensors_patterns_in_bounded_time(pattern):
    config = {"config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": {"num_bits": 4}}}, "ignore": [pattern]}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="pattern"):
        jq.io.from_compressed_tensors({}, "model.layers.0." + "a" * 60, config)
    assert time.perf_counter() - t0 < 1


def test_compressed_tensors_usual_patterns_still_match():
    from jaxquant.io.hf import compressed_tensors_scheme
    config = {"config_groups": {"g": {"targets": ["re:.*self_attn\\.(q|k|v)_proj$"],
                                      "format": "pack-quantized", "weights": {}}},
              "ignore": ["re:.*lm_head", "re:model\\.layers\\.\\d+\\.mlp\\.gate$"]}
    assert compressed_tensors_scheme(config, "model.layers.3.self_attn.k_proj") is not None
    assert compressed_tensors_scheme(config, "model.layers.3.mlp.gate") is None
    assert compressed_tensors_scheme(config, "lm_head") is None


# ---------------------------------------------------------------------------
# The command line: one line.


@pytest.mark.parametrize("command", ["eval", "demo", "generate"])
def test_cli_error_is_one_line(tmp_path, command):
    llama_dir(tmp_path, rope_theta=-1.0)
    (tmp_path / "text.txt").write_text("hello " * 50)
    args = {"eval": ["eval", "--checkpoint", str(tmp_path), "--text", str(tmp_path / "text.txt"),
                     "--context", "8", "--modes", "affine8"],
            "demo": ["demo", "--checkpoint", str(tmp_path), "--modes", "bf16", "--tokens", "2"],
            "generate": ["generate", "--checkpoint", str(tmp_path), "--prompt", "hello hello",
                         "--max-tokens", "2"]}
    if command in ("eval", "generate"):
        pytest.importorskip("tokenizers")
        from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
        tok = Tokenizer(tok_models.WordLevel({"hello": 1, "[UNK]": 0}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tokenizer.json"))
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "jaxquant", *args[command]], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith("error: ") and os.fspath(tmp_path) in lines[0] and \
        "rope_theta" in lines[0]


# ---------------------------------------------------------------------------
# Fuzzing.


def _corrupt(rng, raw: bytes):
    """One random corruption of a file's bytes: (description, new bytes)."""
    b = bytearray(raw)
    kind = rng.integers(0, 5)
    if kind == 0:                                     # flip a few bytes anywhere
        for at in rng.integers(0, len(b), rng.integers(1, 4)):
            b[at] ^= int(rng.integers(1, 256))
        return "flip", bytes(b)
    if kind == 1:                                     # truncate
        return "truncate", bytes(b[:int(rng.integers(0, len(b)))])
    if kind == 2:                                     # inflate an 8-byte length / count / offset
        at = int(rng.integers(0, len(b) - 8))
        values = [2 ** 32 - 1, 2 ** 40, 2 ** 60, 2 ** 64 - 1, int(rng.integers(0, 2 ** 20))]
        b[at:at + 8] = struct.pack("<Q", values[int(rng.integers(0, len(values)))])
        return "inflate", bytes(b)
    if kind == 3:                                     # a 4-byte field (a type, a count)
        at = int(rng.integers(0, len(b) - 4))
        b[at:at + 4] = struct.pack("<I", int(rng.integers(0, 2 ** 32)))
        return "word", bytes(b)
    return "append", bytes(b) + bytes(rng.integers(0, 256, int(rng.integers(1, 64)), np.uint8))


FUZZ_CHILD = textwrap.dedent("""
    import json, os, resource, sys, time
    import numpy as np
    from jaxquant.io import CheckpointError
    from jaxquant.io.gguf import GGML_TYPES
    from jaxquant.io.gguf_file import GGUFReader
    from jaxquant.io.safetensors import SafetensorsFile
    kind, paths, bound = sys.argv[1], sys.argv[2:], 1 << 30
    vm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize")][0])
    resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + bound, vm * 1024 + bound))
    out = []
    for path in paths:
        t0 = time.perf_counter()
        try:
            if kind == "gguf":
                r = GGUFReader(path, GGML_TYPES)
                got = {t.name: [list(map(int, t.shape)), int(t.tensor_type),
                                bytes(t.data).hex()] for t in r.tensors}
                fields = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                          for k, v in r.fields.items()}
            else:
                f = SafetensorsFile(path)
                got = {n: [list(f.shape(n)), str(f.dtype(n)), f.get(n).tobytes().hex()]
                       for n in f.names()}
                fields = None
            res = ["ok", got, fields]
        except CheckpointError as e:
            res = ["error", str(e), path in str(e)]
        except BaseException as e:
            res = ["other", f"{type(e).__name__}: {e}"[:300], False]
        out.append(res + [time.perf_counter() - t0])
    print(json.dumps(out, default=str))
""")


def _fuzz_files(tmp_path, src: bytes, ext: str, seed: int):
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(FUZZ_CASES):
        what, raw = _corrupt(rng, src)
        path = tmp_path / f"case{i}.{ext}"
        path.write_bytes(raw)
        cases.append((what, path))
    return cases


def _run_child(kind, paths):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", FUZZ_CHILD, kind, *map(str, paths)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_fuzz_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    src = tmp_path / "src.gguf"
    gguf_file(src)
    cases = _fuzz_files(tmp_path, src.read_bytes(), "gguf", seed=48)
    results = _run_child("gguf", [p for _, p in cases])
    loaded = 0
    for (what, path), (status, got, detail, seconds) in zip(cases, results):
        assert status in ("ok", "error"), (what, got)
        assert seconds < CASE_SECONDS, (what, seconds)
        if status == "error":
            assert detail, got  # the message names the file
            continue
        loaded += 1
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        for name, (dims, ttype, data) in got.items():  # whole tensors, sized by gguf's table
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            assert len(data) // 2 == math.prod(dims) // block * nbytes, (what, name)
        try:  # what loads must be what gguf-py reads, where gguf-py reads it
            ref = gguf.GGUFReader(str(path))
        except Exception:  # noqa: BLE001 (gguf-py's own failures are not under test)
            continue
        for t in ref.tensors:
            want = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).tobytes().hex()
            assert got[t.name][2] == want, (what, t.name)
    assert loaded < len(cases)  # the corruptions do reach the checks


def test_fuzz_safetensors(tmp_path):
    import safetensors.numpy as stn
    t = llama_dir(tmp_path / "ck", shards=1)
    src = (tmp_path / "ck" / "model-00001-of-00001.safetensors").read_bytes()
    cases = _fuzz_files(tmp_path, src, "safetensors", seed=49)
    results = _run_child("safetensors", [p for _, p in cases])
    for (what, path), (status, got, detail, seconds) in zip(cases, results):
        assert status in ("ok", "error"), (what, got)
        assert seconds < CASE_SECONDS, (what, seconds)
        if status == "error":
            assert detail, got
            continue
        try:  # the safetensors package as the oracle of a file both accept
            ref = stn.load_file(str(path))
        except Exception:  # noqa: BLE001
            continue
        assert set(got) == set(ref), what
        for name, a in ref.items():
            assert got[name][2] == np.ascontiguousarray(a).tobytes().hex(), (what, name)
    # the data section only: each tensor either unchanged or the flipped bytes read back
    n = int.from_bytes(src[:8], "little")
    raw = bytearray(src)
    raw[8 + n + 10] ^= 0xFF
    path = tmp_path / "values.safetensors"
    path.write_bytes(bytes(raw))
    got = jq.io.load_safetensors(path)
    changed = [k for k in t if not np.array_equal(got[k].view(np.uint8), t[k].view(np.uint8))]
    assert len(changed) == 1


def _mutate_json(rng, doc: dict):
    """One random change of a config.json dict: a field dropped, retyped or set to a
    hostile value."""
    doc = json.loads(json.dumps(doc))
    key = str(rng.choice(sorted(doc)))
    kind = rng.integers(0, 4)
    hostile = [0, -1, 2 ** 33, 2 ** 63, 1.5, float("nan"), float("inf"), "7", "false", None,
               [], {}, [1, 2], True, False, ""]
    if kind == 0:
        doc.pop(key)
    elif kind == 1:
        doc[key] = hostile[int(rng.integers(0, len(hostile)))]
    elif kind == 2 and isinstance(doc[key], dict) and doc[key]:
        sub = str(rng.choice(sorted(doc[key])))
        doc[key][sub] = hostile[int(rng.integers(0, len(hostile)))]
    else:
        doc[str(rng.choice(["rope_scaling", "rope_parameters", "layer_types", "quantization",
                            "head_dim", "num_key_value_heads"]))] = hostile[
            int(rng.integers(0, len(hostile)))]
    return doc


@pytest.mark.parametrize("base", ["llama", "gpt_oss", "mixtral", "gptq", "awq",
                                  "compressed-tensors", "mlx"])
def test_fuzz_config_fields(base):
    """config.json (and its quantization configs) with fields dropped, retyped or set to
    hostile values: from_hf and the quantizer's reading of them raise ValueError or
    give a Config, nothing else, in bounded time."""
    quant = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
             "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                     "zero_point": True},
             "compressed-tensors": {"quant_method": "compressed-tensors", "format":
                                    "pack-quantized", "config_groups": {"g": {
                                        "targets": ["Linear"], "weights": {
                                            "num_bits": 4, "strategy": "group",
                                            "group_size": 32}}}, "ignore": ["lm_head"]}}
    doc = dict({"gpt_oss": GPT_OSS, "mixtral": MIXTRAL}.get(base, LLAMA))
    if base in quant:
        doc["quantization_config"] = quant[base]
    if base == "mlx":
        doc["quantization"] = {"bits": 4, "group_size": 64}
    rng = np.random.default_rng(50)
    for _ in range(200):
        bad = _mutate_json(rng, doc)
        if rng.integers(0, 2) and isinstance(bad.get("quantization_config"), dict):
            bad["quantization_config"] = _mutate_json(rng, bad["quantization_config"])
        t0 = time.perf_counter()
        try:
            from_hf(bad)
            qc = bad.get("quantization_config")
            if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
                jq.io.from_compressed_tensors({}, "model.layers.0.self_attn.q_proj", qc)
        except ValueError:
            pass
        assert time.perf_counter() - t0 < CASE_SECONDS, bad


def _with_index(path):
    wmap = {}
    for f in sorted(path.glob("*.safetensors")):
        wmap.update({n: f.name for n in SafetensorsFile(f).names()})
    (path / checkpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


@pytest.mark.parametrize("family", ["llama", "gpt_oss",
                                    pytest.param("mixtral", marks=pytest.mark.full)])
def test_fuzz_checkpoint_loads(tmp_path, family):
    """Whole loads of corrupted sharded checkpoints with an index (config fields, index
    entries and safetensors bytes; gpt-oss with its MXFP4 experts): a CheckpointError
    naming a file of the checkpoint, or a load of the original's structure, shapes and
    dtypes (only values could have changed)."""
    src = tmp_path / "src"
    if family == "llama":
        llama_dir(src, shards=2)
    elif family == "mixtral":
        _write(src, MIXTRAL, _mixtral_tensors(np.random.default_rng(1)))
    else:
        _write(src, GPT_OSS, _gpt_oss_tensors(np.random.default_rng(1)))
    _with_index(src)
    _, want = checkpoint.load(src, layout="canonical", per_layer=True)
    rng = np.random.default_rng(51)
    files = sorted(p.name for p in src.iterdir())
    outcomes = {"ok": 0, "error": 0}
    for i in range(16):
        case = tmp_path / f"c{i}"
        case.mkdir()
        for f in files:
            (case / f).write_bytes((src / f).read_bytes())
        target = files[int(rng.integers(0, len(files)))]
        if target.endswith(".json"):
            doc = json.loads((src / target).read_text())
            if target == checkpoint.INDEX:
                doc["weight_map"] = _mutate_json(rng, doc["weight_map"])
            else:
                doc = _mutate_json(rng, doc)
            (case / target).write_text(json.dumps(doc))
        else:
            (case / target).write_bytes(_corrupt(rng, (src / target).read_bytes())[1])
        t0 = time.perf_counter()
        try:
            cfg, got = checkpoint.load(case, layout="canonical", per_layer=True)
        except CheckpointError as e:
            assert os.fspath(case) in str(e), str(e)
            outcomes["error"] += 1
            continue
        finally:
            assert time.perf_counter() - t0 < 60
        outcomes["ok"] += 1
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert a.shape == b.shape and a.dtype == b.dtype
    assert outcomes["error"] > 0


def test_fuzz_gptq_arguments():
    """from_gptq with random shapes, dtypes and g_idx values (huge ones included):
    ValueError / TypeError or a result, fast, never a MemoryError or a numpy error."""
    rng = np.random.default_rng(52)
    for _ in range(100):
        bits = int(rng.choice([2, 3, 4, 8]))
        k = 32 * int(rng.integers(1, 9))
        n = 8 * int(rng.integers(1, 5))
        groups = int(rng.choice([0, 1, 2, 4, k // 32]))
        qweight = np.zeros((max(k * bits // 32 + int(rng.integers(-1, 2)), 0), n), np.int32)
        qzeros = np.zeros((groups, -(-n * bits // 32)), np.int32)
        scales = np.ones((groups, n), np.float16)
        g_idx = rng.integers(-3, max(groups, 1) + 2, k).astype(np.int64)
        if rng.integers(0, 2):
            g_idx[int(rng.integers(0, k))] = int(rng.choice([2 ** 31 - 1, 2 ** 62, -(2 ** 62)]))
        t0 = time.perf_counter()
        try:
            jq.io.from_gptq(qweight, qzeros, scales, g_idx if rng.integers(0, 2) else None,
                            bits=bits)
        except (ValueError, TypeError):
            pass
        assert time.perf_counter() - t0 < 1
