"""The API through the official `openai` SDK, against a running `tessera serve`.

Started by tests/tests/api_openai.rs, which passes TESSERA_BASE_URL, TESSERA_API_KEY,
TESSERA_BIN and TESSERA_DATA_DIR. Every client validates responses strictly against
the SDK's types.
"""

import collections
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import unittest

import urllib.error
import urllib.request

import httpx2  # the `openai` SDK's own HTTP client (httpx, as the SDK renamed it)
import jsonschema
import openai
import pydantic

BASE_URL = os.environ["TESSERA_BASE_URL"]
API_KEY = os.environ["TESSERA_API_KEY"]
# Model C does not think unless asked, so its answers land in `content`; the thinking
# models (A by default) are exercised in Reasoning below.
MODEL = "vendor-c/model-c"
TEXT_MODEL = "vendor-b/model-b"
THINKING_MODEL = "vendor-a/model-a"


def raw_post(path, body, key=None):
    """A POST without the SDK, for what the SDK cannot send (no key, broken JSON)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    req = urllib.request.Request(BASE_URL + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def client(key=API_KEY):
    return openai.OpenAI(base_url=BASE_URL, api_key=key, max_retries=0, _strict_response_validation=True)


def loose_client():
    """For echoed prompts with log-probabilities: the API (and vLLM) give the first prompt
    token a null log-probability, which the SDK's `List[float]` type cannot hold, so its
    strict validation would refuse a correct reply."""
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0)


def cli(*args):
    """Runs the operator command line against the server's database, returns its JSON."""
    cmd = [os.environ["TESSERA_BIN"], *args, "--data-dir", os.environ["TESSERA_DATA_DIR"], "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


HELLO = [{"role": "user", "content": "Name three colours."}]


class Chat(unittest.TestCase):
    def test_plain_completion_has_the_openai_shape(self):
        r = client().chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=12)
        self.assertTrue(r.id.startswith("chatcmpl-"))
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.model, MODEL)
        self.assertEqual(len(r.choices), 1)
        c = r.choices[0]
        self.assertEqual(c.message.role, "assistant")
        self.assertTrue(c.message.content)
        self.assertIn(c.finish_reason, ("stop", "length"))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        self.assertLessEqual(r.usage.completion_tokens, 12)
        self.assertGreater(r.usage.prompt_tokens, 5)

    def test_stream_matches_the_plain_reply_and_reports_usage(self):
        c = client()
        plain = c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=12)
        chunks = list(
            c.chat.completions.create(
                model=MODEL, messages=HELLO, temperature=0, max_tokens=12, stream=True,
                stream_options={"include_usage": True},
            )
        )
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertEqual(len({ch.id for ch in chunks}), 1, "one id on every chunk")
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        self.assertEqual(text, plain.choices[0].message.content)
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        self.assertEqual(finishes, [plain.choices[0].finish_reason])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, plain.usage.completion_tokens)
        self.assertTrue(all(ch.usage is None for ch in chunks[:-1]))

    def test_stream_helper_accumulates_the_message(self):
        plain = client().chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)
        with client().chat.completions.stream(model=MODEL, messages=HELLO, temperature=0, max_tokens=8) as s:
            deltas = "".join(e.delta for e in s if e.type == "content.delta")
            # get_final_completion() would raise on finish_reason "length" by design.
            snapshot = s.current_completion_snapshot
        self.assertEqual(snapshot.choices[0].message.role, "assistant")
        self.assertEqual(snapshot.choices[0].message.content, deltas)
        self.assertEqual(deltas, plain.choices[0].message.content)

    def test_n_completions(self):
        r = client().chat.completions.create(model=MODEL, messages=HELLO, n=2, temperature=1, seed=7, max_tokens=8)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        chunks = list(client().chat.completions.create(
            model=MODEL, messages=HELLO, n=2, temperature=1, seed=7, max_tokens=8, stream=True))
        roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
        self.assertEqual(sorted(roles), [0, 1], "one role chunk per choice")
        texts = ["", ""]
        for ch in chunks:
            for choice in ch.choices:
                texts[choice.index] += choice.delta.content or ""
        self.assertEqual(texts, [c.message.content for c in r.choices], "same seed, same completions")

    def test_logprobs_with_top_logprobs(self):
        r = client().chat.completions.create(
            model=MODEL, messages=HELLO, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        self.assertEqual("".join(t.token for t in content), r.choices[0].message.content)
        for t in content:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(len(t.top_logprobs), 3)
            self.assertEqual(bytes(t.bytes).decode("utf-8", "replace"), t.token)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(t.top_logprobs[0].logprob, t.logprob, places=4)

    def test_stop_cuts_before_the_stop_string(self):
        c = client()
        full = c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=24).choices[0].message.content
        words = full.split()
        self.assertGreater(len(words), 2, full)
        stop = words[2]
        r = c.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=24, stop=[stop, "zzzz"])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[0].message.content, full[: full.index(stop)])

    def test_each_sampling_parameter_reaches_the_engine(self):
        # Each setting is checked by an effect only the engine can have: filters that
        # leave one token make a hot sampler greedy, penalties change a greedy answer.
        ask = [{"role": "user", "content": "Write the word apple many times."}]

        def texts(n=1, **kw):
            extra = kw.pop("extra", None)
            r = client().chat.completions.create(model=MODEL, messages=ask, max_tokens=16, n=n, extra_body=extra, **kw)
            return [c.message.content for c in r.choices]

        greedy = texts(temperature=0)[0]
        self.assertEqual(texts(temperature=0)[0], greedy)
        hot = dict(temperature=1.5, seed=11)
        self.assertNotEqual(texts(**hot)[0], greedy, "temperature")
        self.assertEqual(texts(**hot)[0], texts(**hot)[0], "seed")
        self.assertNotEqual(texts(temperature=1.5, seed=12)[0], texts(**hot)[0], "seed")
        self.assertEqual(texts(**hot, top_p=0.01)[0], greedy, "top_p")
        self.assertEqual(texts(**hot, extra={"top_k": 1})[0], greedy, "top_k")
        self.assertEqual(texts(**hot, extra={"min_p": 1.0})[0], greedy, "min_p")
        self.assertNotEqual(texts(temperature=0, frequency_penalty=2)[0], greedy, "frequency_penalty")
        self.assertNotEqual(texts(temperature=0, presence_penalty=2)[0], greedy, "presence_penalty")
        self.assertNotEqual(texts(temperature=0, extra={"repetition_penalty": 2.0})[0], greedy, "repetition_penalty")
        self.assertGreater(len(set(texts(n=4, temperature=1))), 1, "n samples independently")
        r = client().chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0, logprobs=True,
                                             logit_bias={"17": 100})
        tokens = [t.token for t in r.choices[0].logprobs.content]
        self.assertEqual(len(tokens), 4)
        self.assertEqual(len(set(tokens)), 1, f"logit_bias makes token 17 every token: {tokens}")

    def test_seed_reproduces_a_sampled_completion(self):
        ask = lambda seed: client().chat.completions.create(
            model=MODEL, messages=HELLO, temperature=1.0, seed=seed, max_tokens=16).choices[0].message.content
        self.assertEqual(ask(1234), ask(1234))

    def test_max_completion_tokens_bounds_the_reply(self):
        r = client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
            temperature=0, max_completion_tokens=5)
        self.assertEqual(r.usage.completion_tokens, 5)
        self.assertEqual(r.choices[0].finish_reason, "length")


