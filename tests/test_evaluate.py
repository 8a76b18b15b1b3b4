"""python -m jaxquant eval (jaxquant/evaluate.py): the quality numbers against an
independent float64 computation from the same logits, on a tiny checkpoint."""


import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import evaluate, models
from jaxquant.models import checkpoint
from tests.test_models import LLAMA, _dense_mlps, _hf_common, _write

tokenizers = pytest.importorskip("tokenizers", reason="eval reads tokenizer.json through the "
                                 "tokenizers package (the `text` extra)")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    rng = np.random.default_rng(0)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    _write(path, LLAMA, t)
    words = sorted({w.strip(".,'").lower() for w in
                    open(evaluate.DEFAULT_TEXT).read().split()})[:LLAMA["vocab_size"] - 1]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def _oracle(ref, lg, tokens):
    """float64 numpy: (sum nll of next tokens, sum KL(ref||lg), agreements, positions)."""
    ref, lg = np.asarray(ref, np.float64), np.asarray(lg, np.float64)
    lsm = lambda a: a - a.max(-1, keepdims=True) - np.log(
        np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True))
    lp, rp = lsm(lg), lsm(ref)
    nll = -np.take_along_axis(lp[:, :-1], np.asarray(tokens)[:, 1:, None], -1).sum()
    kl = (np.exp(rp) * (rp - lp)).sum()
    return nll, kl, (lg.argmax(-1) == ref.argmax(-1)).sum(), ref.shape[0] * ref.shape[1]


def test_numbers_match_float64_oracle(ckpt):
    cfg, params = checkpoint.load(ckpt, mode=None, dtype="float32")
    q = models.quantize_params(params, "mxfp4")
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 3 * 16 + 5)
    got = evaluate.evaluate(cfg, {"float32": params, "mxfp4": q}, tokens, context=16, batch=2)
    windows = jnp.asarray(tokens[:48].reshape(3, 16), jnp.int32)
    ref = models.prefill(cfg, params, windows, 16)[0]
    lg = models.prefill(cfg, q, windows, 16)[0]
    for name, logits in (("float32", ref), ("mxfp4", lg)):
        nll, kl, agree, pos = _oracle(ref, logits, windows)
        r = got[name]
        assert r["positions"] == pos == 48
        np.testing.assert_allclose(r["perplexity"], np.exp(nll / 45), rtol=1e-5)
        np.testing.assert_allclose(r["kl"], kl / pos, rtol=1e-4, atol=1e-7)
        assert r["top1"] == agree / pos
    assert got["float32"]["kl"] == pytest.approx(0, abs=1e-7) and got["float32"]["top1"] == 1
    assert got["mxfp4"]["kl"] > 0


@pytest.mark.slow
def test_cli_prints_a_row_per_mode(ckpt, capsys):
    assert evaluate.main(["--checkpoint", str(ckpt), "--modes", "affine8,mxfp4",
                          "--context", "32", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["mode", "weights", "perplexity"]
    assert [line.split()[0] for line in out[1:]] == ["float32", "affine8", "mxfp4"]
    ppl = [float(line.split()[2]) for line in out[1:]]
    assert all(np.isfinite(ppl)) and all(p > 1 for p in ppl)


@pytest.mark.slow
def test_cli_a8_rows(ckpt, capsys):
    """--a8: a row per row and 8-bit type; 8-bit activations move the float32 model
    (KL > 0) and int8 less than FP8's 3 mantissa bits."""
    assert evaluate.main(["--checkpoint", str(ckpt), "--modes", "mxfp4", "--context", "32",
                          "--dtype", "float32", "--a8", "float8_e4m3fn,int8"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: [float(v.rstrip("%Mi")) for v in line.split()[1:]]
            for line in out[1:]}
    assert list(rows) == ["float32", "mxfp4", "float32+x:fp8", "float32+x:int8",
                          "mxfp4+x:fp8", "mxfp4+x:int8"]
    assert all(np.isfinite(r).all() for r in rows.values())
    assert 0 < rows["float32+x:int8"][2] < rows["float32+x:fp8"][2]


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys):
    for argv, want in ((["--checkpoint", str(tmp_path / "nope")], "is not a directory"),
                       (["--checkpoint", str(tmp_path)], "no tokenizer.json"),
                       (["--checkpoint", str(ckpt), "--modes", "int3"], "unknown mode"),
                       (["--checkpoint", str(ckpt), "--a8", "int4"], "unknown --a8"),
                       (["--checkpoint", str(ckpt), "--context", "4096"], "fewer than one")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(argv)
        assert e.value.code == 2
        assert want in capsys.readouterr().err
