"""SGLang's `/generate` body read into SamplingParams, and outputs written in its answer's shape
(serve/native_protocol.py), without an engine: every SGLang name lands on the right field, the
model's defaults fill what a request leaves unset, lists go one per prompt, and whatever cannot
be honoured is refused by name."""

from __future__ import annotations

import pytest

from ferrobatch.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ferrobatch.serve.logprobs import LOGPROB_FLOOR
from ferrobatch.serve.native_protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    answer_item,
    finish_reason,
    parse_generate,
)
from ferrobatch.serve.protocol import ProtocolError


def _one(body, defaults=None):
    req = parse_generate(body, defaults)
    assert len(req.items) == 1
    return req.items[0]


def test_every_sglang_sampling_name_lands_on_its_field():
    it = _one({"text": "hi", "sampling_params": {
        "max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.2, "presence_penalty": 0.3,
        "repetition_penalty": 1.1, "stop": "\n", "stop_token_ids": [9], "ignore_eos": True,
        "skip_special_tokens": False, "no_stop_trim": True, "n": 3,
        "logit_bias": {"5": 1.0}, "sampling_seed": 11, "spaces_between_special_tokens": True}})
    p = it.params
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        7, 2, 0.5, 0.9, 5, 0.1)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.2, 0.3, 1.1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.skip_special_tokens) == (
        ("\n",), (9,), True, False)
    assert (p.include_stop_str_in_output, p.n, p.seed) == (True, 3, 11)
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.output_kind == "final"
    assert it.prompt == "hi" and len(it.rid) == 32          # a random id when none is given