class Completions(unittest.TestCase):
    def test_prompt_list_echo_and_logprobs(self):
        c = client()
        r = c.completions.create(model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], temperature=0, max_tokens=4)
        self.assertTrue(r.id.startswith("cmpl-"))
        self.assertEqual([ch.index for ch in r.choices], [0, 1])
        self.assertTrue(r.choices[0].text.startswith(" 4"), r.choices[0].text)
        echoed = c.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=4, echo=True)
        self.assertEqual(echoed.choices[0].text, "1, 2, 3," + r.choices[0].text)
        lp = c.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=4, logprobs=2)
        l = lp.choices[0].logprobs
        self.assertEqual(len(l.tokens), lp.usage.completion_tokens)
        self.assertEqual("".join(l.tokens), lp.choices[0].text)
        self.assertEqual(l.text_offset[0], 0)
        for top, logprob in zip(l.top_logprobs, l.token_logprobs):
            self.assertLessEqual(len(top), 3)
            self.assertAlmostEqual(max(top.values()), logprob, places=4)

    def test_echo_with_logprobs_scores_the_prompt(self):
        prompt = "The capital of France is Paris. The capital of Italy is"
        r = loose_client().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                        temperature=0)
        l, n_prompt = r.choices[0].logprobs, r.usage.prompt_tokens
        self.assertEqual(len(l.tokens), n_prompt + r.usage.completion_tokens)
        self.assertEqual("".join(l.tokens), r.choices[0].text)
        self.assertTrue(r.choices[0].text.startswith(prompt))
        self.assertEqual((l.token_logprobs[0], l.top_logprobs[0], l.text_offset[0]), (None, None, 0))
        for i in range(1, len(l.tokens)):
            self.assertEqual(l.text_offset[i], l.text_offset[i - 1] + len(l.tokens[i - 1]))
            self.assertLessEqual(l.token_logprobs[i], 0)
            self.assertIn(l.tokens[i], l.top_logprobs[i])
            self.assertLessEqual(len(l.top_logprobs[i]), 3)
        paris = l.tokens.index(" Paris")
        self.assertGreater(l.token_logprobs[paris], -4, "the model expects Paris there")
        # Only the prompt, scored: max_tokens 0.
        only = loose_client().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
        self.assertEqual(only.choices[0].text, prompt)
        self.assertEqual(only.usage.completion_tokens, 0)
        self.assertEqual(only.choices[0].logprobs.token_logprobs, l.token_logprobs[:n_prompt])
        # Streamed: the echo chunk carries the prompt's log-probabilities.
        chunks = list(loose_client().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                                  temperature=0, stream=True))
        streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        self.assertEqual(streamed, l.tokens)

    def test_vllm_prompt_logprobs_are_the_models_own(self):
        prompt = "1, 2, 3, 4, 5,"
        r = client().completions.create(model=MODEL, prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 0})
        scores = r.choices[0].model_extra["prompt_logprobs"]
        self.assertEqual(len(scores), r.usage.prompt_tokens)
        self.assertIsNone(scores[0])
        # With no alternatives asked, each position holds its own token alone.
        self.assertTrue(all(len(s) == 1 for s in scores[1:]), scores)
        ids = [int(next(iter(s))) for s in scores[1:]]
        wide = client().completions.create(model=MODEL, prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 2})
        for own, s in zip(ids, wide.choices[0].model_extra["prompt_logprobs"][1:]):
            self.assertIn(str(own), s)
            self.assertTrue(2 <= len(s) <= 3 and any(e["rank"] == 1 for e in s.values()), s)
        # A prompt token's score is the log-probability the model gives it when it is
        # generated after the same tokens (forced there by logit_bias: log-probabilities
        # are the model's own, before any bias).
        texts = loose_client().completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                            logprobs=0).choices[0].logprobs.tokens
        k = 5
        forced = client().completions.create(model=MODEL, prompt="".join(texts[:k]), max_tokens=1, logprobs=0,
                                             temperature=0, logit_bias={str(ids[k - 1]): 100})
        self.assertEqual(forced.usage.prompt_tokens, k)
        self.assertEqual(forced.choices[0].logprobs.tokens[0], texts[k])
        self.assertAlmostEqual(forced.choices[0].logprobs.token_logprobs[0], scores[k][str(ids[k - 1])]["logprob"],
                               places=3)
        chat = client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                                extra_body={"prompt_logprobs": 2})
        self.assertEqual(len(chat.model_extra["prompt_logprobs"]), chat.usage.prompt_tokens)
        chunks = list(client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, stream=True,
                                                       extra_body={"prompt_logprobs": 2}))
        streamed = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
        self.assertEqual(streamed, [chat.model_extra["prompt_logprobs"]], "once, in a chunk of its own")

    def test_vllm_sampling_extensions_as_benchmark_clients_send_them(self):
        # ignore_eos: exactly max_tokens, past the end of the turn that a strong bias
        # forces at once; without it the reply ends there.
        end = "2"  # SmolLM2's <|im_end|>
        ask = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, logit_bias={end: 100})
        self.assertEqual(client().chat.completions.create(**ask).usage.completion_tokens, 1)
        fixed = client().chat.completions.create(**ask, extra_body={"ignore_eos": True})
        self.assertEqual((fixed.usage.completion_tokens, fixed.choices[0].finish_reason), (12, "length"))
        # ... and kept in the text when special tokens are not skipped.
        shown = client().chat.completions.create(**ask, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                                   "spaces_between_special_tokens": False})
        self.assertEqual(shown.choices[0].message.content, "<|im_end|>" * 12)
        # min_tokens holds the end back; stop_token_ids ends on a token of our choosing.
        held = client().chat.completions.create(**ask, extra_body={"min_tokens": 5})
        self.assertEqual(held.usage.completion_tokens, 6)
        prompt = "1, 2, 3, 4, 5,"
        seven = client().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            extra_body={"stop_token_ids": [39]})  # "7"
        self.assertEqual((seven.choices[0].text, seven.choices[0].finish_reason), (" 6, ", "stop"))
        kept = client().completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=["8,"],
                                           extra_body={"include_stop_str_in_output": True})
        self.assertEqual(kept.choices[0].text, " 6, 7, 8,")
        # Streamed with ignore_eos, as vLLM's benchmark client sends it (read leniently:
        # a streamed choice's finish_reason is null until it finishes, see below).
        chunks = list(loose_client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}))
        self.assertEqual(chunks[-1].usage.completion_tokens, 24)
        # Strictly typed and bounded, in the API's own error shape.
        for extra, param in [({"ignore_eos": "yes"}, "ignore_eos"), ({"min_tokens": -1}, "min_tokens"),
                             ({"min_tokens": 13}, "min_tokens"), ({"stop_token_ids": [49152]}, "stop_token_ids[0]"),
                             ({"skip_special_tokens": 1}, "skip_special_tokens")]:
            with self.assertRaises(openai.BadRequestError) as e:
                client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, extra_body=extra)
            self.assertEqual(e.exception.body["param"], param, extra)

    def test_default_max_tokens_is_16_and_streams_end_with_usage(self):
        r = client().completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
        self.assertLessEqual(r.usage.completion_tokens, 16)
        # Not strict: the SDK types a streamed choice's finish_reason as non-null, yet
        # the API (OpenAI's and vLLM's alike) sends null until a choice finishes.
        lenient = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0)
        chunks = list(lenient.completions.create(
            model=MODEL, prompt="Once upon a time", temperature=0, stream=True, stream_options={"include_usage": True}))
        self.assertEqual("".join(ch.choices[0].text for ch in chunks if ch.choices), r.choices[0].text)
        self.assertEqual(chunks[-1].usage.completion_tokens, r.usage.completion_tokens)


