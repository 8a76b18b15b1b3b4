"""models.generate's sampling, stop tokens and prompts of different lengths, and
`python -m jaxquant generate` on a tiny checkpoint with its own tokenizer.

The filters are checked mask for mask against a float64 NumPy oracle written from
their definitions (docs/models.md, "Generation"), and the draws against the
filtered distribution by a chi-square test with a fixed seed."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import models
from jaxquant.models import text
from tests.test_models import LLAMA, _dense_mlps, _hf_common, _write, tiny

# ---------------------------------------------------------------------------
# The oracle: Hugging Face's order (temperature, top-k, top-p, min-p), in float64.


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def oracle_keep(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Which tokens of one row of logits survive the filters; the filtered
    distribution (zeros where removed)."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones(x.shape, bool)
    if 0 < top_k < x.size:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    if top_p < 1.0:
        p = np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0.0)
        order = sorted(range(x.size), key=lambda i: (-x[i], i))
        before = 0.0
        kept = np.zeros_like(keep)
        for i in order:
            kept[i] = keep[i] and before < top_p
            before += p[i]
        keep = kept
    if min_p > 0.0:
        p = np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0.0)
        keep &= p >= min_p * p.max()
    dist = np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0.0)
    return keep, dist


def _away_from(values, rng):
    """A threshold strictly between two neighbouring values (no boundary tie)."""
    v = np.unique(np.asarray(values))
    i = rng.integers(0, len(v) - 1)
    return float((v[i] + v[i + 1]) / 2)


@pytest.mark.parametrize("seed", range(6))
def test_filter_masks_equal_the_oracle(seed):
    rng = np.random.default_rng(seed)
    b, v = 5, int(rng.integers(8, 200))
    logits = (rng.standard_normal((b, v)) * rng.uniform(0.5, 4)).astype(np.float32)
    temperature = float(rng.choice([0.5, 1.0, 1.7]))
    for row in range(b):
        x = logits[row].astype(np.float64) / temperature
        p = _softmax(x)
        top_k = int(rng.choice([0, 1, 3, v // 2, v + 5]))
        cum = np.cumsum(np.sort(p)[::-1])
        top_p = float(rng.choice([1.0, min(0.999, _away_from(cum[:-1], rng))]))
        min_p = float(rng.choice([0.0, _away_from(p / p.max(), rng)]))
        s = models.Sampling(temperature, top_k, top_p, min_p)
        got = np.asarray(models.filter_logits(logits[row:row + 1], s))[0]
        keep, _ = oracle_keep(logits[row], temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(np.isfinite(got), keep, err_msg=str(s))
        np.testing.assert_allclose(got[keep], (logits[row] / np.float32(temperature))[keep],
                                   rtol=1e-6)
        assert keep.any()


def test_filters_one_at_a_time_and_ties():
    x = np.array([[3.0, 1.0, 3.0, 0.0, -1.0, 2.0]], np.float32)
    keep = lambda **kw: np.isfinite(np.asarray(models.filter_logits(
        x, models.Sampling(1.0, **kw))))[0].tolist()
    # top-k keeps every logit equal to the k-th (the tie at 3.0)
    assert keep(top_k=1) == [True, False, True, False, False, False]
    assert keep(top_k=3) == [True, False, True, False, False, True]
    # top-p: the first token always stays, however small top_p
    assert keep(top_p=1e-6) == [True, False, False, False, False, False]
    # min-p of 1 keeps exactly the maxima
    assert keep(min_p=1.0) == [True, False, True, False, False, False]
    assert all(keep())


def test_sampling_frequencies_chi_square():
    """40000 draws with a fixed seed against the filtered distribution: no draw of a
    removed token, and the chi-square statistic of the kept ones under the 1e-4
    quantile (a wrong filter or temperature moves it by orders of magnitude)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, 0.9, 1.4], np.float32)
    n = 40000
    for s in (models.Sampling(0.8), models.Sampling(1.3, top_k=5),
              models.Sampling(1.0, top_p=0.8), models.Sampling(0.7, min_p=0.2),
              models.Sampling(1.1, top_k=6, top_p=0.9, min_p=0.05)):
        draws = models.sample(jax.random.key(7), jnp.broadcast_to(logits, (n, 8)), s)
        counts = np.bincount(np.asarray(draws), minlength=8)
        keep, dist = oracle_keep(logits, s.temperature, s.top_k, s.top_p, s.min_p)
        assert counts[~keep].sum() == 0, (s, counts)
        expected = dist[keep] * n
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        limit = scipy_stats.chi2.ppf(1 - 1e-4, df=max(keep.sum() - 1, 1))
        assert chi2 < limit, (s, chi2, limit, counts, expected)