def test_json_schema_text_regex_and_ebnf_are_guided_fields():
    assert _one({"text": "x", "sampling_params": {"regex": "a|b"}}).params.guided_regex == "a|b"
    assert _one({"text": "x", "sampling_params": {"json_schema": '{"type": "object"}'}}
                ).params.guided_json == '{"type": "object"}'
    assert _one({"text": "x", "sampling_params": {"ebnf": 'root ::= "a"'}}
                ).params.guided_grammar == 'root ::= "a"'
    with pytest.raises(ProtocolError, match="one of json_schema"):
        _one({"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}})


def test_max_new_tokens_defaults_to_128_and_null_fills_the_context():
    assert _one({"text": "x"}).params.max_tokens == DEFAULT_MAX_NEW_TOKENS == 128
    assert _one({"text": "x", "sampling_params": {"max_new_tokens": None}}
                ).params.max_tokens is None


def test_unset_fields_take_the_models_defaults_and_set_ones_keep_theirs():
    model = {"temperature": 0.0, "repetition_penalty": 1.3, "top_k": 1, "max_tokens": 6}
    p = _one({"text": "x", "sampling_params": {"top_k": 4}}, model).params
    assert (p.temperature, p.repetition_penalty, p.top_k) == (0.0, 1.3, 4)
    assert p.max_tokens == 128            # the model's max_tokens caps only fill-the-context


def test_logprob_options_become_logprobs_and_prompt_logprobs():
    it = _one({"text": "x", "return_logprob": True, "top_logprobs_num": 3})
    assert (it.params.logprobs, it.params.prompt_logprobs, it.logprob_start_len) == (3, None, -1)
    it = _one({"text": "x", "return_logprob": True, "logprob_start_len": 0})
    assert (it.params.logprobs, it.params.prompt_logprobs) == (0, 0)
    it = _one({"text": "x", "logprob_start_len": 0, "top_logprobs_num": 2})
    assert it.params.logprobs is None and it.params.prompt_logprobs is None   # not asked


def test_a_stream_runs_cumulative():
    req = parse_generate({"input_ids": [1, 2, 3], "stream": True})
    assert req.stream and req.items[0].params.output_kind == "cumulative"
    assert req.items[0].prompt == [1, 2, 3] and not req.batched


def test_a_batch_takes_one_value_for_all_or_one_per_prompt():
    req = parse_generate({"text": ["a", "b"], "rid": ["r1", "r2"],
                          "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
                          "return_logprob": [True, False], "top_logprobs_num": 1})
    assert req.batched and req.answers_a_list
    assert [it.rid for it in req.items] == ["r1", "r2"]
    assert [it.params.max_tokens for it in req.items] == [1, 2]
    assert [it.params.logprobs for it in req.items] == [1, None]
    req = parse_generate({"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0}})
    assert [it.prompt for it in req.items] == [[1, 2], [3]]
    assert all(it.params.temperature == 0 for it in req.items)
    assert not parse_generate({"text": "a"}).answers_a_list
    assert parse_generate({"text": "a", "sampling_params": {"n": 2}}).answers_a_list


@pytest.mark.parametrize("body, param, message", [
    ([], None, "JSON object"),
    ({}, "text", "'text' or 'input_ids' is required"),
    ({"text": "a", "input_ids": [1]}, "text", "not both"),
    ({"text": ""}, "text", "must not be empty"),
    ({"text": ["a", 3]}, "text", "list of strings"),
    ({"input_ids": []}, "input_ids", "non-empty"),
    ({"input_ids": [1, True]}, "input_ids", "token ids"),
    ({"input_ids": [[1], []]}, "input_ids", "token ids"),
    ({"text": ["a"] * 65}, "text", "at most 64"),
    ({"text": "a", "prompt": "b"}, "prompt", "unknown field 'prompt'"),
    ({"text": "a", "image_data": "x.png"}, "image_data", "not supported"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states", "not supported"),
    ({"text": "a", "stream": "yes"}, "stream", "boolean"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params", "one prompt"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "1 entries for 2"),
    ({"text": ["a", "b"], "rid": "same"}, "rid", "one per prompt"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid", "must differ"),
    ({"text": "a", "rid": 5}, "rid", "non-empty string"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params", "an object"),
    ({"text": "a", "sampling_params": {"max_tokens": 3}}, "max_tokens", "unknown sampling"),
    ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "structural_tag",
     "not supported"),
    ({"text": "a", "sampling_params": {"spaces_between_special_tokens": False}},
     "spaces_between_special_tokens", "only True"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature", "a number"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens",
     "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens",
     "'max_new_tokens' must be an integer"),
    ({"text": "a", "sampling_params": {"regex": 5}}, "regex", "'regex' must be a string"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "n", "same 'n'"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num", ">= 0 and at most 20"),
    ({"text": "a", "logprob_start_len": "0"}, "logprob_start_len", "integer"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num",
     "at most 20"),
    ({"text": "a", "lora_path": 3}, "lora_path", "adapter's name"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body, param, message):
    with pytest.raises(ProtocolError) as info:
        parse_generate(body)
    assert info.value.param == param
    if message is not None:
        assert message in str(info.value)


def test_a_lora_name_is_checked_by_the_caller():
    seen = []
    parse_generate({"text": "a", "lora_path": "sql"}, check_lora=seen.append)
    assert seen == ["sql"]

    def refuse(name):
        raise ProtocolError(f"no adapter {name}", code=404, param="lora_path")
    with pytest.raises(ProtocolError, match="no adapter other"):
        parse_generate({"text": "a", "lora_path": "other"}, check_lora=refuse)


def _completion(ids, reason=None, stop_reason=None, logprobs=None):
    return CompletionOutput(0, "text", list(ids), reason, stop_reason, len(ids),
                            logprobs=logprobs)


def test_finish_reasons_in_sglangs_shape():
    assert finish_reason(_completion([5]), 1) is None
    assert finish_reason(_completion([5, 6], "length"), 2) == {"type": "length", "length": 2}
    assert finish_reason(_completion([5, 2], "stop"), 2) == {"type": "stop", "matched": 2}
    assert finish_reason(_completion([5], "stop", "\n\n"), 1) == {"type": "stop",
                                                                 "matched": "\n\n"}
    assert finish_reason(_completion([5, 9], "stop", 9), 2) == {"type": "stop", "matched": 9}
    assert finish_reason(_completion([5], "abort"), 1)["type"] == "abort"


def test_answer_item_carries_ids_counts_and_logprob_triples():
    entries = [TokenLogprob(7, -0.5, [(7, -0.5), (8, -1.5)]),
               TokenLogprob(9, float("-inf"), [(1, -0.1), (9, float("-inf"))])]
    prompt_lps = [None, TokenLogprob(11, -2.0, [(12, -0.2), (11, -2.0)]),
                  TokenLogprob(13, -3.0, [(13, -3.0), (14, -4.0)])]
    out = RequestOutput("rid-1", None, [10, 11, 13], [], True, prompt_logprobs=prompt_lps,
                        num_cached_tokens=2)
    req = parse_generate({"input_ids": [10, 11, 13], "return_logprob": True,
                          "top_logprobs_num": 2, "logprob_start_len": 1,
                          "return_text_in_logprobs": True})
    c = _completion([7, 9], "length", logprobs=entries)
    got = answer_item(req.items[0], out, c, weight_version=3, e2e_latency=0.25,
                      text=lambda t: f"<{t}>")
    assert got["output_ids"] == [7, 9] and got["text"] == "text"
    meta = got["meta_info"]
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"],
            meta["weight_version"], meta["e2e_latency"]) == ("rid-1", 3, 2, 2, "3", 0.25)
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["output_token_logprobs"] == [[-0.5, 7, "<7>"], [LOGPROB_FLOOR, 9, "<9>"]]
    assert meta["output_top_logprobs"][1] == [[-0.1, 1, "<1>"], [LOGPROB_FLOOR, 9, "<9>"]]
    # from position 1 on: the prompt's first token (nothing predicts it) is left out
    assert meta["input_token_logprobs"] == [[-2.0, 11, "<11>"], [-3.0, 13, "<13>"]]
    assert meta["input_top_logprobs"][0] == [[-0.2, 12, "<12>"], [-2.0, 11, "<11>"]]
    req0 = parse_generate({"input_ids": [10, 11, 13], "return_logprob": True,
                           "logprob_start_len": 0})
    meta0 = answer_item(req0.items[0], out, c, weight_version=0, e2e_latency=0.0,
                        text=lambda t: "unused")["meta_info"]
    assert meta0["input_token_logprobs"][0] == [None, 10, None]      # text only when asked
    assert "output_top_logprobs" not in meta0 and "input_top_logprobs" not in meta0
    plain = answer_item(parse_generate({"text": "x"}).items[0], out, c, weight_version=0,
                        e2e_latency=0.0, text=None)["meta_info"]
    assert not [k for k in plain if "logprobs" in k]
