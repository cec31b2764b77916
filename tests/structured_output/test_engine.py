"""Structured outputs through the engine, on a tiny random-weight model: nothing but the grammar's
mask can make its output valid."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from runtime.structured_output import StructuredOutputsParams

NUM_SCHEMAS = 200
NAMES = st.text("abcdefghij", min_size=1, max_size=6)

# Objects of bounded leaves (bounded strings, integer ranges, booleans, nulls, enums, short
# arrays), nested up to twice, every property required: a complete output always exists within
# max_tokens, whatever the random model prefers. (hypothesis-jsonschema, which would generate
# them from a meta-schema, breaks on hypothesis 6.170.10 and later, and under an older release
# took 247 s to draw 200 bounded schemas; these strategies draw them in under a second.)
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
              st.integers(-50, 0), st.integers(1, 500)),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.builds(lambda e: {"enum": e}, st.lists(NAMES, min_size=1, max_size=3, unique=True)),
)


def objects(children: st.SearchStrategy) -> st.SearchStrategy:
    def schema(props: dict) -> dict:
        return {"type": "object", "properties": props, "required": sorted(props),
                "additionalProperties": False}
    return st.dictionaries(NAMES, children, min_size=1, max_size=4).map(schema)


VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    objects(inner),
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
              inner, st.integers(0, 3))), max_leaves=6)
SCHEMAS = objects(VALUES)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory(), max_num_seqs=64)


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def backend_llm(request, llm, tiny_model_factory):
    """The engine on each grammar backend (xgrammar is the default, `llm`)."""
    if request.param == "xgrammar":
        return llm
    return LLM(tiny_model_factory(), max_num_seqs=64,
               structured_outputs_config={"backend": request.param})


@pytest.fixture(scope="module")
def generated_schemas() -> list[dict]:
    found = []

    @settings(max_examples=NUM_SCHEMAS, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(SCHEMAS)
    def collect(schema):
        found.append(schema)

    collect()
    return found


def constrained(temperature: float = 1.0, max_tokens: int = 300, seed: int | None = 0,
                **fields) -> SamplingParams:
    """Sampling params with the structured_outputs of `fields`; SamplingParams takes the rest."""
    kind = {k: fields.pop(k) for k in list(fields)
            if k in StructuredOutputsParams.__dataclass_fields__}
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind), **fields)


def check_json(outputs, schemas_: list[dict]) -> None:
    for out, schema in zip(outputs, schemas_):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (schema, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)


def test_generated_json_schemas_are_followed(backend_llm, generated_schemas):
    assert len(generated_schemas) >= NUM_SCHEMAS // 2
    if backend_llm.engine.config.structured_outputs_config.backend == "guidance":
        generated_schemas = generated_schemas[:10]  # the second backend, in less time
    params = [constrained(seed=i, json=s, disable_any_whitespace=True)
              for i, s in enumerate(generated_schemas)]
    check_json(backend_llm.generate(["Say something:"] * len(params), params), generated_schemas)


def test_unconstrained_output_is_not_json(llm):
    """The check above is not vacuous: without the mask the model writes no JSON."""
    out = llm.generate(["Say something:"], SamplingParams(temperature=0, max_tokens=20))
    with pytest.raises(ValueError):
        json.loads(out[0].outputs[0].text)


REGEXES = [r"[a-c]{3}-\d{2}", r"(cat|dog)s? (sat|ran)", r"\d{4}-\d{2}-\d{2}", r"[A-Z][a-z]{2,5}!"]


def test_regex_choice_grammar_and_json_object(backend_llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num " + " expr\nnum ::= [1-9] [0-9]?'
    params = ([constrained(regex=r, seed=i) for i, r in enumerate(REGEXES)] +
              [constrained(choice=["red", "green", "blue sky"], temperature=0),
               constrained(grammar=grammar, max_tokens=60), constrained(json_object=True)])
    outs = [o.outputs[0] for o in backend_llm.generate(["Go:"] * len(params), params)]
    for regex, out in zip(REGEXES, outs):
        assert re.fullmatch(regex, out.text), (regex, out.text)
    assert outs[4].text in ("red", "green", "blue sky")
    assert re.fullmatch(r"\((\d{1,2} \+ )*\d{1,2}\)", outs[5].text) or \
        outs[5].finish_reason == "length", outs[5].text
    assert outs[6].finish_reason == "length" or isinstance(json.loads(outs[6].text), dict)


def test_n_samples_each_follow_the_schema(backend_llm, generated_schemas):
    schema = generated_schemas[0]
    params = constrained(json=schema, disable_any_whitespace=True, seed=None).clone(n=4)
    out = backend_llm.generate(["Say something:"], params)
    assert len(out[0].outputs) == 4
    check_json(out, [schema])


def test_bad_constraints_are_refused(backend_llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        backend_llm.generate(["x"], constrained(regex="(unclosed"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_speculative_decoding_follows_the_grammar(tiny_model_factory, generated_schemas, backend):
    """n-gram proposals are cut to what the grammar allows before they are verified."""
    spec = LLM(tiny_model_factory(), speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        structured_outputs_config={"backend": backend})
    schemas_ = generated_schemas[:8]
    # a prompt that repeats JSON-ish tokens, so the n-gram proposer has something to propose
    prompt = '{"a": 1, "b": "x"} {"a": 1, "b": "x"} {"a": 1,'
    params = [constrained(json=s, disable_any_whitespace=True, temperature=0, seed=None)
              for s in schemas_] + [constrained(regex=r, temperature=0, seed=None)
                                    for r in REGEXES]
    outs = spec.generate([prompt] * len(params), params)
    check_json(outs[:len(schemas_)], schemas_)
    for regex, out in zip(REGEXES, outs[len(schemas_):]):
        assert re.fullmatch(regex, out.outputs[0].text), (regex, out.outputs[0].text)
    assert spec.engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_preempted_requests_resume_with_their_matcher(tiny_model_factory, generated_schemas):
    """With 10 blocks the batch cannot fit: requests are preempted and recomputed, and their
    outputs are the ones an unhindered run gives."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads x 16, fp32
    schemas_ = sorted(generated_schemas, key=lambda s: len(json.dumps(s)))[:8]  # short outputs
    params = [constrained(json=s, disable_any_whitespace=True, temperature=0, seed=None,
                          max_tokens=100) for s in schemas_]
    # three-block prompts: three requests fill the cache, and the first to need a fourth block
    # preempts another
    prompts = [f"Item {i}: " + "word " * 40 for i in range(len(params))]
    small = LLM(tiny_model_factory(), dtype="float32", kv_cache_memory=10 * block_bytes,
                max_model_len=150)
    outs = small.generate(prompts, params)
    assert small.engine.core.scheduler.num_preemptions > 0
    check_json(outs, schemas_)
    roomy = LLM(tiny_model_factory(), dtype="float32", kv_cache_memory="16MiB")
    assert [o.outputs[0].text for o in outs] == \
        [o.outputs[0].text for o in roomy.generate(prompts, params)]


