"""Engram compressed token map and n-gram hashing (spec: engram.md §1-§4, §8; numbers.md §4)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from openflash.errors import ConfigError, OpenflashError
from openflash.memory.hashing import (DEAD, EngramHashLayout, EngramHashState, NgramHasher, compress,
                                      find_table_primes, hash_multipliers, is_prime)
from openflash.memory.tokenmap import TokenMap, build_compressed_token_map
from openflash.tokenizer import DEEPSEEK, load_tokenizer

GOLDENS = Path(__file__).parent / "goldens"

# ---- released constants (numbers.md §4, engram.md §8) --------------------------------------------------------

RELEASED = dict(layer_ids=[1, 14], engram_vocab_size=16_000_000, max_ngram=4, n_heads=8)
RELEASED_COMPRESSED = 99_092
RELEASED_ROWS = [384_006_168, 384_016_682]
MULTIPLIERS = {
    1: [76_632_096_046_245, 4_839_876_093_313, 35_959_672_319_349, 73_987_337_458_391],
    14: [67_716_810_739_261, 51_510_806_800_915, 30_921_347_202_721, 82_619_226_485_591],
}
PRIMES = {
    1: [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
        16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
        16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463],
    14: [16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
         16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
         16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889],
}
OFFSETS = {
    1: [0, 16000057, 32000136, 48000217, 64000314, 80000435, 96000564, 112000697, 128000880, 144001069, 160001276,
        176001487, 192001740, 208002017, 224002306, 240002613, 256002934, 272003273, 288003654, 304004047, 320004446,
        336004849, 352005258, 368005705],
    14: [0, 16000477, 32000964, 48001463, 64001970, 80002481, 96003054, 112003663, 128004290, 144004957, 160005626,
         176006319, 192007016, 208007727, 224008456, 240009215, 256009984, 272010765, 288011564, 304012377, 320013196,
         336014037, 352014914, 368015793],
}
# (current, -1, -2, -3) = (10, 20, 30, 40), nothing blocked.
VECTOR_ROWS = {
    1: [10250667, 16051853, 42761335, 48437066, 64953759, 91793642, 97213675, 124972355, 130904169, 147647512,
        174479789, 176217609, 193213014, 209711443, 226459680, 248375762, 266647502, 284737834, 292200621, 319934002,
        327756510, 339491046, 365830131, 381142068],
    14: [13402985, 31185432, 33324312, 50751051, 67464774, 94528317, 100959033, 120176944, 128818944, 152218109,
         160998468, 191796781, 195587060, 214176773, 229162919, 250160180, 260141385, 283855289, 300526134, 319101158,
         333879786, 349356468, 360884307, 370522085],
}


@pytest.fixture(scope="module", autouse=True)
def token_map_cache(tmp_path_factory):
    """Every token map in this file is cached in a private folder, never in the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("openflash_cache")
        mp.setenv("OPENFLASH_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEEPSEEK)


@pytest.fixture(scope="module")
def released_layout() -> EngramHashLayout:
    return EngramHashLayout.create(**RELEASED, compressed_vocab_size=RELEASED_COMPRESSED, pad_compressed_id=2,
                                   expected_num_embeddings=RELEASED_ROWS)


def reference_hash(layout: EngramHashLayout, compressed: list[int]) -> np.ndarray:
    """engram.md §4 written literally, one position at a time over the full history: [S, L, C]."""
    out = np.zeros((len(compressed), len(layout.layer_ids), layout.num_columns), dtype=np.int64)
    for p in range(len(compressed)):
        toks, blocked = [], False
        for k in range(layout.max_ngram):
            src = compressed[max(p - k, 0)]
            blocked = blocked or p < k or src == DEAD
            toks.append(layout.pad_id if blocked else src)
        for j in range(len(layout.layer_ids)):
            products = [t * int(m) for t, m in zip(toks, layout.multipliers[j])]
            v = products[0]
            for n in range(2, layout.max_ngram + 1):
                v ^= products[n - 1]
                for h in range(layout.n_heads):
                    c = (n - 2) * layout.n_heads + h
                    out[p, j, c] = v % int(layout.primes[j, c]) + int(layout.offsets[j, c])
    return out


# ---- layout --------------------------------------------------------------------------------------------------


def test_released_multipliers():
    for lid, expected in MULTIPLIERS.items():
        assert hash_multipliers(lid, RELEASED_COMPRESSED, 4).tolist() == expected


def test_released_primes_offsets_rows(released_layout):
    assert find_table_primes(**RELEASED) == [PRIMES[1], PRIMES[14]]
    assert released_layout.primes.tolist() == [PRIMES[1], PRIMES[14]]
    assert released_layout.offsets.tolist() == [OFFSETS[1], OFFSETS[14]]
    assert released_layout.table_rows.tolist() == RELEASED_ROWS
    assert released_layout.multipliers.tolist() == [MULTIPLIERS[1], MULTIPLIERS[14]]
    assert released_layout.num_columns == 24


def test_is_prime_matches_trial_division():
    def slow(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(2000) if is_prime(n)] == [n for n in range(2000) if slow(n)]
    assert is_prime(16000057) and not is_prime(16000059) and not is_prime(3215031751)  # a strong pseudoprime


def test_small_prime_search_shares_the_used_set():
    # The tiny goldens: primes above 39, restarting for every order but never reusing one.
    assert find_table_primes(40, [0, 3], 4, 2) == [[41, 43, 47, 53, 59, 61], [67, 71, 73, 79, 83, 89]]


def test_mismatched_num_embeddings_raises():
    with pytest.raises(ConfigError) as info:
        EngramHashLayout.create(**RELEASED, compressed_vocab_size=RELEASED_COMPRESSED, pad_compressed_id=2,
                                expected_num_embeddings=[384_006_168, 384_016_683])
    message = str(info.value)
    assert "engram_num_embeddings" in message and "384016683" in message and "384016682" in message


def test_pad_outside_compressed_vocab_raises():
    with pytest.raises(ConfigError, match="pad"):
        EngramHashLayout.create(**RELEASED, compressed_vocab_size=10, pad_compressed_id=10)


def test_layout_fingerprint(released_layout):
    again = EngramHashLayout.create(**RELEASED, compressed_vocab_size=RELEASED_COMPRESSED, pad_compressed_id=2)
    other = EngramHashLayout.create(**RELEASED, compressed_vocab_size=RELEASED_COMPRESSED + 1, pad_compressed_id=2)
    assert released_layout.layout_fingerprint() == again.layout_fingerprint()
    assert released_layout.layout_fingerprint() != other.layout_fingerprint()  # other multipliers
    assert len(released_layout.layout_fingerprint()) == 64
    with pytest.raises(ValueError):
        released_layout.primes[0, 0] = 1  # the layout is immutable


# ---- hashing ---------------------------------------------------------------------------------------------------


def test_spec_hash_vectors(released_layout):
    hasher = NgramHasher(released_layout)
    rows, state = hasher.hash(torch.tensor([[40, 30, 20, 10]]), hasher.empty_state(1))
    assert rows.shape == (1, 4, 2, 24) and rows.dtype == torch.int64
    assert rows[0, 3, 0].tolist() == VECTOR_ROWS[1]
    assert rows[0, 3, 1].tolist() == VECTOR_ROWS[14]
    assert state.history.tolist() == [[30, 20, 10]]
    # Each id lies inside its column's range.
    lo = torch.from_numpy(released_layout.offsets.copy())
    assert bool(((rows >= lo) & (rows < lo + torch.from_numpy(released_layout.primes.copy()))).all())


def test_matches_literal_spec_on_random_sequences(released_layout):
    hasher = NgramHasher(released_layout)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, RELEASED_COMPRESSED, (3, 40), generator=gen)
    ids[torch.rand(3, 40, generator=gen) < 0.15] = DEAD
    rows, _ = hasher.hash(ids, hasher.empty_state(3))
    for b in range(3):
        assert np.array_equal(rows[b].numpy(), reference_hash(released_layout, ids[b].tolist()))


