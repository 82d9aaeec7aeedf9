"""client/state.py: a long state tokenized only as far as the rows keep it, token for token the SDK's.

Two levels. The lemma itself (`tokens(text) == tokens(text[:p]) + tokens(text[p:])` at every cut the
policy calls safe) on generated texts made of the pieces that could break it: whitespace runs of every
kind, long words, mixed scripts, emoji and combining marks, contractions, special-token texts. Then whole
requests on long states of every kind against the SDK's own `_encode_state`, with the window forced to
be used and its size varied so the cut lands in different places.
"""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_client_semantics import assert_same_rows

from laya_pool.client import state as state_module
from laya_pool.client.card import ModelCard
from laya_pool.client.semantics import encode_request
from laya_pool.client.state import WindowPolicy, in_parts, split, tokenize_state

PIECES = ["ticket", "refund", "a", "the", "it's", "we'll", "I'm", "x" * 40, "supercalifragilistic" * 8,
          "Grüße", "Zürich", "東京注文返金緊急", "Привет", "مرحبا", "🙂", "👩‍💻", "🇩🇪", "e\u0301", "€100", "42",
          "3.14159", "{", "}", "\"", ":", ",", "...", "!!", "[CLS]", "[SEP]", "[UNK]", "[PAD]", "[SE", "P]", "]",
          " ", "  ", "     ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2028", "\x1c", "\x85",
          "\u200b", "\ufeff"]


def tricky_text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(rng.choice(PIECES))
        if rng.random() < 0.6:
            out.append(" ")
    return "".join(out)


@pytest.fixture(scope="module")
def card(tiny_ckpt) -> ModelCard:
    return ModelCard.from_dir(tiny_ckpt)


def test_the_projects_tokenizer_is_window_safe(card):
    # Otherwise every state is tokenized whole and the tests below prove nothing about windows.
    assert card.window.safe
    assert set(card.window.added) == {"[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"}


def test_other_tokenizers_are_tokenized_whole(card):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    doc = json.loads(card.tokenizer.to_str())
    with_prefix_space = Tokenizer.from_str(json.dumps({**doc, "pre_tokenizer": {
        **doc["pre_tokenizer"], "add_prefix_space": True}}))
    assert not WindowPolicy.for_tokenizer(with_prefix_space).safe
    normalized = Tokenizer.from_str(card.tokenizer.to_str())
    normalized.normalizer = normalizers.NFKC()
    assert not WindowPolicy.for_tokenizer(normalized).safe
    whitespace = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    assert not WindowPolicy.for_tokenizer(whitespace).safe


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**30), n=st.integers(1, 60))
def test_every_safe_cut_splits_the_tokens_exactly(card, seed, n):
    text = tricky_text(seed, n)
    whole = card.encode(text)
    for p in range(len(text) + 1):
        if card.window.is_cut(text, p):
            assert card.encode(text[:p]) + card.encode(text[p:]) == whole, (text, p)


def test_added_tokens_that_strip_spaces_keep_cuts_away(card):
    # ModernBERT-style added tokens absorb the spaces beside them: a cut right after one would hand its
    # space to the other side. The policy keeps a margin around every added token's text.
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(card.tokenizer.to_str())
    tok.add_tokens([AddedToken("<tag>", lstrip=True, rstrip=True)])
    policy = WindowPolicy.for_tokenizer(tok)
    assert policy.safe and "<tag>" in policy.added

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    text = "refund <tag> ticket"
    naive = text.index(">") + 1                       # a cut the margin forbids, and rightly
    assert encode(text[:naive]) + encode(text[naive:]) != encode(text)
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(["<tag>", " <tag> ", " ", "  ", "\n", "ticket", "it's", "🙂", "x"])
                       for _ in range(rng.randint(1, 30)))
        for p in range(len(text) + 1):
            if policy.is_cut(text, p):
                assert encode(text[:p]) + encode(text[p:]) == encode(text), (text, p)


def test_safe_cuts_exist_and_refuse_the_wrong_places(card):
    policy = card.window
    text = "alpha beta  gamma\n[SEP] delta\u00a0epsilon 🙂 zeta"
    cuts = [p for p in range(len(text) + 1) if policy.is_cut(text, p)]
    # "alpha| beta|  gamma" and "epsilon| 🙂"; not inside the double space (11), not next to the special
    # token (17, 23), not at the no-break space (29), not after the emoji (39)
    assert cuts == [5, 10, 37]