def test_a_grammar_left_no_token_ends_only_that_request(backend_llm):
    """allowed_token_ids, bad_words or min_tokens can leave no token the grammar allows: that
    request ends with finish_reason "abort" and the reason, holding no token its grammar
    refuses; the others in the batch are untouched."""
    tokenizer = backend_llm.engine.tokenizer
    letter = tokenizer.convert_tokens_to_ids("a")
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    dead_ends = [
        constrained(regex=r"[0-9]+", allowed_token_ids=[letter]),
        constrained(choice=["7"], bad_words=["7"]),
        constrained(choice=["7"], min_tokens=4),  # after "7" only its stop token is allowed
    ]
    good = [constrained(regex=r, seed=i) for i, r in enumerate(REGEXES)]
    outs = [o.outputs[0] for o in backend_llm.generate(["Go:"] * 7, dead_ends + good)]
    for out in outs[:3]:
        assert out.finish_reason == "abort", out
        assert "breaks the request's structured_outputs grammar" in out.stop_reason, out
    assert outs[0].token_ids == [] and outs[1].token_ids == []
    assert outs[2].token_ids == [digits[7]]
    for regex, out in zip(REGEXES, outs[3:]):
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), (regex, out)


def test_a_complete_grammar_allows_only_its_stop_token_under_ignore_eos(backend_llm):
    out = backend_llm.generate(["Go:"], constrained(choice=["yes"], ignore_eos=True,
                                                    max_tokens=5))
    sample = out[0].outputs[0]
    assert sample.finish_reason == "length" and sample.text == "yes", sample
    eos = backend_llm.engine.tokenizer.eos_token_id
    spelled = [t for t in sample.token_ids if t != eos]  # "yes", in as many tokens as drawn
    assert len(spelled) < 5 and sample.token_ids == spelled + [eos] * (5 - len(spelled))
