"""Oaken's offline thresholds: the quantile procedure, calibration, the versioned file and `kvstrata calibrate oaken`."""

import json

import numpy as np
import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.config import EngineConfig
from kvstrata.data import EMMA
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.errors import KvstrataError
from kvstrata.kv.formats.oaken import thresholds as module
from kvstrata.kv.formats.oaken.thresholds import (
    DEFAULT_RATIOS,
    TENSOR_FIELDS,
    ForeignCalibrationError,
    OakenThresholds,
    calibrate,
    default_thresholds,
    quantile_levels,
    strictly_ordered,
    window_bounds,
)
from kvstrata.model.rotary import RotaryEmbedding, apply_rope, undo_rope

WINDOWS, WINDOW_TOKENS = 3, 48
TWO_GROUPS = (0.1, 0.9)
FIVE_GROUPS = (0.02, 0.03, 0.85, 0.06, 0.04)


def chain(bounds: torch.Tensor) -> torch.Tensor:
    """lo_0, .., lo_{G-2}, hi_{G-2}, .., hi_0 per layer: strictly increasing when ordered."""
    return torch.cat((bounds[..., 0], bounds[..., 1].flip(-1)), dim=-1)


def refuse_to_calibrate(*args, **kwargs):
    raise AssertionError("calibrated although thresholds were available")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB", threads=1))


@pytest.fixture(scope="module")
def token_ids(engine, emma_text):
    return engine.tokenize(emma_text[:20000])


@pytest.fixture(scope="module")
def thresholds(engine, token_ids):
    (result,) = calibrate(engine, token_ids, [DEFAULT_RATIOS], WINDOWS, WINDOW_TOKENS, progress=False,
                          source="emma.txt")
    return result


def test_quantiles_match_numpy():
    q_lo, q_hi = quantile_levels(DEFAULT_RATIOS)
    assert q_lo == pytest.approx([0.02, 0.47]) and q_hi == pytest.approx([0.98, 0.53])
    values = torch.randn(4, 1001, generator=torch.Generator().manual_seed(0))
    (bounds,) = window_bounds(values, [DEFAULT_RATIOS])
    assert bounds.shape == (4, 2, 2) and bounds.dtype == torch.float64
    for row in range(4):
        x = values[row].double().numpy()
        assert bounds[row, :, 0].tolist() == np.quantile(x, q_lo, method="lower").tolist()
        assert bounds[row, :, 1].tolist() == np.quantile(x, q_hi, method="higher").tolist()
    # 0..999 shuffled: ranks 999 q = 19.98, 469.53 (rounded down) and 979.02, 529.47 (rounded up)
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(1)).float()[None]
    (known,) = window_bounds(shuffled, [DEFAULT_RATIOS])
    assert known[0].tolist() == [[19.0, 980.0], [469.0, 530.0]]