class Responses(unittest.TestCase):
    def test_string_input(self):
        r = client().responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=16)
        self.assertEqual(r.status, "incomplete", "16 tokens cut this answer short")
        self.assertEqual(r.incomplete_details.reason, "max_output_tokens")
        self.assertTrue(r.id.startswith("resp_"))
        self.assertTrue(r.output_text)
        self.assertEqual(r.output[0].type, "message")
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens)

    def test_message_list_with_instructions(self):
        ask = [{"role": "user", "content": "What colour is the sky?"}]
        plain = client().responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=ask)
        r = client().responses.create(
            model=MODEL, instructions="Answer in one word.", temperature=0, max_output_tokens=8, input=ask)
        self.assertEqual(r.instructions, "Answer in one word.")
        self.assertTrue(r.output_text)
        # The instructions reach the prompt as its system message: the same prompt as a
        # chat request with that system message, token for token.
        chat = client().chat.completions.create(
            model=MODEL, temperature=0, max_tokens=8,
            messages=[{"role": "system", "content": "Answer in one word."}] + ask)
        self.assertGreater(r.usage.input_tokens, plain.usage.input_tokens + 4)
        self.assertEqual(r.usage.input_tokens, chat.usage.prompt_tokens)
        self.assertEqual(r.output_text, chat.choices[0].message.content)

    def test_streamed_events_through_the_helper(self):
        # A question the model answers in a few tokens, so the response completes (the
        # helper's get_final_response() requires response.completed).
        ask = dict(model=MODEL, input="What is 2+2?", temperature=0, max_output_tokens=64)
        plain = client().responses.create(**ask)
        self.assertEqual(plain.status, "completed")
        with client().responses.stream(**ask) as s:
            events = list(s)
            final = s.get_final_response()
        types = [e.type for e in events]
        self.assertEqual(types[:2], ["response.created", "response.in_progress"])
        self.assertEqual(types[-1], "response.completed")
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        self.assertEqual(deltas, final.output_text)
        self.assertEqual(final.output_text, plain.output_text)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0, le=100_000_000)


PRODUCT = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "minItems": 1, "maxItems": 3},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "note": {"type": "string", "maxLength": 30},
    },
    "required": ["sku", "tags", "price"],
    "additionalProperties": False,
}


class StructuredOutput(unittest.TestCase):
    """JSON output enforced while decoding: it parses and validates, whatever the model."""

    ASK = [{"role": "user", "content": "Describe a product as JSON."}]

    def test_json_schema_output_validates(self):
        for temperature in (0, 1):
            r = client().chat.completions.create(
                model=MODEL, messages=self.ASK, temperature=temperature, seed=7, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT, "strict": True}})
            self.assertEqual(r.choices[0].finish_reason, "stop")
            jsonschema.validate(json.loads(r.choices[0].message.content), PRODUCT)

    def test_parse_with_a_pydantic_model(self):
        r = client().chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], temperature=0,
            max_tokens=200, response_format=City)
        city = r.choices[0].message.parsed
        self.assertIsInstance(city, City)
        self.assertLessEqual(len(city.name), 24)

    def test_json_object_output_is_an_object(self):
        r = client().chat.completions.create(
            model=MODEL, messages=self.ASK, temperature=0, max_tokens=200, response_format={"type": "json_object"})
        self.assertIsInstance(json.loads(r.choices[0].message.content), dict)

    def test_streamed_json_schema_output_validates(self):
        stream = client().chat.completions.create(
            model=MODEL, messages=self.ASK, temperature=0, max_tokens=200, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT}})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), PRODUCT)

    def test_responses_text_format(self):
        r = client().responses.create(
            model=MODEL, input="Describe a product.", temperature=0, max_output_tokens=200,
            text={"format": {"type": "json_schema", "name": "product", "schema": PRODUCT}})
        self.assertEqual(r.status, "completed")
        jsonschema.validate(json.loads(r.output_text), PRODUCT)
        parsed = client().responses.parse(
            model=MODEL, input="Tell me about Rome.", temperature=0, max_output_tokens=200, text_format=City)
        self.assertIsInstance(parsed.output_parsed, City)

    def test_bad_formats_are_400s_naming_the_param(self):
        def create(fmt):
            return client().chat.completions.create(model=MODEL, messages=self.ASK, max_tokens=4, response_format=fmt)
        for fmt, code, param in [
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
             "invalid_value", "response_format"),
            ({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}},
             "invalid_value", "response_format.json_schema.name"),
            ({"type": "json_schema"}, "missing_required_parameter", "response_format.json_schema"),
            ({"type": "yaml"}, "invalid_value", "response_format.type"),
        ]:
            with self.assertRaises(openai.BadRequestError) as e:
                create(fmt)
            self.assertEqual((e.exception.code, e.exception.param), (code, param), e.exception)


WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_ARGS = {
    "type": "object",
    "properties": {"timezone": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME_ARGS}},
]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ARGS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class ToolCalling(unittest.TestCase):
    """Calls forced through a grammar always parse and match their function's schema."""

    def assert_valid_call(self, name, arguments):
        self.assertIn(name, ARGS)
        jsonschema.validate(json.loads(arguments), ARGS[name])

    def test_required_call_round_trip(self):
        r = client().chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
        c = r.choices[0]
        self.assertEqual(c.finish_reason, "tool_calls")
        self.assertGreaterEqual(len(c.message.tool_calls), 1)
        for call in c.message.tool_calls:
            self.assertTrue(call.id.startswith("call_"), call.id)
            self.assertEqual(call.type, "function")
            self.assert_valid_call(call.function.name, call.function.arguments)
        call = c.message.tool_calls[0]
        history = ASK_WEATHER + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"},
        ]
        answer = client().chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20)
        alone = client().chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=1)
        a = answer.choices[0]
        self.assertEqual(a.message.tool_calls, [])
        self.assertTrue(a.message.content)
        self.assertIn(a.finish_reason, ("stop", "length"))
        # The call and its result are in the second prompt.
        self.assertGreater(answer.usage.prompt_tokens, alone.usage.prompt_tokens + 20)

    def test_named_choice_calls_exactly_that_function_and_stops(self):
        r = client().chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=1, seed=3, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        c = r.choices[0]
        self.assertEqual(c.finish_reason, "stop")
        self.assertEqual([t.function.name for t in c.message.tool_calls], ["get_time"])
        self.assert_valid_call("get_time", c.message.tool_calls[0].function.arguments)

    def test_parallel_tool_calls_false_makes_one_call(self):
        r = client().chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=0, max_tokens=120)
        self.assertEqual(len(r.choices[0].message.tool_calls), 1)

    def test_streamed_calls_assemble_through_the_stream_helper(self):
        plain = client().chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
        with client().chat.completions.stream(
                model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0,
                max_tokens=120) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        c = final.choices[0]
        self.assertEqual(c.finish_reason, "tool_calls")
        got = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        want = [(t.function.name, t.function.arguments) for t in plain.choices[0].message.tool_calls]
        self.assertEqual(got, want)
        for t in c.message.tool_calls:
            self.assertTrue(t.id.startswith("call_"))

    def test_every_family_calls_in_its_own_format(self):
        # Thinking off on every model (rule 4, plus D's own switch), so the call comes
        # first; one call, as a small model may list calls until its budget runs out.
        off = {"thinking": False, "enable_thinking": False, "thinking_mode": "disabled"}
        for model in ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c", "vendor-d/model-d"]:
            body = dict(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0,
                        parallel_tool_calls=False, max_tokens=120, extra_body={"chat_template_kwargs": off})
            c = client().chat.completions.create(**body).choices[0]
            self.assertEqual(c.finish_reason, "tool_calls", model)
            self.assertIsNone(c.message.content, model)
            for call in c.message.tool_calls:
                self.assert_valid_call(call.function.name, call.function.arguments)
            chunks = [ch for ch in client().chat.completions.create(stream=True, **body) if ch.choices]
            streamed = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
            firsts = [t for t in streamed if t.id]
            self.assertEqual([(t.index, t.function.name) for t in firsts],
                             [(i, t.function.name) for i, t in enumerate(c.message.tool_calls)], model)
            self.assertTrue(all(t.function.arguments == "" for t in firsts), "arguments follow the first delta")

    def test_parse_with_a_strict_pydantic_tool(self):
        class GetWeather(pydantic.BaseModel):
            city: str = pydantic.Field(max_length=20)
            unit: str = pydantic.Field(pattern="^[CF]$")
        r = client().chat.completions.parse(
            model=MODEL, messages=ASK_WEATHER, tools=[openai.pydantic_function_tool(GetWeather)],
            tool_choice={"type": "function", "function": {"name": "GetWeather"}}, temperature=0, max_tokens=120)
        parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
        self.assertIsInstance(parsed, GetWeather)

    def test_responses_function_calls_and_their_outputs(self):
        r = client().responses.create(
            model=MODEL, input=ASK_WEATHER[0]["content"], tools=FLAT_TOOLS, tool_choice="required",
            temperature=0, max_output_tokens=120)
        calls = [o for o in r.output if o.type == "function_call"]
        self.assertGreaterEqual(len(calls), 1)
        for call in calls:
            self.assertTrue(call.call_id.startswith("call_") and call.id.startswith("fc_"))
            self.assert_valid_call(call.name, call.arguments)
        self.assertEqual(r.tools[0].name, "get_weather")
        follow = client().responses.create(
            model=MODEL, tools=FLAT_TOOLS, tool_choice="none", temperature=0, max_output_tokens=20,
            input=[{"role": "user", "content": ASK_WEATHER[0]["content"]},
                   {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                    "arguments": calls[0].arguments},
                   {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 degrees"}])
        self.assertTrue(follow.output_text)
        self.assertEqual([o.type for o in follow.output], ["message"])

    def test_responses_streamed_function_call_events(self):
        with client().responses.stream(
                model=MODEL, input=ASK_WEATHER[0]["content"], tools=FLAT_TOOLS,
                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                max_output_tokens=120) as stream:
            events = list(stream)
            final = stream.get_final_response()
        types = [e.type for e in events]
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        at = types.index("response.function_call_arguments.done")
        self.assertEqual(types[at - 2:at + 2], ["response.output_item.added", "response.function_call_arguments.delta",
                                                "response.function_call_arguments.done", "response.output_item.done"])
        call = [o for o in final.output if o.type == "function_call"]
        self.assertEqual(len(call), 1)
        self.assert_valid_call("get_weather", call[0].arguments)

    def test_bad_tool_requests_are_400s_naming_the_param(self):
        bad_name = [{"type": "function", "function": {"name": "get weather", "parameters": {}}}]
        for kwargs, param in [
            ({"tools": bad_name}, "tools[0].function.name"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}}, "tool_choice"),
            ({"parallel_tool_calls": False}, "parallel_tool_calls"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
              "tool_choice": "required"}, "tools"),
            ({"messages": ASK_WEATHER + [{"role": "tool", "tool_call_id": "call_x", "content": "?"}]},
             "messages[1].tool_call_id"),
        ]:
            body = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **kwargs}
            with self.assertRaises(openai.BadRequestError) as e:
                client().chat.completions.create(**body)
            self.assertEqual(e.exception.param, param, e.exception)


def reasoning_of(message_or_delta):
    return (message_or_delta.model_extra or {}).get("reasoning")


