"""Incremental detokenization: whole characters only, stop strings cut and held back."""

from flashdsa.runtime.detokenizer import Detokenizer


def byte_token_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet), so characters split across tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [tok.convert_tokens_to_ids(chars[b]) for b in text.encode("utf-8")]


def test_multibyte_characters_are_released_only_when_complete(tok):
    text = "aé日本語🙂 z"
    ids = byte_token_ids(tok, text)
    assert len(ids) > len(text)
    detok = Detokenizer(tok, [5, 6], stop=[])
    released = []
    for i, t in enumerate(ids):
        detok.add_token(t, final=i == len(ids) - 1)
        piece = detok.delta(finished=False)
        assert "\ufffd" not in piece
        released.append(piece)
    assert "".join(released) + detok.delta(finished=True) == text
    assert released[1] == "" and released[2] == "é"  # é is two bytes


def test_stop_string_cuts_the_text_and_is_held_back_while_streaming(tok):
    ids = tok.encode("the quick brown fox", add_special_tokens=False)
    detok = Detokenizer(tok, [], stop=["brown", "zzz"])
    streamed, stop = "", None
    for t in ids:
        stop = detok.add_token(t)
        streamed += detok.delta(finished=stop is not None)
        assert not streamed.endswith("b") or stop is not None  # a possible stop start is held back
        if stop:
            break
    assert stop == "brown" and streamed == "the quick " == detok.text


def test_include_stop_str_keeps_it(tok):
    detok = Detokenizer(tok, [], stop=["fox"], include_stop=True)
    for t in tok.encode("the fox jumps", add_special_tokens=False):
        if detok.add_token(t):
            break
    assert detok.text == "the fox"


def test_a_request_ending_inside_a_character_releases_it_as_a_replacement(tok):
    ids = byte_token_ids(tok, "ok🙂")[:-1]  # the emoji's last byte never comes
    detok = Detokenizer(tok, [], stop=[])
    for i, t in enumerate(ids):
        detok.add_token(t, final=i == len(ids) - 1)
    assert detok.delta(finished=True) == tok.decode(ids) == "ok\ufffd"


def test_a_prompt_ending_inside_a_character_adds_nothing_to_the_output(tok):
    prompt = byte_token_ids(tok, "say 日")[:-1]  # the prompt stops inside 日
    output = tok.encode(" fine words", add_special_tokens=False)
    detok = Detokenizer(tok, prompt, stop=[])
    for t in output:
        detok.add_token(t)
    assert detok.delta(finished=True) == " fine words"


def test_special_tokens_are_skipped(tok):
    detok = Detokenizer(tok, [], stop=[])
    for t in [tok.eos_token_id, *tok.encode("plain", add_special_tokens=False), tok.bos_token_id]:
        detok.add_token(t)
    assert detok.delta(finished=True) == "plain"
