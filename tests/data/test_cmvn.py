"""Per-speaker CMVN against Kaldi's apply-cmvn numbers worked out by hand."""

import kaldiio
import numpy as np
import pytest

from mpitrain.cli import main
from mpitrain.data.cmvn import SpeakerCmvn, accumulate_stats, apply_cmvn
from mpitrain.data.corpus import CorpusError, load_manifest
from mpitrain.data.kaldi import import_kaldi
from mpitrain.data.shards import ShardReader

# Speaker a: utterances a1 (frames [1, 10], [3, 14]) and a2 ([5, 18]), dimension 2.
# Per dimension: mean (1+3+5)/3 = 3 and (10+14+18)/3 = 14;
# variance (1+9+25)/3 - 9 = 8/3 and (100+196+324)/3 - 196 = 32/3.
# Speaker b: one utterance b1 ([2, 2], [4, 6]): mean 3 and 4, variance 1 and 4.
FEATS = {"a1": np.array([[1, 10], [3, 14]], np.float32),
         "a2": np.array([[5, 18]], np.float32),
         "b1": np.array([[2, 2], [4, 6]], np.float32)}
UTT2SPK = {"a1": "a", "a2": "a", "b1": "b"}
MEANS = {"a": [3.0, 14.0], "b": [3.0, 4.0]}
VARS = {"a": [8 / 3, 32 / 3], "b": [1.0, 4.0]}
# Kaldi's stats matrices as compute-cmvn-stats writes them: sums + count, sums of squares + 0
STATS = {"a": np.array([[9, 42, 3], [35, 620, 0]], np.float64),
         "b": np.array([[6, 8, 2], [20, 40, 0]], np.float64)}


def _expected(utt, norm_vars):
    spk = UTT2SPK[utt]
    out = (FEATS[utt] - np.array(MEANS[spk]))
    return out / np.sqrt(VARS[spk]) if norm_vars else out


@pytest.fixture
def kaldi(tmp_path):
    kaldiio.save_ark(str(tmp_path / "feats.ark"), FEATS, scp=str(tmp_path / "feats.scp"))
    kaldiio.save_ark(str(tmp_path / "cmvn.ark"), STATS, scp=str(tmp_path / "cmvn.scp"))
    with open(tmp_path / "ali.txt", "w") as f:
        for utt, m in FEATS.items():
            f.write(utt + " " + " ".join("1" for _ in range(m.shape[0])) + "\n")
    (tmp_path / "utt2spk").write_text("".join(f"{u} {s}\n" for u, s in UTT2SPK.items()))
    return tmp_path


def _stored(out):
    manifest = load_manifest(str(out))
    with ShardReader(manifest.shard_path(0)) as shard:
        f, _, o = shard.read(0, shard.num_utterances)
        return manifest, {u: f[o[k]:o[k + 1]] for k, u in enumerate(shard.utt_ids)}


def test_stats_and_application_match_the_definition():
    stats = accumulate_stats(FEATS["a2"], accumulate_stats(FEATS["a1"]))
    np.testing.assert_allclose(stats, STATS["a"])
    for norm_vars in (False, True):
        # float32 arithmetic, as Kaldi's: a value that cancels to 0 comes out near it
        np.testing.assert_allclose(apply_cmvn(FEATS["a1"], STATS["a"], norm_vars=norm_vars),
                                   _expected("a1", norm_vars), rtol=1e-6, atol=1e-6)


def test_application_is_kaldis_arithmetic_bit_for_bit():
    """ApplyCmvn: offset (and scale) from the double stats, stored as float, then
    the float features times the scale plus the offset, element by element."""
    f32 = np.float32
    rng = np.random.default_rng(4)
    feats = (rng.standard_normal((50, 6)) * 3 + 7).astype(f32)
    stats = accumulate_stats(feats)
    count = stats[0, -1]
    for norm_vars in (False, True):
        got = apply_cmvn(feats, stats, norm_vars=norm_vars)
        for d in range(6):
            mean = stats[0, d] / count
            if norm_vars:
                scale = 1.0 / np.sqrt(max(stats[1, d] / count - mean * mean, 1e-20))
                want = [f32(f32(x) * f32(scale)) + f32(-(mean * scale)) for x in feats[:, d]]
            else:
                want = [f32(x) + f32(-mean) for x in feats[:, d]]
            assert np.array_equal(got[:, d], np.array(want, dtype=f32)), (norm_vars, d)