def test_dead_token_blocks_ngrams_across_it(released_layout):
    hasher = NgramHasher(released_layout)
    a, b, c, d, e = 11, 12, 13, 14, 15
    token_ids = torch.tensor([[a, b, c, 99, d, e]])
    token_map = torch.arange(100) + 1000  # stand-in map: token t -> compressed 1000 + t
    mask = torch.tensor([[True, True, True, False, True, True]])
    compressed = compress(token_ids, token_map, mask)
    assert compressed.tolist() == [[1011, 1012, 1013, DEAD, 1014, 1015]]
    rows, state = hasher.hash(compressed, hasher.empty_state(1))
    fresh, _ = hasher.hash(compressed[:, 4:], hasher.empty_state(1))
    # After the image token the text hashes exactly as at a sequence start.
    assert torch.equal(rows[:, 4:], fresh)
    # The DEAD position itself: every slot is the pad id.
    pad_only, _ = hasher.hash(torch.full((1, 1), released_layout.pad_id), EngramHashState(torch.full((1, 3), 2)))
    assert torch.equal(rows[:, 3], pad_only[:, 0])
    # Without the mask the n-grams do span the position.
    unmasked, _ = hasher.hash(compress(token_ids, token_map), hasher.empty_state(1))
    assert not torch.equal(unmasked[:, 4:], fresh)
    assert state.history.tolist() == [[DEAD, 1014, 1015]]