class Reasoning(unittest.TestCase):
    """Chain-of-thought goes to `reasoning`, never to `content`, and counts as output."""

    def test_thinking_on_by_default_fills_reasoning_not_content(self):
        # Model A's prompt opens <think>; cut off at 16 tokens, before its thinking
        # budget closes the block, every token is reasoning and the limit bounds them all.
        r = client().chat.completions.create(
            model=THINKING_MODEL, messages=HELLO, temperature=0, max_completion_tokens=16)
        m = r.choices[0].message
        self.assertTrue(reasoning_of(m))
        self.assertEqual(m.content, "")
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 16)
        self.assertEqual(r.usage.completion_tokens_details.reasoning_tokens, 16)

    def test_thinking_off_answers_in_content(self):
        for model, kwargs in [(THINKING_MODEL, {"thinking": False}), (TEXT_MODEL, {"enable_thinking": False}),
                              ("vendor-d/model-d", {"thinking_mode": "disabled"})]:
            r = client().chat.completions.create(
                model=model, messages=HELLO, temperature=0, max_completion_tokens=16,
                extra_body={"chat_template_kwargs": kwargs})
            m = r.choices[0].message
            self.assertIsNone(reasoning_of(m), model)
            self.assertTrue(m.content, model)
            self.assertEqual(r.usage.completion_tokens_details.reasoning_tokens, 0, model)

    def test_streamed_reasoning_matches_the_whole_reply(self):
        for model, kwargs in [(THINKING_MODEL, {}), (TEXT_MODEL, {"enable_thinking": False})]:
            body = dict(model=model, messages=HELLO, temperature=0, max_completion_tokens=16,
                        extra_body={"chat_template_kwargs": kwargs})
            whole = client().chat.completions.create(**body).choices[0].message
            chunks = list(client().chat.completions.create(stream=True, **body))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            self.assertEqual("".join(reasoning_of(d) or "" for d in deltas), reasoning_of(whole) or "", model)
            self.assertEqual("".join(d.content or "" for d in deltas), whole.content, model)

    def test_top_level_reasoning_effort_reaches_model_b(self):
        # "max" opens the reply in reasoning, "none" closes it: how many of the 8 tokens
        # the model spends reasoning is its own (7 on an H200's bf16, 8 on the CPU).
        r = client().chat.completions.create(
            model=TEXT_MODEL, messages=HELLO, temperature=0, max_completion_tokens=8, reasoning_effort="max")
        self.assertGreater(r.usage.completion_tokens_details.reasoning_tokens, 0)
        self.assertTrue(reasoning_of(r.choices[0].message))
        r = client().chat.completions.create(
            model=TEXT_MODEL, messages=HELLO, temperature=0, max_completion_tokens=8, reasoning_effort="none")
        self.assertEqual(r.usage.completion_tokens_details.reasoning_tokens, 0)
        self.assertIsNone(reasoning_of(r.choices[0].message))
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=TEXT_MODEL, messages=HELLO, reasoning_effort="extreme")
        self.assertEqual(e.exception.param, "reasoning_effort")

    def test_responses_reasoning_item(self):
        r = client().responses.create(model=THINKING_MODEL, input="Name three colours.", temperature=0,
                                      max_output_tokens=16)
        self.assertEqual(r.status, "incomplete")
        self.assertEqual([o.type for o in r.output], ["reasoning"])
        self.assertTrue(r.output[0].content[0].text)
        self.assertEqual(r.usage.output_tokens_details.reasoning_tokens, 16)
        # Cut off while thinking, the stream ends with response.incomplete (which the
        # SDK's stream helper does not accept as an end), so the raw events are read.
        events = list(client().responses.create(model=THINKING_MODEL, input="Name three colours.", temperature=0,
                                                max_output_tokens=16, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        self.assertEqual(text, r.output[0].content[0].text)
        self.assertEqual(events[-1].type, "response.incomplete")
        self.assertEqual(events[-1].response.output[0].content[0].text, text)


class ThinkingBudget(unittest.TestCase):
    """Reasoning ends in time for an answer: at its budget, when the model ends inside
    it, and early enough that a constrained answer still fits."""

    def test_every_thinking_model_reasons_then_answers_within_300_tokens(self):
        for model, kwargs in [(THINKING_MODEL, {}), (TEXT_MODEL, {}), ("vendor-d/model-d", {"thinking_mode": "enabled"})]:
            r = client().chat.completions.create(model=model, messages=HELLO, temperature=0, max_tokens=300,
                                                 extra_body={"chat_template_kwargs": kwargs})
            m = r.choices[0].message
            self.assertTrue((reasoning_of(m) or "").strip(), model)
            self.assertTrue(m.content.strip(), f"{model}: an answer after the reasoning: {m}")
            self.assertLessEqual(r.usage.completion_tokens, 300, model)
            self.assertGreater(r.usage.completion_tokens, r.usage.completion_tokens_details.reasoning_tokens, model)
        # D decides for itself by default: whatever it does, it answers.
        r = client().chat.completions.create(model="vendor-d/model-d", messages=HELLO, temperature=0, max_tokens=300)
        self.assertTrue(r.choices[0].message.content.strip())

    def test_each_name_of_the_budget_bounds_the_reasoning(self):
        ask = [{"role": "user", "content": "Explain in detail how a bicycle works."}]
        seen = set()
        for extra in [{"thinking_token_budget": 10}, {"thinking_budget": 10},
                      {"chat_template_kwargs": {"thinking_budget": 10}}]:
            r = client().chat.completions.create(model=THINKING_MODEL, messages=ask, temperature=0, max_tokens=80,
                                                 extra_body=extra)
            m = r.choices[0].message
            # Ten tokens of thought, then the closing marker's own (a few tokens).
            self.assertLessEqual(r.usage.completion_tokens_details.reasoning_tokens, 16, extra)
            self.assertTrue(m.content.strip(), extra)
            seen.add((reasoning_of(m), m.content))
        self.assertEqual(len(seen), 1, "the three names are one budget")
        unbounded = client().chat.completions.create(model=THINKING_MODEL, messages=ask, temperature=0, max_tokens=80,
                                                     extra_body={"thinking_budget": 1000})
        self.assertGreater(unbounded.usage.completion_tokens_details.reasoning_tokens, 16, "the budget is what ended it")
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=THINKING_MODEL, messages=ask, extra_body={"thinking_budget": -5})
        self.assertEqual(e.exception.param, "thinking_budget")

    def test_an_answer_that_cannot_fit_is_a_400_naming_the_limit(self):
        schema = {"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT}}
        for limit in ["max_tokens", "max_completion_tokens"]:
            with self.assertRaises(openai.BadRequestError) as e:
                client().chat.completions.create(model=THINKING_MODEL, messages=HELLO, response_format=schema,
                                                 **{limit: 6})
            self.assertEqual(e.exception.param, limit)
            self.assertIn("too few for any valid answer", e.exception.message)
        with self.assertRaises(openai.BadRequestError) as e:
            client().responses.create(model=MODEL, input="x", max_output_tokens=3,
                                      text={"format": {"type": "json_schema", "name": "p", "schema": PRODUCT}})
        self.assertEqual(e.exception.param, "max_output_tokens")

    def test_responses_on_a_thinking_model_give_reasoning_then_a_message(self):
        r = client().responses.create(model=THINKING_MODEL, input="Name three colours.", temperature=0,
                                      max_output_tokens=300)
        self.assertEqual(r.status, "completed")
        self.assertEqual([o.type for o in r.output], ["reasoning", "message"])
        self.assertTrue(r.output_text.strip())


ALL_MODELS = ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c", "vendor-d/model-d"]


class EveryModelConstrained(unittest.TestCase):
    """Structured output and forced calls on every model with its defaults: reasoning
    on A, B and (when it opens a block) D ends early enough for the answer."""

    def check(self, model, name, run):
        with self.subTest(model=model, check=name):
            run()

    def test_formats_and_forced_calls_on_every_model(self):
        ask = StructuredOutput.ASK
        for model in ALL_MODELS:
            def schema():
                r = client().chat.completions.create(
                    model=model, messages=ask, temperature=0, max_tokens=200,
                    response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT}})
                self.assertEqual(r.choices[0].finish_reason, "stop")
                jsonschema.validate(json.loads(r.choices[0].message.content), PRODUCT)

            def any_object():
                r = client().chat.completions.create(model=model, messages=ask, temperature=0, max_tokens=200,
                                                     response_format={"type": "json_object"})
                self.assertIsInstance(json.loads(r.choices[0].message.content), dict)

            def required():
                r = client().chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS,
                                                     tool_choice="required", temperature=0, max_tokens=120)
                calls = r.choices[0].message.tool_calls
                self.assertTrue(calls)
                for call in calls:
                    jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])

            def named():
                r = client().chat.completions.create(
                    model=model, messages=ASK_WEATHER, tools=TOOLS, temperature=1, seed=3, max_tokens=120,
                    tool_choice={"type": "function", "function": {"name": "get_time"}})
                self.assertEqual([c.function.name for c in r.choices[0].message.tool_calls], ["get_time"])

            def text_format():
                r = client().responses.create(
                    model=model, input="Describe a product.", temperature=0, max_output_tokens=200,
                    text={"format": {"type": "json_schema", "name": "product", "schema": PRODUCT}})
                self.assertEqual(r.status, "completed")
                jsonschema.validate(json.loads(r.output_text), PRODUCT)

            for name, run in [("json_schema", schema), ("json_object", any_object), ("required", required),
                              ("named", named), ("text.format", text_format)]:
                self.check(model, name, run)


