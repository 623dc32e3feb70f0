"""The generation core (edgellama/generation.py): step() over several generations gives
each the tokens it gets alone (greedy, a tiny Q8_0 model: the batched pass's rows have
the one-token step's bits), with and without proposals; between steps a sequence holds
its history but the last token; stop strings end the text where they begin; a grammar
that gives up ends its own generation only; generate ends a grammar's reply without a
pass for the stop token, and drafts under a grammar at temperature 0."""
import pytest

import edgellama
from edgellama.constrain import GrammarError, gbnf_grammar
from edgellama.errors import EdgeError
from edgellama.generation import Generation, step
from edgellama.sampling import Sampler, SamplingParams
from edgellama.server.job import StopMatcher
from edgellama.speculative import DraftLength, PassCost, PromptLookup
from edgellama.tokenizer import StreamDecoder
from tiny_gguf import TINY_VOCAB, write_tiny_gguf

GREEDY = SamplingParams(temperature=0)
PROMPTS = ["hello hello there hello", "on and on and on and", "zebra", "the end of the end"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("gen") / "tiny.gguf", "Q8_0", dim=64,
                           ffn=96, vocab=TINY_VOCAB, ctx=256, tokenizer=True, tied=False)
    return edgellama.load(path, ctx=256)


def _gen(llm, prompt: str, n: int, drafter=None, **kw) -> Generation:
    """A generation as the server starts one: the prompt but its last token read."""
    ids = llm.tokenizer.encode(prompt)
    seq = llm.model.new_sequence()
    llm.model.forward(ids[:-1], seq)
    length = None if drafter is None else DraftLength(2, 4)   # always drafts 2..4
    return Generation(seq=seq, history=list(ids), sampler=Sampler(GREEDY), max_tokens=n,
                      stops=set(), next_token=ids[-1], drafter=drafter, length=length, **kw)


def _run(llm, gens: list[Generation], costs=None) -> list[list[int]]:
    starts = [len(g.history) for g in gens]
    while not all(g.done for g in gens):
        step(gens, llm.model, costs=costs)
        for g in gens:   # the cache holds the history but its last token
            assert g.done or g.seq.tokens == g.history[:-1]
    return [g.history[n:] for g, n in zip(gens, starts)]


@pytest.mark.parametrize("drafting", [False, True])
def test_together_equals_alone(llm, drafting):
    lengths = [20, 7, 13, 20]

    def gens():
        return [_gen(llm, p, n, PromptLookup() if drafting else None)
                for p, n in zip(PROMPTS, lengths)]
    alone = [_run(llm, [g])[0] for g in gens()]
    together = gens()
    costs = PassCost() if drafting else None
    assert _run(llm, together, costs) == alone
    assert [len(a) for a in alone] == lengths
    assert all(g.finish_reason == "length" for g in together)
    if drafting:   # proposals were checked, some kept, some not
        assert sum(g.drafted for g in together) > sum(g.accepted for g in together) > 0


def test_stop_strings_end_the_text_where_they_begin(llm):
    texts = []
    plain = _gen(llm, PROMPTS[0], 30, decoder=StreamDecoder(llm.tokenizer),
                 matcher=StopMatcher([]), on_text=texts.append)
    _run(llm, [plain])
    full = "".join(texts) + plain.tail
    stop = full[12:14]
    texts.clear()
    g = _gen(llm, PROMPTS[0], 30, decoder=StreamDecoder(llm.tokenizer),
             matcher=StopMatcher([stop]), on_text=texts.append)
    _run(llm, [g])
    assert g.finish_reason == "stop" and g.tail is None   # nothing held back is sent
    assert "".join(texts) == full[:full.index(stop)]
    # the length: what was held back comes as the tail
    texts.clear()
    g = _gen(llm, PROMPTS[0], 30, decoder=StreamDecoder(llm.tokenizer),
             matcher=StopMatcher(["\x00never"]), on_text=texts.append)
    _run(llm, [g])
    assert g.finish_reason == "length" and "".join(texts) + g.tail == full


def test_a_grammar_that_gives_up_ends_its_generation_only(llm):
    want = _run(llm, [_gen(llm, PROMPTS[1], 10)])[0]

    def broken(logits, history):
        raise GrammarError("the grammar gave up")
    bad, good = _gen(llm, PROMPTS[0], 10, pick=broken), _gen(llm, PROMPTS[1], 10)
    assert _run(llm, [bad, good])[1] == want
    assert isinstance(bad.error, GrammarError) and bad.finish_reason is None
    assert good.finish_reason == "length" and good.error is None


def test_generate_ends_a_grammar_without_a_pass_for_the_stop_token(llm, monkeypatch):
    passes = []
    decode = llm.model.decode
    monkeypatch.setattr(llm.model, "decode", lambda *a, **k: passes.append(1) or decode(*a, **k))
    ids = llm.tokenizer.encode(PROMPTS[0])
    grammar = gbnf_grammar('root ::= "hello there"')
    out = list(llm.generate(ids, max_tokens=30, sampling=GREEDY, grammar=grammar))
    assert llm.tokenizer.decode(out) == "hello there" and llm.stats.stop_reason == "stop"
    assert len(passes) == len(out) - 1          # the first token came from the prompt's pass
    # speculative decoding under a grammar at temperature 0: the same reply
    lookup = list(llm.generate(ids, max_tokens=30, sampling=GREEDY, grammar=grammar,
                               drafter=PromptLookup(draft_min=2, draft_max=2)))
    assert lookup == out
    with pytest.raises(EdgeError, match="grammar when sampling"):
        next(llm.generate(ids, grammar=grammar, drafter=PromptLookup(),
                          sampling=SamplingParams(temperature=0.5)))


def test_generate_with_no_budget_yields_nothing(llm):
    ids = llm.tokenizer.encode(PROMPTS[2])
    assert list(llm.generate(ids, max_tokens=0, sampling=GREEDY)) == []
    assert llm.stats.stop_reason == "length" and llm.seq.tokens == ids
