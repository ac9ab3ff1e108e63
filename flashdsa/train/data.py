"""Training data: text files to one token stream, a held-out tail, and resumable batches.

Accepted files: ``.txt`` (the whole file is one document) and ``.jsonl`` (one JSON object a line,
with ``"text"`` or chat ``"messages"`` rendered through the tokenizer's chat template). Every
document ends with the EOS token, then all are concatenated; the last ``eval_fraction`` of the
stream is held out for the evaluation loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashdsa.models.chat_template import apply_chat_template


def read_documents(path: str | Path, tokenizer) -> list[str]:
    """The documents of a ``.txt`` or ``.jsonl`` file as strings (chats rendered by the chat template).
    ValueError naming the file (and line) when it holds none or a line is malformed."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"data must be a .txt or .jsonl file, got {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        documents = [text] if text.strip() else []
    else:
        lines = enumerate(text.splitlines(), start=1)
        documents = [_jsonl_document(f"{path}:{number}", line, tokenizer) for number, line in lines if line.strip()]
    if not documents:
        raise ValueError(f"data file {path} holds no documents")
    return documents


def _jsonl_document(where: str, line: str, tokenizer) -> str:
    """One JSONL line's document: its ``text``, or its chat ``messages`` through the chat template."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    if not (isinstance(record, dict) and isinstance(record.get("messages"), list)):
        raise ValueError(f"{where}: each line needs a string 'text' or a list 'messages'")
    try:
        return apply_chat_template(tokenizer, record["messages"])
    except Exception as exc:  # jinja raises its own errors on messages the template cannot render
        raise ValueError(f"{where}: the chat template cannot render these messages ({exc})") from exc


def token_stream(documents: list[str], tokenizer) -> torch.Tensor:
    """``[N] int64``: each document's token ids ending with one EOS (a chat rendered by the chat
    template ends with it already), all concatenated."""
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        if ids[-1:] != [tokenizer.eos_token_id]:
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


def split_stream(tokens: torch.Tensor, eval_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out): the held-out part is the tail, at least one window of ``seq_len + 1`` tokens."""
    n_eval = max(int(len(tokens) * eval_fraction), seq_len + 1)
    if len(tokens) - n_eval < seq_len + 1:
        raise ValueError(f"data has {len(tokens)} tokens: too few for seq_len {seq_len} plus a held-out split")
    return tokens[:-n_eval], tokens[-n_eval:]


class TokenBatches:
    """Batches ``[batch_size, seq_len + 1]`` of windows from ``tokens``, resumable exactly.

    Each epoch cuts the stream into non-overlapping windows from a random offset and visits them
    in a random order; both depend only on ``(seed, epoch)``, so ``state_dict`` (epoch and the
    position inside it) is all a resume needs.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0):
        if len(tokens) < 2 * (seq_len + 1):
            need = 2 * (seq_len + 1)
            raise ValueError(f"need at least {need} training tokens for seq_len {seq_len}, got {len(tokens)}")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.epoch, self.position = 0, 0
        self._plan()

    def _plan(self) -> None:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        offset = int(torch.randint(0, self.seq_len, (1,), generator=generator))
        count = (len(self.tokens) - 1 - offset) // self.seq_len
        self._starts = offset + torch.randperm(count, generator=generator) * self.seq_len

    def __iter__(self) -> "TokenBatches":
        return self

    def __next__(self) -> torch.Tensor:
        rows = []
        while len(rows) < self.batch_size:
            if self.position == len(self._starts):
                self.epoch, self.position = self.epoch + 1, 0
                self._plan()
            start = int(self._starts[self.position])
            rows.append(self.tokens[start : start + self.seq_len + 1])
            self.position += 1
        return torch.stack(rows)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._plan()


def eval_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int) -> list[torch.Tensor]:
    """Fixed batches ``[<= batch_size, seq_len + 1]`` of consecutive windows of the held-out stream."""
    count = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    windows = torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)])
    return list(windows.split(batch_size))