def test_sampling_arguments_checked():
    for kw, err in ((dict(temperature=-1.0), ValueError), (dict(temperature=float("nan")),
                                                           ValueError),
                    (dict(temperature=1.0, top_p=0.0), ValueError),
                    (dict(temperature=1.0, top_p=1.5), ValueError),
                    (dict(temperature=1.0, min_p=-0.1), ValueError),
                    (dict(temperature=1.0, top_k=-1), ValueError),
                    (dict(temperature=1.0, top_k=1.5), TypeError),
                    (dict(temperature="1"), TypeError), (dict(top_k=5), ValueError)):
        with pytest.raises(err):
            models.Sampling(**kw)
    with pytest.raises(ValueError, match="temperature"):
        models.filter_logits(jnp.zeros((1, 4)), models.GREEDY)


# ---------------------------------------------------------------------------
# generate.


@pytest.fixture(scope="module")
def llama():
    cfg = tiny("llama", dtype="float32")
    return cfg, models.init_params(cfg, jax.random.key(0))


GEN = jax.jit(models.generate, static_argnums=(0, 3))


def test_greedy_default_is_prefill_and_decode(llama):
    cfg, params = llama
    prompt = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
    _, cache, tok = models.prefill(cfg, params, prompt, 12)
    toks, _, _ = models.decode(cfg, params, cache, tok, 7, 4)
    want = np.concatenate([np.asarray(tok)[:, None], np.asarray(toks)], 1)
    np.testing.assert_array_equal(GEN(cfg, params, prompt, 5), want)
    # the general loop (stop tokens that never come, equal lengths) decodes the same
    never = [t for t in range(cfg.vocab_size) if t not in want][:2]
    np.testing.assert_array_equal(GEN(cfg, params, prompt, 5, stop_tokens=tuple(never)), want)
    np.testing.assert_array_equal(GEN(cfg, params, prompt, 5, lengths=jnp.array([7, 7])), want)


def test_prefill_logits_at_one_position_a_row(llama):
    """The head at one position of each row: those rows of the full logits (the head's
    product on one row instead of all, within float32 rounding), the token their
    argmax; a shape other than [B] is refused."""
    cfg, params = llama
    prompt = jax.random.randint(jax.random.key(2), (3, 9), 0, cfg.vocab_size)
    full, cache_full, _ = models.prefill(cfg, params, prompt, 12)
    at = jnp.array([8, 0, 4], jnp.int32)
    logits, cache, token = models.prefill(cfg, params, prompt, 12, logits_at=at)
    assert logits.shape == (3, 1, cfg.vocab_size)
    want = np.asarray(full)[np.arange(3), np.asarray(at)]
    np.testing.assert_allclose(np.asarray(logits)[:, 0], want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(token, np.argmax(np.asarray(logits)[:, 0], -1))
    for a, b in zip(cache, cache_full):
        np.testing.assert_array_equal(a, b)
    for bad in (jnp.array([8, 8], jnp.int32), jnp.array([[8], [8], [8]], jnp.int32)):
        with pytest.raises(ValueError, match="logits_at"):
            models.prefill(cfg, params, prompt, 12, logits_at=bad)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3_moe", marks=pytest.mark.full),
                                    pytest.param("gpt_oss", marks=pytest.mark.full)])