@pytest.mark.parametrize("norm_vars", [False, True])
@pytest.mark.parametrize("with_stats", [True, False])
def test_prepare_applies_per_speaker_cmvn_like_apply_cmvn(kaldi, norm_vars, with_stats):
    out = kaldi / "corpus"
    args = ["prepare", "--feats", f"scp:{kaldi}/feats.scp", "--ali", f"{kaldi}/ali.txt",
            "--out", str(out), "--utt2spk", str(kaldi / "utt2spk")]
    args += ["--cmvn", f"scp:{kaldi}/cmvn.scp"] if with_stats else []
    args += ["--norm-vars"] if norm_vars else []
    assert main(args) == 0
    manifest, stored = _stored(out)
    for utt in FEATS:
        np.testing.assert_allclose(stored[utt], _expected(utt, norm_vars), rtol=1e-5,
                                   atol=1e-6)
    assert manifest.speaker_cmvn["norm_vars"] is norm_vars
    # without the options nothing is normalised and nothing is recorded
    plain = import_kaldi(f"scp:{kaldi}/feats.scp", f"{kaldi}/ali.txt", str(kaldi / "plain"))
    assert plain.speaker_cmvn is None and load_manifest(str(kaldi / "plain")).speaker_cmvn is None


def test_an_empty_utterance_adds_nothing_to_its_speakers_stats(kaldi):
    # Kaldi writes it 0 x 0, of no dimension: first of its speaker's, it set the
    # stats' width, and prepare refused the speaker's real utterances
    kaldiio.save_ark(str(kaldi / "feats.ark"), {"a0": np.zeros((0, 0), np.float32), **FEATS})
    (kaldi / "utt2spk").write_text("a0 a\n" + (kaldi / "utt2spk").read_text())
    cmvn = SpeakerCmvn.load(utt2spk=str(kaldi / "utt2spk"), feats=f"ark:{kaldi}/feats.ark")
    np.testing.assert_array_equal(cmvn.stats["a"], STATS["a"])
    assert cmvn.apply("a0", np.zeros((0, 2), np.float32)).shape == (0, 2)


def test_text_stats_by_utterance_without_utt2spk(kaldi):
    per_utt = {u: accumulate_stats(m) for u, m in FEATS.items()}
    with open(kaldi / "cmvn.txt", "w") as f:
        for u, s in per_utt.items():
            f.write(f"{u}  [\n  " + " ".join(map(str, s[0])) + "\n  "
                    + " ".join(map(str, s[1])) + " ]\n")
    cmvn = SpeakerCmvn.load(cmvn=f"ark,t:{kaldi}/cmvn.txt")
    np.testing.assert_allclose(cmvn.apply("a1", FEATS["a1"]),
                               FEATS["a1"] - FEATS["a1"].mean(axis=0))
    # the sums and the count alone (one row), as Kaldi takes them without --norm-vars
    kaldiio.save_ark(str(kaldi / "means.ark"), {u: s[:1] for u, s in per_utt.items()})
    cmvn = SpeakerCmvn.load(cmvn=f"ark:{kaldi}/means.ark")
    np.testing.assert_allclose(cmvn.apply("a1", FEATS["a1"]),
                               FEATS["a1"] - FEATS["a1"].mean(axis=0))