def test_bad_ids_raise(released_layout):
    hasher = NgramHasher(released_layout)
    with pytest.raises(OpenflashError, match="99092"):
        hasher.hash(torch.tensor([[RELEASED_COMPRESSED]]), hasher.empty_state(1))
    with pytest.raises(OpenflashError, match="token id 7"):
        compress(torch.tensor([[1, 7]]), torch.arange(5))


def test_state_regrouping_and_lengths(released_layout):
    hasher = NgramHasher(released_layout)
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, 5000, (3, 9), generator=gen)
    full, _ = hasher.hash(seqs, hasher.empty_state(3))
    # Rows 0 and 2 prefilled together, row 1 alone (its history shorter), then one decode step as a regrouped batch.
    _, s02 = hasher.hash(seqs[[0, 2], :8], hasher.empty_state(2))
    _, s1 = hasher.hash(seqs[[1], :5], EngramHashState.empty(1))
    _, s1 = hasher.hash(seqs[[1], 5:8], s1)
    batch = EngramHashState.concat([s02.select([1]), s1, s02.select([0])])  # rows 2, 1, 0
    snapshot = batch.clone()
    step, _ = hasher.hash(seqs[[2, 1, 0], 8:], batch)
    assert torch.equal(step[:, 0], full[[2, 1, 0], 8])
    assert torch.equal(batch.history, snapshot.history)  # hash() does not mutate its input state
    # Right-padded ragged batch: the new state ends at each row's last real token.
    lengths = torch.tensor([8, 5, 7])
    _, ragged = hasher.hash(seqs[:, :8], hasher.empty_state(3), lengths=lengths)
    for b in range(3):
        n = int(lengths[b])
        assert ragged.history[b].tolist() == seqs[b, n - 3:n].tolist()
    # A state with a short history reads the missing part as DEAD.
    assert EngramHashState.concat([EngramHashState.empty(1), s1]).history[0].tolist() == [DEAD] * 3


# ---- token map -------------------------------------------------------------------------------------------------


def _golden(name: str) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    folder = GOLDENS / name
    config = json.loads((folder / "config.json").read_text())["text_config"]
    inputs = json.loads((folder / "inputs.json").read_text())
    with safe_open(str(folder / "expected.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "engram_hash" in k or "input_token" in k
                   or k == "engram.token_map"}
    return config, inputs, tensors


@pytest.mark.parametrize("name", ["A", "A2"])
def test_golden_token_map(name, tokenizer):
    config, _, expected = _golden(name)
    token_map = TokenMap.build(tokenizer, config["vocab_size"], config["engram_pad_token_id"],
                               expected_compressed_vocab_size=config["engram_compressed_vocab_size"])
    assert np.array_equal(token_map.ids, expected["engram.token_map"].numpy())
    assert token_map.compressed_vocab_size == 850
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        TokenMap.build(tokenizer, config["vocab_size"], 2, expected_compressed_vocab_size=851)


@pytest.mark.parametrize("name", ["A", "A2"])
def test_golden_hashes(name, tokenizer):
    config, inputs, expected = _golden(name)
    token_map = TokenMap.build(tokenizer, config["vocab_size"], config["engram_pad_token_id"])
    layout = EngramHashLayout.create(
        config["engram_layer_ids"], config["engram_vocab_size"], config["engram_max_ngram_size"],
        config["engram_n_heads"], token_map.compressed_vocab_size, token_map.pad_id,
        expected_num_embeddings=config["engram_num_embeddings"])
    hasher = NgramHasher(layout)
    prompt = hasher.compress(torch.tensor(inputs["input_ids"]), token_map)
    steps = [hasher.compress(expected[f"decode{t}.input_token"].view(1, 1), token_map)
             for t in range(inputs["decode_steps"])]

    def run(chunks: list[int]) -> None:
        state, pieces, start = hasher.empty_state(1), [], 0
        for size in chunks:
            rows, state = hasher.hash(prompt[:, start:start + size], state)
            pieces.append(rows)
            start += size
        assert torch.equal(torch.cat(pieces, dim=1), expected["prefill.engram_hash"])
        for t, step in enumerate(steps):
            rows, state = hasher.hash(step, state)
            assert torch.equal(rows, expected[f"decode{t}.engram_hash"]), t

    run([prompt.shape[1]])
    rng = random.Random(name)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, prompt.shape[1]), rng.randint(1, min(6, prompt.shape[1] - 1))))
        run([b - a for a, b in zip([0] + cuts, cuts + [prompt.shape[1]])])