# The catalog's prices in micro-dollars per million tokens: input, cache read, output.
PRICES = {"vendor-a/model-a": (700_000, 160_000, 3_500_000), "vendor-c/model-c": (110_000, 110_000, 350_000)}


def expected_cost(model, prompt, cached, completion):
    """The bill of a request, rounded once to the nearest micro-dollar."""
    inp, cache, out = PRICES[model]
    return ((prompt - cached) * inp + cached * cache + completion * out + 500_000) // 1_000_000


def balance(org="default"):
    return cli("credits", "show", "--org", org)["balance_micros"]


def usage_records(org="default"):
    return cli("usage", "list", "--org", org)


class Billing(unittest.TestCase):
    """Every request is paid for from credit exactly once, at the catalog's prices."""

    def test_each_request_is_charged_its_exact_cost_once(self):
        before = balance()
        r = client().chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=12)
        after = balance()
        record = usage_records()[0]
        self.assertEqual((record["prompt_tokens"], record["completion_tokens"]),
                         (r.usage.prompt_tokens, r.usage.completion_tokens))
        self.assertEqual(record["cached_tokens"], r.usage.prompt_tokens_details.cached_tokens)
        cost = expected_cost(MODEL, record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"])
        self.assertEqual(record["cost_micros"], cost)
        self.assertEqual(before - after, cost)
        self.assertEqual(cli("credits", "show", "--org", "default")["held_micros"], 0, "no hold left behind")

    def test_streamed_plain_and_cached_requests_cost_what_their_tokens_cost(self):
        ask = dict(model="vendor-a/model-a", messages=[{"role": "user", "content": "Count to five. " * 40}],
                   temperature=0, max_completion_tokens=10)
        client().chat.completions.create(**ask)
        list(client().chat.completions.create(stream=True, **ask))
        records = usage_records()[:2]
        self.assertEqual({r["endpoint"] for r in records}, {"chat.completions"})
        self.assertEqual(records[0]["completion_tokens"], records[1]["completion_tokens"])
        self.assertGreater(records[0]["cached_tokens"], 0, "the second request hit the prefix cache")
        for rec in records:
            self.assertEqual(rec["cost_micros"], expected_cost(
                rec["model"], rec["prompt_tokens"], rec["cached_tokens"], rec["completion_tokens"]), rec)

    def test_a_client_that_leaves_pays_for_what_was_generated(self):
        before = balance()
        stream = client().chat.completions.create(
            model=MODEL, messages=HELLO, temperature=0, max_tokens=200, stream=True)
        chunks = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
            if chunks == 3:
                break
        stream.close()
        # Settlement runs when the server notices the client is gone: wait for its record
        # (each look is a run of the operator command).
        deadline = time.monotonic() + 60
        records = []
        while not records and time.monotonic() < deadline:
            records = [r for r in usage_records() if r["finish_reason"] == "abandoned"]
        self.assertTrue(records, "the abandoned request was settled")
        rec = records[0]
        self.assertGreaterEqual(rec["completion_tokens"], 3)
        self.assertLess(rec["completion_tokens"], 200)
        self.assertGreater(rec["prompt_tokens"], 0)
        self.assertEqual(rec["cost_micros"], expected_cost(MODEL, rec["prompt_tokens"], rec["cached_tokens"],
                                                           rec["completion_tokens"]))
        self.assertEqual(before - balance(), rec["cost_micros"])
        self.assertEqual(cli("credits", "show", "--org", "default")["held_micros"], 0)

    def test_too_little_credit_is_refused_before_generation(self):
        org = cli("orgs", "create", "thrifty")["id"]
        key = cli("keys", "create", "--org", org, "--name", "k")["secret"]
        cli("credits", "grant", "--org", org, "--usd", "0.0001")
        with self.assertRaises(openai.RateLimitError) as e:
            client(key).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1000)
        self.assertEqual(e.exception.code, "insufficient_quota")
        self.assertEqual(e.exception.response.headers.get("x-should-retry"), "false")
        self.assertEqual(balance(org), 100, "nothing was taken")
        self.assertEqual(usage_records(org), [])
        # A request its credit covers runs.
        r = client(key).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        self.assertEqual(len(usage_records(org)), 1)
        self.assertEqual(balance(org), 100 - usage_records(org)[0]["cost_micros"])
        self.assertTrue(r.choices)