@pytest.mark.parametrize("parts", [2, 3, 7, 40])
def test_a_text_in_parts_gives_its_tokens_whole(card, parts, monkeypatch):
    """A window piece tokenized as parts cut at safe cuts, in one batch (`in_parts`), is token for token the piece
    whole, wherever the cuts land in the tricky texts; a cut one character late (after the space) is not."""
    monkeypatch.setattr(state_module, "_cpus", lambda: parts)
    monkeypatch.setattr(state_module, "_PART_CHARS", 1)
    split_at = []
    for seed in range(40):
        text = tricky_text(seed, 600)
        pieces = split(card.window, text, parts)
        assert "".join(pieces) == text and 1 <= len(pieces) <= parts
        split_at.append(len(pieces))
        assert in_parts(card.encode_many, card.window, text) == card.encode(text), seed
    assert max(split_at) == parts or parts == 40        # the texts do get cut as asked (40: fewer cuts than asked)
    assert min(split_at) > 1
    late = []                                           # the planted mistake: each cut moved past its space
    for seed in range(40):
        text = tricky_text(seed, 600)
        pieces = split(card.window, text, parts)
        moved = [pieces[0] + pieces[1][:1], pieces[1][1:], *pieces[2:]]
        late.append([i for ids in card.encode_many(moved) for i in ids] != card.encode(text))
    assert any(late)


def test_an_unsafe_tokenizer_is_never_cut(card):
    assert split(WindowPolicy(False), tricky_text(1, 600), 8) == [tricky_text(1, 600)]


@pytest.mark.parametrize("from_left", [False, True])
@pytest.mark.parametrize("ratio", [0.7, 3.0, 30.0])
@pytest.mark.parametrize("need", [0, 1, 37, 480])
@pytest.mark.parametrize("many", [False, True])
def test_windows_are_the_whole_states_first_or_last_tokens(card, from_left, ratio, need, many, monkeypatch):
    monkeypatch.setattr(state_module, "_cpus", lambda: 5)
    monkeypatch.setattr(state_module, "_PART_CHARS", 64)      # the window's pieces cut in parts (`in_parts`)
    for seed in range(12):
        text = tricky_text(seed, 1500)
        policy = WindowPolicy(True, card.window.added, card.window.margin, chars_per_token=ratio, min_chars=0)
        got = tokenize_state(card.encode, policy, text, need, from_left, card.encode_many if many else None)
        whole = card.encode(text)
        assert got.count() == len(whole)
        assert len(got.ids) >= min(need, len(whole))
        assert got.ids == (whole[len(whole) - len(got.ids):] if from_left else whole[:len(got.ids)])
        assert got.window_agrees()
        assert got.complete or len(got.ids) < len(whole) // 2, (len(got.ids), len(whole))


# ---------------------------------------------------------------- whole requests against the SDK

QUESTIONS = {
    "one": {"urgent": {"type": "noul", "instructions": "Is this urgent?"}},
    "mixed": {f"q{i}": {"type": ("choice", "noul", "score")[i % 3], "instructions": f"Question {i} about it?",
                        **({"criteria": {"billing": "", "tech": "the servers", "sales": ""}} if i % 3 == 0 else
                           {"criteria": ["none", "low", "high"]} if i % 3 == 2 else {})} for i in range(16)},
    "long_heads": {"team": {"type": "choice", "instructions": "Which team? " * 40,
                            "criteria": {f"team {i}": "handles " * 12 for i in range(12)}},
                   "short": {"type": "noul", "instructions": "ok?"}},
}


def _words(seed: int, n: int, sep: str = " ") -> str:
    rng = random.Random(seed)
    vocab = "ticket customer refund invoice urgent billing login error crash payment order the a not".split()
    return sep.join(rng.choice(vocab) for _ in range(n))


def _whitespace_runs(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(["ticket", "refund", "x"]) + rng.choice([" ", "  ", "\n", "\n\n", " \t ", "   \n ",
                                                                       "\r\n", "\t"]) for _ in range(n))


def _long_words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.choice([3, 30, 300]))) for _ in range(n))


def _mixed_scripts(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(["東京注文返金", "Привет мир", "مرحبا بالعالم", "🙂🙂", "👩‍💻 ", "Grüße ", "naïve café ",
                               "e\u0301 ", "€100 ", " ", "🇩🇪", "[SEP]", " [CLS] ", "it's ", "\n"]) for _ in range(n))


