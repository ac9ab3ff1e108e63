"""Data files to batches (text, chat, resumable order) and the loss plot."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
from transformers import AutoTokenizer

from flashdsa.train.data import TokenBatches, eval_batches, read_documents, split_stream, token_stream
from flashdsa.train.plot import save_loss_png


def test_jsonl_reads_text_and_renders_chat_messages(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "KING:"}, {"role": "assistant", "content": "Good day."}]
    path.write_text(json.dumps({"text": "hear my lord"}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    docs = read_documents(path, tokenizer)
    assert docs == ["hear my lord", tokenizer.apply_chat_template(chat, tokenize=False)]
    assert "Good day." in docs[1]
    stream = token_stream(docs, tokenizer)
    assert stream.dtype == torch.int64 and (stream == tokenizer.eos_token_id).sum() == 2
    assert tokenizer.decode(stream[: stream.tolist().index(tokenizer.eos_token_id)]) == "hear my lord"


@pytest.mark.parametrize("content,match", [('{"prompt": "x"}\n', "needs a string 'text'"), ("", "no documents")])
def test_bad_data_files_say_what_is_wrong(tiny_model_dir, tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_documents(path, AutoTokenizer.from_pretrained(tiny_model_dir))
    with pytest.raises(ValueError, match=".txt or .jsonl"):
        read_documents(tmp_path / "data.csv", None)


def test_batches_cover_each_epoch_once_and_resume_at_the_same_place():
    tokens = torch.arange(1000)
    batches = TokenBatches(tokens, seq_len=10, batch_size=1, seed=3)
    starts = []
    while True:
        row = next(batches)[0]
        if batches.epoch > 0:
            break
        assert row.shape == (11,) and torch.equal(row[1:], row[:-1] + 1)  # contiguous windows
        starts.append(int(row[0]))
    offset = min(starts)
    assert sorted(starts) == list(range(offset, 1000 - 10, 10)) and starts != sorted(starts)  # each once, shuffled
    batches = TokenBatches(tokens, seq_len=10, batch_size=7, seed=3)
    for _ in range(20):
        next(batches)
    resumed = TokenBatches(tokens, seq_len=10, batch_size=7, seed=0)
    resumed.load_state_dict(batches.state_dict())
    for _ in range(20):
        assert torch.equal(next(batches), next(resumed))


def test_held_out_split_is_the_tail_and_eval_batches_are_fixed():
    tokens = torch.arange(500)
    train, held = split_stream(tokens, 0.2, seq_len=16)
    assert torch.equal(torch.cat([train, held]), tokens) and len(held) == 100
    batches = eval_batches(held, seq_len=16, batch_size=4, max_tokens=80)
    assert [b.shape[0] for b in batches] == [4, 1] and batches[0][0, 0] == 400
    with pytest.raises(ValueError, match="too few"):
        split_stream(torch.arange(20), 0.5, seq_len=16)


def test_loss_plot_is_a_png_of_the_figure_size(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "loss.png"
    assert save_loss_png(path, [("loss", [(1, 3.0), (2, 2.5), (3, 1.0)]), ("eval loss", [(3, 2.0)])])
    pixels = image.imread(path)
    assert pixels.shape[:2] == (500, 800) and pixels.std() > 0  # 8 x 5 inches at 100 dpi, something drawn
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]  # no temporary file left


def test_loss_plot_without_matplotlib_is_skipped_with_one_logged_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING):
        assert not save_loss_png(tmp_path / "loss.png", [("loss", [(1, 3.0)])])
    assert not (tmp_path / "loss.png").exists()
    assert len(caplog.records) == 1 and "flashdsa[train]" in caplog.records[0].getMessage()
