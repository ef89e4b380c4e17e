"""``autopar demo``: a tiny run finishes, the losses agree and every promised file is written."""

from __future__ import annotations

import torch

from autopar.tools.cli import main
from autopar.tools.demo import VOCAB, CharLM, compare_curves, load_corpus, make_batches

TINY = ["--hidden", "16", "--layers", "1", "--emb", "8", "--seq-len", "6", "--batch", "4"]
TINY += ["--steps", "4", "--corpus-kb", "8", "--streams", "2", "--no-progress"]


def test_corpus_is_deterministic_ascii_stdlib_source():
    a, files, root = load_corpus(8)
    b, _, _ = load_corpus(8)
    assert torch.equal(a, b) and len(a) == 8 * 1024
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert int(a.max()) < VOCAB and root


def test_batches_are_shifted_windows_and_reproducible():
    data = torch.arange(100) % VOCAB
    (x, y), *_ = make_batches(data, 3, batch=2, seq_len=5, seed=1)
    assert x.shape == y.shape == (2, 5)
    assert torch.equal(x[:, 1:], y[:, :-1])
    (x2, _), *_ = make_batches(data, 3, batch=2, seq_len=5, seed=1)
    assert torch.equal(x, x2)


def test_cell_and_lstm_models_give_logits_over_the_vocabulary():
    x = torch.randint(0, VOCAB, (3, 7))
    for cell in (False, True):
        assert CharLM(hidden=8, layers=2, emb=4, cell=cell)(x).shape == (3, 7, VOCAB)


def test_tiny_demo_runs_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(["demo", *TINY, "--out", str(out), "--store", str(tmp_path / "store.json")])
    text = capsys.readouterr().out
    assert rc == 0, text  # 0: the eager and autopar loss curves agree
    for word in ("AGREE", "speedup", "predicted"):  # the output explains itself
        assert word in text, word
    for name in ("loss.png", "losses.csv", "program.py", "profile.csv", "plan.json"):
        assert (out / name).stat().st_size > 0, name
    assert list(out.glob("gantt*.png"))
    assert "def " in (out / "program.py").read_text()
    assert str(out) in text  # says where the files are


def test_tiny_demo_with_nn_lstm(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", *TINY, "--nn-lstm", "--out", str(out), "--store", str(tmp_path / "s.json")]
    assert main(args) == 0, capsys.readouterr().out
    assert (out / "loss.png").exists()


def test_compare_curves_allows_growing_rounding_drift_but_not_a_different_start():
    same_start = [3.0] * 10 + [2.0] * 30
    drifted = [3.0] * 10 + [2.0 + 0.01 * (-1) ** i for i in range(30)]
    assert compare_curves(same_start, drifted, tol=0.05)[0]
    assert not compare_curves(same_start, [x + 0.01 for x in same_start], tol=0.05)[0]
    assert not compare_curves(same_start, [3.0] * 10 + [2.2] * 30, tol=0.05)[0]
