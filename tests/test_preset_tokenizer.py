"""Presets come with a tokenizer that fits their vocabulary: the DeepSeek tokenizer cut to the preset's ids."""

from __future__ import annotations

import subprocess
import sys

import pytest

from openflash.config import load_config
from openflash.memory.tokenmap import TokenMap
from openflash.tokenizer import DEEPSEEK, load_tokenizer, preset_tokenizer

TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "Ünïcödé, 漢字, emoji 😀 and\ttabs\r\n", "x" * 300, " ", "<｜User｜>hi<｜Assistant｜>"]


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_preset_tokenizer_fits_the_vocabulary(preset):
    cfg = load_config(preset)
    tok = preset_tokenizer(cfg)
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size
    full = load_tokenizer(DEEPSEEK)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids and max(ids) < cfg.vocab_size, text
        assert tok.decode(ids) == text
    # Every kept token has its DeepSeek id and text, so the Engram token map is the config's.
    for i in (0, 1, 2, 3, 258, 259, cfg.vocab_size - 1):
        assert tok.id_to_token(i) == full.id_to_token(i)
    assert TokenMap.for_config(tok, cfg).compressed_vocab_size == cfg.engram_compressed_vocab_size
    for word in ("the", " return", "import os", "self.x"):  # DeepSeek's own pieces, where it has them below the cut
        if max(full.encode(word).ids) < cfg.vocab_size:
            assert tok.encode(word).ids == full.encode(word).ids, word


def test_released_preset_keeps_the_full_tokenizer():
    assert preset_tokenizer(load_config("flash")).get_vocab_size(with_added_tokens=True) == 129280


def test_generate_on_a_preset_takes_any_text():
    """`openflash generate --model small` with a text prompt (it used to fail: ids beyond the preset vocabulary)."""
    out = subprocess.run([sys.executable, "-m", "openflash.cli", "generate", "--model", "tiny", "--prompt",
                          "def fibonacci(n): 😀", "--max-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "3 generated" in out.stdout


def test_a_cut_needs_the_byte_tokens():
    from openflash.errors import ConfigError
    from openflash.tokenizer import deepseek_tokenizer_for_vocab

    with pytest.raises(ConfigError, match="cut to 100 ids needs 259"):
        deepseek_tokenizer_for_vocab(100)
    with pytest.raises(ConfigError, match="would be the whole tokenizer"):
        deepseek_tokenizer_for_vocab(129280)
