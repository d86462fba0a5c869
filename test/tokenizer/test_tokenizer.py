from __future__ import annotations

import pytest

from models_zoo import model_path
from specserve.tokenizer.detokenizer import DetokState, detok_flush, detok_step
from specserve.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(model_path("qwen3"))


def test_chat_template_and_eos(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.encode("<|im_end|>")[0] in tok.eos_token_ids


def test_bad_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer_path"):
        Tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="tokenizer_path"):
        Tokenizer(str(tmp_path))


@pytest.mark.parametrize("text", ["plain ascii words", "é😀日本 mixed ✓ ok", "🙂🙂🙂"])
def test_incremental_detok_equals_full_decode_and_never_splits_a_char(
    tok: Tokenizer, text: str
) -> None:
    prompt = tok.encode("context: ")
    ids = tok.encode(text)
    state = DetokState.start(prompt)
    pieces = []
    for t in ids:
        piece, state = detok_step(tok, state, t, True)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok_flush(tok, state, True))
    assert "".join(pieces) == tok.decode(ids) == text
    assert len(state.window) <= 8  # the window stays short


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers_decode(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("<|im_start|>user\nnaïve 😀 text<|im_end|>")
    assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_token_bytes_rebuild_text_even_across_split_characters(tok: Tokenizer) -> None:
    text = "naïve 😀 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.token_text(i) for i in ids)  # some tokens hold partial characters
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_every_thread_has_its_own_tokenizer_and_they_agree() -> None:
    """HF fast tokenizers fail ("Already borrowed") when a thread changes the
    Rust tokenizer's settings while another uses it: threads never share one."""
    import threading

    tok = Tokenizer(model_path("qwen3"))
    texts = [f"def f{i}(x):\n    return x * {i}\n" * (i % 5 + 1) for i in range(40)]
    want = [tok.encode(t) for t in texts]
    seen: dict[int, object] = {}
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            hf = tok.hf
            seen[k] = hf
            # What makes a shared tokenizer fail: changing its settings mid-use.
            hf._tokenizer.enable_truncation(10_000)
            hf._tokenizer.no_truncation()
            got[k] = [tok.encode(t) for t in texts]
            assert tok.decode(got[k][k]) == tok.decode(want[k])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(g == want for g in got.values())
    assert len({id(h) for h in seen.values()} | {id(tok.hf)}) == 9