class RateLimits(unittest.TestCase):
    def test_an_organization_over_its_limit_gets_429s_it_can_retry_after(self):
        org = cli("orgs", "create", "hasty")["id"]
        key = cli("keys", "create", "--org", org, "--name", "k")["secret"]
        cli("orgs", "set-rate-limit", org, "--rpm", "600")
        ok = client(key).models.with_raw_response.list()
        self.assertEqual(ok.headers["x-ratelimit-limit-requests"], "600")
        self.assertIn("x-ratelimit-remaining-requests", ok.headers)

        def call(_):
            with client(key) as c:
                try:
                    c.models.list()
                    return None
                except openai.RateLimitError as e:
                    return e
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            refusals = [e for e in pool.map(call, range(60)) if e is not None]
        self.assertTrue(refusals, "60 requests at once exceed a burst of 20 at 10 a second")
        for e in refusals:
            self.assertEqual(e.code, "rate_limit_exceeded")
            self.assertEqual(e.type, "requests")
            self.assertGreaterEqual(int(e.response.headers["retry-after"]), 1)
        wait_ms = max(int(e.response.headers["retry-after-ms"]) for e in refusals)
        # The advertised wait is the contract under test: after it, the retry passes.
        time.sleep(wait_ms / 1000)
        client(key).models.list()

    def test_a_pooled_client_loses_no_request_to_an_early_answer(self):
        """10,000 chat requests over 16 pooled keep-alive connections (httpx, the SDK's
        own client), most refused with 429 before the server has read their bodies:
        each body follows its headers a moment later, as from a slow uploader. Every
        request gets an answer; none finds its pooled connection closed under it."""
        org = cli("orgs", "create", "pooled")["id"]
        key = cli("keys", "create", "--org", org, "--name", "k")["secret"]
        cli("credits", "grant", "--org", org, "--usd", "10")
        # 10 a second: a few hundred answered, the rest refused.
        cli("orgs", "set-rate-limit", org, "--rpm", "600")
        body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 1}).encode()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                   "Content-Length": str(len(body))}

        def later():
            # The client's pace, not synchronisation: headers go out first, and the
            # server answers a refusal before this body is there to read.
            time.sleep(0.002)
            yield body

        limits = httpx2.Limits(max_connections=16, max_keepalive_connections=16)
        with httpx2.Client(base_url=BASE_URL, limits=limits, timeout=120) as http:
            def send(_):
                try:
                    return http.post("/chat/completions", headers=headers, content=later()).status_code
                except httpx2.TransportError as e:
                    return repr(e)

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(send, range(10_000)))
        errors = [r for r in results if not isinstance(r, int)]
        self.assertEqual(errors[:5], [], f"{len(errors)} of 10,000 requests lost")
        counts = collections.Counter(results)
        self.assertEqual(set(counts), {200, 429}, counts)
        self.assertGreater(counts[200], 20, counts)
        self.assertGreater(counts[429], 5000, counts)