def test_rows_of_different_lengths_equal_their_own_runs(family):
    """Right-padded prompts with their lengths: each row's tokens are those of its
    own single-prompt run (gpt-oss: its sliding window of 3 crossed while decoding)."""
    cfg = tiny(family, dtype="float32")
    params = models.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    lengths = [9, 2, 5]
    prompt = rng.integers(0, cfg.vocab_size, (3, 9)).astype(np.int32)
    prompt[1, 2:] = 63  # padding: any value, ignored
    got = np.asarray(GEN(cfg, params, jnp.asarray(prompt), 6, lengths=jnp.asarray(lengths)))
    for row, n in enumerate(lengths):
        alone = np.asarray(GEN(cfg, params, jnp.asarray(prompt[row:row + 1, :n]), 6))
        np.testing.assert_array_equal(got[row], alone[0], err_msg=f"row {row}")


def test_stop_tokens_end_each_row(llama):
    cfg, params = llama
    prompt = jax.random.randint(jax.random.key(5), (2, 6), 0, cfg.vocab_size)
    free = np.asarray(GEN(cfg, params, prompt, 8))
    stop = int(free[0, 2])  # row 0 stops at its third token (or earlier, if repeated)
    got = np.asarray(GEN(cfg, params, prompt, 8, stop_tokens=[stop]))
    for row in range(2):
        hits = np.flatnonzero(free[row] == stop)
        end = hits[0] if hits.size else 8
        np.testing.assert_array_equal(got[row, :end + 1], free[row, :end + 1])
        assert (got[row, end:] == stop).all() or end == 8
    # every row stopped at once: the loop ends early and fills the rest
    both = np.asarray(GEN(cfg, params, prompt, 8, stop_tokens=(int(free[0, 0]),
                                                               int(free[1, 0]))))
    np.testing.assert_array_equal(both, np.repeat(free[:, :1], 8, 1))


def test_sampled_generation_is_seeded(llama):
    cfg, params = llama
    prompt = jax.random.randint(jax.random.key(5), (2, 6), 0, cfg.vocab_size)
    s = models.Sampling(temperature=1.5)
    a = np.asarray(GEN(cfg, params, prompt, 12, sampling=s, key=jax.random.key(1)))
    b = np.asarray(GEN(cfg, params, prompt, 12, sampling=s, key=jax.random.key(1)))
    c = np.asarray(GEN(cfg, params, prompt, 12, sampling=s, key=jax.random.key(2)))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # top_k=1 samples the argmax: greedy's tokens
    k1 = GEN(cfg, params, prompt, 12, sampling=models.Sampling(1.0, top_k=1),
             key=jax.random.key(3))
    np.testing.assert_array_equal(k1, GEN(cfg, params, prompt, 12))


def test_generate_arguments_checked(llama):
    cfg, params = llama
    prompt = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="key"):
        models.generate(cfg, params, prompt, 2, sampling=models.Sampling(1.0))
    with pytest.raises(TypeError, match="sampling"):
        models.generate(cfg, params, prompt, 2, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="stop_tokens"):
        models.generate(cfg, params, prompt, 2, stop_tokens=[cfg.vocab_size])
    with pytest.raises(TypeError, match="stop_tokens"):
        models.generate(cfg, params, prompt, 2, stop_tokens=[1.5])
    with pytest.raises(ValueError, match="lengths"):
        models.generate(cfg, params, prompt, 2, lengths=jnp.array([0, 4]))
    with pytest.raises(ValueError, match="lengths"):
        models.generate(cfg, params, prompt, 2, lengths=jnp.array([5, 4]))
    with pytest.raises(ValueError, match="lengths"):
        models.generate(cfg, params, prompt, 2, lengths=jnp.array([4]))
    with pytest.raises(TypeError, match="lengths"):
        models.generate(cfg, params, prompt, 2, lengths=jnp.array([4.0, 4.0]))
    with pytest.raises(ValueError, match="steps"):
        models.generate(cfg, params, prompt, 0)