STATES = {     # each over 10,000 characters: the window is used at every ratio below
    "text_right_cut": lambda s: _words(s, 2500),
    "whitespace_runs": lambda s: _whitespace_runs(s, 2000),
    "long_words": lambda s: _long_words(s, 120),
    "mixed_scripts_and_emoji": lambda s: _mixed_scripts(s, 2500),
    "tricky_pieces": lambda s: tricky_text(s, 2500),
    "json_dict": lambda s: {"subject": _words(s, 40), "body": _mixed_scripts(s, 1500), "tags": _words(s + 1, 300)},
    "conversation_left_cut": lambda s: [{"role": ("user", "agent")[i % 2], "content": _words(s + i, 60)}
                                        for i in range(40)],
    "conversation_of_emoji_and_runs": lambda s: [{"role": "user", "content": _mixed_scripts(s + i, 40)}
                                                 for i in range(40)] + [_whitespace_runs(s, 200)],
    "no_safe_cut_at_all": lambda s: "x" * 9000 + "东" * 3000,
}


@pytest.mark.parametrize("ratio", [1.0, 4.0, 9.0])
@pytest.mark.parametrize("questions", list(QUESTIONS))
@pytest.mark.parametrize("kind", list(STATES))
def test_long_states_equal_sdk(card, sdk_agent, kind, questions, ratio):
    card.window.chars_per_token = ratio        # the window's size: where the cut lands
    for seed in range(2):
        state = STATES[kind](seed)
        enc = assert_same_rows(card, sdk_agent, state, QUESTIONS[questions])
        assert enc is not None
        # the window was really used (except where there is nowhere to cut), and some row was cut
        assert enc.state.complete == (kind == "no_safe_cut_at_all"), kind
        assert any(s["truncated"] for s in enc.state_stats)


@pytest.mark.parametrize("max_len,head_max_len", [(64, 16), (128, 192), (512, 400), (40, 8)])
def test_long_states_with_budget_overrides_equal_sdk(card, sdk_agent, max_len, head_max_len):
    for kind in ("tricky_pieces", "conversation_left_cut"):
        assert_same_rows(card, sdk_agent, STATES[kind](7), QUESTIONS["mixed"], max_len=max_len,
                         head_max_len=head_max_len)


def test_usage_counts_the_whole_state(card, sdk_agent):
    state = STATES["tricky_pieces"](3)
    enc = encode_request(card, state, QUESTIONS["one"])
    assert not enc.state.complete and len(enc.state.ids) < enc.state.count() // 4
    assert enc.state_stats[0]["state_tokens"] == len(card.encode(state)) > 2000
    whole = encode_request(card, state, QUESTIONS["one"], window=False)
    assert whole.state.complete and whole.state_stats == enc.state_stats
    assert [r[0].tolist() for r in whole.rows] == [r[0].tolist() for r in enc.rows]


def test_alone_says_whether_another_thread_could_want_the_gil():
    """A client polls its lane only when nothing else of the process could want the GIL (client/pool.py): another
    thread alive, or work queued for the tokenizing thread, says no; the tokenizing thread idle does not."""
    import threading

    from conftest import wait_until

    from laya_pool.client.state import alone, in_background
    in_background(lambda: None).result()        # the tokenizing thread exists from here on, idle
    wait_until(lambda: alone() or threading.active_count() > 2, 5, "the tokenizing thread never went idle")
    before = alone()                             # (False if the test process runs other threads of its own)
    gate = threading.Event()
    other = threading.Thread(target=gate.wait)
    other.start()
    assert not alone()
    gate.set()
    other.join()
    assert alone() == before
    gate.clear()
    queued = in_background(gate.wait)
    assert not alone()
    gate.set()
    queued.result()
    wait_until(lambda: alone() == before, 5, "the finished task still counted")



@pytest.mark.parametrize("cancel", [False, True])
def test_a_cancelled_count_stops_between_two_pieces(card, monkeypatch, cancel):
    """A call that ended stops its state's background count at the next piece (`StateTokens.cancel`); one that did
    not counts every piece."""
    from concurrent.futures import CancelledError

    monkeypatch.setattr(state_module, "_COUNT_CHARS", 2000)
    text = _words(1, 6000)                       # ~36,000 characters: the count takes many pieces
    policy = WindowPolicy(True, card.window.added, card.window.margin, min_chars=0)
    calls: list[int] = []
    made: list = []

    def encode(t: str) -> list[int]:
        calls.append(len(t))
        if cancel and made:                      # the count's first piece: the call ends while it is tokenized
            made[0].cancel()
        return card.encode(t)
    tokens = tokenize_state(encode, policy, text, 50, False)
    made.append(tokens)
    assert not tokens.complete
    before = len(calls)
    if cancel:
        with pytest.raises(CancelledError):
            tokens.count()
        assert len(calls) - before == 1
    else:
        assert tokens.count() == len(card.encode(text)) and len(calls) - before > 5