def test_released_token_map(tokenizer):
    assert tokenizer.get_vocab_size(with_added_tokens=True) > 129264  # covers the image token id
    ids = build_compressed_token_map(tokenizer)
    assert ids.dtype == np.int64 and ids.shape == (tokenizer.get_vocab_size(with_added_tokens=True),)
    assert int(ids.max()) + 1 == RELEASED_COMPRESSED
    token_map = TokenMap.build(tokenizer, None, 2, expected_compressed_vocab_size=RELEASED_COMPRESSED)
    assert token_map.pad_id == int(ids[2])
    # First occurrences, in token-id order, hand out 0, 1, 2, ... (the smallest token id fixes each key's id).
    first = np.sort(np.unique(ids, return_index=True)[1])
    assert np.array_equal(ids[first], np.arange(RELEASED_COMPRESSED))
    assert np.all(np.maximum.accumulate(ids) <= np.arange(len(ids)))


def test_token_map_rules(tokenizer):
    ids = build_compressed_token_map(tokenizer)
    vocab = {tok: i for i, tok in enumerate(tokenizer.id_to_token(i) for i in range(400))}
    # Case and a leading space normalise away: "A" / "a" / " a" (Ġa) share one compressed id.
    assert ids[vocab["A"]] == ids[vocab["a"]] == ids[vocab["Ġa"]]
    # Special tokens decode literally and normalise (NFKC folds full-width bars) to distinct keys.
    assert len({int(ids[0]), int(ids[1]), int(ids[2])}) == 3
    # A lone space survives Strip as " " (sentinel trick); a newline collapses to " " too. Without the sentinel
    # both would normalise to "" and fall back to their distinct decoded texts.
    space, newline = tokenizer.token_to_id("Ġ"), tokenizer.token_to_id("Ċ")
    assert ids[space] == ids[newline]  # both become " " after the whitespace rule
    assert ids[space] != ids[vocab["a"]]


def test_token_map_cache(tokenizer, token_map_cache):
    folder = token_map_cache / "token_maps"
    before = set(folder.glob("*.npy")) if folder.exists() else set()
    cold = build_compressed_token_map(tokenizer, 300)
    new = set(folder.glob("*.npy")) - before
    assert len(new) == 1 and not list(folder.glob("*.tmp"))
    path = new.pop()
    assert np.array_equal(np.load(path), cold)
    assert np.array_equal(build_compressed_token_map(tokenizer, 300), cold)
    path.write_bytes(b"not a numpy file")
    with pytest.warns(UserWarning, match="rebuilding"):
        assert np.array_equal(build_compressed_token_map(tokenizer, 300), cold)
    assert np.array_equal(np.load(path), cold)  # rewritten
    with pytest.raises(ConfigError, match="num_ids"):
        build_compressed_token_map(tokenizer, 10**7)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(OpenflashError, match="missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(OpenflashError, match=str(bad)):
        load_tokenizer(tmp_path)


# ---- CLI -------------------------------------------------------------------------------------------------------


def test_cli_hash_json(capsys, tokenizer, released_layout):
    from openflash.commands.engram import hash_text as cli_hash

    text = "Hello world, hello World"
    assert cli_hash(argparse.Namespace(config="flash", tokenizer=None, text=text, json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    token_ids = tokenizer.encode(text).ids
    assert out["token_ids"] == token_ids
    assert out["compressed_vocab_size"] == RELEASED_COMPRESSED
    assert out["table_rows"] == {"1": RELEASED_ROWS[0], "14": RELEASED_ROWS[1]}
    assert out["primes"] == {"1": PRIMES[1], "14": PRIMES[14]}
    ids = build_compressed_token_map(tokenizer)
    assert out["compressed_ids"] == ids[token_ids].tolist()
    rows, _ = NgramHasher(released_layout).hash(torch.tensor([out["compressed_ids"]]), EngramHashState.empty(1))
    assert out["hash_ids"] == {"1": rows[0, :, 0].tolist(), "14": rows[0, :, 1].tolist()}
    # "world" after "hello" in both cases: the bigram rows repeat, the trigram rows differ (", " vs "hello").
    assert out["hash_ids"]["1"][1][:8] == out["hash_ids"]["1"][4][:8]
    assert out["hash_ids"]["1"][1][8:] != out["hash_ids"]["1"][4][8:]

    assert cli_hash(argparse.Namespace(config="flash", tokenizer=None, text=text, json=False)) == 0
    printed = capsys.readouterr().out
    assert "384,006,168" in printed and "99092" in printed


def test_cli_hash_checks_compressed_vocab(tmp_path):
    from openflash.commands.engram import hash_text as cli_hash

    data = json.loads((GOLDENS / "A" / "config.json").read_text())
    data["text_config"]["engram_compressed_vocab_size"] = 851
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size") as info:
        cli_hash(argparse.Namespace(config=str(path), tokenizer=None, text="a", json=True))
    assert "851" in str(info.value) and "850" in str(info.value) and str(path) in str(info.value)