# ---------------------------------------------------------------------------
# models.stream: generate's tokens, block by block.


def _streamed(cfg, params, prompt, steps, block, **kw):
    parts = list(models.stream(cfg, params, prompt, steps, block=block, **kw))
    assert parts[0].shape == (prompt.shape[0], 1) and parts[0].dtype == np.int32
    assert all(1 <= p.shape[1] <= block for p in parts[1:]), [p.shape for p in parts]
    return np.concatenate(parts, 1)


@pytest.mark.parametrize("block", [1, 3, 4, 32])
def test_stream_yields_generates_tokens(llama, block):
    """Blocks that divide the steps, that do not (the last one's extra steps write the
    cache's last slot and are dropped) and one longer than all of them."""
    cfg, params = llama
    prompt = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
    np.testing.assert_array_equal(_streamed(cfg, params, prompt, 9, block),
                                  GEN(cfg, params, prompt, 9))
    s = models.Sampling(1.3, top_k=20)
    key = jax.random.key(6)
    np.testing.assert_array_equal(_streamed(cfg, params, prompt, 9, block, sampling=s, key=key),
                                  GEN(cfg, params, prompt, 9, sampling=s, key=key))
    np.testing.assert_array_equal(_streamed(cfg, params, prompt, 1, block),
                                  GEN(cfg, params, prompt, 1))
    # right-padded prompts with their lengths: each row at its own position
    lengths = jnp.array([7, 3], jnp.int32)
    np.testing.assert_array_equal(_streamed(cfg, params, prompt, 9, block, lengths=lengths),
                                  GEN(cfg, params, prompt, 9, lengths=lengths))


def test_stream_ends_when_every_row_has_stopped(llama):
    cfg, params = llama
    prompt = jax.random.randint(jax.random.key(5), (2, 6), 0, cfg.vocab_size)
    free = np.asarray(GEN(cfg, params, prompt, 10))
    stops = (int(free[0, 2]), int(free[1, 5]))
    want = np.asarray(GEN(cfg, params, prompt, 10, stop_tokens=stops))
    # the step at which the later of the two rows stops
    end = max(int(np.flatnonzero(np.isin(free[r], stops))[0]) for r in range(2))
    for block in (1, 2, 4):
        got = _streamed(cfg, params, prompt, 10, block, stop_tokens=stops)
        np.testing.assert_array_equal(got, want[:, :end + 1], err_msg=f"block {block}")
    # a first token that stops every row: nothing is decoded after it
    first = tuple(int(t) for t in free[:, 0])
    assert _streamed(cfg, params, prompt, 10, 4, stop_tokens=first).shape == (2, 1)


def test_stream_arguments_checked(llama):
    cfg, params = llama
    prompt = jnp.zeros((1, 4), jnp.int32)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="block"):
            next(models.stream(cfg, params, prompt, 4, block=bad))
    with pytest.raises(ValueError, match="key"):
        next(models.stream(cfg, params, prompt, 4, sampling=models.Sampling(1.0)))
    with pytest.raises(ValueError, match="steps"):
        next(models.stream(cfg, params, prompt, 0))
    with pytest.raises(ValueError, match="stop_tokens"):
        next(models.stream(cfg, params, prompt, 4, stop_tokens=[cfg.vocab_size]))
    with pytest.raises(ValueError, match="lengths"):
        next(models.stream(cfg, params, prompt, 4, lengths=jnp.array([5])))


# ---------------------------------------------------------------------------
# The checkpoint's text side and `python -m jaxquant generate`.


def _tiny_text_checkpoint(path, template=None):
    """LLAMA's tiny checkpoint with a word-level tokenizer.json: ids 0..63 are the
    words w0..w63, w0 the end token."""
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package builds "
                                     "the test's tokenizer.json")
    rng = np.random.default_rng(11)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    _write(path, dict(LLAMA, eos_token_id=0), t)
    vocab = {f"w{i}": i for i in range(LLAMA["vocab_size"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["w0"])
    tok.save(str(path / "tokenizer.json"))
    if template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": template, "bos_token": "w2",
             "eos_token": {"content": "w0", "special": True}}))
    return tok