def test_ties_are_nudged_into_strict_order():
    tied = torch.tensor([[[-1.0, 1.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    ordered = strictly_ordered(tied)
    assert ordered.dtype == torch.float32
    assert (chain(ordered).diff(dim=-1) > 0).all()
    assert ordered[0, 0].tolist() == [-1.0, 1.0] and ordered[0, 1, 0] == 0.0  # untied values are kept


def test_thresholds_are_ordered_per_layer_and_kind(engine, token_ids, thresholds):
    assert thresholds.fingerprint == engine.model_fingerprint and thresholds.num_layers == 3
    assert (thresholds.num_windows, thresholds.window_tokens, thresholds.source) == (WINDOWS, WINDOW_TOKENS, "emma.txt")
    for name in TENSOR_FIELDS:
        table = getattr(thresholds, name)
        assert table.shape == (3, 2, 2) and table.dtype == torch.float32
        assert (chain(table).diff(dim=-1) > 0).all()
    # on a calibration window, about 4% of the values lie on or beyond the outer thresholds
    k, v = compute_kv(engine, token_ids[:WINDOW_TOKENS])
    for layer in range(3):
        for x, bounds in ((k[layer], thresholds.bounds(layer, "k", "post-rope")), (v[layer], thresholds.bounds(layer, "v"))):
            outer = ((x <= bounds[0, 0]) | (x >= bounds[0, 1])).float().mean()
            assert 0.01 < outer < 0.10


def test_pre_rope_keys_are_the_projection_output(engine, token_ids, thresholds):
    ids = token_ids[:WINDOW_TOKENS]
    k, _ = compute_kv(engine, ids)
    config, model = engine.loaded.config, engine.loaded.model
    cos, sin = RotaryEmbedding(config).cos_sin(torch.arange(len(ids)), torch.float32)
    pre = undo_rope(k, cos, sin)
    attention = model.layers[0].self_attn
    with torch.inference_mode():
        hidden = model.layers[0].input_layernorm(model.embed_tokens(torch.tensor(ids)))
        projected = attention.qkv_proj(hidden).split(attention.split_sizes, dim=-1)[1]
    torch.testing.assert_close(pre[0], projected.view(len(ids), config.num_kv_heads, config.head_dim))
    torch.testing.assert_close(apply_rope(pre, cos, sin), k)
    torch.testing.assert_close(pre[:, 0], k[:, 0])  # position 0 is not rotated; the others are
    assert not torch.allclose(pre[:, 1:], k[:, 1:], atol=1e-3)
    assert not torch.equal(thresholds.k_pre_rope, thresholds.k_post_rope)


def test_keys_without_rope_are_the_same_before_and_after(tiny_opt, emma_text):
    opt = LLMEngine(EngineConfig(model=str(tiny_opt), kv_cache_memory="8MiB", threads=1))
    (result,) = calibrate(opt, opt.tokenize(emma_text[:5000]), [DEFAULT_RATIOS], 2, 32, progress=False)
    assert torch.equal(result.k_pre_rope, result.k_post_rope)
    assert torch.equal(result.k_pre_rope_centered, result.k_post_rope_centered)


def test_mean_key_and_centered_thresholds(engine, token_ids, thresholds):
    """k_mean is the mean pre-RoPE key over the calibration windows; the centered tables are the thresholds of
    keys minus that mean (rotated to each position after RoPE)."""
    starts = np.linspace(0, len(token_ids) - WINDOW_TOKENS, WINDOWS).astype(int).tolist()
    cos, sin = RotaryEmbedding(engine.loaded.config).cos_sin(torch.arange(WINDOW_TOKENS), torch.float32)
    windows = [compute_kv(engine, token_ids[s : s + WINDOW_TOKENS])[0] for s in starts]
    pre = torch.stack([undo_rope(k, cos, sin) for k in windows])  # [windows, L, T, heads, D]
    torch.testing.assert_close(thresholds.k_mean, pre.mean((0, 2)).flatten(1))
    mean = thresholds.k_mean.view(3, 1, *windows[0].shape[2:])
    for name, centered in (("k_pre_rope_centered", [k - mean for k in pre]),
                           ("k_post_rope_centered", [k - apply_rope(mean.expand_as(k), cos, sin) for k in windows])):
        per_window = [window_bounds(x.reshape(3, -1), [DEFAULT_RATIOS])[0] for x in centered]
        torch.testing.assert_close(getattr(thresholds, name), strictly_ordered(torch.stack(per_window).mean(0)))
    # most of a key is its mean here too: the centered keys' outer thresholds are narrower
    width = thresholds.k_pre_rope[:, 0].diff(dim=-1)
    assert (thresholds.k_pre_rope_centered[:, 0].diff(dim=-1) < width).all()


def test_one_pass_serves_every_ratio_set(engine, token_ids, thresholds):
    together = calibrate(engine, token_ids, [DEFAULT_RATIOS, TWO_GROUPS, FIVE_GROUPS], WINDOWS, WINDOW_TOKENS,
                         progress=False, source="emma.txt")
    separate = [thresholds] + [calibrate(engine, token_ids, [ratios], WINDOWS, WINDOW_TOKENS, progress=False)[0]
                               for ratios in (TWO_GROUPS, FIVE_GROUPS)]
    for one, other in zip(together, separate):
        assert one.ratios == other.ratios
        for name in TENSOR_FIELDS:
            assert torch.equal(getattr(one, name), getattr(other, name))
    two, five = together[1:]
    for result, boundaries in ((two, 1), (five, 4)):
        for name in TENSOR_FIELDS:
            table = getattr(result, name)
            assert table.shape == (3, boundaries, 2) and (chain(table).diff(dim=-1) > 0).all()
    # boundaries at the same cumulative fraction agree across ratio sets: 4% outside and 2% + 3% = 5% ...
    assert torch.equal(five.v[:, 1], calibrate(engine, token_ids, [(0.05, 0.95)], WINDOWS, WINDOW_TOKENS,
                                               progress=False)[0].v[:, 0])


def test_calibration_refuses_bad_requests(engine, token_ids):
    with pytest.raises(KvstrataError, match="from 10 tokens"):
        calibrate(engine, token_ids[:10], [DEFAULT_RATIOS], 2, WINDOW_TOKENS, progress=False)
    with pytest.raises(KvstrataError, match="0 windows"):
        calibrate(engine, token_ids, [DEFAULT_RATIOS], 0, WINDOW_TOKENS, progress=False)
    with pytest.raises(KvstrataError, match="max_model_len"):
        calibrate(engine, token_ids, [DEFAULT_RATIOS], 1, engine.max_model_len + 1, progress=False)
    with pytest.raises(KvstrataError, match="sum to"):
        calibrate(engine, token_ids, [(0.5, 0.6)], 1, WINDOW_TOKENS, progress=False)
    with pytest.raises(KvstrataError, match="2 to 5"):
        calibrate(engine, token_ids, [(1.0,)], 1, WINDOW_TOKENS, progress=False)
    with pytest.raises(KvstrataError, match="at least one set"):
        calibrate(engine, token_ids, [], 1, WINDOW_TOKENS, progress=False)


def test_save_load_round_trip(engine, thresholds, tmp_path):
    path = tmp_path / "thresholds.json"
    thresholds.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["thresholds.json"]  # no temporary file left behind
    document = json.loads(path.read_text())
    assert (document["format"], document["version"], document["num_layers"]) == ("kvstrata-oaken-thresholds", 2, 3)
    assert document["ratios"] == list(DEFAULT_RATIOS) and len(document["v"][0]) == 2
    loaded = OakenThresholds.load(path, engine.model_fingerprint)
    assert (loaded.fingerprint, loaded.ratios, loaded.num_windows, loaded.window_tokens, loaded.source) == (
        thresholds.fingerprint, thresholds.ratios, thresholds.num_windows, thresholds.window_tokens, thresholds.source)
    for name in (*TENSOR_FIELDS, "k_mean"):
        assert torch.equal(getattr(loaded, name), getattr(thresholds, name))
    assert torch.equal(loaded.bounds(2, "k", "pre-rope"), thresholds.k_pre_rope[2])
    assert torch.equal(loaded.bounds(2, "k", "post-rope"), thresholds.k_post_rope[2])
    assert torch.equal(loaded.bounds(1, "k", "pre-rope", centered=True), thresholds.k_pre_rope_centered[1])
    assert torch.equal(loaded.bounds(1, "k", "post-rope", centered=True), thresholds.k_post_rope_centered[1])
    assert torch.equal(loaded.bounds(0, "v", centered=True), thresholds.v[0])
    assert torch.equal(loaded.bounds(0, "v"), thresholds.v[0])
    for args, message in (((3, "v"), "layer 3"), ((0, "q"), "kind 'q'"), ((0, "k"), "keys None")):
        with pytest.raises(KvstrataError, match=message):
            loaded.bounds(*args)


def _set(document, key, value):
    document[key] = value


def _swap_layer_two(document):
    document["v"][2][0] = document["v"][2][0][::-1]


def _tie(document):
    document["k_pre_rope"][0][1][0] = document["k_pre_rope"][0][0][0]


CORRUPTIONS = {
    "wrong format": (lambda d: _set(d, "format", "kvstrata-cachegen-profile"), "not an oaken thresholds file"),
    "wrong version": (lambda d: _set(d, "version", 1), "version 1; only version 2"),
    "missing field": (lambda d: d.pop("k_post_rope"), "lacks the field.*k_post_rope"),
    "bad ratios": (lambda d: _set(d, "ratios", [0.5, 0.6]), "sum to"),
    "fingerprint not text": (lambda d: _set(d, "fingerprint", 7), "must be strings"),
    "no windows": (lambda d: _set(d, "num_windows", 0), "num_windows 0"),
    "layer count": (lambda d: _set(d, "num_layers", 4), "num_layers 4"),
    "layers differ": (lambda d: _set(d, "v", d["v"][:2]), r"v has shape \[2, 2, 2\]"),
    "boundaries": (lambda d: _set(d, "v", [layer[:1] for layer in d["v"]]), r"v has shape \[3, 1, 2\]"),
    "ragged": (lambda d: _set(d["v"], 1, [[0.0]]), "v is not a rectangular array"),
    "not numbers": (lambda d: _set(d["v"][0][0], 0, {"lo": 1}), "v is not a rectangular array"),
    "nan": (lambda d: _set(d["v"][1][0], 0, float("nan")), r"non-finite thresholds in layer\(s\) \[1\]"),
    "infinite": (lambda d: _set(d["v"][0][0], 1, float("inf")), "non-finite"),
    "unordered": (_swap_layer_two, r"not in strict order .* layer\(s\) \[2\]"),
    "equal": (_tie, r"k_pre_rope is not in strict order .* layer\(s\) \[0\]"),
    "no mean key": (lambda d: d.pop("k_mean"), "lacks the field.*k_mean"),
    "mean of other layers": (lambda d: _set(d, "k_mean", d["k_mean"][:2]), r"k_mean must be .*\[3, kv width\]"),
    "mean not finite": (lambda d: _set(d["k_mean"][1], 0, float("nan")), "k_mean has non-finite"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupt_files_are_refused(engine, thresholds, tmp_path, case):
    corrupt, message = CORRUPTIONS[case]
    document = thresholds.to_json()
    corrupt(document)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(KvstrataError, match=message) as caught:
        OakenThresholds.load(path, engine.model_fingerprint)
    assert str(path) in str(caught.value) and not isinstance(caught.value, ForeignCalibrationError)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b""])
def test_unreadable_files_are_refused(engine, tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(KvstrataError, match="bad.json"):
        OakenThresholds.load(path, engine.model_fingerprint)


def test_missing_file_is_refused(engine, tmp_path):
    with pytest.raises(KvstrataError, match="cannot read .*missing.json"):
        OakenThresholds.load(tmp_path / "missing.json", engine.model_fingerprint)
    with pytest.raises(KvstrataError, match="cannot read"):
        OakenThresholds.load(tmp_path, engine.model_fingerprint)


def test_foreign_fingerprint_is_refused(engine, thresholds, tmp_path):
    thresholds.save(tmp_path / "thresholds.json")
    with pytest.raises(ForeignCalibrationError) as caught:
        OakenThresholds.load(tmp_path / "thresholds.json", "0123456789abcdef")
    assert engine.model_fingerprint in str(caught.value) and "0123456789abcdef" in str(caught.value)
    assert isinstance(caught.value, KvstrataError)


def test_cli_writes_a_loadable_file(engine, tiny_llama, tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text(EMMA.read_text()[:10000])
    out = tmp_path / "out" / "thresholds.json"
    common = ["calibrate", "oaken", "--text", str(text), "--out", str(out), "--windows", "2", "--window-tokens", "32",
              "--model", str(tiny_llama), "--kv-cache-memory", "8MiB", "--threads", "1"]
    assert main([*common, "--ratios", "0.1,0.8,0.1"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and engine.model_fingerprint in printed and "outer thresholds" in printed
    loaded = OakenThresholds.load(out, engine.model_fingerprint)
    assert (loaded.ratios, loaded.num_windows, loaded.window_tokens, loaded.source) == (
        (0.1, 0.8, 0.1), 2, 32, "calibration.txt")
    assert main([*common, "--ratios", "0.1,x"]) == 2
    assert "--ratios '0.1,x'" in capsys.readouterr().err


def test_default_thresholds_calibrate_once_then_load_the_cache(engine, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSTRATA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(module, "DATA_DIR", tmp_path / "shipped")
    monkeypatch.setattr(module, "DEFAULT_WINDOWS", 2)
    monkeypatch.setattr(module, "DEFAULT_WINDOW_TOKENS", 32)
    first = default_thresholds(engine, progress=False)
    cache = tmp_path / "xdg" / "kvstrata" / "oaken"
    assert [p.name for p in cache.iterdir()] == [f"{engine.model_fingerprint}-0.04-0.9-0.06.json"]
    assert (first.ratios, first.num_windows, first.window_tokens, first.source) == (DEFAULT_RATIOS, 2, 32, "emma.txt")
    with monkeypatch.context() as patch:
        patch.setattr(module, "calibrate", refuse_to_calibrate)
        second = default_thresholds(engine, progress=False)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(second, name), getattr(first, name))
    # a damaged cache is calibrated again, with a warning
    (cache / f"{engine.model_fingerprint}-0.04-0.9-0.06.json").write_text("{")
    with pytest.warns(UserWarning, match="calibrating oaken again"):
        third = default_thresholds(engine, progress=False)
    assert torch.equal(third.v, first.v)
    OakenThresholds.load(cache / f"{engine.model_fingerprint}-0.04-0.9-0.06.json", engine.model_fingerprint)


def test_default_thresholds_prefer_the_shipped_file(engine, thresholds, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "DATA_DIR", tmp_path / "shipped")
    monkeypatch.setattr(module, "DEFAULT_WINDOWS", 2)
    monkeypatch.setattr(module, "DEFAULT_WINDOW_TOKENS", 32)
    thresholds.save(tmp_path / "shipped" / f"{engine.model_fingerprint}.json")
    with monkeypatch.context() as patch:
        patch.setattr(module, "calibrate", refuse_to_calibrate)
        shipped = default_thresholds(engine, progress=False)
    assert torch.equal(shipped.k_pre_rope, thresholds.k_pre_rope)
    # the shipped file has other ratios than these: calibrated on first use, cached under $KVSTRATA_CACHE_DIR
    other = default_thresholds(engine, TWO_GROUPS, progress=False)
    assert other.ratios == TWO_GROUPS
    assert (tmp_path / "cache" / "oaken" / f"{engine.model_fingerprint}-0.1-0.9.json").is_file()