def test_bad_cmvn_input_is_one_line_naming_file_and_speaker(kaldi, tmp_path):
    def fails(match, **kw):
        with pytest.raises(CorpusError, match=match) as info:
            import_kaldi(f"scp:{kaldi}/feats.scp", f"{kaldi}/ali.txt",
                         str(tmp_path / f"out{len(list(tmp_path.iterdir()))}"), **kw)
        assert "\n" not in str(info.value)
    # a speaker without stats
    kaldiio.save_ark(str(kaldi / "only_a.ark"), {"a": STATS["a"]})
    fails(r"only_a\.ark: no CMVN stats for speaker 'b' \(of utterance 'b1'\)",
          utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/only_a.ark")
    # an utterance without a speaker
    (kaldi / "short_utt2spk").write_text("a1 a\na2 a\n")
    fails(r"short_utt2spk: utterance 'b1' has no speaker",
          utt2spk=str(kaldi / "short_utt2spk"), cmvn=f"scp:{kaldi}/cmvn.scp")
    # stats of the wrong dimension
    kaldiio.save_ark(str(kaldi / "wide.ark"), {s: np.zeros((2, 5)) + 1 for s in STATS})
    fails(r"wide\.ark: CMVN stats of 'a' are 2 x 5; features of dimension 2 \(utterance "
          r"'a1'\) need 2 x 3", utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/wide.ark")
    # not a stats matrix at all, and a pickled record refused by key
    kaldiio.save_ark(str(kaldi / "rows.ark"), {"a": np.zeros((3, 3))})
    fails(r"rows\.ark: speaker 'a': expected a 2 x \(dim\+1\) CMVN stats matrix",
          utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/rows.ark")
    (kaldi / "pkl.ark").write_bytes(b"a PKL\x80\x04N.")
    fails(r"pkl\.ark: entry 'a' holds a pickled Python object",
          utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/pkl.ark")
    # per-speaker stats without --utt2spk: looked up by utterance, which the message says
    fails(r"cmvn\.scp: no CMVN stats for utterance 'a1' \(without --utt2spk stats are looked up "
          r"by utterance; per-speaker stats need --utt2spk\)", cmvn=f"scp:{kaldi}/cmvn.scp")
    # a count below one frame (Kaldi's apply-cmvn refuses it too), and one-row stats
    # (sums and count alone) with --norm-vars
    low = {s: v.copy() for s, v in STATS.items()}
    low["a"][0] *= 0.5 / low["a"][0, -1]
    kaldiio.save_ark(str(kaldi / "low.ark"), low)
    fails(r"low\.ark: CMVN stats of 'a' have a frame count of 0\.5; expected at least 1",
          utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/low.ark")
    kaldiio.save_ark(str(kaldi / "means.ark"), {s: v[:1] for s, v in STATS.items()})
    fails(r"means\.ark: CMVN stats of 'a' have no sums of squares \(one row\), which "
          r"--norm-vars needs", utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/means.ark",
          norm_vars=True)
    # a NaN in the stats: it was blamed on the features, naming the output corpus
    nan_stats = {s: v.copy() for s, v in STATS.items()}
    nan_stats["b"][1, 0] = np.nan
    kaldiio.save_ark(str(kaldi / "nan.ark"), nan_stats)
    fails(r"nan\.ark: CMVN stats of 'b' hold nan at row 1, column 0",
          utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/nan.ark", norm_vars=True)
    # finite sums whose mean float32 cannot hold: blamed on the features the same way
    huge = {s: v.copy() for s, v in STATS.items()}
    huge["a"][0, 1] = -3e300
    kaldiio.save_ark(str(kaldi / "huge.ark"), huge)
    for norm_vars in (False, True):
        fails(r"huge\.ark: CMVN stats of 'a' give an infinite offset at dimension 1 "
              r"\(sum -3e\+300, sum of squares 620, count 3\); check the stats of 'a' "
              r"in .*huge\.ark",
              utt2spk=str(kaldi / "utt2spk"), cmvn=f"ark:{kaldi}/huge.ark", norm_vars=norm_vars)
    # the same from stats computed from features: the features are named
    one = np.ones((1, 3), np.float32)
    one[0, 1] = 1e30
    kaldiio.save_ark(str(kaldi / "loud.ark"), {"a1": one})
    (kaldi / "loud_utt2spk").write_text("a1 a\n")
    with pytest.raises(CorpusError, match=r"give an infinite offset at dimension 1 .*; check the "
                       r"features of speaker 'a' for values too large to normalise"):
        SpeakerCmvn.load(utt2spk=str(kaldi / "loud_utt2spk"), feats=f"ark:{kaldi}/loud.ark",
                         norm_vars=True).apply("a1", one)
    (kaldi / "bad_utt2spk").write_text("a1 a extra\n")
    fails(r"bad_utt2spk:1: expected 'utterance speaker'", utt2spk=str(kaldi / "bad_utt2spk"))


def test_merge_refuses_parts_normalised_differently(kaldi):
    from mpitrain.data.merge import merge_corpora
    m = kaldi / "merged"
    spk = {"utt2spk": str(kaldi / "utt2spk")}
    for part, kw in (("p1", spk), ("p2", {}), ("p3", spk)):
        # the same utterances under other ids: ids must be unique across parts
        kaldiio.save_ark(str(kaldi / f"{part}.ark"), {part + u: f for u, f in FEATS.items()})
        (kaldi / f"{part}.ali").write_text("".join(
            f"{part}{u} " + " ".join("1" * f.shape[0]) + "\n" for u, f in FEATS.items()))
        (kaldi / f"{part}.u2s").write_text("".join(f"{part}{u} {s}\n"
                                                   for u, s in UTT2SPK.items()))
        (kaldi / f"{part}.own.u2s").write_text("".join(f"{part}{u} {part}{s}\n"
                                                       for u, s in UTT2SPK.items()))
        kw = {"utt2spk": str(kaldi / f"{part}.u2s")} if kw else {}
        import_kaldi(f"ark:{kaldi}/{part}.ark", str(kaldi / f"{part}.ali"), str(m / part), **kw)
    with pytest.raises(CorpusError, match=r"p2/corpus\.yaml: no per-speaker CMVN, but "
                                          r".*p1/corpus\.yaml: per-speaker CMVN, norm_vars false"):
        merge_corpora(str(m), [str(m / "p1"), str(m / "p2")])
    # the same speakers in two parts, each normalised with its own part's stats
    with pytest.raises(CorpusError, match=r"p3/corpus\.yaml: speaker 'a' is also in .*p1, and "
                                          r"each part normalised it with CMVN stats of its own"):
        merge_corpora(str(m), [str(m / "p1"), str(m / "p3")])
    import_kaldi(f"ark:{kaldi}/p3.ark", str(kaldi / "p3.ali"), str(m / "p3"),
                 utt2spk=str(kaldi / "p3.own.u2s"), overwrite=True)
    merged = merge_corpora(str(m), [str(m / "p1"), str(m / "p3")])
    assert merged.speaker_cmvn["norm_vars"] is False


def test_a_model_trained_on_such_a_corpus_records_it(tmp_path):
    from mpitrain.nn.model_file import load_model
    from tests.helpers import QUICKSTART
    rng = np.random.default_rng(0)
    feats = {f"s{i % 2}-u{i}": rng.normal(size=(300, 5)).astype(np.float32) for i in range(4)}
    kaldiio.save_ark(str(tmp_path / "feats.ark"), feats)
    (tmp_path / "ali.txt").write_text("".join(
        u + " " + " ".join(str(v) for v in rng.integers(0, 3, 300)) + "\n" for u in feats))
    (tmp_path / "utt2spk").write_text("".join(f"{u} {u.split('-')[0]}\n" for u in feats))
    assert main(["prepare", "--feats", f"ark:{tmp_path}/feats.ark", "--ali",
                 f"{tmp_path}/ali.txt", "--out", str(tmp_path / "c"), "--utt2spk",
                 str(tmp_path / "utt2spk"), "--norm-vars"]) == 0
    argv = ["train", QUICKSTART, "--run-dir", str(tmp_path / "run")]
    for item in (f"data.train={tmp_path}/c", "data.dev=", "training.max_steps=2",
                 "training.minibatch=64", "model.hidden_dim=16", "model.hidden_layers=1"):
        argv += ["--set", item]
    assert main(argv) == 0
    net, _ = load_model(tmp_path / "run" / "final.h5")
    assert net.speaker_cmvn == {"norm_vars": True}
