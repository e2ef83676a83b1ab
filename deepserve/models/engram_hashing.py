"""Engram's n-gram hashing (§2.9): the compressed vocabulary, the per-layer odd multipliers (NumPy's PCG64 and
SeedSequence reimplemented in plain Python, checked against NumPy in the tests) and the prime table sizes.

Pure integer work with no model weights: the reference forward and the engine's V4.1 model share it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from deepserve.models.deepseek_v41_config import DeepseekV41Config


_M32, _M64, _M128 = (1 << 32) - 1, (1 << 64) - 1, (1 << 128) - 1


class PCG64:
    """NumPy's `default_rng(seed)` bit generator (SeedSequence -> PCG64 XSL-RR), in plain Python, so the
    Engram multipliers match §2.9 without NumPy. Only what `integers(0, high, dtype=int64)` needs."""

    MULT = (2549297995355413924 << 64) + 4865540595714422341

    def __init__(self, seed: int) -> None:
        s = _seed_sequence_words(seed, 4)
        self.inc = ((((s[2] << 64) | s[3]) << 1) | 1) & _M128
        self.state = 0
        self._step()
        self.state = (self.state + ((s[0] << 64) | s[1])) & _M128
        self._step()

    def _step(self) -> None:
        self.state = (self.state * self.MULT + self.inc) & _M128

    def next_uint64(self) -> int:
        self._step()
        x = ((self.state >> 64) ^ self.state) & _M64
        rot = self.state >> 122
        return ((x >> rot) | (x << ((64 - rot) & 63))) & _M64

    def integers(self, high: int, size: int) -> list[int]:
        """`Generator.integers(0, high, size, dtype=np.int64)`: Lemire's bounded method, 64-bit branch."""
        rng = high - 1
        if rng <= _M32:
            raise NotImplementedError("bounds below 2^32 use NumPy's buffered 32-bit path (compressed vocab "
                                      "sizes above 2^30), not reproduced here")
        out = []
        for _ in range(size):
            m = self.next_uint64() * high
            if m & _M64 < high:
                threshold = (_M64 - rng) % high
                while m & _M64 < threshold:
                    m = self.next_uint64() * high
            out.append(m >> 64)
        return out


def _seed_sequence_words(seed: int, n_words64: int) -> list[int]:
    """numpy.random.SeedSequence(seed).generate_state(n, uint64) (pool size 4, no spawn key)."""
    entropy = []
    while True:
        entropy.append(seed & _M32)
        seed >>= 32
        if not seed:
            break
    hash_const = [0x43B0D7E5]

    def hashmix(value: int) -> int:
        value ^= hash_const[0]
        hash_const[0] = (hash_const[0] * 0x931E8875) & _M32
        value = (value * hash_const[0]) & _M32
        return value ^ (value >> 16)

    def mix(x: int, y: int) -> int:
        r = (0xCA01F9DD * x - 0x4973F715 * y) & _M32
        return r ^ (r >> 16)

    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    words, hb = [], 0x8B51F9DD
    for i in range(2 * n_words64):
        v = pool[i % 4] ^ hb
        hb = (hb * 0x58F38DED) & _M32
        v = (v * hb) & _M32
        words.append(v ^ (v >> 16))
    return [words[2 * i] | (words[2 * i + 1] << 32) for i in range(n_words64)]


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):       # deterministic below 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_compressed_vocab_size(config: DeepseekV41Config) -> int:
    # Reading: Vc = engram_compressed_vocab_size when truthy (compressed tokenizer), else vocab_size (identity).
    return config.engram_compressed_vocab_size or config.vocab_size


def engram_multipliers(config: DeepseekV41Config, layer_id: int) -> list[int]:
    """§2.9: u_r = 2·randint(0, b) + 1 (r < M) from default_rng(10007·layer_id), b = max(1, (2^63-1)//Vc//2)."""
    b = max(1, (2 ** 63 - 1) // engram_compressed_vocab_size(config) // 2)
    return [2 * r + 1 for r in PCG64(10007 * layer_id).integers(b, config.engram_max_ngram_size)]


def engram_table_primes(config: DeepseekV41Config) -> dict[int, list[list[int]]]:
    """§2.9: layer -> [n-gram size n = 2..M][head h] -> table size P. Per layer (config order) and n, start from
    engram_vocab_size - 1 and take successive next primes (> start), skipping primes used anywhere."""
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in config.engram_layer_ids:
        per_n = []
        for _n in range(2, config.engram_max_ngram_size + 1):
            start, heads = config.engram_vocab_size - 1, []
            for _h in range(config.engram_n_heads):
                p = start + 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                heads.append(p)
                start = p
            per_n.append(heads)
        out[layer] = per_n
    return out


def normalize_engram_text(text: str) -> str:
    """§2.9 key: NFKC -> NFD -> strip accents -> lowercase -> collapse whitespace runs to " " -> strip, a lone
    space preserved. # Reading: "whitespace" = [ \\t\\r\\n] (the Engram release's regex); accents = Mn marks."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    return s if s == " " else s.strip()


def engram_compressed_ids(decoded: Sequence[str], raw_tokens: Sequence[str]) -> list[int]:
    """§2.9 compressed vocabulary: token id -> dense compressed id in first-seen order. decoded[i] = the single
    token decoded, raw_tokens[i] = its raw token string (the key when the text contains U+FFFD).
    # Reading: a text that normalises to "" keeps its raw decoded text as key (the Engram release does so)."""
    keys: dict[str, int] = {}
    out = []
    for text, raw in zip(decoded, raw_tokens):
        key = raw if "\ufffd" in text else (normalize_engram_text(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return out
