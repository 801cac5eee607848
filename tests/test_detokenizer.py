import json
import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from checkpoints import CORPUS, save_tokenizer
from kvserve.engine.detokenizer import IncrementalDetokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]
TEXTS = CORPUS + ["Hello world, Café 東京 🚀🔥 naïve Łódź こんにちは ∑√π → done."]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    """GPT-2 style byte-level BPE with <|endoftext|>, <|im_start|>, <|im_end|> specials."""
    return save_tokenizer(tmp_path_factory.mktemp("bpe"))


def _wrap(tok: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    tok.add_special_tokens(SPECIALS)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def metaspace():
    """SentencePiece-style: '▁' marks spaces; the decoder drops the first token's space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return _wrap(tok)


@pytest.fixture(scope="module")
def byte_fallback():
    """Llama-2 style: ASCII BPE plus <0xNN> byte tokens, decoder ending in Strip(' ', 1, 0)."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False)
    base.train_from_iterator([t for t in CORPUS if t.isascii()] * 4, trainer=trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = base.normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return _wrap(tok)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None) -> list[str]:
    """Feed ids (one at a time, or in the given chunk sizes); the last call has finished=True."""
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        chunk, i = ids[i : i + n], i + n
        deltas.append(detok.update(chunk, finished=i >= len(ids)))
    return deltas


def random_ids(rng: random.Random, tok, length: int) -> list[int]:
    """Uniformly random ids, except that <0xNN> byte-fallback tokens only come as whole
    UTF-8 characters: ByteFallback turns every byte of an invalid run into U+FFFD, so
    a later invalid byte can change text that was already valid (and streamed)."""
    byte_tokens = {i for t, i in tok.get_vocab().items() if t.startswith("<0x")}
    ids = []
    while len(ids) < length:
        i = rng.randrange(len(tok))
        if i in byte_tokens:
            ids += tok.encode(rng.choice("é東京🚀ł√"), add_special_tokens=False)
        else:
            ids.append(i)
    return ids


# ---- streaming equals full decode ----


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("tok_name", ["byte_bpe", "byte_fallback", "metaspace"])
def test_stream_equals_decode_of_random_ids(request, tok_name, skip):
    """Random ids: invalid UTF-8, split characters, specials anywhere, odd chunking."""
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(0)
    for _ in range(60):
        ids = random_ids(rng, tok, rng.randrange(1, 40))
        detok = IncrementalDetokenizer(tok, [], skip, [])
        chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in ids]
        deltas = stream(detok, ids, chunks)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == detok.output_text == expected


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("tok_name", ["byte_bpe", "byte_fallback"])
def test_stream_equals_decode_of_real_text(request, tok_name, skip):
    tok = request.getfixturevalue(tok_name)
    specials = tok.convert_tokens_to_ids(tok.all_special_tokens)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        # a special token between two whole characters, and at both ends
        whole = [
            k for k in range(len(ids) // 2, len(ids)) if not tok.decode(ids[:k]).endswith("\ufffd")
        ]
        mid = whole[0] if whole else 0
        ids = [specials[1], *ids[:mid], specials[-1], *ids[mid:], specials[0]]
        detok = IncrementalDetokenizer(tok, [], skip, [])
        deltas = stream(detok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas), "a split character leaked as U+FFFD"


def test_byte_level_waits_for_complete_characters(byte_bpe):
    ids = byte_bpe.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is split across tokens
    detok = IncrementalDetokenizer(byte_bpe, [], True, [])
    deltas = [detok.update([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀"


@pytest.mark.parametrize("tok_name", ["byte_bpe", "byte_fallback"])
def test_incomplete_character_flushed_at_finish(request, tok_name):
    tok = request.getfixturevalue(tok_name)
    ids = tok.encode("ok 東", add_special_tokens=False)[:-1]  # drop the last byte of 東
    detok = IncrementalDetokenizer(tok, [], True, [])
    deltas = [detok.update([i]) for i in ids[:-1]] + [detok.update(ids[-1:], finished=True)]
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")
    assert detok.update([ids[0]]) == ""  # finished: nothing more


@pytest.mark.parametrize("tok_name", ["byte_bpe", "byte_fallback", "metaspace"])
def test_prompt_context_gives_the_continuation(request, tok_name):
    """With the prompt as context, the output is decode(prompt + output) minus decode(prompt),
    which keeps the leading space that SentencePiece decoders strip from a first token."""
    tok = request.getfixturevalue(tok_name)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for cut in (1, 3, len(ids) // 2):
            prompt, output = ids[:cut], ids[cut:]
            full = tok.decode(ids, skip_special_tokens=True)
            head = tok.decode(prompt, skip_special_tokens=True)
            if not full.startswith(head) or head.endswith("\ufffd"):
                continue
            detok = IncrementalDetokenizer(tok, prompt, True, [])
            assert "".join(stream(detok, output)) == full[len(head) :]
            if tok_name == "byte_bpe":
                assert detok.output_text == tok.decode(output, skip_special_tokens=True)


def test_metaspace_keeps_leading_space(metaspace):
    ids = metaspace.encode("the quick brown fox", add_special_tokens=False)
    prompt_len = len(metaspace.encode("the quick", add_special_tokens=False))
    detok = IncrementalDetokenizer(metaspace, ids[:prompt_len], True, [])
    assert "".join(stream(detok, ids[prompt_len:])) == " brown fox"
    no_prompt = IncrementalDetokenizer(metaspace, [], True, [])
    assert "".join(stream(no_prompt, ids[prompt_len:])) == "brown fox"


def test_prompt_ending_mid_character_decodes_output_alone(byte_bpe):
    ids = byte_bpe.encode("ab 🚀", add_special_tokens=False)
    cut = len(ids) - 1  # the prompt keeps all but the last token of 🚀
    assert byte_bpe.decode(ids[:cut]).endswith("\ufffd")
    detok = IncrementalDetokenizer(byte_bpe, ids[:cut], True, [])
    assert "".join(stream(detok, ids[cut:] + ids[:2])) == byte_bpe.decode(ids[cut:] + ids[:2])


def test_decode_token(byte_bpe, metaspace):
    detok = IncrementalDetokenizer(byte_bpe, [], True, [])
    the = byte_bpe.encode(" the", add_special_tokens=False)
    assert len(the) == 1 and detok.decode_token(the[0]) == " the"
    eos = byte_bpe.convert_tokens_to_ids("<|endoftext|>")
    assert detok.decode_token(eos) == "<|endoftext|>"  # shown even with skip_special_tokens
    detok = IncrementalDetokenizer(metaspace, [], True, [])
    fox = metaspace.convert_tokens_to_ids("▁fox")
    assert fox != metaspace.unk_token_id and detok.decode_token(fox) == " fox"


# ---- stop strings ----


class CharTokenizer:
    """Token i decodes to VOCAB[i]; lets stop tests choose token boundaries exactly."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab

    def ids(self, *pieces: str) -> list[int]:
        for p in pieces:
            if p not in self.vocab:
                self.vocab.append(p)
        return [self.vocab.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        return self.ids(text)


def run_stop(pieces: list[str], stop: list[str], include: bool = False, finish: bool = True):
    tok = CharTokenizer([])
    detok = IncrementalDetokenizer(tok, [], True, stop, include_stop_str=include)
    ids = tok.ids(*pieces)
    deltas = []
    for n, i in enumerate(ids):
        deltas.append(detok.update([i], finished=finish and n == len(ids) - 1))
        if detok.stop_reason is not None:
            break
    return detok, deltas


def test_stop_string_truncates_and_never_leaks():
    detok, deltas = run_stop(list("Hello ### world"), ["###"])
    assert detok.output_text == "".join(deltas) == "Hello "
    assert detok.stop_reason == "###"
    assert not any("#" in d for d in deltas)
    assert detok.update([0], finished=True) == ""  # done after a stop


def test_stop_string_spanning_tokens():
    detok, deltas = run_stop(["He", "llo #", "#", "# wor", "ld"], ["###"])
    assert detok.output_text == "Hello " and detok.stop_reason == "###"
    assert deltas == ["He", "llo ", "", ""]


def test_partial_match_that_fails_is_released():
    detok, deltas = run_stop(["x", "a", "b", "d", "y"], ["abc"], finish=False)
    assert deltas == ["x", "", "", "abd", "y"]
    assert detok.stop_reason is None and detok.output_text == "xabdy"


def test_held_text_flushed_when_finished():
    detok, deltas = run_stop(["the ", "E", "N"], ["END"])
    assert deltas == ["the ", "", "EN"]
    assert detok.stop_reason is None


def test_include_stop_str():
    detok, deltas = run_stop(["Hi #", "## there"], ["###"], include=True)
    assert deltas == ["Hi #", "##"]  # nothing held back: the stop text is emitted anyway
    assert detok.output_text == "Hi ###"


def test_first_completed_stop_wins():
    detok, _ = run_stop(["Hello world"], ["world", "lo w"])
    assert (detok.output_text, detok.stop_reason) == ("Hel", "lo w")
    detok, _ = run_stop(["abcd"], ["abcd", "c"])
    assert (detok.output_text, detok.stop_reason) == ("ab", "c")
    detok, _ = run_stop(["xabc"], ["bc", "abc"])  # same end: the earlier start wins
    assert (detok.output_text, detok.stop_reason) == ("x", "abc")


def test_stop_in_multibyte_text(byte_bpe):
    ids = byte_bpe.encode("Café 東京 🚀 and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_bpe, [], True, ["京 🚀"])
    deltas = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == "Café 東"
    assert detok.stop_reason == "京 🚀"


def expected_truncation(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return text[: end if include else start], stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_random(include):
    """Random texts over a tiny alphabet, random token boundaries, several stop strings:
    emitted text is always a prefix of the expected result and never holds a stop string."""
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(1, 30)))
        stops = rng.sample(["abc", "bb", "c a", "aaa", "ba c", "b"], rng.randrange(1, 4))
        if "b" in stops and rng.random() < 0.8:
            stops.remove("b")
            if not stops:
                stops = ["cc"]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        expected, reason = expected_truncation(text, stops, include)
        detok, deltas = run_stop(pieces, stops, include=include)
        emitted = ""
        for d in deltas:
            emitted += d
            assert expected.startswith(emitted), (pieces, stops, emitted)
            if not include:
                assert not any(s in emitted for s in stops)
        assert emitted == detok.output_text == expected, (pieces, stops)
        assert detok.stop_reason == reason


def reference_deltas(
    pieces: list[str], stops: list[str], include: bool, finish: bool
) -> tuple[list[str], str | None]:
    """The quadratic algorithm the detokenizer used before StopMatcher (the oracle):
    search the whole text, hold back the longest tail that is a proper stop prefix."""
    text, emitted, deltas, max_len = "", "", [], max(len(s) for s in stops)
    for n, piece in enumerate(pieces):
        finished = finish and n == len(pieces) - 1
        old_len, text = len(text), text + piece
        found = [
            (start + len(s), start, s)
            for s in stops
            if (start := text.find(s, max(0, old_len - len(s) + 1))) != -1
        ]
        if found:
            end, start, stop = min(found)
            text, finished = text[: end if include else start], True
        end = len(text)
        if not finished and not include:
            end -= next(
                (
                    k
                    for k in range(min(max_len - 1, len(text)), 0, -1)
                    if any(s.startswith(text[-k:]) for s in stops)
                ),
                0,
            )
        deltas.append(text[len(emitted) : end])
        emitted += deltas[-1]
        if finished:
            return deltas, stop if found else None
    return deltas, None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("finish", [False, True])
def test_stop_deltas_identical_to_the_quadratic_algorithm(include, finish):
    """Every delta (hold-back included) is what the old whole-text search returned."""
    rng = random.Random(7)
    pool = ["abc", "bb", "c a", "aaa", "ba c", "b", "abab", "aabaa", "aaab", "cabcab", "a" * 7]
    for _ in range(1500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(1, 60)))
        stops = rng.sample(pool, rng.randrange(1, 5))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 20))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        detok, deltas = run_stop(pieces, stops, include=include, finish=finish)
        assert (deltas, detok.stop_reason) == reference_deltas(pieces, stops, include, finish), (
            pieces,
            stops,
        )


def test_stop_scan_is_linear_in_new_text():
    """16 stop strings of 10,000 characters over ~3,000 steps: each update looks at its new
    characters (plus failure-link steps bounded by the longest stop), never at the whole
    text or the whole stop strings (the old hold-back check copied up to 10k-character tails)."""
    rng = random.Random(3)
    stops = ["".join(rng.choice("ab ") for _ in range(10_000)) for _ in range(15)] + [
        "ab " * 3333 + "x"
    ]
    tok = CharTokenizer([])
    detok = IncrementalDetokenizer(tok, [], True, stops)
    matcher = detok._stop
    text = "ab " * 3000  # the last stop's partial match grows to 9,000 characters
    total_new, max_per_step, pos = 0, 0, 0
    while pos < len(text):
        piece = text[pos : pos + rng.randrange(1, 6)]
        pos += len(piece)
        before = matcher.num_chars_scanned
        detok.update(tok.ids(piece))
        max_per_step = max(max_per_step, matcher.num_chars_scanned - before)
        total_new += len(piece)
    assert detok.stop_reason is None
    assert matcher.num_held_chars == len(text)  # all of it could still become the last stop
    assert detok.output_text == ""
    # amortized: at most 2 looks per new character per stop string (KMP's bound)
    assert matcher.num_chars_scanned <= 2 * len(stops) * total_new
    assert max_per_step <= len(stops) * (3 + 10_000)


def test_stop_held_tail_is_all_that_is_kept():
    tok = CharTokenizer([])
    detok = IncrementalDetokenizer(tok, [], True, ["xyz" * 100])
    for _ in range(1000):
        detok.update(tok.ids("hello "))
    assert detok._pending == "" and len(detok.output_text) == 6000
    detok.update(tok.ids("xyzxy"))
    assert detok._pending == "xyzxy"