def _greedy_words(path, prompt_ids, n):
    cfg, params = models.checkpoint.load(str(path), dtype="float32")
    return np.asarray(GEN(cfg, params, jnp.asarray([prompt_ids], jnp.int32), n))[0]


def test_generate_cli_streams_text_and_stops_at_the_end_token(tmp_path, capsys):
    from jaxquant import __main__ as cli

    path = tmp_path / "ckpt"
    tok = _tiny_text_checkpoint(path)
    prompt = "w5 w9 w33 w12"
    ids = tok.encode(prompt).ids
    free = _greedy_words(path, ids, 12)
    # the end token: the fourth new token (generation_config.json's list beats config.json)
    end = int(free[3])
    cut = int(np.flatnonzero(free == end)[0])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 63]}))
    assert text.stop_tokens(str(path)) == (end, 63)
    assert cli.main(["generate", "--checkpoint", str(path), "--prompt", prompt,
                     "--max-tokens", "12", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    words = [f"w{i}" for i in free[:cut] if i != 0]  # w0 is special: decode skips it
    assert out.split() == words, (out, free, end)
    assert "until end token" in err and "tok/s" in err
    # without the generation config, config.json's eos_token_id (0) counts; --max-tokens
    (path / "generation_config.json").unlink()
    assert cli.main(["generate", "--checkpoint", str(path), "--prompt", prompt,
                     "--max-tokens", "3", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    n = min(3, int(np.flatnonzero(free == 0)[0]) if (free == 0).any() else 3)
    assert out.split() == [f"w{i}" for i in free[:n]]
    # sampling flags run, with a seed: the same text twice
    runs = []
    for _ in range(2):
        assert cli.main(["generate", "--checkpoint", str(path), "--prompt", prompt,
                         "--max-tokens", "6", "--temperature", "1.2", "--top-k", "8",
                         "--top-p", "0.95", "--min-p", "0.01", "--seed", "4",
                         "--dtype", "float32"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0].split()


def test_generate_cli_renders_the_chat_template(tmp_path, capsys):
    pytest.importorskip("jinja2", reason="jinja2 renders chat templates")
    from jaxquant import generate

    path = tmp_path / "ckpt"
    template = ("{{ bos_token }}{% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w4{% endif %}")
    tok = _tiny_text_checkpoint(path, template)
    rendered = text.render_chat(str(path), text.chat_template(str(path)),
                                [{"role": "user", "content": "w7 w8"}])
    assert rendered == "w2w3 w7 w8 w4" or rendered.split() == ["w2w3", "w7", "w8", "w4"]
    free = _greedy_words(path, tok.encode(rendered, add_special_tokens=False).ids, 5)
    assert generate.main(["--checkpoint", str(path), "--prompt", "w7 w8", "--max-tokens", "5",
                          "--dtype", "float32"]) == 0
    want = [f"w{i}" for i in free[:int(np.flatnonzero(free == 0)[0]) if (free == 0).any()
                                  else 5]]
    assert capsys.readouterr().out.split() == want


def test_text_files_checked(tmp_path, capsys):
    from jaxquant import generate

    path = tmp_path / "ckpt"
    _tiny_text_checkpoint(path, template="{{ raise_exception('no system role') }}")
    assert generate.main(["--checkpoint", str(path), "--prompt", "w7"]) == 2
    assert "chat template failed: no system role" in capsys.readouterr().err
    for bad in ("5.0", "[1, true]", "\"eos\"", "-3"):
        (path / "generation_config.json").write_text(f'{{"eos_token_id": {bad}}}')
        with pytest.raises(ValueError, match="eos_token_id"):
            text.stop_tokens(str(path))
    (path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        text.stop_tokens(str(path))
    (path / "tokenizer_config.json").write_text('{"chat_template": 5}')
    with pytest.raises(ValueError, match="chat_template"):
        text.chat_template(str(path))
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        text.tokenizer(str(path))