class Subscriptions(unittest.TestCase):
    """Personal keys billed to a plan's included usage, at the model's supply discount."""

    def personal_key(self, email, plan=None):
        user = cli("users", "create", email)
        if plan:
            cli("plans", "start", "--user", email, "--plan", plan)
        key = cli("keys", "create", "--org", user["org_id"], "--name", "p", "--billing", "subscription")["secret"]
        return user, key

    def test_a_plan_pays_for_requests_at_the_supply_discount(self):
        user, key = self.personal_key("sam@example.com")
        with self.assertRaises(openai.RateLimitError) as e:
            client(key).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
        self.assertEqual(e.exception.code, "insufficient_quota", "no plan yet")
        # Plans renew monthly: a one-time method is refused.
        with self.assertRaises(subprocess.CalledProcessError):
            cli("plans", "start", "--user", user["email"], "--plan", "basic", "--payment-method", "pm_dev_crypto")
        plan = cli("plans", "start", "--user", user["email"], "--plan", "basic")
        self.assertEqual((plan["paid_micros"], plan["included_micros"]), (10_000_000, 20_000_000))

        def in_effect():
            for m in cli("supply", "show")["models"]:
                if m["model"] == MODEL:
                    return m["multiplier_bp"], m["updated_at_us"]
            return None

        # The request pays the multiplier `supply show` reports for its model: read
        # before and after it, and taken when no new state was recorded in between.
        spent = 0
        for _ in range(5):
            before = in_effect()
            client(key).chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=8)
            rec = usage_records(user["org_id"])[0]
            spent += rec["cost_micros"]
            if before is not None and in_effect() == before:
                break
        else:
            self.fail("the supply state changed during every attempt")
        self.assertEqual(rec["funding"], "subscription")
        self.assertEqual(rec["multiplier_bp"], before[0], "the multiplier in effect")
        standard = expected_cost(MODEL, rec["prompt_tokens"], rec["cached_tokens"], rec["completion_tokens"])
        self.assertEqual(rec["cost_micros"], (standard * rec["multiplier_bp"] + 5_000) // 10_000)
        now = cli("plans", "show", "--user", user["email"])
        self.assertEqual((now["spent_micros"], now["held_micros"], now["in_flight"]), (spent, 0, 0))
        self.assertIsNotNone(now["window_5h"]["start"], "the first request started the windows")
        self.assertEqual(balance(user["org_id"]), 0, "credit untouched")

    def test_supply_states_follow_the_replicas_load(self):
        # The suite's server refreshes every two seconds: wait for a state per model.
        deadline = time.monotonic() + 60
        models = []
        while len(models) < 4 and time.monotonic() < deadline:
            models = cli("supply", "show")["models"]
        self.assertEqual(sorted(m["model"] for m in models),
                         ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c", "vendor-d/model-d"])
        spec = {"low": (0, 10_000), "medium": (25, 7_500), "high": (50, 5_000), "surplus": (75, 2_500)}
        for m in models:
            self.assertEqual((m["discount_percent"], m["multiplier_bp"]), spec[m["state"]], m)
            self.assertTrue(m["history"], m)
            self.assertEqual(m["history"][-1]["state"], m["state"])
            self.assertGreater(m["history"][-1]["samples"], 0, "computed from the replicas' load reports")

    def test_a_plan_runs_its_concurrency_and_refuses_more(self):
        user, key = self.personal_key("kim@example.com", plan="basic")
        count = [{"role": "user", "content": "Count from 1 to 300, one number per line."}]
        # Basic runs two at once. A streamed request is admitted when its response starts;
        # ignore_eos keeps both running until closed (a sampled end of turn freed a slot once).
        streams = [client(key).chat.completions.create(model=MODEL, messages=count, max_tokens=400, stream=True,
                                                       extra_body={"ignore_eos": True})
                   for _ in range(2)]
        try:
            with self.assertRaises(openai.RateLimitError) as e:
                client(key).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
            self.assertEqual(e.exception.code, "rate_limit_exceeded")
            self.assertIn("at most 2", e.exception.message)
            self.assertEqual(e.exception.response.headers["retry-after"], "1")
        finally:
            for s in streams:
                s.close()


class Models(unittest.TestCase):
    def test_list_and_retrieve(self):
        ids = sorted(m.id for m in client().models.list())
        self.assertEqual(ids, ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c", "vendor-d/model-d"])
        self.assertEqual(client().models.retrieve("vendor-c/model-c").id, "vendor-c/model-c")
        with self.assertRaises(openai.NotFoundError) as e:
            client().models.retrieve("vendor-c/nope")
        self.assertEqual(e.exception.code, "model_not_found")


class Errors(unittest.TestCase):
    def assert_error(self, cls, code, fn, param=None):
        with self.assertRaises(cls) as e:
            fn()
        self.assertEqual(e.exception.code, code, e.exception)
        if param is not None:
            self.assertEqual(e.exception.param, param)
        self.assertTrue(e.exception.message)
        return e.exception

    def chat(self, key=API_KEY, **kw):
        args = {"model": MODEL, "messages": HELLO, "max_tokens": 4, **kw}
        return lambda: client(key).chat.completions.create(**args)

    def test_keys(self):
        status, body = raw_post("/chat/completions", json.dumps({"model": MODEL, "messages": HELLO}).encode())
        self.assertEqual(status, 401)
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("didn't provide an API key", body["error"]["message"])
        self.assert_error(openai.AuthenticationError, "invalid_api_key", self.chat(key="tsk_not-a-key"))
        well_formed_unknown = cli("keys", "create", "--org", "default", "--name", "tmp")
        cli("keys", "revoke", well_formed_unknown["id"])
        self.assert_error(openai.AuthenticationError, "invalid_api_key", self.chat(key=well_formed_unknown["secret"]))

    def test_revocation_takes_effect_on_the_next_request(self):
        key = cli("keys", "create", "--org", "default", "--name", "short-lived")
        self.assertTrue(key["secret"].startswith("tsk_"))
        client(key["secret"]).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        listed = cli("keys", "list", "--org", "default")
        self.assertIn(key["id"], [k["id"] for k in listed])
        self.assertNotIn(key["secret"], json.dumps(listed))
        cli("keys", "revoke", key["id"])
        self.assert_error(openai.AuthenticationError, "invalid_api_key", self.chat(key=key["secret"]))

    def test_models_must_be_named_in_full(self):
        e = self.assert_error(openai.NotFoundError, "model_not_found", self.chat(model="model-c"))
        self.assertIn("`vendor-c/model-c`", e.message, "the id it most likely meant")
        e = self.assert_error(openai.NotFoundError, "model_not_found", self.chat(model="vendor-a/model-z"))
        self.assertNotIn("Did you mean", e.message, "no guess where nothing is close")
        self.assert_error(openai.NotFoundError, "model_not_found",
                          lambda: client().completions.create(model="model-a", prompt="x"))
        self.assert_error(openai.NotFoundError, "model_not_found",
                          lambda: client().responses.create(model="model-a", input="x"))

    def test_out_of_range_values_name_param_and_bound(self):
        e = self.assert_error(openai.BadRequestError, "decimal_above_max_value", self.chat(temperature=3), "temperature")
        self.assertIn("2", e.message)
        self.assert_error(openai.BadRequestError, "integer_above_max_value",
                          self.chat(logprobs=True, top_logprobs=21), "top_logprobs")
        self.assert_error(openai.BadRequestError, "decimal_below_min_value", self.chat(frequency_penalty=-3), "frequency_penalty")
        self.assert_error(openai.BadRequestError, "invalid_value",
                          self.chat(logit_bias={"99999999": 1}), "logit_bias")
        self.assert_error(openai.BadRequestError, "array_above_max_length", self.chat(stop=["a", "b", "c", "d", "e"]), "stop")
        self.assert_error(openai.BadRequestError, "integer_above_max_value",
                          lambda: client().completions.create(model=MODEL, prompt="x", logprobs=6), "logprobs")
        self.assert_error(openai.BadRequestError, "invalid_parameter_combination",
                          self.chat(max_completion_tokens=3))

    def test_too_many_completions_in_one_request(self):
        self.assert_error(openai.BadRequestError, "invalid_value",
                          lambda: client().completions.create(model=MODEL, prompt=["a", "b"], n=100), "n")
        self.assert_error(openai.BadRequestError, "integer_above_max_value", self.chat(n=129), "n")

    def test_responses_errors_name_the_input_item(self):
        bad = [{"role": "wizard", "content": "hi"}]
        self.assert_error(openai.BadRequestError, "invalid_value",
                          lambda: client().responses.create(model=MODEL, instructions="Be brief.", input=bad),
                          "input[0].role")

    def test_context_length_exceeded(self):
        long = "word " * 9000
        self.assert_error(openai.BadRequestError, "context_length_exceeded",
                          self.chat(messages=[{"role": "user", "content": long}]), "messages")
        self.assert_error(openai.BadRequestError, "context_length_exceeded", self.chat(max_tokens=10**9), "messages")
        self.assert_error(openai.BadRequestError, "context_length_exceeded",
                          lambda: client().completions.create(model=MODEL, prompt=long), "prompt")

    def test_images_on_a_text_only_model(self):
        image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
        e = self.assert_error(openai.BadRequestError, "unsupported_value", self.chat(model=TEXT_MODEL, messages=messages))
        self.assertIn("image", e.message)

    def test_bad_images_are_named_by_their_part_and_good_ones_need_vision_weights(self):
        # A 2x1 PNG, and bytes that are not an image, inline; internal addresses that
        # the server must not fetch (server-side request forgery).
        png = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAADUlEQVR4nGP4zwAE/wEHAAH/4iOeWQAAAABJRU5ErkJggg=="
        good = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}", "detail": "low"}}
        text = {"type": "text", "text": "What is this?"}

        def with_second(part):
            return [{"role": "user", "content": [text, good, part]}]
        bad = {
            "data:image/png;base64,aGVsbG8gd29ybGQ=": "not an image",
            f"data:image/png;base64,{png[:40]}": "cannot be decoded",
            "http://127.0.0.1:9/cat.png": "internal",
            "http://169.254.169.254/latest/meta-data/": "internal",
            "http://[::1]/cat.png": "internal",
            "file:///etc/passwd": "http(s) URL",
        }
        for url, words in bad.items():
            part = {"type": "image_url", "image_url": {"url": url}}
            e = self.assert_error(openai.BadRequestError, "invalid_value", self.chat(messages=with_second(part)),
                                  "messages[0].content[2].image_url")
            self.assertIn(words, e.message, url)
        # A readable image on a model whose spec takes images but whose bundled weights
        # are text-only: refused, naming the weights.
        e = self.assert_error(openai.BadRequestError, "unsupported_value",
                              self.chat(messages=[{"role": "user", "content": [text, good]}]),
                              "messages[0].content[1].image_url")
        self.assertIn("vision weights", e.message)
        self.assertIn("smollm2", e.message)
        item = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "http://10.1.2.3/x.png"}]}]
        e = self.assert_error(openai.BadRequestError, "invalid_value",
                              lambda: client().responses.create(model=MODEL, input=item),
                              "input[0].content[1].image_url")
        self.assertIn("internal", e.message)

    def test_malformed_json_and_unsupported_endpoints(self):
        status, body = raw_post("/chat/completions", b"{not json", API_KEY)
        self.assertEqual(status, 400)
        self.assertIn("parse the JSON body", body["error"]["message"])
        with self.assertRaises(openai.NotFoundError) as e:
            client().embeddings.create(model=MODEL, input="x")
        self.assertIn("not supported", e.exception.message)
        for path in ("/audio/speech", "/fine_tuning/jobs", "/assistants", "/batches", "/files"):
            status, body = raw_post(path, b"{}", API_KEY)
            self.assertEqual(status, 404, path)
            self.assertIn("not supported", body["error"]["message"])


if __name__ == "__main__":
    result = unittest.main(argv=[sys.argv[0], "-v"], exit=False).result
    sys.exit(0 if result.wasSuccessful() else 1)
